"""Timers that record durations (seconds) into an OTel histogram, and the spans of timers.

:class:`Timer` is what ``Logger.timer`` and ``WorkerMetrics.timer`` hand out. :class:`TimerSpan`
and :func:`ambient_tracer` give timers that belong to no Logger — the NeMo RL and verl drop-ins'
(``otel_rl.compat``) — the same spans, in the trace of the newest live Logger's step.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Bucket bounds (seconds) for timing histograms: 1 ms to 1 h.
TIMING_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


# ---- the timers open right now (read by the stall report) ---------------------------------------
#
# One list per thread, outermost first: ``(name, monotonic start, owner)``, the owner a weak
# reference to the object that will stop the timer (``None``: a block that always ends). Each list
# is appended to and popped only by its own thread; the stall watchdog copies them from another.
_open_timers: dict[int, list[tuple[str, float, Any]]] = {}


def timer_opened(name: str, owner: Any = None) -> None:
    """A timer named ``name`` started on this thread; ``owner``, when given, stops it (a timer
    whose owner is gone can never stop, and is no longer listed as open)."""
    ident = threading.get_ident()
    stack = _open_timers.get(ident)
    if stack is None:
        stack = _open_timers[ident] = []
    stack.append((name, time.monotonic(), None if owner is None else weakref.ref(owner)))


def timer_closed(name: str) -> None:
    """That timer stopped (usually the innermost one; stopped out of order, the latest of that
    name; stopped on another thread, the latest of that name anywhere)."""
    stack = _open_timers.get(threading.get_ident())
    if stack and stack[-1][0] == name:
        stack.pop()
        return
    for candidate in ([stack] if stack else []) + list(_open_timers.values()):
        for index in range(len(candidate) - 1, -1, -1):
            if candidate[index][0] == name:
                del candidate[index]
                return


def open_timers() -> dict[int, list[tuple[str, float]]]:
    """``{thread ident: [(name, monotonic start), ...]}`` of the live threads with open timers,
    outermost first (a copy)."""
    live = {t.ident for t in threading.enumerate()}
    for ident in [i for i in list(_open_timers) if i not in live]:
        _open_timers.pop(ident, None)  # a thread that died inside a timer
    return {
        ident: held
        for ident, stack in list(_open_timers.items())
        if (held := [(n, at) for n, at, owner in list(stack) if owner is None or owner()])
    }


class Timer:
    """Context manager and decorator; each exit records the elapsed seconds.

    ``record`` is the histogram's ``record``. Nested and concurrent uses of one Timer object
    each measure their own interval. With a ``tracer`` each use is also an OTel span named
    ``span_name``, a child of whatever span is current (so nested timers nest), whose duration
    is exactly the recorded value; without one the only extra cost is a ``None`` check.
    """

    __slots__ = (
        "__weakref__", "_attributes", "_name", "_record", "_span_name", "_spans", "_starts",
        "_tracer",
    )  # fmt: skip

    def __init__(
        self,
        record: Callable[[float], None],
        tracer: Any = None,
        span_name: str = "",
        attributes: Mapping[str, Any] | None = None,
        name: str = "",
    ) -> None:
        self._name = name or span_name or "timer"
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
        timer_opened(self._name, self)
        self._starts.append(time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = time.perf_counter() - self._starts.pop()
        timer_closed(self._name)
        self._record(elapsed)
        if self._spans is not None:
            scope, span = self._spans.pop()
            _end_span(scope, span, elapsed, exc)

    def __call__(self, fn: F) -> F:
        record, label = self._record, self._name

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            timer_opened(label)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(time.perf_counter() - start)
                timer_closed(label)

        if self._tracer is None:
            return timed  # type: ignore[return-value]
        tracer, name, attributes = self._tracer, self._span_name, self._attributes

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            scope = tracer.start_as_current_span(name, attributes=attributes, end_on_exit=False)
            span = scope.__enter__()
            timer_opened(label)
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
                timer_closed(label)
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
            from otel_rl.core.catalogue import TIMING

            key, description = TIMING.member(name)
            histogram = TIMING.create(
                self._meter,
                name=self._keys.claim(key, "timer"),
                description=description,
                explicit_bucket_boundaries_advisory=TIMING_BUCKETS,
            )
            record = self._records[name] = histogram.record
        if self._tracer is None:
            return Timer(record, name=name)
        return Timer(record, self._tracer, name, self._span_attributes)


# ---- spans of timers that belong to no Logger (the NeMo RL and verl drop-ins' timers) ----------
#
# Such a timer is created without a Logger, often before one exists, so it looks its tracer up at
# each start. This module stays free of OTel imports: with tracing off the look-up is two checks
# of module globals.

# ``StepSpans.tracer`` of each live Logger with tracing, newest last (weak: a dropped Logger is
# not pinned). Replaced, never mutated, so readers need no lock.
_step_tracers: tuple[weakref.ref[Any], ...] = ()
_registry_lock = threading.Lock()
# Set by otel_rl.telemetry.tracing when imported: the tracer of a traced Ray worker (the hook
# ran in the process, which is not the driver), or None.
_process_tracer: Callable[[], Any] | None = None


def add_step_tracer(tracer: Any) -> None:
    """A Logger with tracing starts: drop-in timers make spans under its ``rl.step`` spans."""
    global _step_tracers
    with _registry_lock:
        live = tuple(r for r in _step_tracers if r() is not None)
        _step_tracers = (*live, weakref.ref(tracer))


def remove_step_tracer(tracer: Any) -> None:
    """That Logger finished: drop-in timers go back to the newest Logger still live."""
    global _step_tracers
    with _registry_lock:
        _step_tracers = tuple(r for r in _step_tracers if r() not in (None, tracer))


def drop_step_tracers_after_fork() -> None:
    """In a fork child the inherited Loggers are disabled: their steps are not the child's."""
    global _step_tracers, _registry_lock, _deferred_lock
    # a parent thread may have held them at fork
    _registry_lock = threading.Lock()
    _deferred_lock = threading.Lock()
    _step_tracers = ()
    _deferred.clear()
    # the parent's other threads do not exist in the child: neither do their open timers
    ident = threading.get_ident()
    for other in [i for i in _open_timers if i != ident]:
        _open_timers.pop(other, None)


