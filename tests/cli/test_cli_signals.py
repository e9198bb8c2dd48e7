"""SIGTERM and Ctrl-C (SIGINT) on the long-running commands, as real subprocesses and real
signals: each stops within seconds with 143/130, says so in one line, and what it had is
written out (the GPU values pushed over OTLP, the demo's rows whole in JSONL and TensorBoard,
its trackers closed with the signal's exit code)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node
from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of
from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.servers import free_port

#: How long a signalled command may take to exit ("within a second or two", with room for a
#: busy 2-core machine).
EXIT_WITHIN = 5.0
CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


def otel_rl_command() -> list[str]:
    """The installed ``otel-rl`` script, as a user runs it (else the module)."""
    script = Path(sys.executable).parent / "otel-rl"
    found = str(script) if script.exists() else shutil.which("otel-rl")
    return [found] if found else [sys.executable, "-m", "otel_rl.cli"]


def start(args: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # Files, not pipes: a command that prints a lot never blocks on a full pipe.
    return subprocess.Popen(
        [*otel_rl_command(), *args],
        stdout=(out / "stdout").open("w"), stderr=(out / "stderr").open("w"),
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def wait_for(check: Callable[[], Any], what: str, process: subprocess.Popen,
             out: Path, timeout: float = 90.0) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {what}: {stderr_of(out)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s: {stderr_of(out)}")
        time.sleep(0.1)


def signal_and_wait(process: subprocess.Popen, signum: int) -> tuple[int | None, float]:
    """Send ``signum``; the exit code (None if still running after :data:`EXIT_WITHIN` s, then
    killed) and how long it took."""
    sent = time.monotonic()
    process.send_signal(signum)
    try:
        code = process.wait(timeout=EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        return None, time.monotonic() - sent
    return code, time.monotonic() - sent


def stderr_of(out: Path) -> str:
    return (out / "stderr").read_text(errors="replace")


def stdout_of(out: Path) -> str:
    return (out / "stdout").read_text(errors="replace")


# ---- otel-rl gpu-monitor -------------------------------------------------------------------------


def _prometheus_gpu_utilization(port: int) -> dict[str, float]:
    """``{gpu index: utilization}`` served on ``/metrics`` (empty before the first round)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        s.labels["gpu"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ray_node_gpu_utilization")
    }


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_gpu_monitor_stops_on_a_signal_and_pushes_what_it_scraped(tmp_path, signum):
    node = simulated_node(7)
    receiver = OtlpHttpReceiver()
    port = free_port()
    with NodeFarm() as farm:
        url = farm.add(render(node, H100_FIXTURE.read_text()))
        monitor = start(
            ["gpu-monitor", "--endpoint", url, "--interval", "0.5",
             "--otlp", receiver.endpoint, "--prometheus-port", str(port)],
            tmp_path,
            # No periodic push during the test: what the receiver gets is the final flush.
            env={"OTEL_METRIC_EXPORT_INTERVAL": "3600000"},
        )  # fmt: skip
        try:
            served = wait_for(
                lambda: _prometheus_gpu_utilization(port), "GPU values on /metrics", monitor,
                tmp_path,
            )  # fmt: skip
            assert served == {str(i): gpu.utilization for i, gpu in node.gpus.items()}
            assert receiver.received == []
            code, took = signal_and_wait(monitor, signum)
        finally:
            if monitor.poll() is None:
                monitor.kill()
                monitor.wait(30)
            receiver.close()

    assert code == CODES[signum], f"exit {code} after {took:.1f} s: {stderr_of(tmp_path)}"
    assert "Traceback" not in stderr_of(tmp_path)
    points = {
        (name, attributes_of(p.attributes).get("gpu")): p.as_double
        for _, name, _, p in receiver.points()
        if name.startswith("ray.node.")
    }
    for index, gpu in node.gpus.items():
        assert points[("ray.node.gpu.utilization", index)] == gpu.utilization
        assert points[("ray.node.gpu.temperature", index)] == gpu.temperature_c
        assert points[("ray.node.gpu.power", index)] == gpu.power_mw / 1000
    assert points[("ray.node.memory.used", None)] == node.mem_used
    assert points[("ray.node.cpu.utilization", None)] == node.cpu_util
    # The last table is printed before it exits: every GPU's power, in watts.
    table = stdout_of(tmp_path)
    assert all(f"{gpu.power_mw / 1000:.0f}" in table for gpu in node.gpus.values()), table


