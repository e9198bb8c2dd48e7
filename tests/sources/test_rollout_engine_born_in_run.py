"""An engine that starts during the run and is first seen with its first requests already
counted: its first sample is no baseline, those requests are the step's.

Real HTTP servers on 127.0.0.1 serve vLLM V1 pages built from the fixture pages. A vLLM server
already read once gets a second engine (``engine="1"``, data parallelism) whose series first show
one fixture interval of work (the later page minus the first): a page read before without it
says it started since. A server whose first good page comes only then holds an engine that may
have run before the run: its first sample stays a baseline, as an engine's at the monitor's start.
"""

from __future__ import annotations

import threading

import pytest

from otel_rl.rollout.monitor import RolloutMonitor
from testkit.rollout_pages import V1_EXP, V1_FIRST, V1_LATER, PageServer


def _split(line: str) -> tuple[str, str, float]:
    series, _, value = line.rpartition(" ")
    return series.split("{", 1)[0], series, float(value)


def with_new_engine(first: str, later: str) -> str:
    """``first`` with a second engine (``engine="1"``) beside its engine 0, each series after
    engine 0's: an engine that started from zero and has since done the work between the
    fixture's two pages (counters and histograms: later minus first; gauges: as later)."""
    later_values = {
        series: value
        for series, value in (_split(line)[1:] for line in later.splitlines()
                              if line and not line.startswith("#"))
    }  # fmt: skip
    out, kind = [], ""
    for line in first.splitlines():
        out.append(line)
        if line.startswith("# TYPE "):
            kind = line.split()[3]
        if not line or line.startswith("#") or 'engine="0"' not in line:
            continue
        name, series, old = _split(line)
        new = later_values[series]
        if name.endswith("_created"):
            value = new + 600.0  # created during the run, after the fixture's engine
        elif kind in ("counter", "histogram"):
            value = new - old
        else:
            value = new
        out.append(series.replace('engine="0"', 'engine="1"') + f" {value!r}")
    return "\n".join(out) + "\n"


@pytest.fixture
def servers():
    grown, late = PageServer(V1_FIRST), PageServer("")
    yield grown, late
    grown.close()
    late.close()


def test_an_engine_new_since_its_page_was_read_counts_its_first_requests(servers):
    grown, late = servers
    got: dict[int, dict[str, float]] = {}
    cond = threading.Condition()

    def emit(step: int, values: dict[str, float]) -> None:
        with cond:
            got[step] = values
            cond.notify_all()

    monitor = RolloutMonitor([grown.url, late.url], emit=emit, collection_interval=3600)
    try:
        # The opening round: engine 0 of the first server; the second is not an engine yet.
        assert monitor.wait_rounds(1)
        assert monitor.stats["scrape_errors"] == 1
        grown.page = with_new_engine(V1_FIRST, V1_LATER)
        late.page = V1_LATER  # an engine with a history, first read now
        monitor.mark_step(1)
        assert monitor.flush()
        monitor.mark_step(2)
        assert monitor.flush()
    finally:
        monitor.close()

    assert [(e.id, e.url, e.label) for e in monitor.engines] == [
        (0, grown.url, "0"), (1, grown.url, "1"), (2, late.url, "0")
    ]  # fmt: skip
    step1, step2 = got[1], got[2]
    new = "rollout/engine.1."
    # The new engine's whole first sample is step 1's: its requests, tokens and latencies.
    assert step1[new + "requests_finished"] == V1_EXP["requests_finished"] == 48
    assert step1[new + "preemptions"] == V1_EXP["preemptions_delta"]
    for row, source, q in (
        ("ttft_p50_s", "time_to_first_token_seconds", "p50"),
        ("ttft_p90_s", "time_to_first_token_seconds", "p90"),
        ("e2e_latency_p90_s", "e2e_request_latency_seconds", "p90"),
    ):
        assert step1[new + row] == pytest.approx(V1_EXP[source][q], rel=1e-12), row
    prefix = V1_EXP["prefix_cache"]
    assert step1[new + "prefix_cache_hit_rate"] == (
        prefix["hits_delta_tokens"] / prefix["queries_delta_tokens"]
    )
    # Its rates cover the seconds since the read that did not show it (both share them).
    gen, prompt = step1[new + "gen_tokens_per_s"], step1[new + "prompt_tokens_per_s"]
    assert gen > 0
    assert gen / prompt == pytest.approx(
        V1_EXP["generation_tokens_delta"] / V1_EXP["prompt_tokens_delta"], rel=1e-12
    )
    # Engine 0 did nothing in the step; the engine read for the first time is a baseline.
    assert step1["rollout/engine.0.requests_finished"] == 0.0
    assert "rollout/engine.2.requests_finished" not in step1
    assert step1["rollout/requests_finished"] == 48.0
    assert step1["rollout/engines_reporting"] == 3.0
    # Counted once: the next step starts from the new engine's first sample.
    assert step2[new + "requests_finished"] == 0.0
    assert step2["rollout/requests_finished"] == 0.0
