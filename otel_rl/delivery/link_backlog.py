"""What the training process holds of the records on their way to the delivery process: the
frames the pipe has not taken yet (the backlog, bounded: ``export.queue_size`` records, and with
a spool none older than half ``fsync_interval``) and the record frames it took that the child has
not said are spooled (kept, so that a child that dies loses none of them).

Everything here is used under the link's lock (``LinkState.cond``), except where a method says
it takes the lock itself.
"""

from __future__ import annotations

import time
from collections import deque
from operator import itemgetter

from otel_rl.delivery.link_messages import say_not_kept_up
from otel_rl.delivery.link_state import LinkState
from otel_rl.delivery.options import ExportOptions
from otel_rl.process.deadline import Deadline

__all__ = ["IOV_MAX", "Backlog", "Entry", "KeptFrames", "Numbered"]

#: A backlog entry: (frame, the trackers it is for, when it was sent, its number or 0 for a
#: control frame).
Entry = tuple[bytes, tuple[str, ...], float, int]
#: A frame to keep or write to the leftover file: (its number, frame, the trackers it is for).
Numbered = tuple[int, bytes, tuple[str, ...]]
IOV_MAX = 512  # buffers per writev (Linux allows 1024), and so frames per round of the pusher
_RELEASE_BATCH = 256  # kept frames let go per hold of the lock
_SENT_AT = itemgetter(2)


class KeptFrames:
    """Record frames the pipe took, in the order of the stream, until the child says it has
    spooled them: three deques side by side, so that keeping a frame creates no object the
    garbage collector tracks (more of those bring its full collections, which stop the
    training thread, sooner)."""

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

    def after(self, number: int) -> list[Numbered]:
        return [kept for kept in zip(self.numbers, self.frames, self.names, strict=True)
                if kept[0] > number]  # fmt: skip

    def clear(self) -> None:
        self.numbers.clear()
        self.frames.clear()
        self.names.clear()


