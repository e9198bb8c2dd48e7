"""The shared base of every tracker exporter: an OTel MetricExporter with its own thread.

A tracker exporter receives records (step batches, hyperparameters) from the training thread
through :meth:`TrackerExporter.submit`, which only appends to a bounded in-memory queue. One
worker thread per exporter opens the tracker, writes records in order, retries failures with
exponential backoff, and closes the tracker at shutdown. A tracker that raises or hangs delays
only its own queue: training and the other trackers never wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry.sdk.metrics.export import (
    Gauge,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)

from otel_rl.records import Hyperparams, RowValue, StepBatch
from otel_rl.step_reader import STEP_TEMPORALITY

_log = logging.getLogger("otel_rl")

Record = Any  # StepBatch | Hyperparams | anything with ``deliver_to(exporter)``


class RowRejected(Exception):
    """Raised by a tracker write to drop a record for good (it can never succeed).

    Anything else a write raises is taken as transient and retried.
    """


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

    def __init__(
        self,
        *,
        queue_size: int = 10_000,
        on_full: str = "drop_oldest",
        retry_max_backoff: float = 10.0,
        time_axis: str = "otel_rl/elapsed_s",
        step_gauge: str | None = None,
    ) -> None:
        super().__init__(preferred_temporality=STEP_TEMPORALITY)
        if on_full not in ("drop_oldest", "block"):
            raise ValueError(f"on_full must be 'drop_oldest' or 'block', got {on_full!r}")
        self._queue: deque[Record] = deque()
        self._queue_size = max(queue_size, self.max_batch)
        self._on_full = on_full
        self._retry_max_backoff = retry_max_backoff
        self._time_axis = time_axis
        self._step_gauge = step_gauge
        self._started_at = time.monotonic()
        self._cond = threading.Condition()
        self._inflight = 0
        self._stopping = False
        self._closed = False
        self._idle = True
        self._opened = False
        self._exit_code = 0
        self._warned: set[str] = set()
        self.stats = {"submitted": 0, "delivered": 0, "dropped": 0, "rejected": 0, "retries": 0}
        self._thread = threading.Thread(
            target=self._run, name=f"otel-rl-{self.name}", daemon=True
        )
        self._thread.start()

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

    def write_table(
        self,
        name: str,
        step: int,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
    ) -> None:
        """Store a table; trackers without tables skip it (one warning)."""
        self._warn_once("no-table", "%s: tables are not supported; %r skipped", self.name, name)

    def flush_backend(self) -> None:
        """Push buffered writes out (called when the queue runs empty)."""

    def close(self, exit_code: int) -> None:
        """Finish the run in the tracker; ``exit_code != 0`` marks it failed where possible."""

    # ---- training-thread side ----------------------------------------------------------------

    def submit(self, record: Record) -> None:
        """Queue ``record`` for the worker thread. Never blocks unless ``on_full='block'``."""
        with self._cond:
            if self._closed:
                self._warn_once("closed", "%s: record after shutdown ignored", self.name)
                return
            while len(self._queue) >= self._queue_size:
                if self._on_full == "block":
                    self._cond.wait()
                    continue
                self._drop_oldest()
            self._queue.append(record)
            self.stats["submitted"] += 1
            self._idle = False
            self._cond.notify_all()

    def _drop_oldest(self) -> None:
        # Items at the head may be in flight on the worker; drop the oldest one that is not.
        index = self._inflight
        if index >= len(self._queue):
            index = len(self._queue) - 1
        del self._queue[index]
        self.stats["dropped"] += 1
        self._warn_once(
            "dropped",
            "%s: queue full (%d records), dropping the oldest; raise export.queue_size or use "
            "export.on_full='block'",
            self.name,
            self._queue_size,
        )

    @property
    def pending(self) -> int:
        """Records queued or in flight."""
        return len(self._queue)

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
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Drain within the timeout, then close the tracker (``exit_code`` kwarg: run status)."""
        self._exit_code = int(kwargs.get("exit_code", 0) or 0)
        with self._cond:
            if self._closed:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_millis / 1000)
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._cond.notify_all()
        if left or self._thread.is_alive():
            _log.warning(
                "otel-rl: %s: %d record(s) not delivered before the shutdown timeout",
                self.name,
                left,
            )

    # ---- worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    if not self._idle:
                        self._flush_quietly()
                        self._idle = True
                        self._cond.notify_all()
                    self._cond.wait()
                if not self._queue and self._stopping:
                    break
                if self._closed:
                    return
                items = self._take_locked()
            try:
                if not self._opened:
                    self.open()
                    self._opened = True
                delivered = self._deliver(items)
                backoff = 0.0
            except Exception as exc:  # a tracker failure must never escape this thread
                self.stats["retries"] += 1
                self._warn_once(
                    f"error:{type(exc).__name__}",
                    "%s: write failed (%s: %s); retrying with backoff, training continues",
                    self.name,
                    type(exc).__name__,
                    exc,
                )
                backoff = min(max(backoff * 2, 0.05), self._retry_max_backoff)
                with self._cond:
                    self._inflight = 0
                    if self._closed:
                        return
                    self._cond.wait(backoff)  # shutdown wakes us early; the retry still runs
                continue
            with self._cond:
                for _ in range(delivered):
                    self._queue.popleft()
                self._inflight = 0
                self.stats["delivered"] += delivered
                self._cond.notify_all()
        self._flush_quietly()
        if self._opened:
            try:
                self.close(self._exit_code)
            except Exception as exc:
                _log.warning("otel-rl: %s: close failed: %s", self.name, exc)
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def _take_locked(self) -> list[Record]:
        first = self._queue[0]
        items = [first]
        if isinstance(first, StepBatch) and self.max_batch > 1:
            for record in list(self._queue)[1 : self.max_batch]:
                if not isinstance(record, StepBatch):
                    break
                items.append(record)
        self._inflight = len(items)
        return items

    def _deliver(self, items: list[Record]) -> int:
        try:
            first = items[0]
            if isinstance(first, StepBatch):
                if len(items) == 1:
                    self.write_step(first.step, first.rows, first)
                else:
                    self.write_batches(items)
            elif isinstance(first, Hyperparams):
                self.write_hyperparams(first.params)
            else:
                first.deliver_to(self)
        except RowRejected as exc:
            self.stats["rejected"] += len(items)
            self._warn_once(
                f"rejected:{exc}", "%s: record rejected by the tracker, skipped: %s", self.name, exc
            )
        return len(items)

    def _flush_quietly(self) -> None:
        if not self._opened:
            return
        try:
            self.flush_backend()
        except Exception as exc:
            self._warn_once(f"flush:{type(exc).__name__}", "%s: flush failed: %s", self.name, exc)

    def _axis_point(self, metrics_data: MetricsData) -> tuple[int, str | None]:
        if self._step_gauge:
            for rm in metrics_data.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
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
