"""Which scrapes a step's rollout rows hold, and samples that cannot be compared as they are.

Real HTTP servers on 127.0.0.1 serve the vLLM fixture pages (``testkit/fixtures/rollout``), or
pages made from them by removing or changing sample lines; the monitor GETs them on its own
thread. ``collection_interval`` is an hour, so every scrape after the opening one is one the
test causes: by closing a step (``mark_step``) or by ``flush()``.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest

from otel_rl.rollout.engines import parse_engine_page
from otel_rl.rollout.monitor import RolloutMonitor
from otel_rl.rollout.rows import histogram_quantile
from testkit.rollout_pages import V1_EXP, V1_FIRST, V1_LATER, PageServer

HOUR = 3600.0
PREEMPTIONS = "vllm:num_preemptions_total"
TTFT = "vllm:time_to_first_token_seconds"


class Rows:
    """The emit callback: (step, values) in order, and a wait for a step's row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.cond = threading.Condition()

    def __call__(self, step: int, values: dict[str, float]) -> None:
        with self.cond:
            self.rows.append((step, values))
            self.cond.notify_all()

    def wait_step(self, step: int, timeout: float = 20.0) -> dict[str, float]:
        with self.cond:
            assert self.cond.wait_for(lambda: any(s == step for s, _ in self.rows), timeout), (
                f"no row for step {step} within {timeout} s"
            )
            (values,) = [v for s, v in self.rows if s == step]
            return values


@pytest.fixture
def server():
    made = PageServer(V1_FIRST)
    yield made
    made.close()


def without(page: str, *names: str) -> str:
    """``page`` without the sample, HELP and TYPE lines of these metric families."""
    pattern = re.compile(r"^(# (HELP|TYPE) )?(" + "|".join(map(re.escape, names)) + r")[_{ ]")
    return "\n".join(line for line in page.splitlines() if not pattern.match(line)) + "\n"


def with_value(page: str, series: str, value: float) -> str:
    """``page`` with every sample of the series ``series`` (a full sample name) set to
    ``value``."""
    pattern = re.compile(rf"^({re.escape(series)}(\{{[^}}]*\}})?) \S+$", re.M)
    changed, count = pattern.subn(lambda m: f"{m.group(1)} {value!r}", page)
    assert count, series
    return changed


def page_value(page: str, series: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(series)}(?:{{[^}}]*}})? (\S+)$",
                                            page, re.M))  # fmt: skip


# ---- the scrape at a step's close -------------------------------------------------------------


def test_a_closed_step_gets_the_scrape_taken_when_it_closed_without_waiting_for_the_schedule(
    server,
):
    """The engine does the fixture's interval of work during step 1; the step is closed with
    ``mark_step`` alone (no flush) while the next scheduled scrape is an hour away. The row
    comes from a scrape taken at the close, and holds exactly that interval's increase; work
    done after the row is in step 2's row, not in step 1's."""
    rows = Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=HOUR)
    try:
        assert monitor.wait_rounds(1)  # the opening scrape: the first page
        server.page = V1_LATER  # the engine's work during step 1
        monitor.mark_step(1)
        first = rows.wait_step(1, timeout=10)
        # The next step's work: 5 more preemptions, seen by step 2's closing scrape only.
        server.page = with_value(V1_LATER, PREEMPTIONS, page_value(V1_LATER, PREEMPTIONS) + 5)
        monitor.mark_step(2)
        second = rows.wait_step(2, timeout=10)
    finally:
        monitor.close()
    assert first["rollout/requests_finished"] == V1_EXP["requests_finished"]
    assert first["rollout/preemptions"] == V1_EXP["preemptions_delta"]
    ttft = V1_EXP["time_to_first_token_seconds"]
    assert first["rollout/ttft_p50_s"] == pytest.approx(ttft["p50"], rel=1e-12)
    assert first["rollout/ttft_p90_s"] == pytest.approx(ttft["p90"], rel=1e-12)
    assert first["rollout/gen_tokens_per_s"] / first["rollout/prompt_tokens_per_s"] == (
        pytest.approx(V1_EXP["generation_tokens_delta"] / V1_EXP["prompt_tokens_delta"])
    )
    assert second["rollout/preemptions"] == 5.0
    assert second["rollout/requests_finished"] == 0.0
    assert monitor.stats["steps_without_scrape"] == 0


