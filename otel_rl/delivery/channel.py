"""A tracker's channel: everything between ``submit`` and the tracker's own write calls.

A :class:`Channel` wraps one tracker by composition; the tracker only writes and inherits no
thread, queue or spool. Three threads meet in a channel, at one bounded queue
(:class:`~otel_rl.delivery.record_queue.RecordQueue`, whose condition variable they all wait
on), each with its own small state:

- the **training thread** calls :meth:`Channel.submit`, which only appends to a deque;
- with a spool folder, the **spool thread** (:class:`SpoolFeeder`) appends what was submitted
  to the tracker's write-ahead log (:class:`~otel_rl.delivery.spool.Spool`: in the kernel at
  once, fsynced every ``fsync_interval``), then moves it to the queue, or, when the queue is full
  and ``on_full="spool"``, leaves it on disk only, to be read back in order once the tracker
  catches up; without a spool, records join the queue at once;
- the **worker thread** (:class:`~otel_rl.delivery.tracker_worker.TrackerWorker`) writes the
  queue in order through a :class:`~otel_rl.delivery.writer.TrackerWriter` and marks records
  done in the spool once the tracker holds them (after its ``flush_backend``): transient errors
  are retried with jittered backoff, a permanent one stops this tracker at once (its records
  stay in the spool).

Neither thread ever dies: anything unexpected is reported once and the loop goes on. A disk that
fails costs only durability: the records still go on from memory. What the channel says at its
end is written in :mod:`otel_rl.delivery.messages`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.core.failures import Failure, count_loss, losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.messages import (
    CLOSE_GRACE,
    SPOOL_GRACE,
    left_behind_message,
    lost_message,
    refused_message,
    replay_hint,
    sent_after_shutdown_message,
    undelivered_message,
)
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.record_queue import Item, RecordQueue, is_checkpoint
from otel_rl.delivery.spool import SeqSet, Spool, read_meta
from otel_rl.delivery.tracker import Tracker
from otel_rl.delivery.tracker_worker import Awaitable, TrackerWorker
from otel_rl.delivery.writer import TrackerWriter
from otel_rl.process.fork_safe_log import log as _log

__all__ = [
    "CLOSE_GRACE", "COUNTERS", "Awaitable", "Channel", "SpoolFeeder", "replay_hint",
]  # fmt: skip

#: The counters every tracker's ``stats`` holds from the start.
COUNTERS = ("submitted", "delivered", "dropped", "rejected", "refused_values", "retries",
            "spilled", "waits", "spool_waits", "backwards_steps", "unspooled")  # fmt: skip


class Channel:
    """The delivery of one tracker: its options and spool, and the three parts that move its
    records (the queue, the spool feeder, the worker); what is left at the end.

    A tracker has at most one channel (:meth:`of`); what the tracker reports through its
    notes (:class:`~otel_rl.delivery.tracker.TrackerNotes`) is counted and said here."""

    def __init__(self, tracker: Tracker, *, given: Mapping[str, Any] | None = None) -> None:
        if isinstance(tracker._notes, ChannelNotes):
            raise RuntimeError(f"{tracker.name}: the tracker is delivered by a channel already")
        self.tracker = tracker
        self.name = tracker.name
        tracker._notes = ChannelNotes(self)
        #: Where :class:`~otel_rl.delivery.fanout.Fanout` sends this tracker's records.
        self.route = self
        # Options given to the tracker itself win over the ones a run attaches.
        self._given = dict(given or {})
        self.options = ExportOptions(**self._given)
        self.spool_dir: Path | None = None
        self.spool_meta: dict[str, Any] = {}
        self.spool: Spool | None = None
        #: Delivery counters: submitted, delivered, rejected, retries, spilled, lost[...], ...
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        #: Records left undelivered by :meth:`shutdown` (in the spool when there is one).
        self.undelivered = 0
        #: Why this tracker's records live in memory only, never in a spool, in its user's
        #: words (set by what builds it); None: a spool is the run's choice (export.spool).
        self.memory_only: str | None = None
        self._warned: set[str] = set()
        self._start_lock = threading.Lock()
        self.started = False
        self._after: Awaitable | None = None
        self._records = RecordQueue(self.name, self.stats, self.warn_once)
        self._feeder = SpoolFeeder(self.name, self._records, self.stats, self.warn_once)
        self._worker = TrackerWorker(
            tracker, self.writer(), self._records, self.stats, self.warn_once, self._feeder
        )
        # The parts' deques, never replaced: the training thread's few lookups, and a view.
        self._queue: deque[Item] = self._records.items
        self._incoming: deque[Any] = self._feeder.incoming

    @classmethod
    def of(cls, tracker: Tracker) -> Channel:
        """The channel that delivers ``tracker``: its own, or a new one."""
        notes = tracker._notes
        return notes.channel if isinstance(notes, ChannelNotes) else cls(tracker)

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
            on_full = options.on_full
            if self.spool_dir is None and on_full == "spool":
                # Never make the training thread wait on a tracker nobody asked to wait for.
                on_full = "drop_oldest"
                self.warn_once(
                    "no-spool", "%s: export.on_full='spool' needs a spool (export.spool: true, "
                    "or an exporter given to a Logger); without one a full queue drops its "
                    "oldest record", self.name,
                )  # fmt: skip
            if self.spool_dir is not None:
                self.spool = Spool(self.spool_dir)
            self._records.configure(
                options.queue_size, on_full, self.tracker.max_batch,
                self.spool_dir, self.spool.last_seq if self.spool is not None else 0,
            )  # fmt: skip
            if self.spool is not None:
                self._feeder.start(self.spool, options.fsync_interval)
            self._worker.start(
                self.spool, after=self._after, opened=self.write_meta,
                fsync_interval=options.fsync_interval,
                retry_max_backoff=options.retry_max_backoff, spooling=self.spool is not None,
            )  # fmt: skip
            self.started = True
            self.write_meta()

    def writer(self) -> TrackerWriter:
        """A writer that calls the tracker on the caller's thread (``otel-rl replay``)."""
        return TrackerWriter(self.tracker, self.stats, self.warn_once)

    @property
    def failure(self) -> Failure | None:
        """The permanent failure that stopped this tracker, if any."""
        return self._worker.failure

    @property
    def last_error(self) -> Failure | None:
        """The last error of any kind (named in the final message when records are left)."""
        return self._worker.last_error

    # ---- training thread ----------------------------------------------------------------------

    def send(self, record: Any, names: Sequence[str] = ()) -> None:
        """Queue ``record`` (``names``: this tracker's, from :class:`~otel_rl.delivery.fanout.
        Fanout`). Returns at once, unless ``on_full="block"`` and the tracker is
        behind, or the spool thread is behind (docs/reliability.md): memory stays bounded and
        the crash promise (nothing older than ``fsync_interval`` lost) holds even when the disk
        cannot keep up with the loop (only at thousands of steps per second)."""
        if not self.started:
            self.start()
        provisional = is_checkpoint(record)
        records, feeder, incoming = self._records, self._feeder, self._incoming
        cond = records.cond
        with cond:
            if records.closed or records.stopping:
                if not provisional:  # a checkpoint is no record of its own: nothing is lost
                    count_loss(self.stats, "after_shutdown")
                    self.warn_once("closed", "%s", sent_after_shutdown_message(self.name))
                return
            if provisional:  # a checkpoint for the spool only
                if feeder.spooling:
                    if not incoming:
                        feeder.incoming_since = time.monotonic()
                    incoming.append(record)
                    cond.notify_all()
                return
            self.stats["submitted"] += 1
            records.idle = False
            while feeder.spooling:
                if incoming and (
                    time.monotonic() - feeder.incoming_since > feeder.fsync_interval / 2
                ):  # the machine is too busy for the spool thread
                    self.stats["spool_waits"] += 1
                elif len(incoming) >= records.size or (
                    records.on_full == "block" and len(incoming) + len(self._queue) >= records.size
                ):
                    self.stats["waits"] += 1
                else:
                    if not incoming:
                        feeder.incoming_since = time.monotonic()
                    incoming.append(record)
                    break
                cond.wait(0.05)
            else:  # no spool, or its thread is gone
                records.put_locked(None, record)
            cond.notify_all()

    submit = send  # the verb of one tracker's delivery (otel_rl.delivery.fanout.Delivery)

    @property
    def pending(self) -> int:
        """Records submitted and not yet delivered (in memory or only on disk)."""
        records = self._records
        with records.cond:
            return len(records.items) + len(self._incoming) + records.on_disk_locked()

    def intake_spooled(self, handed: int) -> int:
        """The delivery process's frame number up to which every record submitted here is in
        the spool (or never will be: no spool, or it failed), given ``handed``, the number of
        the last frame submitted before this call."""
        with self._records.cond:
            return self._feeder.spooled_frame_locked(handed)

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        """Wait until every queued record is written (or the timeout passes)."""
        return self.wait_idle(timeout_millis / 1000)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued record is written; False if ``timeout`` seconds pass first."""
        if not self.started:
            return True
        deadline = time.monotonic() + timeout
        records = self._records
        with records.cond:
            while not records.idle:
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None or not self._worker.alive():
                    return False
                records.cond.wait(left)
        return True

    # ---- shutdown -----------------------------------------------------------------------------

    def shutdown(self, timeout: float, exit_code: int) -> None:
        """Drain within ``timeout`` seconds, close the tracker, and say what was left.

        Past the deadline, two things still get a grace: the spool thread writing what it was
        handed to the spool (``SPOOL_GRACE``: local disk, and a record it has not written is lost
        for good at exit), and the worker ending the write in flight and closing the tracker's
        client (``CLOSE_GRACE``). A worker stuck even then is named and left behind."""
        if not self.started:
            return
        records, feeder, worker = self._records, self._feeder, self._worker
        worker.exit_code = exit_code
        with records.cond:
            if records.closed:
                return
            records.stopping = True
            records.cond.notify_all()
        deadline = time.monotonic() + timeout
        if feeder.spooling:  # the spool thread feeds the worker
            feeder.join(max(0.0, deadline + SPOOL_GRACE - time.monotonic()))
        worker.join(max(0.0, deadline - time.monotonic()))
        with records.cond:
            records.abort = True  # a worker still busy starts no new write from here on
            records.closed = True
            records.cond.notify_all()
        worker.join(max(0.0, deadline + CLOSE_GRACE - time.monotonic()))
        left_behind = worker.alive()
        spool = self.spool
        with records.cond:
            if spool is None:
                left, checkpoints = len(records.items), 0
                count_loss(self.stats, "exit_timeout", left)
            else:  # what the spool keeps for replay (what is still in memory is lost at exit)
                left, checkpoints = feeder.left_locked()
                # and what it could not keep (a full disk): in memory only, lost now
                count_loss(self.stats, "exit_timeout", sum(seq is None for seq, _ in records.items))
        self.undelivered = left
        if spool is not None:
            self.write_meta(exit_code=exit_code)
        _say_end(self, left, checkpoints, timeout, left_behind)

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

    @property
    def lost(self) -> dict[str, int]:
        """Records lost for good, by reason (:mod:`otel_rl.core.failures`)."""
        return losses(self.stats)

    @property
    def resume_config(self) -> dict[str, Any]:
        return self.tracker.resume_config

    @property
    def tracker_class(self) -> type[Tracker]:
        return type(self.tracker)

    def apply(self, setup: Callable[[Any], object]) -> None:
        """Run ``setup(tracker)`` (a drop-in's naming rules for the tracker, before it opens)."""
        setup(self.tracker)

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning("otel-rl: " + message, *args)

    # ---- fork ---------------------------------------------------------------------------------

    def abandon_after_fork(self) -> None:
        """In a fork child: the threads, locks, queue, spool and the tracker's handles are the
        parent's. Drop them without writing anything: the child never writes the parent's spool,
        ``meta.json`` or tracker files, and ignores what it is given. Files the spool and the
        tracker hold (a few levels of objects deep) are pointed at ``/dev/null`` in the child,
        so that an inherited buffer is never flushed into the parent's files, even when the
        child collects them."""
        self._start_lock = threading.Lock()  # a parent thread may have held it at fork
        self.started = True  # nothing starts again in the child
        roots: list[object] = [self.tracker]
        if self.spool is not None:
            roots.extend(self.spool.open_files())
        _silence_files_of(roots)
        self.spool = None
        self.spool_dir = None
        self._records.abandon()
        self._feeder.abandon()
        self._worker.abandoned = True


class ChannelNotes:
    """What a tracker tells its channel (:class:`~otel_rl.delivery.tracker.TrackerNotes`)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        self.channel.warn_once(kind, message, *args)

    def value_refused(self, tracker: str, kind: str, key: str, reason: str) -> None:
        self.channel.stats["refused_values"] += 1
        self.channel.warn_once(f"refused:{kind}:{key}", "%s", refused_message(tracker, kind, key,
                                                                            reason))  # fmt: skip

    def run_named(self) -> None:
        if self.channel.spool_dir is not None:
            self.channel.write_meta()


class SpoolFeeder:
    """The spool thread: what was submitted goes to the write-ahead log, then to the queue.

    Its own state: the records submitted and not yet in the spool (``incoming``, and since when
    the oldest waits), those being written (``in_transit``), whether the thread still takes
    records (``spooling``), the checkpoints in the spool no record supersedes yet, and the
    delivery process's frame number of the last record spooled. All of it is read and changed
    under the queue's condition (the checkpoints: by this thread alone, until it has ended);
    without a spool the thread never starts and ``spooling`` stays False.

    A checkpoint (a pending step's provisional batch) is superseded, as replay judges it, by its
    step's sealed batch (the same ``seal``) anywhere in the spool, or by a newer checkpoint of
    that step: this thread marks it done as soon as the superseding record is spooled, so that
    what waits for replay is counted as replay will deliver it."""

    def __init__(
        self, name: str, records: RecordQueue, stats: dict[str, int],
        warn_once: Callable[..., None],
    ) -> None:  # fmt: skip
        self.name = name
        self._records = records
        self._stats = stats
        self._warn_once = warn_once
        self.incoming: deque[Any] = deque()  # submitted, not yet written to the spool
        self.incoming_since = 0.0  # when the oldest of them arrived
        self.in_transit = 0  # taken by the spool thread, not yet handed on
        self.spooling = False  # the thread takes records (False once it has ended)
        self.fsync_interval = 1.0
        # seal -> seq of the newest checkpoint of a step whose sealed batch is not in the spool
        # (yet): replay delivers it if the step is never sealed, no timeout does.
        self.open_checkpoints: dict[int, int] = {}
        self._sealed = SeqSet()  # the seals of the sealed step batches spooled
        self._frame_spooled = 0  # the delivery process's frame number (Record.intake)
        self._spool: Spool | None = None
        self._thread: threading.Thread | None = None

    def start(self, spool: Spool, fsync_interval: float) -> None:
        self._spool, self.fsync_interval = spool, fsync_interval
        self.spooling = True
        self._thread = threading.Thread(
            target=self._feed_spool, name=f"otel-rl-{self.name}-spool", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def feeding_locked(self) -> bool:
        return self.spooling or bool(self.incoming)

    def holding_locked(self) -> bool:
        return bool(self.incoming) or bool(self.in_transit)

    def spooled_frame_locked(self, handed: int) -> int:
        """See :meth:`Channel.intake_spooled`."""
        return self._frame_spooled if self.incoming or self.in_transit else handed

    def abandon(self) -> None:
        """In a fork child: the thread and the spool are the parent's."""
        self._spool = None
        self.spooling = False
        self.incoming.clear()
        self.in_transit = 0

    def _feed_spool(self) -> None:
        spool, records = self._spool, self._records
        assert spool is not None
        last_sync = time.monotonic()
        dirty = False
        while True:
            with records.cond:
                if not self.incoming and not records.stopping:
                    records.cond.wait(self.fsync_interval if dirty else None)
                taken = list(self.incoming)
                self.incoming.clear()
                self.in_transit = len(taken)
                stopping = records.stopping
            if taken:
                try:
                    seqs: list[int | None] = spool.append(taken)
                except Exception as exc:  # a full disk must not lose the records in memory
                    self._warn_once(
                        "spool", "%s: cannot write the spool (%s: %s); records are kept in "
                        "memory only until the tracker has them", self.name,
                        type(exc).__name__, exc,
                    )  # fmt: skip
                    seqs = [None] * len(taken)
                superseded = self._supersede(seqs, taken)
                if superseded:
                    try:
                        spool.mark_superseded(superseded)
                    except Exception as exc:  # replay passes them over all the same
                        self._warn_once("spool-marks", "%s: cannot mark superseded checkpoints "
                                        "done: %s", self.name, exc)  # fmt: skip
                ready = [
                    (seq, record)
                    for seq, record in zip(seqs, taken, strict=True)
                    if not is_checkpoint(record)
                ]
                written = [seq for seq in seqs if seq is not None]
                with records.cond:
                    self._stats["unspooled"] += sum(seq is None for seq, _ in ready)
                    if records.room_locked(len(ready)):
                        # The usual case: the training thread waits for this lock, keep it short.
                        records.items.extend(ready)
                    else:
                        for seq, record in ready:
                            records.put_locked(seq, record)
                    if written:
                        records.spooled_upto = written[-1]
                    intake = getattr(taken[-1], "intake", None)
                    if intake is not None:
                        self._frame_spooled = intake[1]
                    self.in_transit = 0
                    records.cond.notify_all()
                dirty = True
            now = time.monotonic()
            if dirty and (now - last_sync >= self.fsync_interval or stopping):
                try:
                    spool.sync()
                except Exception as exc:
                    self._warn_once("spool-sync", "%s: spool fsync failed: %s", self.name, exc)
                dirty, last_sync = False, now
            if stopping and not taken:
                with records.cond:
                    if not self.incoming:
                        try:
                            spool.close_writer()
                        except OSError as exc:
                            self._warn_once("spool-close", "%s: spool close: %s", self.name, exc)
                        self.spooling = False
                        records.cond.notify_all()  # the worker waits for this thread to end
                        return


    def _supersede(self, seqs: Sequence[int | None], taken: Sequence[Any]) -> list[int]:
        """The checkpoints in the spool that the records just spooled (``taken``, numbered
        ``seqs``) supersede: the step's sealed batch supersedes its checkpoints, wherever they
        are, and a checkpoint the older ones of its step (a checkpoint spooled after its step's
        sealed batch, as one taken just before the seal may be, is superseded at once)."""
        superseded: list[int] = []
        opened, sealed = self.open_checkpoints, self._sealed
        for seq, record in zip(seqs, taken, strict=True):
            if seq is None or not isinstance(record, StepBatch) or type(record.seal) is not int:
                continue
            seal = record.seal
            if not record.provisional:
                sealed.add(seal)
                older = opened.pop(seal, None)
            elif seal in sealed:
                older = seq
            else:
                older, opened[seal] = opened.get(seal), seq
            if older is not None:
                superseded.append(older)
        if len(opened) > 64:  # steps never sealed here (records sent to other trackers)
            done = self._spool.acked_upto if self._spool is not None else 0
            self.open_checkpoints = {k: v for k, v in opened.items() if v > done}
        return superseded

    def left_locked(self) -> tuple[int, int]:
        """At the channel's end: the records left for replay, counted as replay will deliver
        them (checkpoints a later record superseded are done), those still in memory included
        (lost at exit, unless this thread spools them first); and how many of them are
        checkpoints of a step never sealed in the spool."""
        spool, upto = self._spool, self._records.spooled_upto
        assert spool is not None
        done = spool.acked_upto
        left = max(0, len(self.incoming) + self.in_transit + upto - done
                   - spool.superseded_upto(upto))  # fmt: skip
        checkpoints = sum(1 for seq in list(self.open_checkpoints.values()) if seq > done)
        return left, min(left, checkpoints)


def _say_end(
    channel: Channel, left: int, checkpoints: int, timeout: float, left_behind: bool
) -> None:
    """What a channel says at its end: the records ``left`` in one message (how many, why, and
    where they are, or that they are lost), else a worker ``left_behind``; then the losses
    that message did not say."""
    worker, name = channel._worker, channel.name
    if left:
        message = undelivered_message(
            name, left=left, checkpoints=checkpoints, timeout=timeout,
            run_timeout=channel.options.shutdown_timeout, failure=worker.failure,
            last_error=worker.last_error, spool_dir=channel.spool_dir,
            log_dir=channel.spool_meta.get("log_dir", "<log_dir>"), left_behind=left_behind,
            memory_only=channel.memory_only,
        )  # fmt: skip
        _log.warning("otel-rl: %s", message)
    elif left_behind:
        _log.warning("otel-rl: %s", left_behind_message(name))
    lost = losses(channel.stats)
    if channel.spool is None:  # those the message said are lost
        lost.pop("exit_timeout", None)
    if lost:
        _log.warning("otel-rl: %s", lost_message(name, lost))


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
