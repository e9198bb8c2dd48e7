"""A tracker's bounded record queue: where its spool feeder (or the training thread, without a
spool) and its worker meet (:mod:`otel_rl.delivery.channel` explains the three threads).

The queue owns the condition variable every thread of the channel waits on, and the state they
wait for: the records ready for the worker, how many at its head are being written, and the
channel's lifecycle (stopping, closed, aborted, idle). It applies ``export.on_full`` when full:
``block`` waits (only without a spool: with one, the training thread waits in front of the
spool thread instead), ``drop_oldest`` drops the oldest record not yet being written, ``spool``
leaves records on disk only, from one sequence number on, and reads them back in order through a
:class:`~otel_rl.delivery.spool.SegmentCursor` once the worker has room.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.core.failures import count_loss
from otel_rl.core.records import StepBatch
from otel_rl.delivery.spool import SegmentCursor

__all__ = ["RecordQueue", "is_checkpoint"]

#: A ``(seq, record)`` pair: ``seq`` is the record's number in the spool, None when it is not
#: on disk (no spool, or the spool could not take it).
Item = tuple[int | None, Any]


def is_checkpoint(record: Any) -> bool:
    """A pending step's checkpoint: kept by the spool for a crash, never delivered live."""
    return isinstance(record, StepBatch) and record.provisional


class RecordQueue:
    """The records ready for one tracker's worker, bounded by ``export.queue_size``.

    Every method named ``*_locked`` is called with :attr:`cond` held."""

    def __init__(self, name: str, stats: dict[str, int], warn_once: Callable[..., None]) -> None:
        self.name = name
        self._stats = stats
        self._warn_once = warn_once
        self.cond = threading.Condition()
        self.items: deque[Item] = deque()
        self.inflight = 0  # records at the head being written
        self.size = 1
        self.on_full = "drop_oldest"
        self.max_batch = 1
        # With a spool: the first seq that lives only on disk, the last seq spooled, and the
        # cursor that reads the former back.
        self.overflow_from: int | None = None
        self.spooled_upto = 0
        self._cursor: SegmentCursor | None = None
        self._spool_dir: Path | None = None
        # The channel's lifecycle, read by every thread under the condition.
        self.stopping = False  # shutdown began: no record is taken any more
        self.closed = False  # shutdown's deadline passed
        self.abort = False  # a worker still busy then starts no new write
        self.stopped = False  # a permanent failure: records in the spool wait for replay
        self.idle = True  # nothing submitted is waiting to be written

    def configure(
        self, size: int, on_full: str, max_batch: int, spool_dir: Path | None, spooled_upto: int
    ) -> None:
        """The queue's bounds and policy, and the spool it reads an overflow back from."""
        self.size, self.on_full, self.max_batch = max(1, size), on_full, max(1, max_batch)
        self.spooled_upto = spooled_upto
        if spool_dir is not None:
            self._spool_dir = spool_dir
            self._cursor = SegmentCursor(spool_dir)

    # ---- putting records in (training or spool thread) ----------------------------------------

    def room_locked(self, count: int) -> bool:
        """Whether ``count`` records join at once, with no policy to apply (the usual case)."""
        return (
            not self.stopped and self.overflow_from is None
            and len(self.items) + count <= self.size
        )  # fmt: skip

    def put_locked(self, seq: int | None, record: Any) -> None:
        """Hand a record to the worker, applying ``on_full`` when the queue is full."""
        if self.stopped:  # spooled records wait for replay
            if seq is None:
                count_loss(self._stats, "tracker_stopped")
            return
        full = len(self.items) >= self.size
        if seq is not None and (
            self.overflow_from is not None or (full and self.on_full == "spool")
        ):  # on disk only; once one record waits there, later ones do too (order is kept)
            if self.overflow_from is None:
                self.overflow_from = seq
                self._warn_once(
                    "spilled", "%s: tracker is behind by %d records; further records wait on "
                    "disk only", self.name, self.size,
                )  # fmt: skip
            self._stats["spilled"] += 1
            return
        if full and self.on_full == "block" and self._spool_dir is None:
            while len(self.items) >= self.size and not self.closed:
                self._stats["waits"] += 1
                self.cond.wait()
        elif full:
            count_loss(self._stats, "queue_full")
            self._warn_once(
                "dropped", "%s: queue full (%d records), dropping the oldest; raise "
                "export.queue_size or use export.on_full='spool' or 'block'",
                self.name, self.size,
            )  # fmt: skip
            if self.inflight >= len(self.items):
                return  # every queued record is being written: the new one is the one dropped
            del self.items[self.inflight]  # the oldest record not yet handed to the tracker
        self.items.append((seq, record))

    # ---- taking records out (worker thread) ---------------------------------------------------

    def has_work_locked(self) -> bool:
        return bool(self.items) or self.overflow_from is not None

    def take_locked(self) -> list[Item]:
        """The head of the queue, marked in flight: consecutive step batches (a backlog) up to
        the tracker's ``max_batch``, else one record."""
        first = self.items[0]
        items = [first]
        if isinstance(first[1], StepBatch) and self.max_batch > 1:
            for item in list(self.items)[1 : self.max_batch]:
                if not isinstance(item[1], StepBatch):
                    break
                items.append(item)
        self.inflight = len(items)
        return items

    def done_locked(self, count: int) -> None:
        """The ``count`` records at the head are written (or set aside); none is in flight."""
        for _ in range(count):
            self.items.popleft()
        self.inflight = 0

    def on_disk_locked(self) -> int:
        """Records that live only on disk, waiting to be read back."""
        overflow = self.overflow_from
        return self.spooled_upto - overflow + 1 if overflow is not None else 0

    def load_overflow(self) -> None:
        """Read up to ``size`` records that live only on disk back into the queue (called
        without the condition: the disk is read outside it)."""
        with self.cond:
            start, upto = self.overflow_from, self.spooled_upto
        if start is None or self._cursor is None:
            return
        read = self._cursor.read(start, upto, self.size)
        # Nothing readable left in that range (never expected of our own spool): go on live.
        read_upto = read[-1][0] if read else upto
        missing = read_upto - start + 1 - len(read)
        if missing > 0:  # segments deleted or truncated from outside while the run went on
            with self.cond:
                count_loss(self._stats, "spool_vanished", missing)
            self._warn_once(
                "spool-missing",
                "%s: %d spooled record(s) vanished from %s before delivery (deleted from "
                "outside?); they are lost, later records go on",
                self.name, missing, self._spool_dir,
            )  # fmt: skip
        with self.cond:
            self.overflow_from = None if read_upto >= self.spooled_upto else read_upto + 1
            self.items.extend((seq, record) for seq, record in read if not is_checkpoint(record))
            self.cond.notify_all()

    def park_locked(self) -> None:
        """A stopped tracker: drop what is in memory (it is in the spool, if there is one: else
        it is counted lost) and wake the waiters."""
        if self._spool_dir is None:
            count_loss(self._stats, "tracker_stopped", len(self.items))
        self.overflow_from = None  # the records on disk wait for replay, not for the worker
        self.items.clear()
        self.idle = True
        self.cond.notify_all()

    def abandon(self) -> None:
        """In a fork child: a new condition (a parent thread may have held this one at the
        fork), nothing queued, everything stopped."""
        self.cond = threading.Condition()
        self.items.clear()
        self.inflight = 0
        self.overflow_from = None
        self.stopping = self.abort = self.closed = True
        self.idle = True
