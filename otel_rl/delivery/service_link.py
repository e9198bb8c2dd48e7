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
a handoff file instead (see :meth:`ServiceLink._push`), so a child that is behind never makes
the caller wait. Without a handoff file, the backlog holds at most ``export.queue_size``
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
(``otel_rl/delivery/intake.py``).

Frames (``otel_rl/delivery/frames.py``): ``("hello", settings)``, ``("rec", names, pickled
record, number)``, ``("flush", id, seconds)``, ``("end", exit_code, seconds)``, ``("setup",
tracker, function)``, ``("handoff", path)`` (read the frames in that file here). The child
answers on a second pipe with JSON lines: ``started`` or ``error`` once, then ``stats`` every
quarter second, ``flushed`` and ``finished``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import LOSS_REASONS, count_loss, describe_losses, losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.channel import COUNTERS, replay_hint
from otel_rl.delivery.frames import encode_frame, record_body
from otel_rl.delivery.intake import Launch
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.spool import last_seq, private_dirs, waiting_records
from otel_rl.process.cores import keep_to, spare_cores, thread_cores
from otel_rl.process.deadline import SHUTDOWN_GRACE, Deadline
from otel_rl.process.fork_safe_log import log as _log

__all__ = ["CHILD_GRACE", "ServiceLink", "ServiceTracker", "apply_to_tracker"]

_F_SETPIPE_SZ = 1031  # Linux: a 1 MiB pipe holds a few hundred steps before the backlog is used
_F_GETPIPE_SZ = 1032
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PIPE_SIZE = 1 << 20
_IOV_MAX = 512  # buffers per writev (Linux allows 1024)
#: How long after the run's deadline the delivery process still waits for its trackers: past a
#: channel's CLOSE_GRACE (its trackers' last words), short of SHUTDOWN_GRACE (its report here).
CHILD_GRACE = 0.7 * SHUTDOWN_GRACE
# A backlog entry: (frame, the trackers it is for, when it was sent, its number or 0 for a
# control frame).
_FRAME, _TRACKERS, _SENT_AT = itemgetter(0), itemgetter(1), itemgetter(2)
_Buffer = bytes | memoryview
_Entry = tuple[bytes, tuple[str, ...], float, int]
_RELEASE_BATCH = 256  # kept frames let go per hold of the lock


class _Kept:
    """Record frames the pipe took, in the order of the stream, until the child says it has
    spooled them: three deques side by side, so that keeping a frame creates no object the
    garbage collector tracks (more of those bring its full collections, which stop the
    training thread, sooner). Used under the link's lock."""

    __slots__ = ("frames", "names", "numbers")

    def __init__(self) -> None:
        self.numbers: deque[int] = deque()
        self.frames: deque[bytes] = deque()
        self.names: deque[tuple[str, ...]] = deque()

    def add(self, number: int, frame: bytes, names: tuple[str, ...]) -> None:
        self.numbers.append(number)
        self.frames.append(frame)
        self.names.append(names)

    def release(self, upto: int, most: int) -> bool:
        """Let go of up to ``most`` frames numbered ``upto`` or less; True if more are left."""
        numbers = self.numbers
        for _ in range(most):
            if not numbers or numbers[0] > upto:
                return False
            numbers.popleft()
            self.frames.popleft()
            self.names.popleft()
        return bool(numbers) and numbers[0] <= upto

    def after(self, number: int) -> list[tuple[int, bytes, tuple[str, ...]]]:
        return [kept for kept in zip(self.numbers, self.frames, self.names, strict=True)
                if kept[0] > number]  # fmt: skip

    def clear(self) -> None:
        self.numbers.clear()
        self.frames.clear()
        self.names.clear()


