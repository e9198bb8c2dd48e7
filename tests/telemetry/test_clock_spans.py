"""One clock: a timer is recorded once, on the phase clock; its row, its spans on disk and the
operator outputs' histograms are derived from that record (docs/tracing.md#spans-on-disk,
docs/architecture.md). Real Loggers, the trace file read back with OpenTelemetry's own OTLP
JSON messages, TensorBoard's own reader, a real Prometheus endpoint."""

from __future__ import annotations

import io
import threading
import time
import urllib.request

import pytest

from otel_rl import Logger
from otel_rl.run import picture
from otel_rl.telemetry.timing import TimingInstruments
from testkit.readers import rows_by_step, tensorboard_accumulator, trace_file_spans


def _spans(log_dir):
    """``{span id: (name, trace id, parent id, seconds, attributes)}`` of the trace file."""
    out = {}
    for _, span in trace_file_spans(log_dir):
        attributes = {kv.key: kv.value.string_value if kv.value.string_value is not None
                      else kv.value.int_value for kv in span.attributes}  # fmt: skip
        seconds = (int(span.end_time_unix_nano) - int(span.start_time_unix_nano)) / 1e9
        out[span.span_id] = (span.name, span.trace_id, span.parent_span_id or None, seconds,
                             attributes)  # fmt: skip
    return out


def test_the_default_config_leaves_every_timers_span_on_disk_and_the_picture_in_tensorboard(
    tmp_path,
):
    log_dir = tmp_path / "run"
    helper_ident = []
    with Logger({"log_dir": str(log_dir), "tensorboard_enabled": True}) as logger:
        for step in range(6):
            with logger.timer("generation"):
                time.sleep(0.002 * (step + 1))
            with logger.timer("train"), logger.timer("forward"):
                time.sleep(0.001)
            if step == 2:  # a timer on another thread is on disk too, on its own thread

                def reward():
                    helper_ident.append(threading.get_ident())
                    with logger.timer("reward"):
                        time.sleep(0.001)

                worker = threading.Thread(target=reward, name="reward-thread")
                worker.start()
                worker.join()
            if step == 3:  # a timer around two steps' calls keeps its inner timer's trace
                with logger.timer("epoch"):
                    logger.log_metrics({"loss": 1.0}, step=step)
                    with logger.timer("inner"):
                        time.sleep(0.001)
                    logger.log_metrics({"loss": 1.0}, step=step + 1)
                continue
            logger.log_metrics({"loss": 1.0}, step=step)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    spans = _spans(log_dir)
    steps = {attrs["rl.step"]: (trace, span_id)
             for span_id, (name, trace, _, _, attrs) in spans.items()
             if name == "rl.step"}  # fmt: skip
    assert sorted(steps) == [0, 1, 2, 3, 4, 5]
    assert len({trace for trace, _ in steps.values()}) == 6  # one trace per step
    by_name: dict[str, list] = {}
    for span_id, (name, trace, parent, seconds, attrs) in spans.items():
        by_name.setdefault(name, []).append((span_id, trace, parent, seconds, attrs))
    # every timer use is a span, a child of its step's span, lasting exactly the row's value
    assert len(by_name["generation"]) == 6
    for _, trace, parent, seconds, attrs in by_name["generation"]:
        step = next(s for s, (t, _) in steps.items() if t == trace)
        assert parent == steps[step][1]
        assert seconds == pytest.approx(rows[step]["timing/generation"], abs=2e-6)
        assert attrs["thread.id"] == threading.get_ident()
    trains = {span_id: trace for span_id, trace, *_ in by_name["train"]}
    for _, trace, parent, _, _ in by_name["forward"]:  # nested: under train, in its trace
        assert trains[parent] == trace
    [(_, _, reward_parent, _, reward_attrs)] = by_name["reward"]
    assert reward_attrs["thread.id"] == helper_ident[0]
    assert reward_attrs["thread.name"] == "reward-thread"
    assert reward_parent == steps[2][1]
    [(epoch_id, epoch_trace, epoch_parent, epoch_seconds, _)] = by_name["epoch"]
    [(_, inner_trace, inner_parent, _, _)] = by_name["inner"]
    assert (epoch_trace, epoch_parent) == steps[3]  # opened during step 3
    assert (inner_trace, inner_parent) == (epoch_trace, epoch_id)  # closed in step 4, still in it
    # its row: the step of the next call (step 4's, logged again in the loop's next turn)
    assert epoch_seconds == pytest.approx(rows[4]["timing/epoch"], abs=2e-6)
    assert "trace_id" not in rows[0]  # by default the rows stay as logged

    images = tensorboard_accumulator(log_dir / "tensorboard").Images(picture.PAGE_NAME)
    assert [image.step for image in images] == [5]
    from PIL import Image

    png = Image.open(io.BytesIO(images[0].encoded_image_string))
    assert png.format == "PNG" and png.width >= 800


