"""Turn whatever a training loop logs into row values: floats, text, or summary statistics.

The rules (documented in docs/configuration.md):
- Python/numpy/torch scalars, 0-d and 1-element arrays → float; bool → 0.0/1.0.
- NaN and ±inf are kept (the OTel SDK would drop them; a NaN loss is what a user must see).
- Lists, tuples and 1-D arrays of numbers → ``key/count, /mean, /std, /min, /max, /p50, /p90``;
  NaNs in them are left out of the statistics and counted as ``key/nan_count``.
- Nested mappings → flattened with ``/``.
- Strings → text (trackers without text support skip them, with one warning).
- ``None`` and anything else → skipped, reported to the caller so it can warn once per key.
- A key or value that cannot be converted (an int beyond the float range, a ``__float__``, a
  ``__str__`` or a ``.shape`` that raises) is skipped alone and reported; the rest is kept.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from otel_rl.core.errors import MetricError
from otel_rl.core.records import (
    CountedHistogram,
    HistogramValue,
    checked_bins,
    exact_sum,
    histogram_layout,
    histogram_of,
)

#: Called as ``report(key, reason)`` for every value that is not logged as given.
Reporter = Callable[[str, str], None]

SUMMARY_STATS = ("count", "mean", "std", "min", "max", "p50", "p90")

#: Arrays of at least this many elements are summarised by numpy (in C: a 1M-element tensor in
#: tens of milliseconds, not a second of Python on the training thread). Smaller ones take the
#: exact path of lists; the two agree on count, min, max and the percentiles exactly, on mean
#: and std to the last bits of a float.
NUMPY_SUMMARY_FROM = 4096


def flatten_into(
    out: dict[str, Any],
    metrics: Mapping[Any, Any],
    prefix: str,
    report: Reporter,
) -> int:
    """Normalize ``metrics`` into ``out`` under ``prefix``; returns how many values are non-finite.

    Written for the hot path: a float or int costs one type check and one dict store. A key or
    value that cannot be logged costs only itself: it is reported (naming the key) and left out,
    and the other keys of the call are kept. ``report`` may raise (strict mode): its
    :class:`MetricError` goes to the caller as it is.
    """
    nonfinite = 0
    for raw_key, value in metrics.items():
        if type(value) is float and type(raw_key) is str and raw_key:  # most values: no more
            out[f"{prefix}/{raw_key}" if prefix else raw_key] = value
            if value - value != 0.0:  # NaN or ±inf, cheaper than math.isfinite on the hot path
                nonfinite += 1
            continue
        key: str = "<key>"
        try:
            if type(raw_key) is str:
                key = raw_key
            else:
                text = _key_text(raw_key, report)
                if text is None:
                    continue
                key = text
            if not key:
                report(key, "empty key skipped")
                continue
            if prefix:
                key = f"{prefix}/{key}"
            kind = type(value)
            if kind is float:
                out[key] = value
                if value - value != 0.0:  # NaN or ±inf, cheaper than math.isfinite on the hot path
                    nonfinite += 1
            elif kind is int:
                out[key] = float(value)  # OverflowError beyond 1.8e308, handled below
            else:
                nonfinite += _convert_slow(out, key, value, report)
        except MetricError:
            raise  # strict mode: the reporter's own error, never wrapped a second time
        except Exception as exc:
            # Anything a value can do (an int too large for a float, a __float__ or a .shape
            # raising, a tensor on a dead device) costs that value only, never the whole call.
            report(key, _skip_reason(value, exc))
    return nonfinite


def _key_text(raw_key: Any, report: Reporter) -> str | None:
    """The string form of a non-string key (reported), or ``None`` when it has none."""
    try:
        key = str(raw_key)
    except Exception as exc:
        report(
            f"<{type(raw_key).__name__} key>",
            f"key skipped: str() of the key raised {type(exc).__name__}: {exc}",
        )
        return None
    report(key, f"key of type {type(raw_key).__name__} converted to the string {key!r}")
    return key


def _skip_reason(value: Any, exc: Exception) -> str:
    if isinstance(exc, OverflowError):
        if isinstance(value, int):
            return (
                f"value skipped: an integer of {value.bit_length()} bits is too large for a "
                "float (largest about 1.8e308)"
            )
        return f"value skipped: a number in it is too large for a float ({exc})"
    return f"value skipped: {type(exc).__name__}: {exc}"


def _convert_slow(out: dict[str, Any], key: str, value: Any, report: Reporter) -> int:
    if isinstance(value, bool):
        out[key] = 1.0 if value else 0.0
        return 0
    if isinstance(value, (int, float)):
        number = float(value)
        out[key] = number
        return 0 if math.isfinite(number) else 1
    if isinstance(value, (str, HistogramValue)):
        out[key] = value
        if isinstance(value, CountedHistogram):
            out.update(value.left_out(key))
        return 0
    if value is None:
        report(key, "value None skipped")
        return 0
    if isinstance(value, Mapping):
        return flatten_into(out, value, key, report)
    if isinstance(value, (bytes, bytearray)):
        report(key, f"value of type {type(value).__name__} skipped (log text as str)")
        return 0
    size = _array_size(value)
    if size is not None:
        if size == 1:
            return _convert_slow(out, key, _array_item(value), report)
        if size >= NUMPY_SUMMARY_FROM:
            done = _summarize_array_into(out, key, value)
            if done is not None:
                return done
        return _summarize_into(out, key, _array_list(value), report)
    if isinstance(value, (list, tuple)):
        return _summarize_into(out, key, list(value), report)
    try:
        number = float(value)  # objects with __float__ (Decimal, Fraction, custom scalars)
    except (TypeError, ValueError):
        report(key, f"value of type {type(value).__name__} is not a number, string or list")
        return 0
    out[key] = number
    return 0 if math.isfinite(number) else 1


def _array_size(value: Any) -> int | None:
    """Element count of a numpy array or torch tensor (duck-typed: neither is imported)."""
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "tolist"):
        return None
    size = 1
    for dim in tuple(shape):
        size *= int(dim)
    return size


def _array_item(value: Any) -> Any:
    item = value.item() if hasattr(value, "item") else value.tolist()
    return item


def _array_list(value: Any) -> list[Any]:
    if hasattr(value, "detach"):  # torch: leave autograd and the device before converting
        value = value.detach().cpu()
    flat = value.reshape(-1) if hasattr(value, "reshape") else value
    values: list[Any] = flat.tolist()
    return values


def _real_array(np: Any, value: Any) -> Any:
    """``value`` as a numpy array of real numbers (a torch tensor off autograd and its device,
    as float64), or ``None`` for anything else (numpy cannot read it, or it holds no numbers)."""
    try:
        if hasattr(value, "detach"):
            value = value.detach().cpu().double().numpy()
        array = np.asarray(value)
    except Exception:
        return None
    return array if array.dtype.kind in "biuf" else None


def _summarize_array_into(out: dict[str, Any], key: str, value: Any) -> int | None:
    """:func:`summarize` of a large numeric array with numpy; ``None`` (the exact path decides)
    for anything else: no numpy loaded, values that are not real numbers, an infinity, or sums
    beyond the float range."""
    np = sys.modules.get("numpy")  # a numpy array or torch tensor in hand: numpy is loaded
    if np is None:
        return None
    array = _real_array(np, value)
    if array is None:
        return None
    flat = array.astype(np.float64, copy=False).reshape(-1)
    missing = np.isnan(flat)
    nans = int(missing.sum())
    clean = flat[~missing] if nans else flat
    n = len(clean)
    stats: dict[str, float] = {"count": float(n)}
    if n:
        # Only the order statistics the summary reads are put in place (O(n), not a sort):
        # _quantile reads positions floor and floor + 1 of (n - 1) * q.
        places = {0, n - 1}
        for q in (0.5, 0.9):
            places.update((math.floor((n - 1) * q), min(math.floor((n - 1) * q) + 1, n - 1)))
        ordered = np.partition(clean, sorted(places))
        low, high = float(ordered[0]), float(ordered[-1])
        if not (math.isfinite(low) and math.isfinite(high)):
            return None
        with np.errstate(all="ignore"):
            mean = float(np.mean(ordered))
            scale = max(abs(low), abs(high)) or 1.0
            scaled = (ordered - mean) / scale
            std = scale * math.sqrt(float(np.dot(scaled, scaled)) / n)
        if not (math.isfinite(mean) and math.isfinite(std)):
            return None
        p50, p90 = float(_quantile(ordered, 0.5)), float(_quantile(ordered, 0.9))
        stats.update(mean=mean, std=std, min=low, max=high, p50=p50, p90=p90)
    if nans:
        stats["nan_count"] = float(nans)
    for name, number in stats.items():
        out[f"{key}/{name}"] = number
    return 0


def histogram_of_values(values: Any, bins: int = 30) -> CountedHistogram | None:
    """:func:`~otel_rl.core.records.histogram_of` of ``values`` (a sequence of numbers, or an
    array or tensor, flattened); ``None`` when there are none.

    Arrays, tensors and lists of :data:`NUMPY_SUMMARY_FROM` elements and more are binned by
    numpy when it is loaded (a 1M-element array in milliseconds, not half a second of Python on
    the training thread): the same bounds, counts, count, min, max, ``nan_count`` and
    ``inf_count`` as the exact path, the sum to within float rounding (numpy's pairwise sum).
    A value that is not a number raises ``TypeError`` or ``ValueError``, as ``float()`` does,
    and so do ``bins`` outside 1 to :data:`~otel_rl.core.records.MAX_BINS` (before any value is
    read).
    """
    bins = checked_bins(bins)
    size = _array_size(values)
    is_array = size is not None
    if size is None and isinstance(values, (list, tuple)):
        size = len(values)
    if size is not None and size >= NUMPY_SUMMARY_FROM:
        histogram = _histogram_of_array(values, bins, is_array)
        if histogram is not None:
            return histogram
    numbers = [float(v) for v in (_array_list(values) if is_array else values)]
    return histogram_of(numbers, bins) if numbers else None


def _histogram_of_array(value: Any, bins: int, is_array: bool) -> CountedHistogram | None:
    """:func:`histogram_of` by numpy, or ``None`` (the exact path decides) when numpy is not
    loaded or the values are not all real numbers."""
    np = sys.modules.get("numpy")  # imported by whoever made the array; never imported here
    if np is None:
        return None
    array = _real_array(np, value)
    # A list must be one of numbers, as float() of each element would take it; an array is
    # flattened.
    if array is None or (not is_array and array.ndim != 1):
        return None
    flat = array.astype(np.float64, copy=False).reshape(-1)
    good = np.isfinite(flat)
    finite = flat if good.all() else flat[good]
    nans = int(np.isnan(flat).sum()) if len(finite) < len(flat) else 0
    n = len(finite)
    lo, hi = (float(finite.min()) + 0.0, float(finite.max()) + 0.0) if n else (0.0, 0.0)
    scale, width, bounds = histogram_layout(lo, hi, bins)
    total = 0.0
    counts: list[int] = [0] * bins
    if n:
        # The same float operations as histogram_of's loop, element by element (IEEE doubles
        # both), then truncated as int() does: the same bin for every value.
        places = (finite * scale - lo * scale) / width
        counts = np.bincount(np.minimum(places.astype(np.int64), bins - 1), minlength=bins).tolist()
        with np.errstate(all="ignore"):
            total = float(np.sum(finite))
        if not math.isfinite(total):  # partial sums beyond the float range (inf or inf - inf)
            total = exact_sum(finite.tolist())
    return CountedHistogram(
        bounds,
        tuple(counts),
        n,
        total,
        lo,
        hi,
        nan_count=nans,
        inf_count=len(flat) - n - nans,
    )


def _summarize_into(out: dict[str, Any], key: str, values: list[Any], report: Reporter) -> int:
    numbers: list[float] = []
    nans = 0
    for v in values:
        if isinstance(v, (int, float)) or _array_size(v) == 1:
            number = float(v)
            if number != number:
                nans += 1
            else:
                numbers.append(number)
        else:
            report(key, f"list element of type {type(v).__name__} is not a number; list skipped")
            return 0
    if not numbers and not nans:
        report(key, "empty list skipped")
        return 0
    nonfinite = 0
    for name, value in _statistics(numbers, nans).items():
        out[f"{key}/{name}"] = value
        if value - value != 0.0:
            nonfinite += 1
    return nonfinite


def summarize(numbers: Iterable[float]) -> dict[str, float]:
    """The statistics a logged list becomes: count, mean, population std, min, max, p50 and p90
    (linear interpolation) of the numbers that are not NaN, and ``nan_count`` when some are.

    NaN has no place in an order, so it is left out of every statistic (sorting or comparing
    with it depends on where it sits) and counted instead. With nothing but NaNs, ``count`` is 0
    and the other statistics, undefined, are left out. ±inf are ordered values and take part:
    min, max and the percentiles are read off the sorted values, the mean is ±inf (NaN with both
    signs, as inf - inf is undefined) and the std is NaN.
    """
    clean: list[float] = []
    nans = 0
    for x in numbers:
        if x != x:
            nans += 1
        else:
            clean.append(float(x))
    return _statistics(clean, nans)


def _statistics(numbers: list[float], nans: int) -> dict[str, float]:
    """:func:`summarize` of ``numbers``, which hold no NaN, and ``nans`` NaNs left out."""
    n = len(numbers)
    stats: dict[str, float] = {"count": float(n)}
    if n:
        ordered = sorted(numbers)
        try:
            mean = math.fsum(ordered) / n
        except OverflowError:  # finite partial sums beyond the float range
            mean = exact_sum([x / n for x in ordered])
        except ValueError:  # +inf and -inf both present
            mean = math.nan
        # The distance of a value to an infinite mean is undefined: NaN.
        infinite = math.isinf(ordered[0]) or math.isinf(ordered[-1])
        stats["mean"] = mean
        stats["std"] = math.nan if infinite else _std(ordered, mean)
        stats["min"] = ordered[0]
        stats["max"] = ordered[-1]
        stats["p50"] = _quantile(ordered, 0.5)
        stats["p90"] = _quantile(ordered, 0.9)
    if nans:
        stats["nan_count"] = float(nans)
    return stats


def _std(ordered: list[float], mean: float) -> float:
    """Population std, computed on values scaled by the largest magnitude: squares of values
    beyond ~1e154 would overflow (and ``fsum`` raise) although the std itself is finite."""
    scale = max(abs(ordered[0]), abs(ordered[-1])) or 1.0
    try:
        total = math.fsum((t := (x - mean) / scale) * t for x in ordered)
    except OverflowError:
        return math.inf
    return scale * math.sqrt(total / len(ordered))


def _quantile(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    a, b, t = ordered[lo], ordered[hi], pos - lo
    if t == 0.0 or a == b:
        return a  # exact, also for an infinity (inf * 0 would be NaN)
    if math.isinf(a) or math.isinf(b):
        # Between an infinity and anything else, every point but the ends is that infinity;
        # between -inf and +inf there is no defined point.
        return math.nan if math.isinf(a) and math.isinf(b) else (a if math.isinf(a) else b)
    gap = b - a
    if math.isinf(gap):  # two finite values further apart than the largest float
        return a * (1.0 - t) + b * t
    return a + gap * t
