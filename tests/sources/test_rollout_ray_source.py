"""``rollout_monitoring: {source: ray}``: vLLM engines that forward their metrics to Ray.

vLLM's ``RayPrometheusStatLogger`` (``vllm/v1/metrics/ray_wrappers.py``) records every engine
metric through ``ray.util.metrics`` under the vLLM name with ``:`` turned into ``_`` and vLLM's
labels plus ``ReplicaId`` as tag keys. vLLM itself is not installed here (it needs a GPU), so the
actors below record exactly what that logger would, through the real ``ray.util.metrics`` on a
real local Ray cluster, with the values of the shipped vLLM fixture pages; the monitor finds the
node through ``ray.nodes()`` and reads the node's real metrics page.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_rl.rollout.engines import parse_engine_page, parse_ray_node_page, ray_series_name
from otel_rl.rollout.monitor import RolloutMonitor
from testkit.rollout_pages import V1_EXP, V1_FIRST, V1_LATER

#: The vLLM families the rollout rows read, by kind (``vllm/v1/metrics/loggers.py`` names).
COUNTERS = ("generation_tokens", "prompt_tokens", "request_success", "num_preemptions",
            "prefix_cache_hits", "prefix_cache_queries")  # fmt: skip
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds")


def _families(page: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(page) if f.name.startswith("vllm:")}


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def recording_ops(page: str, before: str | None = None) -> list[tuple[Any, ...]]:
    """What an engine's Ray stat logger records to go from the page ``before`` (``None``: a
    fresh engine) to ``page``: counter increments, gauge values, histogram observations (each
    bucket's new observations at its upper bound, the ``+Inf`` bucket's beyond the last)."""
    now, then = _families(page), _families(before) if before else {}
    ops: list[tuple[Any, ...]] = []
    for short in COUNTERS:
        name = f"vllm:{short}"
        old = {_key(s.labels): s.value for s in then[name].samples} if then else {}
        for s in now[name].samples:
            if s.name.endswith("_total"):
                amount = s.value - old.get(_key(s.labels), 0.0)
                ops.append(("counter", name, dict(s.labels), amount))
    for short in GAUGES:
        name = f"vllm:{short}"
        for s in now[name].samples:
            ops.append(("gauge", name, dict(s.labels), s.value))
    for short in HISTOGRAMS:
        name = f"vllm:{short}"

        def cumulative(family: Any) -> dict[Any, dict[float, float]]:
            out: dict[Any, dict[float, float]] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    out.setdefault(_key(s.labels), {})[float(s.labels["le"])] = s.value
            return out

        new_counts = cumulative(now[name])
        old_counts = cumulative(then[name]) if then else {}
        for key, by_le in new_counts.items():
            bounds = sorted(b for b in by_le if b != float("inf"))
            previous_total = 0.0
            for le in (*bounds, float("inf")):
                total = by_le[le] - old_counts.get(key, {}).get(le, 0.0)
                times = round(total - previous_total)
                previous_total = total
                value = le if le != float("inf") else bounds[-1] * 2
                if times:
                    ops.append(("observe", name, dict(key), bounds, value, times))
    return ops


class ForwardingEngine:
    """An actor recording as ``RayPrometheusStatLogger`` does (vLLM's wrapper classes in
    ``vllm/v1/metrics/ray_wrappers.py``): sanitized name, vLLM's labels plus ``ReplicaId``.
    Like an engine, which sets its gauges at every stats interval, it sets its gauges' last
    values again every half second: Ray drops a gauge not set for two export intervals."""

    def __init__(self) -> None:
        import threading

        self.metrics: dict[str, Any] = {}
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._keep_gauges, daemon=True).start()

    def _keep_gauges(self) -> None:
        import time

        while True:
            time.sleep(0.5)
            with self.lock:
                for (name, tags), value in self.gauges.items():
                    self.metrics[name].set(value, tags=dict(tags))

    def record(self, ops: list[tuple[Any, ...]]) -> int:
        import os

        from ray.util import metrics

        def metric(kind: str, name: str, labels: dict[str, str], bounds: Any = None) -> Any:
            if name not in self.metrics:
                clean = re.sub(r"[^a-zA-Z0-9_]", "_", name)
                keys = (*sorted(labels), "ReplicaId")
                if kind == "counter":
                    self.metrics[name] = metrics.Counter(clean, description=name, tag_keys=keys)
                elif kind == "gauge":
                    self.metrics[name] = metrics.Gauge(clean, description=name, tag_keys=keys)
                else:
                    self.metrics[name] = metrics.Histogram(
                        clean, description=name, boundaries=bounds, tag_keys=keys
                    )
            return self.metrics[name]

        with self.lock:
            for op in ops:
                kind, name, labels = op[0], op[1], op[2]
                tags = {**labels, "ReplicaId": ""}
                if kind == "counter":
                    if op[3]:
                        metric(kind, name, labels).inc(op[3], tags=tags)
                elif kind == "gauge":
                    metric(kind, name, labels).set(op[3], tags=tags)
                    self.gauges[name, tuple(sorted(tags.items()))] = op[3]
                else:
                    histogram = metric(kind, name, labels, op[3])
                    for _ in range(op[5]):
                        histogram.observe(op[4], tags=tags)
        return os.getpid()


def ray_page(ops_by_worker: dict[str, list[tuple[Any, ...]]]) -> str:
    """A Ray node page as Ray 2.60's OpenTelemetry recorder writes it (names, label set and
    suffixes as read off a real node's page), for the parse tests that need no cluster."""
    lines = []
    for worker, ops in ops_by_worker.items():
        observed: dict[tuple[str, str], tuple[list[float], list[tuple[float, int]]]] = {}
        for op in ops:
            kind, name, labels = op[0], op[1], op[2]
            tags = {"Component": "core_worker", "NodeAddress": "10.0.0.5", "ReplicaId": "",
                    "SessionName": "session_x", "Version": "2.60.0", "WorkerId": worker,
                    **labels}  # fmt: skip
            text = ",".join(f'{k}="{v}"' for k, v in sorted(tags.items()))
            if kind == "counter":
                lines.append(f"{ray_series_name(name)}_total{{{text}}} {op[3]}")
            elif kind == "gauge":
                lines.append(f"{ray_series_name(name)}{{{text}}} {op[3]}")
            else:
                observed.setdefault((name, text), (op[3], []))[1].append((op[4], op[5]))
        for (name, text), (bounds, values) in observed.items():
            for le in bounds:
                count = sum(times for value, times in values if value <= le)
                lines.append(f'{ray_series_name(name)}_bucket{{{text},le="{le}"}} {count}')
            total = sum(times for _, times in values)
            lines.append(f'{ray_series_name(name)}_bucket{{{text},le="+Inf"}} {total}')
            lines.append(f"{ray_series_name(name)}_count{{{text}}} {total}")
    return "\n".join(lines) + "\n"


