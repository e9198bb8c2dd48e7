"""Merge worker snapshots on the driver, each metric with its own reduction.

Semantics (also in docs/distributed.md):

- scalars: ``mean`` is the mean of every value recorded on every worker, each weighted by its
  ``weight`` (default 1), i.e. ``Σ w·v / Σ w`` (NaN if the total weight is 0); ``sum`` adds
  every value; ``min``/``max`` over every value; ``last`` is the value recorded last by wall
  clock (ties: the later snapshot in the list). A key that only some workers recorded is reduced
  over those workers.
- timings: each worker's total for the step (several snapshots of one worker add up), then
  ``max`` across workers unless a rule says ``min``, ``mean`` or ``sum`` (or a list, such as
  ``["max", "min", "mean"]``, for ``/min`` and ``/mean`` too). A timing reduced with ``max``
  over two or more workers also gets ``/slowest_rank`` (the rank of the slowest worker; the
  lowest rank on a tie) and ``/skew`` (max ÷ median of the workers' totals; see :func:`skew`).
- histograms (OTel histograms from ``WorkerMetrics.meter``): merged exactly (counts per bucket,
  count, sum, min, max); logged as the histogram plus ``/count, /sum, /mean, /min, /max``.

The reduction of a scalar comes from the worker (``record(..., reduce=)``), else from the rules
(``reductions`` in the logger config), else ``mean``. Two workers declaring different
reductions, a worker disagreeing with a rule, or one key used as two kinds of metric is a
conflict: :class:`ReductionConflictError`, or — when ``report`` is given — a report and the key
left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from otel_rl.core.records import HistogramValue
from otel_rl.distributed.reductions import (
    DEFAULT_SCALAR,
    DEFAULT_TIMING,
    ReductionConflictError,
    ReductionRules,
    Spec,
)
from otel_rl.distributed.snapshot import (
    FORMAT,
    LAST,
    LAST_TIME,
    LEVELS_KEY,
    MAX,
    MIN,
    REDUCE,
    SUM,
    WEIGHT,
    WSUM,
    HistogramEntry,
    ScalarEntry,
    merge_histogram,
)

_TIMING_REDUCTIONS = ("max", "min", "mean", "sum")


def _not_a_snapshot(snap: Any) -> str | None:
    """What makes ``snap`` no ``WorkerMetrics`` snapshot, or ``None`` when it is one."""
    if not isinstance(snap, Mapping) or snap.get("format") != FORMAT:
        return f"expected a WorkerMetrics snapshot (format {FORMAT}), got {type(snap).__name__}"
    if "role" not in snap or "rank" not in snap or not all(
        isinstance(snap.get(part), Mapping) for part in ("scalars", "timings", "histograms")
    ):  # fmt: skip
        return "a WorkerMetrics snapshot without its role, rank, scalars, timings or histograms"
    return None


def merge_snapshots(
    snapshots: Iterable[Mapping[str, Any] | None],
    reductions: ReductionRules | Mapping[str, Any] | None = None,
    prefix: str = "",
    report: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Merge worker snapshots into ``{key: value}`` (keys under ``prefix``), ready to log.

    ``None`` entries (a worker that sent nothing) are skipped. An entry that is no snapshot
    raises ``TypeError``, or with ``report`` is reported and left out (the others are merged).
    """
    rules = reductions if isinstance(reductions, ReductionRules) else ReductionRules(reductions)
    given = []
    for index, snap in enumerate(snapshots):
        problem = None if snap is None else _not_a_snapshot(snap)
        if problem is None:
            if snap is not None:
                given.append(snap)
        elif report is None:
            raise TypeError(problem)
        else:
            report("<log_worker_metrics>", f"entry {index} left out: {problem}")
    # Scalars are grouped per key first; each key's reduction then reads only the fields it
    # needs, in one builtin pass (per-entry Python arithmetic was most of the cost).
    scalars: dict[str, list[ScalarEntry]] = {}
    timings: dict[str, dict[tuple[str, int], float]] = {}
    histograms: dict[str, HistogramEntry] = {}
    conflicts: dict[str, str] = {}

    # An up-down counter's level: one worker's latest (its snapshots do not add up).
    levels: dict[str, dict[tuple[str, int], ScalarEntry]] = {}
    for snap in given:
        worker = (snap["role"], snap["rank"])
        level_keys = snap.get(LEVELS_KEY)
        if not isinstance(level_keys, (list, tuple)):
            level_keys = ()
        for key, entry in snap["scalars"].items():
            if key in level_keys:
                latest = levels.setdefault(key, {})
                held = latest.get(worker)
                if held is None or entry[LAST_TIME] >= held[LAST_TIME]:
                    latest[worker] = entry
                continue
            group = scalars.get(key)
            if group is None:
                scalars[key] = [entry]
            else:
                group.append(entry)
        for key, (total, _count) in snap["timings"].items():
            per_worker = timings.get(key)
            if per_worker is None:
                timings[key] = {worker: total}
            else:
                per_worker[worker] = per_worker.get(worker, 0.0) + total
        for key, entry in snap["histograms"].items():
            old = histograms.get(key)
            if old is None:
                histograms[key] = entry
            elif old[0] != entry[0]:
                conflicts[key] = f"histogram bucket bounds differ on {_name(worker)}"
            else:
                histograms[key] = merge_histogram(old, entry)

    for key, latest in levels.items():
        scalars.setdefault(key, []).extend(latest.values())
    _kind_conflicts(scalars, timings, histograms, conflicts)
    out: dict[str, Any] = {}
    lookup = rules.lookup if rules else None
    for key, entries in scalars.items():
        full = f"{prefix}/{key}" if prefix else key
        explicit = _declared(key, entries, given, conflicts)
        spec = _scalar_spec(key, full, explicit, lookup, conflicts)
        if spec is None:
            continue
        out[full] = _scalar_value(entries, spec[0])
        for extra in spec[1:]:
            out[f"{full}/{extra}"] = _scalar_value(entries, extra)
    for key, per_worker in timings.items():
        if key in conflicts:
            continue
        full = f"{prefix}/{key}" if prefix else key
        spec = (lookup(key, full) if lookup else None) or DEFAULT_TIMING
        bad = [r for r in spec if r not in _TIMING_REDUCTIONS]
        if bad:
            allowed = ", ".join(_TIMING_REDUCTIONS)
            conflicts[key] = f"a timing reduces with {allowed}, not {bad[0]!r}"
            continue
        totals = list(per_worker.values())
        out[full] = _timing_value(totals, spec[0])
        for extra in spec[1:]:
            out[f"{full}/{extra}"] = _timing_value(totals, extra)
        if "max" in spec and len(per_worker) > 1:
            ranks = ((seconds, who[1]) for who, seconds in per_worker.items())
            out[f"{full}/slowest_rank"] = slowest_rank(ranks)
            out[f"{full}/skew"] = skew(totals)
    for key, (bounds, counts, count, total, lo, hi) in histograms.items():
        if key in conflicts:
            continue
        full = f"{prefix}/{key}" if prefix else key
        hist = HistogramValue(tuple(bounds), tuple(counts), count, total, lo, hi)
        out[full] = hist
        out.update(hist.stats(full))

    # Every conflicting key was left out above; now say why.
    for key, reason in conflicts.items():
        full = f"{prefix}/{key}" if prefix else key
        if report is None:
            raise ReductionConflictError(full, reason)
        report(full, reason)
    return out


