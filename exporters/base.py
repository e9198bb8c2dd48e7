"""The shared base of every tracker exporter: an OTel MetricExporter with its own thread.

A tracker exporter receives records (step batches, hyperparameters, plots, tables) from the
training thread through :meth:`TrackerExporter.submit`, which only appends to a queue. Its
:class:`~otel_rl.delivery.Delivery` spools them to disk, and one worker thread per exporter opens
the tracker, writes records in order, retries failures with exponential backoff, and closes the
tracker at shutdown. A tracker that raises or hangs delays only its own queue: training and the
other trackers never wait for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from opentelemetry.sdk.metrics.export import (
    Gauge,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from otel_rl.exporters.step_order import StepOrder

from otel_rl.delivery import Delivery
from otel_rl.export_options import ExportOptions
from otel_rl.failures import Failure, RowRejected, classify, describe_losses, losses
from otel_rl.fork_safe_log import log as _log
from otel_rl.records import Event, Record, RowValue, StepBatch, TableRows, scoped_metrics
from otel_rl.redaction import Patterns, redact_init_kwargs
from otel_rl.step_reader import STEP_TEMPORALITY
from otel_rl.tracker_writer import PartialWrite, TrackerHooks, TrackerWriter

__all__ = ["RowRejected", "TrackerExporter"]


class TrackerExporter(MetricExporter):
    """Base class: subclasses implement :meth:`open`, :meth:`write_step` and :meth:`close`.

    Everything except :meth:`submit` and the OTel ``export`` hand-off runs on the exporter's
    worker thread, including :meth:`open`, so a tracker SDK is imported and initialised there.
    """

    #: The name used in config (``<name>_enabled``), logs and the registry.
    name: ClassVar[str] = "tracker"
    #: Step batches handed to :meth:`write_batches` at once when a backlog builds.
    max_batch: ClassVar[int] = 1
    #: Importable modules the tracker needs; checked before the exporter is built.
    requires: ClassVar[tuple[str, ...]] = ()
    #: What the tracker does with a training step lower than one it already has (for the
    #: one warning; docs/backends/README.md has the table).
    backwards_policy: ClassVar[str] = "it keeps both points at that step"
    #: Trackers that keep one value per key and step lose a repeated step as well.
    repeat_is_backwards: ClassVar[bool] = False

    def __init__(
        self,
        *,
        queue_size: int | None = None,
        on_full: str | None = None,
        retry_max_backoff: float | None = None,
        spool_dir: str | os.PathLike | None = None,
        fsync_interval: float | None = None,
        spool_meta: Mapping[str, Any] | None = None,
        time_axis: str = "otel_rl/elapsed_s",
        step_gauge: str | None = None,
    ) -> None:
        super().__init__(preferred_temporality=STEP_TEMPORALITY)
        self._time_axis = time_axis
        self._step_gauge = step_gauge
        self._started_at = time.monotonic()
        self._warned: set[str] = set()
        #: Config overrides that reopen this tracker's run later (``otel-rl replay``); set it in
        #: ``open()``, e.g. ``{"mlflow": {"run_id": run.info.run_id}}``.
        self.resume_config: dict[str, Any] = {}
        # Options given here win over the ones a Logger attaches; the rest follow export.*.
        given = {
            "queue_size": queue_size, "on_full": on_full,
            "retry_max_backoff": retry_max_backoff, "fsync_interval": fsync_interval,
        }  # fmt: skip
        self._given = {k: v for k, v in given.items() if v is not None}
        self._options = ExportOptions(**self._given)
        self._spool_dir = Path(spool_dir) if spool_dir is not None else None
        self._spool_meta = dict(spool_meta or {})
        self._order = StepOrder(repeat_is_backwards=self.repeat_is_backwards)
        self._noted: weakref.WeakSet[StepBatch] = weakref.WeakSet()
        self._delivery: Delivery | None = None
        self._start_lock = threading.Lock()
        #: Delivery counters: submitted, delivered, rejected, retries, spilled, dropped, ...
        self.stats: dict[str, int] = {}
        #: Records left undelivered by :meth:`shutdown` (in the spool when there is one).
        self.undelivered = 0

    def attach(
        self,
        options: ExportOptions | None = None,
        *,
        spool_dir: str | os.PathLike | None = None,
        spool_meta: Mapping[str, Any] | None = None,
        redaction: Patterns | None = None,
    ) -> None:
        """Set how this exporter delivers (the run's ``export.*`` options, its spool folder and
        the run's metadata) and the run's extra redaction patterns, before :meth:`start`. A
        Logger attaches every exporter it is given."""
        if self._delivery is not None:
            raise RuntimeError(f"{self.name}: attach() after the exporter started")
        if options is not None:
            self._options = dataclasses.replace(options, **self._given)
        if spool_dir is not None and self._spool_dir is None:
            self._spool_dir = Path(spool_dir)
            self._spool_meta = dict(spool_meta or {})
        if redaction is not None:
            self.redact_own_config(redaction)

    def start(self) -> None:
        """Start the delivery threads (idempotent; the first :meth:`submit` starts them too)."""
        with self._start_lock:
            if self._delivery is not None:
                return
            self._delivery = Delivery(
                self.name,
                hooks=self._hooks(),
                max_batch=self.max_batch,
                options=self._options,
                spool_dir=self._spool_dir,
                stats=self.stats,
                warn_once=self._warn_once,
            )
            self._write_spool_meta()

    def redact_own_config(self, patterns: Patterns) -> None:
        """Apply the run's extra redaction patterns to any configuration this tracker sends on
        its own (a tracker SDK's ``init`` config); nothing by default."""

    def writer(self) -> TrackerWriter:
        """A writer that calls this tracker on the caller's thread (``otel-rl replay``)."""
        return TrackerWriter(self.name, self._hooks(), self.stats, self._warn_once)

    def _hooks(self) -> TrackerHooks:
        return TrackerHooks(
            open=self._open_and_remember,
            deliver=self._deliver,
            flush=self.flush_backend,
            close=self.close,
            classify=self.classify_error,
            position=self.write_position,
        )

    @property
    def started(self) -> bool:
        return self._delivery is not None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **options: Any) -> TrackerExporter:
        """Build from a resolved logger config. This default passes the tracker's
        ``trackers: {<name>: {...}}`` options as keyword arguments (third-party trackers)."""
        own = dict((cfg.get("trackers") or {}).get(cls.name) or {})
        return cls(**own, **options)

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        """Connect to the tracker / open files. Called once, lazily, before the first write."""

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        """Write one step's rows. ``batch.axis`` names a custom x-axis when not ``None``."""
        raise NotImplementedError

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        """Write several consecutive step batches; override with one request where possible."""
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
        """Show an :class:`~otel_rl.records.Event` (a stall, a straggler) as text; trackers
        without text skip it (the run's log and Prometheus/OTLP carry it anyway)."""

    def flush_backend(self) -> None:
        """Push buffered writes out to the tracker (called when the queue runs empty and at
        least every ``export.fsync_interval``): records count as delivered only after it."""

    def write_position(self) -> Any:
        """Where the tracker's output stands (JSON-able, e.g. a file size), noted in the spool
        before each write. Return ``None`` (the default) if the tracker cannot tell."""
        return None

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        """``otel-rl replay``: whether a write of ``records`` records (``None``: not noted) that
        started at ``position`` reached the tracker whole (the process was killed before marking
        it done). Implement it together with :meth:`write_position`. A kill can cut even one
        write call short, so count what the output holds after ``position``."""
        return False

    def classify_error(self, exc: BaseException, phase: str) -> Failure:
        """Whether ``exc`` (raised in ``"open"`` or ``"write"``) is transient, permanent or
        refuses one record; override to recognise the tracker's own errors."""
        return classify(exc, phase, self.name)  # type: ignore[arg-type]

    def close(self, exit_code: int) -> None:
        """Finish the run in the tracker; ``exit_code != 0`` marks it failed where possible."""

    # ---- training-thread side ----------------------------------------------------------------

    def submit(self, record: Any) -> None:
        """Queue ``record`` for this tracker. Returns at once, unless ``on_full="block"`` and the
        tracker is behind, or the spool cannot keep up with the disk (docs/reliability.md)."""
        delivery = self._delivery
        if delivery is None:
            self.start()
            delivery = self._delivery
        assert delivery is not None
        delivery.submit(record)

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered."""
        return self._delivery.pending if self._delivery is not None else 0

    @property
    def lost(self) -> dict[str, int]:
        """Records lost for good, by reason (``otel_rl.failures.LOSS_REASONS``)."""
        return losses(self.stats)

    @property
    def failure(self) -> Failure | None:
        """The permanent error that stopped this tracker, if any."""
        return self._delivery.failure if self._delivery is not None else None

    @property
    def spool_dir(self) -> Path | None:
        return self._spool_dir

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
        if self._delivery is None:
            return True
        return self._delivery.wait_idle(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Drain within the timeout, then close the tracker (``exit_code`` kwarg: run status).

        Accepts the SDK's ``timeout`` keyword (milliseconds) as well as ``timeout_millis``.
        """
        if "timeout" in kwargs and kwargs["timeout"] is not None:
            timeout_millis = float(kwargs["timeout"])
        exit_code = int(kwargs.get("exit_code", 0) or 0)
        delivery = self._delivery
        if delivery is None:
            return
        left = delivery.shutdown(timeout_millis / 1000, exit_code)
        self.undelivered = left
        if self.spool_dir is not None:
            self._write_spool_meta(exit_code=exit_code)
        if left:
            _log.warning("otel-rl: %s", self._undelivered_message(left, timeout_millis / 1000))
        lost = self.lost
        if lost:
            _log.warning(
                "otel-rl: %s: %d record(s) lost for good in this run: %s (docs/reliability.md, "
                "Losses)", self.name, sum(lost.values()), describe_losses(lost),
            )  # fmt: skip

    def _undelivered_message(self, left: int, timeout: float) -> str:
        assert self._delivery is not None
        if self._options.shutdown_timeout is not None:
            timeout = self._options.shutdown_timeout
        failure = self._delivery.failure
        error = failure or self._delivery.last_error
        if failure is not None:
            text = (
                f"{self.name}: {left} record(s) not delivered: the tracker stopped on "
                f"{failure.describe()}."
            )
        else:
            text = (
                f"{self.name}: {left} record(s) not delivered before the shutdown timeout "
                f"(export.shutdown_timeout: {timeout:g} s"
            )
            if error is not None:
                text += f"; last error: {error.describe()}"
            text += (
                "; raise export.shutdown_timeout to deliver more before exit, lower it to wait "
                "less)." if timeout > 0 else
                ": finish() does not wait, so records in flight are counted here too)."
            )  # fmt: skip
        if self.spool_dir is not None:
            log_dir = self._spool_meta.get("log_dir", "<log_dir>")
            text += (
                f" They are in the spool ({self.spool_dir}); deliver them with: "
                f"otel-rl replay {log_dir}"
            )
        else:
            text += " There is no spool (export.spool: false): they are lost."
        return text

    # ---- worker thread -----------------------------------------------------------------------

    def _open_and_remember(self) -> None:
        self.open()
        self._remember_resume()

    def _remember_resume(self) -> None:
        """Save ``resume_config`` with the spool (trackers that open their run lazily call it
        once they have one)."""
        if self.resume_config and self.spool_dir is not None:
            self._write_spool_meta()

    def _deliver(self, items: list[Record]) -> None:
        self._note_order(items)
        first = items[0]
        if isinstance(first, StepBatch):
            if len(items) == 1:
                self.write_step(first.step, first.rows, first)
            elif type(self).write_batches is TrackerExporter.write_batches:
                # One write_step per batch: report how far it got, so a retry never repeats.
                for done, batch in enumerate(items):
                    try:
                        self.write_step(batch.step, batch.rows, batch)
                    except Exception as exc:
                        if done == 0:
                            raise
                        raise PartialWrite(done, exc) from exc
            else:
                self.write_batches(items)
        else:
            first.deliver_to(self)

    def _note_order(self, items: list[Record]) -> None:
        for batch in items:
            # Once per batch: a retried write delivers the same batch again.
            if not isinstance(batch, StepBatch) or batch.axis is not None or batch in self._noted:
                continue
            self._noted.add(batch)
            previous = self._order.check(batch.step)
            if previous is None:
                continue
            self.stats["backwards_steps"] = self._order.backwards
            self._warn_once(
                "backwards",
                "%s: step went backwards (%d after %d); %s; further occurrences are only counted",
                self.name,
                batch.step,
                previous,
                self.backwards_policy,
            )

    def _write_spool_meta(self, exit_code: int | None = None) -> None:
        spool = self._delivery.spool if self._delivery is not None else None
        if spool is None:
            return
        meta = {**self._spool_meta, "tracker": self.name, "resume": self.resume_config}
        if exit_code is not None:
            meta["exit_code"] = exit_code
            # The last record written: replay tells records cut from outside from none at all.
            meta["last_seq"] = spool.last_seq
        try:
            spool.write_meta(meta)
        except OSError as exc:
            self._warn_once("meta", "%s: cannot write spool metadata: %s", self.name, exc)

    def _axis_point(self, metrics_data: MetricsData) -> tuple[int, str | None]:
        if self._step_gauge:
            for _, metric in scoped_metrics((metrics_data,)):
                if metric.name == self._step_gauge and isinstance(metric.data, Gauge):
                    points = metric.data.data_points
                    if points:
                        return int(points[-1].value), None
        return int(time.monotonic() - self._started_at), self._time_axis

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        _log.warning("otel-rl: " + message, *args)

    def abandon_after_fork(self) -> None:
        """In a fork child (called by the Logger's fork hook): the delivery, the tracker's handles
        and the spool are the parent's. Drop them without writing anything: the child never
        writes the parent's spool, ``meta.json`` or tracker files, and ignores what it is given.
        Files the tracker holds (one level of objects deep) are pointed at ``/dev/null`` in the
        child, so that an inherited buffer is never flushed into the parent's files."""
        import io
        import sys

        self._start_lock = threading.Lock()  # a parent thread may have held it at fork
        delivery = self._delivery
        if delivery is not None:
            delivery.abandon_after_fork()
        self._spool_dir = None
        std = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            seen: set[int] = set()
            todo: list[tuple[Any, int]] = [(self, 0)]
            while todo and len(seen) < 1000:
                obj, depth = todo.pop()
                if id(obj) in seen or id(obj) in std:
                    continue
                seen.add(id(obj))
                if isinstance(obj, io.IOBase):
                    try:
                        if not obj.closed and obj.fileno() > 2:
                            os.dup2(null, obj.fileno())
                    except (OSError, ValueError):
                        pass
                    continue
                if depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, type):
                    todo.extend((value, depth + 1) for value in vars(obj).values())
        finally:
            os.close(null)


class SdkRunExporter(TrackerExporter):
    """A tracker whose SDK starts a run with ``init(**init_kwargs)``: W&B, SwanLab, Trackio.

    ``init_kwargs`` are the tracker's config section; its ``config`` and free-text fields reach
    the tracker's files as they are, so they go through the same redaction as
    ``log_hyperparams`` (docs/security.md). ``run`` is the SDK's own run object once the tracker
    is open, for power users.
    """

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.init_kwargs = redact_init_kwargs(dict(init_kwargs or {}))
        self.run: Any = None
        super().__init__(**kwargs)

    def redact_own_config(self, patterns: Patterns) -> None:
        """``init_kwargs`` reach the SDK only when the tracker opens, after :meth:`attach`."""
        self.init_kwargs = redact_init_kwargs(self.init_kwargs, extra_patterns=patterns)

    @contextlib.contextmanager
    def refused_content(self) -> Iterator[None]:
        """The SDK's ``TypeError``/``ValueError`` on a row is its verdict on the content: the row
        is set aside (:class:`RowRejected`), never retried."""
        try:
            yield
        except (TypeError, ValueError) as exc:
            raise RowRejected(f"{self.name} refused the row: {exc}") from exc
