"""A collector that is down must never fail training, and finish() must not wait it out.

What it costs the training thread is measured by ``python -m benchmarks.otlp_down``.
"""

from __future__ import annotations

import pytest

from testkit.otlp_receiver import closed_port

STEPS = 200
OTLP_TIMEOUT_S = 1.0


def _run(tmp_path, otlp: dict) -> tuple[list[float], float]:
    """200 steps of 20 keys and a timer; returns (log_metrics latencies, finish() seconds)."""
    from benchmarks.otlp_down import one_run

    return one_run(tmp_path, otlp, STEPS)


@pytest.mark.slow
def test_down_collector_neither_fails_training_nor_holds_finish(tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}"
    latencies, finish_s = _run(
        tmp_path / "down",
        # A short interval keeps the reader thread failing against the closed port throughout.
        {"enabled": True, "endpoint": dead, "interval": 0.05, "timeout": OTLP_TIMEOUT_S},
    )
    assert len(latencies) == STEPS  # every call returned
    # The final export of each provider (in parallel) gives up within the OTLP timeout.
    assert finish_s <= OTLP_TIMEOUT_S + 1.5, finish_s
