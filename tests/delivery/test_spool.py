"""The write-ahead spool: bounded memory, replay after an outage, crash recovery."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from otel_rl import Logger
from otel_rl.delivery.spool import (
    handoff_dir,
    read_acks,
    spool_dirs,
    spool_root,
    spools_of_run,
    undelivered,
)
from otel_rl.exporters.base import TrackerExporter
from otel_rl.run.replay import replay
from testkit.readers import jsonl_rows, tensorboard_scalars


class DownThenUp(TrackerExporter):
    """An in-memory tracker that is down until ``up`` is set; stands for a tracker outage."""

    name = "downthenup"

    def __init__(self, **kwargs):
        self.up = threading.Event()
        self.steps: list[int] = []
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        if not self.up.is_set():
            raise ConnectionError("down")
        self.steps.append(step)


def test_backlog_beyond_the_queue_lives_on_disk_and_arrives_in_order(tmp_path):
    tracker = DownThenUp(
        queue_size=20, spool_dir=tmp_path / "spool", retry_max_backoff=0.2,
        fsync_interval=0.1,
    )
    logger = Logger({"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False},
                    exporters=[tracker])
    for step in range(300):
        logger.log_metrics({"x": step}, step=step)
    logger.log_metrics({}, step_finished=True)
    deadline = time.monotonic() + 30
    while tracker.delivery.stats["spilled"] == 0:  # most of the backlog waits on disk only
        assert time.monotonic() < deadline, tracker.delivery.stats
        time.sleep(0.01)
    tracker.up.set()
    assert logger.flush(timeout=30)
    logger.finish()
    assert tracker.steps == list(range(300))  # each once, in order
    assert read_acks(tmp_path / "spool").upto == 300
    assert undelivered(tmp_path / "spool") == []


def test_outage_that_outlives_the_run_is_replayed_exactly_once(tmp_path, otel_rl_warnings):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "tensorboard").write_text("not a directory")  # TensorBoard cannot open
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True,
           "export": {"shutdown_timeout": 1.0, "retry_max_backoff": 0.2}}
    with Logger(cfg) as logger:
        for step in range(50):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step, prefix="train")
    assert len(jsonl_rows(log_dir / "metrics.jsonl")) == 50  # the other tracker was unaffected
    message = " ".join(r.getMessage() for r in otel_rl_warnings.records)
    assert "50 record(s) not delivered" in message and f"otel-rl replay {log_dir}" in message

    (log_dir / "tensorboard").unlink()  # the outage ends
    out = subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir),
                          "--no-progress"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensorboard" in out.stdout and "50/50 record(s) delivered" in out.stdout
    loss = tensorboard_scalars(log_dir / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == list(range(50))

    again = replay(log_dir, progress=False)  # idempotent
    assert [(r.tracker, r.pending) for r in again] == [("jsonl", 0), ("tensorboard", 0)]
    assert [s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["train/loss"]] == list(
        range(50)
    )


CHILD = textwrap.dedent(
    """
    import sys, time
    from otel_rl import Logger
    log_dir = sys.argv[1]
    logger = Logger({"log_dir": log_dir, "tensorboard_enabled": True,
                     "export": {"fsync_interval": 0.2}})
    step = 0
    while True:
        logger.log_metrics({"loss": step * 0.5, "reward": -step}, step=step, prefix="train")
        print(step, time.monotonic(), flush=True)
        step += 1
        time.sleep(0.002)
    """
)


@pytest.mark.slow
def test_sigkilled_training_loses_nothing_older_than_the_fsync_interval(tmp_path):
    log_dir = tmp_path / "logs"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(log_dir)],
                             stdout=subprocess.PIPE, text=True)
    returned: list[tuple[int, float]] = []
    started = time.monotonic()
    while time.monotonic() - started < 3.0 or len(returned) < 100:  # a busy machine is slower
        line = child.stdout.readline()
        if line:
            step, at = line.split()
            returned.append((int(step), float(at)))
    child.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    child.wait(10)
    assert len(returned) >= 100

    subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir),
                    "--no-progress"], check=True, timeout=120, capture_output=True)
    must_have = {s for s, at in returned if killed_at - at > 0.2 + 0.3}
    tb_steps = {s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["train/reward"]}
    jsonl_steps = {r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert must_have <= tb_steps
    assert must_have <= jsonl_steps
    for row in jsonl_rows(log_dir / "metrics.jsonl"):
        assert row["metrics"]["train/loss"] == row["step"] * 0.5


class AlwaysRaises(TrackerExporter):
    name = "always_raises"

    def write_step(self, step, rows, batch):
        raise RuntimeError("tracker rejects everything")


def _wait_until_spooled(tracker: TrackerExporter, timeout: float = 60.0) -> None:
    """Memory is measured once the spool thread has written what was submitted."""
    deadline = time.monotonic() + timeout
    while tracker.delivery._incoming and time.monotonic() < deadline:
        time.sleep(0.05)


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_tracker_raising_on_every_write_keeps_memory_flat(tmp_path, otel_rl_warnings):
    tracker = AlwaysRaises(queue_size=1000, spool_dir=tmp_path / "spool",
                           retry_max_backoff=0.5)
    logger = Logger({"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False,
                     "export": {"shutdown_timeout": 1.0}}, exporters=[tracker])
    row = {f"k{i}": float(i) for i in range(20)}
    rss = {}
    for step in range(100_000):
        logger.log_metrics(row, step=step, step_finished=True)
        if step in (20_000, 99_999):
            _wait_until_spooled(tracker)
            gc.collect()
            rss[step] = _rss_mib()
    logger.finish()
    assert rss[99_999] - rss[20_000] < 30, rss
    assert tracker.delivery.stats["spilled"] > 90_000
    failures = [r for r in otel_rl_warnings.records if "write failed" in r.getMessage()]
    assert len(failures) == 1
    assert len(undelivered(tmp_path / "spool")) == 100_000


def test_spool_layout_and_meta(tmp_path):
    log_dir = tmp_path / "logs"
    with Logger({"log_dir": str(log_dir), "run_id": "r1",
                 "wandb": {"api_key": "secret-value-123"}}) as logger:
        logger.log_metrics({"x": 1}, step=0)
    directory = spool_root(log_dir) / "jsonl" / "r1"
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["tracker"] == "jsonl" and meta["run_id"] == "r1" and meta["exit_code"] == 0
    assert meta["config"]["wandb"]["api_key"] == "***REDACTED***"
    assert read_acks(directory).upto == 1


def test_the_spools_of_a_run_pass_the_handoff_folder_by(tmp_path):
    """The delivery process's ``.handoff`` folder sits beside the trackers' spools and comes and
    goes while a relaunch lists them: it is never taken for a spool. A spool whose metadata is
    lost (segments only) is still listed, for replay to report."""
    log_dir = tmp_path / "logs"
    with Logger({"log_dir": str(log_dir), "run_id": "r1"}) as logger:
        logger.log_metrics({"x": 1}, step=0)
    stray = handoff_dir(log_dir) / "jsonl"
    stray.mkdir(parents=True)
    (stray / "meta.json").write_text(json.dumps({"run_id": "r1", "tracker": "jsonl"}))
    orphan = spool_root(log_dir) / "tensorboard" / "r0"
    orphan.mkdir(parents=True)
    (orphan / "wal-00000001.jsonl").write_text("")
    assert spools_of_run(log_dir, "r1") == [spool_root(log_dir) / "jsonl" / "r1"]
    assert spool_dirs(log_dir) == [spool_root(log_dir) / "jsonl" / "r1", orphan]