def _later_ops() -> list[tuple[Any, ...]]:
    """The fixture's first page recorded, then the increase to its later page."""
    return recording_ops(V1_FIRST) + recording_ops(V1_LATER, V1_FIRST)


# ---- without a cluster --------------------------------------------------------------------------


def test_ray_names_are_vllms_sanitized_with_ray_prefix():
    assert ray_series_name("vllm:num_requests_running") == "ray_vllm_num_requests_running"
    assert ray_series_name("vllm:generation_tokens_total") == "ray_vllm_generation_tokens_total"


def test_a_ray_node_page_gives_one_engine_per_recording_worker_with_the_pages_values():
    """Two workers, both vLLM ``engine="0"`` (one engine per actor, as NeMo RL and verl run
    them), are two engines; each one's sample equals what the engine's own page gives."""
    first = ray_page({"a" * 56: recording_ops(V1_FIRST), "b" * 56: recording_ops(V1_FIRST)})
    engines = parse_ray_node_page(first)
    assert sorted(engines) == [f"worker={'a' * 12} engine=0", f"worker={'b' * 12} engine=0"]
    (own,) = parse_engine_page(V1_FIRST).values()
    for sample in engines.values():
        assert sample.kind == "vllm-v1"
        assert sample.counters == own.counters
        assert sample.gauges == own.gauges
        assert sample.histograms == own.histograms


def test_a_node_page_without_forwarded_engines_has_none():
    assert parse_ray_node_page('ray_node_mem_used{NodeAddress="10.0.0.5"} 1.0\n') == {}
    assert parse_ray_node_page('ray_vllm_something_else{WorkerId="a"} 1.0\n') == {}


def test_without_ray_the_ray_source_is_one_warning_and_the_run_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    rows: list[tuple[int, dict[str, float]]] = []
    monitor = RolloutMonitor([], emit=lambda s, v: rows.append((s, v)), source="ray",
                             collection_interval=3600)  # fmt: skip
    try:
        monitor.mark_step(1)
        assert monitor.flush()
        monitor.mark_step(2)
        assert monitor.flush()
    finally:
        monitor.close()
    assert [s for s, _ in rows] == [1, 2]
    assert rows[0][1] == {"rollout/engines_reporting": 0.0}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Ray is not initialized" in warnings[0], warnings


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="source must be one of http, ray"):
        RolloutMonitor([], emit=lambda s, v: None, source="k8s", start=False)


# ---- a real local Ray cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,  # the per-node agent that serves /metrics still starts
        object_store_memory=100 * 2**20,
        logging_level="ERROR",
        log_to_driver=False,
        # Workers push their metrics to the node's page every second instead of every 10 s.
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        yield ray, f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    finally:
        ray.shutdown()


