"""Delivery: how records get from the training thread into one tracker, in order, eventually.

Three parties, one condition variable:

- the **training thread** calls :meth:`Delivery.submit`, which only appends to a deque;
- the **spool thread** (when a spool directory is given) appends records to the tracker's
  write-ahead log (in the kernel at once, fsynced every ``fsync_interval``) and passes them on to
  the in-memory queue — or, when that queue is full and ``on_full="spool"``, leaves them on disk
  only, to be read back in order by a :class:`~otel_rl.spool.SegmentCursor`;
- the **worker thread** writes records in order through a
  :class:`~otel_rl.tracker_writer.TrackerWriter` and marks them done once the tracker has them
  (after its ``flush``): transient errors are retried with jittered backoff, a permanent one
  stops this tracker at once (its records stay in the spool).

The worker never dies: anything unexpected is reported once and the loop goes on.
Without a spool directory, records go straight to the in-memory queue.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_rl.failures import Failure
from otel_rl.records import StepBatch
from otel_rl.spool import SegmentCursor, Spool
from otel_rl.tracker_writer import TrackerHooks, TrackerWriter

__all__ = ["ON_FULL", "Delivery", "ExportOptions"]

_log = logging.getLogger("otel_rl")

ON_FULL = ("spool", "block", "drop_oldest")


@dataclass(frozen=True)
class ExportOptions:
    """The ``export.*`` settings one tracker's delivery follows."""

    queue_size: int = 10_000
    on_full: str = "spool"
    retry_max_backoff: float = 10.0
    fsync_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}, got {self.on_full!r}")


