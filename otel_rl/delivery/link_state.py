"""What every part of the delivery process's link reads and writes under its one lock: where
records sent to the child go (:class:`Pipe`, one state changed only by :class:`LinkState`'s
methods), whether the run ended, and the link's counts of records per tracker.

The link's parts (``link_backlog``, ``link_writer``, ``link_status``, ``link_handle`` and the
facade ``service_link``) hold this object and take ``cond`` from it each time: a fork child
replaces the lock (the parent's may be held by a thread the child does not have).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Iterable, Sequence

from otel_rl.core.failures import LOSS_REASONS, count_loss

__all__ = ["LinkState", "Pipe"]


class Pipe(enum.Enum):
    """Where a record sent to the delivery process goes. ``OPEN`` is the start; ``CLOSED`` once
    the run's end frame is out and the pipe is closed, or the pipe broke (the status reader then
    says whether the child died early); a child gone before the run's end passes ``LEAVING``
    (senders wait) to ``TO_FILE`` or ``LOST``, which last."""

    OPEN = "open"  # to the pipe (or a handoff file): the child takes it
    CLOSED = "closed"  # nowhere: the child cannot be written to any more
    LEAVING = "leaving"  # the child died during the run: its leftover file is being written
    TO_FILE = "to_file"  # the launch's leftover file, for ``otel-rl replay``
    LOST = "lost"  # no leftover file could be written: counted lost


class LinkState:
    """The link's lock, where its records go, and its records per tracker (``names``). The
    changes of ``pipe``, ``ended`` and ``killed`` are its methods' (``*_locked``: ``cond`` held),
    each a step of the lifecycle, and so are those of its counts: the other parts of the link
    read them and never set them on their own."""

    __slots__ = (
        "checkpoint_frames", "checkpoints_sent", "cond", "ended", "handed", "in_files", "killed",
        "local_stats", "names", "pipe", "sent",
    )  # fmt: skip

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.cond = threading.Condition(threading.Lock())
        self.pipe = Pipe.OPEN
        #: The run ended: no record is taken from now on.
        self.ended = False
        #: The child was killed here (or never started a run): its end is no news.
        self.killed = False
        #: Records accepted for each tracker (checkpoints not counted), sent or not.
        self.handed: dict[str, int] = dict.fromkeys(names, 0)
        #: Records for each tracker waiting in files for ``otel-rl replay`` (never spooled).
        self.in_files: dict[str, int] = dict.fromkeys(names, 0)
        #: Records written whole to the pipe, by tracker (checkpoints not counted).
        self.sent: dict[str, int] = dict.fromkeys(names, 0)
        #: Checkpoints of a pending step handed to the child (or a handoff file), by tracker,
        #: and the frame numbers of those the child has not said are spooled: replay passes
        #: them over once their step's sealed batch is spooled, so no count of what waits
        #: takes them for records.
        self.checkpoints_sent: dict[str, int] = dict.fromkeys(names, 0)
        self.checkpoint_frames: dict[str, deque[int]] = {name: deque() for name in names}
        #: Records this process could not hand to the child, by tracker and reason.
        self.local_stats: dict[str, dict[str, int]] = {name: {} for name in names}

    @property
    def dead(self) -> bool:
        """The child cannot be written to any more (gone, or the run ended and the pipe
        closed)."""
        return self.pipe is not Pipe.OPEN

    def end_run_locked(self) -> bool:
        """The run ends: nothing is taken from now on. True the first time."""
        if self.ended:
            return False
        self.ended = True
        self.cond.notify_all()
        return True

    def close_pipe_locked(self) -> None:
        """Nothing more is written to the child: the end frame is out, or the pipe broke."""
        if self.pipe is Pipe.OPEN:
            self.pipe = Pipe.CLOSED
        self.cond.notify_all()

    def killed_here(self) -> None:
        """The child is killed by this process (or never started a run): its end is no news."""
        self.killed = True

    def leaving_locked(self) -> bool:
        """The child is gone before the run's end: senders wait until :meth:`left_locked` says
        where their records go. False when that is known already (the leftover file was
        written, or could not be)."""
        if self.pipe in (Pipe.TO_FILE, Pipe.LOST):
            return False
        self.pipe = Pipe.LEAVING
        self.cond.notify_all()
        return True

    def left_locked(self, kept: bool) -> None:
        """The leftover file is written (``kept``), or could not be: records sent from now on
        go to it, or are counted lost."""
        self.pipe = Pipe.TO_FILE if kept else Pipe.LOST
        self.cond.notify_all()

    def abandon_after_fork(self) -> None:
        """In a fork child: the parent's run is not the child's, nor is its delivery process;
        a lock of its own (the parent's may be held by a thread the child does not have)."""
        self.pipe, self.ended = Pipe.CLOSED, True
        self.cond = threading.Condition(threading.Lock())

    # ---- the counts: changed only here, each call with ``cond`` held ---------------------------

    def accepted_locked(self, names: Iterable[str]) -> None:
        """A record for ``names`` is accepted (sent, or to be)."""
        handed = self.handed
        for name in names:
            handed[name] += 1

    def not_kept_locked(self, reason: str, names: Iterable[str]) -> None:
        """A record accepted for ``names`` is lost after all (dropped for room, or no file could
        keep it): counted under ``reason``, no longer as accepted."""
        names = tuple(names)
        self.count(reason, names)
        for name in names:
            self.handed[name] -= 1

    def sent_locked(self, names: Iterable[str], n: int = 1) -> None:
        """``n`` records for ``names`` are written whole to the pipe."""
        sent = self.sent
        for name in names:
            sent[name] += n

    def checkpoint_handed_locked(self, names: Iterable[str], frame: int) -> None:
        """The checkpoint in frame ``frame`` is handed over for ``names``."""
        for name in names:
            self.checkpoints_sent[name] += 1
            self.checkpoint_frames[name].append(frame)

    def in_files_locked(self, names: Iterable[str], n: int = 1) -> None:
        """``n`` records for ``names`` wait in the launch's leftover file for replay."""
        for name in names:
            self.in_files[name] += n

    def checkpoints_after(self, name: str, frame: int) -> int:
        """Checkpoints handed over for ``name`` numbered above ``frame``."""
        return sum(1 for number in self.checkpoint_frames[name] if number > frame)

    def spooled_through(self, frame: int) -> None:
        """Every spool holds the frames up to ``frame``: their checkpoints are no news."""
        for frames in self.checkpoint_frames.values():
            while frames and frames[0] <= frame:
                frames.popleft()

    def count(self, what: str, names: Iterable[str], n: int = 1) -> None:
        for name in names:
            stats = self.local_stats[name]
            if what in LOSS_REASONS:
                count_loss(stats, what, n)
            else:
                stats[what] = stats.get(what, 0) + n
