"""A collector that is down must cost the training thread nothing and finish() little.

The bounds are generous on purpose (2x the run without OTLP, plus an absolute slack for a shared
2-core machine); benchmarks measure the real numbers.
"""

from __future__ import annotations

import time

import pytest

from otel_rl import Logger
from tests.otlp_receiver import closed_port

STEPS = 200
OTLP_TIMEOUT_S = 1.0
SLACK_S = 0.002


def _run(tmp_path, otlp: dict) -> tuple[float, float, list[float]]:
    """200 steps of 20 keys and a timer; returns (p99 of log_metrics, finish() seconds, all)."""
    logger = Logger(
        {
            "log_dir": str(tmp_path),
            "jsonl_enabled": False,
            "capture_global_meters": False,
            "otlp": otlp,
        }
    )
    latencies = []
    for step in range(STEPS):
        with logger.timer("generation"):
            pass
        metrics = {f"k{i}": step * 0.01 + i for i in range(20)}
        started = time.perf_counter()
        logger.log_metrics(metrics, step=step, prefix="train")
        latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    logger.finish()
    finish_s = time.perf_counter() - started
    latencies.sort()
    return latencies[int(0.99 * len(latencies)) - 1], finish_s, latencies


@pytest.mark.slow
def test_down_collector_does_not_slow_training(tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}"
    # Warm-up so that imports and first-time costs hit neither measured run.
    _run(tmp_path / "warm", {"enabled": False})
    base_p99, _, _ = _run(tmp_path / "base", {"enabled": False})
    down_p99, finish_s, _ = _run(
        tmp_path / "down",
        # A short interval keeps the reader thread failing against the closed port throughout.
        {"enabled": True, "endpoint": dead, "interval": 0.05, "timeout": OTLP_TIMEOUT_S},
    )
    assert down_p99 <= 2 * base_p99 + SLACK_S, (down_p99, base_p99)
    # The final export of each provider (in parallel) gives up within the OTLP timeout.
    assert finish_s <= OTLP_TIMEOUT_S + 1.5, finish_s
