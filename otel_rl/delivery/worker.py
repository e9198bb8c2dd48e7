"""Delivery: how records get from the training thread into one tracker, in order, eventually.

Three parties, one condition variable:

- the **training thread** calls :meth:`Delivery.submit`, which only appends to a deque;
- with a spool directory, a :class:`~otel_rl.delivery.spool_feed.SpoolFeed` writes records to the
  tracker's spool on its own thread before they join the in-memory queue (the spooled path, read
  alone in ``spool_feed.py``); without one, records join the queue at once;
- the **worker thread** writes the queue in order through a
  :class:`~otel_rl.delivery.writer.TrackerWriter` and marks records done once the tracker has them
  (after its ``flush``): transient errors are retried with jittered backoff, a permanent one
  stops this tracker at once (its records stay in the spool).

The worker never dies: anything unexpected is reported once and the loop goes on.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.core.failures import Failure, count_loss
from otel_rl.core.records import StepBatch
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.spool import Spool
from otel_rl.delivery.spool_feed import SpoolFeed
from otel_rl.delivery.writer import TrackerHooks, TrackerWriter
from otel_rl.process.deadline import SHUTDOWN_GRACE
from otel_rl.process.fork_safe_log import log as _log

__all__ = ["COUNTERS", "Delivery", "ExportOptions"]

#: The counters every tracker's ``stats`` holds from the start.
COUNTERS = ("submitted", "delivered", "dropped", "rejected", "retries", "spilled", "waits",
            "spool_waits", "backwards_steps", "unspooled")  # fmt: skip

#: Seconds past the shutdown deadline for the spool to take what it was handed and for the
#: tracker to close: half the run's grace, so that a tracker left behind is named here, with what
#: it means, and the process still exits within ``shutdown_timeout`` + the grace (the other half
#: is the interpreter's own exit, measured at 0.1-0.3 s on a busy 2-core machine).
CLOSE_GRACE = 0.5 * SHUTDOWN_GRACE


class Delivery:
    """The in-memory queue, worker thread and retries of one tracker exporter (and its
    :class:`~otel_rl.delivery.spool_feed.SpoolFeed` when it spools)."""

    def __init__(
        self,
        name: str,
        *,
        hooks: TrackerHooks,
        max_batch: int = 1,
        options: ExportOptions | None = None,
        spool_dir: str | Path | None = None,
        stats: dict[str, int] | None = None,
        warn_once: Callable[..., None],
    ) -> None:
        self.name = name
        self._max_batch = max(1, max_batch)
        options = options or ExportOptions()
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
        self._warn_once = warn_once
        self.stats = stats if stats is not None else {}
        for key in COUNTERS:
            self.stats.setdefault(key, 0)

        self._cond = threading.Condition()
        self._queue: deque[tuple[int | None, Any]] = deque()  # ready for the worker
        self._inflight = 0  # records at the head of the queue being written
        self._stopping = False
        self._abort = False  # shutdown timed out: start no new write
        self._abandoned = False  # a fork child's copy: never touch the tracker
        self._closed = False
        self._idle = True
        #: The permanent failure that stopped this tracker, if any.
        self.failure: Failure | None = None
        #: The last error of any kind (named in the final message when records are left).
        self.last_error: Failure | None = None
        self.exit_code = 0
        self._feed = (
            SpoolFeed(
                name,
                spool_dir,
                cond=self._cond,
                enqueue=self._enqueue_locked,
                queued=self._queue.__len__,
                queue_size=self._queue_size,
                block=self._on_full == "block",
                fsync_interval=options.fsync_interval,
                stats=self.stats,
                warn_once=warn_once,
            )
            if spool_dir is not None
            else None
        )
        # The worker waits with a timeout while a spool is fed, to notice the feed's thread end.
        self._worker_wait = options.fsync_interval if self._feed is not None else None
        self._writer = TrackerWriter(name, hooks, self.stats, warn_once)
        self._worker = threading.Thread(target=self._run, name=f"otel-rl-{name}", daemon=True)
        self._worker.start()
        if self._feed is not None:
            self._feed.start()

    @property
    def spool(self) -> Spool | None:
        """This tracker's spool, if it has one."""
        return self._feed.spool if self._feed is not None else None

    # ---- training thread --------------------------------------------------------------------

    def submit(self, record: Any) -> None:
        provisional = isinstance(record, StepBatch) and record.provisional
        with self._cond:
            if self._closed or self._stopping:
                if not provisional:
                    self._warn_once("closed", "%s: record after shutdown ignored", self.name)
                return
            if provisional:  # a checkpoint for the spool only
                if self._feed is not None:
                    self._feed.checkpoint_locked(record)
                    self._cond.notify_all()
                return
            self.stats["submitted"] += 1
            self._idle = False
            if self._feed is None or not self._feed.admit_locked(record):
                self._enqueue_locked(None, record)  # no spool, or its thread is gone
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered (in memory or only on disk)."""
        with self._cond:
            fed = self._feed.pending_locked() if self._feed is not None else 0
            return len(self._queue) + fed

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None or not self._worker.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout: float, exit_code: int) -> int:
        """Drain within ``timeout`` seconds and close; returns how many records were left.

        Past the deadline, two things still get up to ``CLOSE_GRACE`` seconds: the spool thread
        writing what it was handed to the spool (local disk, and a record it has not written is
        lost for good at exit), and the worker ending the write in flight and closing the
        tracker's client. A worker stuck even then is named and left behind."""
        self.exit_code = exit_code
        with self._cond:
            if self._closed:
                return 0
            self._stopping = True
            if self._feed is not None:
                self._feed.stop_locked()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        if self._feed is not None and self._feed.thread.is_alive():  # it feeds the worker
            self._feed.thread.join(max(0.0, deadline + CLOSE_GRACE - time.monotonic()))
        self._worker.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._abort = True  # a worker still busy starts no new write from here on
            self._closed = True
            self._cond.notify_all()
        self._worker.join(max(0.0, deadline + CLOSE_GRACE - time.monotonic()))
        if self._worker.is_alive():
            _log.warning(
                "otel-rl: %s: the tracker's SDK has not returned from a write or its close "
                "%g s after export.shutdown_timeout; it is left behind (the records it had "
                "not acknowledged stay in the spool)", self.name, CLOSE_GRACE,
            )  # fmt: skip
        with self._cond:
            if self._feed is None:
                count_loss(self.stats, "exit_timeout", len(self._queue))
                return len(self._queue)
            return self._feed.undelivered_locked()

    def _enqueue_locked(self, seq: int | None, record: Any) -> None:
        if self.failure is not None:  # stopped: spooled records wait for replay
            if seq is None:
                count_loss(self.stats, "tracker_stopped")
            return
        full = len(self._queue) >= self._queue_size
        if self._feed is not None and self._feed.spill_locked(
            seq, queue_full=full, on_full=self._on_full
        ):
            return
        if full and self._on_full == "block" and self._feed is None:
            while len(self._queue) >= self._queue_size and not self._closed:
                self.stats["waits"] += 1
                self._cond.wait()
        elif full:
            count_loss(self.stats, "queue_full")
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

    def _has_work_locked(self) -> bool:
        return bool(self._queue) or (self._feed is not None and self._feed.overflow)

    def _work(self) -> None:
        feed = self._feed
        backoff = 0.0
        while True:
            with self._cond:
                while not self._has_work_locked():
                    if self._stopping and (feed is None or feed.drained_locked()):
                        break
                    if not self._idle and not (feed is not None and feed.busy_locked()):
                        self._idle = True
                        self._cond.notify_all()
                    self._cond.wait(self._worker_wait)
                if not self._has_work_locked() or self._abort:
                    break
                if self.failure is not None:  # stopped: the records wait in the spool
                    self._park_locked()
                    break
            if not self._queue:
                assert feed is not None  # only the feed's overflow is left
                loaded = feed.load_overflow()
                with self._cond:
                    self._queue.extend(loaded)
                    self._cond.notify_all()
                continue
            with self._cond:
                items = self._take_locked()
            refused = self.stats.get("rejected", 0)
            done, failure = self._writer.write(
                items, feed.spool.note_attempt if feed is not None else None
            )
            refused = self.stats.get("rejected", 0) - refused  # done, set aside: not delivered
            if done:
                # Marked done right after the tracker holds them: a kill in between is the
                # only way a record is sent twice, and that window is two system calls wide.
                seqs = [seq for seq, _ in items[:done] if seq is not None]
                self._flush_and_mark_done(seqs[-1] if seqs else None)
            with self._cond:
                for _ in range(done):
                    self._queue.popleft()
                self._inflight = 0
                self.stats["delivered"] += done - refused
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
        self._flush_and_mark_done(None)

    def _stop_for(self, failure: Failure) -> None:
        self.failure = failure
        where = (
            f"; its records stay in the spool ({self.spool.dir}) for `otel-rl replay` once "
            "fixed" if self.spool is not None else ""
        )
        _log.error("otel-rl: %s stopped: %s%s", self.name, failure.describe(), where)
        with self._cond:
            self._cond.notify_all()

    def _park_locked(self) -> None:
        """A stopped tracker: drop what is in memory (it is in the spool) and wake waiters."""
        if self._feed is None:
            count_loss(self.stats, "tracker_stopped", len(self._queue))
        else:
            self._feed.forget_overflow_locked()
        self._queue.clear()
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

    def _flush_and_mark_done(self, upto: int | None) -> None:
        """Make the tracker hold what it was given, then mark it done (never the other way)."""
        failure = self._writer.flush()
        if failure is not None:
            self.last_error = failure
            return
        if self._feed is not None:
            self._feed.mark_done(upto)

    def _finish_worker(self) -> None:
        if not self._abandoned:  # after a shutdown timeout too: the run's status is recorded
            self._writer.close(self.exit_code)
        if self._feed is not None:
            self._feed.close()
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def abandon_after_fork(self) -> None:
        """In a fork child: the threads, locks, queue and spool are the parent's. Forget them
        without writing anything and ignore what is submitted from now on."""
        if self._feed is not None:
            self._feed.abandon_after_fork()
        self._feed = None
        self._cond = threading.Condition()  # a parent thread may have held the old one at fork
        self._queue.clear()
        self._inflight = 0
        self._stopping = self._abort = self._closed = self._abandoned = True
        self._idle = True
