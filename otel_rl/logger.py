"""Logger: the training loop's one entry point to every tracker, the Collector and Prometheus."""

from __future__ import annotations

import atexit
import math
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import Observation

from otel_rl import lifecycle
from otel_rl.config import resolve_config
from otel_rl.deadline import (
    SHUTDOWN_GRACE,
    Deadline,
    start_stopping,
    still_stopping,
    stop_in_parallel,
)
from otel_rl.distributed.reductions import ReductionRules
from otel_rl.errors import MetricError, MetricReporter
from otel_rl.export_options import ExportOptions
from otel_rl.fanout import Fanout
from otel_rl.fork_safe_log import log as _log
from otel_rl.keys import KeyCollisionError, KeyRegistry
from otel_rl.lifecycle import exit_code_hint, exit_code_of, weak_atexit
from otel_rl.paths import safe_relative
from otel_rl.pipeline import Pipeline, build_resource
from otel_rl.records import (
    OWN_SCOPE,
    Hyperparams,
    Plot,
    Table,
    histogram_of,
    rows_from_metrics,
)
from otel_rl.redaction import compile_patterns, flatten_params, redact
from otel_rl.routing import global_router
from otel_rl.run_sources import RunSources
from otel_rl.run_trackers import RunTrackers
from otel_rl.self_telemetry import install_self_telemetry
from otel_rl.steps import StepAssembler, checked_step
from otel_rl.timing import Timer, TimerFactory
from otel_rl.tracing import StepSpans, build_tracer_provider
from otel_rl.values import flatten_into

if TYPE_CHECKING:
    from otel_rl.watch import RunWatch