class Backlog:
    """The frames waiting for the pipe (``entries``, in the order of the stream) and the record
    frames kept until spooled, with the rules of how long a caller waits for room."""

    def __init__(self, state: LinkState, options: ExportOptions, *, handoff: bool) -> None:
        self._state = state
        self._options = options
        self.entries: deque[Entry] = deque()
        self.records = 0  # record frames among ``entries`` (control frames are not counted)
        self.pushing = False  # the pusher holds frames taken from ``entries``
        self.pushing_since = 0.0  # when the oldest frame the pusher holds was sent
        self.head_cut = False  # the first entry is the rest of a frame the pipe took part of
        self.diverted = False  # frames go to the handoff file until the pipe has its name
        # The crash promise of a spool (nothing older than fsync_interval lost to a kill) holds
        # for frames this process still holds, too. Frames the pipe has not taken after a
        # quarter of it go to a handoff file (local disk, which survives this process); past
        # half of it (the file cannot be written), the caller waits.
        self._lag_limit = options.fsync_interval / 2 if handoff else None
        self.patience = max(1.0, 2 * options.fsync_interval)
        self.unresponsive = False
        self.kept = KeptFrames()
        self.spooled_through = 0  # the child's last word: every frame up to it is spooled
        self.stranded: list[Entry] = []  # taken by the pusher, never written anywhere

    def add_locked(self, frame: bytes, counted: tuple[str, ...], number: int) -> None:
        """A frame the pipe did not take at once: it waits here for the pusher."""
        self.make_room_locked()
        self.entries.append((frame, counted, time.monotonic(), number))
        self.records += bool(counted)
        self._state.cond.notify_all()

    def make_room_locked(self) -> None:
        """Before a frame joins the backlog: under ``export.queue_size`` records, none older than
        half ``fsync_interval`` (``drop_oldest`` drops instead of waiting for room). When one
        call has waited ``patience`` seconds, the delivery process is not kept waiting for
        until it has caught up: the caller goes on (one warning), a full backlog drops its
        oldest record, counted, and the crash promise is suspended until then."""
        state = self._state
        began = time.monotonic()
        counted = False
        while not state.dead:
            full = self.records >= self._options.queue_size
            lagging = (
                self._lag_limit is not None
                and not self.unresponsive
                and self._oldest_age_locked() > self._lag_limit
            )
            if not full and not lagging:
                return
            gives_up = self.unresponsive and self._options.on_full != "block"
            if full and (self._options.on_full == "drop_oldest" or gives_up):
                self._drop_oldest_locked()
                return
            if not counted:
                counted = True
                state.count("waits" if full else "spool_waits", state.names)
            if time.monotonic() - began > self.patience and not self.unresponsive:
                self.unresponsive = True
                say_not_kept_up(self.patience)
                continue
            state.cond.wait(0.05)

    def _drop_oldest_locked(self) -> None:
        # The first frame may be half written already: the oldest record after it goes.
        oldest = next((i for i, entry in enumerate(self.entries) if i and entry[1]), None)
        if oldest is not None:
            dropped = self.entries[oldest][1]
            del self.entries[oldest]
            self.records -= 1
            self._state.not_kept_locked("queue_full", dropped)

    def _oldest_age_locked(self) -> float:
        oldest = self.entries[0][2] if self.entries else float("inf")
        if self.pushing:
            oldest = min(oldest, self.pushing_since)
        return time.monotonic() - oldest

    def take_batch_locked(self) -> tuple[list[Entry], bool]:
        """The pusher's next round: a few hundred frames (every step of a round is then short,
        and none holds the GIL or the lock long while the training thread waits for it), and
        whether the first is the rest of a frame the pipe took part of."""
        entries = self.entries
        batch = [entries.popleft() for _ in range(min(len(entries), IOV_MAX))]
        self.records -= sum(bool(entry[1]) for entry in batch)
        self.pushing_since = _SENT_AT(batch[0]) if batch else time.monotonic()
        cut, self.head_cut = self.head_cut, False
        self.pushing = True
        return batch, cut

    def queue_control_locked(self, frame: bytes) -> None:
        if not self._state.dead:
            self.entries.append((frame, (), time.monotonic(), 0))
            self._state.cond.notify_all()

    def send_control(self, frame: bytes, deadline: Deadline) -> bool:
        """Send a control frame after every record sent before it; True once the pipe took it
        (the pusher writes it: one writer, so frames never interleave). Takes the lock."""
        state = self._state
        with state.cond:
            if state.dead:
                return False
            self.queue_control_locked(frame)
            while self.holding_locked() and not state.dead and deadline.left() > 0:
                state.cond.wait(min(0.05, deadline.left()))
            return not (self.holding_locked() or state.dead)

    def holding_locked(self) -> bool:
        """Frames not in the pipe yet: waiting, being written, or in a file not announced."""
        return bool(self.entries) or self.pushing or self.diverted

    def let_go(self, spooled_through: int) -> None:
        """The child says every spool holds the frames up to ``spooled_through``: they need not
        be kept here any more (a few at a time: the training thread may wait for the lock).
        Takes the lock."""
        self.spooled_through = max(self.spooled_through, spooled_through)
        more = True
        while more:
            with self._state.cond:
                more = self.kept.release(spooled_through, _RELEASE_BATCH)
        with self._state.cond:
            self._state.spooled_through(spooled_through)

    def take_unspooled_locked(self) -> list[Numbered]:
        """Every record frame the child may not have spooled (kept, stranded, never sent), in
        no particular order; none of them is held here any more."""
        backlog = list(self.entries)
        if self.head_cut and backlog:  # the rest of a frame kept whole already
            backlog = backlog[1:]
        left = self.kept.after(self.spooled_through)
        left += [(number, bytes(frame), names) for frame, names, _, number in self.stranded]
        left += [(number, bytes(frame), names) for frame, names, _, number in backlog if number]
        self.clear_locked()
        return left

    def clear_locked(self) -> None:
        self.kept.clear()
        self.stranded = []
        self.entries.clear()
        self.records = 0
