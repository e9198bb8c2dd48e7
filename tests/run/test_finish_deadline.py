"""One deadline for the end of a run: ``finish()`` (and exit) return within
``export.shutdown_timeout`` + 1 s whatever hangs, and what was not delivered is replayable.

The hung parts are real sockets that accept connections and never answer (a rollout engine,
a Ray node's metrics endpoint, the OTel Collector for metrics and traces), plus the
``faultfile`` tracker stuck in a write (no real tracker SDK hangs on demand; see
``tests/faults/fault_tracker.py``).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.exporters import TrackerExporter
from otel_rl.process.deadline import Deadline, stop_in_parallel
from testkit.readers import jsonl_rows
from tests.faults.fault_tracker import env_with_faultfile, read_rows, set_mode

REPLAY = [sys.executable, "-m", "otel_rl.cli", "replay"]
SHUTDOWN_TIMEOUT = 2.0
STEPS = 20


def _silent_endpoint() -> socket.socket:
    """A port whose connections are accepted by the kernel and never answered."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    return server


def _child(tmp_path: Path, ports: dict[str, int], ending: str, delivery: str) -> str:
    ends = {
        "finish": "logger.finish()",
        "atexit": "pass  # the interpreter's exit ends the run",
    }
    return textwrap.dedent(f"""
        import logging, sys, time
        from otel_rl import Logger
        from tests.faults.fault_tracker import set_mode
        logging.basicConfig()
        control = {str(tmp_path / "control")!r}
        cfg = {{
            "log_dir": {str(tmp_path / "logs")!r},
            "jsonl_enabled": True,
            "trackers": {{"faultfile": {{"path": {str(tmp_path / "rows.jsonl")!r},
                                         "control": control}}}},
            "monitor_gpus": True,
            "gpu_monitoring": {{"endpoints": ["127.0.0.1:{ports["gpu"]}"],
                                "collection_interval": 0.5, "flush_interval": 0.5}},
            "rollout_monitoring": {{"endpoints": ["127.0.0.1:{ports["rollout"]}"],
                                    "collection_interval": 0.5}},
            "otlp": {{"enabled": True, "endpoint": "http://127.0.0.1:{ports["collector"]}",
                      "interval": 0.5}},
            "tracing": {{"enabled": True}},
            "export": {{"shutdown_timeout": {SHUTDOWN_TIMEOUT}, "fsync_interval": 0.1,
                        "delivery": {delivery!r}}},
        }}
        set_mode(control, "ok")
        logger = Logger(cfg)
        for step in range({STEPS}):
            if step == {STEPS // 2}:
                set_mode(control, "slow 1000")  # the tracker hangs in its next write
            with logger.timer("timing/step"):
                logger.log_metrics({{"loss": float(step)}}, step=step)
        time.sleep(1.0)  # every hung part is now waiting on its socket or its write
        print("ENDING", time.monotonic(), file=sys.stderr, flush=True)
        {ends[ending]}
        print("ENDED", time.monotonic(), file=sys.stderr, flush=True)
    """)


