"""Delivery: how records get from the training thread into one tracker, in order, eventually.

Three parties, one lock:

- the **training thread** calls :meth:`Delivery.submit`, which only appends to a deque;
- the **spool thread** (when a spool directory is given) writes records to the tracker's
  write-ahead log, fsyncs it every ``fsync_interval``, and passes them on to the in-memory queue —
  or, when that queue is full and ``on_full="spool"``, leaves them on disk only;
- the **worker thread** opens the tracker, writes records in order (reading back from disk what
  overflowed), retries failures with exponential backoff, and marks what it delivered as done.

Without a spool directory, records go straight to the in-memory queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.records import StepBatch
from otel_rl.spool import Spool, iter_records, segment_paths

_log = logging.getLogger("otel_rl")

ON_FULL = ("spool", "block", "drop_oldest")


class RowRejected(Exception):
    """Raised by a tracker write to drop a record for good (it can never succeed).

    Anything else a write raises is taken as transient and retried.
    """


class Delivery:
    """The queue, threads, retries and spool of one tracker exporter."""

    def __init__(
        self,
        name: str,
        *,
        open: Callable[[], None],
        deliver: Callable[[list[Any]], None],
        flush: Callable[[], None],
        close: Callable[[int], None],
        max_batch: int = 1,
        queue_size: int = 10_000,
        on_full: str = "spool",
        retry_max_backoff: float = 10.0,
        spool_dir: str | Path | None = None,
        fsync_interval: float = 1.0,
        warn_once: Callable[..., None],
    ) -> None:
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}, got {on_full!r}")
        self.name = name
        self._open, self._deliver, self._flush, self._close = open, deliver, flush, close
        self._max_batch = max_batch
        self._queue_size = max(queue_size, max_batch)
        self._on_full = on_full if spool_dir is not None or on_full != "spool" else "drop_oldest"
        self._retry_max_backoff = retry_max_backoff
        self._fsync_interval = fsync_interval
        self._warn_once = warn_once
        self.spool = Spool(spool_dir) if spool_dir is not None else None

        self._cond = threading.Condition()
        self._incoming: deque[Any] = deque()  # submitted, not yet spooled
        self._queue: deque[tuple[int | None, Any]] = deque()  # ready for the worker
        self._overflow_from: int | None = None  # first seq that lives only on disk
        self._spooled_upto = self.spool.last_seq if self.spool else 0
        self._start_seq = self._spooled_upto
        self._inflight = 0
        self._in_transit = 0  # taken by the spool thread, not yet in the queue
        self._spool_running = spool_dir is not None
        self._stopping = False
        self._closed = False
        self._idle = True
        self._opened = False
        self.exit_code = 0
        self.stats = {
            "submitted": 0, "delivered": 0, "dropped": 0, "rejected": 0, "retries": 0,
            "spilled": 0, "waits": 0, "backwards_steps": 0,
        }  # fmt: skip
        self._threads = [threading.Thread(target=self._work, name=f"otel-rl-{name}", daemon=True)]
        if self.spool is not None:
            self._threads.append(
                threading.Thread(target=self._spool_loop, name=f"otel-rl-{name}-spool", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # ---- training thread --------------------------------------------------------------------

    def submit(self, record: Any) -> None:
        with self._cond:
            if self._closed or self._stopping:
                self._warn_once("closed", "%s: record after shutdown ignored", self.name)
                return
            self.stats["submitted"] += 1
            self._idle = False
            if self.spool is not None:
                # Memory stays bounded even when the disk cannot keep up with the loop (only at
                # thousands of steps per second): then the caller waits for the spool thread.
                while self._spool_running and (
                    len(self._incoming) >= self._queue_size
                    or (
                        self._on_full == "block"
                        and len(self._incoming) + len(self._queue) >= self._queue_size
                    )
                ):
                    self.stats["waits"] += 1
                    self._cond.wait(0.05)
                if self._spool_running:
                    self._incoming.append(record)
                else:  # the spool thread is gone: keep delivering from memory
                    self._enqueue_locked(None, record)
            else:
                self._enqueue_locked(None, record)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered (in memory or only on disk)."""
        with self._cond:
            on_disk = (
                self._spooled_upto - self._overflow_from + 1 if self._overflow_from else 0
            )
            return len(self._incoming) + len(self._queue) + on_disk

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or not self._threads[0].is_alive():
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
            self._closed = True
            self._cond.notify_all()
            if self.spool is None:
                return len(self._queue)
            return len(self._incoming) + self._spooled_upto - self.spool.acked_upto

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
                    self._warn_once("spool", "%s: cannot write the spool: %s", self.name, exc)
                    seqs = [None] * len(records)
                dirty = True
                with self._cond:
                    for seq, record in zip(seqs, records, strict=True):
                        self._enqueue_locked(seq, record)
                    if seqs and seqs[-1] is not None:
                        self._spooled_upto = seqs[-1]
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
                        self._spool_running = False
                        self._cond.notify_all()  # the worker waits for this thread to end
                        return

    def _enqueue_locked(self, seq: int | None, record: Any) -> None:
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
                self._cond.wait()
        elif full:
            self._drop_oldest_locked()
        self._queue.append((seq, record))

    def _drop_oldest_locked(self) -> None:
        # Items at the head may be in flight on the worker; drop the oldest one that is not.
        index = min(self._inflight, len(self._queue) - 1)
        del self._queue[index]
        self.stats["dropped"] += 1
        self._warn_once(
            "dropped",
            "%s: queue full (%d records), dropping the oldest; raise export.queue_size or use "
            "export.on_full='spool' or 'block'",
            self.name,
            self._queue_size,
        )

    # ---- worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        backoff = 0.0
        last_ack_sync = time.monotonic()
        while True:
            with self._cond:
                while not self._queue and self._overflow_from is None:
                    if self._stopping and not self._incoming and not self._spool_alive():
                        break
                    if not self._idle and not self._incoming and not self._in_transit:
                        self._settle_locked()  # releases the lock: look again before waiting
                        continue
                    self._cond.wait(self._fsync_interval if self.spool else None)
                if not self._queue and self._overflow_from is None:
                    break
                if self._closed:
                    return
            if not self._queue:
                self._load_overflow()
                continue
            with self._cond:
                items = self._take_locked()
            try:
                if not self._opened:
                    self._open()
                    self._opened = True
                self._deliver_items([record for _, record in items])
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
                for _ in items:
                    self._queue.popleft()
                self._inflight = 0
                self.stats["delivered"] += len(items)
                self._cond.notify_all()
            seq = items[-1][0]
            if self.spool is not None and seq is not None:
                self.spool.ack(seq)
                if time.monotonic() - last_ack_sync >= self._fsync_interval:
                    self._sync_acks()
                    last_ack_sync = time.monotonic()
        self._flush_quietly()
        self._sync_acks()
        if self._opened:
            try:
                self._close(self.exit_code)
            except Exception as exc:
                _log.warning("otel-rl: %s: close failed: %s", self.name, exc)
        if self.spool is not None:
            self.spool.close()
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def _spool_alive(self) -> bool:
        return self._spool_running

    def _settle_locked(self) -> None:
        """Everything handed over is written: flush the tracker and tell waiters."""
        self._cond.release()
        try:
            self._flush_quietly()
            self._sync_acks()
        finally:
            self._cond.acquire()
        if (
            not self._queue
            and not self._incoming
            and not self._in_transit
            and self._overflow_from is None
        ):
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

    def _deliver_items(self, records: list[Any]) -> None:
        records = [r for r in records if r is not None]  # spooled entries that cannot replay
        if not records:
            return
        try:
            self._deliver(records)
        except RowRejected as exc:
            self.stats["rejected"] += len(records)
            self._warn_once(
                f"rejected:{exc}", "%s: record rejected by the tracker, skipped: %s", self.name, exc
            )

    def _load_overflow(self) -> None:
        """Bring up to ``queue_size`` records that live only on disk back into memory."""
        assert self.spool is not None
        with self._cond:
            start, upto = self._overflow_from, self._spooled_upto
        if start is None:
            return
        loaded: list[tuple[int, Any]] = []
        for path in segment_paths(self.spool.dir):
            for seq, record in iter_records(path):
                if start <= seq <= upto:
                    loaded.append((seq, record))
                    if len(loaded) >= self._queue_size:
                        break
            if len(loaded) >= self._queue_size:
                break
        with self._cond:
            for seq, record in loaded:
                self._queue.append((seq, record))
            last = loaded[-1][0] if loaded else upto
            self._overflow_from = None if last >= self._spooled_upto else last + 1
            self._cond.notify_all()

    def _flush_quietly(self) -> None:
        if not self._opened:
            return
        try:
            self._flush()
        except Exception as exc:
            self._warn_once(f"flush:{type(exc).__name__}", "%s: flush failed: %s", self.name, exc)

    def _sync_acks(self) -> None:
        if self.spool is None:
            return
        try:
            self.spool.sync_acks()
        except (OSError, ValueError) as exc:
            self._warn_once("ack", "%s: cannot record deliveries: %s", self.name, exc)