def set_process_tracer(lookup: Callable[[], Any] | None) -> None:
    """Where drop-in timers find a tracer when no Logger with tracing is live (``None``: no
    spans then)."""
    global _process_tracer
    _process_tracer = lookup


def ambient_tracer() -> Any:
    """The tracer for a timer that belongs to no Logger, or ``None`` (tracing off): the newest
    live Logger's step tracer, else a traced Ray worker's own (its spans continue the trace of
    the driver call that runs them)."""
    tracers = _step_tracers
    if tracers:
        for ref in reversed(tracers):
            tracer = ref()
            if tracer is not None:
                return tracer
    lookup = _process_tracer
    return None if lookup is None else lookup()


# Spans whose context could not be detached when they closed (stopped out of order, or on another
# thread than the one that opened them), by the thread they are attached in. Detached as soon as
# each is that thread's current context again: contexts are only ever detached in the order they
# were attached, so an out-of-order stop never leaves the wrong context current.
_deferred: dict[int, list[TimerSpan]] = {}
_deferred_lock = threading.Lock()


class TimerSpan:
    """The span of one use of a timer, from its start to its stop.

    Opening it makes it the current span of the thread (what the block calls — nested timers,
    Ray calls, ``trace_carrier()`` — is its child); a timer started with no span current is a
    child of the current ``rl.step`` span. Closing it ends it ``elapsed`` seconds after its
    start, so its duration is the timer's value, and restores the context it replaced.
    """

    __slots__ = ("_context", "_thread", "_token", "span")

    def __init__(self, tracer: Any, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        from opentelemetry import context as context_api
        from opentelemetry import trace

        if _deferred:
            _detach_deferred()
        parent = context_api.get_current()
        if not trace.get_current_span(parent).get_span_context().is_valid:
            step_context = getattr(tracer, "step_context", None)
            if step_context is not None:
                parent = step_context()
        self.span = tracer.start_span(name, context=parent, attributes=attributes)
        self._context = trace.set_span_in_context(self.span, parent)
        self._thread = threading.get_ident()
        self._token = context_api.attach(self._context)

    def fail(self, error: BaseException) -> None:
        """The timed block raised ``error``: the span records it and is marked failed (as a
        ``Logger.timer`` span is)."""
        from opentelemetry.trace import Status, StatusCode

        self.span.record_exception(error)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def close(self, elapsed: float, error: BaseException | None = None) -> None:
        """End the span ``elapsed`` seconds after it started; ``error`` marks it failed."""
        span = self.span
        try:
            if error is not None:
                self.fail(error)
        finally:
            start = getattr(span, "start_time", None)
            span.end(end_time=None if start is None else start + round(elapsed * 1e9))
            self.release()

    def release(self) -> None:
        """Restore the context this span replaced, now or as soon as it is current again
        (alone, without ending the span: a timer that was reset while running has no value)."""
        if self._detach():
            if _deferred:
                _detach_deferred()
            return
        with _deferred_lock:
            _deferred.setdefault(self._thread, []).append(self)

    def _detach(self) -> bool:
        from opentelemetry import context as context_api

        if self._thread != threading.get_ident() or context_api.get_current() is not self._context:
            return False
        var = getattr(self._token, "var", None)
        if var is None:  # a runtime context other than contextvars: its own detach
            context_api.detach(self._token)
            return True
        try:
            var.reset(self._token)
        except (ValueError, RuntimeError):  # attached in another asyncio task's context
            return False
        return True


def _detach_deferred() -> None:
    """Detach this thread's deferred spans that are current again (innermost first)."""
    ident = threading.get_ident()
    if ident not in _deferred:
        return
    with _deferred_lock:
        pending = _deferred.get(ident, [])
        progress = True
        while pending and progress:
            progress = False
            for scope in reversed(pending):
                if scope._detach():
                    pending.remove(scope)
                    progress = True
                    break
        if not pending:
            _deferred.pop(ident, None)
