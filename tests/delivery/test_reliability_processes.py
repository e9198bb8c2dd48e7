"""Reliability with real processes: a tracker server that dies, a training process terminated.

The slow tracker here is a small third-party exporter (found through a real entry point) whose
writes take a second: it stands for a tracker that is slow, which no real one is on demand.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from otel_rl import Logger
from testkit.servers import start_mlflow_server, stop_mlflow_server

pytestmark = pytest.mark.slow


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def _run_loop(logger: Logger, steps: range, pause: float, on_step=None) -> list[float]:
    latencies = []
    for step in steps:
        t0 = time.perf_counter()
        logger.log_metrics({"loss": step / 1000, "reward": float(step)}, step=step, prefix="train")
        latencies.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step)
        time.sleep(pause)
    return latencies


@pytest.mark.long
def test_mlflow_server_killed_for_10s_then_restarted(tmp_path):
    from mlflow.tracking import MlflowClient

    workdir = tmp_path / "server"
    server = start_mlflow_server(workdir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        def config(name: str) -> dict:
            return {"log_dir": str(tmp_path / name), "mlflow_enabled": True,
                    "jsonl_enabled": False,
                    "mlflow": {"tracking_uri": server.url, "experiment_name": "outage",
                               "run_name": name},
                    "export": {"retry_max_backoff": 1.0, "shutdown_timeout": 120.0}}

        healthy = Logger(config("healthy"))
        healthy_latency = _run_loop(healthy, range(300), 0.02)
        healthy.finish()

        logger = Logger(config("outage"))
        outage: dict[str, float] = {}

        def kill_then_restart(step: int) -> None:
            nonlocal server
            if step == 100:
                os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
                server.process.wait(10)
                outage["down"] = time.monotonic()
            if step == 599:  # 500 steps of 20 ms: more than 10 s down
                outage["restarting"] = time.monotonic()
                server = start_mlflow_server(workdir, port=port)

        latency = _run_loop(logger, range(700), 0.02, kill_then_restart)
        (exporter,) = logger.exporters
        run_id = exporter.tracker.run_id
        logger.finish()
        assert outage["restarting"] - outage["down"] >= 10.0

        history = MlflowClient(server.url).get_metric_history(run_id, "train/reward")
        assert [(m.step, m.value) for m in history] == [(s, float(s)) for s in range(700)]
        # The loop never waited for the dead server (latencies are the benchmarks' business:
        # benchmarks/training_thread.py measures a slow tracker; here, no call ever waited).
        print(f"log_metrics p99: healthy {_p99(healthy_latency) * 1e6:.0f} µs, "
              f"outage {_p99(latency) * 1e6:.0f} µs")
        assert exporter.stats["waits"] == 0
    finally:
        stop_mlflow_server(server)


TRACKER = '''
import json, os, time
from otel_rl.exporters.base import TrackerExporter


class SlowFileTracker(TrackerExporter):
    """Appends each step's scalars to a file; every write takes ``delay`` seconds."""

    name = "slowfile"

    def __init__(self, path, delay=1.0, **kwargs):
        self.path, self.delay = path, delay
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        time.sleep(float(os.environ.get("SLOWFILE_DELAY", self.delay)))
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "rows": dict(rows)}) + "\\n")
'''

CHILD = '''
import sys, time
from otel_rl import Logger
log_dir, path = sys.argv[1], sys.argv[2]
logger = Logger({"log_dir": log_dir, "jsonl_enabled": False,
                 "trackers": {"slowfile": {"path": path, "delay": 1.0}},
                 "export": {"shutdown_timeout": 2.0, "fsync_interval": 0.2}})
step = 0
while True:
    logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
    print(step, flush=True)
    step += 1
    time.sleep(0.01)
