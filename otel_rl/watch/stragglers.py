"""The rank everyone waits for: who was slowest at each reduced timing, who keeps being it, and
what it cost.

Reduced timings come with ``<timing>/slowest_rank`` and ``<timing>/skew`` rows
(:func:`otel_rl.distributed.merge.merge_snapshots` for ``log_worker_metrics``,
:func:`otel_rl.distributed.torch.reduce_across_ranks` under torchrun). A
:class:`StragglerWatch` reads those rows as steps are logged and, when one rank was the slowest
at a timing in more than half of the last ``window`` steps, says so once (a warning, and an event
to the run's outputs) — a straggler is a stall in slow motion — in terms of the time it cost:
"rank 2 cost 31 % of the step time over the last 10 steps".

The cost of one step is what the other ranks waited for the slowest: the slowest rank's time
minus the median rank's (``max - max / skew``, from the ``<timing>`` and ``<timing>/skew`` rows).
A straggler's cost is that, summed over the window's steps where it was the slowest, divided by
the sum of the window's step wall times.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

SLOWEST_SUFFIX = "/slowest_rank"

#: ``walls(steps)``: the wall time (seconds) of each of those steps that is known.
StepWalls = Callable[[Sequence[int]], Mapping[int, float]]


@dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` was the slowest at ``timing`` in ``times`` of the last ``window`` steps.

    ``cost`` is its share of the window's wall time that the other ranks spent waiting for it
    (``waited`` seconds of ``wall`` seconds; above 1 for a timing that overlaps the steps instead
    of running inside them); ``None`` when it cannot be known, ``unknown`` saying why.
    """

    timing: str
    rank: int
    times: int
    window: int
    step: int
    skew: float
    cost: float | None = None
    waited: float | None = None
    wall: float | None = None
    unknown: str = ""

    def describe(self) -> str:
        lead = (
            f"its time was {self.skew:.2f}x the median rank's at that step"
            if self.skew != float("inf") else "the median rank took no time at that step"
        )  # fmt: skip
        detail = f"up to step {self.step}; {lead}): the other ranks wait for it"
        where = f"the slowest at {self.timing} in {self.times} of them ({detail}"
        if self.cost is not None and self.waited is not None and self.wall is not None:
            if self.cost > 1:  # timings that run beside the steps (asynchronous work)
                return (
                    f"rank {self.rank} cost {self.waited:.3g} s over the last {self.window} "
                    f"steps, more than their {self.wall:.3g} s of wall time (the timing overlaps "
                    f"the steps): {where}"
                )
            return (
                f"rank {self.rank} cost {percent(self.cost)} of the step time over the last "
                f"{self.window} steps ({self.waited:.3g} s of {self.wall:.3g} s): {where}"
            )
        return (
            f"rank {self.rank} was the slowest at {self.timing} in {self.times} of the last "
            f"{self.window} steps ({detail}; what it cost is unknown: {self.unknown}"
        )


def percent(share: float) -> str:
    """``31 %``, ``4.2 %``, ``0.05 %``: enough digits to tell a small share from none."""
    value = 100 * share
    return f"{value:.0f} %" if value >= 10 else f"{value:.2g} %"


class _Seen(NamedTuple):
    """One step of a timing: its slowest rank (``-1`` when nobody was much slower), that rank
    whatever its lead, and the seconds the others waited for it (``None``: unknown)."""

    step: int
    counted: int
    slowest: int
    waited: float | None


