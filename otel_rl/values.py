"""Turn whatever a training loop logs into row values: floats, text, or summary statistics.

The rules (documented in docs/configuration.md):
- Python/numpy/torch scalars, 0-d and 1-element arrays → float; bool → 0.0/1.0.
- NaN and ±inf are kept (the OTel SDK would drop them; a NaN loss is what a user must see).
- Lists, tuples and 1-D arrays of numbers → ``key/count, /mean, /std, /min, /max, /p50, /p90``.
- Nested mappings → flattened with ``/``.
- Strings → text (trackers without text support skip them, with one warning).
- ``None`` and anything else → skipped, reported to the caller so it can warn once per key.
- A key or value that cannot be converted (an int beyond the float range, a ``__float__``, a
  ``__str__`` or a ``.shape`` that raises) is skipped alone and reported; the rest is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from otel_rl.errors import MetricError
from otel_rl.records import HistogramValue

#: Called as ``report(key, reason)`` for every value that is not logged as given.
Reporter = Callable[[str, str], None]

SUMMARY_STATS = ("count", "mean", "std", "min", "max", "p50", "p90")


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


def _summarize_into(out: dict[str, Any], key: str, values: list[Any], report: Reporter) -> int:
    numbers: list[float] = []
    for v in values:
        if isinstance(v, (int, float)) or _array_size(v) == 1:
            numbers.append(float(v))
        else:
            report(key, f"list element of type {type(v).__name__} is not a number; list skipped")
            return 0
    if not numbers:
        report(key, "empty list skipped")
        return 0
    stats = summarize(numbers)
    for name in SUMMARY_STATS:
        out[f"{key}/{name}"] = stats[name]
    return sum(1 for v in stats.values() if not math.isfinite(v))


def summarize(numbers: list[float]) -> dict[str, float]:
    """count, mean, population std, min, max and the p50/p90 (linear interpolation)."""
    n = len(numbers)
    ordered = sorted(numbers)
    try:
        mean = math.fsum(ordered) / n
    except (OverflowError, ValueError):  # partial sums beyond the float range
        mean = math.fsum(x / n for x in ordered)
    var = math.fsum((x - mean) * (x - mean) for x in ordered) / n
    return {
        "count": float(n),
        "mean": mean,
        "std": math.sqrt(var) if var == var else math.nan,
        "min": ordered[0],
        "max": ordered[-1],
        "p50": _quantile(ordered, 0.5),
        "p90": _quantile(ordered, 0.9),
    }


def _quantile(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
