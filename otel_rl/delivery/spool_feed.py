"""The spooled path of a delivery: records reach the tracker's spool before its queue.

A :class:`SpoolFeed` sits between the training thread and a
:class:`~otel_rl.delivery.worker.Delivery`'s in-memory queue. Its thread appends what was submitted
to the tracker's write-ahead log (in the kernel at once, fsynced every ``fsync_interval``) and hands
each record on to the queue — or, when the queue is full and ``on_full="spool"``, leaves it on
disk only, to be read back in order by a :class:`~otel_rl.delivery.spool.SegmentCursor` once the
tracker catches up. Deliveries are marked done here too, after the tracker holds them.

It shares its delivery's condition variable: every ``*_locked`` method is called with it held.
A disk that fails costs only durability: the records still go on from memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.core.failures import count_loss
from otel_rl.core.records import StepBatch
from otel_rl.delivery.spool import SegmentCursor, Spool

__all__ = ["SpoolFeed"]

#: Hands a record on to the in-memory queue: ``(seq, record)``; seq is None when not on disk.
Enqueue = Callable[[int | None, Any], None]


def _provisional(record: Any) -> bool:
    """A pending step's checkpoint: kept by the spool for a crash, never delivered live."""
    return isinstance(record, StepBatch) and record.provisional


