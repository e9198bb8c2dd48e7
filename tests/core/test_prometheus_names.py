"""The metric-name table of docs/outputs.md is what the Prometheus endpoint really serves.

One run does everything the table's rows do; every series name in the table's last column must
be on /metrics, and the endpoint must bind to loopback by default and use its own registry.
otel-rl's own metrics are in docs/metrics.md, checked against a live page by
tests/core/test_metric_catalogue.py.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY

from otel_rl import Logger
from otel_rl.config.loading import DEFAULTS
from testkit.dashboard import REPO, exposed_names

OUTPUTS = REPO / "docs" / "outputs.md"


def _documented_series() -> set[str]:
    text = OUTPUTS.read_text()
    section = text.split("### Metric names", 1)[1]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| you log", "| ---")):
            last_cell = line.rstrip(" |").rsplit(" | ", 1)[1]
            names.update(re.findall(r"`([a-z_:][a-z0-9_:]*)`", last_cell))
    return names


@pytest.mark.slow
def test_every_documented_series_is_served(tmp_path):
    documented = _documented_series()
    assert {"train_loss", "timing_generation_seconds_bucket", "rollout_samples_total"} <= documented
    logger = Logger(
        {
            "log_dir": str(tmp_path),
            "capture_global_meters": False,
            "prometheus": {"enabled": True, "port": 0},
        }
    )
    try:
        meter = logger.meter_provider.get_meter("my_lib")
        meter.create_counter("rollout.samples").add(3)
        meter.create_histogram("rollout.tokens").record(512)
        meter.create_histogram("rollout.latency", unit="ms").record(5)
        with logger.timer("generation"):
            pass
        logger.log_metrics({"loss": 0.1, "done": True}, step=0, prefix="train")
        logger.log_metrics({"reward": [0.5, -1.0, 2.0]}, step=0, prefix="train")
        logger.log_metrics(
            {
                "Val/Accuracy@1": 0.5,
                "perf/tokens-per-sec": 3e4,
                "1st/metric": 2.0,
                "x": float("nan"),
            },
            step=0,
        )
        logger.flush()
        text = _wait_for(logger.prometheus_url, "rollout_latency_milliseconds_count")
    finally:
        logger.finish()
    exposed = exposed_names(text)
    missing = sorted(documented - exposed)
    assert not missing, f"documented but not served: {missing}"
    assert re.search(r"^train_loss\{[^}]*\} 0\.1$", text, flags=re.M)
    assert re.search(r"^train_reward_min\{[^}]*\} -1\.0$", text, flags=re.M)


def test_loopback_by_default_and_own_registry(tmp_path):
    assert DEFAULTS["prometheus"]["host"] == "127.0.0.1"
    logger = Logger(
        {
            "log_dir": str(tmp_path),
            "jsonl_enabled": False,
            "prometheus": {"enabled": True, "port": 0},
        }
    )
    try:
        assert logger.prometheus_url.startswith("http://127.0.0.1:")
        logger.log_metrics({"loss": 0.25}, step=0, prefix="train")
        # Nothing of the process-global registry (python_gc_*, process_*) is served...
        text = urllib.request.urlopen(logger.prometheus_url, timeout=5).read().decode()
        assert "train_loss" in text and "python_gc_objects_collected_total" not in text
        # ...and nothing of the run leaks into it.
        assert REGISTRY.get_sample_value("train_loss") is None
    finally:
        logger.finish()


def _wait_for(url: str, needle: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle} never appeared on {url}")
