"""A tracker's channel: everything between ``submit`` and the tracker's own write calls.

A :class:`Channel` wraps one tracker by composition; the tracker only writes and inherits no
thread, queue or spool. Three threads meet here, under one condition variable:

- the **training thread** calls :meth:`Channel.submit`, which only appends to a deque;
- with a spool folder, the **spool thread** appends what was submitted to the tracker's
  write-ahead log (:class:`~otel_rl.delivery.spool.Spool`: in the kernel at once, fsynced every
  ``fsync_interval``), then moves it to the worker's queue, or, when the queue is full and
  ``on_full="spool"``, leaves it on disk only, to be read back in order by a
  :class:`~otel_rl.delivery.spool.SegmentCursor` once the tracker catches up; without a spool,
  records join the queue at once;
- the **worker thread** writes the queue in order through a
  :class:`~otel_rl.delivery.writer.TrackerWriter` and marks records done in the spool once the
  tracker holds them (after its ``flush_backend``): transient errors are retried with jittered
  backoff, a permanent one stops this tracker at once (its records stay in the spool).

Neither thread ever dies: anything unexpected is reported once and the loop goes on. A disk that
fails costs only durability: the records still go on from memory.
"""

from __future__ import annotations

import dataclasses
import io
import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from otel_rl.core.failures import Failure, count_loss, describe_losses, losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.spool import SegmentCursor, Spool, read_meta
from otel_rl.delivery.writer import Tracker, TrackerWriter
from otel_rl.process.deadline import SHUTDOWN_GRACE
from otel_rl.process.fork_safe_log import log as _log

__all__ = ["COUNTERS", "Awaitable", "Channel", "Tracker", "replay_hint"]


class Awaitable(Protocol):
    """What a worker waits for before its first write: a relaunch's earlier launches being
    delivered (``wait`` returns whether that is done within ``timeout`` seconds), after which
    ``tracker_run`` names the run a tracker continues when its start did not know it (the
    earlier launch was killed before its tracker opened a run; the delivery opened one)."""

    def wait(self, timeout: float | None = None) -> bool: ...
    def tracker_run(self, tracker: str) -> Mapping[str, Any] | None: ...

#: The counters every tracker's ``stats`` holds from the start.
COUNTERS = ("submitted", "delivered", "dropped", "rejected", "retries", "spilled", "waits",
            "spool_waits", "backwards_steps", "unspooled")  # fmt: skip

#: Seconds past the shutdown deadline for the spool to take what it was handed and for the
#: tracker to close: half the run's grace, so that a tracker left behind is named here, with what
#: it means, and the process still exits within ``shutdown_timeout`` + the grace (the other half
#: is the interpreter's own exit, measured at 0.1-0.3 s on a busy 2-core machine).
CLOSE_GRACE = 0.5 * SHUTDOWN_GRACE


def replay_hint(spool_dir: object, log_dir: object) -> str:
    """The end of a message about records left in a spool: where, and the command."""
    return f" They are in the spool ({spool_dir}); deliver them with: otel-rl replay {log_dir}"


def _provisional(record: Any) -> bool:
    """A pending step's checkpoint: kept by the spool for a crash, never delivered live."""
    return isinstance(record, StepBatch) and record.provisional


