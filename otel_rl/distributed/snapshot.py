"""The snapshot a worker hands to the driver: plain dicts and tuples, nothing from OTel.

A snapshot is everything one worker recorded since its previous snapshot::

    {"format": 1, "rank": 0, "role": "actor", "step": 3 | None, "time": <unix seconds>,
     "scalars":    {key: (reduce, n, sum, weighted_sum, weight_sum, min, max, last, last_time)},
     "timings":    {key: (total_seconds, count)},
     "histograms": {key: (bounds, counts, count, sum, min, max)},
     "anatomy":    {timer path: exclusive seconds},
     "spans":      [(name, trace id, span id, parent id, start ns, end ns, attributes,
                     resource attributes, scope)], "spans_dropped": n,
     "levels":     [key, ...]}

A scalar carries enough to apply any reduction on the driver: ``reduce`` is what the worker
declared (``None``: let the driver's rules decide, default ``mean``), ``n`` how many values
were recorded, then their plain sum, their weighted sum and total weight (for a weighted mean),
min, max, and the last value with its wall-clock time. A timing is the worker's total seconds
for that name over the step (repeated timers add up). A histogram has explicit bucket bounds and
merges exactly. ``anatomy`` (optional: a snapshot without it is still format 1) holds the
seconds the worker spent inside its own timers, by timer path, each exclusive of the timers nested
in it (the driver's step anatomy, docs/anatomy.md). ``spans`` (optional too, from a worker
that traces) are its timer spans, and where the Ray hook ran its process's Ray spans, that ended
since the last snapshot or are still running (marked open), for the driver's trace file
(:mod:`otel_rl.telemetry.span_transfer`). ``levels`` (optional) names the scalars that are an
up-down counter's level, not a change: of one worker's several snapshots in a step the latest
counts, and the workers' levels add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    HistogramDataPoint,
    MetricsData,
    NumberDataPoint,
    Sum,
)

from otel_rl.core.records import _with_attributes, scoped_metrics

FORMAT = 1

#: The snapshot entry of the worker's exclusive timer seconds by path.
ANATOMY_KEY = "anatomy"
#: The snapshot entries of the worker's ended spans, and of those it dropped for room.
SPANS_KEY = "spans"
SPANS_DROPPED_KEY = "spans_dropped"
#: The snapshot entry naming the scalars that are levels (up-down counters).
LEVELS_KEY = "levels"

# Field positions of a scalar entry.
REDUCE, N, SUM, WSUM, WEIGHT, MIN, MAX, LAST, LAST_TIME = range(9)

#: A scalar in a snapshot, indexed by the names above (reduce, n, sum, ..., last_time).
ScalarEntry = tuple[Any, ...]
#: A histogram in a snapshot: (bounds, bucket counts, count, sum, min, max).
HistogramEntry = tuple[tuple[float, ...], tuple[int, ...], int, float, float, float]


def empty_snapshot(rank: int, role: str, step: int | None, now: float) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "rank": rank,
        "role": role,
        "step": step,
        "time": now,
        "scalars": {},
        "timings": {},
        "histograms": {},
    }


def add_otel_data(
    snapshot: dict[str, Any],
    datas: Sequence[MetricsData],
    now: float,
) -> list[str]:
    """Fold OTel data collected from the worker's provider into ``snapshot``; returns the keys
    left out because ``record()`` holds them already in this snapshot.

    Histograms stay histograms; counters and up-down counters become scalars reduced by
    ``sum``; gauges become scalars whose reduction the driver's rules decide.
    """
    scalars, histograms = snapshot["scalars"], snapshot["histograms"]
    recorded, clashes = set(scalars), []
    for _, metric in scoped_metrics(datas):
        for p in metric.data.data_points:
            key = _with_attributes(metric.name, p.attributes)
            if key in recorded:
                clashes.append(key)
            elif isinstance(p, HistogramDataPoint):
                entry: HistogramEntry = (
                    tuple(p.explicit_bounds), tuple(p.bucket_counts),
                    p.count, p.sum, p.min, p.max,
                )  # fmt: skip
                old = histograms.get(key)
                histograms[key] = entry if old is None else merge_histogram(old, entry)
            elif isinstance(p, NumberDataPoint) and isinstance(metric.data, Sum):
                v = float(p.value)
                scalars[key] = ("sum", 1, v, v, 1.0, v, v, v, now)
                if not metric.data.is_monotonic:  # an up-down counter: its level
                    snapshot.setdefault(LEVELS_KEY, []).append(key)
            elif isinstance(p, NumberDataPoint) and isinstance(metric.data, Gauge):
                v = float(p.value)
                scalars[key] = (None, 1, v, v, 1.0, v, v, v, now)
    return clashes


def merge_histogram(a: HistogramEntry, b: HistogramEntry) -> HistogramEntry:
    """Exact merge of two histogram entries with the same bucket bounds."""
    if a[0] != b[0]:
        raise ValueError("cannot merge histograms with different bucket bounds")
    return (
        a[0],
        tuple(x + y for x, y in zip(a[1], b[1], strict=True)),
        a[2] + b[2],
        a[3] + b[3],
        min(a[4], b[4]),
        max(a[5], b[5]),
    )
