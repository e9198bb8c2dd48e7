"""``Timer``, ``ThreadSafeTimer`` and ``TimeoutChecker`` with the methods and reductions of
``nemo_rl.utils.timer``.

A Timer keeps every measured duration (seconds) per label; ``get_timing_metrics("sum")`` gives
the ``{label: seconds}`` dict a training loop logs with ``prefix="timing/train"`` — which is how
``timing/train/total_step_time`` gets its name. Pure Python (no numpy): ``std`` is the population
standard deviation, as ``numpy.std`` computes it.

The DEBUG lines of every start/stop/record/mark go to the ``nemo_rl.utils.timer`` logger, the
name NeMo RL's timer logs under, so logging configured for NeMo RL applies unchanged; when that
logger is not enabled for DEBUG, they go to this module's own logger (``otel_rl.compat.nemo_timer``,
as NeMo RL's timer logs under its module's name), so either name can switch them on.

With a live Logger whose ``tracing.enabled`` is on (the drop-in ``otel_rl.compat.nemo_rl.Logger``
or ``otel_rl.Logger``), each ``start``/``stop`` interval — a ``with timer.time(label)`` block
included — is also an OTel span named by its label, lasting exactly the recorded duration,
nested as the code nests it, under the step's ``rl.step`` span (docs/tracing.md). ``record``
adds a duration measured elsewhere: no span. With tracing off the only cost is one look-up of
two module globals per ``start``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from otel_rl.telemetry.timing import TimerSpan, ambient_tracer, timer_closed, timer_opened

#: NeMo RL's logger name for its timer, kept so that existing logging configuration applies.
LOGGER_NAME = "nemo_rl.utils.timer"
_log = logging.getLogger(LOGGER_NAME)
#: This module's own logger (NeMo RL's timer module has its ``logger`` too): the DEBUG lines'
#: destination when NeMo RL's name is not enabled.
logger = logging.getLogger(__name__)

#: A marked point in time (Unix seconds) and its metadata.
Marker = tuple[float, dict[str, Any] | None]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    return statistics.pstdev(values)


#: Reduction name → function over the recorded durations.
REDUCTIONS: dict[str, Callable[[Sequence[float]], float | int]] = {
    "mean": _mean,
    "median": lambda v: float(statistics.median(v)),
    "min": lambda v: float(min(v)),
    "max": lambda v: float(max(v)),
    "std": _std,
    "sum": lambda v: math.fsum(v),
    "count": len,
}


class NemoRLTimer:
    """Durations per label: ``start``/``stop``, ``with timer.time(label)``, or ``record``.

    ``context`` (e.g. ``{"rank": 3}``) prefixes the DEBUG line written at each event.
    """

    _REDUCTION_FUNCTIONS = REDUCTIONS

    def __init__(self, context: dict[str, object] | None = None) -> None:
        self._timers: dict[str, list[float]] = {}
        self._start_times: dict[str, float] = {}
        self._markers: dict[str, list[Marker]] = {}
        # the span of each running label, when tracing is on
        self._spans: dict[str, TimerSpan] = {}
        self._context: dict[str, object] = dict(context or {})
        if "hostname" not in self._context:
            import socket

            self._context["hostname"] = socket.gethostname()

    def __getstate__(self) -> dict[str, Any]:
        # a running label's span belongs to this process: a copy keeps the start time only
        state = self.__dict__.copy()
        state["_spans"] = {}
        return state

    # ---- measuring ----------------------------------------------------------------------------

    def start(self, label: str, should_log: bool = True) -> None:
        """Start timing ``label``; a label that is already running is an error."""
        if label in self._start_times:
            raise ValueError(f"Timer '{label}' is already running")
        tracer = ambient_tracer()
        if tracer is not None:
            self._spans[label] = TimerSpan(tracer, label)
        timer_opened(label, self)
        from otel_rl.watch.job_state import publish_from_a_worker  # at first use: ~35 ms

        publish_from_a_worker()  # a worker's timer: its process says where it is
        self._start_times[label] = time.perf_counter()
        if should_log:
            self._debug(label, "start")

    def stop(self, label: str, should_log: bool = True) -> float:
        """Stop timing ``label``; returns and records the elapsed seconds."""
        started = self._start_times.pop(label, None)
        if started is None:
            # NeMo RL's message, word for word.
            raise ValueError(
                f"Timer '{label}' is not running. Running times: {self._start_times.keys()}"
            )
        elapsed = time.perf_counter() - started
        timer_closed(label)
        self._timers.setdefault(label, []).append(elapsed)
        if self._spans:
            span = self._spans.pop(label, None)
            if span is not None:
                span.close(elapsed)
        if should_log:
            self._debug(label, f"end elapsed={elapsed:.4f}s")
        return elapsed

    def record(self, label: str, elapsed: float, should_log: bool = True) -> None:
        """Add a duration measured elsewhere."""
        self._timers.setdefault(label, []).append(float(elapsed))
        if should_log:
            self._debug(label, f"record elapsed={float(elapsed):.4f}s")

    @contextlib.contextmanager
    def time(self, label: str, should_log: bool = True) -> Iterator[None]:
        """Time the ``with`` block under ``label`` (recorded even when the block raises; its
        span, if any, then records the exception)."""
        self.start(label, should_log)
        try:
            yield
        except BaseException as exc:
            span = self._spans.get(label)
            if span is not None:
                span.fail(exc)
            raise
        finally:
            self.stop(label, should_log)

    def drain(self, label: str) -> float:
        """The sum of ``label``'s durations, removing them (0.0 if it never ran)."""
        values = self._timers.pop(label, None)
        return math.fsum(values) if values else 0.0

    def mark(self, label: str, metadata: dict[str, Any] | None = None) -> float:
        """Record a point in time (Unix seconds, comparable across processes); returns it."""
        now = time.time()
        self._markers.setdefault(label, []).append((now, metadata))
        self._debug(label, f"mark meta={metadata}" if metadata else "mark")
        return now

    # ---- reading ------------------------------------------------------------------------------

    def get_markers(self, label: str | None = None) -> dict[str, list[Marker]]:
        if label is not None:
            return {label: list(self._markers.get(label, []))}
        return {k: list(v) for k, v in self._markers.items()}

    def get_elapsed(self, label: str) -> list[float]:
        """Every duration recorded for ``label`` (KeyError if none)."""
        if label not in self._timers:
            raise KeyError(f"No timings recorded for '{label}'")
        return self._timers[label]

    def get_latest_elapsed(self, label: str) -> float:
        values = self.get_elapsed(label)
        if not values:
            raise IndexError(f"No measurements recorded for '{label}'")
        return values[-1]

    def reduce(self, label: str, operation: str = "mean") -> float:
        """``operation`` (mean, median, min, max, std, sum, count) over ``label``'s durations."""
        reduction = self._REDUCTION_FUNCTIONS.get(operation)
        if reduction is None:
            valid = ", ".join(self._REDUCTION_FUNCTIONS)
            raise ValueError(f"Invalid operation '{operation}'. Valid options are: {valid}")
        return reduction(self.get_elapsed(label))

    def get_timing_metrics(
        self, reduction_op: str | dict[str, str] = "mean"
    ) -> dict[str, float | list[float]]:
        """``{label: value}``: one reduction for all labels (a str), or per label (a dict).

        Labels a dict does not name, or names with an unknown reduction, keep their list of
        durations (otel-rl logs a list as ``/count, /mean, /std, /min, /max, /p50, /p90``).
        """
        if isinstance(reduction_op, str):
            ops = dict.fromkeys(self._timers, reduction_op)
        else:
            ops = dict(reduction_op)
        results: dict[str, float | list[float]] = {}
        for label, values in self._timers.items():
            op = ops.get(label)
            if op in self._REDUCTION_FUNCTIONS:
                results[label] = self._REDUCTION_FUNCTIONS[op](values)
            else:
                results[label] = list(values)
        return results

    def reset(self, label: str | None = None) -> None:
        """Forget ``label`` (durations, running start, markers), or everything."""
        running = [label] if label and label in self._start_times else []
        if not label:
            running = list(self._start_times)
        for name in running:  # a running label forgotten is no longer an open timer
            timer_closed(name)
        if label:
            self._timers.pop(label, None)
            self._start_times.pop(label, None)
            self._markers.pop(label, None)
            dropped = [self._spans.pop(label)] if label in self._spans else []
        else:
            self._timers, self._start_times, self._markers = {}, {}, {}
            dropped, self._spans = list(self._spans.values()), {}
        # A running label forgotten has no duration: its span is dropped unexported, and the
        # context it made current is restored.
        for span in reversed(dropped):
            span.release()

    def _debug(self, label: str, event: str) -> None:
        if _log.isEnabledFor(logging.DEBUG):
            target = _log
        elif logger.isEnabledFor(logging.DEBUG):
            target = logger
        else:
            return  # building the timestamp costs more than the measurement
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        context = " ".join(f"{k}={v}" for k, v in self._context.items())
        target.debug("[%s] %s %s ts=%s", context, label, event, stamp)


