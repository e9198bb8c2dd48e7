"""A tracker's worker thread: the queue's records, in order, into the tracker.

It takes the head of the :class:`~otel_rl.delivery.record_queue.RecordQueue` (a backlog of step
batches: a batch), waits once for what must be delivered first (a relaunch's earlier launches),
opens the tracker, writes through a :class:`~otel_rl.delivery.writer.TrackerWriter`, and marks
the records done in the spool once the tracker holds them (after its ``flush_backend``).
Transient errors are retried with jittered backoff, held as a deadline (:meth:`TrackerWorker.
_rest`: the records that keep arriving meanwhile never bring a retry forward) and never sooner
than the tracker's server asked (``Retry-After``); a permanent one stops the tracker at once
(its records stay in the spool); an error of ours is reported once and the loop goes on: the
thread never dies before its channel's end (:mod:`otel_rl.delivery.channel` explains the three
threads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from otel_rl.core.failures import Failure, retry_wait
from otel_rl.delivery.messages import stopped_message
from otel_rl.delivery.record_queue import RecordQueue
from otel_rl.delivery.spool import Spool
from otel_rl.delivery.tracker import Tracker
from otel_rl.delivery.writer import TrackerWriter
from otel_rl.process.fork_safe_log import log as _log

__all__ = ["Awaitable", "Feed", "TrackerWorker"]


class Awaitable(Protocol):
    """What a worker waits for before its first write: a relaunch's earlier launches being
    delivered (``wait`` returns whether that is done within ``timeout`` seconds), after which
    ``tracker_run`` names the run a tracker continues when its start did not know it (the
    earlier launch was killed before its tracker opened a run; the delivery opened one)."""

    def wait(self, timeout: float | None = None) -> bool: ...
    def tracker_run(self, tracker: str) -> Mapping[str, Any] | None: ...


class Feed(Protocol):
    """What feeds the queue (the spool thread), as the worker sees it, the condition held."""

    def feeding_locked(self) -> bool:
        """Whether records may still arrive (the feed has not ended)."""
        ...

    def holding_locked(self) -> bool:
        """Whether records submitted are on their way to the queue (not idle yet)."""
        ...


class TrackerWorker:
    """The worker thread of one tracker, and what its writes left: the permanent failure that
    stopped it, the last error of any kind."""

    def __init__(
        self,
        tracker: Tracker,
        writer: TrackerWriter,
        records: RecordQueue,
        stats: dict[str, int],
        warn_once: Callable[..., None],
        feed: Feed,
    ) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self._writer = writer
        self._records = records
        self._feed = feed
        self._stats = stats
        self._warn_once = warn_once
        #: The permanent failure that stopped this tracker, if any.
        self.failure: Failure | None = None
        #: The last error of any kind (named in the final message when records are left).
        self.last_error: Failure | None = None
        #: The run's exit code, given to the tracker's ``close``.
        self.exit_code = 0
        self.abandoned = False  # a fork child's copy: never touch the tracker
        self._thread: threading.Thread | None = None
        self._spool: Spool | None = None
        self._after: Awaitable | None = None
        self._opened: Callable[[], None] = lambda: None
        self._fsync_interval = 1.0
        self._retry_max_backoff = 1.0
        self._wait: float | None = None
        self._last_ack_sync = 0.0

    def start(
        self,
        spool: Spool | None,
        *,
        after: Awaitable | None,
        opened: Callable[[], None],
        fsync_interval: float,
        retry_max_backoff: float,
        spooling: bool,
    ) -> None:
        """Start the thread. ``opened`` is called once the tracker has opened its run and
        knows how to reopen it (``resume_config``); ``spooling``: a spool thread feeds the
        queue, and the worker waits with a timeout to notice the feed's end."""
        self._spool, self._after, self._opened = spool, after, opened
        self._fsync_interval, self._retry_max_backoff = fsync_interval, retry_max_backoff
        self._wait = fsync_interval if spooling else None
        self._thread = threading.Thread(target=self._work, name=f"otel-rl-{self.name}")
        self._thread.daemon = True
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------

    def _work(self) -> None:
        """Write the queue in order until shutdown; an exception never ends the thread."""
        records, feed = self._records, self._feed
        backoff, pause = 0.0, 0.05
        stopping = False  # whether the shutdown had begun when the last attempt began
        while True:
            try:
                with records.cond:
                    while not records.has_work_locked():
                        if records.stopping and not feed.feeding_locked():
                            break
                        if not records.idle and not feed.holding_locked():
                            records.idle = True
                            records.cond.notify_all()
                        records.cond.wait(self._wait)
                    if not records.has_work_locked() or records.abort:
                        break
                    if self.failure is not None:  # stopped: the records wait in the spool
                        records.park_locked()
                        break
                    items = records.take_locked() if records.items else None
                    stopping = records.stopping
                if items is None:  # only records on disk are left
                    records.load_overflow()
                    continue
                if self._after is not None and not self._waited_for_after():
                    break  # shut down first: this launch's records stay in its spool
                refused = self._stats["rejected"]
                done, failure = 0, self._open_tracker()
                if failure is None:
                    note = self._spool.note_attempt if self._spool is not None else None
                    done, failure = self._writer.write(items, note)
                refused = self._stats["rejected"] - refused  # done, set aside: not delivered
                if done:
                    # Marked done right after the tracker holds them: a kill in between is the
                    # only way a record is sent twice, and that window is two system calls wide.
                    seqs = [seq for seq, _ in items[:done] if seq is not None]
                    self._flush_and_mark_done(seqs[-1] if seqs else None)
                with records.cond:
                    records.done_locked(done)
                    self._stats["delivered"] += done - refused
                    records.cond.notify_all()
                if failure is None:
                    backoff = pause = 0.0
                    continue
                self.last_error = failure
                if failure.kind == "permanent":
                    self._stop_for(failure)
                    continue
                self._stats["retries"] += 1
                self._warn_once(
                    f"error:{type(failure.error).__name__}",
                    "%s: write failed (%s); retrying with backoff, training continues",
                    self.name, failure.describe(),
                )  # fmt: skip
                backoff = min(max(backoff * 2, 0.05), self._retry_max_backoff)
                wait = retry_wait(backoff, failure, self._retry_max_backoff)
                if not self._rest(time.monotonic() + wait, stopping):
                    break
            except Exception as exc:  # a bug of ours must not silence a tracker for the run
                self._warn_once(
                    f"internal:{type(exc).__name__}",
                    "%s: internal error in the delivery loop (%s: %s); continuing",
                    self.name, type(exc).__name__, exc,
                )  # fmt: skip
                pause = min(max(pause * 2, 0.05), 1.0)
                with records.cond:
                    records.inflight = 0
                    if records.closed:
                        break
                if not self._rest(time.monotonic() + pause, stopping):
                    break
        self._end()

    def _rest(self, until: float, stopping: bool) -> bool:
        """Wait until ``until`` (monotonic) before the next attempt; False once the channel's
        shutdown gave up (abort). A deadline, not a wait for the next notification: every record
        sent notifies the queue's condition, and each would otherwise bring a retry forward, a
        storm at the rate of training on a server that is down or recovering. Records arriving
        meanwhile are queued or spooled by the threads that bring them.

        ``stopping``: whether the shutdown had begun when the attempt that failed began. The
        first attempt after it begins is not held back (a tracker back by then gets its records
        before the deadline); the ones after that are."""
        records = self._records
        with records.cond:
            while not records.abort:
                left = until - time.monotonic()
                if left <= 0 or records.stopping != stopping:
                    return True
                records.cond.wait(left)
        return False

    def _waited_for_after(self) -> bool:
        """Wait for what comes before the first write, until the shutdown's deadline; while
        it lasts, records wait in the spool (``on_full: spool``) or the queue's policy applies."""
        after = self._after
        assert after is not None
        while not after.wait(0.1):
            with self._records.cond:
                if self._records.abort:
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
            self._opened()  # how to reopen the tracker's run, before anything is written
        return failure

    def _flush_and_mark_done(self, upto: int | None) -> None:
        """Make the tracker hold what it was given, then mark it done (never the other way):
        marks are fsynced at most every ``fsync_interval``, and at once when ``upto`` is None;
        finished segments are deleted then."""
        failure = self._writer.flush()
        if failure is not None:
            self.last_error = failure
            return
        spool = self._spool
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
            self._warn_once("ack", "%s: cannot record deliveries: %s", self.name, exc)

    def _stop_for(self, failure: Failure) -> None:
        # Stopped for the queue in the same hold as the failure is recorded, before the error
        # is said: a record handed on meanwhile is counted (tracker_stopped) or left to replay,
        # never parked uncounted behind a slow log handler.
        with self._records.cond:
            self.failure = failure
            self._records.stopped = True
            self._records.cond.notify_all()
        spool_dir = self._spool.dir if self._spool is not None else None
        _log.error("otel-rl: %s", stopped_message(self.name, failure, spool_dir))

    def _end(self) -> None:
        self._flush_and_mark_done(None)
        if not self.abandoned:  # after a shutdown timeout too: the run's status is recorded
            self._writer.close(self.exit_code)
        if self._spool is not None and not self.abandoned:
            try:
                self._spool.close_acks()
            except OSError as exc:
                self._warn_once("spool-close", "%s: cannot close the spool: %s", self.name, exc)
        with self._records.cond:
            self._records.idle = True
            self._records.cond.notify_all()
