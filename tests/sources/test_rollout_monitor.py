"""RolloutMonitor against real HTTP servers on 127.0.0.1 serving successive engine pages.

Each server is ``http.server`` in a thread; the test swaps the page it serves between scrapes.
Scrape times come from a clock the test sets (the monitor's ``clock`` argument), so that rates
over the step are exact; scrapes themselves are real GETs on the monitor's own thread, triggered
by ``flush()`` or by the monitor's schedule. Tests wait on rounds and emissions, never on sleeps.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest

from otel_rl.rollout.monitor import RolloutMonitor
from testkit.otlp_receiver import closed_port
from testkit.rollout_pages import SG_EXP, SG_FIRST, SG_LATER, V1_EXP, V1_FIRST, V1_LATER, PageServer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rows:
    """The emit callback: records (step, values) and lets tests wait for a step."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.cond = threading.Condition()

    def __call__(self, step: int, values: dict[str, float]) -> None:
        with self.cond:
            self.rows.append((step, values))
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float = 20.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.rows), timeout)

    def step(self, step: int) -> dict[str, float]:
        (values,) = [v for s, v in self.rows if s == step]
        return values


@pytest.fixture
def servers():
    made: list[PageServer] = []

    def make(page: str = "") -> PageServer:
        server = PageServer(page)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def _three_rounds(monitor: RolloutMonitor, clock: Clock, switch) -> None:
    """Baseline scrape at t=0 (first pages), one at t=5 (first pages), step 7 marked at t=10
    and closed by the scrape at t=10 (later pages)."""
    assert monitor.wait_rounds(1)
    clock.now = 5.0
    assert monitor.flush()
    switch()
    clock.now = 10.0
    monitor.mark_step(7)
    assert monitor.flush()


def _mean(first: float, later: float) -> float:
    """Gauge mean of the first step: the scrapes at t=0 and t=5 (first page) and t=10 (later);
    the first step starts when the monitor does, so its baseline scrape is inside it."""
    return (first + first + later) / 3