@pytest.mark.slow
@pytest.mark.serial  # the whole process's exit within the second after the deadline
@pytest.mark.parametrize("delivery", ["thread", "process"])
@pytest.mark.parametrize("ending", ["finish", "atexit"])
def test_everything_hung_at_once_still_ends_the_run_within_the_timeout(tmp_path, ending, delivery):
    """A tracker, a rollout endpoint, a GPU endpoint and the collector hang at once: the run
    ends within ``shutdown_timeout`` + 1 s (about 15 s before there was one deadline), the exit
    message counts what was not delivered and names what was left stopping, and replay then
    delivers every step exactly once. With ``export.delivery: process`` the tracker hangs in the
    delivery process, which says the same."""
    servers = {name: _silent_endpoint() for name in ("rollout", "gpu", "collector")}
    ports = {name: s.getsockname()[1] for name, s in servers.items()}
    env = env_with_faultfile(tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _child(tmp_path, ports, ending, delivery)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        exited = time.monotonic()  # the same clock as the child's on Linux
    finally:
        for server in servers.values():
            server.close()
    assert done.returncode == 0, done.stderr
    ending_at = float(done.stderr.split("ENDING ", 1)[1].split()[0])
    assert exited - ending_at < SHUTDOWN_TIMEOUT + 1.0, done.stderr
    if ending == "finish":
        ended_at = float(done.stderr.split("ENDED ", 1)[1].split()[0])
        assert ended_at - ending_at < SHUTDOWN_TIMEOUT + 1.0, done.stderr
    assert "faultfile: " in done.stderr and "not delivered before the shutdown timeout" in (
        done.stderr
    )
    assert f"(export.shutdown_timeout: {SHUTDOWN_TIMEOUT:g} s;" in done.stderr
    late = done.stderr.split("without waiting for: ", 1)[1].split(". ", 1)[0].split(", ")
    assert "tracing" in late  # the tracker gave up and closed, in whichever process it ran:
    assert not [part for part in late if part.startswith(("tracker", "delivery process"))]

    set_mode(tmp_path / "control", "ok")
    out = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_rows(tmp_path / "rows.jsonl")
    losses = [(step, row["loss"]) for step, row in rows if "loss" in row]
    assert losses == [(step, float(step)) for step in range(STEPS)]


def test_stop_in_parallel_waits_for_the_quick_names_the_late_and_survives_a_failure(caplog):
    release = threading.Event()
    stopped = []
    parts = [
        ("quick", lambda: stopped.append("quick")),
        ("hung", release.wait),
        ("broken", lambda: 1 / 0),
        ("slow", lambda: (time.sleep(0.2), stopped.append("slow"))),
    ]
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        started = time.monotonic()
        late = stop_in_parallel(parts, time.monotonic() + 0.6)
        waited = time.monotonic() - started
    release.set()
    assert late == ["hung"]
    assert sorted(stopped) == ["quick", "slow"]
    assert 0.55 < waited < 2.0
    assert [r.getMessage() for r in caplog.records] == [
        "otel-rl: broken: stopping failed: ZeroDivisionError: division by zero"
    ]


def test_a_deadline_shares_its_time_and_never_goes_negative():
    deadline = Deadline(10.0)
    first = deadline.share(0.5)
    assert 4.9 < first.left() <= 5.0
    assert first.at < deadline.at
    assert Deadline(-3).left() == 0.0
    passed = Deadline(0.0)
    assert passed.share(0.5).left() == 0.0


class _Tracker(TrackerExporter):
    """A tracker in memory whose writes and close take as long as the test says."""

    name = "held"

    def __init__(self, name: str, write_s: float = 0.0, close_hangs: bool = False) -> None:
        self.name = name
        self.write_s = write_s
        self.release = threading.Event()
        self.close_hangs = close_hangs
        self.steps: list[int] = []
        self.closed_with: int | None = None
        super().__init__()

    def write_step(self, step, rows, batch) -> None:
        time.sleep(self.write_s)
        self.steps.append(step)

    def close(self, exit_code: int) -> None:
        if self.close_hangs:
            self.release.wait()
        self.closed_with = exit_code


def test_a_second_finish_waits_for_the_first_to_end_the_run(tmp_path):
    """finish() from a daemon thread, then from the main thread (as atexit does): the second
    returns only once the run has ended, never in the middle of the first one's drain."""
    tracker = _Tracker("paced", write_s=0.05)
    cfg = {"log_dir": str(tmp_path), "jsonl_enabled": False, "stalls": {"enabled": False}}
    logger = Logger(cfg, exporters=[tracker])
    for step in range(20):
        logger.log_metrics({"x": float(step)}, step=step)
    first = threading.Thread(target=logger.finish, daemon=True)
    first.start()
    time.sleep(0.1)  # the first one is draining (20 writes of 0.05 s)
    logger.finish()
    assert tracker.steps == list(range(20))
    assert tracker.closed_with == 0
    first.join(5)


def test_a_finish_on_a_daemon_thread_is_waited_for_at_exit(tmp_path):
    """A daemon thread calls finish() and the script ends at once: the interpreter's exit waits
    for that drain (it would otherwise kill the thread in the middle of it), so every row is in
    the JSONL file without any replay."""
    log_dir = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import threading, time
        from otel_rl import Logger
        logger = Logger({{"log_dir": {str(log_dir)!r}, "stalls": {{"enabled": False}}}})
        for step in range(3000):
            logger.log_metrics({{f"k{{i}}": float(step) for i in range(20)}}, step=step)
        threading.Thread(target=logger.finish, daemon=True).start()
        time.sleep(0.05)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "k0" in r["metrics"]] == list(range(3000))