#: NeMo RL's name for it (``nemo_rl.utils.timer.Timer``).
Timer = NemoRLTimer


class ThreadSafeTimer(Timer):
    """A :class:`Timer` whose every operation holds one lock (the timed block itself does not)."""

    def __init__(self, context: dict[str, object] | None = None) -> None:
        super().__init__(context)
        self._lock = threading.RLock()

    def start(self, label: str, should_log: bool = True) -> None:
        with self._lock:
            super().start(label, should_log)

    def stop(self, label: str, should_log: bool = True) -> float:
        with self._lock:
            return super().stop(label, should_log)

    def record(self, label: str, elapsed: float, should_log: bool = True) -> None:
        with self._lock:
            super().record(label, elapsed, should_log)

    def drain(self, label: str) -> float:
        with self._lock:
            return super().drain(label)

    def mark(self, label: str, metadata: dict[str, Any] | None = None) -> float:
        with self._lock:
            return super().mark(label, metadata)

    def get_markers(self, label: str | None = None) -> dict[str, list[Marker]]:
        with self._lock:
            return super().get_markers(label)

    def get_elapsed(self, label: str) -> list[float]:
        with self._lock:
            return list(super().get_elapsed(label))

    def get_latest_elapsed(self, label: str) -> float:
        with self._lock:
            return super().get_latest_elapsed(label)

    def reduce(self, label: str, operation: str = "mean") -> float:
        with self._lock:
            return super().reduce(label, operation)

    def get_timing_metrics(
        self, reduction_op: str | dict[str, str] = "mean"
    ) -> dict[str, float | list[float]]:
        with self._lock:
            return super().get_timing_metrics(reduction_op)

    def reset(self, label: str | None = None) -> None:
        with self._lock:
            super().reset(label)