class SpoolFeed:
    """The spool thread of one tracker, the records it has not written yet, and the range of
    records that live on disk only."""

    def __init__(
        self,
        name: str,
        spool_dir: str | Path,
        *,
        cond: threading.Condition,
        enqueue: Enqueue,
        queued: Callable[[], int],
        queue_size: int,
        block: bool,
        fsync_interval: float,
        stats: dict[str, int],
        warn_once: Callable[..., None],
    ) -> None:
        self.name = name
        self.spool = Spool(spool_dir)
        self._cursor = SegmentCursor(self.spool.dir)
        self._cond = cond
        self._enqueue = enqueue
        self._queued = queued
        self._queue_size = queue_size
        self._block = block
        self._fsync_interval = fsync_interval
        self._stats = stats
        self._warn_once = warn_once
        self._incoming: deque[Any] = deque()  # submitted, not yet written
        self._incoming_since = 0.0  # when the oldest of them arrived
        self._in_transit = 0  # taken from _incoming, not yet handed on
        self._overflow_from: int | None = None  # first seq that lives only on disk
        self._spooled_upto = self.spool.last_seq
        self._stopping = False
        self._last_ack_sync = 0.0
        #: False once the thread has written everything and closed the log.
        self.running = True
        self.thread = threading.Thread(target=self._run, name=f"otel-rl-{name}-spool", daemon=True)

    # ---- training thread (condition held) -----------------------------------------------------

    def admit_locked(self, record: Any) -> bool:
        """Take ``record`` for the spool; False when the thread is gone (deliver from memory).

        Memory stays bounded even when the disk cannot keep up with the loop (only at thousands
        of steps per second): then the caller waits for the spool thread.
        """
        while self.running:
            if self._lagging_locked():
                self._stats["spool_waits"] += 1
            elif len(self._incoming) >= self._queue_size or (
                self._block and len(self._incoming) + self._queued() >= self._queue_size
            ):
                self._stats["waits"] += 1
            else:
                self._append_locked(record)
                return True
            self._cond.wait(0.05)
        return False

    def checkpoint_locked(self, record: Any) -> None:
        """A provisional record: to disk only, and only while the thread runs."""
        if self.running:
            self._append_locked(record)

    def _append_locked(self, record: Any) -> None:
        if not self._incoming:
            self._incoming_since = time.monotonic()
        self._incoming.append(record)

    def _lagging_locked(self) -> bool:
        """The oldest record not yet written waited half an fsync interval: the machine is too
        busy for the spool thread, and the crash promise (nothing older than ``fsync_interval``
        lost) now costs the caller a short wait."""
        return bool(self._incoming) and (
            time.monotonic() - self._incoming_since > self._fsync_interval / 2
        )

    # ---- what the delivery asks (condition held) -----------------------------------------------

    def busy_locked(self) -> bool:
        """Records taken by the feed and not yet handed on."""
        return bool(self._incoming) or self._in_transit > 0

    def drained_locked(self) -> bool:
        """The thread has ended with nothing left to hand on."""
        return not self.running and not self._incoming

    @property
    def overflow(self) -> bool:
        """Some records live on disk only and wait for :meth:`load_overflow`."""
        return self._overflow_from is not None

    def pending_locked(self) -> int:
        """Records taken and not yet in the queue (in memory or on disk only)."""
        on_disk = self._spooled_upto - self._overflow_from + 1 if self._overflow_from else 0
        return len(self._incoming) + on_disk

    def undelivered_locked(self) -> int:
        """Records taken and not yet marked done: what the spool keeps for ``otel-rl replay``."""
        taken = len(self._incoming) + self._in_transit  # still in memory: lost at exit
        return max(0, taken + self._spooled_upto - self.spool.acked_upto)

    def spill_locked(self, seq: int | None, *, queue_full: bool, on_full: str) -> bool:
        """Keep ``seq`` on disk only if it cannot join the queue now (or an earlier one could
        not: order is kept). Returns whether it stays on disk."""
        if seq is None or not (self.overflow or (queue_full and on_full == "spool")):
            return False
        if self._overflow_from is None:
            self._overflow_from = seq
            self._warn_once(
                "spilled",
                "%s: tracker is behind by %d records; further records wait on disk only",
                self.name,
                self._queue_size,
            )
        self._stats["spilled"] += 1
        return True

    def forget_overflow_locked(self) -> None:
        """A stopped tracker: the records on disk wait for replay, not for the worker."""
        self._overflow_from = None

    def stop_locked(self) -> None:
        self._stopping = True

    # ---- the spool thread ----------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
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
                self._write(records)
                dirty = True
            now = time.monotonic()
            if dirty and (now - last_sync >= self._fsync_interval or stopping):
                try:
                    self.spool.sync()
                except Exception as exc:
                    self._warn_once("spool-sync", "%s: spool fsync failed: %s", self.name, exc)
                dirty, last_sync = False, now
            if stopping and not records:
                with self._cond:
                    if not self._incoming:
                        try:
                            self.spool.close_writer()
                        except OSError as exc:
                            self._warn_once("spool-close", "%s: spool close: %s", self.name, exc)
                        self.running = False
                        self._cond.notify_all()  # the worker waits for this thread to end
                        return

    def _write(self, records: list[Any]) -> None:
        try:
            seqs: list[int | None] = list(self.spool.append(records))
        except Exception as exc:  # a full disk must not lose the records in memory
            self._warn_once(
                "spool", "%s: cannot write the spool (%s: %s); records are kept in memory only "
                "until the tracker has them", self.name, type(exc).__name__, exc,
            )  # fmt: skip
            seqs = [None] * len(records)
        with self._cond:
            for seq, record in zip(seqs, records, strict=True):
                if _provisional(record):
                    continue
                if seq is None:
                    self._stats["unspooled"] += 1
                self._enqueue(seq, record)
            written = [s for s in seqs if s is not None]
            if written:
                self._spooled_upto = written[-1]
            self._in_transit = 0
            self._cond.notify_all()

    # ---- worker thread -------------------------------------------------------------------------

    def load_overflow(self) -> list[tuple[int, Any]]:
        """Read up to ``queue_size`` records that live only on disk, to go back into the queue."""
        with self._cond:
            start, upto = self._overflow_from, self._spooled_upto
        if start is None:
            return []
        read = self._cursor.read(start, upto, self._queue_size)
        # Nothing readable left in that range (never expected of our own spool): go on live.
        read_upto = read[-1][0] if read else upto
        missing = read_upto - start + 1 - len(read)
        if missing > 0:  # segments deleted or truncated from outside while the run went on
            with self._cond:
                count_loss(self._stats, "spool_vanished", missing)
            self._warn_once(
                "spool-missing",
                "%s: %d spooled record(s) vanished from %s before delivery (deleted from "
                "outside?); they are lost, later records go on",
                self.name, missing, self.spool.dir,
            )  # fmt: skip
        with self._cond:
            self._overflow_from = None if read_upto >= self._spooled_upto else read_upto + 1
        return [(seq, record) for seq, record in read if not _provisional(record)]

    def mark_done(self, upto: int | None) -> None:
        """The tracker holds every record up to ``upto``: mark them (fsynced at most every
        ``fsync_interval``, and at once when ``upto`` is None) and delete finished segments."""
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

    def close(self) -> None:
        try:
            self.spool.close_acks()
        except OSError as exc:
            self._warn_once("spool-close", "%s: cannot close the spool: %s", self.name, exc)

    # ---- fork ----------------------------------------------------------------------------------

    def abandon_after_fork(self) -> None:
        """In a fork child: point the child's copies of the spool's file descriptors at
        ``/dev/null``, so that bytes left in an inherited buffer never reach the parent's files,
        even when the child collects them; then forget everything."""
        import io
        import os

        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for value in self.spool.open_files():
                if isinstance(value, io.IOBase):
                    try:
                        if value.fileno() > 2:
                            os.dup2(null, value.fileno())
                    except (OSError, ValueError):
                        pass
        finally:
            os.close(null)
        self.running = False
        self._incoming.clear()
        self._overflow_from = None
        self._in_transit = 0