def test_a_tracker_stuck_in_its_close_is_named_and_one_late_in_a_write_is_still_closed(
    tmp_path, caplog
):
    """Past the deadline a tracker has one more second: one whose write ends then is closed
    with the run's exit code (its run status is recorded); one whose SDK never returns from
    close() is named, and finish() returns by shutdown_timeout + 1 s all the same."""
    late = _Tracker("late", write_s=0.0)
    stuck = _Tracker("stuck", close_hangs=True)
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": False,
                     "export": {"shutdown_timeout": 0.5}, "stalls": {"enabled": False}},
                    exporters=[late, stuck])  # fmt: skip
    logger.log_metrics({"x": 0.0}, step=0, step_finished=True)
    logger.flush()
    late.write_s = 0.8  # the next write ends 0.3 s past the deadline
    logger.log_metrics({"x": 1.0}, step=1, step_finished=True)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        began = time.monotonic()
        logger.finish(exit_code=3)
        took = time.monotonic() - began
    stuck.release.set()
    assert took < 0.5 + 1.0, took
    assert late.steps == [0, 1] and late.closed_with == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("otel-rl: stuck: the tracker's SDK has not returned") for m in messages)
    assert not any(m.startswith("otel-rl: late: the tracker's SDK") for m in messages)


def test_records_handed_over_before_a_short_deadline_still_reach_the_spool(tmp_path):
    """A disk slower than ``export.shutdown_timeout`` (each spool append takes 0.2 s; a slow
    disk on demand, which no real file system gives): what ``log_metrics`` handed over still
    reaches the spool before the process exits, so replay delivers every step once (before,
    the records the spool thread had not written by the deadline were lost for good). The spool
    thread gets half a second past the deadline: at worst it is one append into its chunk and
    has one more to write (0.3 s appends did not always fit)."""
    log_dir = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import time
        from otel_rl import Logger
        from otel_rl.delivery.spool import Spool
        append = Spool.append
        def slow_append(self, records):
            time.sleep(0.2)
            return append(self, records)
        Spool.append = slow_append
        cfg = {{"log_dir": {str(log_dir)!r}, "stalls": {{"enabled": False}},
               "export": {{"shutdown_timeout": 0.05}}}}
        logger = Logger(cfg)
        for step in range(300):
            logger.log_metrics({{"loss": float(step)}}, step=step)
        logger.finish()
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [(r["step"], r["metrics"]["loss"]) for r in jsonl_rows(log_dir / "metrics.jsonl")
            if "loss" in r["metrics"]]  # fmt: skip
    assert rows == [(step, float(step)) for step in range(300)]


def test_the_nemo_rl_drop_in_ends_its_run_within_the_same_deadline(tmp_path):
    """NeMo RL's ``Logger.finish()`` writes its artifact dumps while the core run ends, within
    the one deadline: a dump still being written and a collector that never answers together
    cost ``shutdown_timeout`` + 1 s at most (one after the other they cost twice the timeout);
    a second finish() from another thread returns only once the run has ended."""
    from otel_rl.compat.nemo_rl import Logger as NemoLogger
    from testkit.readers import tensorboard_scalars
    from tests.compat.test_compat_nemo_rl import nemo_config

    collector = _silent_endpoint()
    release = threading.Event()
    ended: dict[str, float] = {}
    try:
        cfg = nemo_config(
            tmp_path / "logs",
            otlp={"enabled": True, "endpoint": f"http://127.0.0.1:{collector.getsockname()[1]}",
                  "interval": 60},
            export={"shutdown_timeout": 1.5},
        )  # fmt: skip
        logger = NemoLogger(cfg)
        logger.log_metrics({"loss": 0.5}, step=0, prefix="train")
        logger.artifacts.submit("a dump that outlives the deadline", lambda: release.wait(30) and 0)

        def finish_first() -> None:
            logger.finish()
            ended["first"] = time.monotonic()

        first = threading.Thread(target=finish_first, daemon=True)
        began = time.monotonic()
        first.start()
        time.sleep(0.2)  # the first caller is ending the run
        logger.finish()
        # The run's own mark, set when its end is done: read as the second call returns.
        run_had_ended = logger.core._run._ended.is_set()
        first.join(5)
    finally:
        release.set()
        collector.close()
    assert ended["first"] - began < 1.5 + 1.0, ended["first"] - began
    assert run_had_ended  # the second call never returns before the run has ended
    scalars = tensorboard_scalars(tmp_path / "logs" / "tensorboard")
    assert scalars["train/loss"] == [(0, 0.5)]
