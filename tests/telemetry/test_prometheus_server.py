"""A real Prometheus server scrapes otel-rl's /metrics every second during a demo run.

Checks what an operator sees: the last logged ``train_loss``, a ``histogram_quantile`` of a
timer, the dashboard's template variables, and every query of the "RL training" dashboard
returning data (GPU panels fed by the Ray bridge scraping the 8xH100 fixture; rollout panels by
Prometheus scraping the vLLM and SGLang fixture pages through the Logger's `file_sd` file).
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request

import pytest

from otel_rl import Logger
from otel_rl.cli.demo import simulate_training
from testkit.dashboard import (
    FixtureNode,
    concrete,
    demo_run_config,
    load_dashboard,
    panel_targets,
)
from testkit.otlp_receiver import closed_port
from testkit.prometheus_server import PrometheusServer, prometheus_binary
from testkit.readers import jsonl_rows
from testkit.rollout_pages import SG_FIRST, V1_FIRST, PageServer

STEPS = 20


@pytest.fixture
def demo_run(tmp_path):
    """A Logger with the demo's config, served on a free port, GPU bridge on the fixture, rollout
    monitoring of a vLLM and an SGLang page keeping a ``file_sd`` file for Prometheus."""
    prometheus_binary()  # skip (or fail in CI) before starting anything
    node = FixtureNode()
    engines = [PageServer(V1_FIRST), PageServer(SG_FIRST)]
    cfg = demo_run_config(
        tmp_path / "run",
        [node.address, f"127.0.0.1:{closed_port()}"],
        engines=[e.url for e in engines],
        sd_file=tmp_path / "sd" / "engines.json",
    )
    logger = Logger(cfg)
    yield logger
    logger.finish()
    node.close()
    for engine in engines:
        engine.close()


@pytest.fixture
def prometheus(tmp_path, demo_run):
    target = urllib.parse.urlsplit(demo_run.prometheus_url).netloc
    sd_file = demo_run.config["rollout_monitoring"]["sd_file"]
    server = PrometheusServer(tmp_path / "prometheus", [target], file_sd=[sd_file])
    try:
        server.wait_ready()
        server.wait_scraped()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_prometheus_sees_the_run_and_every_dashboard_query_has_data(tmp_path, demo_run, prometheus):
    logger = demo_run
    # Paced so that several scrapes (1 s apart) fall inside the run: rate() needs two.
    simulate_training(logger, steps=STEPS, step_seconds=0.2)
    assert logger.flush(timeout=10)
    training = [r for r in jsonl_rows(tmp_path / "run" / "metrics.jsonl") if not r.get("axis")]
    last = training[-1]  # GPU rows sit on their own axis (ray/ray_step) in the same file
    assert last["step"] == STEPS - 1
    last_loss = last["metrics"]["train/loss"]

    result = prometheus.wait_for("train_loss", lambda r: r and float(r[0]["value"][1]) == last_loss)
    assert len(result) == 1
    step = prometheus.query("otel_rl_step")
    assert float(step[0]["value"][1]) == STEPS - 1

    # A quantile of a timer, as Prometheus computes it from the scraped buckets; it must equal
    # the interpolation over the buckets our endpoint serves right now (nothing is recorded now).
    buckets = _endpoint_buckets(logger.prometheus_url, "timing_generation_seconds")
    prometheus.wait_for(
        "timing_generation_seconds_count", lambda r: r and float(r[0]["value"][1]) == STEPS
    )
    p50 = prometheus.query("histogram_quantile(0.5, timing_generation_seconds_bucket)")
    assert float(p50[0]["value"][1]) == pytest.approx(_quantile(0.5, buckets), rel=1e-9)
    # The demo sleeps 4 ms in generation: the (2.5 ms, 5 ms] bucket or a later one.
    assert 0.0025 < float(p50[0]["value"][1]) <= 0.1

    # The dashboard's template variables resolve to this run and the fixture node.
    run_ids = _label_values(prometheus, "otel_rl_run_id", "target_info")
    assert run_ids == [logger.run_id]
    assert _label_values(prometheus, "node", "ray_node_gpu_utilization_percent") == ["0"]

    # The engines' series, labelled with the run through the Logger's file_sd file; rate() needs
    # two scrapes of them.
    prometheus.wait_for(
        f'count_over_time(vllm:generation_tokens_total{{otel_rl_run_id="{logger.run_id}"}}[30s])',
        lambda r: r and float(r[0]["value"][1]) >= 2,
    )
    # Every query of every panel returns data for this run (the stall annotation only while a
    # run is stalled: tests/product/test_alert_rules.py evaluates that on a stalled run).
    values = {"run_id": logger.run_id, "node": ".*", "__rate_interval": "30s"}
    empty = [
        (title, expr)
        for title, expr in panel_targets(load_dashboard())
        if not title.startswith("annotation: ") and not prometheus.query(concrete(expr, values))
    ]
    assert not empty, f"panels without data: {empty}"
    # A run id that is not this one selects nothing (the target_info join really filters).
    loss_expr = next(e for t, e in panel_targets(load_dashboard()) if t == "Loss")
    assert prometheus.query(concrete(loss_expr, {**values, "run_id": "no-such-run"})) == []


def _endpoint_buckets(url: str, name: str) -> list[tuple[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sorted(
                (float(s.labels["le"]), s.value)
                for s in family.samples
                if s.name == f"{name}_bucket"
            )
    raise AssertionError(f"{name} not on {url}")


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q·n."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    raise AssertionError("unreachable")


def _label_values(prometheus: PrometheusServer, label: str, metric: str) -> list[str]:
    params = urllib.parse.urlencode({"match[]": metric})
    url = f"{prometheus.url}/api/v1/label/{label}/values?{params}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]