def _declared(
    key: str,
    entries: list[ScalarEntry],
    snapshots: list[Mapping[str, Any]],
    conflicts: dict[str, str],
) -> str | None:
    """The reduction the workers declared for ``key`` (``None``: none did); records a conflict
    when two declared different ones."""
    first: str | None = entries[0][REDUCE]
    if all(e[REDUCE] == first for e in entries):
        return first
    declared: set[str] = {e[REDUCE] for e in entries} - {None}
    if len(declared) == 1:
        return declared.pop()
    # rare: find which workers disagree, for the message
    seen: dict[str, tuple[str, int]] = {}
    for snap in snapshots:
        entry = snap["scalars"].get(key)
        if entry is not None and entry[REDUCE] is not None:
            seen.setdefault(entry[REDUCE], (snap["role"], snap["rank"]))
    (a, worker_a), (b, worker_b) = list(seen.items())[:2]
    conflicts[key] = f"reduce={a!r} on {_name(worker_a)}, reduce={b!r} on {_name(worker_b)}"
    return None


def _kind_conflicts(
    scalars: Mapping[str, Any],
    timings: Mapping[str, Any],
    histograms: Mapping[str, Any],
    conflicts: dict[str, str],
) -> None:
    kinds = (("a scalar", scalars), ("a timing", timings), ("a histogram", histograms))
    for i, (name_a, a) in enumerate(kinds):
        for name_b, b in kinds[i + 1 :]:
            if not a or not b:
                continue
            for key in a.keys() & b.keys():
                conflicts[key] = f"recorded as {name_a} and as {name_b}"