class Delivery:
    """The queue, threads, retries and spool of one tracker exporter."""

    def __init__(
        self,
        name: str,
        *,
        hooks: TrackerHooks,
        max_batch: int = 1,
        options: ExportOptions = ExportOptions(),
        spool_dir: str | Path | None = None,
        stats: dict[str, int] | None = None,
        warn_once: Callable[..., None],
    ) -> None:
        self.name = name
        self._max_batch = max(1, max_batch)
        self._queue_size = max(1, options.queue_size)
        self._on_full = options.on_full
        if spool_dir is None and options.on_full == "spool":
            # Never make the training thread wait on a tracker nobody asked to wait for.
            self._on_full = "drop_oldest"
            warn_once(
                "no-spool",
                "%s: export.on_full='spool' needs a spool (export.spool: true, or an exporter "
                "given to a Logger); without one a full queue drops its oldest record",
                name,
            )
        self._retry_max_backoff = options.retry_max_backoff
        self._fsync_interval = options.fsync_interval
        self._warn_once = warn_once
        self.spool = Spool(spool_dir) if spool_dir is not None else None
        self._cursor = SegmentCursor(self.spool.dir) if self.spool else None

        self._cond = threading.Condition()
        self._incoming: deque[Any] = deque()  # submitted, not yet spooled
        self._incoming_since = 0.0  # when the oldest of them arrived
        self._queue: deque[tuple[int | None, Any]] = deque()  # ready for the worker
        self._overflow_from: int | None = None  # first seq that lives only on disk
        self._spooled_upto = self.spool.last_seq if self.spool else 0
        self._inflight = 0  # records at the head of the queue being written
        self._in_transit = 0  # taken by the spool thread, not yet in the queue
        self._spool_running = self.spool is not None
        self._stopping = False
        self._abort = False  # shutdown timed out: start no new write
        self._closed = False
        self._idle = True
        self._last_ack_sync = 0.0
        #: The permanent failure that stopped this tracker, if any.
        self.failure: Failure | None = None
        #: The last error of any kind (named in the final message when records are left).
        self.last_error: Failure | None = None
        self.exit_code = 0
        self.stats = stats if stats is not None else {}
        for key in ("submitted", "delivered", "dropped", "rejected", "retries", "spilled",
                    "waits", "spool_waits", "backwards_steps", "unspooled"):  # fmt: skip
            self.stats.setdefault(key, 0)
        self._writer = TrackerWriter(name, hooks, self.stats, warn_once)
        self._threads = [threading.Thread(target=self._run, name=f"otel-rl-{name}", daemon=True)]
        if self.spool is not None:
            self._threads.append(
                threading.Thread(target=self._spool_loop, name=f"otel-rl-{name}-spool", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # ---- training thread --------------------------------------------------------------------

    def submit(self, record: Any) -> None:
        provisional = isinstance(record, StepBatch) and record.provisional
        with self._cond:
            if self._closed or self._stopping:
                if not provisional:
                    self._warn_once("closed", "%s: record after shutdown ignored", self.name)
                return
            if provisional:
                if self._spool_running:  # a checkpoint for the spool only
                    self._append_incoming_locked(record)
                    self._cond.notify_all()
                return
            self.stats["submitted"] += 1
            self._idle = False
            if self.spool is not None:
                # Memory stays bounded even when the disk cannot keep up with the loop (only at
                # thousands of steps per second): then the caller waits for the spool thread.
                while self._spool_running:
                    if self._spool_lagging_locked():
                        self.stats["spool_waits"] += 1
                    elif len(self._incoming) >= self._queue_size or (
                        self._on_full == "block"
                        and len(self._incoming) + len(self._queue) >= self._queue_size
                    ):
                        self.stats["waits"] += 1
                    else:
                        break
                    self._cond.wait(0.05)
                if self._spool_running:
                    self._append_incoming_locked(record)
                else:  # the spool thread is gone: keep delivering from memory
                    self._enqueue_locked(None, record)
            else:
                self._enqueue_locked(None, record)
            self._cond.notify_all()

    def _append_incoming_locked(self, record: Any) -> None:
        if not self._incoming:
            self._incoming_since = time.monotonic()
        self._incoming.append(record)

    def _spool_lagging_locked(self) -> bool:
        """The oldest record not yet written to the spool waited half an fsync interval: the
        machine is too busy for the spool thread, and the crash promise (nothing older than
        ``fsync_interval`` lost) now costs the caller a short wait."""
        return bool(self._incoming) and (
            time.monotonic() - self._incoming_since > self._fsync_interval / 2
        )

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered (in memory or only on disk)."""
        with self._cond:
            on_disk = self._spooled_upto - self._overflow_from + 1 if self._overflow_from else 0
            return len(self._incoming) + len(self._queue) + on_disk

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None or not self._threads[0].is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout: float, exit_code: int) -> int:
        """Drain within ``timeout`` seconds and close; returns how many records were left."""
        self.exit_code = exit_code
        with self._cond:
            if self._closed:
                return 0
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in reversed(self._threads):  # the spool thread first: it feeds the worker
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._abort = True  # a worker still busy starts no new write from here on
            self._closed = True
            self._cond.notify_all()
            if self.spool is None:
                return len(self._queue)
            left = len(self._incoming) + self._spooled_upto - self.spool.acked_upto
            return max(0, left)

    # ---- spool thread -----------------------------------------------------------------------

    def _spool_loop(self) -> None:
        spool = self.spool
        assert spool is not None
        last_sync = time.monotonic()
        dirty = False
        while True:
            with self._cond:
                if not self._incoming and not self._stopping:
                    self._cond.wait(self._fsync_interval if dirty else None)
                records = list(self._incoming)
                self._incoming.clear()
                self._in_transit = len(records)
                stopping = self._stopping
            if records:
                try:
                    seqs = spool.append(records)
                except Exception as exc:  # a full disk must not lose the records in memory
                    self._warn_once(
                        "spool", "%s: cannot write the spool (%s: %s); records are kept in "
                        "memory only until the tracker has them", self.name,
                        type(exc).__name__, exc,
                    )  # fmt: skip
                    seqs = [None] * len(records)
                dirty = True
                with self._cond:
                    for seq, record in zip(seqs, records, strict=True):
                        provisional = isinstance(record, StepBatch) and record.provisional
                        if seq is None and not provisional:
                            self.stats["unspooled"] += 1
                        if not provisional:
                            self._enqueue_locked(seq, record)
                    written = [s for s in seqs if s is not None]
                    if written:
                        self._spooled_upto = written[-1]
                    self._in_transit = 0
                    self._cond.notify_all()
            now = time.monotonic()
            if dirty and (now - last_sync >= self._fsync_interval or stopping):
                try:
                    spool.sync()
                except Exception as exc:
                    self._warn_once("spool-sync", "%s: spool fsync failed: %s", self.name, exc)
                dirty, last_sync = False, now
            if stopping and not records:
                with self._cond:
                    if not self._incoming:
                        try:
                            spool.close_writer()
                        except OSError as exc:
                            self._warn_once("spool-close", "%s: spool close: %s", self.name, exc)
                        self._spool_running = False
                        self._cond.notify_all()  # the worker waits for this thread to end
                        return

    def _enqueue_locked(self, seq: int | None, record: Any) -> None:
        if self.failure is not None:  # stopped: spooled records wait for replay
            if seq is None:
                self.stats["dropped"] += 1
            return
        full = len(self._queue) >= self._queue_size
        spill = self._overflow_from is not None or (full and self._on_full == "spool")
        if seq is not None and spill:
            if self._overflow_from is None:
                self._overflow_from = seq
                self._warn_once(
                    "spilled",
                    "%s: tracker is behind by %d records; further records wait on disk only",
                    self.name,
                    self._queue_size,
                )
            self.stats["spilled"] += 1
            return
        if full and self._on_full == "block" and self.spool is None:
            while len(self._queue) >= self._queue_size and not self._closed:
                self.stats["waits"] += 1
                self._cond.wait()
        elif full:
            self.stats["dropped"] += 1
            self._warn_once(
                "dropped",
                "%s: queue full (%d records), dropping the oldest; raise export.queue_size or "
                "use export.on_full='spool' or 'block'",
                self.name,
                self._queue_size,
            )
            if self._inflight >= len(self._queue):
                return  # every queued record is being written: the new one is the one dropped
            del self._queue[self._inflight]  # the oldest record not yet handed to the tracker
        self._queue.append((seq, record))

    # ---- worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """The worker: never lets an exception end the thread."""
        pause = 0.05
        while True:
            try:
                self._work()
                break
            except Exception as exc:  # a bug of ours must not silence a tracker for the run
                self._warn_once(
                    f"internal:{type(exc).__name__}",
                    "%s: internal error in the delivery loop (%s: %s); continuing",
                    self.name, type(exc).__name__, exc,
                )  # fmt: skip
                with self._cond:
                    self._inflight = 0
                    if self._closed:
                        break
                    self._cond.wait(pause)
                pause = min(pause * 2, 1.0)
        self._finish_worker()

    def _work(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._queue and self._overflow_from is None:
                    if self._stopping and not self._incoming and not self._spool_running:
                        break
                    if not self._idle and not self._incoming and not self._in_transit:
                        self._idle = True
                        self._cond.notify_all()
                    self._cond.wait(self._fsync_interval if self.spool else None)
                if (not self._queue and self._overflow_from is None) or self._abort:
                    break
                if self.failure is not None:  # stopped: the records wait in the spool
                    self._park_locked()
                    break
            if not self._queue:
                self._load_overflow()
                continue
            with self._cond:
                items = self._take_locked()
            done, failure = self._writer.write(
                items, self.spool.note_attempt if self.spool is not None else None
            )
            if done:
                # Marked done right after the tracker holds them: a kill in between is the
                # only way a record is sent twice, and that window is two system calls wide.
                seqs = [seq for seq, _ in items[:done] if seq is not None]
                self._flush_and_ack(seqs[-1] if seqs else None)
            with self._cond:
                for _ in range(done):
                    self._queue.popleft()
                self._inflight = 0
                self.stats["delivered"] += done
                self._cond.notify_all()
            if failure is None:
                backoff = 0.0
                continue
            self.last_error = failure
            if failure.kind == "permanent":
                self._stop_for(failure)
                continue
            self.stats["retries"] += 1
            self._warn_once(
                f"error:{type(failure.error).__name__}",
                "%s: write failed (%s); retrying with backoff, training continues",
                self.name, failure.describe(),
            )  # fmt: skip
            backoff = min(max(backoff * 2, 0.05), self._retry_max_backoff)
            with self._cond:
                if self._abort:
                    break
                # Jitter spreads the retries of many ranks hitting one recovering server.
                self._cond.wait(backoff * random.uniform(0.5, 1.0))
        self._flush_and_ack(None)

    def _stop_for(self, failure: Failure) -> None:
        self.failure = failure
        where = (
            f"; its records stay in the spool ({self.spool.dir}) for `otel-rl replay` once "
            "fixed" if self.spool is not None else ""
        )
        _log.error(
            "otel-rl: %s stopped: %s%s", self.name, failure.describe(), where
        )
        with self._cond:
            self._cond.notify_all()

    def _park_locked(self) -> None:
        """A stopped tracker: drop what is in memory (it is in the spool) and wake waiters."""
        if self.spool is None:
            self.stats["dropped"] += len(self._queue)
        self._queue.clear()
        self._overflow_from = None
        self._idle = True
        self._cond.notify_all()

    def _take_locked(self) -> list[tuple[int | None, Any]]:
        first = self._queue[0]
        items = [first]
        if isinstance(first[1], StepBatch) and self._max_batch > 1:
            for item in list(self._queue)[1 : self._max_batch]:
                if not isinstance(item[1], StepBatch):
                    break
                items.append(item)
        self._inflight = len(items)
        return items

    def _load_overflow(self) -> None:
        """Bring up to ``queue_size`` records that live only on disk back into memory."""
        assert self.spool is not None and self._cursor is not None
        with self._cond:
            start, upto = self._overflow_from, self._spooled_upto
        if start is None:
            return
        read = self._cursor.read(start, upto, self._queue_size)
        # Nothing readable left in that range (never expected of our own spool): go on live.
        read_upto = read[-1][0] if read else upto
        missing = read_upto - start + 1 - len(read)
        if missing > 0:  # segments deleted or truncated from outside while the run went on
            with self._cond:
                self.stats["dropped"] += missing
            self._warn_once(
                "spool-missing",
                "%s: %d spooled record(s) vanished from %s before delivery (deleted from "
                "outside?); they are lost, later records go on",
                self.name, missing, self.spool.dir,
            )  # fmt: skip
        loaded = [(s, r) for s, r in read if not (isinstance(r, StepBatch) and r.provisional)]
        with self._cond:
            self._queue.extend(loaded)
            self._overflow_from = None if read_upto >= self._spooled_upto else read_upto + 1
            self._cond.notify_all()

    def _flush_and_ack(self, upto: int | None) -> None:
        """Make the tracker hold what it was given, then mark it done (never the other way)."""
        failure = self._writer.flush()
        if failure is not None:
            self.last_error = failure
            return
        if self.spool is None:
            return
        try:
            if upto is not None:
                self.spool.ack(upto)
            now = time.monotonic()
            if upto is None or now - self._last_ack_sync >= self._fsync_interval:
                self.spool.sync_acks()
                self.spool.delete_done_segments()
                self._last_ack_sync = now
        except (OSError, ValueError) as exc:
            self._warn_once("ack", "%s: cannot record deliveries: %s", self.name, exc)

    def _finish_worker(self) -> None:
        if not self._abort:
            self._writer.close(self.exit_code)
        if self.spool is not None:
            try:
                self.spool.close_acks()
            except OSError as exc:
                self._warn_once("spool-close", "%s: cannot close the spool: %s", self.name, exc)
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def abandon_after_fork(self) -> None:
        """In a fork child: the threads, locks, queue and spool are the parent's. Forget them
        without writing anything and ignore what is submitted from now on. The child's copies of
        the spool's file descriptors are pointed at ``/dev/null`` first, so that bytes left in an
        inherited buffer never reach the parent's files, even when the child collects them."""
        import io
        import os

        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for holder in (self.spool, self._cursor):
                for value in list(vars(holder).values()) if holder is not None else ():
                    if isinstance(value, io.IOBase) and not value.closed:
                        try:
                            if value.fileno() > 2:
                                os.dup2(null, value.fileno())
                        except (OSError, ValueError):
                            pass
        finally:
            os.close(null)
        self._cond = threading.Condition()  # a parent thread may have held the old one at fork
        self._threads = []
        self.spool = None
        self._cursor = None
        self._spool_running = False
        self._incoming.clear()
        self._queue.clear()
        self._overflow_from = None
        self._inflight = self._in_transit = 0
        self._stopping = self._abort = self._closed = True
        self._idle = True
