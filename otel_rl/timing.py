"""Timers that record durations (seconds) into an OTel histogram."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Bucket bounds (seconds) for timing histograms: 1 ms to 1 h.
TIMING_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


class Timer:
    """Context manager and decorator; each exit records the elapsed seconds.

    ``record`` is the histogram's ``record``. Nested and concurrent uses of one Timer object
    each measure their own interval.
    """

    __slots__ = ("_record", "_starts")

    def __init__(self, record: Callable[[float], None]) -> None:
        self._record = record
        self._starts: list[float] = []

    def __enter__(self) -> Timer:
        self._starts.append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        self._record(time.perf_counter() - self._starts.pop())

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._record(time.perf_counter() - start)

        return timed  # type: ignore[return-value]