def _scalar_spec(
    key: str,
    full: str,
    explicit: str | None,
    lookup: Callable[[str, str], Spec | None] | None,
    conflicts: dict[str, str],
) -> Spec | None:
    if key in conflicts:
        return None
    declared = lookup(key, full) if lookup else None
    if declared is None:
        return (explicit,) if explicit else DEFAULT_SCALAR
    if explicit is not None and explicit != declared[0]:
        conflicts[key] = (
            f"a worker declared reduce={explicit!r} but the reductions config says {declared[0]!r}"
        )
        return None
    return declared


def _scalar_value(entries: list[ScalarEntry], reduction: str) -> float:
    if reduction == "mean":
        weight = sum([e[WEIGHT] for e in entries])
        return sum([e[WSUM] for e in entries]) / weight if weight > 0 else math.nan
    if reduction == "sum":
        return float(sum([e[SUM] for e in entries]))
    if reduction == "max":
        return _extreme(max, [e[MAX] for e in entries])
    if reduction == "min":
        return _extreme(min, [e[MIN] for e in entries])
    # last: the latest by wall clock; on a tie, the later snapshot
    return float(max(reversed(entries), key=_last_time)[LAST])


def _extreme(pick: Callable[[list[float]], float], values: list[float]) -> float:
    """min/max that returns NaN when any value is NaN (builtins depend on the order)."""
    total = sum(values)
    if total != total and any(v != v for v in values):
        return math.nan
    return float(pick(values))


def _last_time(entry: ScalarEntry) -> float:
    return float(entry[LAST_TIME])


def _timing_value(totals: list[float], reduction: str) -> float:
    if reduction in ("max", "min") and any(t != t for t in totals):
        return math.nan  # kept, whatever the worker's place (max and min depend on it)
    if reduction == "max":
        return max(totals)
    if reduction == "min":
        return min(totals)
    if reduction == "sum":
        return math.fsum(totals)
    return math.fsum(totals) / len(totals)


def slowest_rank(times: Iterable[tuple[float, int]]) -> float:
    """The rank of the longest of ``(seconds, rank)`` (the lowest rank on a tie), NaNs left out
    (NaN has no place in an order); NaN when every time is NaN."""
    held = [(seconds, rank) for seconds, rank in times if seconds == seconds]
    if not held:
        return math.nan
    return float(max(held, key=lambda item: (item[0], -item[1]))[1])


def skew(values: list[float]) -> float:
    """How far the slowest is from the typical one: ``max ÷ median`` of ``values`` (1.0 when all
    are equal; ``inf`` when the median is 0 and the max is not). NaNs are left out."""
    finite = [v for v in values if v == v]
    if not finite:
        return math.nan
    top, middle = max(finite), statistics.median(finite)
    if middle > 0:
        return top / middle
    return 1.0 if top == middle else math.inf


def _name(worker: tuple[str, int]) -> str:
    return f"{worker[0]} rank {worker[1]}"
