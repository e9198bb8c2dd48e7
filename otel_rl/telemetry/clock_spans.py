"""The spans of a run's timers on disk, made from the phase clock's records, with no tracing SDK.

With ``tracing.enabled`` unset (the default), a timer's use costs the caller's thread what it
costs anyway: the phase clock appends each closed use to a deque (``telemetry/timing.py``). At
each ``log_metrics`` call the run takes them (:meth:`ClockSpans.take`); when the step is sealed
they are handed, with the step's number and trace id, to the trace file's thread, which makes
them the step's spans in OTLP JSON (``traces.jsonl``): one trace per step, its ``rl.step`` span
from the end of the previous step's last call to its own, each timer's span a child of the timer
it ran in (or of the step's span), its duration the timer's value. A timer enclosing others
keeps their trace: the trace of the step in which it opened. The same rules as the SDK's step
spans (``telemetry/tracing.StepSpans``), without an SDK call on the training thread.

What only ``tracing.enabled: true`` (the SDK) does: export spans over OTLP, follow a call into a
Ray actor or another rank (``trace_carrier()``), a failed timer's status, stall events on the
step's span.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from otel_rl.core.records import OWN_SCOPE
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.span_transfer import PlainSpan
from otel_rl.telemetry.timing import PROCESS_CLOCK, ClosedTimer, PhaseClock
from otel_rl.telemetry.tracing import STEP_ATTRIBUTE, STEP_SPAN

#: Epochs whose trace is remembered, for a timer that encloses many steps.
KEEP_TRACES = 10_000
_MASK = (1 << 64) - 1


class ClockSpans:
    """A run's step spans from the phase clock (``take``/``seal``/``close`` as ``StepSpans``)."""

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
        #: ``{epoch: (trace id, step span id)}`` of the steps sealed (the newest ones).
        self._traces: dict[int, tuple[int, int]] = {}
        self._epochs: list[int] = []  # taken for the pending step
        self._taken: list[ClosedTimer] = []
        self._start_ns = self._last_ns = time.time_ns()
        self._overflowed = False

    def take(self, step: int) -> None:
        """A ``log_metrics`` call at ``step``: the timers closed since belong to it."""
        self._epochs.append(self._clock.next_epoch())
        closed = self._closed
        if len(closed) == closed.maxlen and not self._overflowed:
            self._overflowed = True
            _log.warning("otel-rl: timers were used %d times or more between two log_metrics "
                         "calls: only the newest of such a stretch have spans", len(closed))
        self._taken += [closed.popleft() for _ in range(len(closed))]
        self._last_ns = time.time_ns()

    def seal(self, step: int, final: bool = False) -> None:
        """The step's row is sealed: its spans go to the trace file's thread (``final``: a seal
        by ``flush``/``finish``, which takes what closed since too). The row does not name the
        trace (the SDK's step spans do, as ``trace_id``): by default rows stay as logged."""
        if final:
            self.take(step)
        if not self._epochs:
            return
        if not self._taken:  # nothing timed: no spans (a loop without timers has no trace file)
            self._epochs.clear()
            self._start_ns = self._last_ns
            return
        ids = (random.getrandbits(128) or 1, random.getrandbits(64) or 1)
        traces = self._traces
        for epoch in self._epochs:
            traces[epoch] = ids
        while len(traces) > KEEP_TRACES:
            del traces[next(iter(traces))]
        start, end, self._start_ns = self._start_ns, self._last_ns, self._last_ns
        taken, self._taken, self._epochs = self._taken, [], []
        sealer = (threading.get_ident(), threading.current_thread().name)
        self._file.carry(functools.partial(self._spans, step, ids, start, end, taken, sealer))

    def close(self) -> None:
        """The run is over: the clock keeps no more records for it."""
        self._clock.stop_spans()

    def _id(self, seq: int) -> int:
        return ((seq * 0x9E3779B97F4A7C15) ^ self._salt) & _MASK or 1

    def _spans(self, step: int, ids: tuple[int, int], start: int, end: int,
               taken: list[ClosedTimer], sealer: tuple[int, str]) -> list[PlainSpan]:  # fmt: skip
        """The step's spans (on the trace file's thread); the step's own on the thread that
        logged it, as the SDK's."""
        resource, wall, traces = self._resource, self._wall_ns, self._traces
        spans: list[PlainSpan] = [(
            STEP_SPAN, ids[0], ids[1], 0, start, end,
            {STEP_ATTRIBUTE: step, "thread.id": sealer[0], "thread.name": sealer[1]},
            resource, OWN_SCOPE,
        )]  # fmt: skip
        for name, opened, closed, thread, thread_name, seq, parent, epoch in taken:
            trace_id, step_span = traces.get(epoch, ids)
            attributes = {"thread.id": thread, "thread.name": thread_name}
            spans.append((
                name, trace_id, self._id(seq), self._id(parent) if parent else step_span,
                wall + round(opened * 1e9), wall + round(closed * 1e9), attributes, resource,
                OWN_SCOPE,
            ))  # fmt: skip
        return spans