class Logger:
    """Log metrics, timings and hyperparameters to every enabled tracker, off the training thread.

    ``cfg`` is a mapping or a YAML file path with NeMo RL's logger keys plus otel-rl's own (see
    docs/configuration.md). ``exporters`` adds tracker exporters built by the caller.

    Step semantics: values logged with the same ``step`` merge into one row; a step is sent to
    the trackers when a different step is logged, when ``step_finished=True``, or on
    ``flush()``/``finish()``. What OTel instruments record (timers, library meters) between two
    ``log_metrics`` calls belongs to the step of the second call.
    """

    def __init__(
        self,
        cfg: Mapping[str, Any] | str | Path | None = None,
        *,
        exporters: Sequence[Any] = (),
    ) -> None:
        self.config = resolve_config(cfg)
        cfg = self.config
        self.log_dir = Path(cfg["log_dir"])
        self.run_id = str(cfg["run_id"] or uuid.uuid4().hex[:12])
        # The config says which run it is, for exporters that record it (JSONL rows) and for
        # ``otel-rl replay``, which rebuilds them from the config kept in the spool.
        cfg["run_id"] = self.run_id
        self._strict = bool(cfg["strict"])
        self._report = MetricReporter(self._strict, _log)
        self._redaction = compile_patterns(tuple(cfg["redaction"]["extra_patterns"]))
        export = cfg["export"]
        self._shutdown_timeout = float(export["shutdown_timeout"])
        self._trackers = trackers = RunTrackers(
            cfg, exporters, run_id=self.run_id, redaction=self._redaction,
            options=ExportOptions.from_section(export),
        )  # fmt: skip
        self.exporters = trackers.exporters
        # What can refuse the run (a port in use, the OTLP environment) comes before any
        # tracker thread starts: a Logger() that raises leaves nothing running.
        self._pipeline = Pipeline(cfg, build_resource(cfg, self.run_id))
        try:
            trackers.start()
        except BaseException:
            self._pipeline.shutdown(timeout_millis=1000)
            raise
        self._fanout = Fanout(self.exporters)

        self.meter_provider = self._pipeline.provider
        self._meter = self._pipeline.provider.get_meter(OWN_SCOPE)
        self._side_meter = self._pipeline.side_provider.get_meter(OWN_SCOPE)
        otlp = cfg["otlp"] if cfg["otlp"]["enabled"] else None
        #: Spans of timers (``tracing.enabled``); ``None`` when tracing is off.
        self.tracer_provider = build_tracer_provider(
            cfg["tracing"]["enabled"], otlp, self._pipeline.resource
        )
        # One ``rl.step`` span per training step, parent of the step's timers (docs/tracing.md).
        self._step_spans = (
            StepSpans(self.tracer_provider, run_id=self.run_id) if self.tracer_provider else None
        )
        self._reductions = ReductionRules(cfg["reductions"])
        self._router = global_router() if cfg["capture_global_meters"] else None
        if self._router is not None:
            self._router.route_to(self._pipeline.provider)

        self._keys = KeyRegistry()
        self._timers = TimerFactory(
            self._meter, self._keys, self._step_spans.tracer if self._step_spans else None
        )
        self._known: set[str] = set()
        self._latest: dict[str, float] = {}
        #: ``steps`` sealed, ``backwards_steps``, ``nonfinite`` values logged.
        self.stats = {"nonfinite": 0, "backwards_steps": 0, "steps": 0}
        self._steps = StepAssembler(
            send=self._fanout.send,
            take_otel=self._pipeline.step_reader.take,
            convert=self._convert,
            report=self._report,
            stats=self.stats,
            step_spans=self._step_spans,
        )
        self._lock = self._steps.lock
        self._finished = False
        self._ending: int | None = None  # the thread ending the run
        self._ended = threading.Event()
        if self._pipeline.has_side_readers:
            install_self_telemetry(
                self._side_meter, self.exporters, self.stats, lambda: self._steps.last_step
            )
        self._sources = sources = RunSources(
            cfg, run_id=self.run_id, pipeline=self._pipeline, fanout=self._fanout,
            steps=self._steps, step_spans=self._step_spans,
        )  # fmt: skip
        #: The Ray GPU/node monitor (``monitor_gpus: true``), else ``None``; see
        #: docs/gpu-monitoring.md. It scrapes on its own thread.
        self.gpu_monitor: Any = sources.gpu_monitor
        #: The inference-engine monitor (``rollout_monitoring``), else ``None``; see
        #: docs/rollout-monitoring.md. It scrapes on its own thread.
        self.rollout_monitor: Any = sources.rollout_monitor
        #: Stalls and stragglers (``stalls``): the watchdog's thread and what it tells.
        self._watch: RunWatch | None = sources.watch
        # Signals raise only at safe points, sys.exit codes reach atexit, fork children disable
        # this Logger (otel_rl/lifecycle.py). Before our atexit drain, whose hooks run after it.
        lifecycle.register(self, handle_signals=bool(export["handle_signals"]))
        self._atexit = weak_atexit(self, lambda run: run.finish(exit_code=exit_code_hint()))

    @property
    def fanout(self) -> Fanout:
        """The run's trackers as one :class:`~otel_rl.fanout.Fanout`: ``send(record, to=...)``
        queues a record (``otel_rl.records``) for all of them or the ones named."""
        return self._fanout

    @property
    def prometheus_url(self) -> str | None:
        """The ``/metrics`` URL this run serves (``prometheus.enabled``), else ``None``."""
        return self._pipeline.prometheus_url

    @property
    def otlp_endpoint(self) -> str | None:
        """Where OTLP metrics are pushed (``otlp.enabled``, after the ``OTEL_*`` variables),
        else ``None``."""
        return self._pipeline.otlp_endpoint

    # ---- logging ------------------------------------------------------------------------------

    def log_metrics(
        self,
        metrics: Mapping[Any, Any],
        step: int | None = None,
        prefix: str = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log ``metrics`` at ``step`` (merged with anything else logged at that step).

        Never raises in the default lenient mode: bad keys and values are reported once each
        through ``logging``. With ``strict: true`` they raise :class:`otel_rl.MetricError`.
        """
        try:
            self._log_metrics(metrics, step, prefix, step_metric, step_finished)
        except MetricError as exc:
            if self._strict:
                raise
            self._report(exc.key, exc.reason)
        except Exception as exc:  # lenient mode: training must survive anything logged
            # Bad keys and values are handled one by one in flatten_into; this is what is left
            # (a mapping whose iteration raises): the call is lost, and said so.
            if self._strict:
                raise MetricError("<log_metrics>", f"{type(exc).__name__}: {exc}") from exc
            self._report("<log_metrics>", f"call dropped: {type(exc).__name__}: {exc}")

    def _log_metrics(
        self,
        metrics: Mapping[Any, Any],
        step: int | None,
        prefix: str,
        step_metric: str | None,
        step_finished: bool,
    ) -> None:
        if self._finished:
            self._report("<log_metrics>", "called after finish(); values ignored")
            return
        if not isinstance(metrics, Mapping):
            raise MetricError(metrics, f"metrics must be a mapping, got {type(metrics).__name__}")
        fresh: dict[str, Any] = {}
        if step_metric is not None and prefix and step_metric in metrics:
            # NeMo RL convention: the step metric keeps its own name, unprefixed.
            metrics = dict(metrics)
            fresh_axis: dict[str, Any] = {}
            self.stats["nonfinite"] += flatten_into(
                fresh_axis, {step_metric: metrics.pop(step_metric)}, "", self._report
            )
            fresh.update(fresh_axis)
        self.stats["nonfinite"] += flatten_into(fresh, metrics, prefix, self._report)
        with self._lock:
            # Everything that can refuse the call (the step, a key collision in strict mode)
            # runs before the pending step changes: a refused call leaves no trace, not even
            # an empty row at its step.
            step = self._steps.resolve(step, self._strict)
            watch = self._watch
            if watch is not None:
                watch.stamp(step, fresh)
            new = fresh.keys() - self._known
            if new:
                self._register(new, fresh)
                if watch is not None:
                    watch.new_keys(step, fresh, new)
            self._steps.add(step, fresh, prefix, step_metric)
            if self._pipeline.has_side_readers:
                self._latest.update(fresh)
            if step_finished:
                self._steps.seal()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration (nested keys flattened with ``.``; secrets redacted)."""
        try:
            flat = redact(flatten_params(params), extra_patterns=self._redaction)
        except Exception as exc:
            if self._strict:
                raise MetricError("<hyperparams>", str(exc)) from exc
            self._report("<hyperparams>", f"failed: {exc}")
            return
        self._fanout.send(Hyperparams(flat))

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Log a matplotlib figure (rendered to PNG here, on the caller's thread: the figure
        object may change as soon as this returns)."""
        import io

        checked = self._checked_record(name, step, "plot")
        if checked is None:
            return
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        self._fanout.send(Plot(name=name, step=checked, png=buffer.getvalue()))

    def log_table(
        self,
        name: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        step: int,
    ) -> None:
        """Log a table (e.g. validation samples: input, output, score)."""
        checked = self._checked_record(name, step, "table")
        if checked is None:
            return
        table = Table(name, checked, tuple(map(str, columns)), tuple(tuple(r) for r in rows))
        self._fanout.send(table)

    def log_histogram(self, values: Sequence[float], step: int, name: str, bins: int = 30) -> None:
        """Log the distribution of ``values`` at ``step`` as a histogram (plus summary stats)."""
        numbers = [float(v) for v in values]
        if not numbers:
            self._report(name, "empty histogram skipped")
            return
        self.log_metrics({name: histogram_of(numbers, bins)}, step=step)

    def timer(self, name: str) -> Timer:
        """Time a block or a function into the histogram ``timing/<name>`` (seconds).

        Rows show the step's total seconds under ``timing/<name>``; Prometheus and OTLP get the
        histogram.
        """
        try:
            return self._timers.timer(name)
        except KeyCollisionError as exc:
            raise MetricError(f"timing/{name}", str(exc)) from exc

    def log_worker_metrics(
        self,
        snapshots: Sequence[Mapping[str, Any] | None],
        step: int | None = None,
        prefix: str = "",
        step_finished: bool = False,
    ) -> None:
        """Merge ``WorkerMetrics.snapshot()`` results from many workers and log them at ``step``.

        Each key is reduced as its worker declared, else by the ``reductions`` config, else
        ``mean``; timings take the ``max`` across workers by default (docs/distributed.md).
        A conflicting declaration is reported (raised with ``strict: true``) and that key left out.
        """
        from otel_rl.distributed.merge import merge_snapshots

        try:
            report = None if self._strict else self._report
            rows = merge_snapshots(snapshots, self._reductions, prefix, report=report)
        except MetricError:
            if self._strict:
                raise
            return
        except Exception as exc:  # lenient mode: a malformed snapshot must not stop training
            if self._strict:
                raise MetricError("<log_worker_metrics>", f"{type(exc).__name__}: {exc}") from exc
            self._report("<log_worker_metrics>", f"failed: {type(exc).__name__}: {exc}")
            return
        self.log_metrics(rows, step=step, step_finished=step_finished)

    # ---- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Send the pending step and wait until every tracker has written everything.

        Blocks the caller (up to ``timeout`` seconds, default ``export.shutdown_timeout``);
        returns whether all trackers caught up.
        """
        with self._lock:
            self._steps.seal(final=True)
        deadline = Deadline(self._shutdown_timeout if timeout is None else timeout)
        ok = self._sources.flush(deadline)
        for exporter in self.exporters:
            left = deadline.left()
            ok = exporter.force_flush(timeout_millis=left * 1000) and ok
        return ok

    def finish(self, exit_code: int | None = None) -> None:
        """Send what is pending, drain every tracker (within ``export.shutdown_timeout``) and
        close the run; ``exit_code != 0`` marks it failed in trackers that keep a status.

        Without ``exit_code``, the run ends as the process does: called while an exception is
        handled or propagating (``except:``, ``finally:``) it is failed (1; ``KeyboardInterrupt``
        130, SIGTERM 143), after ``sys.exit(n)`` it gets ``n``, else it succeeded. An explicit
        ``exit_code`` (``finish(exit_code=0)``) is taken as it is.
        """
        code = lifecycle.exit_code_now() if exit_code is None else int(exit_code)
        with self._lock:
            first = self._steps.close()
            if first:
                self._finished = True
                self._ending = threading.get_ident()
        if not first:
            # Another thread is ending the run (a daemon thread, then atexit): returning now
            # would let the process exit in the middle of its drain.
            if self._ending not in (None, threading.get_ident()):
                self._ended.wait(self._shutdown_timeout + SHUTDOWN_GRACE)
            return
        try:
            self._end(code)
        finally:
            self._ended.set()
            # Only now: a finish() on a daemon thread keeps the exit's finish, which waits for
            # it, so that the interpreter never exits (killing that thread) in the drain.
            atexit.unregister(self._atexit)

    def _end(self, code: int) -> None:
        deadline = Deadline(self._shutdown_timeout)
        # The sources' last rows must reach the trackers before these close, so the sources
        # stop first, within half the time: a hung endpoint leaves the trackers the rest.
        sources_by = deadline.share(0.5)
        late = stop_in_parallel(self._sources.stopping(sources_by), sources_by.at)
        if self._router is not None:
            self._router.unroute(self._pipeline.provider)
        trackers = start_stopping(self._trackers.stopping(deadline, code))
        otel = start_stopping([
            # Never a zero timeout, which the SDK reports as an error: the thread is left behind
            # at the deadline all the same.
            ("OTel pipeline", lambda: self._pipeline.shutdown(max(deadline.left(), 0.1) * 1000)),
            ("tracing", self._close_tracing),
        ])  # fmt: skip
        # The grace second lets a tracker that gave up at the deadline close its client.
        late += still_stopping(otel, deadline.at)
        late += still_stopping(trackers, deadline.at + SHUTDOWN_GRACE)
        if late:
            _log.warning(
                "otel-rl: the run ended at its deadline (export.shutdown_timeout: %g s) without "
                "waiting for: %s. What they had not sent is lost, except the trackers' records, "
                "which stay in the spool for otel-rl replay",
                self._shutdown_timeout, ", ".join(late),
            )  # fmt: skip
        # Last, so that a signal during the drain still finds our handler; the signals go back
        # to their previous handlers only if the application did not install its own since.
        lifecycle.unregister(self)

    def abandon_after_fork(self) -> None:
        """In a fork child, which does not own the run: drop the locks a parent thread may have
        held at the fork, stop routing the global meters here and let the exporters forget the
        parent's threads. Nothing reaches the trackers from this process afterwards."""
        fresh = threading.RLock()
        self._steps.lock, self._steps.closed = fresh, True
        self._lock = fresh
        self._finished = True
        if self._router is not None:
            self._router.unroute(self._pipeline.provider)
        for exporter in self.exporters:
            abandon = getattr(exporter, "abandon_after_fork", None)
            if abandon is not None:
                abandon()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(exit_code=exit_code_of(exc_type, exc))

    # ---- internals ----------------------------------------------------------------------------

    def _close_tracing(self) -> None:
        """End the open step spans, then send the spans (the tracer's shutdown has no timeout of
        its own: the deadline of ``finish()`` bounds it)."""
        if self._step_spans is not None:
            self._step_spans.close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()

    def _convert(self, datas: Sequence[Any]) -> dict[str, Any]:
        return rows_from_metrics(datas, self._key_of)

    def _key_of(self, scope: str, instrument: str) -> tuple[str, str] | None:
        if scope != OWN_SCOPE:
            return None
        key = self._keys.key_for(instrument)
        return (key, "timer") if key is not None else None

    def _register(self, new: set[str], fresh: Mapping[str, Any]) -> None:
        for key in new:
            try:
                name = self._keys.claim(key, "gauge")
            except KeyCollisionError as exc:
                # The key still reaches the trackers; only the OTel instrument is refused.
                self._report(key, str(exc))
                self._known.add(key)
                continue
            self._known.add(key)
            if self._pipeline.has_side_readers and type(fresh[key]) is float:
                self._side_meter.create_observable_gauge(name, callbacks=[self._observe(key)])

    def _observe(self, key: str) -> Callable[[Any], list[Observation]]:
        latest = self._latest

        def callback(options: Any) -> list[Observation]:
            value = latest.get(key)
            if type(value) is float and math.isfinite(value):
                return [Observation(value)]
            return []

        return callback

    def _checked_record(self, name: Any, step: Any, what: str) -> int | None:
        """The step of a plot or table, or ``None`` (reported) when its name or step is refused.

        Trackers get the name as given; file-based ones store it through
        :func:`otel_rl.paths.safe_relative`, so a name with no usable path part is refused here,
        on the caller's thread, rather than on a tracker's.
        """
        try:
            if not isinstance(name, str):
                raise MetricError(name, f"{what} name must be a string, got {type(name).__name__}")
            try:
                safe_relative(name)
            except ValueError as exc:
                raise MetricError(name, f"{what} skipped: {exc}") from None
            try:
                return checked_step(step)
            except MetricError as exc:
                raise MetricError(name, f"{what} skipped: {exc.reason}") from None
        except MetricError as exc:
            self._report(exc.key, exc.reason)  # raises in strict mode
            return None
