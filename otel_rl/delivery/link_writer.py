"""The writer of frames to the delivery process: the pusher thread, which writes the backlog to
the records pipe as it takes it, or to a handoff file when the child has fallen behind.

Frames the pipe has not taken a quarter of ``fsync_interval`` after they were sent go to a
handoff file instead, in the run's spool folder, and so do all the frames after them until the
pipe has taken the file's name: the child reads the file there, in order, then deletes it. A
file whose name never reached the pipe (this process was killed) is read when the pipe ends. So
the caller does not wait for a child that is behind, and a kill loses no more than it would
in-process.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import select
import struct
import termios
import threading
import time
from collections import Counter, deque
from operator import itemgetter
from pathlib import Path
from typing import Any

from otel_rl.delivery.frames import encode_frame
from otel_rl.delivery.link_backlog import IOV_MAX, Backlog, Entry
from otel_rl.delivery.link_messages import say_caught_up, say_no_handoff_file
from otel_rl.delivery.link_state import LinkState
from otel_rl.delivery.spool import private_dirs
from otel_rl.process.cores import keep_to

__all__ = ["FrameWriter", "widen_pipe"]

_F_SETPIPE_SZ = 1031  # Linux: a 1 MiB pipe holds a few hundred steps before the backlog is used
_F_GETPIPE_SZ = 1032
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PIPE_SIZE = 1 << 20
_FRAME, _TRACKERS, _SENT_AT = itemgetter(0), itemgetter(1), itemgetter(2)
_Buffer = bytes | memoryview


def widen_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe behind ``fd`` (a smaller one only brings the backlog in sooner)."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)


def _atomic_run(frames: deque[_Buffer]) -> list[_Buffer]:
    """The first frames, up to ``PIPE_BUF`` bytes in all (or the first alone): a pipe takes
    such a write whole or not at all, so it never ends inside a frame when the frames after
    it go to a handoff file. Only a frame larger than that can be cut by a full pipe; the
    handoff then waits until the pipe has taken the rest of it."""
    run: list[_Buffer] = []
    size = 0
    for frame in itertools.islice(frames, IOV_MAX):
        size += len(frame)
        if run and size > select.PIPE_BUF:
            break
        run.append(frame)
    return run


class FrameWriter:
    """The one writer of the records pipe once the hello frame is in it (so frames never
    interleave): the training thread writes a frame itself only when nothing waits before it
    (``fits_whole``, then ``os.write(out, ...)``), the pusher thread everything else."""

    def __init__(
        self, state: LinkState, backlog: Backlog, handoff_dir: Path | None, fsync_interval: float
    ) -> None:
        self._state = state
        self._backlog = backlog
        self.out = -1  # the write end of the records pipe
        self._pipe_pages = 16
        #: Where handoff files go; None without a spool, or once one could not be written.
        self.handoff_dir = handoff_dir
        self._handoff_after = fsync_interval / 4
        self._handoff: tuple[Path, int] | None = None  # the file being written, and its fd
        self._handoffs = 0
        self._taken: list[Entry | None] = []  # the pipe took them in the pusher's round
        self._cores: frozenset[int] | None = None
        self._pusher: threading.Thread | None = None

    def attach(self, out: int) -> None:
        """Write to the pipe whose write end is ``out`` (the pusher is not started yet)."""
        self.out = out
        try:
            self._pipe_pages = fcntl.fcntl(out, _F_GETPIPE_SZ) // _PAGE
        except OSError:
            self._pipe_pages = 16  # Linux's default pipe: 64 KiB

    def start(self, hello: bytes, cores: frozenset[int] | None) -> None:
        """Write ``hello`` (before any record: blocking), then start the pusher on ``cores``."""
        self._cores = cores
        os.write(self.out, hello)
        os.set_blocking(self.out, False)
        self._pusher = threading.Thread(target=self._push, name="otel-rl-delivery-pipe",
                                        daemon=True)  # fmt: skip
        self._pusher.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the pusher to end (it ends once the child is
        dead or the run ended and the backlog is out)."""
        if self._pusher is not None:
            self._pusher.join(timeout)

    def _push(self) -> None:
        """Write the backlog as the pipe takes it. The frames go out by ``writev`` as they are:
        joining or slicing megabytes would hold the GIL the training thread is waiting for."""
        keep_to(self._cores)
        state, backlog = self._state, self._backlog
        poller = select.poll()
        poller.register(self.out, select.POLLOUT)
        while True:
            with state.cond:
                while not (backlog.entries or backlog.diverted or state.dead or state.ended):
                    state.cond.wait()
                if backlog.diverted and not backlog.entries and not state.dead:
                    state.cond.wait(0.02)  # for the pipe to take the file's name, or a frame
                if state.dead or not (backlog.entries or backlog.diverted):
                    return
                batch, cut = backlog.take_batch_locked()
            frames: deque[_Buffer] = deque(map(_FRAME, batch))
            times = deque(map(_SENT_AT, batch))
            # What the pipe takes is kept until the child has spooled it; a frame cut by the
            # pipe before this round was kept then.
            keep: deque[Entry | None] = deque(batch)
            if cut and keep:
                keep[0] = None
            pushed = len(frames)
            try:
                if backlog.diverted and self.handoff_dir is None:
                    self._announce(poller, wait=True)  # the file failed: the pipe from here on
                if not backlog.diverted:
                    self._to_pipe(frames, times, keep, poller, cut=cut)
                if frames and not state.dead and self._to_handoff(frames):
                    keep.clear()  # in a file that outlives the child: nothing to keep here
                elif frames and not state.dead:
                    self._announce(poller, wait=True)
                    self._to_pipe(frames, times, keep, poller, handoff=False)
                if backlog.diverted:
                    self._announce(poller, wait=self.handoff_dir is None)
            except OSError:  # the child is gone: the status reader says whether early
                with state.cond:
                    state.close_pipe_locked()
            pushed -= len(frames)
            taken = Counter(map(_TRACKERS, itertools.islice(batch, pushed)))
            with state.cond:
                for names, count in taken.items():
                    state.sent_locked(names, count)
                if frames:  # the child is gone, or the run ended before it took them
                    backlog.stranded += [entry for entry in keep if entry is not None and entry[3]]
                elif backlog.unresponsive and not backlog.entries:
                    # Caught up with everything: the crash promise holds again from here on.
                    backlog.unresponsive = False
                    say_caught_up()
                backlog.pushing = False
                state.cond.notify_all()

    def _to_pipe(
        self, frames: deque[_Buffer], times: deque[float], keep: deque[Entry | None],
        poller: Any, *, handoff: bool = True, cut: bool = False,
    ) -> None:  # fmt: skip
        """Write ``frames`` to the pipe; stops at a frame's boundary, leaving the rest in
        ``frames``, when the oldest has waited long enough for the handoff file. ``cut``: the
        first is the rest of a frame the pipe has taken part of. ``keep`` (beside ``frames``):
        the record frames to keep once the pipe has taken their first byte."""
        handoff = handoff and self.handoff_dir is not None
        whole = not cut  # frames[0] is a whole frame, not the rest of one
        try:
            self._to_pipe_keeping(frames, times, keep, poller, handoff, whole)
        finally:
            # Kept once per round, not per write: the lock, taken per write, made this thread
            # wait for the GIL a switch interval at a time while the training thread logs.
            with self._state.cond:
                for entry in self._taken:
                    if entry is not None and entry[3]:
                        self._backlog.kept.add(entry[3], entry[0], entry[1])
            self._taken.clear()

    def _to_pipe_keeping(
        self, frames: deque[_Buffer], times: deque[float], keep: deque[Entry | None],
        poller: Any, handoff: bool, whole: bool,
    ) -> None:  # fmt: skip
        taken, state = self._taken, self._state
        while frames and not state.dead:
            if handoff and whole and time.monotonic() - times[0] > self._handoff_after:
                return
            poller.poll(20 if handoff else 100)
            if handoff and whole and not self.fits_whole(len(frames[0])):
                time.sleep(0.005)  # a large frame waits for room for all of it, or for the file
                continue
            try:
                written = os.writev(self.out, _atomic_run(frames) if handoff else
                                    list(itertools.islice(frames, IOV_MAX)))  # fmt: skip
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
                self._backlog.pushing_since = times[0]

    def fits_whole(self, size: int) -> bool:
        """Whether the pipe has room for a write of ``size`` bytes. One of ``PIPE_BUF`` bytes or
        less goes whole or not at all; a larger one could go in part, and its rest would then
        wait for the child however far behind it is, with every frame after it (a handoff file
        can start only between frames). The pipe is reckoned in pages as the kernel keeps it,
        each at least half full, so a write that fits by this count goes whole."""
        if size <= select.PIPE_BUF or self.handoff_dir is None:
            return True
        queued: int = struct.unpack("i", fcntl.ioctl(self.out, termios.FIONREAD, b"\0" * 4))[0]
        free_pages = self._pipe_pages - 2 * -(-queued // _PAGE) - 1
        return size <= free_pages * _PAGE

    def _to_handoff(self, frames: deque[_Buffer]) -> bool:
        """Append ``frames`` to the handoff file (opened for the first); False, and nothing
        written, when it cannot be (the handoff is then off for the run, with one warning)."""
        assert self.handoff_dir is not None
        if self._handoff is None:
            self._handoffs += 1
            path = self.handoff_dir / f"handoff-{os.getpid()}-{self._handoffs}.frames"
            try:
                private_dirs(self.handoff_dir)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            except OSError as exc:
                return self._handoff_failed(exc)
            self._handoff = (path, fd)
            with self._state.cond:
                self._backlog.diverted = True
        path, fd = self._handoff
        size = os.fstat(fd).st_size
        left = deque(frames)  # ``frames`` stays whole until all of it is in the file
        try:
            while left:
                written = os.writev(fd, list(itertools.islice(left, IOV_MAX)))
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
        say_no_handoff_file(exc)
        self.handoff_dir = None
        return False

    def _announce(self, poller: Any, *, wait: bool) -> None:
        """Give the child the handoff file's name (a frame small enough to go whole or not at
        all); the frames after it go by the pipe again. ``wait``: until the pipe takes it."""
        if self._handoff is None:
            return
        frame = encode_frame("handoff", str(self._handoff[0]))
        while not self._state.dead:
            try:
                os.write(self.out, frame)
            except BlockingIOError:
                if not wait:
                    return
                poller.poll(100)
                continue
            break
        self.close_handoff()
        with self._state.cond:
            self._backlog.diverted = False
            self._state.cond.notify_all()

    def close_handoff(self) -> None:
        """Close the handoff file being written (its name never reached the pipe if it is still
        open: the child reads it when the pipe ends)."""
        if self._handoff is not None:
            with contextlib.suppress(OSError):
                os.close(self._handoff[1])
            self._handoff = None

    def close(self) -> None:
        """Close the records pipe: the child reads what it holds, then sees its end. Once: the
        number may soon name another file of this process (a fork child's ``dup2`` too)."""
        out, self.out = self.out, -1
        if out >= 0:
            with contextlib.suppress(OSError):
                os.close(out)