class Channel:
    """The delivery of one tracker: its options and spool, the queue, the spool and worker
    threads, and what is left at the end."""

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
        #: Delivery counters: submitted, delivered, rejected, retries, spilled, lost[...], ...
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        #: Records left undelivered by :meth:`shutdown` (in the spool when there is one).
        self.undelivered = 0
        #: The permanent failure that stopped this tracker, if any.
        self.failure: Failure | None = None
        #: The last error of any kind (named in the final message when records are left).
        self.last_error: Failure | None = None
        self._warned: set[str] = set()
        self._one_by_one = batches_one_by_one
        self._writer = self.writer()
        self._start_lock = threading.Lock()
        self.started = False
        self._cond = threading.Condition()
        self._queue: deque[tuple[int | None, Any]] = deque()  # ready for the worker
        self._inflight = 0  # records at the head of the queue being written
        self._stopping = False
        self._abort = False  # shutdown timed out: start no new write
        self._abandoned = False  # a fork child's copy: never touch the tracker
        self._closed = False
        self._idle = True
        self._exit_code = 0
        # The spooled path (set up by start() when there is a spool folder).
        self.spool: Spool | None = None
        self._spooling = False  # the spool thread takes records (False once it has ended)
        self._incoming: deque[Any] = deque()  # submitted, not yet written to the spool
        self._incoming_since = 0.0  # when the oldest of them arrived
        self._in_transit = 0  # taken by the spool thread, not yet handed on
        self._overflow_from: int | None = None  # first seq that lives only on disk
        self._spooled_upto = 0
        # Checkpoints of a step never sealed at the spool's end (the run ended, or the training
        # process was killed, while it was being logged): replay delivers them, no timeout does.
        self._checkpoints_at_end = 0
        self._last_ack_sync = 0.0
        # The delivery process's frame number of the last record spooled (Record.intake).
        self._intake_spooled = 0
        self._after: Awaitable | None = None

    def attach(
        self,
        options: ExportOptions | None,
        spool_dir: str | os.PathLike[str] | None,
        spool_meta: Mapping[str, Any] | None,
        after: Awaitable | None = None,
    ) -> None:
        """The run's ``export.*`` options, spool folder and metadata, before :meth:`start`;
        ``after``: what the worker waits for before its first write."""
        if self.started:
            raise RuntimeError(f"{self.name}: attach() after the exporter started")
        self._after = after
        if options is not None:
            self.options = dataclasses.replace(options, **self._given)
        if spool_dir is not None and self.spool_dir is None:
            self.spool_dir = Path(spool_dir)
            self.spool_meta = dict(spool_meta or {})

    def start(self) -> None:
        """Start the threads once (the first :meth:`submit` does it too)."""
        with self._start_lock:
            if self.started:
                return
            options = self.options
            self._queue_size = max(1, options.queue_size)
            self._on_full = options.on_full
            self._fsync_interval = options.fsync_interval
            self._max_batch = max(1, self.tracker.max_batch)
            if self.spool_dir is None and options.on_full == "spool":
                # Never make the training thread wait on a tracker nobody asked to wait for.
                self._on_full = "drop_oldest"
                self.warn_once(
                    "no-spool", "%s: export.on_full='spool' needs a spool (export.spool: true, "
                    "or an exporter given to a Logger); without one a full queue drops its "
                    "oldest record", self.name,
                )  # fmt: skip
            threads = [threading.Thread(target=self._work, name=f"otel-rl-{self.name}")]
            if self.spool_dir is not None:
                self.spool = Spool(self.spool_dir)
                self._cursor = SegmentCursor(self.spool.dir)
                self._spooled_upto = self.spool.last_seq
                self._spooling = True
                self._spool_thread = threading.Thread(
                    target=self._feed_spool, name=f"otel-rl-{self.name}-spool"
                )
                threads.append(self._spool_thread)
            # The worker waits with a timeout while a spool is fed, to notice the feed's end.
            self._worker_wait = self._fsync_interval if self._spooling else None
            self._worker = threads[0]
            for thread in threads:
                thread.daemon = True
                thread.start()
            self.started = True
            self.write_meta()

    def writer(self) -> TrackerWriter:
        """A writer that calls the tracker on the caller's thread (``otel-rl replay``)."""
        return TrackerWriter(
            self.tracker, self.stats, self.warn_once, batches_one_by_one=self._one_by_one
        )

    # ---- training thread ----------------------------------------------------------------------

    def submit(self, record: Any) -> None:
        """Queue ``record``. Returns at once, unless ``on_full="block"`` and the tracker is
        behind, or the spool thread is behind (docs/reliability.md): memory stays bounded and
        the crash promise (nothing older than ``fsync_interval`` lost) holds even when the disk
        cannot keep up with the loop (only at thousands of steps per second)."""
        if not self.started:
            self.start()
        provisional = _provisional(record)
        with self._cond:
            if self._closed or self._stopping:
                if not provisional:
                    self.warn_once("closed", "%s: record after shutdown ignored", self.name)
                return
            if provisional:  # a checkpoint for the spool only
                if self._spooling:
                    if not self._incoming:
                        self._incoming_since = time.monotonic()
                    self._incoming.append(record)
                    self._cond.notify_all()
                return
            self.stats["submitted"] += 1
            self._idle = False
            while self._spooling:
                if self._incoming and (
                    time.monotonic() - self._incoming_since > self._fsync_interval / 2
                ):  # the machine is too busy for the spool thread
                    self.stats["spool_waits"] += 1
                elif len(self._incoming) >= self._queue_size or (
                    self._on_full == "block"
                    and len(self._incoming) + len(self._queue) >= self._queue_size
                ):
                    self.stats["waits"] += 1
                else:
                    if not self._incoming:
                        self._incoming_since = time.monotonic()
                    self._incoming.append(record)
                    break
                self._cond.wait(0.05)
            else:  # no spool, or its thread is gone
                self._enqueue_locked(None, record)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered (in memory or only on disk)."""
        with self._cond:
            overflow = self._overflow_from
            on_disk = self._spooled_upto - overflow + 1 if overflow is not None else 0
            return len(self._queue) + len(self._incoming) + on_disk

    def intake_spooled(self, handed: int) -> int:
        """The delivery process's frame number up to which every record submitted here is in
        the spool (or never will be: no spool, or it failed), given ``handed``, the number of
        the last frame submitted before this call."""
        with self._cond:
            if self._incoming or self._in_transit:
                return self._intake_spooled
            return handed

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued record is written; False if ``timeout`` seconds pass first."""
        if not self.started:
            return True
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None or not self._worker.is_alive():
                    return False
                self._cond.wait(left)
        return True

    # ---- shutdown -----------------------------------------------------------------------------

    def shutdown(self, timeout: float, exit_code: int) -> None:
        """Drain within ``timeout`` seconds, close the tracker, and say what was left.

        Past the deadline, two things still get up to ``CLOSE_GRACE`` seconds: the spool thread
        writing what it was handed to the spool (local disk, and a record it has not written is
        lost for good at exit), and the worker ending the write in flight and closing the
        tracker's client. A worker stuck even then is named and left behind."""
        if not self.started:
            return
        self._exit_code = exit_code
        with self._cond:
            if self._closed:
                return
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        if self._spooling:  # the spool thread feeds the worker
            self._spool_thread.join(max(0.0, deadline + CLOSE_GRACE - time.monotonic()))
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
            if self.spool is None:
                left = len(self._queue)
                count_loss(self.stats, "exit_timeout", left)
            else:  # what the spool keeps for replay (what is still in memory is lost at exit)
                taken = len(self._incoming) + self._in_transit
                left = max(0, taken + self._spooled_upto - self.spool.acked_upto)
        self.undelivered = left
        if self.spool is not None:
            self.write_meta(exit_code=exit_code)
        if left:
            checkpoints = min(left, self._checkpoints_at_end) if self.spool is not None else 0
            _log.warning("otel-rl: %s", self._undelivered_message(left, checkpoints, timeout))
        lost = losses(self.stats)
        if lost:
            _log.warning(
                "otel-rl: %s: %d record(s) lost for good in this run: %s (docs/reliability.md, "
                "Losses)", self.name, sum(lost.values()), describe_losses(lost),
            )  # fmt: skip

    def write_meta(self, exit_code: int | None = None) -> None:
        """The spool's ``meta.json``: the run, the tracker, and how to reopen its run."""
        spool = self.spool
        if spool is None:
            return
        # Until the tracker opens its run, the run the folder already names stays named there
        # (a relaunch killed or ended before its first write must not hide it from the next).
        resume = self.tracker.resume_config or read_meta(spool.dir).get("resume") or {}
        meta = {**self.spool_meta, "tracker": self.name, "resume": resume}
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

    # ---- the queue (condition held) -----------------------------------------------------------

    def _enqueue_locked(self, seq: int | None, record: Any) -> None:
        """Hand a record to the worker; ``seq`` is None when it is not on disk."""
        if self.failure is not None:  # stopped: spooled records wait for replay
            if seq is None:
                count_loss(self.stats, "tracker_stopped")
            return
        full = len(self._queue) >= self._queue_size
        if seq is not None and (
            self._overflow_from is not None or (full and self._on_full == "spool")
        ):  # on disk only; once one record waits there, later ones do too (order is kept)
            if self._overflow_from is None:
                self._overflow_from = seq
                self.warn_once(
                    "spilled", "%s: tracker is behind by %d records; further records wait on "
                    "disk only", self.name, self._queue_size,
                )  # fmt: skip
            self.stats["spilled"] += 1
            return
        if full and self._on_full == "block" and self.spool is None:
            while len(self._queue) >= self._queue_size and not self._closed:
                self.stats["waits"] += 1
                self._cond.wait()
        elif full:
            count_loss(self.stats, "queue_full")
            self.warn_once(
                "dropped", "%s: queue full (%d records), dropping the oldest; raise "
                "export.queue_size or use export.on_full='spool' or 'block'",
                self.name, self._queue_size,
            )  # fmt: skip
            if self._inflight >= len(self._queue):
                return  # every queued record is being written: the new one is the one dropped
            del self._queue[self._inflight]  # the oldest record not yet handed to the tracker
        self._queue.append((seq, record))

    # ---- the spool thread ---------------------------------------------------------------------

    def _feed_spool(self) -> None:
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
                    seqs: list[int | None] = spool.append(records)
                except Exception as exc:  # a full disk must not lose the records in memory
                    self.warn_once(
                        "spool", "%s: cannot write the spool (%s: %s); records are kept in "
                        "memory only until the tracker has them", self.name,
                        type(exc).__name__, exc,
                    )  # fmt: skip
                    seqs = [None] * len(records)
                ready = [
                    (seq, record)
                    for seq, record in zip(seqs, records, strict=True)
                    if not _provisional(record)
                ]
                written = [seq for seq in seqs if seq is not None]
                with self._cond:
                    self.stats["unspooled"] += sum(seq is None for seq, _ in ready)
                    if (
                        self.failure is None
                        and self._overflow_from is None
                        and len(self._queue) + len(ready) <= self._queue_size
                    ):  # the usual case: the training thread waits for this lock, keep it short
                        self._queue.extend(ready)
                    else:
                        for seq, record in ready:
                            self._enqueue_locked(seq, record)
                    if written:
                        self._spooled_upto = written[-1]
                    intake = getattr(records[-1], "intake", None)
                    if intake is not None:
                        self._intake_spooled = intake[1]
                    for seq, record in zip(seqs, records, strict=True):
                        if seq is not None:
                            self._checkpoints_at_end = (
                                self._checkpoints_at_end + 1 if _provisional(record) else 0
                            )
                    self._in_transit = 0
                    self._cond.notify_all()
                dirty = True
            now = time.monotonic()
            if dirty and (now - last_sync >= self._fsync_interval or stopping):
                try:
                    spool.sync()
                except Exception as exc:
                    self.warn_once("spool-sync", "%s: spool fsync failed: %s", self.name, exc)
                dirty, last_sync = False, now
            if stopping and not records:
                with self._cond:
                    if not self._incoming:
                        try:
                            spool.close_writer()
                        except OSError as exc:
                            self.warn_once("spool-close", "%s: spool close: %s", self.name, exc)
                        self._spooling = False
                        self._cond.notify_all()  # the worker waits for this thread to end
                        return

    # ---- the worker thread --------------------------------------------------------------------

    def _work(self) -> None:
        """Write the queue in order until shutdown; an exception never ends the thread."""
        backoff, pause = 0.0, 0.05
        while True:
            try:
                with self._cond:
                    while not self._has_work_locked():
                        if self._stopping and not (self._spooling or self._incoming):
                            break
                        if not self._idle and not (self._incoming or self._in_transit):
                            self._idle = True
                            self._cond.notify_all()
                        self._cond.wait(self._worker_wait)
                    if not self._has_work_locked() or self._abort:
                        break
                    if self.failure is not None:  # stopped: the records wait in the spool
                        self._park_locked()
                        break
                    items = self._take_locked() if self._queue else None
                if items is None:  # only records on disk are left
                    loaded = self._load_overflow()
                    with self._cond:
                        self._queue.extend(loaded)
                        self._cond.notify_all()
                    continue
                if self._after is not None and not self._waited_for_after():
                    break  # shut down first: this launch's records stay in its spool
                refused = self.stats["rejected"]
                done, failure = 0, self._open_tracker()
                if failure is None:
                    note = self.spool.note_attempt if self.spool is not None else None
                    done, failure = self._writer.write(items, note)
                refused = self.stats["rejected"] - refused  # done, set aside: not delivered
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
                    backoff = pause = 0.0
                    continue
                self.last_error = failure
                if failure.kind == "permanent":
                    self._stop_for(failure)
                    continue
                self.stats["retries"] += 1
                self.warn_once(
                    f"error:{type(failure.error).__name__}",
                    "%s: write failed (%s); retrying with backoff, training continues",
                    self.name, failure.describe(),
                )  # fmt: skip
                backoff = min(max(backoff * 2, 0.05), self.options.retry_max_backoff)
                with self._cond:
                    if self._abort:
                        break
                    # Jitter spreads the retries of many ranks hitting one recovering server.
                    self._cond.wait(backoff * random.uniform(0.5, 1.0))
            except Exception as exc:  # a bug of ours must not silence a tracker for the run
                self.warn_once(
                    f"internal:{type(exc).__name__}",
                    "%s: internal error in the delivery loop (%s: %s); continuing",
                    self.name, type(exc).__name__, exc,
                )  # fmt: skip
                pause = min(max(pause * 2, 0.05), 1.0)
                with self._cond:
                    self._inflight = 0
                    if self._closed:
                        break
                    self._cond.wait(pause)
        self._end_work()

    def _waited_for_after(self) -> bool:
        """Wait for what comes before the first write, until the shutdown's deadline; while
        it lasts, records wait in the spool (``on_full: spool``) or the queue's policy applies."""
        after = self._after
        assert after is not None
        while not after.wait(0.1):
            with self._cond:
                if self._abort:
                    return False
        self._after = None
        run = after.tracker_run(self.name)
        if run is not None and not self._writer.opened:
            self.tracker.continue_run(run)
        return True

    def _open_tracker(self) -> Failure | None:
        if self._writer.opened:
            return None
        failure = self._writer.open()
        if failure is None and self.tracker.resume_config:
            self.write_meta()  # how to reopen the tracker's run, before anything is written
        return failure

    def _has_work_locked(self) -> bool:
        return bool(self._queue) or self._overflow_from is not None

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

    def _load_overflow(self) -> list[tuple[int, Any]]:
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
                count_loss(self.stats, "spool_vanished", missing)
            self.warn_once(
                "spool-missing",
                "%s: %d spooled record(s) vanished from %s before delivery (deleted from "
                "outside?); they are lost, later records go on",
                self.name, missing, self.spool_dir,
            )  # fmt: skip
        with self._cond:
            self._overflow_from = None if read_upto >= self._spooled_upto else read_upto + 1
        return [(seq, record) for seq, record in read if not _provisional(record)]

    def _flush_and_mark_done(self, upto: int | None) -> None:
        """Make the tracker hold what it was given, then mark it done (never the other way):
        marks are fsynced at most every ``fsync_interval``, and at once when ``upto`` is None;
        finished segments are deleted then."""
        failure = self._writer.flush()
        if failure is not None:
            self.last_error = failure
            return
        spool = self.spool
        if spool is None:
            return
        try:
            if upto is not None:
                spool.ack(upto)
            now = time.monotonic()
            if upto is None or now - self._last_ack_sync >= self._fsync_interval:
                spool.sync_acks()
                spool.delete_done_segments()
                self._last_ack_sync = now
        except (OSError, ValueError) as exc:
            self.warn_once("ack", "%s: cannot record deliveries: %s", self.name, exc)

    def _stop_for(self, failure: Failure) -> None:
        self.failure = failure
        where = (
            f"; its records stay in the spool ({self.spool_dir}) for `otel-rl replay` once "
            "fixed" if self.spool is not None else ""
        )
        _log.error("otel-rl: %s stopped: %s%s", self.name, failure.describe(), where)
        with self._cond:
            self._cond.notify_all()

    def _park_locked(self) -> None:
        """A stopped tracker: drop what is in memory (it is in the spool) and wake waiters."""
        if self.spool is None:
            count_loss(self.stats, "tracker_stopped", len(self._queue))
        self._overflow_from = None  # the records on disk wait for replay, not for the worker
        self._queue.clear()
        self._idle = True
        self._cond.notify_all()

    def _end_work(self) -> None:
        self._flush_and_mark_done(None)
        if not self._abandoned:  # after a shutdown timeout too: the run's status is recorded
            self._writer.close(self._exit_code)
        if self.spool is not None and not self._abandoned:
            try:
                self.spool.close_acks()
            except OSError as exc:
                self.warn_once("spool-close", "%s: cannot close the spool: %s", self.name, exc)
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def _undelivered_message(self, left: int, checkpoints: int, timeout: float) -> str:
        # The deadline is the run's export.shutdown_timeout, or the one given to the exporter's
        # own shutdown() (OpenTelemetry's unit, milliseconds: said in that unit).
        run_timeout = self.options.shutdown_timeout
        given = run_timeout is None
        if run_timeout is not None:
            timeout = run_timeout
        failure = self.failure
        error = failure or self.last_error
        sealed = left - checkpoints
        if not sealed:
            text = (
                f"{self.name}: the step still being logged when the run ended was checkpointed "
                f"({checkpoints} checkpoint(s)); no other record is undelivered."
            )
        elif failure is not None:
            text = (
                f"{self.name}: {sealed} record(s) not delivered: the tracker stopped on "
                f"{failure.describe()}."
            )
        elif given:
            text = (
                f"{self.name}: {sealed} record(s) not delivered within the {timeout * 1000:g} ms "
                "given to shutdown() (timeout_millis, or the SDK's timeout keyword: milliseconds, "
                f"as OpenTelemetry's exporters take them; {CLOSE_GRACE:g} s more let the tracker "
                "end its write and close"
            )
            if error is not None:
                text += f"; last error: {error.describe()}"
            text += ")."
        else:
            text = (
                f"{self.name}: {sealed} record(s) not delivered before the shutdown timeout "
                f"(export.shutdown_timeout: {timeout:g} s"
            )
            if error is not None:
                text += f"; last error: {error.describe()}"
            text += (
                "; raise export.shutdown_timeout to deliver more before exit, lower it to wait "
                "less)." if timeout > 0 else
                ": finish() does not wait, so records in flight are counted here too)."
            )  # fmt: skip
        if sealed and checkpoints:
            text += " The step still being logged when the run ended was checkpointed as well."
        if self.spool_dir is not None:
            text += replay_hint(self.spool_dir, self.spool_meta.get("log_dir", "<log_dir>"))
        else:
            text += " There is no spool (export.spool: false): they are lost."
        return text

    # ---- fork ---------------------------------------------------------------------------------

    def abandon_after_fork(self) -> None:
        """In a fork child: the threads, locks, queue, spool and the tracker's handles are the
        parent's. Drop them without writing anything: the child never writes the parent's spool,
        ``meta.json`` or tracker files, and ignores what it is given. Files the spool and the
        tracker hold (a few levels of objects deep) are pointed at ``/dev/null`` in the child,
        so that an inherited buffer is never flushed into the parent's files, even when the
        child collects them."""
        self._start_lock = threading.Lock()  # a parent thread may have held these at fork
        self._cond = threading.Condition()
        self.started = True  # nothing starts again in the child
        roots: list[object] = [self.tracker]
        if self.spool is not None:
            roots.extend(self.spool.open_files())
        _silence_files_of(roots)
        self.spool = None
        self.spool_dir = None
        self._spooling = False
        self._incoming.clear()
        self._overflow_from = None
        self._in_transit = 0
        self._queue.clear()
        self._inflight = 0
        self._stopping = self._abort = self._closed = self._abandoned = True
        self._idle = True


def _silence_files_of(roots: list[object]) -> None:
    std = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        seen: set[int] = set()
        todo: list[tuple[Any, int]] = [(root, 0) for root in roots]
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