def test_vllm_v1_rows_over_a_step_match_the_fixture_values(servers):
    server, clock, rows = servers(V1_FIRST), Clock(), Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=3600, clock=clock)
    try:
        _three_rounds(monitor, clock, lambda: setattr(server, "page", V1_LATER))
    finally:
        monitor.close()
    got = rows.step(7)
    kv, wait = V1_EXP["kv_cache_usage"], V1_EXP["num_requests_waiting"]
    ttft, e2e = V1_EXP["time_to_first_token_seconds"], V1_EXP["e2e_request_latency_seconds"]
    want = {
        "gen_tokens_per_s": 2560.0,
        "prompt_tokens_per_s": 4915.2,
        "requests_finished": 48.0,
        "preemptions": 2.0,
        "prefix_cache_hit_rate": 40960 / 49152,
        "requests_running_mean": 64.0,
        "requests_running_max": 64.0,
        "requests_waiting_mean": _mean(wait["first"], wait["later"]),
        "requests_waiting_max": 12.0,
        "kv_cache_usage_mean": _mean(kv["first"], kv["later"]),
        "kv_cache_usage_max": kv["later"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "e2e_latency_p90_s": e2e["p90"],
    }
    assert got["rollout/engines_reporting"] == 1.0
    for name, value in want.items():
        assert got[f"rollout/{name}"] == pytest.approx(value, rel=1e-12), name
        assert got[f"rollout/engine.0.{name}"] == pytest.approx(value, rel=1e-12), name
    assert [e.kind for e in monitor.engines] == ["vllm-v1"]
    assert monitor.engines[0].label == "0"


def test_sglang_rows_over_a_step_match_the_fixture_values(servers):
    server, clock, rows = servers(SG_FIRST), Clock(), Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=3600, clock=clock)
    try:
        _three_rounds(monitor, clock, lambda: setattr(server, "page", SG_LATER))
    finally:
        monitor.close()
    got = rows.step(7)
    kv, run, queue = SG_EXP["kv_cache_usage"], SG_EXP["num_running_reqs"], SG_EXP["num_queue_reqs"]
    ttft, e2e = SG_EXP["time_to_first_token_seconds"], SG_EXP["e2e_request_latency_seconds"]
    want = {
        "gen_tokens_per_s": 7040.0,
        "prompt_tokens_per_s": 15360.0,
        "requests_finished": 128.0,
        "prefix_cache_hit_rate": 128000 / 153600,
        "requests_running_mean": _mean(run["first"], run["later"]),
        "requests_running_max": 256.0,
        "requests_waiting_mean": _mean(queue["first"], queue["later"]),
        "requests_waiting_max": 40.0,
        "kv_cache_usage_mean": _mean(kv["first"], kv["later"]),
        "kv_cache_usage_max": kv["later"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "e2e_latency_p90_s": e2e["p90"],
    }
    for name, value in want.items():
        assert got[f"rollout/{name}"] == pytest.approx(value, rel=1e-12), name
        assert got[f"rollout/engine.0.{name}"] == pytest.approx(value, rel=1e-12), name
    assert "rollout/preemptions" not in got  # no retraction counter in this release
    assert [e.kind for e in monitor.engines] == ["sglang"]


# ---- vLLM V0: a page built with prometheus_client from vllm/engine/metrics.py's definitions ----

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


def v0_pages() -> tuple[str, str]:
    """Two scrapes of a V0 engine (``model_name`` label only, no ``_created``, as vLLM's V0
    frontend disables them), 10 s apart. Between them: 20480 prompt and 40960 generation tokens,
    18 + 2 finished requests, 1 preemption, 20 TTFT and 20 e2e observations."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name"]

    def gauge(name: str) -> Gauge:
        return Gauge(name, name, labels, registry=reg)

    running, waiting = gauge("vllm:num_requests_running"), gauge("vllm:num_requests_waiting")
    swapped = gauge("vllm:num_requests_swapped")
    gpu_kv, cpu_kv = gauge("vllm:gpu_cache_usage_perc"), gauge("vllm:cpu_cache_usage_perc")
    gpu_hit, cpu_hit = (
        gauge("vllm:gpu_prefix_cache_hit_rate"),
        gauge("vllm:cpu_prefix_cache_hit_rate"),
    )
    preempt = Counter("vllm:num_preemptions", "p", labels, registry=reg)
    prompt = Counter("vllm:prompt_tokens", "p", labels, registry=reg)
    gen = Counter("vllm:generation_tokens", "g", labels, registry=reg)
    success = Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, buckets=TTFT_BUCKETS,
                     registry=reg)  # fmt: skip
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e", labels, buckets=E2E_BUCKETS,
                    registry=reg)  # fmt: skip
    m = {"model_name": "meta-llama/Llama-3.1-8B-Instruct"}

    def render() -> str:
        text = generate_latest(reg).decode()
        return "\n".join(line for line in text.splitlines() if "_created" not in line) + "\n"

    running.labels(**m).set(32)
    waiting.labels(**m).set(4)
    swapped.labels(**m).set(0)
    gpu_kv.labels(**m).set(0.5)
    cpu_kv.labels(**m).set(0.0)
    gpu_hit.labels(**m).set(0.25)
    cpu_hit.labels(**m).set(0.0)
    preempt.labels(**m).inc(3)
    prompt.labels(**m).inc(10000)
    gen.labels(**m).inc(50000)
    success.labels(**m, finished_reason="stop").inc(90)
    success.labels(**m, finished_reason="length").inc(10)
    for _ in range(100):
        ttft.labels(**m).observe(0.05)
        e2e.labels(**m).observe(3.0)
    first = render()

    running.labels(**m).set(30)
    waiting.labels(**m).set(2)
    gpu_kv.labels(**m).set(0.75)
    gpu_hit.labels(**m).set(0.5)
    preempt.labels(**m).inc(1)
    prompt.labels(**m).inc(20480)
    gen.labels(**m).inc(40960)
    success.labels(**m, finished_reason="stop").inc(18)
    success.labels(**m, finished_reason="length").inc(2)
    for value, times in ((0.3, 10), (0.9, 9), (3.0, 1)):
        for _ in range(times):
            ttft.labels(**m).observe(value)
    for value, times in ((7.0, 12), (12.0, 5), (100.0, 3)):
        for _ in range(times):
            e2e.labels(**m).observe(value)
    return first, render()


def test_vllm_v0_rows_over_a_step_match_hand_derived_values(servers):
    first, later = v0_pages()
    server, clock, rows = servers(first), Clock(), Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=3600, clock=clock)
    try:
        _three_rounds(monitor, clock, lambda: setattr(server, "page", later))
    finally:
        monitor.close()
    got = rows.step(7)
    want = {
        "gen_tokens_per_s": 4096.0,
        "prompt_tokens_per_s": 2048.0,
        "requests_finished": 20.0,
        "preemptions": 1.0,
        "requests_running_mean": (32 + 32 + 30) / 3,
        "requests_running_max": 32.0,
        "requests_waiting_mean": (4 + 4 + 2) / 3,
        "requests_waiting_max": 4.0,
        "kv_cache_usage_mean": (0.5 + 0.5 + 0.75) / 3,
        "kv_cache_usage_max": 0.75,
        # V0 has only a hit-rate gauge: its mean over the step's scrapes (0.25, 0.25, 0.5).
        "prefix_cache_hit_rate": 1.0 / 3,
        # TTFT increases: 10 in (0.25, 0.5], 9 in (0.75, 1.0], 1 in (2.5, 5.0].
        "ttft_p50_s": 0.5,
        "ttft_p90_s": 0.75 + 0.25 * 8 / 9,
        # e2e: 12 in (5, 10], 5 in (10, 15], 3 above 60: rank 18 falls in +Inf -> 60.
        "e2e_latency_p90_s": 60.0,
    }
    for name, value in want.items():
        assert got[f"rollout/{name}"] == pytest.approx(value, rel=1e-12), name
        assert got[f"rollout/engine.0.{name}"] == pytest.approx(value, rel=1e-12), name
    assert [e.kind for e in monitor.engines] == ["vllm-v0"]


# ---- failures ---------------------------------------------------------------------------------


def _without_prefix_cache(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "vllm:prefix_cache_" not in line) + "\n"


def test_restart_missing_metric_and_dead_engine_leave_the_others_intact(servers, caplog):
    """Engine 0 restarts during the step (its page goes from the later to the first scrape),
    engine 1 is an older vLLM without prefix-cache counters, and a third endpoint refuses
    connections. One warning each, over several steps; no negative value anywhere."""
    restarting = servers(V1_LATER)
    older = servers(_without_prefix_cache(V1_FIRST))
    dead = f"http://127.0.0.1:{closed_port()}/metrics"
    clock, rows = Clock(), Rows()
    caplog.set_level(logging.WARNING, logger="otel_rl")
    monitor = RolloutMonitor(
        [restarting.url, older.url, dead], emit=rows, collection_interval=3600, clock=clock
    )
    try:
        assert monitor.wait_rounds(1)
        restarting.page = V1_FIRST
        older.page = _without_prefix_cache(V1_LATER)
        clock.now = 10.0
        monitor.mark_step(1)
        assert monitor.flush()
        clock.now = 20.0  # nothing changes: a step of zeros, and no new warnings
        monitor.mark_step(2)
        assert monitor.flush()
    finally:
        monitor.close()
    got = rows.step(1)
    assert got["rollout/engines_reporting"] == 2.0
    # Engine 0 after the restart: every counter counted from zero, i.e. the page's own values.
    assert got["rollout/engine.0.requests_finished"] == 36871 + 4102 + 263
    assert got["rollout/engine.0.gen_tokens_per_s"] == 2.3062598e07 / 10.0
    assert got["rollout/engine.0.prefix_cache_hit_rate"] == 3.4815488e07 / 4.218624e07
    # Engine 1 is unaffected by its neighbours; its missing metric only removes its own row.
    assert got["rollout/engine.1.requests_finished"] == 48.0
    assert got["rollout/engine.1.gen_tokens_per_s"] == 2560.0
    assert got["rollout/engine.1.ttft_p50_s"] == pytest.approx(1.75, rel=1e-12)
    assert "rollout/engine.1.prefix_cache_hit_rate" not in got
    assert got["rollout/requests_finished"] == 41236 + 48
    assert got["rollout/prefix_cache_hit_rate"] == 3.4815488e07 / 4.218624e07
    assert all(v >= 0 for _, values in rows.rows for v in values.values())
    second = rows.step(2)
    assert second["rollout/requests_finished"] == 0.0
    assert second["rollout/gen_tokens_per_s"] == 0.0
    assert "rollout/ttft_p50_s" not in second  # no request finished: no quantile
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum(dead in w for w in warnings) == 1, warnings
    assert sum("restarted" in w for w in warnings) == 1, warnings
    assert sum("prefix_cache_hit_rate" in w for w in warnings) == 1, warnings
    assert len(warnings) == 3, warnings
    assert monitor.stats["restarts"] == 1


# ---- the background thread, endpoints added at run time -----------------------------------------


def test_steps_are_emitted_by_the_background_scrapes_and_new_endpoints_get_the_next_id(servers):
    """Real clock, scrapes every 50 ms, no flush: each marked step is emitted by the monitor's
    own schedule. An endpoint added at run time becomes engine 1; the SGLang page advancing once
    shows up as exactly 128 finished requests over all steps."""
    sglang, vllm = servers(SG_FIRST), servers(V1_FIRST)
    rows = Rows()
    monitor = RolloutMonitor([sglang.url], emit=rows, collection_interval=0.05)
    try:
        for step in range(1, 4):
            monitor.mark_step(step)
            assert rows.wait_for(lambda r, s=step: any(x == s for x, _ in r)), step
        monitor.add_endpoints(["127.0.0.1:" + vllm.url.split(":")[2].split("/")[0]])
        sglang.page = SG_LATER
        step = 3
        while True:  # until engine 1 has a full step (its first scrape only opens a window)
            step += 1
            monitor.mark_step(step)
            assert rows.wait_for(lambda r, s=step: any(x == s for x, _ in r)), step
            if "rollout/engine.1.requests_finished" in rows.step(step):
                break
            assert step < 50
    finally:
        monitor.close()
    assert [(e.id, e.url, e.kind) for e in monitor.engines] == [
        (0, sglang.url, "sglang"),
        (1, vllm.url, "vllm-v1"),
    ]
    steps = [s for s, _ in rows.rows]
    assert steps == sorted(steps)
    finished = sum(v.get("rollout/engine.0.requests_finished", 0.0) for _, v in rows.rows)
    assert finished == 128.0
    assert rows.step(step)["rollout/engine.1.requests_finished"] == 0.0


def test_sd_file_lists_the_endpoints_for_the_collector(servers, tmp_path):
    monitor = RolloutMonitor(
        ["10.0.0.5:8000", "http://10.0.0.6:30000/metrics"], emit=Rows(), start=False
    )
    monitor.add_endpoints("http://10.0.0.7:8000/")
    path = monitor.write_sd_file(tmp_path / "sd" / "rollout.json")
    assert json.loads(path.read_text()) == [
        {
            "targets": ["10.0.0.5:8000", "10.0.0.6:30000", "10.0.0.7:8000"],
            "labels": {
                "__metrics_path__": "/metrics",
                "__scheme__": "http",
                "otel_rl_role": "rollout",
            },
        }
    ]
    monitor.close()


def test_bad_configuration_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="engine must be one of"):
        RolloutMonitor([], emit=Rows(), engine="tgi", start=False)
    with pytest.raises(ValueError, match="collection_interval"):
        RolloutMonitor([], emit=Rows(), collection_interval=0, start=False)
    with pytest.raises(ValueError, match="not an endpoint URL"):
        RolloutMonitor(["http://"], emit=Rows(), start=False)
    with pytest.raises(ValueError, match="unknown keys"):
        RolloutMonitor.from_config({"endpoints": [], "interval": 5}, emit=Rows())


def test_flush_from_the_emit_callback_is_refused_not_a_deadlock(servers):
    server = servers(V1_FIRST)
    errors: list[BaseException] = []
    done = threading.Event()
    monitor: RolloutMonitor

    def emit(step: int, values: dict[str, float]) -> None:
        try:
            monitor.flush(1.0)
        except RuntimeError as exc:
            errors.append(exc)
        done.set()

    monitor = RolloutMonitor([server.url], emit=emit, collection_interval=3600)
    try:
        monitor.mark_step(1)
        assert monitor.flush()
        assert done.wait(10)
    finally:
        monitor.close()
    assert len(errors) == 1 and "emit callback" in str(errors[0])
