"""Where each step went: the ``anatomy/*`` rows, read back from what the trackers wrote.

Real parts: a Logger writing JSONL and TensorBoard (read with TensorBoard's own reader), timers
around real sleeps, workers in separate processes whose snapshots are pickled to the driver, and
the NeMo RL and verl drop-ins' own timers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest

from otel_rl import Logger
from otel_rl.distributed.worker import WorkerMetrics
from testkit.readers import anatomy_phases, rows_by_step, tensorboard_scalars


class Brackets:
    """The test's own clock read around each timed block: before entering and after leaving it
    (``outer``), and just inside it (``inner``). The phase clock reads its own between those, so
    a phase lies between the two however long a loaded machine took over the sleeps: the bounds
    hold on any machine, and a phase counted twice or in the wrong place still falls outside
    them by whole sleeps."""

    def __init__(self) -> None:
        self.inner: dict[str, float] = {}
        self.outer: dict[str, float] = {}

    @contextlib.contextmanager
    def around(self, path: str, timer: Any) -> Iterator[None]:
        before = time.monotonic()
        with timer:
            entered = time.monotonic()
            yield
            leaving = time.monotonic()
        self.inner[path] = self.inner.get(path, 0.0) + leaving - entered
        self.outer[path] = self.outer.get(path, 0.0) + time.monotonic() - before

    def exclusive(self, path: str, children: tuple[str, ...] = ()) -> tuple[float, float]:
        """The bounds of ``path``'s own time: its block less its children's blocks."""
        low = self.inner[path] - sum(self.outer[c] for c in children)
        high = self.outer[path] - sum(self.inner[c] for c in children)
        return low - EPS, high + EPS


#: Float rounding of the sums; nothing to do with time.
EPS = 1e-6


def test_nested_phases_and_untimed_add_up_to_the_step_wall_time(log_dir):
    sleeps = {"step": 0.04, "step/generation": 0.12, "step/generation/decode": 0.08,
              "step/reward": 0.06}  # fmt: skip
    children = {"step": ("step/generation", "step/reward"),
                "step/generation": ("step/generation/decode",)}  # fmt: skip
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True}
    brackets: dict[int, Brackets] = {}
    with Logger(cfg) as logger:
        for step in range(4):
            b = brackets[step] = Brackets()
            with b.around("step", logger.timer("step")):
                time.sleep(sleeps["step"])
                with b.around("step/generation", logger.timer("generation")):
                    time.sleep(sleeps["step/generation"])
                    with b.around("step/generation/decode", logger.timer("decode")):
                        time.sleep(sleeps["step/generation/decode"])
                with b.around("step/reward", logger.timer("reward")):
                    time.sleep(sleeps["step/reward"])
            time.sleep(0.05)  # no timer: untimed
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert sorted(rows) == [0, 1, 2, 3]
    for step, row in rows.items():
        phases = anatomy_phases(row)
        assert set(phases) == set(sleeps)
        for path, slept in sleeps.items():
            # exclusive: a nested timer's time counts under its own path only
            low, high = brackets[step].exclusive(path, children.get(path, ()))
            assert max(slept, low) <= phases[path] <= high, (step, path, phases[path], low, high)
        wall = row["anatomy/wall/seconds"]
        total = sum(phases.values()) + row["anatomy/untimed/seconds"]
        assert abs(total - wall) <= 0.01 * wall
        assert row["anatomy/untimed/seconds"] >= 0.05
        # the inclusive timing rows stay as they were: generation includes decode (the timer's
        # own reads lie inside the phase clock's)
        inclusive = phases["step/generation"] + phases["step/generation/decode"]
        assert brackets[step].inner["step/generation"] - EPS <= row["timing/generation"]
        assert row["timing/generation"] <= inclusive + EPS
        assert row["anatomy/critical/step/generation/seconds"] == phases["step/generation"]
    # the path is text only where it changes: at the first step here
    assert rows[0]["anatomy/critical_path"] == "driver:step/generation"
    assert all("anatomy/critical_path" not in rows[s] for s in (1, 2, 3))
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert [s for s, _ in scalars["anatomy/step/reward/seconds"]] == [0, 1, 2, 3]
    assert scalars["anatomy/wall/seconds"][2][1] == pytest.approx(rows[2]["anatomy/wall/seconds"])


def test_a_step_ends_at_its_last_call_and_a_timer_open_across_it_is_split(log_dir):
    """The time after a step's last call belongs to the next step, even inside one timer."""
    with Logger({"log_dir": str(log_dir)}) as logger:
        before = time.monotonic()
        with logger.timer("epoch"):
            time.sleep(0.1)
            ending = time.monotonic()
            logger.log_metrics({"x": 0.0}, step=0, step_finished=True)
            ended = time.monotonic()
            time.sleep(0.2)
            logger.log_metrics({"x": 1.0}, step=1, step_finished=True)
            last = time.monotonic()
    rows = rows_by_step(log_dir / "metrics.jsonl")
    # step 0 ends inside its last call, and step 1 starts there
    assert 0.1 <= rows[0]["anatomy/epoch/seconds"] <= ended - before + EPS
    assert 0.2 <= rows[1]["anatomy/epoch/seconds"] <= last - ending + EPS
    assert rows[1]["anatomy/untimed/seconds"] < 0.01


