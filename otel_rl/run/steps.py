"""The step being logged: values merge into it until it is sealed and handed to the trackers.

A Logger feeds :class:`StepAssembler` from the training thread; the pending-step checkpointer
reads :meth:`StepAssembler.snapshot` from its own thread. Everything here runs under one lock and
costs dict updates only: sealing builds a :class:`~otel_rl.core.records.StepBatch` and queues it.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from otel_rl.core.errors import MetricError
from otel_rl.core.records import Record, Resume, StepBatch
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.tracing import TRACE_ID_KEY

_T = TypeVar("_T")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StepAssembler:
    """One training step at a time: merge, seal, snapshot.

    Step semantics (docs/configuration.md#steps): values logged with the same step merge into one
    row; the row is sealed when another step is logged, on ``step_finished``, or by
    ``flush``/``finish`` (``final``). What OTel instruments (``take_otel``) and the run's timers
    (``take_timings``) recorded since the previous call belongs to the step of the call that
    takes it.

    ``stats`` is the Logger's public ``stats`` dict: ``steps`` (rows sealed) and
    ``backwards_steps`` are counted in it. ``on_seal`` callables get each sealed step number (the
    rollout monitor marks its step there); they run on the training thread under the step lock,
    so they only hand the step on (append to a queue, wake a thread), never wait.

    The lock is the assembler's own: every method takes it (it is reentrant, so hooks may call
    back), and :meth:`exclusively` runs a caller's function under it.
    """

    def __init__(
        self,
        *,
        send: Callable[[Record], Any],
        take_otel: Callable[[], Sequence[Any]],
        take_timings: Callable[[], list[tuple[str, float]]],
        report: Callable[[object, str], None],
        stats: dict[str, Any],
        step_spans: Any = None,
    ) -> None:
        self._lock = threading.RLock()
        self.on_seal: list[Callable[[int], None]] = []
        #: Called with a call's resolved step and values before they join the pending step
        #: (claiming new keys, stamping the stall watch); raising refuses the whole call.
        self.admit: Callable[[int, dict[str, Any]], None] | None = None
        #: Called with a call's values once they joined the pending step.
        self.after_add: list[Callable[[dict[str, Any]], None]] = []
        #: Rows derived from the step as it is sealed (its anatomy), given the step number; the
        #: application's own value of a key wins.
        self.before_seal: Callable[[int], Mapping[str, Any]] | None = None
        self.closed = False
        #: A relaunched run's attempt (``run/history.py``): announced to the trackers with the
        #: first step this launch logs, before its row (a step of timers alone, sealed by
        #: ``flush``, names no step of the caller's and supersedes nothing).
        self.resume_attempt: int | None = None
        self._send = send
        self._take_otel = take_otel
        self._take_timings = take_timings
        self._report = report
        self._stats = stats
        self._spans = step_spans
        self._values: dict[str, Any] = {}
        self._otel: list[Any] = []
        self._timings: list[tuple[str, float]] = []
        self._step: int | None = None
        self._step_metrics: dict[str, str] = {}
        self._last: int | None = None
        self._checkpointed: tuple[Any, ...] | None = None
        self._trace_key_taken = False

    @property
    def last_step(self) -> int | None:
        """The highest step sealed so far."""
        return self._last

    def log(
        self,
        step: object,
        values: dict[str, Any],
        prefix: str,
        step_metric: str | None,
        finished: bool,
        strict: bool,
    ) -> None:
        """One ``log_metrics`` call: resolve its step, admit its values (everything that can
        refuse the call runs before the pending step changes: a refused call leaves no trace,
        not even an empty row at its step), merge them, and seal when ``finished``.
        ``values`` is the call's own dict: the pending step may take it as its row."""
        with self._lock:
            resolved = self._resolve(step, strict)
            if self.admit is not None:
                self.admit(resolved, values)
            if self._step is not None and resolved != self._step:
                self._seal()
            self._step = resolved
            if self._values:
                self._values.update(values)
            else:  # the call's own dict (Intake's), nobody else's: taken, not copied
                self._values = values
            self._otel.extend(self._take_otel())
            self._timings += self._take_timings()
            if self._spans is not None:
                self._spans.take(resolved)
            if step_metric is not None:
                self._step_metrics[prefix] = step_metric
            for hook in self.after_add:
                hook(values)
            if finished:
                self._seal()

    def exclusively(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` while no step changes (for state the seal reads)."""
        with self._lock:
            return fn(*args)

    def _resolve(self, step: object, strict: bool) -> int:
        """The step a call logs at (``None``: the current one, else the one after the last);
        raises :class:`MetricError` for a step no tracker could store."""
        if step is None:
            if self._step is not None:
                return self._step
            step = 0 if self._last is None else self._last + 1  # (past int64 after its top)
        elif type(step) is not int:
            step = integral_step(step)
        if not INT64_MIN <= step <= INT64_MAX:
            # Every tracker stores steps as int64: such a step could never be written.
            raise MetricError(
                "<step>", f"step {step} is outside the signed 64-bit range trackers store; "
                "this call's values are dropped",
            )  # fmt: skip
        last, pending = self._last, self._step
        if pending is not None and (last is None or pending > last):
            last = pending
        if last is not None and step < last and step != pending:
            self._stats["backwards_steps"] += 1
            if self._stats["backwards_steps"] == 1 or strict:
                self._report(
                    "<step>",
                    f"step went backwards ({last} -> {step}); the rows are still sent (see "
                    "docs/backends/README.md for what each tracker does with them); further "
                    "backwards steps are only counted in logger.stats['backwards_steps']",
                )
        return step

    def seal(self, final: bool = False) -> None:
        """Hand the pending step to the trackers. ``final``: a seal by ``flush``/``finish``,
        which also takes what OTel instruments recorded since."""
        with self._lock:
            self._seal(final)

    def _seal(self, final: bool = False) -> None:
        if final:
            self._otel.extend(self._take_otel())
            self._timings += self._take_timings()
        step = self._step
        logged = step is not None  # a step the caller named, not one only timers recorded
        if step is None:
            if not self._otel and not self._timings:
                return
            step = 0 if self._last is None else self._last + 1
        if self._spans is not None:
            trace_id = self._spans.seal(step, final)
            if trace_id is not None:  # the row names the trace of its step
                if TRACE_ID_KEY not in self._values:
                    self._values[TRACE_ID_KEY] = trace_id
                elif not self._trace_key_taken:
                    # The caller's own value wins: their data is never overwritten.
                    self._trace_key_taken = True
                    _log.warning(
                        "otel-rl: the key %r is logged by the application, so rows keep that "
                        "value and do not name their step's trace (tracing.enabled)",
                        TRACE_ID_KEY,
                    )
        if self.before_seal is not None:
            for key, value in self.before_seal(step).items():
                self._values.setdefault(key, value)
        for hook in self.on_seal:
            hook(step)
        batch = StepBatch(
            step=step,
            values=self._values,
            otel=tuple(self._otel),
            step_metrics=dict(self._step_metrics),
            timings=self._timings,
            seal=self._stats["steps"],
        )
        self._values = {}
        self._otel = []
        self._timings = []
        self._step = None
        self._last = step if self._last is None else max(step, self._last)
        self._stats["steps"] += 1
        if self.resume_attempt is not None and logged:
            self._send(Resume(self.resume_attempt, step))
            self.resume_attempt = None
        self._send(batch)

    def close(self) -> bool:
        """Seal what is pending and refuse snapshots from now on; ``False`` if already closed."""
        with self._lock:
            if self.closed:
                return False
            self._seal(final=True)
            self.closed = True
            return True

    def abandon_after_fork(self) -> None:
        """In a fork child: a parent thread may have held the lock at the fork; the child's
        copy of the run takes nothing more."""
        self._lock, self.closed = threading.RLock(), True

    def snapshot(self) -> StepBatch | None:
        """The step still being logged, if it changed since the last snapshot, as a provisional
        batch for the spools (checkpoint thread; the lock is held for a dict copy)."""
        with self._lock:
            if self._step is None or self.closed:
                return None
            state = (self._step, len(self._otel) + len(self._timings), self._values)
            if self._checkpointed == state:
                return None
            values = dict(self._values)
            self._checkpointed = (state[0], state[1], values)
            return StepBatch(
                step=self._step,
                values=values,
                otel=tuple(self._otel),
                step_metrics=dict(self._step_metrics),
                timings=tuple(self._timings),
                seal=self._stats["steps"],
                provisional=True,
            )


def checked_step(step: Any) -> int:
    """``step`` as an int inside int64, or :class:`MetricError` (for plots and tables)."""
    checked = step if type(step) is int else integral_step(step)
    if not INT64_MIN <= checked <= INT64_MAX:
        raise MetricError("<step>", f"step {checked} is outside int64")
    return checked


def integral_step(step: Any) -> int:
    """``step`` as an int: ints and integer types (numpy, 0-d integer tensors) as they are, a
    float only when it is a whole number (``3.0``); bool, text and ``8.9`` are refused."""
    if isinstance(step, bool) or type(step).__name__ in ("bool_", "bool"):
        raise MetricError("<step>", f"step must be an integer, got the boolean {step!r}")
    if isinstance(step, (str, bytes)):
        raise MetricError(
            "<step>", f"step must be an integer or None, got {type(step).__name__} {step!r:.40}"
        )
    try:
        return operator.index(step)  # numpy integers, integer tensors
    except TypeError:
        pass
    try:
        number = float(step)
    except (TypeError, ValueError, OverflowError):
        raise MetricError(
            "<step>", f"step must be an integer or None, got {type(step).__name__}"
        ) from None
    if not number.is_integer():
        raise MetricError(
            "<step>", f"step must be a whole number, got {number!r} "
            "(steps are never rounded: pass int(step) if that is what you mean)",
        )  # fmt: skip
    return int(number)
