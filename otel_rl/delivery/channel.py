"""A tracker's channel: everything between ``submit`` and the tracker's own write calls.

A :class:`Channel` wraps one tracker by composition. It keeps the tracker's export options,
spool folder and run metadata, starts the :class:`~otel_rl.delivery.worker.Delivery` (queue,
worker thread, retries, and the spool feed when it spools), turns the records it is handed into
the tracker's write calls, notices steps that go backwards, and says what was left undelivered
at the end. The tracker only writes: it inherits no thread, queue or spool.

What a channel needs of a tracker (:class:`Tracker`) are the verbs of
``otel_rl.exporters.TrackerExporter``; any object with them can be wrapped.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast
from weakref import WeakSet

from otel_rl.core.failures import Failure, describe_losses, losses
from otel_rl.core.records import Record, StepBatch
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.step_order import StepOrder
from otel_rl.delivery.worker import Delivery
from otel_rl.delivery.writer import PartialWrite, TrackerHooks, TrackerWriter
from otel_rl.process.fork_safe_log import log as _log


class Tracker(Protocol):
    """The calls a channel makes on the tracker it wraps, all on the channel's worker thread
    (or on ``otel-rl replay``'s)."""

    resume_config: dict[str, Any]

    @property
    def name(self) -> str: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def backwards_policy(self) -> str: ...
    @property
    def repeat_is_backwards(self) -> bool: ...

    def open(self) -> None: ...
    def write_step(self, step: int, rows: Mapping[str, Any], batch: StepBatch) -> None: ...
    def write_batches(self, batches: Sequence[StepBatch]) -> None: ...
    def flush_backend(self) -> None: ...
    def close(self, exit_code: int) -> None: ...
    def classify_error(self, exc: BaseException, phase: str) -> Failure: ...
    def write_position(self) -> Any: ...


class Channel:
    """The delivery of one tracker: options, spool, worker, and what is left at the end."""

    def __init__(
        self, tracker: Tracker, *, given: Mapping[str, Any], batches_one_by_one: bool
    ) -> None:
        self.tracker = tracker
        self.name = tracker.name
        # Options given to the tracker itself win over the ones a run attaches.
        self._given = dict(given)
        self.options = ExportOptions(**self._given)
        self.spool_dir: Path | None = None
        self.spool_meta: dict[str, Any] = {}
        # A tracker without its own write_batches gets one write_step per batch, and a failure
        # half-way says how far it got, so that a retry never writes a step twice.
        self._one_by_one = batches_one_by_one
        self.order = StepOrder(repeat_is_backwards=tracker.repeat_is_backwards)
        self._noted: WeakSet[StepBatch] = WeakSet()
        self._warned: set[str] = set()
        self._start_lock = threading.Lock()
        self.delivery: Delivery | None = None
        #: Delivery counters: submitted, delivered, rejected, retries, spilled, lost[...], ...
        self.stats: dict[str, int] = {}
        #: Records left undelivered by :meth:`shutdown` (in the spool when there is one).
        self.undelivered = 0

    def attach(
        self,
        options: ExportOptions | None,
        spool_dir: str | os.PathLike[str] | None,
        spool_meta: Mapping[str, Any] | None,
    ) -> None:
        """The run's ``export.*`` options, spool folder and metadata, before :meth:`start`."""
        if self.delivery is not None:
            raise RuntimeError(f"{self.name}: attach() after the exporter started")
        if options is not None:
            self.options = dataclasses.replace(options, **self._given)
        if spool_dir is not None and self.spool_dir is None:
            self.spool_dir = Path(spool_dir)
            self.spool_meta = dict(spool_meta or {})

    def start(self) -> Delivery:
        """Start the delivery threads once; returns the running delivery."""
        with self._start_lock:
            if self.delivery is None:
                self.delivery = Delivery(
                    self.name,
                    hooks=self._hooks(),
                    max_batch=self.tracker.max_batch,
                    options=self.options,
                    spool_dir=self.spool_dir,
                    stats=self.stats,
                    warn_once=self.warn_once,
                )
                self.write_meta()
            return self.delivery

    def submit(self, record: Any) -> None:
        (self.delivery or self.start()).submit(record)

    def writer(self) -> TrackerWriter:
        """A writer that calls the tracker on the caller's thread (``otel-rl replay``)."""
        return TrackerWriter(self.name, self._hooks(), self.stats, self.warn_once)

    @property
    def pending(self) -> int:
        return self.delivery.pending if self.delivery is not None else 0

    @property
    def failure(self) -> Failure | None:
        return self.delivery.failure if self.delivery is not None else None

    def wait_idle(self, timeout: float) -> bool:
        return self.delivery is None or self.delivery.wait_idle(timeout)

    def shutdown(self, timeout: float, exit_code: int) -> None:
        """Drain within ``timeout`` seconds, close the tracker, and say what was left."""
        delivery = self.delivery
        if delivery is None:
            return
        self.undelivered = left = delivery.shutdown(timeout, exit_code)
        if self.spool_dir is not None:
            self.write_meta(exit_code=exit_code)
        if left:
            _log.warning("otel-rl: %s", self._undelivered_message(left, timeout))
        lost = losses(self.stats)
        if lost:
            _log.warning(
                "otel-rl: %s: %d record(s) lost for good in this run: %s (docs/reliability.md, "
                "Losses)", self.name, sum(lost.values()), describe_losses(lost),
            )  # fmt: skip

    def write_meta(self, exit_code: int | None = None) -> None:
        """The spool's ``meta.json``: the run, the tracker, and how to reopen its run."""
        spool = self.delivery.spool if self.delivery is not None else None
        if spool is None:
            return
        meta = {**self.spool_meta, "tracker": self.name, "resume": self.tracker.resume_config}
        if exit_code is not None:
            meta["exit_code"] = exit_code
            # The last record written: replay tells records cut from outside from none at all.
            meta["last_seq"] = spool.last_seq
        try:
            spool.write_meta(meta)
        except OSError as exc:
            self.warn_once("meta", "%s: cannot write spool metadata: %s", self.name, exc)

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning("otel-rl: " + message, *args)

    # ---- the tracker's calls (worker thread) -------------------------------------------------

    def _hooks(self) -> TrackerHooks:
        tracker = self.tracker
        return TrackerHooks(
            open=self._open,
            deliver=self._deliver,
            flush=tracker.flush_backend,
            close=tracker.close,
            classify=tracker.classify_error,
            position=tracker.write_position,
        )

    def _open(self) -> None:
        self.tracker.open()
        if self.tracker.resume_config and self.spool_dir is not None:
            self.write_meta()

    def _deliver(self, items: list[Record]) -> None:
        self._note_order(items)
        first, tracker = items[0], self.tracker
        if not isinstance(first, StepBatch):
            first.deliver_to(tracker)
            return
        batches = cast("list[StepBatch]", items)  # several records are step batches only
        if len(batches) == 1:
            tracker.write_step(first.step, first.rows, first)
        elif not self._one_by_one:
            tracker.write_batches(batches)
        else:
            for done, batch in enumerate(batches):
                try:
                    tracker.write_step(batch.step, batch.rows, batch)
                except Exception as exc:
                    if done == 0:
                        raise
                    raise PartialWrite(done, exc) from exc

    def _note_order(self, items: list[Record]) -> None:
        for batch in items:
            # Once per batch: a retried write delivers the same batch again.
            if not isinstance(batch, StepBatch) or batch.axis is not None or batch in self._noted:
                continue
            self._noted.add(batch)
            previous = self.order.check(batch.step)
            if previous is None:
                continue
            self.stats["backwards_steps"] = self.order.backwards
            self.warn_once(
                "backwards",
                "%s: step went backwards (%d after %d); %s; further occurrences are only counted",
                self.name, batch.step, previous, self.tracker.backwards_policy,
            )  # fmt: skip

    def _undelivered_message(self, left: int, timeout: float) -> str:
        assert self.delivery is not None
        if self.options.shutdown_timeout is not None:
            timeout = self.options.shutdown_timeout
        failure = self.delivery.failure
        error = failure or self.delivery.last_error
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
            log_dir = self.spool_meta.get("log_dir", "<log_dir>")
            text += (
                f" They are in the spool ({self.spool_dir}); deliver them with: "
                f"otel-rl replay {log_dir}"
            )
        else:
            text += " There is no spool (export.spool: false): they are lost."
        return text

    # ---- fork --------------------------------------------------------------------------------

    def abandon_after_fork(self) -> None:
        """In a fork child: the delivery, the tracker's handles and the spool are the parent's.
        Drop them without writing anything: the child never writes the parent's spool,
        ``meta.json`` or tracker files, and ignores what it is given. Files the tracker holds
        (a few levels of objects deep) are pointed at ``/dev/null`` in the child, so that an
        inherited buffer is never flushed into the parent's files."""
        self._start_lock = threading.Lock()  # a parent thread may have held it at fork
        if self.delivery is not None:
            self.delivery.abandon_after_fork()
        self.spool_dir = None
        _silence_files_of(self.tracker)


def _silence_files_of(root: object) -> None:
    std = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        seen: set[int] = set()
        todo: list[tuple[Any, int]] = [(root, 0)]
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