def _page_values(url: str, series: str) -> list[float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [float(v) for v in re.findall(rf"^{series}{{[^}}]*}} (\S+)$", text, re.M)]


def _wait_for_page(url: str, want: dict[str, list[float]], timeout: float = 60.0) -> None:
    """Until the node's page shows every series with these values (one per worker)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {series: sorted(_page_values(url, series)) for series in want}
        if seen == {series: sorted(values) for series, values in want.items()}:
            return
        assert time.monotonic() < deadline, f"the node's page never showed {want}: {seen}"
        time.sleep(0.2)


def _shown_by_both(page: str) -> dict[str, list[float]]:
    """A counter, a gauge and a histogram of ``page`` as both workers' series should show them
    (a worker pushes all its metrics at once)."""
    values = {s.name: float(s.value) for f in text_string_to_metric_families(page)
              for s in f.samples}  # fmt: skip
    return {
        ray_series_name(name): [values[name]] * 2
        for name in ("vllm:generation_tokens_total", "vllm:num_requests_waiting",
                     "vllm:e2e_request_latency_seconds_count")
    }  # fmt: skip


@pytest.mark.slow
def test_rows_from_engines_forwarded_to_ray_equal_the_fixtures_expected_values(ray_cluster):
    """Two actors record the vLLM fixture's first page, the monitor (``source="ray"``, no URL)
    takes its baseline, the actors record the increase to the later page, and step 7 closes 10 s
    (test clock) later: each engine's rows are the fixture's expected values, the totals twice
    them (rates, counts, running/waiting) or the same (KV cache, hit rate, quantiles)."""
    ray, url = ray_cluster
    engine = ray.remote(num_cpus=0)(ForwardingEngine)
    actors = [engine.remote(), engine.remote()]
    ray.get([a.record.remote(recording_ops(V1_FIRST)) for a in actors])
    _wait_for_page(url, _shown_by_both(V1_FIRST))

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock, got, lock = Clock(), [], threading.Lock()

    def emit(step: int, values: dict[str, float]) -> None:
        with lock:
            got.append((step, values))

    monitor = RolloutMonitor([], emit=emit, source="ray", collection_interval=3600, clock=clock)
    try:
        assert monitor.wait_rounds(1)  # baseline at t=0
        clock.now = 5.0
        assert monitor.flush()
        ray.get([a.record.remote(recording_ops(V1_LATER, V1_FIRST)) for a in actors])
        _wait_for_page(url, _shown_by_both(V1_LATER))
        clock.now = 10.0
        monitor.mark_step(7)
        assert monitor.flush()
    finally:
        monitor.close()
    (values,) = [v for s, v in got if s == 7]
    kv, wait = V1_EXP["kv_cache_usage"], V1_EXP["num_requests_waiting"]
    ttft, e2e = V1_EXP["time_to_first_token_seconds"], V1_EXP["e2e_request_latency_seconds"]
    per_engine = {
        "gen_tokens_per_s": V1_EXP["generation_tokens_per_s"],
        "prompt_tokens_per_s": V1_EXP["prompt_tokens_per_s"],
        "requests_finished": V1_EXP["requests_finished"],
        "preemptions": V1_EXP["preemptions_delta"],
        "prefix_cache_hit_rate": V1_EXP["prefix_cache"]["hit_rate"],
        "requests_running_mean": 64.0,
        "requests_running_max": 64.0,
        "requests_waiting_mean": (wait["first"] * 2 + wait["later"]) / 3,
        "requests_waiting_max": wait["first"],
        "kv_cache_usage_mean": (kv["first"] * 2 + kv["later"]) / 3,
        "kv_cache_usage_max": kv["later"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "e2e_latency_p90_s": e2e["p90"],
    }
    assert values["rollout/engines_reporting"] == 2.0
    assert [e.kind for e in monitor.engines] == ["vllm-v1", "vllm-v1"]
    assert all(e.url == url and e.label.endswith("engine=0") for e in monitor.engines)
    summed = {"gen_tokens_per_s", "prompt_tokens_per_s", "requests_finished", "preemptions",
              "requests_running_mean", "requests_running_max", "requests_waiting_mean",
              "requests_waiting_max"}  # fmt: skip
    for name, value in per_engine.items():
        for engine_id in (0, 1):
            assert values[f"rollout/engine.{engine_id}.{name}"] == pytest.approx(
                value, rel=1e-12
            ), (engine_id, name)
        total = value * 2 if name in summed else value
        assert values[f"rollout/{name}"] == pytest.approx(total, rel=1e-12), name
    print("\nrow | fixture expected | engine 0 (via Ray) | all engines")
    for name, value in per_engine.items():
        one, every = values[f"rollout/engine.0.{name}"], values[f"rollout/{name}"]
        print(f"{name} | {value} | {one} | {every}")
