"""The "RL training" Grafana dashboard: well-formed, and every metric its PromQL reads is one that
otel-rl's Prometheus endpoint really exposes in the demo run.

Sources of the names checked: the demo's own loop (otel_rl.cli.demo.simulate_training) for the
training, timing, throughput and exporter panels; the Ray GPU bridge (monitor_gpus: true)
scraping the 8xH100 fixture (testkit/fixtures/) plus one dead node for the GPU and scrape-health
panels. Everything is read from one real /metrics response.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import yaml

from otel_rl import Logger
from otel_rl.cli.demo import simulate_training
from testkit.dashboard import (
    DASHBOARD,
    REPO,
    FixtureNode,
    concrete,
    demo_run_config,
    exposed_names,
    load_dashboard,
    panel_targets,
    selectors,
    variable_queries,
)
from testkit.otlp_receiver import closed_port

VALUES = {"run_id": ".*", "node": ".*", "__rate_interval": "1m"}


def test_dashboard_is_well_formed():
    dashboard = load_dashboard()
    assert dashboard["title"] == "RL training"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in (
        "Reward", "Loss", "KL", "Response length", "Step timings (stacked)", "Throughput",
        "GPU utilization", "GPU memory used", "Ray node scrapes", "Where the step went (stacked)",
        "Worker busy fraction",
    ):  # fmt: skip
        assert wanted in titles
    for title in ("Step timings (stacked)", "Where the step went (stacked)"):
        stacked = next(p for p in dashboard["panels"] if p["title"] == title)
        assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert set(variable_queries(dashboard)) == {"run_id", "node"}

    datasource = yaml.safe_load(
        (REPO / "docker/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"]


def test_every_expression_parses_and_filters_by_run():
    dashboard = load_dashboard()
    for title, expr in panel_targets(dashboard):
        found = selectors(concrete(expr, VALUES))  # raises on a PromQL syntax error
        assert found, (title, expr)
        # Every panel is scoped to the chosen runs through target_info.
        assert "$run_id" in expr, (title, expr)
    for name, query in variable_queries(dashboard).items():
        assert query.startswith("label_values("), name


@pytest.mark.slow
def test_every_metric_the_dashboard_reads_is_exposed_by_the_demo_run(tmp_path):
    node = FixtureNode()
    dead = f"127.0.0.1:{closed_port()}"
    try:
        logger = Logger(demo_run_config(tmp_path, [node.address, dead]))
        try:
            simulate_training(logger, steps=5)
            text = _metrics_once_the_bridge_has_reported(logger.prometheus_url)
        finally:
            logger.finish()
    finally:
        node.close()
    exposed = exposed_names(text)

    dashboard = load_dashboard()
    used = [
        (title, selector)
        for title, expr in panel_targets(dashboard)
        for selector in selectors(concrete(expr, VALUES))
    ]
    for query in variable_queries(dashboard).values():
        used.extend(("variable", s) for s in selectors(_label_values_metric(query)))
    # The rollout row reads the inference engines' own series (scraped by the collector, not
    # served by otel-rl): test_rollout_panels_read_what_the_engines_expose checks those.
    used = [(title, s) for title, s in used if not _engine_metric(s)]
    missing = [(title, s) for title, s in used if not s.matches(exposed)]
    assert not missing, f"not on the endpoint: {missing}\nexposed: {sorted(exposed)}"
    # The panels really cover the GPU bridge and the run's own metrics.
    names = {s.name for _, s in used}
    assert {"ray_node_gpu_utilization_percent", "ray_node_gpu_memory_used_bytes"} <= names
    assert {"train_loss", "train_kl", "train_reward_mean", "perf_throughput"} <= names
    # the anatomy panels read the step's phases and the workers' busy fraction
    assert {"anatomy_generation_seconds", "anatomy_untimed_seconds",
            "anatomy_trainer_busy_fraction"} <= exposed  # fmt: skip


def _engine_metric(selector) -> bool:
    return (selector.name or "").startswith(("vllm:", "sglang:"))


def test_rollout_panels_read_what_the_engines_expose():
    """Every vllm:/sglang: series of the rollout row is on the engines' pages (the fixtures
    built from vLLM's and SGLang's metric definitions), and each panel filters by run through
    the otel_rl_run_id label otel-rl's service-discovery file gives the engines' targets."""
    fixtures = REPO / "testkit" / "fixtures" / "rollout"
    exposed = set()
    for name in ("vllm-v1-8gpu-tp.prom", "sglang-4gpu.prom"):
        exposed |= exposed_names((fixtures / name).read_text())
    dashboard = load_dashboard()
    titles = {p["title"] for p in dashboard["panels"]}
    rollout = {"Rollout throughput", "KV cache usage", "Rollout queue", "Time to first token p90"}
    assert {"Rollout (inference engines)"} | rollout <= titles
    used = [
        (title, s)
        for title, expr in panel_targets(dashboard)
        if title in rollout
        for s in selectors(concrete(expr, VALUES))
    ]
    assert used and all(_engine_metric(s) for _, s in used)
    assert not [(t, s) for t, s in used if not s.matches(exposed)]
    assert {s.name.split(":")[0] for _, s in used} == {"vllm", "sglang"}
    for title, expr in panel_targets(dashboard):
        if title in rollout:
            assert 'otel_rl_run_id=~"$run_id"' in expr, (title, expr)


def _metrics_once_the_bridge_has_reported(url: str, timeout: float = 15.0) -> str:
    """/metrics after the bridge has scraped both nodes (one failing) at least once."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        if "otel_rl_scrape_errors_total" in text and "ray_node_gpu_utilization" in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"the GPU bridge never reported on {url}:\n{text[:3000]}")


def _label_values_metric(query: str) -> str:
    """``label_values(metric, label)`` → ``metric`` (a PromQL selector)."""
    inner = query[len("label_values(") : -1]
    return inner.rsplit(",", 1)[0].strip()


def test_dashboard_json_is_canonical():
    """The file is plain JSON (Grafana rejects comments and trailing commas)."""
    json.loads(DASHBOARD.read_text())
