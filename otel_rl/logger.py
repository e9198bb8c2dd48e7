"""Logger: the training loop's one entry point to every tracker, the Collector and Prometheus."""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.config.loading import resolve_settings
from otel_rl.core.errors import MetricError, MetricReporter
from otel_rl.core.records import Hyperparams, Plot, Table
from otel_rl.core.redaction import compile_patterns, flatten_params, redact
from otel_rl.core.values import histogram_of_values
from otel_rl.delivery.fanout import Fanout
from otel_rl.distributed.snapshot import SPANS_DROPPED_KEY, SPANS_KEY
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.process.lifecycle import exit_code_of
from otel_rl.run.history import RUN_ID_ENV, RunHistory, continue_tracker_runs
from otel_rl.run.intake import Intake
from otel_rl.run.run import Run
from otel_rl.telemetry.timing import PhaseTimer


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
        #: The resolved config, typed (:class:`~otel_rl.config.schema.LoggerSettings`:
        #: ``logger.config.export.delivery``); it reads as a mapping too.
        self.config = cfg = resolve_settings(cfg)
        self.log_dir = Path(cfg.log_dir)
        given = cfg.run_id if cfg.run_id is not None else os.environ.get(RUN_ID_ENV)
        named = given is not None and bool(str(given).strip())
        if given is not None and not named:
            # An unset job id expanded to nothing: the run cannot be continued by a relaunch.
            _log.warning("otel-rl: run_id is empty (config or %s); a random one is used, so a "
                         "relaunch will not continue this run", RUN_ID_ENV)  # fmt: skip
        self.run_id = str(given) if named else uuid.uuid4().hex[:12]
        #: The launches of this run in ``log_dir`` (``resume``): ``history.attempt`` is this
        #: launch's number, 1 for a new run.
        self.history = history = RunHistory.begin(self.log_dir, self.run_id, cfg.resume)
        # The config says which run and attempt it is, for exporters that record it (JSONL
        # rows) and for ``otel-rl replay``, which rebuilds them from the config in the spool.
        cfg.run_id = self.run_id
        cfg.set_launch(history.attempt, history.launch)
        continue_tracker_runs(cfg, history.tracker_runs())
        self._strict = cfg.strict
        self._report = MetricReporter(self._strict, _log)
        self._redaction = compile_patterns(tuple(cfg.redaction.extra_patterns))
        self._run = run = Run(cfg, exporters, run_id=self.run_id, redaction=self._redaction,
                              report=self._report)  # fmt: skip
        run.facades.append(weakref.ref(self))
        history.record()
        if history.resumed:
            run.steps.resume_attempt = history.attempt
        self._intake = Intake(run, cfg.reductions, strict=self._strict, report=self._report,
                              anatomy=cfg.anatomy)  # fmt: skip
        self._shared_timers = run.timers.shared
        self._fanout = run.fanout
        self.exporters = run.exporters
        self.meter_provider = run.pipeline.provider
        #: Spans of timers (``tracing.enabled``); ``None`` when tracing is off.
        self.tracer_provider = run.tracer_provider
        #: ``steps`` sealed, ``backwards_steps``, ``nonfinite`` values logged.
        self.stats = run.stats
        #: The Ray GPU/node monitor (``monitor_gpus: true``), else ``None``; see
        #: docs/gpu-monitoring.md. It scrapes on its own thread.
        self.gpu_monitor: Any = run.sources.gpu_monitor
        #: The inference-engine monitor (``rollout_monitoring``), else ``None``; see
        #: docs/rollout-monitoring.md. It scrapes on its own thread.
        self.rollout_monitor: Any = run.sources.rollout_monitor

    @property
    def fanout(self) -> Fanout:
        """The run's trackers as one :class:`~otel_rl.delivery.fanout.Fanout`:
        ``send(record, to=...)`` queues a record (``otel_rl.core.records``) for all of them or the
        ones named."""
        return self._fanout

    @property
    def prometheus_url(self) -> str | None:
        """The ``/metrics`` URL this run serves (``prometheus.enabled``), else ``None``."""
        return self._run.pipeline.prometheus_url

    @property
    def otlp_endpoint(self) -> str | None:
        """Where OTLP metrics are pushed (``otlp.enabled``, after the ``OTEL_*`` variables),
        else ``None``."""
        return self._run.pipeline.otlp_endpoint

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
            self._intake.log(metrics, step, prefix, step_metric, step_finished)
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

        checked = self._intake.checked_record(name, step, "plot")
        if checked is None:
            return
        buffer = io.BytesIO()
        try:
            figure.savefig(buffer, format="png", bbox_inches="tight")
        except Exception as exc:  # not a figure, or one that cannot render: costs only itself
            what = f"{type(figure).__name__}.savefig(...) failed ({type(exc).__name__}: {exc})"
            self._report(name, f"plot skipped: {what}; give a matplotlib figure")
            return
        self._fanout.send(Plot(name=name, step=checked, png=buffer.getvalue()))

    def log_table(
        self,
        name: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        step: int,
    ) -> None:
        """Log a table (e.g. validation samples: input, output, score)."""
        checked = self._intake.checked_record(name, step, "table")
        if checked is None:
            return
        table = Table(name, checked, tuple(map(str, columns)), tuple(tuple(r) for r in rows))
        self._fanout.send(table)

    def log_histogram(self, values: Sequence[float], step: int, name: str, bins: int = 30) -> None:
        """Log the distribution of ``values`` at ``step`` as a histogram (plus summary stats).

        ``values``: numbers, or an array or tensor (flattened). Large ones are binned by numpy
        (docs/configuration.md). A value that is not a number, or ``bins`` that is not a
        positive integer, skips this histogram alone, with a warning (raises in strict mode).
        """
        try:
            histogram = histogram_of_values(values, bins)
        except Exception as exc:  # whatever the values do costs this histogram only
            self._report(name, f"histogram skipped: {type(exc).__name__}: {exc}")
            return
        if histogram is None:
            self._report(name, "empty histogram skipped")
            return
        self.log_metrics({name: histogram}, step=step)

    def timer(self, name: str) -> PhaseTimer:
        """Time a block or a function into the histogram ``timing/<name>`` (seconds).

        Rows show the step's total seconds under ``timing/<name>``; Prometheus and OTLP get the
        histogram. A generator or coroutine function is timed from its first step to its end.
        A name is checked as a logged key is (another type converted to text, a lone surrogate
        refused: a timer that times nothing), reported once, raised in strict mode.
        """
        try:
            timer = self._shared_timers.get(name)  # the usual call: a timer used before
        except TypeError:  # a name that is no dict key (a list): checked below
            timer = None
        return timer if timer is not None else self._intake.timer(name)

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
        A conflicting declaration is reported (raised with ``strict: true``) and that key left out;
        so is an entry that is no snapshot (``None``, a worker that sent nothing, is skipped).
        """
        if isinstance(snapshots, (str, bytes, Mapping)) or not isinstance(snapshots, Iterable):
            self._report("<log_worker_metrics>", "call dropped: give a list of "
                         f"WorkerMetrics.snapshot() results, not {type(snapshots).__name__}")
            return
        snapshots = list(snapshots)  # (a generator is read once, here)
        trace_file = self._run.trace_file
        if trace_file is not None:  # the workers' spans, written on the trace file's thread
            for snapshot in snapshots:
                if not isinstance(snapshot, Mapping):
                    continue
                spans, dropped = snapshot.get(SPANS_KEY), snapshot.get(SPANS_DROPPED_KEY)
                if isinstance(spans, list):
                    trace_file.carry(spans, dropped if type(dropped) is int else 0)
        rows = self._intake.merged(snapshots, prefix)
        if rows is not None:
            self.log_metrics(rows, step=step, step_finished=step_finished)

    # ---- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Send the pending step and wait until every tracker has written everything.

        Blocks the caller (up to ``timeout`` seconds, default ``export.shutdown_timeout``);
        returns whether all trackers caught up.
        """
        return self._run.flush(timeout)

    def finish(self, exit_code: int | None = None) -> None:
        """Send what is pending, drain every tracker (within ``export.shutdown_timeout``) and
        close the run; ``exit_code != 0`` marks it failed in trackers that keep a status.

        Without ``exit_code``, the run ends as the process does: called while an exception is
        handled or propagating (``except:``, ``finally:``) it is failed (1; ``KeyboardInterrupt``
        130, SIGTERM 143), after ``sys.exit(n)`` it gets ``n``, else it succeeded. An explicit
        ``exit_code`` (``finish(exit_code=0)``) is taken as it is.
        """
        self._run.finish(exit_code)

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(exit_code=exit_code_of(exc_type, exc))
