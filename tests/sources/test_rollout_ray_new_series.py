"""Engines forwarded to Ray create each series at its first record: the monitor counts a series
that appears after the engine's first sample from zero, and warns only about what never appears.

A real local Ray cluster of its own (no series of other tests' workers on its node page); an
actor records through the real ``ray.util.metrics`` what vLLM's ``RayPrometheusStatLogger``
records (vLLM's own metric names and labels, see ``test_rollout_ray_source``), with the values
of the vLLM fixture pages. vLLM itself needs a GPU and is not installed here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from otel_rl.rollout.engines import parse_engine_page, parse_ray_node_page
from otel_rl.rollout.monitor import RolloutMonitor
from otel_rl.rollout.rows import histogram_quantile
from testkit.rollout_pages import V1_EXP, V1_FIRST, V1_LATER
from tests.sources.test_rollout_ray_source import ForwardingEngine, recording_ops


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,  # the per-node agent that serves /metrics still starts
        object_store_memory=100 * 2**20,
        logging_level="ERROR",
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        yield ray, f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    finally:
        ray.shutdown()


def _shows(url: str, page: str | None, timeout: float = 60.0) -> None:
    """Until the node's one engine shows every counter, gauge and histogram of ``page`` (a
    worker may push in the middle of a recording); ``None``: the gauges of the fixture's first
    page and no counter or histogram yet."""
    import urllib.request

    (want,) = parse_engine_page(page or V1_FIRST).values()
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            seen = list(parse_ray_node_page(response.read().decode()).values())
        if len(seen) == 1 and seen[0].gauges == want.gauges:
            got = seen[0]
            if page is None and not got.counters and not got.histograms:
                return
            if page is not None and (got.counters, got.histograms) == (
                _without_prefix(want.counters),
                want.histograms,
            ):
                return
        assert time.monotonic() < deadline, f"the node's page never showed it: {seen}"
        time.sleep(0.1)


def _without_prefix(counters: dict[str, float]) -> dict[str, float]:
    return {r: v for r, v in counters.items() if not r.startswith("prefix_")}


def _ops(page: str, before: str | None = None) -> list[tuple[Any, ...]]:
    """The engine's records, without the prefix-cache counters (an engine that never has any)."""
    return [op for op in recording_ops(page, before) if "prefix_cache" not in op[1]]


@pytest.mark.slow
def test_series_that_appear_after_the_first_sample_count_from_zero_and_the_run_totals_match(
    ray_cluster, caplog
):
    """The engine has only set its gauges when monitoring starts (Ray has no counter or
    histogram series yet). During step 1 it serves the fixture's first page's worth of requests
    from zero, during step 2 the increase to the later page, during step 3 nothing. Step 1
    counts every series from zero, step 2 gets the fixture's increase, and the run's totals are
    what the engine served. The only warning, at close, names the metric it never had."""
    ray, url = ray_cluster
    caplog.set_level(logging.WARNING, logger="otel_rl")
    engine = ray.remote(num_cpus=0)(ForwardingEngine).remote()
    ray.get(engine.record.remote([op for op in _ops(V1_FIRST) if op[0] == "gauge"]))
    _shows(url, None)

    got: dict[int, dict[str, float]] = {}
    cond = threading.Condition()

    def emit(step: int, values: dict[str, float]) -> None:
        with cond:
            got[step] = values
            cond.notify_all()

    monitor = RolloutMonitor([], emit=emit, source="ray", collection_interval=3600)
    try:
        assert monitor.wait_rounds(1)  # the baseline: gauges only
        ray.get(engine.record.remote([op for op in _ops(V1_FIRST) if op[0] != "gauge"]))
        _shows(url, V1_FIRST)
        monitor.mark_step(1)
        assert monitor.flush()
        ray.get(engine.record.remote(_ops(V1_LATER, V1_FIRST)))
        _shows(url, V1_LATER)
        monitor.mark_step(2)
        assert monitor.flush()
        monitor.mark_step(3)
        assert monitor.flush()
        warned_before_close = [r.getMessage() for r in caplog.records]
    finally:
        monitor.close()
    assert sorted(got) == [1, 2, 3]
    (first,) = parse_engine_page(V1_FIRST).values()
    (later,) = parse_engine_page(V1_LATER).values()
    step1, step2, step3 = got[1], got[2], got[3]
    assert step1["rollout/requests_finished"] == first.counters["requests_finished"]
    assert step1["rollout/preemptions"] == first.counters["preemptions"] == 37.0
    hist = first.histograms["ttft"]
    assert step1["rollout/ttft_p50_s"] == histogram_quantile(0.5, hist.bounds, hist.counts)
    assert step2["rollout/requests_finished"] == V1_EXP["requests_finished"]
    assert step2["rollout/preemptions"] == V1_EXP["preemptions_delta"]
    ttft = V1_EXP["time_to_first_token_seconds"]
    assert step2["rollout/ttft_p50_s"] == pytest.approx(ttft["p50"], rel=1e-12)
    assert step2["rollout/ttft_p90_s"] == pytest.approx(ttft["p90"], rel=1e-12)
    assert step3["rollout/requests_finished"] == 0.0
    for role, row in (("requests_finished", "requests_finished"), ("preemptions", "preemptions")):
        total = sum(values[f"rollout/{row}"] for values in got.values())
        assert total == later.counters[role], role  # what the engine served over the run
    assert all("prefix_cache_hit_rate" not in values for values in got.values() if values)
    assert not [m for m in warned_before_close if "metric for" in m], warned_before_close
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ever had a metric for prefix_cache_hit_rate" in warnings[0]


