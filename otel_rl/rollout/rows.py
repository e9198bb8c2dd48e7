"""From successive engine samples to the rows of one training step.

Every engine keeps an :class:`EngineWindow` that is fed each good scrape. Between two consecutive
good scrapes of an engine, counters and histogram buckets add their increase to the window;
gauges add their sample. Closing the window at a step gives that step's rows and starts the next
window, so every increase and every gauge sample is counted in exactly one step.

The engine's first sample is the baseline: an engine already running when monitoring starts
does not count its history. An engine new since an earlier read of its page (``since``: that
read did not show it) has no history before it: its first sample counts everything from zero
over the seconds since that read. A counter or histogram that appears in a later sample counts
from zero (Ray, and ``prometheus_client`` for a labelled series, create a series at its first
record); one missing from a sample keeps its last value, so it is not counted twice when it is
back.

A counter series or a histogram bucket that went down means the engine's process started over,
and with it every counter of the engine: then each counter's and bucket's increase is its new
value (counted from 0, as Prometheus' ``increase()`` counts a reset), including the series that
happen to be above their old value already. An increase is never negative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from otel_rl.rollout.engines import EngineSample, Histogram, SeriesKey

PREFIX = "rollout/"


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """PromQL ``histogram_quantile`` on cumulative ``counts`` (one per bound, then ``+Inf``).

    Linear interpolation inside the bucket that holds rank ``q * total``; the first bucket starts
    at 0 (or is its own bound when that is not positive); a rank in the ``+Inf`` bucket gives the
    largest finite bound. ``None`` when there are no observations.
    """
    if not counts or counts[-1] <= 0 or not 0.0 <= q <= 1.0:
        return None
    rank = q * counts[-1]
    previous_bound, previous_count = 0.0, 0.0
    for i, bound in enumerate(bounds):
        count = counts[i]
        if count >= rank:
            if i == 0 and bound <= 0:
                return bound
            lower = previous_bound if i > 0 else 0.0
            if count == previous_count:
                return bound
            return lower + (bound - lower) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return bounds[-1] if bounds else None


@dataclass
class _Gauge:
    total: float = 0.0
    n: int = 0
    peak: float = -math.inf

    def add(self, value: float) -> None:
        self.total += value
        self.n += 1
        self.peak = max(self.peak, value)


@dataclass
class EngineStep:
    """One engine's share of a step: increases, the seconds they cover, gauge statistics."""

    seconds: float
    increases: dict[str, float]
    histograms: dict[str, Histogram]
    gauge_mean: dict[str, float]
    gauge_max: dict[str, float]
    samples: int