def _worker(rank: int, seconds: float, out: Any, slow_in: Any, fast_out: list) -> None:
    """Rank 2's block holds the others' (they enter once it is in; it leaves once they are out),
    so it is the busiest however the machine schedules the three processes."""
    worker = WorkerMetrics(rank=rank, role="rollout")
    b = Brackets()
    if rank != 2:
        slow_in.wait(60)
    with b.around("vllm_generate", worker.timer("vllm_generate")):
        if rank == 2:
            slow_in.set()
        time.sleep(seconds)
        with b.around("detokenize", worker.timer("detokenize")):
            time.sleep(0.02)
        if rank == 2:
            assert all(done.wait(60) for done in fast_out)
    if rank != 2:
        fast_out[rank].set()
    worker.record("tokens", 100.0, reduce="sum")
    out.put((worker.snapshot(step=0), b.inner, b.outer))


def test_worker_roles_get_busy_fractions_their_busiest_rank_and_the_critical_path(log_dir):
    seconds = {0: 0.1, 1: 0.1, 2: 0.4}
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    slow_in, fast_out = context.Event(), [context.Event(), context.Event()]
    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("generation"):
            workers = [context.Process(target=_worker, args=(r, s, queue, slow_in, fast_out))
                       for r, s in seconds.items()]  # fmt: skip
            for process in workers:
                process.start()
            sent = [queue.get(timeout=60) for _ in workers]
            for process in workers:
                process.join(10)
        logger.log_worker_metrics([snapshot for snapshot, _, _ in sent], step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    wall = row["anatomy/wall/seconds"]
    brackets = {}
    for snapshot, inner, outer in sent:
        b = brackets[snapshot["rank"]] = Brackets()
        b.inner, b.outer = inner, outer
    # the median rank's time in its own timers (its outermost block), over the step
    busy = row["anatomy/rollout/busy_fraction"] * wall
    low = sorted(b.inner["vllm_generate"] for b in brackets.values())[1]
    high = sorted(b.outer["vllm_generate"] for b in brackets.values())[1]
    assert low - EPS <= busy <= high + EPS
    assert row["anatomy/rollout/busiest_rank"] == 2.0
    low, high = brackets[2].exclusive("vllm_generate", ("detokenize",))
    assert max(0.4, low) <= row["anatomy/critical/rollout/vllm_generate/seconds"] <= high
    assert row["anatomy/critical_path"] == "driver:generation > rollout rank 2:vllm_generate"
    assert row["tokens"] == 300.0


def test_the_drop_ins_timers_are_phases_too(log_dir):
    from otel_rl.compat.nemo_rl import Logger as NemoLogger
    from otel_rl.compat.nemo_timer import Timer as NemoTimer
    from otel_rl.compat.verl_timing import marked_timer

    logger = NemoLogger({"log_dir": str(log_dir), "wandb_enabled": False,
                         "tensorboard_enabled": False, "mlflow_enabled": False,
                         "swanlab_enabled": False, "monitor_gpus": False,
                         "jsonl_enabled": True})  # fmt: skip
    timer = NemoTimer()
    timing_raw: dict[str, float] = {}
    brackets: dict[int, Brackets] = {}
    for step in range(2):
        b = brackets[step] = Brackets()
        with timer.time("total_step_time"):
            with b.around("generation", timer.time("generation")):
                time.sleep(0.1)
            with b.around("update_actor", marked_timer("update_actor", timing_raw)):
                time.sleep(0.05)
        logger.log_metrics({"loss": 1.0}, step=step)
    logger.finish()
    found = sorted(log_dir.rglob("metrics.jsonl"))
    assert found, list(log_dir.rglob("*"))
    rows = rows_by_step(found[0].parent / "metrics.jsonl")
    for step in (0, 1):
        phases = anatomy_phases(rows[step])
        high = brackets[step].exclusive("generation")[1]
        assert 0.1 <= phases["total_step_time/generation"] <= high
        high = brackets[step].exclusive("update_actor")[1]
        assert 0.05 <= phases["total_step_time/update_actor"] <= high


def test_a_run_without_timers_has_no_anatomy_and_the_option_turns_it_off(log_dir):
    with Logger({"log_dir": str(log_dir / "plain")}) as logger:
        for step in range(3):
            logger.log_metrics({"loss": 1.0}, step=step)
    assert all(not any(k.startswith("anatomy/") for k in row)
               for row in rows_by_step(log_dir / "plain" / "metrics.jsonl").values())  # fmt: skip
    with Logger({"log_dir": str(log_dir / "off"), "anatomy": False}) as logger:
        for step in range(3):
            with logger.timer("generation"):
                time.sleep(0.01)
            logger.log_metrics({"loss": 1.0}, step=step)
    rows = rows_by_step(log_dir / "off" / "metrics.jsonl")
    assert all("timing/generation" in row for row in rows.values())
    assert all(not any(k.startswith("anatomy/") for k in row) for row in rows.values())


def test_the_applications_own_anatomy_key_wins(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("generation"):
            time.sleep(0.01)
        logger.log_metrics({"anatomy/wall/seconds": -1.0}, step=0)
    assert rows_by_step(log_dir / "metrics.jsonl")[0]["anatomy/wall/seconds"] == -1.0


def test_a_timed_function_that_calls_itself_is_one_phase(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:

        @logger.timer("search")
        def search(depth: int) -> None:
            time.sleep(0.01)
            if depth:
                search(depth - 1)

        before = time.monotonic()
        search(30)
        took = time.monotonic() - before
        logger.log_metrics({"x": 1.0}, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    # one phase of the outermost call's time: 31 sleeps, each counted once
    assert list(anatomy_phases(row)) == ["search"]
    assert 0.31 <= anatomy_phases(row)["search"] <= took + EPS


def test_steps_logged_from_another_thread_than_the_timers_have_wall_and_untimed_only(log_dir):
    """The anatomy is the logging thread's: timers elsewhere are in their timing rows only."""
    import threading

    b = Brackets()
    with Logger({"log_dir": str(log_dir)}) as logger:
        with b.around("generation", logger.timer("generation")):
            time.sleep(0.05)
        logger.log_metrics({"x": 0.0}, step=0)

        def elsewhere() -> None:
            with logger.timer("reward"):
                time.sleep(0.05)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        logger.log_metrics({"x": 1.0}, step=1)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert list(anatomy_phases(rows[0])) == ["generation"]
    assert 0.05 <= anatomy_phases(rows[0])["generation"] <= b.exclusive("generation")[1]
    assert anatomy_phases(rows[1]) == {}
    assert rows[1]["timing/reward"] >= 0.05
    assert rows[1]["anatomy/untimed/seconds"] == rows[1]["anatomy/wall/seconds"] >= 0.05


def test_another_thread_logging_into_a_step_keeps_the_training_threads_phases(log_dir):
    """An evaluation thread logs into the step after the training thread's own call: the step's
    phases are still the training thread's (the first thread that logged)."""
    import threading

    brackets: dict[int, Brackets] = {}
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(3):
            b = brackets[step] = Brackets()
            with b.around("generation", logger.timer("generation")):
                time.sleep(0.05)
            logger.log_metrics({"loss": 1.0}, step=step)
            evaluation = threading.Thread(
                target=lambda s=step: logger.log_metrics({"eval/score": 0.5}, step=s)
            )
            evaluation.start()
            evaluation.join()
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert sorted(rows) == [0, 1, 2]
    for step, row in rows.items():
        # the training thread's timer only, as long as its block: nothing of the other thread
        assert list(anatomy_phases(row)) == ["generation"], step
        high = brackets[step].exclusive("generation")[1]
        assert 0.05 <= anatomy_phases(row)["generation"] <= high, step
        assert row["eval/score"] == 0.5


def test_timers_named_like_the_anatomys_own_rows_are_renamed_not_mixed_in(log_dir):
    b = Brackets()
    with Logger({"log_dir": str(log_dir)}) as logger:
        with b.around("untimed", logger.timer("untimed")):
            time.sleep(0.05)
        with b.around("critical", logger.timer("critical")), b.around("wall", logger.timer("wall")):
            time.sleep(0.03)
        logger.log_metrics({"x": 1.0}, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    phases = anatomy_phases(row)
    assert sorted(phases) == ["critical_timer", "critical_timer/wall", "untimed_timer"]
    assert 0.05 <= phases["untimed_timer"] <= b.exclusive("untimed")[1]
    low, high = b.exclusive("critical", ("wall",))
    assert max(0.0, low) <= phases["critical_timer"] <= high
    assert 0.03 <= phases["critical_timer/wall"] <= b.exclusive("wall")[1]
    total = sum(anatomy_phases(row).values()) + row["anatomy/untimed/seconds"]
    assert total == pytest.approx(row["anatomy/wall/seconds"], rel=1e-9)
    assert row["anatomy/critical/untimed_timer/seconds"] == row["anatomy/untimed_timer/seconds"]


def test_paths_are_at_most_eight_names_deep(log_dir):
    """Two timed functions that call each other: the path stops growing at eight names."""
    with Logger({"log_dir": str(log_dir)}) as logger:

        @logger.timer("ping")
        def ping(depth: int) -> None:
            if depth:
                pong(depth - 1)

        @logger.timer("pong")
        def pong(depth: int) -> None:
            time.sleep(0.001)
            if depth:
                ping(depth - 1)

        ping(200)
        logger.log_metrics({"x": 1.0}, step=0)
    phases = anatomy_phases(rows_by_step(log_dir / "metrics.jsonl")[0])
    deepest = max(phases, key=lambda path: path.count("/"))
    assert deepest == "/".join(["ping", "pong"] * 4)
    assert phases[deepest] >= 0.09  # the 100 sleeps at depth 8 and below


def test_a_step_mostly_untimed_has_untimed_as_its_critical_link_even_beside_a_timer_of_that_name(
    log_dir,
):
    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("untimed"):
            time.sleep(0.02)
        time.sleep(0.1)
        logger.log_metrics({"x": 1.0}, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    assert row["anatomy/critical/untimed/seconds"] == row["anatomy/untimed/seconds"] >= 0.1
    assert "anatomy/critical/untimed_timer/seconds" not in row
    assert row["anatomy/critical_path"] == "driver:untimed"