def _engines_on(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_ray_node_page(response.read().decode())


@pytest.mark.slow
def test_an_engine_first_seen_with_its_first_requests_already_counted_counts_them(ray_cluster):
    """An engine that starts during the run and whose first push to its node's page already
    holds its first requests (gauges, counters and histograms recorded at once, as when Ray's
    push comes after the engine's first batch): the node's page, read before without it, says
    it is new, so step 1 counts every series of its first sample from zero, and step 2 nothing
    twice. (Before, that first sample was a baseline: step 1 lost those requests.)"""
    ray, url = ray_cluster
    got: dict[int, dict[str, float]] = {}
    cond = threading.Condition()

    def emit(step: int, values: dict[str, float]) -> None:
        with cond:
            got[step] = values
            cond.notify_all()

    before = set(_engines_on(url))  # an engine an earlier test left on the node, if any
    (first,) = parse_engine_page(V1_FIRST).values()
    monitor = RolloutMonitor([], emit=emit, source="ray", collection_interval=3600)
    try:
        assert monitor.wait_rounds(1)  # the node's page, without the new engine
        engine = ray.remote(num_cpus=0)(ForwardingEngine).remote()
        ray.get(engine.record.remote(_ops(V1_FIRST)))
        deadline = time.monotonic() + 60
        while True:  # until its whole first sample is on the page (no scrape meanwhile)
            new = {k: s for k, s in _engines_on(url).items() if k not in before}
            if [(s.counters, s.histograms) for s in new.values()] == [
                (_without_prefix(first.counters), first.histograms)
            ]:
                (key,) = new
                break
            assert time.monotonic() < deadline, f"the node's page never showed it: {new}"
            time.sleep(0.1)
        monitor.mark_step(1)
        assert monitor.flush()
        monitor.mark_step(2)
        assert monitor.flush()
    finally:
        monitor.close()
    (info,) = [e for e in monitor.engines if e.label == key]
    head = f"rollout/engine.{info.id}."
    step1, step2 = got[1], got[2]
    assert step1[head + "requests_finished"] == first.counters["requests_finished"]
    assert step1["rollout/requests_finished"] == first.counters["requests_finished"]
    assert step1[head + "preemptions"] == first.counters["preemptions"] == 37.0
    hist = first.histograms["ttft"]
    assert step1[head + "ttft_p90_s"] == histogram_quantile(0.9, hist.bounds, hist.counts)
    assert step1[head + "gen_tokens_per_s"] > 0
    assert step2[head + "requests_finished"] == 0.0
    assert step2["rollout/requests_finished"] == 0.0