@dataclass
class EngineWindow:
    """Accumulates one engine's scrapes since the last closed step."""

    previous: EngineSample | None = None
    previous_at: float = 0.0
    seconds: float = 0.0
    increases: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, tuple[tuple[float, ...], list[float]]] = field(default_factory=dict)
    gauges: dict[str, _Gauge] = field(default_factory=dict)
    samples: int = 0

    def add(self, sample: EngineSample, at: float, since: float | None = None) -> list[str]:
        """Feed one good scrape taken at ``at``; returns the series that went backwards (a
        restart) so the caller can say so once. ``since``, for the engine's first sample: the
        engine came into being after a scrape taken then (its page, read then, did not show
        it), so it stood at zero then and everything it shows now is its increase since."""
        went_back: list[str] = []
        if self.previous is None and since is not None:
            self.previous, self.previous_at = EngineSample(sample.kind), since
        previous = self.previous
        if previous is not None:
            went_back = _went_back(previous, sample)
            restarted = bool(went_back)
            for role, value in sample.counters.items():
                if restarted or role not in previous.counters:
                    # A metric that appears after the engine's first sample was created by
                    # its first record (Ray creates a series only then): it counts from zero.
                    increase = value
                else:
                    increase = _counter_increase(previous, sample, role)
                self.increases[role] = self.increases.get(role, 0.0) + increase
            for role, hist in sample.histograms.items():
                before_hist = previous.histograms.get(role)
                if restarted or before_hist is None:
                    delta: list[float] | None = list(hist.counts)
                else:
                    delta = _histogram_increase(before_hist, hist)
                if delta is not None:  # None only after a restart, handled above
                    self._add_buckets(role, hist.bounds, delta)
            self.seconds += max(0.0, at - self.previous_at)
            if not went_back:
                sample = _with_missing_series(previous, sample)
        for role, value in sample.gauges.items():
            self.gauges.setdefault(role, _Gauge()).add(value)
        self.samples += 1
        self.previous, self.previous_at = sample, at
        return went_back

    def _add_buckets(self, role: str, bounds: tuple[float, ...], delta: list[float]) -> None:
        held = self.buckets.get(role)
        if held is None or held[0] != bounds:
            # New, or the engine came back with other bucket bounds (another release): the
            # step keeps the latest layout's increases only.
            self.buckets[role] = (bounds, list(delta))
            return
        acc = held[1]
        for i, d in enumerate(delta):
            acc[i] += d

    def close(self) -> EngineStep | None:
        """This window's share of the step (``None`` if the engine never answered in it), and
        start the next window from the latest scrape."""
        if self.samples == 0:
            return None
        paired = self.seconds > 0 or bool(self.increases) or bool(self.buckets)
        step = EngineStep(
            seconds=self.seconds,
            increases=dict(self.increases) if paired else {},
            histograms={r: Histogram(b, tuple(c)) for r, (b, c) in self.buckets.items()},
            gauge_mean={r: g.total / g.n for r, g in self.gauges.items()},
            gauge_max={r: g.peak for r, g in self.gauges.items()},
            samples=self.samples,
        )
        self.seconds = 0.0
        self.increases = {}
        self.buckets = {}
        self.gauges = {}
        self.samples = 0
        return step


def below_zero(sample: EngineSample) -> list[str]:
    """The counters (by source name) with a series or a histogram bucket below zero: no engine
    counts below zero, so such a sample comes from a bug or a broken exporter and is not
    compared with anything."""
    names: list[str] = []
    for role, value in sample.counters.items():
        series = sample.series.get(role)
        if value < 0 or (series is not None and any(v < 0 for v in series.values())):
            names.append(sample.sources.get(role, role))
    for role, hist in sample.histograms.items():
        if any(c < 0 for c in hist.counts):
            names.append(sample.sources.get(role, role))
    return names


def _went_back(before: EngineSample, after: EngineSample) -> list[str]:
    """The metrics of ``after`` below their value in ``before``: a counter series that went
    down, or a histogram with a bucket that went down or other buckets (another release)."""
    names: list[str] = []
    for role, value in after.counters.items():
        old = before.counters.get(role)
        if old is None:
            continue
        old_series, new_series = before.series.get(role), after.series.get(role)
        if old_series is not None and new_series is not None:
            # Per series, as Prometheus does: a reset of one series (one finished_reason) can
            # hide in a sum that still grew thanks to the others.
            down = any(v < old_series.get(s, v) for s, v in new_series.items())
        else:
            down = value < old
        if down:
            names.append(after.sources.get(role, role))
    for role, hist in after.histograms.items():
        old_hist = before.histograms.get(role)
        if old_hist is not None and _histogram_increase(old_hist, hist) is None:
            names.append(after.sources.get(role, role))
    return names


def _counter_increase(before: EngineSample, after: EngineSample, role: str) -> float:
    """The increase of a counter that did not go down: summed over its series, a series new
    since ``before`` counting from 0 and one gone since then left out (a sum that lost a series
    would otherwise look like a decrease)."""
    old_series, new_series = before.series.get(role), after.series.get(role)
    if old_series is None or new_series is None:
        return after.counters[role] - before.counters[role]
    return math.fsum(v - old_series.get(s, 0.0) for s, v in new_series.items())


