"""The rank everyone waits for: who was slowest at each reduced timing, and who keeps being it.

Reduced timings come with ``<timing>/slowest_rank`` and ``<timing>/skew`` rows
(:func:`otel_rl.distributed.merge.merge_snapshots` for ``log_worker_metrics``,
:func:`otel_rl.distributed.torch.reduce_across_ranks` under torchrun). A
:class:`StragglerWatch` reads those rows as steps are logged and, when one rank was the slowest
at a timing in more than half of the last ``window`` steps, says so once (a warning, and an event
to the run's outputs) — a straggler is a stall in slow motion.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

SLOWEST_SUFFIX = "/slowest_rank"


@dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` was the slowest at ``timing`` in ``times`` of the last ``window`` steps."""

    timing: str
    rank: int
    times: int
    window: int
    step: int
    skew: float

    def describe(self) -> str:
        lead = (
            f"its time was {self.skew:.2f}x the median rank's at that step"
            if self.skew != float("inf") else "the median rank took no time at that step"
        )  # fmt: skip
        return (
            f"rank {self.rank} was the slowest at {self.timing} in {self.times} of the last "
            f"{self.window} steps (up to step {self.step}; {lead}): the other ranks wait for it"
        )


class StragglerWatch:
    """Counts the slowest rank of each reduced timing over a sliding window of steps.

    ``observe`` is given the rows of a step as they are logged; it only looks at keys ending in
    ``/slowest_rank`` (found once, when a key is first seen), so a step without reduced timings
    costs one dict lookup per such key. ``on_straggler`` is called once per (timing, rank).
    """

    def __init__(
        self, window: int, on_straggler: Callable[[Straggler], None], min_skew: float = 1.2
    ) -> None:
        self.window = max(1, int(window))
        #: A step counts for its slowest rank only when that rank took at least this many times
        #: the median rank's time (a 5 % lead is noise, not a straggler).
        self.min_skew = float(min_skew)
        self._on_straggler = on_straggler
        self._recent: dict[str, deque[tuple[int, int]]] = {}
        self._said: set[tuple[str, int]] = set()
        #: Every straggler found so far (for the stall report: who the run waits for).
        self.found: list[Straggler] = []

    @staticmethod
    def watches(key: str) -> bool:
        return key.endswith(SLOWEST_SUFFIX)

    def observe(self, step: int, key: str, rank: float, skew: float | None) -> None:
        """``rank`` was the slowest for ``key`` (``<timing>/slowest_rank``) at ``step``."""
        if rank != rank:  # NaN: nobody had the timing
            return
        if skew is not None and skew < self.min_skew:
            rank = -1.0  # nobody was much slower than the others at this step
        timing = key[: -len(SLOWEST_SUFFIX)]
        recent = self._recent.setdefault(timing, deque(maxlen=self.window))
        if recent and recent[-1][0] == step:
            recent.pop()  # a step logged in several calls counts once, as its latest value
        recent.append((step, int(rank)))
        if len(recent) < self.window:
            return
        counts = Counter(r for _, r in recent if r >= 0)
        if not counts:
            return
        leader, times = counts.most_common(1)[0]
        if times * 2 <= self.window or (timing, leader) in self._said:
            return
        self._said.add((timing, leader))
        found = Straggler(timing, leader, times, self.window, step, skew if skew else 1.0)
        self.found.append(found)
        self._on_straggler(found)

    def last_slowest(self) -> dict[str, int]:
        """``{timing: rank}`` of the latest step each timing had a clear slowest rank."""
        return {
            timing: recent[-1][1]
            for timing, recent in self._recent.items()
            if recent and recent[-1][1] >= 0
        }
