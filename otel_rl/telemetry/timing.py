"""Timers: one record of each use on the phase clock and in its factory, and the spans of timers.

:class:`PhaseTimer` is what ``Logger.timer`` and ``WorkerMetrics.timer`` hand out.
:class:`TimerSpan` and :func:`ambient_tracer` give timers that belong to no Logger — the NeMo RL
and verl drop-ins' (``otel_rl.compat``) — the same spans, in the trace of the newest live
Logger's step.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from otel_rl.core.keys import KeyCollisionError

F = TypeVar("F", bound=Callable[..., Any])

#: Bucket bounds (seconds) for timing histograms: 1 ms to 1 h.
TIMING_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


# ---- the timers open right now, and where each thread's time went ------------------------------
#
# A phase clock keeps, per thread, the stack of open timers and the exclusive seconds of each timer
# path (the names of the open timers joined by "/", outermost first): at each start and stop the
# interval since the previous one is charged to the path that was innermost then ("" when no timer
# was open). Stacks and totals are changed only by their own thread; other threads copy them. A
# stack entry is ``(name, monotonic start, owner, path, seq, epoch)``, the owner a weak reference
# to the object that will stop the timer (``None``: a block that always ends), ``seq`` the use's
# number in the process and ``epoch`` the clock's epoch when it opened (see
# :meth:`PhaseClock.record_spans`).

#: Completed uses of a path whose durations :func:`phase_history` keeps.
HISTORY = 20
#: Names in a timer path at most: a timer opened deeper is counted in the deepest path.
MAX_DEPTH = 8
#: Closed uses a clock keeps for spans, and a timer factory for its rows, until they are taken
#: (at each ``log_metrics`` call; the oldest go beyond it, said once).
SPAN_RECORDS = 100_000

#: A closed use of a timer (:meth:`PhaseClock.record_spans`).
ClosedTimer = tuple[str, float, float, int, str, int, int, int, int]


class SpanRecords(deque[ClosedTimer]):
    """One reader's closed uses for spans (:meth:`PhaseClock.record_spans`), bounded, and what
    it took (only the reader counts: the clock's thread just appends)."""

    def __init__(self, since: int) -> None:
        super().__init__(maxlen=SPAN_RECORDS)
        self._since = since  # the clock's count of closed uses when this record began
        #: That count when the clock stopped appending here (its reader stopped), if so.
        self.until: int | None = None
        self.taken = 0

    def pushed_out(self, recorded: int) -> int:
        """How many of the uses appended the bound let go before the reader took them, given
        the clock's count of closed uses read before this call (so that it is never
        over-counted: an append racing it only makes it smaller)."""
        until = self.until
        if until is not None and until < recorded:  # another record took the later ones
            recorded = until
        return recorded - self._since - self.taken - len(self)


class _EveryReader:
    """What the clock appends a closed use to when more than one reader records (two Loggers
    in one process): each reader's own record gets it."""

    __slots__ = ("readers",)

    def __init__(self, readers: tuple[SpanRecords, ...]) -> None:
        self.readers = readers

    def append(self, closed: ClosedTimer) -> None:
        for records in self.readers:
            records.append(closed)


_now = time.monotonic
_thread = threading.get_ident


def _path(top: str, name: str) -> str:
    """The path of a timer ``name`` opened inside the path ``top``."""
    if not top:
        return name
    if top == name or top.endswith("/" + name) or top.count("/") >= MAX_DEPTH - 1:
        # a timed function that calls itself is one phase, not a path per depth; and a path
        # is at most MAX_DEPTH names (a tracker's key has a length limit)
        return top
    return f"{top}/{name}"


class _ThreadPhases:
    __slots__ = ("events", "ident", "name", "owned", "paths", "since", "stack", "top", "totals")

    def __init__(self, now: float) -> None:
        self.ident = _thread()
        self.name = threading.current_thread().name
        self.stack: list[tuple[str, float, Any, str, int, int]] = []
        self.totals: dict[str, float] = {}
        self.since = now
        self.top = ""
        #: Starts and stops so far: equal counts mean equal ``totals``.
        self.events = 0
        #: Entries of ``stack`` with an owner (only those can be orphans).
        self.owned = 0
        #: ``{enclosing path: {name: path}}``: each path is built once.
        self.paths: dict[str, dict[str, str]] = {}

    def charge(self, now: float) -> None:
        totals, top = self.totals, self.top
        totals[top] = totals.get(top, 0.0) + (now - self.since)
        self.since = now
        self.events += 1


class PhaseClock:
    """Where the time of each thread went, by timer path (exclusive seconds), and the timers open
    now. The process has one (:data:`PROCESS_CLOCK`, fed by every timer); a ``WorkerMetrics`` has
    its own, fed by its timers only, so that a worker run inside the driver's process counts only
    its own time. Its open and close are a timer's one record on the caller's thread: a clock
    read and a list append each."""

    def __init__(self, history: bool = False) -> None:
        self._threads: dict[int, _ThreadPhases] = {}
        self._history: dict[str, deque[float]] | None = {} if history else None
        self._seq = itertools.count(1)
        self._epoch = 0
        #: Where closed uses go, for spans: ``(name, start, end, thread id, thread name, seq,
        #: parent seq or 0, epoch of the outermost timer open around it, epoch it closed in)``;
        #: the one reader's record, every reader's, or ``None`` when none records.
        self._closed: SpanRecords | _EveryReader | None = None
        self._span_readers: tuple[SpanRecords, ...] = ()
        #: Closed uses appended so far (a reader sees whether any closed since it looked).
        self.recorded = 0

    def record_spans(self) -> SpanRecords:
        """From now on every use that closes is appended to the deque returned, the caller's
        own (it takes from its left), until it calls :meth:`stop_spans` with it."""
        records = SpanRecords(self.recorded)
        self._set_readers((*self._span_readers, records))
        return records

    def stop_spans(self, records: SpanRecords) -> None:
        """That reader's record gets no more uses."""
        records.until = self.recorded
        self._set_readers(tuple(r for r in self._span_readers if r is not records))

    def _set_readers(self, readers: tuple[SpanRecords, ...]) -> None:
        self._span_readers = readers
        self._closed = None if not readers else readers[0] if len(readers) == 1 else (
            _EveryReader(readers)
        )  # fmt: skip

    def next_epoch(self) -> int:
        """End the current epoch (a step's timers, up to a ``log_metrics`` call) and return it:
        timers opened from now on, and those they enclose, carry the next one."""
        ended = self._epoch
        self._epoch = ended + 1
        return ended

    def open(self, name: str, owner: Any = None) -> None:
        now = _now()
        state = self._threads.get(_thread())
        if state is None:
            state = self._threads[_thread()] = _ThreadPhases(now)
        elif state.owned:
            _drop_orphans(state, now)
        totals, top = state.totals, state.top  # the interval so far is the innermost path's
        totals[top] = totals.get(top, 0.0) + (now - state.since)
        state.since = now
        state.events += 1
        paths = state.paths.get(top)
        if paths is None:
            paths = state.paths[top] = {}
        path = paths.get(name)
        if path is None:
            path = paths[name] = _path(top, name)
        state.top = path
        if owner is not None:
            state.owned += 1
            owner = weakref.ref(owner)
        state.stack.append((name, now, owner, path, next(self._seq), self._epoch))

    def close(self, name: str) -> float | None:
        """The timer ``name`` stopped: usually this thread's innermost one; stopped out of order,
        the latest of that name; stopped on another thread, the latest of that name anywhere.
        Returns its seconds, or ``None`` when no such timer is open or this use ran inside an
        open use of the same name (a timed function that calls itself: the outermost call's
        seconds hold the inner ones', which would be counted twice)."""
        now = _now()
        state = self._threads.get(_thread())
        if state is not None and state.stack and state.stack[-1][0] == name:
            return self._stopped(state, len(state.stack) - 1, now)  # the usual stop
        for candidate in ([state] if state is not None else []) + list(self._threads.values()):
            stack = candidate.stack
            for index in range(len(stack) - 1, -1, -1):
                if stack[index][0] == name:
                    return self._stopped(candidate, index, now)
        return None

    def _stopped(self, state: _ThreadPhases, index: int, now: float) -> float | None:
        totals, top = state.totals, state.top
        totals[top] = totals.get(top, 0.0) + (now - state.since)
        state.since = now
        state.events += 1
        stack = state.stack
        name, start, owner, path, seq, epoch = stack.pop(index)
        if owner is not None:
            state.owned -= 1
        state.top = stack[-1][3] if stack else ""
        closed = self._closed
        if closed is not None:
            parent = stack[index - 1][4] if index else 0
            outer = stack[0][5] if index else epoch
            closed.append((name, start, now, state.ident, state.name, seq, parent, outer,
                           self._epoch))
            self.recorded += 1
        if index:  # inside a use of the same name, which counts this one's time (looked for
            # as far as a path goes: a stack that only grows must not slow every stop)
            for entry in stack[max(0, index - MAX_DEPTH) : index]:
                if entry[0] == name:
                    return None
        history = self._history
        if history is not None:
            recent = history.get(path)
            if recent is None:
                recent = history.setdefault(path, deque(maxlen=HISTORY))
            recent.append(now - start)
        return now - start

    def open_stacks(self) -> dict[int, list[tuple[str, float, str]]]:
        """``{thread ident: [(name, monotonic start, path), ...]}`` of the live threads with
        open timers whose owner still lives, outermost first (a copy)."""
        live = {t.ident for t in threading.enumerate()}
        for ident in [i for i in list(self._threads) if i not in live]:
            self._threads.pop(ident, None)  # a thread that died (inside a timer or not)
        return {
            ident: held
            for ident, state in list(self._threads.items())
            if (held := [(n, at, path) for n, at, owner, path, _, _ in list(state.stack)
                         if owner is None or owner()])
        }  # fmt: skip

    def history(self, path: str) -> tuple[float, ...]:
        recent = None if self._history is None else self._history.get(path)
        return tuple(recent) if recent else ()

    def reading(self, ident: int) -> tuple[int, dict[str, float], str, float] | None:
        """``(events, totals, innermost path, since)`` of a thread, ``totals`` itself, not a copy
        (copy it at once: ``dict(totals)`` is atomic), or ``None`` if it never timed anything."""
        state = self._threads.get(ident)
        if state is None:
            return None
        if state.owned and ident == threading.get_ident():
            _drop_orphans(state, time.monotonic())
        return state.events, state.totals, state.top, state.since

    def threads(self) -> list[int]:
        """The threads that have timed something."""
        return list(self._threads)

    def take(self) -> dict[str, float]:
        """Exclusive seconds by path, over every thread, since the previous ``take`` (for one
        reader: a ``WorkerMetrics`` snapshot)."""
        now = time.monotonic()
        out: dict[str, float] = {}
        for state in list(self._threads.values()):
            totals, top, since = state.totals, state.top, state.since
            state.totals = {}
            totals[top] = totals.get(top, 0.0) + (now - since)
            state.since = now
            for path, spent in totals.items():
                if path:
                    out[path] = out.get(path, 0.0) + spent
        return out

    def after_fork(self) -> None:
        """The parent's other threads do not exist in a fork child: neither do their timers."""
        ident = threading.get_ident()
        for other in [i for i in self._threads if i != ident]:
            self._threads.pop(other, None)


def _drop_orphans(state: _ThreadPhases, now: float) -> None:
    """Forget the open timers whose owner is gone: they can never stop, and must not be charged
    the thread's time from now on."""
    stack = state.stack
    if all(entry[2] is None or entry[2]() is not None for entry in stack):
        return
    state.charge(now)
    stack[:] = [entry for entry in stack if entry[2] is None or entry[2]() is not None]
    state.owned = sum(1 for entry in stack if entry[2] is not None)
    state.top = stack[-1][3] if stack else ""


#: The clock every timer of this process feeds (the stall watchdog and the step anatomy read it).
PROCESS_CLOCK = PhaseClock(history=True)


def timer_opened(name: str, owner: Any = None) -> None:
    """A timer named ``name`` started on this thread; ``owner``, when given, stops it (a timer
    whose owner is gone can never stop, and is no longer listed as open)."""
    PROCESS_CLOCK.open(name, owner)


def timer_closed(name: str) -> None:
    """That timer stopped (see :meth:`PhaseClock.close`)."""
    PROCESS_CLOCK.close(name)


def open_timers() -> dict[int, list[tuple[str, float]]]:
    """``{thread ident: [(name, monotonic start), ...]}`` of the live threads with open timers,
    outermost first (a copy)."""
    return {
        ident: [(name, at) for name, at, _ in stack]
        for ident, stack in PROCESS_CLOCK.open_stacks().items()
    }


def open_phases() -> dict[int, list[tuple[str, float]]]:
    """``{thread ident: [(path, monotonic start), ...]}``: the open timers by path."""
    return {
        ident: [(path, at) for _, at, path in stack]
        for ident, stack in PROCESS_CLOCK.open_stacks().items()
    }


def phase_history(path: str) -> tuple[float, ...]:
    """Durations (seconds) of the last :data:`HISTORY` completed uses of ``path`` in this
    process, oldest first."""
    return PROCESS_CLOCK.history(path)


class PhaseTimer:
    """Context manager and decorator; each exit appends ``(key, elapsed seconds)`` to ``done``.

    The phase clock's open and close and that append are all a use costs the caller's thread:
    the rows, the OpenTelemetry histogram and the anatomy are derived from them later
    (:class:`TimerFactory`). Untraced, it holds no state of its own, so one object serves nested
    and concurrent uses. With a ``tracer`` each use is also an OTel span named ``name``, a
    child of whatever span is current (so nested timers nest), whose duration is exactly the
    recorded value. Every use feeds the process's :data:`PROCESS_CLOCK`, and ``clock`` too when
    given (a worker's own, whose reading is then the value).
    """

    __slots__ = ("__weakref__", "_attributes", "_clock", "_done", "_key", "_name", "_spans",
                 "_tracer")  # fmt: skip

    def __init__(
        self,
        done: Callable[[tuple[str, float]], None],
        key: str,
        name: str,
        tracer: Any = None,
        attributes: Mapping[str, Any] | None = None,
        clock: PhaseClock | None = None,
    ) -> None:
        self._done = done
        self._key = key
        self._name = name
        self._clock = clock
        self._tracer = tracer
        self._attributes = attributes
        #: Traced: each thread's open spans of this timer (one object may be used by many).
        self._spans: dict[int, list[Any]] | None = {} if tracer is not None else None

    def __enter__(self) -> PhaseTimer:
        if self._spans is not None:
            scope = self._tracer.start_as_current_span(
                self._name, attributes=self._attributes, end_on_exit=False
            )
            self._spans.setdefault(_thread(), []).append((scope, scope.__enter__()))
        PROCESS_CLOCK.open(self._name)
        if self._clock is not None:
            self._clock.open(self._name)
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = PROCESS_CLOCK.close(self._name)
        if self._clock is not None:
            elapsed = self._clock.close(self._name)
        if elapsed is not None:
            self._done((self._key, elapsed))
        if self._spans is not None:
            held = self._spans.get(_thread())
            if held:  # (none: a use opened on another thread, whose span that thread ends)
                scope, span = held.pop()
                if not held:
                    del self._spans[_thread()]
                _end_span(scope, span, elapsed, exc)

    def __call__(self, fn: F) -> F:
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or (
            inspect.isasyncgenfunction(fn)
        ):  # fmt: skip
            return _timed_iteration(self, fn)
        done, key, label = self._done, self._key, self._name
        opened, closed = _clock_hooks(self._clock)
        tracer, attributes = self._tracer, self._attributes

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            scope = span = None
            if tracer is not None:
                scope = tracer.start_as_current_span(label, attributes=attributes,
                                                     end_on_exit=False)  # fmt: skip
                span = scope.__enter__()
            opened(label)
            exc: tuple[Any, Any, Any] = (None, None, None)
            try:
                return fn(*args, **kwargs)
            except BaseException as error:
                exc = (type(error), error, error.__traceback__)
                raise
            finally:
                elapsed = closed(label)
                if elapsed is not None:
                    done((key, elapsed))
                if scope is not None:
                    _end_span(scope, span, elapsed, exc)

        return timed  # type: ignore[return-value]


def _timed_iteration(timer: PhaseTimer, fn: F) -> F:
    """``fn``, a generator, coroutine or async generator function, timed from its first step
    to its end (its items' consumer included, as a ``with`` around the loop would), not the
    instant its call makes the generator or coroutine. Such calls interleave on one thread (two
    tasks awaiting at once): traced, each call gets a timer of its own, so each ends its own
    span."""
    if timer._tracer is None:  # untraced, a timer holds no state: one serves every call
        use: Callable[[], PhaseTimer] = lambda: timer  # noqa: E731
    else:
        use = functools.partial(PhaseTimer, timer._done, timer._key, timer._name, timer._tracer,
                                timer._attributes, timer._clock)  # fmt: skip
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
            with use():
                return await fn(*args, **kwargs)

        return timed_coroutine  # type: ignore[return-value]
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def timed_async_items(*args: Any, **kwargs: Any) -> Any:
            with use():
                async for item in fn(*args, **kwargs):
                    yield item

        return timed_async_items  # type: ignore[return-value]

    @functools.wraps(fn)
    def timed_items(*args: Any, **kwargs: Any) -> Any:
        with use():
            return (yield from fn(*args, **kwargs))

    return timed_items  # type: ignore[return-value]


class UnusedTimer(PhaseTimer):
    """What ``Logger.timer`` hands out for a name it refused (and reported): it times nothing;
    the block or the function it holds runs as it would without it."""

    __slots__ = ()

    def __init__(self) -> None:  # no clock, no key: nothing is recorded
        pass

    def __enter__(self) -> UnusedTimer:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __call__(self, fn: F) -> F:
        return fn


def _clock_hooks(
    clock: PhaseClock | None,
) -> tuple[Callable[[str], None], Callable[[str], float | None]]:
    """What a decorated function calls at its start and stop: the process clock's, and
    ``clock``'s too when given (whose reading is then the value)."""
    if clock is None:
        return PROCESS_CLOCK.open, PROCESS_CLOCK.close

    def opened(name: str) -> None:
        PROCESS_CLOCK.open(name)
        clock.open(name)

    def closed(name: str) -> float | None:
        PROCESS_CLOCK.close(name)
        return clock.close(name)

    return opened, closed


def _end_span(scope: Any, span: Any, elapsed: float | None, exc: tuple[Any, ...]) -> None:
    """Leave the span's scope (recording an exception) and end it ``elapsed`` seconds after its
    start: the span's duration is the timer's value, to the nanosecond."""
    try:
        scope.__exit__(*exc)
    finally:
        start = getattr(span, "start_time", None)
        ended = None if start is None or elapsed is None else start + round(elapsed * 1e9)
        span.end(end_time=ended)


class TimerFactory:
    """Hands out :class:`PhaseTimer` objects for ``timing/<name>`` and keeps what they timed.

    A timer's key is claimed in ``keys`` the first time its name is used, so that a timer
    cannot collide with a logged metric (``KeyCollisionError``). Every use of every timer is
    appended to one deque (thread-safe, no lock): :meth:`take` hands its content over, once per
    ``log_metrics`` call or snapshot, and gives it to ``instruments`` too (the histograms that
    Prometheus and OTLP read).
    """

    def __init__(
        self,
        keys: Any,
        tracer: Any = None,
        span_attributes: Mapping[str, Any] | None = None,
        clock: PhaseClock | None = None,
        instruments: TimingInstruments | None = None,
    ) -> None:
        self._clock = clock
        self._keys = keys
        self._tracer = tracer
        self._span_attributes = span_attributes
        self._instruments = instruments
        self._done: deque[tuple[str, float]] = deque(maxlen=SPAN_RECORDS)
        self._known: dict[str, PhaseTimer] = {}
        #: ``{name: PhaseTimer}`` of the timers that can be handed out again (untraced, a
        #: PhaseTimer has no state: one per name); a caller may look a name up here first.
        self.shared: dict[str, PhaseTimer] = self._known if tracer is None else {}
        self._overflowed = False

    def timer(self, name: str, instrument: bool = True) -> PhaseTimer:
        """The timer ``name``; raises ``KeyCollisionError`` when its OTel instrument's name is
        taken, unless ``instrument`` is False (its rows then reach the trackers alone)."""
        known = self._known.get(name)
        if known is not None and self._tracer is None:
            return known
        if known is None:
            from otel_rl.core.catalogue import TIMING

            key, description = TIMING.member(name)
            if instrument:
                claimed = self._keys.claim(key, "timer")
                if self._instruments is not None:
                    self._instruments.add(key, claimed, description)
        else:
            key = known._key
        timer = PhaseTimer(self._done.append, key, name, self._tracer, self._span_attributes,
                      self._clock)  # fmt: skip
        self._known[name] = timer
        return timer

    def checked_timer(self, name: Any, report: Callable[[str, str], None]) -> PhaseTimer:
        """The timer ``name``, its name checked as a logged key's is, each finding given to
        ``report(key, reason)`` (which raises in strict mode): another type is converted to
        text, a lone surrogate refuses it (an :class:`UnusedTimer`: no tracker could store its
        key), an OTel name taken keeps it from OTel only (its rows still reach the trackers)."""
        if type(name) is not str:
            try:
                text = str(name)
            except Exception as exc:
                report(f"timing/<{type(name).__name__}>",
                       f"timer skipped: its name cannot be text ({exc!r:.80})")  # fmt: skip
                return UnusedTimer()
            report(f"timing/{text}", f"timer name of type {type(name).__name__} "
                   f"converted to the string {text!r}")  # fmt: skip
            name = text
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                report(f"timing/{name}", "timer skipped: its name holds a lone surrogate, "
                       "which no tracker can store (decode its bytes with errors='replace')")
                return UnusedTimer()
        try:
            return self.timer(name)
        except KeyCollisionError as exc:
            report(f"timing/{name}", str(exc))
            return self.timer(name, instrument=False)

    def take(self) -> list[tuple[str, float]]:
        """``(key, seconds)`` of every use that ended since the previous ``take``."""
        done = self._done
        if not done:
            return []
        if len(done) == done.maxlen and not self._overflowed:
            self._overflowed = True
            from otel_rl.process.fork_safe_log import log

            log.warning(
                "otel-rl: timers were used %d times or more between two log_metrics calls: "
                "only the newest %d of such a stretch are in the timing/* rows and histograms",
                SPAN_RECORDS, SPAN_RECORDS,
            )  # fmt: skip
        taken = [done.popleft() for _ in range(len(done))]
        if self._instruments is not None:
            self._instruments.put(taken)
        return taken


def timing_totals(timings: Iterable[tuple[str, float]]) -> dict[str, tuple[float, int]]:
    """``{key: (seconds, uses)}`` of ``timings``."""
    totals: dict[str, tuple[float, int]] = {}
    for key, seconds in timings:
        total, count = totals.get(key, (0.0, 0))
        totals[key] = (total + seconds, count + 1)
    return totals


class TimingInstruments:
    """The ``timing/<name>`` histograms of a run, for the operator outputs (Prometheus, OTLP).

    The timings wait in a bounded deque and are recorded into their histograms when an
    operator output collects, on its own thread: the callback of the observable counter of the
    timings dropped records them before the SDK reads the histograms, so the caller's thread never
    pays for an SDK ``record``, and each histogram keeps one aggregation per series. A reader
    that is never read (a ``/metrics`` nobody scrapes) keeps the latest :data:`PENDING` timings;
    older ones are dropped, counted (``otel_rl.timings.dropped``) and said once.
    """

    #: Timings kept between two collections.
    PENDING = 200_000

    def __init__(self, meter: Any) -> None:
        self._meter = meter
        self._records: dict[str, Callable[[float], None]] = {}
        self._pending: deque[tuple[str, float]] = deque(maxlen=self.PENDING)
        self.dropped = 0
        self._lock = threading.Lock()
        from otel_rl.core.catalogue import TIMINGS_DROPPED

        TIMINGS_DROPPED.create(meter, [self._drain])

    def add(self, key: str, instrument: str, description: str) -> None:
        from otel_rl.core.catalogue import TIMING

        histogram = TIMING.create(self._meter, name=instrument, description=description,
                                  explicit_bucket_boundaries_advisory=TIMING_BUCKETS)  # fmt: skip
        self._records[key] = histogram.record

    def put(self, timings: list[tuple[str, float]]) -> None:
        """Timings for the histograms (the step's, on the caller's thread: a deque extend)."""
        pending = self._pending
        over = len(pending) + len(timings) - self.PENDING
        if over > 0:
            self.dropped += over
            if self.dropped == over:
                from otel_rl.process.fork_safe_log import log

                log.warning(
                    "otel-rl: %d timings waited for Prometheus/OTLP to collect them; the oldest "
                    "are dropped from their histograms from now on (the trackers' timing/* rows "
                    "keep every one): scrape /metrics, or lower otlp.interval", self.PENDING,
                )  # fmt: skip
        pending.extend(timings)

    def _drain(self, options: Any) -> list[Any]:
        """The callback of ``otel_rl.timings.dropped``: the waiting timings are recorded into
        their histograms first, and the output reads them in the same collection."""
        from opentelemetry.metrics import Observation

        pending, records = self._pending, self._records
        with self._lock:  # two outputs collecting at once: each timing is recorded once
            for _ in range(len(pending)):
                key, seconds = pending.popleft()
                record = records.get(key)
                if record is not None:  # (None: a timer whose instrument's name was taken)
                    record(seconds)
        return [Observation(self.dropped)]


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
    PROCESS_CLOCK.after_fork()


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