def _atomic_run(frames: deque[_Buffer]) -> list[_Buffer]:
    """The first frames, up to ``PIPE_BUF`` bytes in all (or the first alone): a pipe takes
    such a write whole or not at all, so it never ends inside a frame when the frames after
    it go to a handoff file. Only a frame larger than that can be cut by a full pipe; the
    handoff then waits until the pipe has taken the rest of it."""
    run: list[_Buffer] = []
    size = 0
    for frame in itertools.islice(frames, _IOV_MAX):
        size += len(frame)
        if run and size > select.PIPE_BUF:
            break
        run.append(frame)
    return run


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
        self._argv = list(argv)
        self.names = [cls.name for cls in classes]
        self._settings = dict(settings)
        self._options = options
        self.trackers = [ServiceTracker(self, cls) for cls in classes]
        self.process: subprocess.Popen[bytes] | None = None
        self._out = -1  # the write end of the records pipe
        self._status: Any = None  # the read end of the status pipe
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Frames the pipe has not taken yet: (frame, trackers, when it was sent).
        self._backlog: deque[tuple[bytes, tuple[str, ...], float, int]] = deque()
        self._backlog_records = 0
        self._pushing = False
        self._pushing_since = 0.0  # when the oldest frame the pusher holds was sent
        # The crash promise of a spool (nothing older than fsync_interval lost to a kill) holds
        # for frames this process still holds, too. Frames the pipe has not taken after a
        # quarter of it go to a handoff file (local disk, which survives this process); past
        # half of it (the file cannot be written), the caller waits.
        self._handoff_dir = handoff_dir
        self._settings["handoff_dir"] = None if handoff_dir is None else str(handoff_dir)
        self._lag_limit = options.fsync_interval / 2 if handoff_dir is not None else None
        self._handoff_after = options.fsync_interval / 4
        self._handoff: tuple[Path, int] | None = None  # the file being written, and its fd
        self._handoffs = 0
        self._diverted = False  # frames go to the handoff file until the pipe has its name
        self._head_cut = False  # the backlog's first frame is the rest of one the pipe took part of
        self._patience = max(1.0, 2 * options.fsync_interval)
        self._unresponsive = False
        # Record frames are numbered in the order of the stream; those the pipe took are kept
        # until the child says every spool holds them (see the module's docstring).
        self._token = os.urandom(6).hex()
        self._settings["launch"] = self._token
        self._numbered = 0
        self._kept = _Kept()
        self._spooled_through = 0  # the child's last word: every frame up to it is spooled
        self._stranded: list[_Entry] = []  # taken by the pusher, never written anywhere
        self._taken: list[_Entry | None] = []  # the pipe took them in the pusher's round
        self._launch: Launch | None = None
        self._orphaned = False  # the child is gone: records go to the leftover file
        self._orphaning = False
        #: Records accepted for each tracker (checkpoints not counted), sent or not.
        self._handed: dict[str, int] = dict.fromkeys(self.names, 0)
        #: Records for each tracker waiting in files for ``otel-rl replay`` (never spooled).
        self._in_files: dict[str, int] = dict.fromkeys(self.names, 0)
        #: Records written whole to the pipe, by tracker (checkpoints not counted).
        self._sent: dict[str, int] = dict.fromkeys(self.names, 0)
        self._checkpoints_sent: dict[str, int] = dict.fromkeys(self.names, 0)
        self._spooled_from: dict[str, int] = {}  # each spool's last record before the run
        self._cores: frozenset[int] | None = None  # where this end's threads run
        self._killed = False
        self._unread_lost = False  # what the child never read is counted (once)
        self.dead = False
        self._ended = False
        self._events: dict[str, threading.Event] = {
            "started": threading.Event(), "finished": threading.Event()
        }  # fmt: skip
        self._flushed: dict[int, bool] = {}
        self._flush_ids = 0
        self.start_error: str | None = None
        self._config_error = False
        # The child's log lines, heard by the status thread and said by a thread of their own.
        self._lines: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._lines_heard = self._lines_said = 0
        self._saying: threading.Thread | None = None
        self.remote_stats: dict[str, dict[str, int]] = {name: {} for name in self.names}
        self.remote_undelivered: dict[str, int] = {}
        self.remote_runs: dict[str, dict[str, Any]] = {}  # each tracker's resume_config
        #: Each tracker's spool folder in the child (None: no spool), known once it started.
        self.spool_dirs: dict[str, Path | None] = {}
        #: Records this process could not hand to the child, by tracker and reason.
        self.local_stats: dict[str, dict[str, int]] = {name: {} for name in self.names}

    @property
    def backlog(self) -> int:
        """Records waiting for the pipe in this process."""
        return self._backlog_records

    def in_files(self, name: str) -> int:
        """Records for tracker ``name`` that wait in handoff files for ``otel-rl replay``."""
        return self._in_files[name]

    def sent(self, name: str) -> int:
        """Records for tracker ``name`` that left this process (into the pipe or a file)."""
        return self._sent[name]

    # ---- start ---------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Start the child and wait until its trackers are started (their spools taken);
        raise :class:`ConfigError` with the child's reason when they cannot be."""
        # The delivery process keeps off the caller's (the training thread's) core, and so do
        # this end's threads where that leaves them two cores or more: otel_rl/process/cores.py.
        cores = spare_cores()
        self._settings["cores"] = None if cores is None else sorted(cores)
        self._cores = thread_cores(cores)
        records_r, records_w = os.pipe()
        status_r, status_w = os.pipe()
        with contextlib.suppress(OSError):  # a smaller pipe only brings the backlog in sooner
            fcntl.fcntl(records_w, _F_SETPIPE_SZ, _PIPE_SIZE)
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
        self._out = records_w
        try:
            self._pipe_pages = fcntl.fcntl(records_w, _F_GETPIPE_SZ) // _PAGE
        except OSError:
            self._pipe_pages = 16  # Linux's default pipe: 64 KiB
        self._status = os.fdopen(status_r, "rb")
        threading.Thread(target=self._read_status, name="otel-rl-delivery-status",
                         daemon=True).start()  # fmt: skip
        os.write(self._out, encode_frame("hello", self._settings))  # before any record: blocking
        os.set_blocking(self._out, False)
        threading.Thread(target=self._push, name="otel-rl-delivery-pipe", daemon=True).start()
        if not self._events["started"].wait(timeout) or self.start_error is not None:
            reason = self.start_error or f"it did not start within {timeout:g} s"
            self._killed = True  # no run was started: its end is no news
            self._kill()
            if self._config_error:  # the same error as with the trackers in this process
                raise ConfigError(reason)
            raise ConfigError(f"the delivery process (export.delivery: process) failed: {reason}")
        # No record was sent yet: what each spool holds from here on came from this run.
        self._spooled_from = {
            name: last_seq(folder) for name, folder in self.spool_dirs.items() if folder is not None
        }
        if self._handoff_dir is not None:
            try:
                self._launch = Launch(self._handoff_dir, self._token, self.spool_dirs)
            except OSError as exc:  # the handoff files fail the same way: said there
                _log.warning("otel-rl: the delivery process's handoff folder cannot be written "
                             "(%s); what it has not spooled if it is killed is lost", exc)

    # ---- the training thread -------------------------------------------------------------------

    def send(self, record: Any, names: Sequence[str]) -> None:
        """Hand ``record`` to the child for ``names``. Waits only as :meth:`_make_room_locked`
        says: when the child has fallen behind (bounded), never on a write."""
        if type(record) is StepBatch and record.provisional:
            for name in names:  # spooled by the child as records are: see _orphan
                self._checkpoints_sent[name] += 1
        try:
            to = None if len(names) == len(self.names) else tuple(names)
            body = record_body(record)
        except Exception as exc:  # cannot be pickled: costs only this record
            self._count("refused", names)
            _log.warning("otel-rl: a record cannot reach the delivery process (%s: %s); "
                         "it is dropped", type(exc).__name__, exc)  # fmt: skip
            return
        # Checkpoints of a pending step are no records of their own: never counted.
        # A tuple of strings, unlike a list, is soon untracked by the garbage collector.
        counted = () if type(record) is StepBatch and record.provisional else tuple(names)
        with self._cond:
            while self._orphaning:  # the child just died: its leftover file is being written
                self._cond.wait(0.05)
            if self._ended or (self.dead and not self._orphaned):
                self._count("delivery_process", names)
                return
            self._numbered += 1
            number = self._numbered
            frame = encode_frame("rec", to, body, number)
            for name in counted:
                self._handed[name] += 1
            if self._orphaned:
                self._keep_in_file([(number, frame, counted)])
                return
            if (
                not self._backlog and not self._pushing and not self._diverted
                and self._fits_whole(len(frame))
            ):  # fmt: skip
                try:
                    written = os.write(self._out, frame)
                except BlockingIOError:
                    written = 0
                except OSError:  # the child is gone: the status reader says so once
                    self._count("delivery_process", names)
                    return
                if written:
                    self._kept.add(number, frame, counted)
                if written == len(frame):
                    self._note_sent(record, names)
                    return
                frame = frame[written:]
                self._head_cut = bool(written)  # the pipe holds the first part of this frame
            self._make_room_locked()
            self._backlog.append((frame, counted, time.monotonic(), number))
            self._backlog_records += bool(counted)
            self._cond.notify_all()

    def _note_sent(self, record: Any, names: Iterable[str]) -> None:
        if not (type(record) is StepBatch and record.provisional):
            for name in names:
                self._sent[name] += 1

    def _make_room_locked(self) -> None:
        """Before a frame joins the backlog: under ``export.queue_size`` records, none older than
        half ``fsync_interval`` (``drop_oldest`` drops instead of waiting for room). When one
        call has waited ``_patience`` seconds, the delivery process is not kept waiting for
        until it has caught up: the caller goes on (one warning), a full backlog drops its
        oldest record, counted, and the crash promise is suspended until then."""
        began = time.monotonic()
        counted = False
        while not self.dead:
            full = self._backlog_records >= self._options.queue_size
            lagging = (
                self._lag_limit is not None
                and not self._unresponsive
                and self._oldest_age_locked() > self._lag_limit
            )
            if not full and not lagging:
                return
            gives_up = self._unresponsive and self._options.on_full != "block"
            if full and (self._options.on_full == "drop_oldest" or gives_up):
                self._drop_oldest_locked()
                return
            if not counted:
                counted = True
                self._count("waits" if full else "spool_waits", self.names)
            if time.monotonic() - began > self._patience and not self._unresponsive:
                self._unresponsive = True
                _log.warning(
                    "otel-rl: the delivery process has not kept up for %.1f s (it reads nothing, "
                    "or less than is logged); until it has caught up, log_metrics no longer "
                    "waits for it: up to export.queue_size records wait here, older ones are "
                    "dropped and counted (queue_full)", self._patience,
                )  # fmt: skip
                continue
            self._cond.wait(0.05)

    def _drop_oldest_locked(self) -> None:
        # The first frame may be half written already: the oldest record after it goes.
        oldest = next((i for i, entry in enumerate(self._backlog) if i and entry[1]), None)
        if oldest is not None:
            dropped = self._backlog[oldest][1]
            del self._backlog[oldest]
            self._backlog_records -= 1
            self._count("queue_full", dropped)
            for name in dropped:
                self._handed[name] -= 1

    def _oldest_age_locked(self) -> float:
        oldest = self._backlog[0][2] if self._backlog else float("inf")
        if self._pushing:
            oldest = min(oldest, self._pushing_since)
        return time.monotonic() - oldest

    def _count(self, what: str, names: Iterable[str], n: int = 1) -> None:
        for name in names:
            stats = self.local_stats[name]
            if what in LOSS_REASONS:
                count_loss(stats, what, n)
            else:
                stats[what] = stats.get(what, 0) + n

    # ---- the pusher thread ---------------------------------------------------------------------

    def _push(self) -> None:
        """Write the backlog as the pipe takes it. The frames go out by ``writev`` as they are:
        joining or slicing megabytes would hold the GIL the training thread is waiting for.

        Frames the pipe has not taken a quarter of ``fsync_interval`` after they were sent (the
        child has fallen behind) go to a handoff file instead, in the run's spool folder, and
        so do all the frames after them until the pipe has taken the file's name: the child
        reads the file there, in order, then deletes it. A file whose name never reached the
        pipe (this process was killed) is read when the pipe ends. So the caller does not wait
        for a child that is behind, and a kill loses no more than it would in-process."""
        keep_to(self._cores)
        poller = select.poll()
        poller.register(self._out, select.POLLOUT)
        while True:
            with self._cond:
                while not (self._backlog or self._diverted or self.dead or self._ended):
                    self._cond.wait()
                if self._diverted and not self._backlog and not self.dead:
                    self._cond.wait(0.02)  # for the pipe to take the file's name, or a frame
                if self.dead or not (self._backlog or self._diverted):
                    return
                # A few hundred frames at a time: every step of a round is then short, and
                # none holds the GIL or this lock long while the training thread waits for it.
                backlog = self._backlog
                batch = [backlog.popleft() for _ in range(min(len(backlog), _IOV_MAX))]
                self._backlog_records -= sum(bool(entry[1]) for entry in batch)
                self._pushing_since = batch[0][2] if batch else time.monotonic()
                cut, self._head_cut = self._head_cut, False
                self._pushing = True
            frames: deque[_Buffer] = deque(map(_FRAME, batch))
            times = deque(map(_SENT_AT, batch))
            # What the pipe takes is kept until the child has spooled it; a frame cut by the
            # pipe before this round was kept then.
            keep: deque[_Entry | None] = deque(batch)
            if cut and keep:
                keep[0] = None
            pushed = len(frames)
            try:
                if self._diverted and self._handoff_dir is None:
                    self._announce(poller, wait=True)  # the file failed: the pipe from here on
                if not self._diverted:
                    self._to_pipe(frames, times, keep, poller, cut=cut)
                if frames and not self.dead and self._to_handoff(frames):
                    keep.clear()  # in a file that outlives the child: nothing to keep here
                elif frames and not self.dead:
                    self._announce(poller, wait=True)
                    self._to_pipe(frames, times, keep, poller, handoff=False)
                if self._diverted:
                    self._announce(poller, wait=self._handoff_dir is None)
            except OSError:
                with self._cond:
                    self.dead = True
            pushed -= len(frames)
            taken = Counter(map(_TRACKERS, itertools.islice(batch, pushed)))
            with self._cond:
                for names, count in taken.items():
                    for name in names:
                        self._sent[name] += count
                if frames:  # the child is gone, or the run ended before it took them
                    self._stranded += [entry for entry in keep if entry is not None and entry[3]]
                elif self._unresponsive and not self._backlog:
                    # Caught up with everything: the crash promise holds again from here on.
                    self._unresponsive = False
                    _log.warning("otel-rl: the delivery process has caught up again")
                self._pushing = False
                self._cond.notify_all()

    def _to_pipe(
        self, frames: deque[_Buffer], times: deque[float], keep: deque[_Entry | None],
        poller: Any, *, handoff: bool = True, cut: bool = False,
    ) -> None:  # fmt: skip
        """Write ``frames`` to the pipe; stops at a frame's boundary, leaving the rest in
        ``frames``, when the oldest has waited long enough for the handoff file. ``cut``: the
        first is the rest of a frame the pipe has taken part of. ``keep`` (beside ``frames``):
        the record frames to keep once the pipe has taken their first byte."""
        handoff = handoff and self._handoff_dir is not None
        whole = not cut  # frames[0] is a whole frame, not the rest of one
        try:
            self._to_pipe_keeping(frames, times, keep, poller, handoff, whole)
        finally:
            # Kept once per round, not per write: the lock, taken per write, made this thread
            # wait for the GIL a switch interval at a time while the training thread logs.
            with self._cond:
                for entry in self._taken:
                    if entry is not None and entry[3]:
                        self._kept.add(entry[3], entry[0], entry[1])
            self._taken.clear()

    def _to_pipe_keeping(
        self, frames: deque[_Buffer], times: deque[float], keep: deque[_Entry | None],
        poller: Any, handoff: bool, whole: bool,
    ) -> None:  # fmt: skip
        taken = self._taken
        while frames and not self.dead:
            if handoff and whole and time.monotonic() - times[0] > self._handoff_after:
                return
            poller.poll(20 if handoff else 100)
            if handoff and whole and not self._fits_whole(len(frames[0])):
                time.sleep(0.005)  # a large frame waits for room for all of it, or for the file
                continue
            try:
                written = os.writev(self._out, _atomic_run(frames) if handoff else
                                    list(itertools.islice(frames, _IOV_MAX)))  # fmt: skip
            except BlockingIOError:
                continue
            while written and written >= len(frames[0]):
                written -= len(frames.popleft())
                times.popleft()
                taken.append(keep.popleft())
            whole = not written
            if written:
                frames[0] = memoryview(frames[0])[written:]
                taken.append(keep[0])
                keep[0] = None
            if times:
                self._pushing_since = times[0]

    def _fits_whole(self, size: int) -> bool:
        """Whether the pipe has room for a write of ``size`` bytes. One of ``PIPE_BUF`` bytes or
        less goes whole or not at all; a larger one could go in part, and its rest would then
        wait for the child however far behind it is, with every frame after it (a handoff file
        can start only between frames). The pipe is reckoned in pages as the kernel keeps it,
        each at least half full, so a write that fits by this count goes whole."""
        if size <= select.PIPE_BUF or self._handoff_dir is None:
            return True
        queued: int = struct.unpack("i", fcntl.ioctl(self._out, termios.FIONREAD, b"\0" * 4))[0]
        free_pages = self._pipe_pages - 2 * -(-queued // _PAGE) - 1
        return size <= free_pages * _PAGE

    def _to_handoff(self, frames: deque[_Buffer]) -> bool:
        """Append ``frames`` to the handoff file (opened for the first); False, and nothing
        written, when it cannot be (the handoff is then off for the run, with one warning)."""
        assert self._handoff_dir is not None
        if self._handoff is None:
            self._handoffs += 1
            path = self._handoff_dir / f"handoff-{os.getpid()}-{self._handoffs}.frames"
            try:
                private_dirs(self._handoff_dir)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            except OSError as exc:
                return self._handoff_failed(exc)
            self._handoff = (path, fd)
            with self._cond:
                self._diverted = True
        path, fd = self._handoff
        size = os.fstat(fd).st_size
        left = deque(frames)  # ``frames`` stays whole until all of it is in the file
        try:
            while left:
                written = os.writev(fd, list(itertools.islice(left, _IOV_MAX)))
                while written and written >= len(left[0]):
                    written -= len(left.popleft())
                if written:
                    left[0] = memoryview(left[0])[written:]
        except OSError as exc:  # a full disk: the frames go by the pipe, the file is cut back
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            return self._handoff_failed(exc)
        frames.clear()
        return True

    def _handoff_failed(self, exc: OSError) -> bool:
        _log.warning("otel-rl: the delivery process's handoff file cannot be written (%s); "
                     "log_metrics waits for the delivery process instead", exc)  # fmt: skip
        self._handoff_dir = None
        return False

    def _announce(self, poller: Any, *, wait: bool) -> None:
        """Give the child the handoff file's name (a frame small enough to go whole or not at
        all); the frames after it go by the pipe again. ``wait``: until the pipe takes it."""
        if self._handoff is None:
            return
        frame = encode_frame("handoff", str(self._handoff[0]))
        while not self.dead:
            try:
                os.write(self._out, frame)
            except BlockingIOError:
                if not wait:
                    return
                poller.poll(100)
                continue
            break
        self._close_handoff()
        with self._cond:
            self._diverted = False
            self._cond.notify_all()

    def setup(self, name: str, setup: Callable[[Any], object]) -> None:
        """Run ``setup(tracker)`` on tracker ``name`` in the child, before any record sent
        after this call (``setup`` travels by reference: a module-level function)."""
        with self._cond:
            self._queue_control_locked(encode_frame("setup", name, setup))

    def _queue_control_locked(self, frame: bytes) -> None:
        if not self.dead:
            self._backlog.append((frame, (), time.monotonic(), 0))
            self._cond.notify_all()

    def _send_control(self, frame: bytes, deadline: Deadline) -> bool:
        """Send a control frame after every record sent before it; True once the pipe took it
        (the pusher writes it: one writer, so frames never interleave)."""
        with self._cond:
            if self.dead:
                return False
            self._queue_control_locked(frame)
            while self._holding_locked() and not self.dead and deadline.left() > 0:
                self._cond.wait(min(0.05, deadline.left()))
            return not (self._holding_locked() or self.dead)

    def _holding_locked(self) -> bool:
        """Frames not in the pipe yet: waiting, being written, or in a file not announced."""
        return bool(self._backlog) or self._pushing or self._diverted

    # ---- the status reader thread --------------------------------------------------------------

    def _read_status(self) -> None:
        keep_to(self._cores)
        for line in self._status:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            self._on_status(message)
        code = self.process.wait() if self.process is not None else None
        with self._cond:
            was_ended = self._ended
            self.dead = True
            # Records sent from now on wait for _orphan() to have written the leftover file.
            self._orphaning = self._events["started"].is_set() and not self._killed
            self._cond.notify_all()
        if not self._events["started"].is_set():
            self.start_error = self.start_error or f"it exited with code {code} before starting"
            self._events["started"].set()
        elif not self._killed and (not was_ended or not self._events["finished"].is_set()):
            kept = self._orphan()
            self._left_in_spools()
            if kept:
                _log.error(
                    "otel-rl: the delivery process exited (code %s) before the run ended; the "
                    "records it had not spooled and those for %s from now on wait in %s for "
                    "otel-rl replay, with what it had spooled", code, ", ".join(self.names),
                    self._handoff_dir,
                )  # fmt: skip
            else:
                _log.error(
                    "otel-rl: the delivery process exited (code %s) before the run ended; %d "
                    "record(s) it had not spooled and those for %s from now on are lost "
                    "(counted), what it had spooled waits for otel-rl replay", code,
                    sum(self._unspooled(name) for name in self.names), ", ".join(self.names),
                )  # fmt: skip
        self._events["finished"].set()
        with self._cond:
            self._cond.notify_all()

    def _on_status(self, message: Mapping[str, Any]) -> None:
        if "log" in message:  # the delivery process's own log line, said here by its own thread
            level, text = message["log"]
            self._lines.put((int(level), str(text)))
            self._lines_heard += 1
            if self._saying is None:
                self._saying = threading.Thread(target=self._say_lines, name="otel-rl-delivery-log",
                                                daemon=True)  # fmt: skip
                self._saying.start()
        if "error" in message:
            self.start_error = str(message["error"])
            self._config_error = bool(message.get("config_error"))
            self._events["started"].set()
        if message.get("started"):
            self.spool_dirs = {
                str(name): None if folder is None else Path(folder)
                for name, folder in (message.get("spools") or {}).items()
            }
            self._events["started"].set()
        for name, stats in (message.get("stats") or {}).items():
            if name in self.remote_stats:
                self.remote_stats[name] = {str(k): int(v) for k, v in stats.items()}
        if "intake" in message:
            self._let_go(int(message["intake"]))
        self.remote_runs.update(message.get("runs") or {})
        if "flushed" in message:
            with self._cond:
                self._flushed[int(message["flushed"])] = bool(message.get("ok"))
                self._cond.notify_all()
        if "finished" in message:
            self.remote_undelivered = {str(k): int(v) for k, v in message["finished"].items()}
            self._events["finished"].set()

    def _say_lines(self) -> None:
        """The child's log lines through the ``otel_rl`` logger, on a thread of their own: a
        slow handler of the user's delays the lines, never the counters or the end of the run."""
        keep_to(self._cores)
        while True:
            level, text = self._lines.get()
            _log.log(level, "%s", text)
            self._lines_said += 1

    def _wait_said(self, until: float) -> None:
        while self._lines_said < self._lines_heard and time.monotonic() < until:
            time.sleep(0.01)
        left = self._lines_heard - self._lines_said
        if left:
            sys.stderr.write(
                f"otel-rl: {left} log line(s) of the delivery process were not said by the run's "
                "deadline: a handler of the otel_rl logger is slow\n"
            )

    # ---- flush and finish ----------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait until the child's trackers hold every record sent so far (or ``timeout`` s)."""
        deadline = Deadline(timeout)
        with self._cond:
            if self._ended and self._events["finished"].is_set() and not self._killed:
                return True  # the run ended and the child closed the trackers: nothing waits
            self._flush_ids += 1
            flush_id = self._flush_ids
        if not self._send_control(encode_frame("flush", flush_id, deadline.left()), deadline):
            return False
        with self._cond:
            while flush_id not in self._flushed and not self.dead and deadline.left() > 0:
                self._cond.wait(min(0.05, deadline.left()))
            return self._flushed.pop(flush_id, False)

    def finish(self, deadline: Deadline, exit_code: int) -> None:
        """Tell the child the run ended with ``exit_code``; it delivers what it can by
        ``deadline`` and closes the trackers. Killed if still there a second later."""
        with self._cond:
            if self._ended:
                first = False
            else:
                first, self._ended = True, True
                self._cond.notify_all()
        if first and not self.dead:
            # The records go first. What this process still holds at the deadline never reached
            # the child: it goes to the leftover file once the child is stopped; the child,
            # without the end frame, closes the run as killed once it has read the rest.
            self._send_control(encode_frame("end", exit_code, deadline.left()), deadline)
            with self._cond:
                self.dead = True  # the pusher stops within its poll: then the pipe can close
                self._cond.notify_all()
                while self._pushing:
                    self._cond.wait(0.05)
            self._close_handoff()  # a file never named in the pipe: the child reads it at EOF
            with contextlib.suppress(OSError):
                os.close(self._out)
        # The child gives up CHILD_GRACE after the deadline; a little after that, it is killed
        # here and what it never spooled goes to the leftover file, within the run's grace second.
        finished = self._events["finished"].wait(deadline.left() + CHILD_GRACE + 0.1)
        if not first:
            return
        if not finished and self.process is not None and self.process.poll() is None:
            self._killed = True
            self._kill()
            self._events["finished"].wait(0.1)  # the status thread has read the last report
            kept = self._orphan()
            _log.warning(
                "otel-rl: the delivery process had not ended (closing %s, or stopped) at the "
                "deadline (export.shutdown_timeout); it was killed: %s",
                ", ".join(self.names),
                "what it had not delivered waits for otel-rl replay" if kept else
                "what it had spooled waits for otel-rl replay, what it had not spooled yet is "
                "lost (counted)",
            )  # fmt: skip
            self._left_in_spools()
            cfg = self._settings["cfg"]
            for name in self.names:
                left = self.trackers[self.names.index(name)].undelivered
                if not left:
                    continue
                # What each tracker's channel would have said at its close, had it got there.
                files = self._in_files[name]
                _log.warning(
                    "otel-rl: %s: %d record(s) not delivered before the shutdown timeout "
                    "(export.shutdown_timeout: %g s; the delivery process was killed there).%s",
                    name, left, cfg["export"]["shutdown_timeout"],
                    replay_hint(self.spool_dirs[name], cfg["log_dir"]) if not files else
                    f" {left - files} are in the spool ({self.spool_dirs[name]}), {files} in "
                    f"handoff files ({self._handoff_dir}); deliver them with: otel-rl replay "
                    f"{cfg['log_dir']}",
                )  # fmt: skip
        elif self._orphaned:  # the child died during the run: the records since then wait too
            self._left_in_spools()
        if self._launch is not None:
            self._launch.release()
        for name in self.names:
            lost = losses(self.local_stats[name])
            if lost:
                _log.warning(
                    "otel-rl: %s: %d record(s) lost for good on their way to the delivery "
                    "process's spool: %s (docs/reliability.md, Losses)",
                    name, sum(lost.values()), describe_losses(lost),
                )  # fmt: skip
        self._wait_said(deadline.at + 0.95 * SHUTDOWN_GRACE)

    def _close_handoff(self) -> None:
        if self._handoff is not None:
            with contextlib.suppress(OSError):
                os.close(self._handoff[1])
            self._handoff = None

    def _let_go(self, spooled_through: int) -> None:
        """The child says every spool holds the frames up to ``spooled_through``: they need not
        be kept here any more (a few at a time: the training thread may wait for the lock)."""
        self._spooled_through = max(self._spooled_through, spooled_through)
        more = True
        while more:
            with self._cond:
                more = self._kept.release(spooled_through, _RELEASE_BATCH)

    def _orphan(self) -> bool:
        """The child is gone before the end of the run (killed here, or died): what it may not
        have spooled (the frames the pipe took that it had not said were spooled, those never
        sent) goes to the launch's leftover file, and so does every record sent from now on:
        ``otel-rl replay`` spools them with the handoff files, each once. Counted per tracker
        from the spools themselves (what was handed over, less what each spool gained since
        the start; checkpoints count on both sides): as waiting in files, or, without a
        leftover file (no spool, or it cannot be written), as lost. True when it was written."""
        with self._cond:
            self.dead = self._orphaning = True
            self._cond.notify_all()
            while self._pushing:  # the pusher stops within its poll; then no file grows
                self._cond.wait(0.05)
            if self._orphaned or self._unread_lost:
                self._orphaning = False
                return self._orphaned
            backlog = list(self._backlog)
            if self._head_cut and backlog:  # the rest of a frame kept whole already
                backlog = backlog[1:]
            left = self._kept.after(self._spooled_through)
            left += [(number, bytes(frame), names) for frame, names, _, number in self._stranded]
            left += [(number, bytes(frame), names) for frame, names, _, number in backlog if number]
            self._kept.clear()
            self._stranded = []
            self._backlog.clear()
            self._backlog_records = 0
        self._close_handoff()
        left.sort(key=itemgetter(0))
        kept = self._launch is not None and self._launch.keep(entry[1] for entry in left)
        unread = {name: self._unspooled(name) for name in self.names}  # reads files: unlocked
        with self._cond:
            for name, count in unread.items():
                if kept:
                    self._in_files[name] += count
                else:
                    self._count("delivery_process", (name,), count)
            self._orphaned = kept
            self._unread_lost = not kept
            self._orphaning = False
            self._cond.notify_all()
        return kept

    def _keep_in_file(self, entries: list[tuple[int, bytes, tuple[str, ...]]]) -> None:
        """Records sent once the child is gone: to the leftover file (or counted lost)."""
        assert self._launch is not None
        kept = self._launch.keep(entry[1] for entry in entries)
        for _, _, names in entries:
            for name in names:
                if kept:
                    self._in_files[name] += 1
                else:
                    self._handed[name] -= 1
                    self._count("delivery_process", (name,))

    def _left_in_spools(self) -> dict[str, int]:
        """The child ended without saying what it left (killed, or died): each spooled
        tracker's records not marked done, read from its spool (its marks and the end of its
        last segment), known from then on as the tracker's ``undelivered``. Returns those
        with records left."""
        left: dict[str, int] = {}
        for name, folder in self.spool_dirs.items():
            if folder is None or name in self.remote_undelivered:
                continue
            with contextlib.suppress(OSError):
                left[name] = waiting = waiting_records(folder)
                if name in self._spooled_from:
                    # The child's last report is up to a quarter second old; what it marked done
                    # since is in the spool too (a checkpoint is spooled, never delivered).
                    spooled = last_seq(folder) - self._spooled_from[name]
                    done = spooled - self._checkpoints_sent[name] - waiting
                    stats = self.remote_stats[name]
                    stats["delivered"] = max(stats.get("delivered", 0), done)
        self.remote_undelivered.update(left)
        return {name: count for name, count in left.items() if count}

    def _unspooled(self, name: str) -> int:
        remote = self.remote_stats[name]
        refused = sum(losses(remote).values())  # counted by the child already, never spooled
        folder = self.spool_dirs.get(name)
        if folder is None or name not in self._spooled_from:
            return max(0, self._handed[name] - remote.get("delivered", 0) - refused)
        spooled = last_seq(folder) - self._spooled_from[name]
        return max(0, self._handed[name] + self._checkpoints_sent[name] - spooled - refused)

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(0.1)

    def abandon_after_fork(self) -> None:
        """In a fork child: close this process's copies of the pipes (the child then sees the
        end of the records when the training process ends) and forget the parent's process."""
        if self.process is None:
            return  # abandoned already (the link is shared by every tracker it delivers)
        self.dead = self._ended = True
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._backlog.clear()
        self._kept.clear()
        self.process = None
        # The launch's lock and leftover file are the parent's: a copy held here would keep
        # ``otel-rl replay`` off them while this child lives.
        held = self._launch.open_fds() if self._launch is not None else []
        self._launch = None
        # dup2, not close: the status file object closes its descriptor again when collected,
        # and a closed number may by then belong to another file of the child.
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in (self._out, self._status.fileno(), *held):
                with contextlib.suppress(OSError):
                    os.dup2(null, fd)
        finally:
            os.close(null)


class ServiceTracker:
    """A tracker delivered by the delivery process, as the run sees it: its name, counters
    (updated four times a second by the child) and the verbs a run calls."""

    started = True
    failure = None

    def __init__(self, link: ServiceLink, tracker_class: type[Any]) -> None:
        self.link = link
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
        child has exited (what it left is in its spool, or counted lost)."""
        process = self.link.process
        if process is not None and process.poll() is not None:
            return 0
        remote = self.link.remote_stats[self.name]
        unread = max(0, self.link.sent(self.name) - remote.get("submitted", 0))
        return int(remote.get("pending", 0)) + unread + self.link.backlog

    def submit(self, record: Any) -> None:
        self.link.send(record, (self.name,))

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        return self.link.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.link.finish(Deadline(timeout_millis / 1000), int(kwargs.get("exit_code", 0) or 0))

    def abandon_after_fork(self) -> None:
        self.link.abandon_after_fork()


def apply_to_tracker(exporter: Any, setup: Callable[[Any], object]) -> None:
    """Run ``setup(tracker)`` where the tracker lives: on the exporter here, or in the delivery
    process (``export.delivery: process``; ``setup`` must then be a module-level function)."""
    if isinstance(exporter, ServiceTracker):
        exporter.link.setup(exporter.name, setup)
    else:
        setup(exporter)

