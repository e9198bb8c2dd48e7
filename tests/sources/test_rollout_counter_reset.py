"""An inference engine restarting mid-run: its counters start over from 0, and the rollout rows
that reach the trackers are computed from what the engine did after the restart, never from a
negative difference.

Real HTTP servers on 127.0.0.1 serve the vLLM V1 and SGLang fixture pages to the Logger's
RolloutMonitor; between scrapes the test swaps a page for the restarted engine's page, built from
the same fixtures: every counter and histogram series holds what the fixture's interval adds
(later page minus first page), i.e. an engine that restarted and then did exactly the fixture's
interval of work, so the expected rows are the fixture's expected values. The rows are read back
from the JSONL file.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from otel_rl import Logger
from otel_rl.rollout.engines import parse_engine_page
from otel_rl.rollout.rows import EngineWindow, engine_rows
from testkit.readers import jsonl_rows
from testkit.rollout_pages import SG_EXP, SG_FIRST, SG_LATER, V1_EXP, V1_FIRST, V1_LATER, PageServer

#: When a restarted engine's series were created, in seconds after the fixture's.
RESTART_AFTER = 3600.0


def _split(line: str) -> tuple[str, str, float]:
    """``(name, series, value)`` of a sample line; ``series`` is the line without its value."""
    series, _, value = line.rpartition(" ")
    return series.split("{", 1)[0], series, float(value)


def _series_values(text: str) -> dict[str, float]:
    return {series: value for series, value in (_split(ln)[1:] for ln in _samples(text))}


def _samples(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


def rewrite(template: str, value: Callable[[str, str, float, bool], float]) -> str:
    """``template`` with every sample's value replaced by ``value(name, series, old, cumulative)``;
    ``cumulative`` is true for counter and histogram series (not their ``_created`` times)."""
    out, kind = [], ""
    for line in template.splitlines():
        if line.startswith("# TYPE "):
            kind = line.split()[3]
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name, series, old = _split(line)
        cumulative = kind in ("counter", "histogram") and not name.endswith("_created")
        out.append(f"{series} {value(name, series, old, cumulative)!r}")
    return "\n".join(out) + "\n"


def restarted(
    first: str, later: str, intervals: float = 1.0, restart_at: float = RESTART_AFTER
) -> str:
    """The page of an engine that restarted ``restart_at`` seconds after the ``later`` page's
    series were created and has since done ``intervals`` times the work between the fixture's
    ``first`` and ``later`` pages; gauges as on ``later``."""
    before = _series_values(first)

    def value(name: str, series: str, old: float, cumulative: bool) -> float:
        if name.endswith("_created"):
            return old + restart_at
        return intervals * (old - before[series]) if cumulative else old

    return rewrite(later, value)


def with_values(page: str, changes: dict[str, float]) -> str:
    """``page`` with the samples of the metrics named in ``changes`` set to the given value."""
    return rewrite(page, lambda name, series, old, cumulative: changes.get(name, old))


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def engines():
    vllm, sglang = PageServer(V1_LATER), PageServer(SG_LATER)
    yield vllm, sglang
    vllm.close()
    sglang.close()


def run_steps(log_dir, vllm, sglang, pages: list[tuple[str, str]]) -> tuple[dict, float]:
    """Scrape once, then per step serve its ``(vLLM, SGLang)`` pages and close the step with a
    flush; returns the JSONL rollout rows by step and an upper bound of every step's seconds."""
    cfg = {
        "log_dir": str(log_dir),
        "rollout_monitoring": {
            "endpoints": [vllm.url, sglang.url],
            "collection_interval": 3600,  # only the opening scrape and the flushes
        },
    }
    began = time.monotonic()
    with Logger(cfg) as logger:
        monitor = logger.rollout_monitor
        _wait_for(lambda: monitor.stats["rounds"] >= 1)
        for step, (vllm_page, sglang_page) in enumerate(pages):
            vllm.page, sglang.page = vllm_page, sglang_page
            logger.log_metrics({"reward": float(step)}, step=step)
            assert logger.flush(timeout=30)
        bound = time.monotonic() - began
        restarts = monitor.stats["restarts"]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    rollout = {r["step"]: r["metrics"] for r in rows if r.get("axis") == "rollout/step"}
    for values in rollout.values():  # nothing negative, ever
        assert all(v >= 0 for v in values.values()), values
    return {"rows": rollout, "restarts": restarts}, bound