class StragglerWatch:
    """Counts the slowest rank of each reduced timing over a sliding window of steps.

    ``observe`` is given the rows of a step as they are logged; it only looks at keys ending in
    ``/slowest_rank`` (found once, when a key is first seen), so a step without reduced timings
    costs one dict lookup per such key. ``on_straggler`` is called once per (timing, rank);
    ``walls`` gives the wall times of the window's steps when one is named (without it, what a
    straggler cost is unknown).
    """

    def __init__(
        self,
        window: int,
        on_straggler: Callable[[Straggler], None],
        min_skew: float = 1.2,
        walls: StepWalls | None = None,
    ) -> None:
        self.window = max(1, int(window))
        #: A step counts for its slowest rank only when that rank took at least this many times
        #: the median rank's time (a 5 % lead is noise, not a straggler).
        self.min_skew = float(min_skew)
        self._on_straggler = on_straggler
        self._walls = walls
        self._recent: dict[str, deque[_Seen]] = {}
        self._said: set[tuple[str, int]] = set()
        #: Every straggler found so far (for the stall report: who the run waits for).
        self.found: list[Straggler] = []

    @staticmethod
    def watches(key: str) -> bool:
        return key.endswith(SLOWEST_SUFFIX)

    def observe(
        self,
        step: int,
        key: str,
        rank: float,
        skew: float | None,
        seconds: float | None = None,
    ) -> None:
        """``rank`` was the slowest for ``key`` (``<timing>/slowest_rank``) at ``step``, taking
        ``seconds`` (the ``<timing>`` row: the slowest rank's time), ``skew`` times the median
        rank's."""
        if rank != rank:  # NaN: nobody had the timing
            return
        counted = rank
        if skew is not None and skew < self.min_skew:
            counted = -1.0  # nobody was much slower than the others at this step
        timing = key[: -len(SLOWEST_SUFFIX)]
        recent = self._recent.setdefault(timing, deque(maxlen=self.window))
        if recent and recent[-1].step == step:
            recent.pop()  # a step logged in several calls counts once, as its latest value
        recent.append(_Seen(step, int(counted), int(rank), waited_for(seconds, skew)))
        if len(recent) < self.window:
            return
        counts = Counter(seen.counted for seen in recent if seen.counted >= 0)
        if not counts:
            return
        leader, times = counts.most_common(1)[0]
        if times * 2 <= self.window or (timing, leader) in self._said:
            return
        self._said.add((timing, leader))
        found = Straggler(timing, leader, times, self.window, step, skew if skew else 1.0,
                          *self._cost(timing, leader, recent))  # fmt: skip
        self.found.append(found)
        self._on_straggler(found)

    def _cost(
        self, timing: str, rank: int, recent: Sequence[_Seen]
    ) -> tuple[float | None, float | None, float | None, str]:
        """What ``rank`` cost over ``recent``: the fields ``cost``, ``waited``, ``wall`` and
        ``unknown`` of a :class:`Straggler`."""
        theirs = [seen for seen in recent if seen.slowest == rank]
        missing = [seen.step for seen in theirs if seen.waited is None]
        if missing:
            return None, None, None, f"no {timing} and {timing}/skew rows at step {missing[0]}"
        if self._walls is None:
            return None, None, None, "the steps' wall times are not known here"
        steps = [seen.step for seen in recent]
        walls = self._walls(steps)
        absent = [s for s in steps if s not in walls]
        if absent:
            return None, None, None, f"no wall time for step {absent[0]}"
        wall = sum(walls[s] for s in steps)
        if wall <= 0:
            return None, None, None, f"the window's steps took {wall:g} s of wall time"
        waited = sum(seen.waited or 0.0 for seen in theirs)
        return waited / wall, waited, wall, ""

    def last_slowest(self) -> dict[str, int]:
        """``{timing: rank}`` of the latest step each timing had a clear slowest rank."""
        return {
            timing: recent[-1].counted
            for timing, recent in self._recent.items()
            if recent and recent[-1].counted >= 0
        }


def waited_for(seconds: float | None, skew: float | None) -> float | None:
    """Seconds the median rank waited for the slowest, whose time was ``seconds`` and ``skew``
    times the median's (``None`` when either is missing or not a number)."""
    if seconds is None or skew is None or math.isnan(seconds) or math.isnan(skew) or skew <= 0:
        return None
    if math.isinf(skew):
        return seconds  # the median rank took no time: the whole of it was waited for
    return seconds - seconds / skew