# ---- a metric that appears after the engine's first sample ------------------------------------


def test_a_metric_that_appears_after_the_first_sample_counts_from_zero(server):
    """As an engine forwarded to Ray shows a series only from its first record on: the opening
    scrape has no preemption counter and no TTFT histogram; both appear during step 1. Step 1
    counts them from zero (their whole values), whereas the counters present from the start
    give their increase (the engine's history before monitoring is not counted). A metric
    missing from one scrape and back in the next is not counted again."""
    server.page = without(V1_FIRST, PREEMPTIONS, TTFT)
    rows = Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=HOUR)
    try:
        assert monitor.wait_rounds(1)
        server.page = V1_LATER
        monitor.mark_step(1)
        first = rows.wait_step(1)
        server.page = without(V1_LATER, PREEMPTIONS, TTFT)  # a scrape without them
        monitor.mark_step(2)
        second = rows.wait_step(2)
        server.page = V1_LATER  # back, unchanged
        monitor.mark_step(3)
        third = rows.wait_step(3)
    finally:
        monitor.close()
    (later,) = parse_engine_page(V1_LATER).values()
    assert first["rollout/preemptions"] == page_value(V1_LATER, PREEMPTIONS) == 39.0
    hist = later.histograms["ttft"]
    for name, q in (("ttft_p50_s", 0.5), ("ttft_p90_s", 0.9)):
        assert first[f"rollout/{name}"] == histogram_quantile(q, hist.bounds, hist.counts)
    assert first["rollout/requests_finished"] == V1_EXP["requests_finished"]  # an increase
    assert "rollout/preemptions" not in second
    assert third["rollout/preemptions"] == 0.0
    assert "rollout/ttft_p50_s" not in third  # no observation since it was last seen


# ---- a counter below zero ---------------------------------------------------------------------


def test_a_sample_with_a_counter_below_zero_is_skipped_with_one_warning(server, caplog):
    """A broken exporter shows ``vllm:request_success_total`` below zero in the scrapes that
    close steps 1 and 2. Those samples are skipped (no row of theirs is negative, one warning
    names the engine and the metric); step 3's good sample gets the increase since the last
    good one, the opening scrape."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    rows = Rows()
    monitor = RolloutMonitor([server.url], emit=rows, collection_interval=HOUR)
    broken = with_value(V1_LATER, "vllm:request_success_total", -3.0)
    try:
        assert monitor.wait_rounds(1)
        server.page = broken
        monitor.mark_step(1)
        first = rows.wait_step(1)
        monitor.mark_step(2)
        second = rows.wait_step(2)
        server.page = V1_LATER
        monitor.mark_step(3)
        third = rows.wait_step(3)
    finally:
        monitor.close()
    # Step 1 holds the opening scrape's gauges only; step 2 no sample of the engine at all.
    assert first["rollout/requests_waiting_max"] == V1_EXP["num_requests_waiting"]["first"]
    assert second["rollout/engines_reporting"] == 0.0
    for row in (first, second):
        assert not any(k.endswith(("requests_finished", "gen_tokens_per_s")) for k in row)
    assert third["rollout/requests_finished"] == V1_EXP["requests_finished"]
    assert third["rollout/preemptions"] == V1_EXP["preemptions_delta"]
    assert all(v >= 0 for _, values in rows.rows for v in values.values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "engine 0" in warnings[0] and "vllm:request_success_total" in warnings[0]
    assert server.url in warnings[0] and "below zero" in warnings[0]
    assert monitor.stats["negative_samples"] == 2
