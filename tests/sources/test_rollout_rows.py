"""Engine pages -> per-engine samples -> rows, without the network: recognition of the engine
kind, the shipped fixture pairs against their expected values, PromQL quantile semantics,
counter resets and mixed bucket layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_rl.rollout.engines import NotAnEnginePage, parse_engine_page
from otel_rl.rollout.rows import (
    EngineWindow,
    combine,
    engine_rows,
    histogram_quantile,
    merge_histograms,
)

FIXTURES = Path(__file__).resolve().parents[2] / "testkit" / "fixtures" / "rollout"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _two_scrapes(first: str, later: str, seconds: float = 10.0) -> dict[str, float]:
    a, b = parse_engine_page(first), parse_engine_page(later)
    (key,) = a
    window = EngineWindow()
    window.add(a[key], 0.0)
    window.close()  # the baseline belongs to the previous step
    window.add(b[key], seconds)
    part = window.close()
    assert part is not None
    return engine_rows(part)


def _quantiles(hist: dict) -> tuple[list[float], list[float]]:
    bounds = [float(le) for le in hist["bucket_increase"] if le != "+Inf"]
    counts = [float(v) for v in hist["bucket_increase"].values()]
    return bounds, counts


def test_vllm_v1_fixture_pair_gives_the_expected_rows():
    exp = expected("vllm-v1-expected.json")
    rows = _two_scrapes(page("vllm-v1-8gpu-tp.prom"), page("vllm-v1-8gpu-tp.later.prom"))
    assert rows["gen_tokens_per_s"] == exp["generation_tokens_per_s"] == 2560.0
    assert rows["prompt_tokens_per_s"] == exp["prompt_tokens_per_s"] == 4915.2
    assert rows["requests_finished"] == exp["requests_finished"] == 48
    assert rows["preemptions"] == exp["preemptions_delta"] == 2
    assert rows["prefix_cache_hit_rate"] == exp["prefix_cache"]["hit_rate"]
    # Only the closing scrape is inside the step here: mean = max = the later value.
    assert rows["kv_cache_usage_mean"] == exp["kv_cache_usage"]["later"]
    assert rows["requests_waiting_max"] == exp["num_requests_waiting"]["later"] == 9
    assert rows["ttft_p50_s"] == pytest.approx(exp["time_to_first_token_seconds"]["p50"], rel=1e-12)
    assert rows["ttft_p90_s"] == pytest.approx(exp["time_to_first_token_seconds"]["p90"], rel=1e-12)
    assert rows["e2e_latency_p90_s"] == pytest.approx(
        exp["e2e_request_latency_seconds"]["p90"], rel=1e-12
    )


def test_sglang_fixture_pair_gives_the_expected_rows():
    exp = expected("sglang-expected.json")
    rows = _two_scrapes(page("sglang-4gpu.prom"), page("sglang-4gpu.later.prom"))
    assert rows["gen_tokens_per_s"] == exp["generation_tokens_per_s"] == 7040.0
    assert rows["prompt_tokens_per_s"] == exp["prompt_tokens_per_s"] == 15360.0
    assert rows["requests_finished"] == exp["requests_finished"] == 128
    assert rows["prefix_cache_hit_rate"] == exp["prefix_cache"]["hit_rate"]
    assert rows["kv_cache_usage_max"] == exp["kv_cache_usage"]["later"]
    assert rows["requests_running_mean"] == exp["num_running_reqs"]["later"] == 248
    assert rows["requests_waiting_mean"] == exp["num_queue_reqs"]["later"] == 31
    assert rows["ttft_p50_s"] == pytest.approx(exp["time_to_first_token_seconds"]["p50"], rel=1e-12)
    assert rows["ttft_p90_s"] == pytest.approx(exp["time_to_first_token_seconds"]["p90"], rel=1e-12)
    assert rows["e2e_latency_p90_s"] == pytest.approx(
        exp["e2e_request_latency_seconds"]["p90"], rel=1e-12
    )
    # This SGLang release has no retraction counter: no preemptions row rather than a guess.
    assert "preemptions" not in rows


@pytest.mark.parametrize(
    ("fixture", "histogram"),
    [
        ("vllm-v1-expected.json", "time_to_first_token_seconds"),
        ("vllm-v1-expected.json", "e2e_request_latency_seconds"),
        ("vllm-v1-expected.json", "inter_token_latency_seconds"),
        ("vllm-v1-expected.json", "request_queue_time_seconds"),
        ("sglang-expected.json", "time_to_first_token_seconds"),
        ("sglang-expected.json", "e2e_request_latency_seconds"),
        ("sglang-expected.json", "inter_token_latency_seconds"),
        ("sglang-expected.json", "func_latency_seconds_generate_request"),
    ],
)
def test_histogram_quantile_matches_promql_on_every_fixture_histogram(fixture, histogram):
    hist = expected(fixture)[histogram]
    bounds, counts = _quantiles(hist)
    for q in ("p50", "p90", "p99"):
        got = histogram_quantile(int(q[1:]) / 100, bounds, counts)
        assert got == pytest.approx(hist[q], abs=1e-6), q


def test_histogram_quantile_edge_cases():
    assert histogram_quantile(0.5, [1.0, 2.0], [0.0, 0.0, 0.0]) is None  # nothing observed
    assert histogram_quantile(0.9, [1.0, 2.0], [1.0, 1.0, 10.0]) == 2.0  # rank in +Inf
    assert histogram_quantile(0.5, [1.0, 2.0], [4.0, 4.0, 4.0]) == 0.5  # first bucket from 0


def test_engine_kind_is_recognised_from_the_names():
    assert {s.kind for s in parse_engine_page(page("vllm-v1-8gpu-tp.prom")).values()} == {
        "vllm-v1"
    }
    assert {s.kind for s in parse_engine_page(page("sglang-4gpu.prom")).values()} == {"sglang"}
    v0 = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        "# TYPE vllm:num_requests_swapped gauge\n"
        'vllm:num_requests_swapped{model_name="m"} 0.0\n'
    )
    (sample,) = parse_engine_page(v0).values()
    assert sample.kind == "vllm-v0"
    assert sample.gauges == {"kv_usage": 0.5}
    assert sample.sources["kv_usage"] == "vllm:gpu_cache_usage_perc"


def test_a_forced_engine_kind_refuses_the_other_engines_page():
    with pytest.raises(NotAnEnginePage, match="sglang"):
        parse_engine_page(page("vllm-v1-8gpu-tp.prom"), engine="sglang")
    with pytest.raises(NotAnEnginePage, match="vLLM"):
        parse_engine_page(page("sglang-4gpu.prom"), engine="vllm")
    with pytest.raises(NotAnEnginePage):
        parse_engine_page("# TYPE up gauge\nup 1\n")
    with pytest.raises(ValueError, match="engine must be one of"):
        parse_engine_page(page("sglang-4gpu.prom"), engine="tgi")


def test_several_engines_behind_one_vllm_server_are_told_apart():
    text = page("vllm-v1-8gpu-tp.prom")
    second = [
        line.replace('engine="0"', 'engine="1"').replace("} 64.0", "} 7.0")
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    ]
    engines = parse_engine_page(text + "\n".join(second) + "\n")
    assert list(engines) == ["0", "1"]
    assert engines["0"].gauges["running"] == 64.0
    assert engines["1"].gauges == {"running": 7.0}


def test_a_restarted_engine_counts_from_zero_never_negative():
    later, first = page("vllm-v1-8gpu-tp.later.prom"), page("vllm-v1-8gpu-tp.prom")
    window = EngineWindow()
    window.add(parse_engine_page(later)["0"], 0.0)
    went_back = window.add(parse_engine_page(first)["0"], 10.0)
    assert "vllm:generation_tokens_total" in went_back
    rows = engine_rows(window.close())
    assert rows["requests_finished"] == 36871 + 4102 + 263 + 0  # the page after the restart
    assert rows["gen_tokens_per_s"] == 2.3062598e07 / 10.0
    assert all(v >= 0 for v in rows.values())


def test_engines_with_different_bucket_layouts_merge_on_shared_bounds():
    from otel_rl.rollout.engines import Histogram

    a = Histogram((0.1, 0.2, 0.5, 1.0), (0.0, 2.0, 4.0, 10.0, 10.0))
    b = Histogram((0.2, 1.0), (1.0, 5.0, 6.0))
    merged = merge_histograms([a, b])
    assert merged == Histogram((0.2, 1.0), (3.0, 15.0, 16.0))


def test_combine_sums_rates_and_weighs_the_prefix_hit_rate_by_tokens():
    first, later = page("vllm-v1-8gpu-tp.prom"), page("vllm-v1-8gpu-tp.later.prom")
    sg_first, sg_later = page("sglang-4gpu.prom"), page("sglang-4gpu.later.prom")
    parts = {}
    for number, (a, b) in enumerate(((first, later), (sg_first, sg_later))):
        (sa,), (sb,) = parse_engine_page(a).values(), parse_engine_page(b).values()
        window = EngineWindow()
        window.add(sa, 0.0)
        window.close()
        window.add(sb, 10.0)
        parts[number] = window.close()
    rows = combine(parts, {"running": [64.0 + 248.0], "waiting": [9.0 + 31.0]})
    assert rows["gen_tokens_per_s"] == 2560.0 + 7040.0
    assert rows["requests_finished"] == 48 + 128
    assert rows["preemptions"] == 2  # SGLang has none: the sum of those that have it
    assert rows["prefix_cache_hit_rate"] == (40960 + 128000) / (49152 + 153600)
    assert rows["requests_running_mean"] == 64 + 248
    assert rows["requests_running_max"] == 312
    kv = expected("vllm-v1-expected.json")["kv_cache_usage"]["later"]
    kv_sg = expected("sglang-expected.json")["kv_cache_usage"]["later"]
    assert rows["kv_cache_usage_mean"] == (kv + kv_sg) / 2
    assert rows["kv_cache_usage_max"] == max(kv, kv_sg)
    # TTFT over both engines: the two delta histograms added on the bounds both layouts have
    # (0.1, 1, 10, 20, 40, 80): at le=1 12 + 2 observations, at le=10 48 + 127, of 176.
    assert rows["ttft_p50_s"] == pytest.approx(1.0 + 9.0 * (88 - 14) / (175 - 14), rel=1e-12)