def assert_one_fixture_interval(row: dict, bound: float, hits: dict[int, float] | None = None):
    """The rows of one fixture interval of work per engine (engine 0 vLLM, engine 1 SGLang),
    with ``hits`` prefix-cache hit tokens instead of the fixture's where given."""
    hits = hits or {}
    fixtures = {0: V1_EXP, 1: SG_EXP}
    queries = {0: V1_EXP["prefix_cache"]["queries_delta_tokens"],
               1: SG_EXP["prefix_cache"]["prompt_tokens_delta"]}  # fmt: skip
    hit_tokens = {0: hits.get(0, V1_EXP["prefix_cache"]["hits_delta_tokens"]),
                  1: hits.get(1, SG_EXP["prefix_cache"]["cached_tokens_delta"])}  # fmt: skip
    for engine, exp in fixtures.items():
        head = f"rollout/engine.{engine}."
        assert row[head + "requests_finished"] == exp["requests_finished"]
        for name, source, q in (
            ("ttft_p50_s", "time_to_first_token_seconds", "p50"),
            ("ttft_p90_s", "time_to_first_token_seconds", "p90"),
            ("e2e_latency_p90_s", "e2e_request_latency_seconds", "p90"),
        ):
            assert row[head + name] == pytest.approx(exp[source][q], rel=1e-12), (engine, name)
        assert row[head + "prefix_cache_hit_rate"] == hit_tokens[engine] / queries[engine]
        # The rate is the post-restart value over the step's seconds: both token rates share
        # those seconds, so their ratio is exact, and the seconds are no longer than the run.
        gen, prompt = row[head + "gen_tokens_per_s"], row[head + "prompt_tokens_per_s"]
        assert gen / prompt == pytest.approx(
            exp["generation_tokens_delta"] / exp["prompt_tokens_delta"], rel=1e-12
        )
        assert 0 < exp["generation_tokens_delta"] / gen <= bound
    assert row["rollout/engine.0.preemptions"] == V1_EXP["preemptions_delta"]
    assert (
        row["rollout/requests_finished"]
        == V1_EXP["requests_finished"] + SG_EXP["requests_finished"]
    )
    assert row["rollout/engines_reporting"] == 2.0


def test_a_restart_between_scrapes_gives_the_rows_of_the_post_restart_counters(engines, log_dir):
    """Both engines have run for long (their later page) when monitoring starts; during step 0
    they restart and do one fixture interval of work; during step 1 one more. Step 0's rows are
    that interval's, from the post-restart values (not the negative difference to the old ones),
    and step 1 counts from the post-restart page."""
    vllm, sglang = engines
    pages = [
        (restarted(V1_FIRST, V1_LATER), restarted(SG_FIRST, SG_LATER)),
        (restarted(V1_FIRST, V1_LATER, 2), restarted(SG_FIRST, SG_LATER, 2)),
    ]
    got, bound = run_steps(log_dir, vllm, sglang, pages)
    assert sorted(got["rows"]) == [0, 1]
    assert_one_fixture_interval(got["rows"][0], bound)
    assert_one_fixture_interval(got["rows"][1], bound)
    assert got["restarts"] == 2  # each engine once, in step 0


def test_a_restart_counts_every_series_of_the_engine_from_zero_even_those_that_grew(
    engines, log_dir
):
    """Both engines are young when monitoring starts (one fixture interval since they started).
    During step 0 they restart and do the same work again, but with a cold prefix cache: the
    prefix-cache hits are the only counter below its old value; every other counter and
    histogram is back where it was. The engine restarted, so all of its series count from zero:
    step 0 has one interval of requests, tokens and latencies, and the cold cache's hit rate."""
    vllm, sglang = engines
    young = (restarted(V1_FIRST, V1_LATER), restarted(SG_FIRST, SG_LATER))
    cold = {0: 4096.0, 1: 12800.0}
    again = (
        restarted(V1_FIRST, V1_LATER, restart_at=2 * RESTART_AFTER),
        restarted(SG_FIRST, SG_LATER, restart_at=2 * RESTART_AFTER),
    )
    pages = [
        (
            with_values(again[0], {"vllm:prefix_cache_hits_total": cold[0]}),
            with_values(again[1], {"sglang:cached_tokens_total": cold[1]}),
        ),
        # Step 1: the restarted engines do one more interval, their cache warm again.
        (
            with_values(
                restarted(V1_FIRST, V1_LATER, 2, restart_at=2 * RESTART_AFTER),
                {"vllm:prefix_cache_hits_total": cold[0] + 40960},
            ),
            with_values(
                restarted(SG_FIRST, SG_LATER, 2, restart_at=2 * RESTART_AFTER),
                {"sglang:cached_tokens_total": cold[1] + 128000},
            ),
        ),
    ]
    vllm.page, sglang.page = young
    got, bound = run_steps(log_dir, vllm, sglang, pages)
    assert_one_fixture_interval(got["rows"][0], bound, hits=cold)
    assert_one_fixture_interval(got["rows"][1], bound)
    assert got["restarts"] == 2


