"""What a run says it left at exit is what ``otel-rl replay`` then delivers, checkpoints of the
step being logged among the spooled records.

The tracker is ``faultfile`` (rows to a file, down on demand: no real tracker SDK is; see
``tests/faults/fault_tracker.py``), in the training process or the delivery process, which is
also stopped (SIGSTOP) so that the training process counts what it left.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_rl.delivery.spool import spool_root
from tests.faults.fault_tracker import env_with_faultfile, read_rows, set_mode

REPLAY = [sys.executable, "-m", "otel_rl.cli", "replay"]


def _script(tmp_path: Path, control: Path, delivery: str, stopped: bool) -> str:
    return textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from otel_rl import Logger
        from tests.faults.fault_tracker import set_mode
        cfg = {{
            "log_dir": {str(tmp_path / "logs")!r}, "jsonl_enabled": False,
            "trackers": {{"faultfile": {{"path": {str(tmp_path / "rows.jsonl")!r},
                                         "control": {str(control)!r}}}}},
            "export": {{"delivery": {delivery!r}, "shutdown_timeout": 1.0,
                        "fsync_interval": 0.1}},
        }}
        logger = Logger(cfg)
        tracker = logger.exporters[0]
        for step in range(10):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        assert logger.flush(30)
        set_mode({str(control)!r}, "raise")  # the backend is down: the rest stays spooled
        for step in range(10, 20):
            logger.log_metrics({{"loss": float(step)}}, step=step)
            # A long step: the checkpoint thread copies it to the spool meanwhile.
            time.sleep(0.15)
            logger.log_metrics({{"acc": float(step)}}, step=step)
        if {stopped!r}:
            # The last step's checkpoint is spooled; its sealed batch (at finish()) never is.
            def spooled():
                return "".join(p.read_text() for p in Path(tracker.spool_dir).glob("wal-*"))
            ends = time.monotonic() + 30
            while not any('"step":19,' in line and '"provisional":true' in line
                          for line in spooled().splitlines()):
                assert time.monotonic() < ends, "the last step was never checkpointed"
                time.sleep(0.05)
            os.kill(tracker.link.process.pid, signal.SIGSTOP)
        logger.finish()
        print("EXIT", tracker.stats["delivered"], tracker.undelivered, file=sys.stderr)
    """)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("delivery", "stopped"), [("thread", False), ("process", False), ("process", True)]
)
def test_the_count_said_at_exit_is_what_replay_delivers_with_checkpoints_in_the_spool(
    tmp_path, delivery, stopped
):
    """Ten long steps logged while the tracker is down, each checkpointed while it was being
    logged: the exit says 10 records are left (never the checkpoints a sealed step superseded,
    which replay passes over), delivered plus left is every step, and replay delivers 10/10.
    Stopped, the delivery process is killed at the deadline with the last step's checkpoint
    spooled and its sealed batch not: the training process counts it the same."""
    control = tmp_path / "control"
    set_mode(control, "ok")
    env = env_with_faultfile(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _script(tmp_path, control, delivery, stopped)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (spool,) = (spool_root(tmp_path / "logs") / "faultfile").iterdir()
    lines = "".join(p.read_text() for p in spool.glob("wal-*")).splitlines()
    assert sum('"provisional":true' in line for line in lines) >= 2, lines  # checkpoints in play
    assert "EXIT 10 10" in done.stderr, done.stderr
    (said,) = [m for m in done.stderr.splitlines() if "record(s) not delivered" in m]
    assert said.startswith(
        "otel-rl: faultfile: 10 record(s) not delivered before the shutdown timeout "
        "(export.shutdown_timeout: 1 s; "
    ), said
    assert said.endswith(f"deliver them with: otel-rl replay {tmp_path / 'logs'}"), said
    assert "checkpointed" not in said, said
    set_mode(control, "ok")
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"faultfile    run {spool.name}: 10/10 record(s) delivered" in replay.stdout, (
        replay.stdout
    )
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [s for s, _ in rows] == list(range(20))
    assert [(r["loss"], r.get("acc")) for s, r in rows[10:]] == [
        (float(s), float(s)) for s in range(10, 20)
    ]