def _with_missing_series(before: EngineSample, after: EngineSample) -> EngineSample:
    """``after``, keeping the last value of the counter series, counters and histograms it
    lacks: one back after a scrape without it then adds its increase since it was last seen,
    not its whole value (only a metric never seen before counts from zero)."""
    carried: dict[str, dict[SeriesKey, float]] = {}
    for role, old_series in before.series.items():
        new_series = after.series.get(role)
        if new_series is not None and not old_series.keys() <= new_series.keys():
            carried[role] = {**old_series, **new_series}
    gone_counters = {r: v for r, v in before.counters.items() if r not in after.counters}
    gone_histograms = {r: h for r, h in before.histograms.items() if r not in after.histograms}
    if not (carried or gone_counters or gone_histograms):
        return after
    series = {**after.series, **carried}
    for role in gone_counters:
        if role in before.series:
            series[role] = before.series[role]
    sources = dict(after.sources)
    for role in (*gone_counters, *gone_histograms):
        if role in before.sources:
            sources.setdefault(role, before.sources[role])
    return replace(
        after,
        counters={**after.counters, **gone_counters},
        histograms={**after.histograms, **gone_histograms},
        series=series,
        sources=sources,
    )


def _histogram_increase(before: Histogram, after: Histogram) -> list[float] | None:
    """Per-bucket increase, or ``None`` if the histogram went back or changed its buckets
    (a restarted engine: the caller counts ``after`` from zero)."""
    if before.bounds != after.bounds:
        return None
    delta = [a - b for a, b in zip(after.counts, before.counts, strict=True)]
    if any(d < 0 for d in delta):
        return None
    return delta


# ---- rows --------------------------------------------------------------------------------------

#: Row suffix -> role for counter rates (per second over the step).
RATES = {"gen_tokens_per_s": "gen_tokens", "prompt_tokens_per_s": "prompt_tokens"}
#: Row suffix -> role for counter increases over the step.
COUNTS = {"requests_finished": "requests_finished", "preemptions": "preemptions"}
#: Row stem -> role for gauges (``<stem>_mean`` and ``<stem>_max``).
GAUGES = {
    "requests_running": "running",
    "requests_waiting": "waiting",
    "kv_cache_usage": "kv_usage",
}
#: Row suffix -> (histogram role, quantile).
QUANTILES = {
    "ttft_p50_s": ("ttft", 0.5),
    "ttft_p90_s": ("ttft", 0.9),
    "e2e_latency_p90_s": ("e2e", 0.9),
}


def engine_rows(step: EngineStep) -> dict[str, float]:
    """One engine's rows for a step, without prefix (``gen_tokens_per_s``, ...)."""
    rows: dict[str, float] = {}
    if step.seconds > 0:
        for name, role in RATES.items():
            if role in step.increases:
                rows[name] = step.increases[role] / step.seconds
    for name, role in COUNTS.items():
        if role in step.increases:
            rows[name] = step.increases[role]
    for stem, role in GAUGES.items():
        if role in step.gauge_mean:
            rows[f"{stem}_mean"] = step.gauge_mean[role]
            rows[f"{stem}_max"] = step.gauge_max[role]
    hits, queries = _prefix(step)
    if queries is not None and queries > 0 and hits is not None:
        rows["prefix_cache_hit_rate"] = hits / queries
    elif "prefix_hit_rate" in step.gauge_mean and not step.increases.get("prefix_queries"):
        rows["prefix_cache_hit_rate"] = step.gauge_mean["prefix_hit_rate"]
    for name, (role, q) in QUANTILES.items():
        hist = step.histograms.get(role)
        if hist is not None:
            value = histogram_quantile(q, hist.bounds, hist.counts)
            if value is not None:
                rows[name] = value
    return rows