# ---- otel-rl demo --------------------------------------------------------------------------------


def _complete_rows(path: Path) -> int:
    """How many whole lines the JSONL file has so far."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _check_demo_run(run_dir: Path, exit_code: int, trackers: set[str]) -> None:
    """Rows whole and contiguous from step 0, their values those of their step, the same steps
    in TensorBoard, and every tracker closed with ``exit_code``."""
    rows = jsonl_rows(run_dir / "metrics.jsonl")  # raises on a torn line
    steps = [row["step"] for row in rows]
    assert steps == list(range(len(rows))), steps
    assert len(rows) >= 5
    full = [row for row in rows if "train/kl" in row["metrics"]]
    assert len(full) >= len(rows) - 1  # only the step being logged may be partial
    for row in full:
        step, metrics = row["step"], row["metrics"]
        assert metrics["train/reward/count"] == 16
        assert 0.002 * step <= metrics["train/kl"] < 0.002 * step + 0.01
        assert 64 + 4 * step <= metrics["train/response_length/min"]
        assert metrics["train/response_length/max"] <= 512 + 4 * step
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["train/kl"]] == [row["step"] for row in full]
    metas = [
        json.loads(p.read_text()) for p in (run_dir / ".otel-rl" / "spool").glob("*/*/meta.json")
    ]
    assert {m["tracker"]: m["exit_code"] for m in metas} == dict.fromkeys(trackers, exit_code)


def _run_demo_until_rows(tmp_path: Path, backends: str) -> tuple[subprocess.Popen, Path]:
    base = tmp_path / "demo"
    demo = start(
        ["demo", "--steps", "100000", "--step-seconds", "0.01", "--log-dir", str(base),
         "--backends", backends],
        tmp_path,
    )  # fmt: skip
    run_dir = base / "exp_001"
    wait_for(lambda: _complete_rows(run_dir / "metrics.jsonl") >= 5, "5 rows", demo, tmp_path)
    return demo, run_dir


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_demo_stopped_by_a_signal_says_so_in_one_line_and_closes_its_trackers(tmp_path, signum):
    demo, run_dir = _run_demo_until_rows(tmp_path, "tensorboard,jsonl")
    try:
        code, took = signal_and_wait(demo, signum)
    finally:
        if demo.poll() is None:
            demo.kill()
    stderr = stderr_of(tmp_path)
    assert code == CODES[signum], f"exit {code} after {took:.1f} s: {stderr}"
    assert "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    assert line == f"otel-rl demo: stopped by {name}; the steps logged so far are in {run_dir}"
    _check_demo_run(run_dir, CODES[signum], {"jsonl", "tensorboard"})


def test_demo_ctrl_c_with_the_console_tracker_ends_with_the_one_line(tmp_path):
    """The console tracker prints its tables on stderr too: the line comes after the last."""
    demo, run_dir = _run_demo_until_rows(tmp_path, "tensorboard,jsonl,console")
    try:
        code, took = signal_and_wait(demo, signal.SIGINT)
    finally:
        if demo.poll() is None:
            demo.kill()
    stderr = stderr_of(tmp_path)
    assert code == 130, f"exit {code} after {took:.1f} s: {stderr}"
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    expected = f"otel-rl demo: stopped by SIGINT (Ctrl-C); the steps logged so far are in {run_dir}"
    assert lines[-1] == expected
    assert lines.count(expected) == 1
    _check_demo_run(run_dir, 130, {"jsonl", "tensorboard", "console"})