def test_a_series_that_went_back_restarts_the_whole_engine_in_its_window():
    """The same at the level of one engine's window, on the parsed fixture pages: after a
    restart seen on one counter, every counter's increase is its new value."""
    young = restarted(V1_FIRST, V1_LATER)
    after = with_values(young, {"vllm:num_preemptions_total": 0.0})
    window = EngineWindow()
    window.add(parse_engine_page(young)["0"], 0.0)
    window.close()
    went_back = window.add(parse_engine_page(after)["0"], 10.0)
    assert went_back == ["vllm:num_preemptions_total"]
    rows = engine_rows(window.close())
    assert rows["requests_finished"] == V1_EXP["requests_finished"]
    assert rows["gen_tokens_per_s"] == V1_EXP["generation_tokens_per_s"]
    assert rows["prompt_tokens_per_s"] == V1_EXP["prompt_tokens_per_s"]
    assert rows["preemptions"] == 0.0
    assert rows["ttft_p50_s"] == pytest.approx(V1_EXP["time_to_first_token_seconds"]["p50"])
    assert rows["prefix_cache_hit_rate"] == V1_EXP["prefix_cache"]["hit_rate"]


def test_a_reset_of_one_labelled_series_is_a_restart_even_when_the_sum_grew():
    """``requests_finished`` sums ``vllm:request_success_total`` over ``finished_reason``. The
    young engine restarts and finishes its requests differently: 50 stop, no length, 48 before
    (46 stop, 2 length). The sum grew, but the ``length`` series went down: a restart, so the
    step has the 50 requests, not 2, and the other counters count from zero too."""
    young = restarted(V1_FIRST, V1_LATER)

    def finished(name: str, series: str, old: float, cumulative: bool) -> float:
        if name != "vllm:request_success_total":
            return old
        reason = re.search(r'finished_reason="([^"]*)"', series)
        assert reason is not None
        return {"stop": 50.0, "length": 0.0}.get(reason.group(1), old)

    after = rewrite(young, finished)
    window = EngineWindow()
    window.add(parse_engine_page(young)["0"], 0.0)
    window.close()
    assert window.add(parse_engine_page(after)["0"], 10.0) == ["vllm:request_success_total"]
    rows = engine_rows(window.close())
    assert rows["requests_finished"] == 50.0
    assert rows["gen_tokens_per_s"] == V1_EXP["generation_tokens_per_s"]
    assert rows["preemptions"] == V1_EXP["preemptions_delta"]


def test_a_series_missing_from_one_scrape_is_no_restart_and_counts_from_its_last_value():
    """A labelled series absent from one scrape (the ``stop`` series of
    ``vllm:request_success_total``) is not a reset of the sum: the interval counts the other
    series, and when it is back it adds what it gained since it was last seen."""
    young = restarted(V1_FIRST, V1_LATER)
    stop = 'finished_reason="stop"'
    without_stop = "\n".join(
        ln for ln in young.splitlines()
        if not (ln.startswith("vllm:request_success_total{") and stop in ln)
    ) + "\n"  # fmt: skip

    def stop_plus_ten(name: str, series: str, old: float, cumulative: bool) -> float:
        return old + 10 if name == "vllm:request_success_total" and stop in series else old

    window = EngineWindow()
    window.add(parse_engine_page(young)["0"], 0.0)
    window.close()
    assert window.add(parse_engine_page(without_stop)["0"], 10.0) == []
    assert engine_rows(window.close())["requests_finished"] == 0.0
    assert window.add(parse_engine_page(rewrite(young, stop_plus_ten))["0"], 20.0) == []
    assert engine_rows(window.close())["requests_finished"] == 10.0
