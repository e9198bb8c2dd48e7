"""One run: its parts started together, and its end within one deadline.

A :class:`Run` owns what a Logger starts — the trackers, the OTel pipeline, the tracer, the
pending step and the sources that feed it — and how it ends: ``flush``, ``finish`` with one
:class:`~otel_rl.process.deadline.Deadline` passed down to every part, the signal handlers and
``atexit`` hook (:mod:`otel_rl.process.lifecycle` calls :meth:`Run.finish`), and a fork child's
:meth:`Run.abandon_after_fork`.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_rl.core.keys import KeyRegistry
from otel_rl.core.records import OWN_SCOPE
from otel_rl.core.redaction import Patterns
from otel_rl.delivery.fanout import Fanout
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.tracker import Tracker
from otel_rl.process import lifecycle
from otel_rl.process.deadline import (
    SHUTDOWN_GRACE,
    Deadline,
    start_stopping,
    still_stopping,
    stop_in_parallel,
)
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.process.lifecycle import exit_code_hint, weak_atexit
from otel_rl.run.sources import RunSources
from otel_rl.run.steps import StepAssembler
from otel_rl.run.trackers import RunTrackers
from otel_rl.telemetry.clock_spans import ClockSpans
from otel_rl.telemetry.pipeline import Pipeline, build_resource
from otel_rl.telemetry.routing import global_router
from otel_rl.telemetry.self_telemetry import install_self_telemetry
from otel_rl.telemetry.timing import TimerFactory, TimingInstruments
from otel_rl.telemetry.trace_file import MB, TraceFile
from otel_rl.telemetry.tracing import StepSpans, build_tracer_provider

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings


class Run:
    """The parts of one run (``cfg`` resolved, ``run_id`` chosen) and their lifecycle.

    ``exporters`` are the trackers' deliveries in order, ``pipeline`` the OTel side,
    ``steps`` the pending step, ``keys`` the run's keys and instrument names, ``stats`` the
    Logger's public counters, ``sources`` the monitors and the stall watch.
    """

    def __init__(
        self,
        cfg: LoggerSettings,
        exporters: Sequence[Tracker],
        *,
        run_id: str,
        redaction: Patterns,
        report: Callable[[object, str], None],
    ) -> None:
        export = cfg.export
        self.run_id = run_id
        #: Weak references to the objects the run is used through (the Logger): in a fork
        #: child, their verbs are disabled with the run's (``otel_rl.process.lifecycle``).
        self.facades: list[weakref.ref[Any]] = []
        self.shutdown_timeout = export.shutdown_timeout
        options = ExportOptions.from_section(export)
        self.trackers = RunTrackers(cfg, exporters, run_id=run_id, redaction=redaction,
                                    options=options)  # fmt: skip
        self.exporters = self.trackers.exporters
        # What can refuse the run (a port in use, the OTLP environment) comes before any
        # tracker thread starts: a Logger() that raises leaves nothing running.
        self.pipeline = Pipeline(cfg, build_resource(cfg, run_id))
        try:
            self.trackers.start()
        except BaseException:
            self.pipeline.shutdown(timeout=1.0)
            raise
        self.fanout = Fanout(self.exporters)
        otlp = cfg.otlp if cfg.otlp.enabled else None
        tracing = cfg.tracing
        sdk = tracing.enabled is True
        #: ``<log_dir>/traces.jsonl`` (``tracing.file``); ``None`` when spans stay off disk.
        self.trace_file = (
            TraceFile(cfg.log_dir, tracing.file_max_mb * MB)
            if tracing.enabled is not False and tracing.file
            else None
        )
        #: Timers as OTel SDK spans (``tracing.enabled: true``), else ``None``.
        self.tracer_provider = build_tracer_provider(
            sdk, otlp, self.pipeline.resource, trace_file=self.trace_file
        )
        # One ``rl.step`` span per training step, parent of the step's timers (docs/tracing.md):
        # SDK spans, or (``tracing.enabled`` unset) spans made from the phase clock off the
        # training thread.
        self.step_spans = (
            StepSpans(self.tracer_provider, run_id=run_id) if self.tracer_provider else None
        )
        self.clock_spans = (
            ClockSpans(self.trace_file, self.pipeline.resource.attributes)
            if not sdk and self.trace_file is not None
            else None
        )
        self._router = global_router() if cfg.capture_global_meters else None
        if self._router is not None:
            self._router.route_to(self.pipeline.provider)
        self.keys = KeyRegistry()
        #: The run's timers (``Logger.timer``): their rows, and their histograms for the
        #: operator outputs, are derived from what they keep (telemetry/timing.py).
        self.timers = TimerFactory(
            self.keys,
            self.step_spans.tracer if self.step_spans else None,
            instruments=(
                TimingInstruments(self.pipeline.side_provider.get_meter(OWN_SCOPE))
                if self.pipeline.has_side_readers
                else None
            ),
        )
        #: ``steps`` sealed, ``backwards_steps``, ``nonfinite`` values logged.
        self.stats: dict[str, int] = {"nonfinite": 0, "backwards_steps": 0, "steps": 0}
        self.steps = StepAssembler(
            send=self.fanout.send,
            take_otel=self.pipeline.take_step_data,
            take_timings=self.timers.take,
            report=report,
            stats=self.stats,
            step_spans=self.step_spans or self.clock_spans,
        )
        if self.pipeline.has_side_readers:
            install_self_telemetry(
                self.pipeline.side_provider.get_meter(OWN_SCOPE), self.exporters, self.stats,
                lambda: self.steps.last_step,
            )  # fmt: skip
        self.sources = RunSources(
            cfg, run_id=run_id, pipeline=self.pipeline, fanout=self.fanout, steps=self.steps,
            step_spans=self.step_spans,
            flush_spans=self._flush_spans if self.trace_file is not None else None,
            flush_trackers=self._flush_trackers,
        )  # fmt: skip
        self._ending: int | None = None  # the thread ending the run
        self._finishing = threading.Lock()
        self._ended = threading.Event()
        # Signals raise only at safe points, sys.exit codes reach atexit, fork children abandon
        # the run. Registered before our atexit drain, whose hooks then run after it.
        lifecycle.register(self, handle_signals=export.handle_signals)
        self._atexit = weak_atexit(self, lambda run: run.finish(exit_code_hint()))

    def flush(self, timeout: float | None = None) -> bool:
        """Seal the pending step and wait (up to ``timeout`` s, default
        ``export.shutdown_timeout``) until every source and tracker has written everything."""
        self.steps.seal(final=True)
        deadline = Deadline(self.shutdown_timeout if timeout is None else timeout)
        ok = self.sources.flush(deadline)
        if self.clock_spans is not None:  # the spans of the steps sealed so far, on disk too
            self._flush_spans()
        return self._flush_trackers(deadline.left()) and ok

    def _flush_trackers(self, seconds: float) -> bool:
        deadline = Deadline(seconds)
        ok = True
        for exporter in self.exporters:
            ok = exporter.force_flush(timeout_millis=deadline.left() * 1000) and ok
        return ok

    def finish(self, exit_code: int | None = None) -> None:
        """End the run (see ``Logger.finish``); the first call ends it, a later one from another
        thread waits for that end."""
        code = lifecycle.exit_code_now() if exit_code is None else int(exit_code)
        with self._finishing:  # who ends the run is known before a second caller looks
            first = self.steps.close()
            if first:
                self._ending = threading.get_ident()
        if not first:
            # Another thread is ending the run (a daemon thread, then atexit): returning now
            # would let the process exit in the middle of its drain.
            if self._ending not in (None, threading.get_ident()):
                # Its longest end: a killed delivery process's count gets one grace more.
                self._ended.wait(self.shutdown_timeout + 2 * SHUTDOWN_GRACE)
            return
        try:
            self._end(code)
        finally:
            self._ended.set()
            # Only now: a finish() on a daemon thread keeps the exit's finish, which waits for
            # it, so that the interpreter never exits (killing that thread) in the drain.
            atexit.unregister(self._atexit)

    def _end(self, code: int) -> None:
        deadline = Deadline(self.shutdown_timeout)
        # The sources' last rows must reach the trackers before these close, so the sources
        # stop first, within half the time: a hung endpoint leaves the trackers the rest.
        sources_by = deadline.share(0.5)
        late = stop_in_parallel(self.sources.stopping(sources_by), sources_by.at)
        if self._router is not None:
            self._router.unroute(self.pipeline.provider)
        trackers = start_stopping(self.trackers.stopping(deadline, code))
        otel = start_stopping([
            # Never a zero timeout, which the SDK reports as an error: the thread is left behind
            # at the deadline all the same.
            ("OTel pipeline", lambda: self.pipeline.shutdown(max(deadline.left(), 0.1))),
            ("tracing", self._close_tracing),
        ])  # fmt: skip
        # The grace second lets a tracker that gave up at the deadline close its client.
        late += still_stopping(otel, deadline.at)
        late += self.trackers.still_stopping(trackers, deadline)
        if late:
            _log.warning(
                "otel-rl: the run ended at its deadline (export.shutdown_timeout: %g s) without "
                "waiting for: %s. What they had not sent is lost, except the trackers' records, "
                "which stay in the spool for otel-rl replay",
                self.shutdown_timeout, ", ".join(late),
            )  # fmt: skip
        # Last, so that a signal during the drain still finds our handler; the signals go back
        # to their previous handlers only if the application did not install its own since.
        lifecycle.unregister(self)

    def _flush_spans(self, timeout_millis: int = 30_000) -> bool:
        """The spans so far on disk (for the timeline picture); ``False`` when the run has
        none to draw (spans from the phase clock, and no timer used yet)."""
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_millis)
            return True
        assert self.trace_file is not None
        self.trace_file.write_carried()
        return self.trace_file.written > 0

    def _close_tracing(self) -> None:
        """End the open step spans, then send the spans (the tracer's shutdown has no timeout of
        its own: the deadline of ``finish()`` bounds it)."""
        if self.step_spans is not None:
            self.step_spans.close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.clock_spans is not None:
            self.clock_spans.close()
            assert self.trace_file is not None
            self.trace_file.shutdown()

    def abandon_after_fork(self) -> None:
        """In a fork child, which does not own the run: drop the lock a parent thread may have
        held at the fork, stop routing the global meters here and let the exporters forget the
        parent's threads. Nothing reaches the trackers from this process afterwards."""
        self.steps.abandon_after_fork()
        if self._router is not None:
            self._router.unroute(self.pipeline.provider)
        for delivery in self.exporters:
            delivery.abandon_after_fork()
