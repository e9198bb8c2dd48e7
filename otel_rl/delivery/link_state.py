"""What every part of the delivery process's link reads and writes under its one lock: how far
the run and the child have got, and the link's counts of records per tracker.

The link's parts (``link_backlog``, ``link_writer``, ``link_status``, ``link_handle`` and the
facade ``service_link``) hold this object and take ``cond`` from it each time: a fork child
replaces the lock (the parent's may be held by a thread the child does not have).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

from otel_rl.core.failures import LOSS_REASONS, count_loss

__all__ = ["LinkState"]


class LinkState:
    """The link's lock and flags, and its records per tracker (``names``)."""

    __slots__ = (
        "checkpoint_frames", "checkpoints_sent", "cond", "dead", "ended", "handed", "in_files",
        "killed", "local_stats", "names", "orphaned", "orphaning", "sent", "unread_lost",
    )  # fmt: skip

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.cond = threading.Condition(threading.Lock())
        #: The child cannot be written to any more (gone, or the run ended and the pipe closed).
        self.dead = False
        #: The run ended: no record is taken from now on.
        self.ended = False
        #: The child was killed here (or never started a run): its end is no news.
        self.killed = False
        #: The child just died and its leftover file is being written: senders wait.
        self.orphaning = False
        #: The child is gone: records go to the leftover file.
        self.orphaned = False
        #: What the child never read is counted lost (once; no leftover file).
        self.unread_lost = False
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

    def renew_lock(self) -> None:
        """In a fork child: a lock of its own (the parent's may be held by a thread it lacks)."""
        self.cond = threading.Condition(threading.Lock())

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