def test_a_loop_without_timers_has_no_trace_file_and_no_picture(tmp_path):
    with Logger({"log_dir": str(tmp_path), "tensorboard_enabled": True}) as logger:
        for step in range(3):
            logger.log_metrics({"loss": 1.0}, step=step)
    assert not (tmp_path / "traces.jsonl").exists()
    assert not tensorboard_accumulator(tmp_path / "tensorboard").Tags()["images"]


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip


def test_timings_wait_for_the_outputs_within_a_bound_and_the_rest_are_counted(
    tmp_path, monkeypatch, caplog
):
    """Prometheus gets every timing when it scrapes; one never scraped keeps the newest
    ``PENDING`` (a smaller bound here, the same code), the rest counted and said once."""
    monkeypatch.setattr(TimingInstruments, "PENDING", 1_000)
    cfg = {"log_dir": str(tmp_path), "prometheus": {"enabled": True, "port": 0}}
    with Logger(cfg) as logger:
        timer = logger.timer("generation")
        for step in range(3):
            for _ in range(500):
                with timer:
                    pass
            logger.log_metrics({"x": 1.0}, step=step)
        first = _scrape(logger.prometheus_url)
        for _ in range(10):
            with timer:
                pass
        logger.log_metrics({"x": 1.0}, step=3)
        second = _scrape(logger.prometheus_url)
    assert first["timing_generation_seconds_count"] == 1_000
    assert first["otel_rl_timings_dropped_total"] == 500
    assert second["timing_generation_seconds_count"] == 1_010
    assert second["otel_rl_timings_dropped_total"] == 500
    said = [r for r in caplog.records if "timings waited for Prometheus/OTLP" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.slow  # 200,000 spans made and written
def test_more_timer_uses_than_the_bound_between_two_calls_are_said_once(tmp_path, caplog):
    """Between two ``log_metrics`` calls a timer factory keeps the newest ``SPAN_RECORDS`` uses
    (so a loop that stops logging, or times after ``finish()``, holds bounded memory), said once;
    the spans are taken by the trace file's thread as they come, and whatever it could not take
    in time is said once too."""
    from otel_rl.telemetry.timing import SPAN_RECORDS

    uses = SPAN_RECORDS + 10
    tracing = {"picture": False, "file_max_mb": 1024}  # every span kept: none rotated away
    with Logger({"log_dir": str(tmp_path), "tracing": tracing}) as logger:
        timer = logger.timer("tick")
        for step in range(2):
            for _ in range(uses):
                with timer:
                    pass
            logger.log_metrics({"x": 1.0}, step=step)
    said = [r.getMessage() for r in caplog.records if "times or more" in r.getMessage()]
    assert sum("timing/* rows" in m for m in said) == 1, said
    spans_said = sum("have spans" in m for m in said)
    assert spans_said <= 1, said
    ticks = [span for span in _spans(tmp_path).values() if span[0] == "tick"]
    if spans_said:
        assert SPAN_RECORDS <= len(ticks) < 2 * uses
    else:
        assert len(ticks) == 2 * uses
    rows = rows_by_step(tmp_path / "metrics.jsonl")
    assert all(rows[step]["timing/tick"] > 0 for step in range(2))


def test_the_uses_pushed_out_of_the_clocks_record_are_counted_exactly_and_only_its_own():
    """The loss is worked out by the reader from the clock's counts (no check per timer close):
    nothing lost is nothing said, past the bound exactly the uses pushed out, and a record the
    clock stopped feeding (its last run ended) is not charged with the uses of the next one."""
    from otel_rl.telemetry.timing import SPAN_RECORDS, PhaseClock

    clock = PhaseClock()
    records = clock.record_spans()
    for _ in range(5):
        clock.open("a")
        clock.close("a")
    assert records.pushed_out(clock.recorded) == 0
    for _ in range(3):
        records.popleft()
    records.taken += 3
    assert records.pushed_out(clock.recorded) == 0
    for _ in range(SPAN_RECORDS + 7):
        clock.open("a")
        clock.close("a")
    assert len(records) == SPAN_RECORDS
    assert records.pushed_out(clock.recorded) == 2 + 7  # the 2 left, then 7 more past the bound
    clock.stop_spans(records)
    newer = clock.record_spans()
    assert newer is not records
    for _ in range(50):
        clock.open("b")
        clock.close("b")
    assert records.pushed_out(clock.recorded) == 9 and newer.pushed_out(clock.recorded) == 0


def test_a_use_taken_after_its_step_was_written_joins_that_steps_trace(tmp_path):
    """A timer on another thread can read the clock's epoch just before the training thread
    ends it, and append its record only after the trace file's thread wrote that step. The
    interleaving is made here by appending the record the clock would have appended (no
    scheduler can be told to switch there): the span is in its step's trace all the same."""
    from otel_rl.telemetry.clock_spans import ClockSpans
    from otel_rl.telemetry.timing import PhaseClock
    from otel_rl.telemetry.trace_file import TraceFile

    clock = PhaseClock()
    trace_file = TraceFile(tmp_path, 1 << 24)
    spans = ClockSpans(trace_file, {"service.name": "t"}, clock=clock)
    clock.open("rollout")
    clock.close("rollout")
    epoch = clock._epoch
    spans.take(7)
    spans.seal(7)
    first = list(spans.spans())
    assert [s[0] for s in first] == ["rl.step", "rollout"]
    trace_id, step_span = first[0][1], first[0][2]
    spans._closed.append(("late", 1.0, 2.0, 1, "worker", 99, 0, epoch, epoch))
    clock.recorded += 1
    spans.take(8)
    spans.seal(8)
    (late,) = list(spans.spans())  # step 8 timed nothing: only the late use
    assert late[0] == "late" and late[1] == trace_id and late[3] == step_span
    spans.close()
    trace_file.shutdown()


def test_flush_puts_the_spans_of_the_steps_sealed_so_far_on_disk(tmp_path):
    """The trace file's thread writes every half second; ``flush()`` does not wait for it:
    after it returns, each step logged so far has its spans in ``traces.jsonl``."""
    with Logger({"log_dir": str(tmp_path), "tracing": {"picture": False}}) as logger:
        for step in range(3):
            with logger.timer("generation"):
                pass
            logger.log_metrics({"x": float(step)}, step=step)
        logger.flush()
        spans = _spans(tmp_path).values()
        steps = sorted(a["rl.step"] for name, _, _, _, a in spans if name == "rl.step")
        assert steps == [0, 1, 2]
        assert sum(1 for span in spans if span[0] == "generation") == 3



@pytest.mark.parametrize("sdk", [False, True], ids=["clock", "sdk"])
def test_two_loggers_in_one_process_each_keep_the_spans_of_their_own_steps(tmp_path, sdk):
    """A training Logger and an evaluation Logger side by side, one thread: the process's
    clock feeds both (or, with ``tracing.enabled``, each has its SDK tracer), and each one's
    trace file has the spans of the timers of its own steps, each in its step's trace, none of
    the other's and none lost."""
    steps = 5
    tracing = {"picture": False, **({"enabled": True} if sdk else {})}
    first = Logger({"log_dir": str(tmp_path / "train"), "tracing": tracing})
    second = Logger({"log_dir": str(tmp_path / "eval"), "tracing": tracing})
    for step in range(steps):
        with first.timer("rollout"):
            time.sleep(0.001)
        first.log_metrics({"loss": float(step)}, step=step, step_finished=True)
        with second.timer("score"):
            time.sleep(0.001)
        second.log_metrics({"accuracy": float(step)}, step=step, step_finished=True)
    first.finish()
    second.finish()
    for folder, timer in (("train", "rollout"), ("eval", "score")):
        spans = _spans(tmp_path / folder)
        step_of = {
            trace: attributes["rl.step"]
            for name, trace, _, _, attributes in spans.values()
            if name == "rl.step"
        }
        timed = sorted(step_of[trace] for name, trace, _, _, _ in spans.values() if name == timer)
        assert {name for name, *_ in spans.values()} == {"rl.step", timer}, folder
        assert timed == list(range(steps)), folder
