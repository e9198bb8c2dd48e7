"""The tracker exporter: a tracker's few verbs, as an OTel ``MetricExporter``.

A subclass writes to one tracker (``open``, ``write_step``, ``close``, and what else the tracker
supports), each verb on the exporter's own thread. The delivery around it (queue, worker, retries,
spool) is a :class:`~otel_rl.delivery.channel.Channel` it holds, not something it inherits: a
tracker that raises or hangs delays only its own channel.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otel_rl.core.failures import Failure, RowRejected, classify, losses
from otel_rl.core.records import (
    Event,
    Resume,
    RowValue,
    StepBatch,
    TableRows,
    last_gauge_value,
)
from otel_rl.core.redaction import Patterns
from otel_rl.delivery.channel import Awaitable, Channel
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.writer import TrackerWriter
from otel_rl.telemetry.step_reader import STEP_TEMPORALITY

__all__ = ["RowRejected", "TrackerExporter"]


class TrackerExporter(MetricExporter):
    """Base class: subclasses implement :meth:`open`, :meth:`write_step` and :meth:`close`."""

    # The name in config (``<name>_enabled``), logs and the registry; step batches handed to
    # write_batches at once in a backlog; modules the tracker needs (checked up front); what
    # it does with a step below one it has (docs/backends/README.md); whether a repeated step
    # is lost as well (trackers that keep one value per key and step).
    name: ClassVar[str] = "tracker"
    max_batch: ClassVar[int] = 1
    requires: ClassVar[tuple[str, ...]] = ()
    backwards_policy: ClassVar[str] = "it keeps both points at that step"
    repeat_is_backwards: ClassVar[bool] = False

    def __init__(
        self, *, queue_size: int | None = None, on_full: str | None = None,
        retry_max_backoff: float | None = None, spool_dir: str | os.PathLike[str] | None = None,
        fsync_interval: float | None = None, spool_meta: Mapping[str, Any] | None = None,
        time_axis: str = "otel_rl/elapsed_s", step_gauge: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(preferred_temporality=STEP_TEMPORALITY)
        self._time_axis, self._step_gauge = time_axis, step_gauge
        self._started_at = time.monotonic()
        #: Config overrides that reopen this tracker's run later (``otel-rl replay``); set it in
        #: ``open()``, e.g. ``{"mlflow": {"run_id": run.info.run_id}}``.
        self.resume_config: dict[str, Any] = {}
        given = {"queue_size": queue_size, "on_full": on_full, "fsync_interval": fsync_interval,
                 "retry_max_backoff": retry_max_backoff}  # fmt: skip
        self._channel = Channel(
            self, given={k: v for k, v in given.items() if v is not None},
            batches_one_by_one=type(self).write_batches is TrackerExporter.write_batches,
        )  # fmt: skip
        if type(self).submit is TrackerExporter.submit:  # one call less on every record's path
            self.submit = self._channel.submit  # type: ignore[method-assign]
        if spool_dir is not None:
            self._channel.attach(None, spool_dir, spool_meta)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **options: Any) -> TrackerExporter:
        """Build from a resolved logger config. This default passes the tracker's
        ``trackers: {<name>: {...}}`` options as keyword arguments (third-party trackers)."""
        own = dict((cfg.get("trackers") or {}).get(cls.name) or {})
        return cls(**own, **options)

    # ---- the tracker's verbs (worker thread) -------------------------------------------------

    def open(self) -> None:
        """Connect to the tracker / open files. Called once, lazily, before the first write."""

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        """Write one step's rows. ``batch.axis`` names a custom x-axis when not ``None``."""
        raise NotImplementedError

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        """Write consecutive step batches. Override it with one request where possible: a tracker
        that does gets every step through it, one or many at a time."""
        for batch in batches:
            self.write_step(batch.step, batch.rows, batch)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration (flattened keys)."""

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        """Store a rendered figure; trackers without images skip it (one warning)."""
        self._warn_once("no-plot", "%s: plots are not supported; %r skipped", self.name, name)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        """Store a table; trackers without tables skip it (one warning)."""
        self._warn_once("no-table", "%s: tables are not supported; %r skipped", self.name, name)

    def write_event(self, event: Event) -> None:
        """Show an :class:`~otel_rl.core.records.Event` (a stall, a straggler) as text; trackers
        without text skip it (the run's log and Prometheus/OTLP carry it anyway)."""

    def continue_run(self, resume_config: Mapping[str, Any]) -> None:
        """Open the run ``resume_config`` names (what :attr:`resume_config` held in an earlier
        launch of this run) rather than a new one; called before :meth:`open`. Trackers
        without a run of their own (files) keep the default, which ignores it."""

    def write_resume(self, resume: Resume) -> None:
        """The run was relaunched: from ``resume.step`` on, steps belong to ``resume.attempt``
        and supersede what earlier attempts logged there. Trackers that can hide the superseded
        steps (TensorBoard) or record the attempts (MLflow tags, a JSONL record) do it here."""

    def flush_backend(self) -> None:
        """Push buffered writes out to the tracker (called when the queue runs empty and at
        least every ``export.fsync_interval``): records count as delivered only after it."""

    def write_position(self) -> Any:
        """Where the tracker's output stands (JSON-able, e.g. a file size), noted in the spool
        before each write. Return ``None`` (the default) if the tracker cannot tell."""
        return None

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        """``otel-rl replay``: whether a write of ``records`` records (``None``: not noted) from
        ``position`` reached the tracker whole before a kill (with :meth:`write_position`; a
        kill can cut one write call short, so count what the output holds after it)."""
        return False

    def landed_since(self, position: Any, records: int) -> int | None:
        """``otel-rl replay``: how many of a write's ``records`` records, counted from the first
        written, the tracker holds whole after ``position`` (a kill can cut one write call short,
        leaving its first records whole); ``None`` (the default) when it can tell only all or
        nothing (:meth:`holds_since` then decides)."""
        return None

    def classify_error(self, exc: BaseException, phase: str) -> Failure:
        """Whether ``exc`` (raised in ``"open"`` or ``"write"``) is transient, permanent or
        refuses one record; override to recognise the tracker's own errors."""
        return classify(exc, phase, self.name)  # type: ignore[arg-type]

    def close(self, exit_code: int) -> None:
        """Finish the run in the tracker; ``exit_code != 0`` marks it failed where possible."""

    def redact_own_config(self, patterns: Patterns) -> None:
        """Apply the run's extra redaction patterns to any configuration this tracker sends on
        its own (a tracker SDK's ``init`` config); nothing by default."""

    # ---- the channel's side ------------------------------------------------------------------

    def attach(
        self, options: ExportOptions | None = None, *, redaction: Patterns | None = None,
        spool_dir: os.PathLike[str] | str | None = None,
        spool_meta: Mapping[str, Any] | None = None, after: Awaitable | None = None,
    ) -> None:  # fmt: skip
        """Set how this exporter delivers (the run's ``export.*`` options, spool folder and
        metadata) and the run's extra redaction patterns, before :meth:`start`. ``after``: what
        must be done before the first write (a relaunch's earlier launch, delivered first)."""
        self._channel.attach(options, spool_dir, spool_meta, after)
        if redaction is not None:
            self.redact_own_config(redaction)

    def start(self) -> None:
        """Start the delivery threads (idempotent; the first :meth:`submit` starts them too)."""
        self._channel.start()

    def submit(self, record: Any) -> None:
        """Queue ``record`` for this tracker. Returns at once, unless ``on_full="block"`` and the
        tracker is behind, or the spool cannot keep up with the disk (docs/reliability.md)."""
        self._channel.submit(record)

    def writer(self) -> TrackerWriter:  # writes on the caller's thread (otel-rl replay)
        return self._channel.writer()

    # Delivery counters, records not yet delivered, the permanent error that stopped the tracker,
    # records lost for good by reason (core/failures.py), and those left by shutdown().
    started = property(lambda self: self._channel.started)
    stats = property(lambda self: self._channel.stats)
    pending = property(lambda self: self._channel.pending)
    failure = property(lambda self: self._channel.failure)
    lost = property(lambda self: losses(self._channel.stats))
    undelivered = property(lambda self: self._channel.undelivered)
    spool_dir = property(lambda self: self._channel.spool_dir)
    intake_spooled = property(lambda self: self._channel.intake_spooled)

    def abandon_after_fork(self) -> None:  # in a fork child: the delivery is the parent's
        self._channel.abandon_after_fork()

    # ---- OTel MetricExporter API -------------------------------------------------------------

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        """Hand-off from a periodic reader: the data goes on a time (or step-gauge) axis."""
        step, axis = self._axis_point(metrics_data)
        self.submit(StepBatch(step=step, otel=(metrics_data,), axis=axis))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        """Wait until every queued record is written (or the timeout passes)."""
        return self._channel.wait_idle(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Drain within the timeout, then close the tracker (``exit_code`` kwarg: run status).
        Accepts the SDK's ``timeout`` keyword (milliseconds) as well as ``timeout_millis``."""
        if kwargs.get("timeout") is not None:
            timeout_millis = float(kwargs["timeout"])
        self._channel.shutdown(timeout_millis / 1000, int(kwargs.get("exit_code", 0) or 0))

    # ---- for subclasses ----------------------------------------------------------------------

    def _remember_resume(self) -> None:  # for trackers that open their run lazily
        if self.resume_config and self._channel.spool_dir is not None:
            self._channel.write_meta()

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        self._channel.warn_once(kind, message, *args)

    def _value_refused(self, kind: str, key: str, reason: str) -> None:
        """One value of a record that the tracker refused for good while it took the record's
        other values: counted in ``stats["refused_values"]`` (the record itself counts as
        delivered) and named once per key."""
        self.stats["refused_values"] += 1
        self._warn_once(
            f"refused:{kind}:{key}",
            "%s: the tracker refused %s %r, skipped (the record's other values were delivered; "
            "further refusals are counted in stats['refused_values']): %s",
            self.name, kind, key, reason,
        )  # fmt: skip

    def _axis_point(self, metrics_data: MetricsData) -> tuple[int, str | None]:
        step = last_gauge_value(metrics_data, self._step_gauge) if self._step_gauge else None
        if step is not None:
            return int(step), None
        return int(time.monotonic() - self._started_at), self._time_axis
