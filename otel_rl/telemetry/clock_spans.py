"""The spans of a run's timers on disk, made from the phase clock's records, with no tracing SDK.

With ``tracing.enabled`` unset (the default), a timer's use costs the caller's thread what it
costs anyway: the phase clock appends each closed use to a deque (``telemetry/timing.py``), with
the clock's epoch then. Each ``log_metrics`` call ends an epoch (:meth:`ClockSpans.take`), and
a sealed step is queued with its epochs; the trace file's thread, every half second or when many
steps wait, gives each closed use to the step it closed in and makes them the step's spans in
OTLP JSON (``traces.jsonl``): one trace per step, its ``rl.step`` span
from the end of the previous step's last call to its own, each timer's span a child of the timer
it ran in (or of the step's span), its duration the timer's value. A timer enclosing others
keeps their trace: the trace of the step in which it opened. The same rules as the SDK's step
spans (``telemetry/tracing.StepSpans``), without an SDK call on the training thread.

What only ``tracing.enabled: true`` (the SDK) does: export spans over OTLP, follow a call into a
Ray actor or another rank (``trace_carrier()``), a failed timer's status, stall events on the
step's span.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from otel_rl.core.records import OWN_SCOPE
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.span_transfer import PlainSpan
from otel_rl.telemetry.timing import PROCESS_CLOCK, SPAN_RECORDS, ClosedTimer, PhaseClock
from otel_rl.telemetry.tracing import STEP_ATTRIBUTE, STEP_SPAN

#: Epochs whose trace is remembered, for a timer that encloses many steps.
KEEP_TRACES = 10_000
#: Steps sealed that wake the trace file's thread before its next round.
WAKE_AT = 1_000
#: Closed uses or steps the trace file's thread goes through before it lets go of the GIL
#: (between two of its lines it does too).
YIELD_EVERY = 256
_MASK = (1 << 64) - 1


class ClockSpans:
    """A run's step spans from the phase clock (``take``/``seal``/``close`` as ``StepSpans``).

    The training thread only marks where its steps end: ``take`` ends the clock's epoch, and
    ``seal`` queues the step's number, its epochs and its bounds. The trace file's thread
    (:meth:`spans`, a source of the file) takes the clock's closed uses, gives each to the step
    whose epochs hold the one it closed in, and makes that step's spans.
    """

    #: Timers of such a run are not SDK spans.
    tracer = None

    def __init__(self, trace_file: Any, resource: Mapping[str, Any],
                 clock: PhaseClock = PROCESS_CLOCK) -> None:  # fmt: skip
        self._file = trace_file
        self._clock = clock
        self._closed = clock.record_spans()
        self._resource = dict(resource)
        self._salt = random.getrandbits(64)
        self._wall_ns = time.time_ns() - time.monotonic_ns()  # monotonic → Unix time
        self._epochs: list[int] = []  # ended by the pending step's calls
        self._start_ns = self._last_ns = time.time_ns()
        self._sealer = (threading.get_ident(), threading.current_thread().name)
        self._recorded = clock.recorded  # the clock's count of closed uses at the last take
        self._timed = False  # a timer closed in the pending step's epochs
        #: Steps sealed, for the trace file's thread: (step, epochs, start, end, sealer).
        self._sealed: deque[tuple[int, list[int], int, int, tuple[int, str]]] = deque(
            maxlen=SPAN_RECORDS
        )
        # Only the trace file's thread (one writer at a time) uses what follows.
        #: ``{epoch: (trace id, step span id)}`` of the steps with spans (the newest ones).
        self._traces: dict[int, tuple[int, int]] = {}
        #: Closed uses whose epoch's step is not sealed yet, by that epoch.
        self._waiting: dict[int, list[ClosedTimer]] = {}
        #: The last epoch of the steps written: a use taken later that closed in it or before
        #: joins its step's trace (taken while the training thread filled the deque faster).
        self._written_through = -1
        #: One attributes object per thread (encoded once per line of the file).
        self._thread_attributes: dict[int, dict[str, Any]] = {}
        self._overflowed = False  # the clock's records, said once
        self._steps_overflowed = False  # the steps queued, said once
        trace_file.add_source(self.spans)

    def take(self, step: int) -> None:
        """A ``log_metrics`` call at ``step``: the timers closed since belong to it."""
        clock = self._clock
        self._epochs.append(clock.next_epoch())
        self._last_ns = time.time_ns()
        if clock.recorded != self._recorded:  # a timer closed in the epoch just ended
            self._recorded, self._timed = clock.recorded, True

    def seal(self, step: int, final: bool = False) -> None:
        """The step's row is sealed: its spans are the trace file's thread's to make
        (``final``: a seal by ``flush``/``finish``, which takes what closed since too). The row
        does not name the trace (the SDK's step spans do, as ``trace_id``): by default rows stay
        as logged."""
        if final:
            self.take(step)
        epochs = self._epochs
        if not epochs:
            return
        self._epochs = []
        start, end, self._start_ns = self._start_ns, self._last_ns, self._last_ns
        if not self._timed:
            return  # no timer closed during the step: no spans (a loop without timers has none)
        self._timed = False
        ident = threading.get_ident()
        sealer = self._sealer
        if sealer[0] != ident:
            sealer = self._sealer = (ident, threading.current_thread().name)
        sealed = self._sealed
        if len(sealed) == sealed.maxlen and not self._steps_overflowed:
            self._steps_overflowed = True
            _log.warning("otel-rl: %d steps waited for the trace file's thread: the oldest have "
                         "no spans", len(sealed))
        sealed.append((step, epochs, start, end, sealer))
        if len(sealed) == WAKE_AT:  # once: the thread takes every step queued at its round
            self._file.wake()

    def close(self) -> None:
        """The run is over: the clock keeps no more records for it."""
        self._clock.stop_spans(self._closed)

    def spans(self) -> Iterator[PlainSpan]:
        """The spans of the steps sealed since the last call, step by step (the trace file's
        thread, which writes them as they come). A step whose timers did not run has none."""
        closed, waiting = self._closed, self._waiting
        recorded = self._clock.recorded  # read before the deque's length: see pushed_out
        count = len(closed)
        for index in range(count):
            record = closed.popleft()
            held = waiting.get(record[8])
            if held is None:
                waiting[record[8]] = [record]
            else:
                held.append(record)
            if index % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)  # the GIL to the training thread now and then
        closed.taken += count
        lost = closed.pushed_out(recorded)
        if lost > 0 and not self._overflowed:
            self._overflowed = True
            _log.warning("otel-rl: timers were used %d times or more before the trace file's "
                         "thread took them: only the newest have spans", SPAN_RECORDS)
        sealed = self._sealed
        last = None
        for index in range(len(sealed)):
            if index % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)  # a round of many steps without timers holds the GIL no longer
            step, epochs, start, end, sealer = sealed.popleft()
            last = epochs[-1]
            taken = [record for epoch in epochs for record in waiting.pop(epoch, ())]
            if taken:  # nothing timed: no spans (a loop without timers has no trace file)
                yield from self._step_spans(step, epochs, start, end, taken, sealer)
        if last is None:
            last = self._written_through
            if last < 0:
                return
        self._written_through = last
        for epoch in [e for e in waiting if e <= last]:
            late = waiting.pop(epoch)
            ids = self._traces.get(epoch)
            if ids is not None:  # closed as its step was sealed, taken after: in its trace still
                yield from self._timer_spans(late, ids)
            # else it closed in an epoch of no step of this run's (another Logger's): not ours

    def _id(self, seq: int) -> int:
        return ((seq * 0x9E3779B97F4A7C15) ^ self._salt) & _MASK or 1

    def _step_spans(
        self, step: int, epochs: list[int], start: int, end: int, taken: list[ClosedTimer],
        sealer: tuple[int, str],
    ) -> list[PlainSpan]:
        """The step's spans; the step's own on the thread that logged it, as the SDK's. A
        timer enclosing others keeps the trace of the step in which it opened."""
        ids = (random.getrandbits(128) or 1, random.getrandbits(64) or 1)
        traces = self._traces
        for epoch in epochs:
            traces[epoch] = ids
        while len(traces) > KEEP_TRACES:
            del traces[next(iter(traces))]
        spans: list[PlainSpan] = [(
            STEP_SPAN, ids[0], ids[1], 0, start, end,
            {STEP_ATTRIBUTE: step, "thread.id": sealer[0], "thread.name": sealer[1]},
            self._resource, OWN_SCOPE,
        )]  # fmt: skip
        return spans + self._timer_spans(taken, ids)

    def _timer_spans(self, taken: list[ClosedTimer], ids: tuple[int, int]) -> list[PlainSpan]:
        """The spans of closed uses; ``ids``: the trace and step span of the step they closed
        in, for those whose outermost timer opened in no step known."""
        resource, wall, traces = self._resource, self._wall_ns, self._traces
        spans: list[PlainSpan] = []
        by_thread = self._thread_attributes
        for name, opened, closed, thread, thread_name, seq, parent, epoch, _ in taken:
            trace_id, step_span = traces.get(epoch, ids)
            attributes = by_thread.get(thread)
            if attributes is None or attributes["thread.name"] != thread_name:
                attributes = by_thread[thread] = {"thread.id": thread, "thread.name": thread_name}
                while len(by_thread) > KEEP_TRACES:
                    del by_thread[next(iter(by_thread))]
            spans.append((
                name, trace_id, self._id(seq), self._id(parent) if parent else step_span,
                wall + round(opened * 1e9), wall + round(closed * 1e9), attributes, resource,
                OWN_SCOPE,
            ))  # fmt: skip
        return spans