'''


@pytest.fixture
def slow_tracker_path(tmp_path):
    """A directory on PYTHONPATH holding the tracker module and its entry-point metadata."""
    site = tmp_path / "site"
    info = site / "slowfile_tracker-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "slowfile_tracker.py").write_text(textwrap.dedent(TRACKER))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slowfile-tracker\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[otel_rl.exporters]\nslowfile = slowfile_tracker:SlowFileTracker\n"
    )
    return site


@pytest.mark.serial  # the whole process's exit within seconds of SIGTERM
def test_sigterm_with_a_slow_tracker_exits_in_time_and_replay_completes(
    tmp_path, slow_tracker_path
):
    env = {**os.environ, "PYTHONPATH": f"{slow_tracker_path}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    log_dir, rows = tmp_path / "logs", tmp_path / "slowfile.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(log_dir), str(rows)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    logged = []
    while len(logged) < 60:
        line = child.stdout.readline()
        assert line, child.stderr.read()
        logged.append(int(line))
    child.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    rest, err = child.communicate(timeout=30)
    took = time.monotonic() - sent
    logged += [int(s) for s in rest.split()]

    assert child.returncode == 143, err
    assert took < 2.0 + 3.0  # the shutdown timeout, plus interpreter start-up noise
    assert "otel-rl replay" in err  # the final message says how to deliver the rest
    delivered_before = [json.loads(line)["step"] for line in rows.read_text().splitlines()]
    assert len(delivered_before) < len(logged)  # a second per write: most of it waits

    replay = subprocess.run(
        [sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir), "--no-progress"],
        capture_output=True, text=True, timeout=120, env={**env, "SLOWFILE_DELAY": "0"},
    )
    assert replay.returncode == 0, replay.stderr
    steps = [json.loads(line)["step"] for line in rows.read_text().splitlines()]
    assert set(steps) == set(logged)
    assert len(steps) - len(set(steps)) <= 1  # at most the row in flight at the signal
    assert sorted(steps[len(delivered_before):]) == steps[len(delivered_before):]


KILLED_CHILD = '''
import sys, time
from otel_rl import Logger
log_dir, url = sys.argv[1], sys.argv[2]
logger = Logger({"log_dir": log_dir, "tensorboard_enabled": True, "mlflow_enabled": True,
                 "mlflow": {"tracking_uri": url, "experiment_name": "killed"},
                 "export": {"fsync_interval": 0.2}})
step = 0
while True:
    logger.log_metrics({f"k{i}": step + i for i in range(50)}, step=step, prefix="train")
    print(step, time.monotonic(), flush=True)
    step += 1
    time.sleep(0.002)
'''


def _spooled_mlflow_run_id(log_dir) -> str | None:
    for path in (log_dir / ".otel-rl" / "spool" / "mlflow").glob("*/meta.json"):
        try:
            return json.loads(path.read_text())["resume"]["mlflow"]["run_id"]
        except (ValueError, KeyError):
            return None
    return None


@pytest.mark.long
def test_sigkilled_run_is_completed_by_replay_in_tensorboard_and_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    from testkit.readers import tensorboard_scalars

    server = start_mlflow_server(tmp_path / "server")
    try:
        log_dir = tmp_path / "logs"
        child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(log_dir), server.url],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        returned: list[tuple[int, float]] = []
        started = time.monotonic()
        run_id = None
        # Kill once the MLflow run exists (its id is in the spool's meta) and 4 s have passed.
        while run_id is None or time.monotonic() - started < 4.0:
            step, at = child.stdout.readline().split()
            returned.append((int(step), float(at)))
            if run_id is None and len(returned) % 50 == 0:
                run_id = _spooled_mlflow_run_id(log_dir)
            assert time.monotonic() - started < 60, "the MLflow run was never opened"
        child.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        child.wait(10)

        client = MlflowClient(server.url)
        before = {m.step for m in client.get_metric_history(run_id, "train/k7")}
        must_have = {s for s, at in returned if killed_at - at > 0.2 + 0.3}
        assert not must_have <= before  # MLflow (~40 ms a request) was behind when killed

        replay = subprocess.run(
            [sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir), "--no-progress"],
            capture_output=True, text=True, timeout=300,
        )
        assert replay.returncode == 0, replay.stderr
        history = client.get_metric_history(run_id, "train/k7")
        assert must_have <= {m.step for m in history}
        assert all(m.value == m.step + 7 for m in history)
        tb = tensorboard_scalars(log_dir / "tensorboard")["train/k7"]
        assert must_have <= {s for s, _ in tb}
        assert all(v == s + 7 for s, v in tb)
        assert client.get_run(run_id).info.status == "KILLED"  # never "finished"
    finally:
        stop_mlflow_server(server)
