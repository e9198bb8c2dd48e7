"""Where each step went: the ``anatomy/*`` rows, read back from what the trackers wrote.

Real parts: a Logger writing JSONL and TensorBoard (read with TensorBoard's own reader), timers
around real sleeps, workers in separate processes whose snapshots are pickled to the driver, and
the NeMo RL and verl drop-ins' own timers.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from otel_rl import Logger
from otel_rl.distributed.worker import WorkerMetrics
from testkit.readers import anatomy_phases, rows_by_step, tensorboard_scalars


def test_nested_phases_and_untimed_add_up_to_the_step_wall_time(log_dir):
    sleeps = {"step": 0.04, "step/generation": 0.12, "step/generation/decode": 0.08,
              "step/reward": 0.06}  # fmt: skip
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True}
    with Logger(cfg) as logger:
        for step in range(4):
            begun = time.monotonic()
            with logger.timer("step"):
                time.sleep(sleeps["step"])
                with logger.timer("generation"):
                    time.sleep(sleeps["step/generation"])
                    with logger.timer("decode"):
                        time.sleep(sleeps["step/generation/decode"])
                with logger.timer("reward"):
                    time.sleep(sleeps["step/reward"])
            time.sleep(0.05)  # no timer: untimed
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            assert time.monotonic() - begun < 1.0
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert sorted(rows) == [0, 1, 2, 3]
    for step, row in rows.items():
        phases = anatomy_phases(row)
        assert set(phases) == set(sleeps)
        for path, slept in sleeps.items():
            # exclusive: a nested timer's time counts under its own path only
            assert slept <= phases[path] < slept + 0.03, (step, path, phases[path])
        wall = row["anatomy/wall/seconds"]
        total = sum(phases.values()) + row["anatomy/untimed/seconds"]
        assert abs(total - wall) <= 0.01 * wall
        assert row["anatomy/untimed/seconds"] >= 0.05
        # the inclusive timing rows stay as they were: generation includes decode
        assert row["timing/generation"] == pytest.approx(
            phases["step/generation"] + phases["step/generation/decode"], abs=0.005
        )
        assert row["anatomy/critical/step/generation/seconds"] == phases["step/generation"]
    # the path is text only where it changes: at the first step here
    assert rows[0]["anatomy/critical_path"] == "driver:step/generation"
    assert all("anatomy/critical_path" not in rows[s] for s in (1, 2, 3))
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert [s for s, _ in scalars["anatomy/step/reward/seconds"]] == [0, 1, 2, 3]
    assert scalars["anatomy/wall/seconds"][2][1] == pytest.approx(rows[2]["anatomy/wall/seconds"])


def test_a_step_ends_at_its_last_call_and_a_timer_open_across_it_is_split(log_dir):
    """The time after a step's last call belongs to the next step, even inside one timer."""
    with Logger({"log_dir": str(log_dir)}) as logger, logger.timer("epoch"):
        time.sleep(0.1)
        logger.log_metrics({"x": 0.0}, step=0, step_finished=True)
        time.sleep(0.2)
        logger.log_metrics({"x": 1.0}, step=1, step_finished=True)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert 0.1 <= rows[0]["anatomy/epoch/seconds"] < 0.13
    assert 0.2 <= rows[1]["anatomy/epoch/seconds"] < 0.23
    assert rows[1]["anatomy/untimed/seconds"] < 0.01


def _worker(rank: int, seconds: float, out: multiprocessing.Queue) -> None:
    worker = WorkerMetrics(rank=rank, role="rollout")
    with worker.timer("vllm_generate"):
        time.sleep(seconds)
        with worker.timer("detokenize"):
            time.sleep(0.02)
    worker.record("tokens", 100.0, reduce="sum")
    out.put(worker.snapshot(step=0))


def test_worker_roles_get_busy_fractions_their_busiest_rank_and_the_critical_path(log_dir):
    seconds = {0: 0.1, 1: 0.1, 2: 0.4}
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("generation"):
            workers = [context.Process(target=_worker, args=(r, s, queue))
                       for r, s in seconds.items()]  # fmt: skip
            for process in workers:
                process.start()
            snapshots = [queue.get(timeout=60) for _ in workers]
            for process in workers:
                process.join(10)
        logger.log_worker_metrics(snapshots, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    wall = row["anatomy/wall/seconds"]
    # the median rank spent ~0.12 s in its own timers
    assert row["anatomy/rollout/busy_fraction"] == pytest.approx(0.12 / wall, rel=0.25)
    assert row["anatomy/rollout/busiest_rank"] == 2.0
    assert 0.4 <= row["anatomy/critical/rollout/vllm_generate/seconds"] < 0.45
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
    for step in range(2):
        with timer.time("total_step_time"):
            with timer.time("generation"):
                time.sleep(0.1)
            with marked_timer("update_actor", timing_raw):
                time.sleep(0.05)
        logger.log_metrics({"loss": 1.0}, step=step)
    logger.finish()
    found = sorted(log_dir.rglob("metrics.jsonl"))
    assert found, list(log_dir.rglob("*"))
    rows = rows_by_step(found[0].parent / "metrics.jsonl")
    for step in (0, 1):
        phases = anatomy_phases(rows[step])
        assert 0.1 <= phases["total_step_time/generation"] < 0.13
        assert 0.05 <= phases["total_step_time/update_actor"] < 0.08


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

        search(30)
        logger.log_metrics({"x": 1.0}, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    assert anatomy_phases(row) == {"search": pytest.approx(0.31, abs=0.05)}


def test_steps_logged_from_another_thread_than_the_timers_have_wall_and_untimed_only(log_dir):
    """The anatomy is the logging thread's: timers elsewhere are in their timing rows only."""
    import threading

    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("generation"):
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
    assert anatomy_phases(rows[0]) == {"generation": pytest.approx(0.05, abs=0.02)}
    assert anatomy_phases(rows[1]) == {}
    assert rows[1]["timing/reward"] >= 0.05
    assert rows[1]["anatomy/untimed/seconds"] == rows[1]["anatomy/wall/seconds"] >= 0.05


def test_another_thread_logging_into_a_step_keeps_the_training_threads_phases(log_dir):
    """An evaluation thread logs into the step after the training thread's own call: the step's
    phases are still the training thread's (the first thread that logged)."""
    import threading

    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(3):
            with logger.timer("generation"):
                time.sleep(0.05)
            logger.log_metrics({"loss": 1.0}, step=step)
            evaluation = threading.Thread(
                target=lambda s=step: logger.log_metrics({"eval/score": 0.5}, step=s)
            )
            evaluation.start()
            evaluation.join()
    for step, row in rows_by_step(log_dir / "metrics.jsonl").items():
        assert anatomy_phases(row) == {"generation": pytest.approx(0.05, abs=0.02)}, step
        assert row["eval/score"] == 0.5


def test_timers_named_like_the_anatomys_own_rows_are_renamed_not_mixed_in(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        with logger.timer("untimed"):
            time.sleep(0.05)
        with logger.timer("critical"), logger.timer("wall"):
            time.sleep(0.03)
        logger.log_metrics({"x": 1.0}, step=0)
    row = rows_by_step(log_dir / "metrics.jsonl")[0]
    assert anatomy_phases(row) == {
        "untimed_timer": pytest.approx(0.05, abs=0.02),
        "critical_timer": pytest.approx(0.0, abs=0.01),
        "critical_timer/wall": pytest.approx(0.03, abs=0.02),
    }
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
