"""Timers that record durations (seconds) into an OTel histogram."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
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
    each measure their own interval. With a ``tracer`` each use is also an OTel span named
    ``span_name``, a child of whatever span is current (so nested timers nest), whose duration
    is exactly the recorded value; without one the only extra cost is a ``None`` check.
    """

    __slots__ = ("_attributes", "_record", "_span_name", "_spans", "_starts", "_tracer")

    def __init__(
        self,
        record: Callable[[float], None],
        tracer: Any = None,
        span_name: str = "",
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        self._record = record
        self._starts: list[float] = []
        self._tracer = tracer
        self._span_name = span_name
        self._attributes = attributes
        self._spans: list[Any] | None = [] if tracer is not None else None

    def __enter__(self) -> Timer:
        if self._spans is not None:
            scope = self._tracer.start_as_current_span(
                self._span_name, attributes=self._attributes, end_on_exit=False
            )
            self._spans.append((scope, scope.__enter__()))
        self._starts.append(time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = time.perf_counter() - self._starts.pop()
        self._record(elapsed)
        if self._spans is not None:
            scope, span = self._spans.pop()
            _end_span(scope, span, elapsed, exc)

    def __call__(self, fn: F) -> F:
        record = self._record

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(time.perf_counter() - start)

        if self._tracer is None:
            return timed  # type: ignore[return-value]
        tracer, name, attributes = self._tracer, self._span_name, self._attributes

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            scope = tracer.start_as_current_span(name, attributes=attributes, end_on_exit=False)
            span = scope.__enter__()
            start = time.perf_counter()
            exc: tuple[Any, Any, Any] = (None, None, None)
            try:
                return fn(*args, **kwargs)
            except BaseException as error:
                exc = (type(error), error, error.__traceback__)
                raise
            finally:
                elapsed = time.perf_counter() - start
                record(elapsed)
                _end_span(scope, span, elapsed, exc)

        return traced  # type: ignore[return-value]


def _end_span(scope: Any, span: Any, elapsed: float, exc: tuple[Any, ...]) -> None:
    """Leave the span's scope (recording an exception) and end it ``elapsed`` seconds after its
    start: the span's duration is the timer's value, to the nanosecond."""
    try:
        scope.__exit__(*exc)
    finally:
        start = getattr(span, "start_time", None)
        span.end(end_time=None if start is None else start + round(elapsed * 1e9))


class TimerFactory:
    """Hands out :class:`Timer` objects for ``timing/<name>``, one histogram per name.

    The histogram is created on ``meter`` the first time a name is used; its key is claimed in
    ``keys`` so a timer cannot collide with a logged metric (``KeyCollisionError``).
    """

    def __init__(
        self,
        meter: Any,
        keys: Any,
        tracer: Any = None,
        span_attributes: Mapping[str, Any] | None = None,
    ) -> None:
        self._meter = meter
        self._keys = keys
        self._tracer = tracer
        self._span_attributes = span_attributes
        self._records: dict[str, Callable[[float], None]] = {}

    def timer(self, name: str) -> Timer:
        record = self._records.get(name)
        if record is None:
            instrument = self._keys.claim(f"timing/{name}", "timer")
            histogram = self._meter.create_histogram(
                instrument,
                unit="s",
                description=f"duration of {name}",
                explicit_bucket_boundaries_advisory=TIMING_BUCKETS,
            )
            record = self._records[name] = histogram.record
        if self._tracer is None:
            return Timer(record)
        return Timer(record, self._tracer, name, self._span_attributes)
