"""The training process's end of the delivery process (``export.delivery: process``).

In-process delivery shares the interpreter with the training loop: the trackers' SDK calls,
the spool's encoding and the records held in queues compete for the GIL and are walked by every
full garbage collection, and a loop that never releases the GIL waits for them a switch interval
(5 ms) at a time (docs/performance.md, "The tail"). Here the trackers built from the config run
in a child process instead (``otel_rl.run.service``), with their channels, spools, retries and
exactly-once marks exactly as in-process; this process keeps no delivery thread and no queue of
records. The training thread pickles each record once (a step: its rows, ~4 µs for 100 keys)
and writes the frame to a pipe without blocking. What the pipe cannot take at once waits as
bytes (which the garbage collector never walks) for a pusher thread that writes it while the
training thread goes on; with a spool, what has waited a quarter of ``fsync_interval`` goes to
a handoff file instead (``otel_rl/delivery/link_writer.py``), so a child that is behind never
makes the caller wait. Without a handoff file, the backlog holds at most ``export.queue_size``
records (then ``export.on_full`` applies) and, with a spool, none older than half
``fsync_interval`` (the crash promise: the caller waits); no call waits longer than max(1 s,
2 x ``fsync_interval``), and a child that has not kept up by then is not waited for again until
it has caught up.

A record written to the pipe or a handoff file survives this process: if it is killed, the
child still reads what the pipe holds and then the files, delivers it and closes the trackers
as killed (exit code 137). The child
ignores SIGINT and SIGTERM and runs in a session of its own (a terminal's Ctrl-C reaches only
the training process, which then ends the run); :meth:`ServiceLink.finish` tells it the exit
code and the deadline, and kills it if it is still closing a second after that deadline.

Nothing handed over is lost with the child either. Record frames are numbered; the child spools
each record with its number and says, four times a second, up to which number every spool holds
what it was sent (``intake``). Until then this process keeps each frame the pipe took (bytes,
bounded by the pipe and the child's half second of spooling); a handoff file stays until then
too. When the child is gone before the end of the run (killed at the deadline, or died), the
frames it had not said were spooled, those never sent and every record logged afterwards go to
the launch's leftover file, and ``otel-rl replay`` spools them with the handoff files, each once
(``otel_rl/delivery/handoff.py``).

Frames (``otel_rl/delivery/frames.py``): ``("hello", settings)``, ``("rec", names, pickled
record, number)``, ``("flush", id, seconds)``, ``("end", exit_code, seconds, at)``, ``("setup",
tracker, function)``, ``("handoff", path)`` (read the frames in that file here). The child
answers on a second pipe with JSON lines: ``started`` or ``error`` once, then ``stats`` every
quarter second, ``flushed`` and ``finished``.

The link is in parts, each in a module of its own: :class:`ServiceLink` here is the facade the run
uses (the training thread's ``send``, ``flush``, ``setup``, and what the child has said), and
:class:`ServiceTracker` each tracker's proxy; ``link_state`` holds the one lock, the flags and
the counts per tracker that every part shares; ``link_backlog`` what waits for the pipe and
what is kept until spooled; ``link_writer`` the pusher thread (pipe and handoff files);
``link_status`` the status reader; ``link_handle`` the delivery process's start, end and
leftovers; and ``link_messages`` every word the link says to the user.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.core.failures import losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.channel import COUNTERS
from otel_rl.delivery.frames import encode_frame, record_body
from otel_rl.delivery.link_backlog import Backlog
from otel_rl.delivery.link_handle import DELIVERY_GRACE, DeliveryHandle
from otel_rl.delivery.link_messages import say_sent_after_end, say_unpicklable
from otel_rl.delivery.link_state import LinkState, Pipe
from otel_rl.delivery.link_status import StatusReader
from otel_rl.delivery.link_writer import FrameWriter
from otel_rl.delivery.options import ExportOptions
from otel_rl.process.deadline import Deadline

__all__ = ["DELIVERY_GRACE", "ServiceLink", "ServiceTracker"]


class ServiceLink:
    """One delivery process and the pipes to it, shared by the run's :class:`ServiceTracker`
    proxies (one per tracker it delivers)."""

    def __init__(
        self,
        argv: Sequence[str],
        classes: Sequence[type[Any]],
        settings: Mapping[str, Any],
        options: ExportOptions,
        *,
        handoff_dir: Path | None = None,
    ) -> None:
        self.names = [cls.name for cls in classes]
        self.trackers = [ServiceTracker(self, cls) for cls in classes]
        self._state = state = LinkState(self.names)
        self._backlog = Backlog(state, options, handoff=handoff_dir is not None)
        self._writer = FrameWriter(state, self._backlog, handoff_dir, options.fsync_interval)
        self._status = StatusReader(state, on_intake=self._backlog.let_go)
        self._delivery = DeliveryHandle(argv, settings, state, self._backlog, self._writer,
                                    self._status)  # fmt: skip
        self._numbered = 0  # record frames numbered so far, in the order of the stream
        self._flush_ids = 0
        self._said_after_end = False

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The delivery process (a ``subprocess.Popen``); None before the start, or in a fork
        child."""
        return self._delivery.process

    @property
    def dead(self) -> bool:
        """The child can no longer be written to (gone, or the run ended and the pipe closed)."""
        return self._state.dead

    @property
    def finished(self) -> bool:
        """The child closed its trackers (or is gone): what they left is in their spools."""
        return self._status.finished.is_set()

    @property
    def start_error(self) -> str | None:
        return self._status.start_error

    @property
    def remote_stats(self) -> dict[str, dict[str, int]]:
        """Each tracker's counters in the child, as it last reported them."""
        return self._status.remote_stats

    @property
    def remote_undelivered(self) -> dict[str, int]:
        """Each tracker's records left for replay, known once the child ended (or was gone)."""
        return self._status.remote_undelivered

    @property
    def remote_runs(self) -> dict[str, dict[str, Any]]:
        """Each tracker's run, as its ``resume_config`` names it in the child."""
        return self._status.remote_runs

    @property
    def spool_dirs(self) -> dict[str, Path | None]:
        """Each tracker's spool folder in the child (None: no spool), known once it started."""
        return self._status.spool_dirs

    @property
    def local_stats(self) -> dict[str, dict[str, int]]:
        """Records this process could not hand to the child, by tracker and reason."""
        return self._state.local_stats

    @property
    def backlog(self) -> int:
        """Records waiting for the pipe in this process."""
        return self._backlog.records

    def in_files(self, name: str) -> int:
        """Records for tracker ``name`` that wait in handoff files for ``otel-rl replay``."""
        return self._state.in_files[name]

    def sent(self, name: str) -> int:
        """Records for tracker ``name`` that left this process (into the pipe or a file)."""
        return self._state.sent[name]

    def start(self, timeout: float = 120.0) -> None:
        """Start the child and wait until its trackers are started (their spools taken);
        raise :class:`ConfigError` with the child's reason when they cannot be."""
        self._delivery.start(timeout)

    def send(self, record: Any, names: Sequence[str]) -> None:
        """Hand ``record`` to the child for ``names``, from the training thread. Waits only as
        :meth:`Backlog.make_room_locked` says: when the child has fallen behind (bounded), never
        on a write."""
        state = self._state
        # Checkpoints of a pending step are no records of their own: never counted (they are
        # spooled by the child as records are, which the leftover count takes into account).
        checkpoint = type(record) is StepBatch and record.provisional
        try:
            to = None if len(names) == len(self.names) else tuple(names)
            body = record_body(record)
        except Exception as exc:  # cannot be pickled: costs only this record
            state.count("refused", names)
            say_unpicklable(exc)
            return
        # A tuple of strings, unlike a list, is soon untracked by the garbage collector.
        counted = () if checkpoint else tuple(names)
        backlog, writer = self._backlog, self._writer
        cond = state.cond
        with cond:
            while state.pipe is Pipe.LEAVING:  # the child just died: its leftover file is written
                cond.wait(0.05)
            if state.ended or state.pipe in (Pipe.CLOSED, Pipe.LOST):
                if not state.ended:
                    state.count("delivery_process", names)
                elif not checkpoint:  # the run ended: lost, as with a channel shut down
                    state.count("after_shutdown", names)
                    if not self._said_after_end:
                        self._said_after_end = True
                        say_sent_after_end(names)
                return
            self._numbered += 1
            number = self._numbered
            frame = encode_frame("rec", to, body, number)
            state.accepted_locked(counted)
            if state.pipe is Pipe.TO_FILE:
                self._delivery.keep_in_file([(number, frame, counted)])
                return
            if checkpoint:
                state.checkpoint_handed_locked(names, number)
            if (
                not backlog.entries and not backlog.pushing and not backlog.diverted
                and writer.fits_whole(len(frame))
            ):  # fmt: skip
                try:
                    written = os.write(writer.out, frame)
                except BlockingIOError:
                    written = 0
                except OSError:  # the child is gone: the status reader says so once
                    state.count("delivery_process", names)
                    return
                if written:
                    backlog.kept.add(number, frame, counted)
                if written == len(frame):
                    if not checkpoint:
                        state.sent_locked(names)
                    return
                frame = frame[written:]
                backlog.head_cut = bool(written)  # the pipe holds the first part of this frame
            backlog.add_locked(frame, counted, number)

    def setup(self, name: str, setup: Callable[[Any], object]) -> None:
        """Run ``setup(tracker)`` on tracker ``name`` in the child, before any record sent
        after this call (``setup`` travels by reference: a module-level function)."""
        with self._state.cond:
            self._backlog.queue_control_locked(encode_frame("setup", name, setup))

    def flush(self, timeout: float) -> bool:
        """Wait until the child's trackers hold every record sent so far (or ``timeout`` s)."""
        deadline = Deadline(timeout)
        state, status = self._state, self._status
        with state.cond:
            if state.ended and status.finished.is_set() and not state.killed:
                return True  # the run ended and the child closed the trackers: nothing waits
            self._flush_ids += 1
            flush_id = self._flush_ids
        if not self._backlog.send_control(encode_frame("flush", flush_id, deadline.left()),
                                          deadline):  # fmt: skip
            return False
        with state.cond:
            while flush_id not in status.flushed and not state.dead and deadline.left() > 0:
                state.cond.wait(min(0.05, deadline.left()))
            return status.flushed.pop(flush_id, False)

    def finish(self, deadline: Deadline, exit_code: int) -> None:
        """Tell the child the run ended with ``exit_code``; it delivers what it can by
        ``deadline`` and closes the trackers. Killed if still there a second later."""
        self._delivery.finish(deadline, exit_code)

    def abandon_after_fork(self) -> None:
        """In a fork child: close this process's copies of the pipes (the child then sees the
        end of the records when the training process ends) and forget the parent's process."""
        self._delivery.abandon_after_fork()


