"""A timer's forms beyond a plain block: the decorator on generator and coroutine functions, and
one traced timer object used by two threads at once."""

from __future__ import annotations

import asyncio
import threading
import time

from otel_rl import Logger
from testkit.readers import rows_by_step, trace_file_spans


def test_a_decorated_generator_or_coroutine_is_timed_from_its_first_step_to_its_end(tmp_path):
    """Not the instant its call makes the generator or coroutine (that took microseconds: the
    rows said ~6 µs for 30 ms of work)."""
    with Logger({"log_dir": str(tmp_path)}) as logger:

        @logger.timer("items")
        def items():
            for i in range(3):
                time.sleep(0.01)
                yield i

        @logger.timer("wait")
        async def wait():
            await asyncio.sleep(0.05)
            return "done"

        @logger.timer("stream")
        async def stream():
            for i in range(2):
                await asyncio.sleep(0.02)
                yield i

        async def consume():
            return [i async for i in stream()]

        assert list(items()) == [0, 1, 2]
        assert asyncio.run(wait()) == "done"
        assert asyncio.run(consume()) == [0, 1]
        logger.log_metrics({"loss": 1.0}, step=0)
    row = rows_by_step(tmp_path / "metrics.jsonl")[0]
    assert 0.03 <= row["timing/items"] < 1.0
    assert 0.05 <= row["timing/wait"] < 1.0
    assert 0.04 <= row["timing/stream"] < 1.0
    assert items.__name__ == "items" and wait.__name__ == "wait"


def test_one_traced_timer_used_by_two_threads_at_once_gives_each_its_own_span(tmp_path):
    """Each thread's use ends its own span (they were swapped: a 10 ms use ended the span of a
    200 ms one on the other thread, and OpenTelemetry could not detach their contexts)."""
    cfg = {"log_dir": str(tmp_path), "tracing": {"enabled": True, "picture": False}}
    with Logger(cfg) as logger:
        shared = logger.timer("shared")
        short_inside = threading.Event()

        def long_use():
            short_inside.wait(5)
            with shared:
                time.sleep(0.2)

        def short_use():
            with shared:
                short_inside.set()
                time.sleep(0.01)

        threads = [threading.Thread(target=long_use, name="long"),
                   threading.Thread(target=short_use, name="short")]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        logger.log_metrics({"loss": 1.0}, step=0)
    seconds = {}
    for _, span in trace_file_spans(tmp_path):
        if span.name == "shared":
            thread = next(kv.value.string_value for kv in span.attributes
                          if kv.key == "thread.name")  # fmt: skip
            seconds[thread] = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert set(seconds) == {"long", "short"}
    assert seconds["long"] >= 0.2 and seconds["short"] < 0.15


def test_two_calls_of_a_traced_coroutine_awaiting_at_once_each_end_their_own_span(
    tmp_path, caplog
):
    """Two tasks on one thread in one decorated coroutine, the long one started while the short
    one awaits, the short one ending first: each call's span lasts its own call."""
    cfg = {"log_dir": str(tmp_path), "tracing": {"enabled": True, "picture": False}}
    with Logger(cfg) as logger:

        @logger.timer("fetch")
        async def fetch(seconds: float) -> float:
            await asyncio.sleep(seconds)
            return seconds

        async def both() -> list[float]:
            short = asyncio.ensure_future(fetch(0.05))
            await asyncio.sleep(0.01)
            long = asyncio.ensure_future(fetch(0.2))
            return [await short, await long]

        assert asyncio.run(both()) == [0.05, 0.2]
        logger.log_metrics({"loss": 1.0}, step=0)
    seconds = sorted((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
                     for _, span in trace_file_spans(tmp_path) if span.name == "fetch")  # fmt: skip
    # Each call ends its own span's scope (OpenTelemetry could not detach them otherwise). The
    # phase clock closes the latest use of a name on a thread, and counts a use inside an open
    # one of the same name in that one: the two calls are one use, from the first's start to
    # the last's end, as the clock keeps its stacks by thread, not by task
    # (docs/configuration.md#keys).
    assert len(seconds) == 2 and seconds[1] >= 0.2 and 0.2 <= sum(seconds) < 0.4
    assert "Failed to detach context" not in caplog.text


def test_a_timed_function_that_calls_itself_counts_its_time_once(tmp_path):
    """The outermost call's seconds hold the inner calls': the row is the time spent in the
    function, not the sum over the depth of the recursion (fib(5) summed 3x its wall time);
    the same for a timer reopened deeper inside another (``a`` > ``b`` > ``a``) and for a
    worker's timer. Each call is still a span of its own."""
    from otel_rl import WorkerMetrics

    worker = WorkerMetrics(role="actor", rank=0)
    with Logger({"log_dir": str(tmp_path)}) as logger:

        @logger.timer("fib")
        def fib(n):
            time.sleep(0.002)
            return n if n < 2 else fib(n - 1) + fib(n - 2)

        began = time.perf_counter()
        assert fib(5) == 5
        fib_wall = time.perf_counter() - began
        began = time.perf_counter()
        with logger.timer("a"), logger.timer("b"), logger.timer("a"):
            time.sleep(0.02)
        nested_wall = time.perf_counter() - began

        @worker.timer("walk")
        def walk(depth):
            time.sleep(0.005)
            if depth:
                walk(depth - 1)

        began = time.perf_counter()
        walk(3)
        walk_wall = time.perf_counter() - began
        logger.log_worker_metrics([worker.snapshot()], step=0)
        logger.log_metrics({"loss": 1.0}, step=0)
    row = rows_by_step(tmp_path / "metrics.jsonl")[0]
    assert 0.015 * 2 <= row["timing/fib"] <= fib_wall  # 15 calls of 2 ms at least, one count
    assert 0.02 <= row["timing/a"] <= nested_wall and 0.02 <= row["timing/b"] <= row["timing/a"]
    assert 0.02 <= row["timing/walk"] <= walk_wall
    fib_spans = [span for _, span in trace_file_spans(tmp_path) if span.name == "fib"]
    assert len(fib_spans) == 15
