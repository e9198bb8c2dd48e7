"""Nothing of otel-rl runs after ``finish()`` returns: the job-state publisher, the delivery
process's status and log readers and the signals' re-send thread have all ended, and the job's
board says the process finished, so a stall verdict of the job's other processes tells a rank
that ended from one that went silent. Each run is a fresh Python process (threads from other
tests' Loggers would otherwise share it), on the default config with a real delivery process
where asked, and its state on the job's real directory board."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_rl.timeline.run_picture import load_run
from otel_rl.watch.job_state import SILENT_AFTER, DirectoryBoard, JobStates
from otel_rl.watch.job_verdict import job_verdict
from testkit.servers import free_port

_RUN = textwrap.dedent("""
    import json, sys, threading, time
    from otel_rl import Logger

    log_dir, delivery, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    worker = extra.pop("worker", None)
    if worker:  # a worker of the driver's own process, made before its Logger
        from otel_rl import WorkerMetrics
        worker = WorkerMetrics(role="actor", rank=0)
    logger = Logger({"log_dir": log_dir, "tensorboard_enabled": True,
                     "export": {"delivery": delivery, "shutdown_timeout": 5}, **extra})
    for step in range(5):
        with logger.timer("generation"):
            time.sleep(0.01)
        if worker:
            with worker.timer("rollout"):
                worker.record("reward", float(step))
            logger.log_worker_metrics([worker.snapshot()], step=step)
        logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
    time.sleep(1.5)  # the job-state publisher has published once (a second after its start)
    logger.finish()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("otel-rl")]
    print(json.dumps({"alive": alive, "ended": time.time(),
                      "undelivered": {d.name: d.undelivered for d in logger.exporters}}))
""")


def _run(log_dir: Path, delivery: str, **extra: object) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", _RUN, str(log_dir), delivery, json.dumps(extra)],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_after_finish_no_thread_of_otel_rl_is_alive_and_the_board_says_the_run_ended(
    tmp_path, delivery
):
    out = _run(tmp_path / "logs", delivery)
    assert out["alive"] == []
    # The job's board (WORLD_SIZE 2: a directory of the shared log_dir) holds the last state,
    # published at finish(): it says when the process ended, and where it was.
    (state,) = DirectoryBoard(tmp_path / "logs" / "job", started=0.0).read()[0]
    assert state.step == 4 and state.ended is not None
    assert out["ended"] - 30 < state.ended <= out["ended"]
    assert state.published >= state.ended


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_with_a_tracker_that_is_down_nothing_of_otel_rl_runs_after_finish(tmp_path, delivery):
    """MLflow on a port nobody listens on, whose SDK would retry a refused connection for
    minutes inside one call: the tracker tries a connection before it calls the SDK, so its
    worker (or the delivery process) stops at the deadline, its records stay in the spool, and
    no thread of otel-rl is left in the training process."""
    pytest.importorskip("mlflow")
    down = f"http://127.0.0.1:{free_port()}"
    out = _run(tmp_path / "logs", delivery, mlflow_enabled=True,
               mlflow={"tracking_uri": down, "experiment_name": "down"})  # fmt: skip
    assert out["alive"] == []
    assert out["undelivered"]["mlflow"] >= 5 and out["undelivered"]["tensorboard"] == 0


def test_a_worker_of_the_driver_s_process_does_not_keep_its_publisher_after_finish(tmp_path):
    """A ``WorkerMetrics`` made in the driver's process (before its Logger) publishes through the
    process's one publisher; the Logger's ``finish()`` still ends it: nothing of otel-rl runs
    after, and the board says the process ended, at the Logger's last step; the worker's rows
    reached the run at their steps."""
    out = _run(tmp_path / "logs", "thread", worker=True)
    assert out["alive"] == []
    (state,) = DirectoryBoard(tmp_path / "logs" / "job", started=0.0).read()[0]
    assert state.step == 4 and state.ended is not None
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").open()]
    rewards = {r["step"]: r["metrics"]["reward"] for r in rows if "reward" in r["metrics"]}
    assert rewards == {step: float(step) for step in range(5)}


def test_the_publisher_runs_until_the_last_logger_of_the_process_finished(tmp_path):
    """Two Loggers in one process share its publisher: the first to finish leaves it running
    for the other, and the board says nothing ended until the second finished."""
    script = textwrap.dedent("""
        import json, sys, threading, time
        from otel_rl import Logger
        from otel_rl.watch.job_state import DirectoryBoard

        def publishing():
            return any(t.name == "otel-rl-job-state" for t in threading.enumerate())

        root = sys.argv[1]
        first, second = (Logger({"log_dir": f"{root}/{name}"}) for name in ("a", "b"))
        first.log_metrics({"loss": 1.0}, step=0)
        time.sleep(1.5)
        first.finish()
        after_first = publishing()
        time.sleep(0.5)
        states = DirectoryBoard(__import__("pathlib").Path(f"{root}/b/job"), started=0.0).read()[0]
        second.finish()
        print(json.dumps({"after_first": after_first, "after_second": publishing(),
                          "ended_before": [s.ended for s in states]}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"after_first": True, "after_second": False, "ended_before": [None]}


def test_a_process_that_finished_is_said_to_have_ended_not_to_have_gone_silent(tmp_path):
    """Long after a process finished (past the time a silent one is named), the verdict says it
    finished its run, when and after which step, and does not count it as not heard from."""
    _run(tmp_path / "logs", "thread")
    found = JobStates()
    found.states = DirectoryBoard(tmp_path / "logs" / "job", started=0.0).read()[0]
    (state,) = found.states
    assert state.ended is not None
    verdict = job_verdict(found, now=state.ended + 10 * SILENT_AFTER)
    assert verdict.not_heard_from == []
    (ended,) = verdict.ended
    assert ended["pid"] == state.pid and ended["step"] == 4
    assert f"(pid {state.pid} on {state.node}) finished its run at " in verdict.sentence
    assert verdict.sentence.endswith(f"({10 * SILENT_AFTER:.0f} s ago), after step 4"), (
        verdict.sentence
    )
    assert verdict.to_json()["ended"] == verdict.ended
    # The run's page says it too, where it lists where the job's processes were.
    (places,) = load_run(tmp_path / "logs").places
    (row,) = places.processes
    assert row[1] == "4" and row[2].endswith(f"finished its run at {ended['ended']}"), row


def test_a_state_written_before_ended_existed_still_reads_as_silent(tmp_path):
    """An older otel-rl's state has no ``ended``: it reads, and a silent one is named as such."""
    board = tmp_path / "job"
    board.mkdir()
    old = {"pid": 7, "node": "n1", "role": "process", "rank": None, "step": 3, "published": 1000.0,
           "every": 5.0}  # fmt: skip
    (board / "n1_7.json").write_text(json.dumps(old))
    os.utime(board / "n1_7.json", (2000.0, 2000.0))
    found = JobStates()
    found.states = DirectoryBoard(board, started=0.0).read()[0]
    (state,) = found.states
    assert state.ended is None
    verdict = job_verdict(found, now=1000.0 + 10 * SILENT_AFTER)
    assert verdict.ended == [] and len(verdict.not_heard_from) == 1
