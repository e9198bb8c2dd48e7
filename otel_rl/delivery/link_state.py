"""What every part of the delivery process's link reads and writes under its one lock: how far
the run and the child have got, and the link's counts of records per tracker.

The link's parts (``link_backlog``, ``link_writer``, ``link_status``, ``link_child`` and the
facade ``service_link``) hold this object and take ``cond`` from it each time: a fork child
replaces the lock (the parent's may be held by a thread the child does not have).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from otel_rl.core.failures import LOSS_REASONS, count_loss

__all__ = ["LinkState"]


class LinkState:
    """The link's lock and flags, and its records per tracker (``names``)."""

    __slots__ = (
        "checkpoints_sent", "cond", "dead", "ended", "handed", "in_files", "killed",
        "local_stats", "names", "orphaned", "orphaning", "sent", "unread_lost",
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
        self.checkpoints_sent: dict[str, int] = dict.fromkeys(names, 0)
        #: Records this process could not hand to the child, by tracker and reason.
        self.local_stats: dict[str, dict[str, int]] = {name: {} for name in names}

    def renew_lock(self) -> None:
        """In a fork child: a lock of its own (the parent's may be held by a thread it lacks)."""
        self.cond = threading.Condition(threading.Lock())

    def count(self, what: str, names: Iterable[str], n: int = 1) -> None:
        for name in names:
            stats = self.local_stats[name]
            if what in LOSS_REASONS:
                count_loss(stats, what, n)
            else:
                stats[what] = stats.get(what, 0) + n