def convert_to_seconds(time_string: str) -> int:
    """``"DD:HH:MM:SS"`` → seconds."""
    days, hours, minutes, seconds = (int(part) for part in time_string.split(":"))
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class TimeoutChecker:
    """NeMo RL's checkpoint deadline: ``check_save()`` is true once, when the job's time is up.

    ``timeout`` is ``"DD:HH:MM:SS"`` counted from construction (``None``: never). With
    ``fit_last_save_time``, the deadline is brought forward by the mean iteration time measured
    by ``start_iterations()``/``mark_iteration()``, so that the last checkpoint starts while one
    more iteration still fits. ``clock`` (default ``time.time``) is the time source.
    """

    def __init__(
        self,
        timeout: str | None = "00:03:45:00",
        fit_last_save_time: bool = False,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.last_save_time: float = math.inf if timeout is None else convert_to_seconds(timeout)
        self.start_time: float = clock()
        self.last_saved = False
        self.iteration_times: list[float] = []
        self.previous_iteration_time: float | None = None
        self.fit_last_save_time = fit_last_save_time

    def check_save(self) -> bool:
        """True the first time the deadline is reached (or would be, one mean iteration
        later, with ``fit_last_save_time``); False before it and at every later call."""
        # NeMo RL flushes here so that a job killed right after the checkpoint keeps its output.
        sys.stdout.flush()
        sys.stderr.flush()
        if self.last_saved:
            return False
        elapsed = self._clock() - self.start_time
        margin = 0.0
        if self.fit_last_save_time and self.iteration_times:
            margin = math.fsum(self.iteration_times) / len(self.iteration_times)
        if elapsed + margin >= self.last_save_time:
            self.last_saved = True
            return True
        return False

    def start_iterations(self) -> None:
        """Start the clock of the first iteration."""
        self.previous_iteration_time = self._clock()

    def mark_iteration(self) -> None:
        """End one iteration: record its duration and start the next one's clock."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.previous_iteration_time is None:
            raise RuntimeError(
                "TimeoutChecker.mark_iteration() called before start_iterations(): "
                "there is no iteration start to measure from"
            )
        now = self._clock()
        self.iteration_times.append(now - self.previous_iteration_time)
        self.previous_iteration_time = now