def _prefix(step: EngineStep) -> tuple[float | None, float | None]:
    """Prefix-cache hits and queries (tokens) of the step; V0 engines, which only have a hit-rate
    gauge, count as ``gauge mean x prompt tokens`` so that engines can be weighed together."""
    if "prefix_queries" in step.increases and "prefix_hits" in step.increases:
        return step.increases["prefix_hits"], step.increases["prefix_queries"]
    if "prefix_hit_rate" in step.gauge_mean and "prompt_tokens" in step.increases:
        prompts = step.increases["prompt_tokens"]
        return step.gauge_mean["prefix_hit_rate"] * prompts, prompts
    return None, None


def combine(
    steps: Mapping[int, EngineStep], round_totals: Mapping[str, list[float]]
) -> dict[str, float]:
    """Rows over all engines (without prefix). Rates and counts are summed; running/waiting
    means are summed and their maxima are the largest per-scrape total (``round_totals``);
    KV-cache usage is the mean over engines and the fullest engine's maximum; prefix-cache hit
    rate is token-weighted; quantiles come from the engines' histograms added together."""
    rows: dict[str, float] = {}
    if not steps:
        return rows
    for name, role in RATES.items():
        parts = [s.increases[role] / s.seconds for s in steps.values()
                 if s.seconds > 0 and role in s.increases]  # fmt: skip
        if parts:
            rows[name] = math.fsum(parts)
    for name, role in COUNTS.items():
        parts = [s.increases[role] for s in steps.values() if role in s.increases]
        if parts:
            rows[name] = math.fsum(parts)
    for stem in ("requests_running", "requests_waiting"):
        role = GAUGES[stem]
        means = [s.gauge_mean[role] for s in steps.values() if role in s.gauge_mean]
        if means:
            rows[f"{stem}_mean"] = math.fsum(means)
            totals = round_totals.get(role) or [max(s.gauge_max[role] for s in steps.values()
                                                    if role in s.gauge_max)]  # fmt: skip
            rows[f"{stem}_max"] = max(totals)
    means = [s.gauge_mean["kv_usage"] for s in steps.values() if "kv_usage" in s.gauge_mean]
    if means:
        rows["kv_cache_usage_mean"] = math.fsum(means) / len(means)
        rows["kv_cache_usage_max"] = max(
            s.gauge_max["kv_usage"] for s in steps.values() if "kv_usage" in s.gauge_max
        )
    hits = queries = 0.0
    for s in steps.values():
        h, qn = _prefix(s)
        if h is not None and qn is not None:
            hits += h
            queries += qn
    if queries > 0:
        rows["prefix_cache_hit_rate"] = hits / queries
    for name, (role, q) in QUANTILES.items():
        merged = merge_histograms(
            [s.histograms[role] for s in steps.values() if role in s.histograms]
        )
        if merged is not None:
            value = histogram_quantile(q, merged.bounds, merged.counts)
            if value is not None:
                rows[name] = value
    return rows


def merge_histograms(hists: Sequence[Histogram]) -> Histogram | None:
    """The sum of histograms; with different bucket layouts (mixed releases), on the bounds they
    all share, where every engine's cumulative count is exact."""
    if not hists:
        return None
    common = set(hists[0].bounds)
    for h in hists[1:]:
        common &= set(h.bounds)
    bounds = tuple(sorted(common))
    counts = [0.0] * (len(bounds) + 1)
    for h in hists:
        index = {b: i for i, b in enumerate(h.bounds)}
        for j, b in enumerate(bounds):
            counts[j] += h.counts[index[b]]
        counts[-1] += h.counts[-1]
    return Histogram(bounds, tuple(counts))


def prefixed(rows: Mapping[str, float], engine: int | None = None) -> dict[str, float]:
    """``rollout/<name>`` or, per engine, ``rollout/engine.<i>.<name>``."""
    head = PREFIX if engine is None else f"{PREFIX}engine.{engine}."
    return {head + name: float(value) for name, value in rows.items()}