class ServiceTracker:
    """A tracker delivered by the delivery process, as the run sees it: its name, counters
    (updated four times a second by the child) and the verbs a run calls."""

    started = True
    failure = None
    tracker = None  # it lives in the delivery process

    def __init__(self, link: ServiceLink, tracker_class: type[Any]) -> None:
        self.link = link
        #: One frame carries a record for all the trackers of the delivery process.
        self.route = link
        self.name: str = tracker_class.name
        #: The class of the tracker in the delivery process (what it supports, e.g. tables).
        self.tracker_class = tracker_class

    @property
    def stats(self) -> dict[str, int]:
        """The child's counters (as last reported) plus what was lost or waited for here."""
        merged = dict.fromkeys(COUNTERS, 0)
        merged.update(self.link.remote_stats[self.name])
        for key, value in self.link.local_stats[self.name].items():
            merged[key] = merged.get(key, 0) + value
        return merged

    @property
    def lost(self) -> dict[str, int]:
        return losses(self.stats)

    @property
    def spool_dir(self) -> Path | None:
        """The tracker's spool folder (the run's checkpoints of a pending step go there too)."""
        return self.link.spool_dirs.get(self.name)

    @property
    def resume_config(self) -> dict[str, Any]:
        """The tracker's run, as its ``resume_config`` names it in the delivery process (e.g.
        ``{"mlflow": {"run_id": ...}}``), known once it opened the run and reported it."""
        return self.link.remote_runs.get(self.name, {})

    @property
    def undelivered(self) -> int:
        """Records left for ``otel-rl replay`` at the end of the run (known once the run ended):
        in the spool, and in handoff files when the delivery process was killed or died."""
        return self.link.remote_undelivered.get(self.name, 0) + self.link.in_files(self.name)

    @property
    def pending(self) -> int:
        """Records not yet delivered: waiting here, in the pipe or a handoff file (sent, not
        yet read by the child, as of its last report), or held by the child; none once the
        child has closed its trackers or exited (what it left is in its spool, or counted
        lost)."""
        process = self.link.process
        if self.link.finished or (process is not None and process.poll() is not None):
            return 0
        remote = self.link.remote_stats[self.name]
        unread = max(0, self.link.sent(self.name) - remote.get("submitted", 0))
        return int(remote.get("pending", 0)) + unread + self.link.backlog

    def submit(self, record: Any) -> None:
        self.link.send(record, (self.name,))

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        return self.link.flush(timeout_millis / 1000)

    def apply(self, setup: Callable[[Any], object]) -> None:
        """Run ``setup(tracker)`` in the delivery process (``setup`` must be a module-level
        function)."""
        self.link.setup(self.name, setup)

    def abandon_after_fork(self) -> None:
        self.link.abandon_after_fork()
