"""The delivery process's life as the training process sees it: started (its trackers' spools
taken, or the reason they cannot be), told the run's end and deadline, killed a second after
it, and when it is gone before the end of the run, what it may not have spooled written to the
launch's leftover file for ``otel-rl replay`` (``otel_rl/delivery/handoff.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import losses
from otel_rl.delivery import link_messages as say
from otel_rl.delivery.frames import encode_frame
from otel_rl.delivery.handoff import LaunchFiles, claim_folder, release_folder
from otel_rl.delivery.link_backlog import Backlog, Numbered
from otel_rl.delivery.link_state import LinkState, Pipe
from otel_rl.delivery.link_status import StatusReader
from otel_rl.delivery.link_writer import FrameWriter, widen_pipe
from otel_rl.delivery.spool import SpoolEnd, last_seq, spool_end
from otel_rl.process.cores import spare_cores, thread_cores
from otel_rl.process.deadline import SHUTDOWN_GRACE, Deadline

__all__ = ["DELIVERY_GRACE", "DeliveryHandle"]

#: How long after the run's deadline the delivery process still waits for its trackers: past a
#: channel's graces, each counted from the deadline (SPOOL_GRACE for its spool thread, CLOSE_GRACE
#: for its tracker's last words), short of SHUTDOWN_GRACE (its report here).
DELIVERY_GRACE = 0.7 * SHUTDOWN_GRACE


class DeliveryHandle:
    """The training process's handle on one delivery process: its start, its end, and what is
    left when it is gone."""

    def __init__(
        self, argv: Sequence[str], settings: Mapping[str, Any], state: LinkState,
        backlog: Backlog, writer: FrameWriter, status: StatusReader,
    ) -> None:  # fmt: skip
        self._argv = list(argv)
        self._state, self._backlog, self._writer, self._status = state, backlog, writer, status
        self.process: subprocess.Popen[bytes] | None = None
        self._handoff_dir = handoff_dir = writer.handoff_dir
        self._settings = dict(settings)
        self._settings["handoff_dir"] = None if handoff_dir is None else str(handoff_dir)
        # Record frames are numbered in the order of the stream; the child spools them under
        # this launch's token, by which replay knows which of the leftover frames it holds.
        self._token = os.urandom(6).hex()
        self._settings["launch"] = self._token
        self._launch: LaunchFiles | None = None
        self._claimed: tuple[int, str] | None = None  # the handoff folder, for this launch
        self._spooled_from: dict[str, int] = {}  # each spool's last record before the run
        self._ends: dict[str, SpoolEnd] | None = None  # the spools as the child left them

    def start(self, timeout: float) -> None:
        """Start the child and wait until its trackers are started (their spools taken);
        raise :class:`ConfigError` with the child's reason when they cannot be."""
        status = self._status
        # The delivery process keeps off the caller's (the training thread's) core, and so do
        # this end's threads where that leaves them two cores or more: otel_rl/process/cores.py.
        cores = spare_cores()
        self._settings["cores"] = None if cores is None else sorted(cores)
        own_cores = thread_cores(cores)
        records_r, records_w = os.pipe()
        status_r, status_w = os.pipe()
        widen_pipe(records_w)
        try:
            self.process = subprocess.Popen(
                [*self._argv, str(records_r), str(status_w)],
                pass_fds=(records_r, status_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the training process's to handle
            )
        finally:
            os.close(records_r)
            os.close(status_w)
        self._writer.attach(records_w)
        status.start(status_r, own_cores, on_end=self._gone)
        self._writer.start(encode_frame("hello", self._settings), own_cores)
        if not status.started.wait(timeout) or status.start_error is not None:
            reason = status.start_error or say.not_started_in(timeout)
            self._stop_unstarted()
            if status.config_error:  # the same error as with the trackers in this process
                raise ConfigError(reason)
            raise ConfigError(say.start_failed(reason))
        if self._handoff_dir is not None:
            try:
                self._claimed = claim_folder(self._handoff_dir, self._settings["log_dir"])
            except ConfigError:
                self._stop_unstarted()
                raise
        # No record was sent yet: what each spool holds from here on came from this run.
        self._spooled_from = {
            name: last_seq(folder)
            for name, folder in status.spool_dirs.items()
            if folder is not None
        }  # fmt: skip
        if self._handoff_dir is not None:
            try:
                self._launch = LaunchFiles(self._handoff_dir, self._token, status.spool_dirs)
            except OSError as exc:  # the handoff files fail the same way: said there
                say.say_no_handoff_folder(exc)

    def _stop_unstarted(self) -> None:
        """The run does not start: the child is killed, and a Logger() that raises leaves
        nothing running (the status thread hears the end and tells the pusher, which ends)."""
        self._state.killed_here()  # no run was started: its end is no news
        self.kill()
        self._status.finished.wait(DELIVERY_GRACE)
        self._writer.join(DELIVERY_GRACE)
        self._writer.close()  # finish() closes the pipe only for a child that started

    def finish(self, deadline: Deadline, exit_code: int) -> None:
        """Tell the child the run ended with ``exit_code``; it delivers what it can by
        ``deadline`` and closes the trackers. Killed if still there a second later."""
        state, status = self._state, self._status
        with state.cond:
            first = state.end_run_locked()
        if first and not state.dead:
            # The records go first. What this process still holds at the deadline never reached
            # the child: it goes to the leftover file once the child is stopped; the child,
            # without the end frame, closes the run as killed once it has read the rest.
            self._backlog.send_control(
                encode_frame("end", exit_code, deadline.left(), deadline.at), deadline
            )
            with state.cond:
                state.close_pipe_locked()  # the pusher stops within its poll: then it can close
                while self._backlog.pushing:
                    state.cond.wait(0.05)
            self._writer.close_handoff()  # a file never named in the pipe: read at EOF
            self._writer.close()
        # The child gives up DELIVERY_GRACE after the deadline; a little after that, it is killed
        # here and what it never spooled goes to the leftover file, within the run's grace second.
        finished = status.finished.wait(deadline.left() + DELIVERY_GRACE + 0.1)
        if not first:
            return
        if not finished and self.process is not None and self.process.poll() is None:
            state.killed_here()
            # Its spools are read once it is dead: a write it was in the middle of lands first.
            self.kill(wait=DELIVERY_GRACE)
            status.finished.wait(0.1)  # the status thread has read the last report
            kept = self._orphan()
            say.say_killed_at_deadline(state.names, kept)
            self._left_in_spools()
            for name in state.names:
                left = status.remote_undelivered.get(name, 0) + state.in_files[name]
                if left:
                    say.say_left_at_deadline(
                        name, left, state.in_files[name], self._settings["log_dir"],
                        self._settings["shutdown_timeout"], status.spool_dirs[name],
                        self._writer.handoff_dir,
                    )  # fmt: skip
        elif state.pipe is Pipe.TO_FILE:  # the child died during the run: what came since waits
            self._left_in_spools()
        if self._launch is not None:
            self._launch.release()
        release_folder(self._claimed)
        for name in state.names:
            lost = losses(state.local_stats[name])
            if lost:
                say.say_lost_on_the_way(name, lost)
        status.wait_said(deadline.at + 0.95 * SHUTDOWN_GRACE)
        # No thread of the link outlives it: the child, which said it finished, exits now.
        status.join(min(deadline.at + 0.95 * SHUTDOWN_GRACE, time.monotonic() + DELIVERY_GRACE))

    def _gone(self) -> None:
        """The status pipe ended: the child exited (or was killed). Before it started, that is
        why it did not; during the run, what it had not spooled goes to the leftover file."""
        state, status = self._state, self._status
        code = self.process.wait() if self.process is not None else None
        with state.cond:
            # An exit before the run's end (a start refused is none): what it had not spooled
            # goes to the leftover file. Records sent from now on wait for _orphan() to have
            # written it; after a normal end there is none to wait for (they are counted lost).
            early = (
                status.started.is_set() and not state.killed and status.start_error is None
                and (not state.ended or not status.finished.is_set())
            )  # fmt: skip
            state.close_pipe_locked()
            if early:
                state.leaving_locked()
        if not status.started.is_set():
            status.start_error = status.start_error or say.exited_before_starting(code)
            status.started.set()
        elif early:
            kept = self._orphan()
            self._left_in_spools()
            unspooled = 0 if kept else sum(self._unspooled(name) for name in state.names)
            say.say_exited_early(code, state.names, kept, self._writer.handoff_dir, unspooled)

    def _orphan(self) -> bool:
        """The child is gone before the end of the run (killed here, or died): what it may not
        have spooled (the frames the pipe took that it had not said were spooled, those never
        sent) goes to the launch's leftover file, and so does every record sent from now on:
        ``otel-rl replay`` spools them with the handoff files, each once. Counted per tracker
        from the spools themselves (the records handed over, less those each spool gained
        since the start; checkpoints are no records): as waiting in files, or, without a
        leftover file (no spool, or it cannot be written), as lost. True when it was written."""
        state = self._state
        with state.cond:
            state.leaving_locked()
            while self._backlog.pushing:  # the pusher stops within its poll; then no file grows
                state.cond.wait(0.05)
            if state.pipe in (Pipe.TO_FILE, Pipe.LOST):  # written already (or it could not be)
                return state.pipe is Pipe.TO_FILE
            left = self._backlog.take_unspooled_locked()
        self._writer.close_handoff()
        left.sort(key=itemgetter(0))
        kept = self._launch is not None and self._launch.keep(entry[1] for entry in left)
        unread = {name: self._unspooled(name) for name in state.names}  # reads files: unlocked
        with state.cond:
            for name, count in unread.items():
                if kept:
                    state.in_files_locked((name,), count)
                else:
                    state.count("delivery_process", (name,), count)
            state.left_locked(kept)
        return kept

    def keep_in_file(self, entries: list[Numbered]) -> None:
        """Records sent once the child is gone: to the leftover file (or counted lost)."""
        assert self._launch is not None
        state = self._state
        kept = self._launch.keep(entry[1] for entry in entries)
        for _, _, names in entries:
            if kept:
                state.in_files_locked(names)
            else:
                state.not_kept_locked("delivery_process", names)

    def _left_in_spools(self) -> dict[str, int]:
        """The child ended without saying what it left (killed, or died): each spooled
        tracker's records not marked done, read from its spool (its marks and the end of its
        last segment), known from then on as the tracker's ``undelivered``: what replay will
        deliver of it. Returns those with records left.

        Checkpoints are no records: the run seals every step before it ends, so each one is
        superseded by its step's sealed batch, spooled by the child (which marked it done) or
        left in a file for replay to spool first. Those the child had not seen superseded are
        the spool's open checkpoints (at its end) and the ones it never spooled."""
        status = self._status
        left: dict[str, int] = {}
        for name, end in self._spool_ends().items():
            if name in status.remote_undelivered:
                continue
            left[name] = waiting = max(0, end.waiting - end.open_checkpoints)
            if name in self._spooled_from:
                # The child's last report is up to a quarter second old; what it marked done
                # since is in the spool too.
                spooled = end.last_seq - self._spooled_from[name] - self._checkpoints_in(name)
                stats = status.remote_stats[name]
                stats["delivered"] = max(stats.get("delivered", 0), spooled - waiting)
        status.remote_undelivered.update(left)
        return {name: count for name, count in left.items() if count}

    def _unspooled(self, name: str) -> int:
        """Records for tracker ``name`` that the child never spooled (checkpoints not
        counted)."""
        state = self._state
        remote = self._status.remote_stats[name]
        refused = sum(losses(remote).values())  # counted by the child already, never spooled
        end = self._spool_ends().get(name)
        if end is None or name not in self._spooled_from:
            return max(0, state.handed[name] - remote.get("delivered", 0) - refused)
        spooled = end.last_seq - self._spooled_from[name] - self._checkpoints_in(name)
        return max(0, state.handed[name] - spooled - refused)

    def _checkpoints_in(self, name: str) -> int:
        """Checkpoints the child spooled for tracker ``name`` in this run: those handed over,
        but for the ones numbered after the last record its spool holds."""
        end = self._spool_ends()[name]
        spooled = end.last_seq > self._spooled_from[name]
        ours = spooled and end.last_intake is not None and end.last_intake[0] == self._token
        frame = end.last_intake[1] if ours and end.last_intake is not None else 0
        state = self._state
        return state.checkpoints_sent[name] - state.checkpoints_after(name, frame)

    def _spool_ends(self) -> dict[str, SpoolEnd]:
        """Where each spool stands, read once the child is gone (it writes them no more)."""
        if self._ends is None:
            ends: dict[str, SpoolEnd] = {}
            for name, folder in self._status.spool_dirs.items():
                if folder is not None:
                    with contextlib.suppress(OSError):
                        ends[name] = spool_end(folder)
            self._ends = ends
        return self._ends

    def kill(self, wait: float = 0.1) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait)

    def abandon_after_fork(self) -> None:
        """In a fork child: close this process's copies of the pipes (the child then sees the
        end of the records when the training process ends) and forget the parent's process."""
        if self.process is None:
            return  # abandoned already (the link is shared by every tracker it delivers)
        state = self._state
        state.abandon_after_fork()
        self._backlog.entries.clear()
        self._backlog.kept.clear()
        self.process = None
        # The launch's lock and leftover file are the parent's: a copy held here would keep
        # ``otel-rl replay`` off them while this child lives.
        held = self._launch.open_fds() if self._launch is not None else []
        self._launch = None
        # dup2, not close: the status file object closes its descriptor again when collected,
        # and a closed number may by then belong to another file of the child.
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in (self._writer.out, self._status.fileno(), *held):
                with contextlib.suppress(OSError):
                    os.dup2(null, fd)
        finally:
            os.close(null)
