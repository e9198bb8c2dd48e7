"""Where each step's time went: the ``anatomy/*`` rows of a step, built when it is sealed.

A step lasts from the last ``log_metrics`` call of the step before it to its own last call (the
first step: from the Logger's start). The process's phase clock
(:data:`~otel_rl.telemetry.timing.PROCESS_CLOCK`) says how much of that the training thread (the
thread that logs) spent inside each timer path, exclusive of the timers nested in it; what no timer
covered is ``untimed``, so the phases and ``untimed`` add up to the step's wall time exactly.
Workers' snapshots (``log_worker_metrics``) carry their own timers' exclusive seconds; each role
that sent some gets its median rank's busy fraction and its busiest rank. The critical path is the
driver's longest phase, then the busiest rank of the busiest role with its longest phase.

On the training thread a call costs a clock read and, when timers started or stopped since the
previous call, one copy of the thread's totals (a few paths); the rows are built at the seal.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from otel_rl.distributed.snapshot import ANATOMY_KEY
from otel_rl.telemetry.timing import PROCESS_CLOCK, PhaseClock

PREFIX = "anatomy/"
UNTIMED = "anatomy/untimed/seconds"
WALL = "anatomy/wall/seconds"
CRITICAL_PATH = "anatomy/critical_path"
CRITICAL_UNTIMED = "anatomy/critical/untimed/seconds"
#: First names of rows the anatomy writes itself: a timer path or a role that starts with one is
#: renamed (:func:`_unreserved`).
RESERVED = frozenset({"untimed", "wall", "critical", "critical_path"})

# (monotonic time, thread ident, totals of that thread then, its innermost path, charged since)
_Mark = tuple[float, int, Mapping[str, float], str, float]
_NO_TOTALS: Mapping[str, float] = {}


class StepAnatomy:
    """Marks the end of the pending step at each call; gives the step's rows at its seal.

    Called under the step lock (``mark``, ``add_workers``, ``rows``): one caller at a time.
    """

    def __init__(self, clock: PhaseClock = PROCESS_CLOCK) -> None:
        self._clock = clock
        self._copied: tuple[int, int] | None = None  # (thread, events) of ``_copy``
        self._copy: Mapping[str, float] = _NO_TOTALS
        # The training thread is the first to call log_metrics; until then the step's start is
        # known for every thread that timed something (the others had timed nothing yet).
        self._thread: int | None = None
        now = time.monotonic()
        self._began = now
        self._starts = {ident: self._reading(now, ident) for ident in clock.threads()}
        self._start: _Mark = (now, 0, _NO_TOTALS, "", now)
        self._end: _Mark | None = None
        # role -> rank -> {path: seconds}: for the pending step, and handed in for the next call
        self._workers: dict[str, dict[int, dict[str, float]]] = {}
        self._incoming: dict[str, dict[int, dict[str, float]]] = {}
        # (role, rank, time) of the snapshots taken: handed in, and in the pending step
        self._seen_incoming: set[tuple[str, int, Any]] = set()
        self._seen: set[tuple[str, int, Any]] = set()
        self._timed = False  # a run that never times anything has no anatomy to tell
        self._keys: dict[tuple[str, str, str], str] = {}  # see _key_of
        self._last_chain: tuple[tuple[str, str], ...] = ()

    def mark(self) -> None:
        """A ``log_metrics`` call, from any thread: the pending step lasts at least until now,
        and the training thread's time so far is in it."""
        thread = self._thread
        if thread is None:
            thread = self._thread = threading.get_ident()
            began = self._began
            self._start = self._starts.pop(thread, (began, thread, _NO_TOTALS, "", began))
            self._starts.clear()
        self._end = self._reading(time.monotonic(), thread)
        if self._incoming:
            for role, ranks in self._incoming.items():
                for rank, phases in ranks.items():
                    _add(self._workers.setdefault(role, {}).setdefault(rank, {}), phases)
            self._incoming = {}
            self._seen |= self._seen_incoming
            self._seen_incoming = set()

    def add_workers(self, snapshots: Iterable[Mapping[str, Any] | None]) -> None:
        """The workers' own timer seconds, for the step of the next call (the one that logs
        these snapshots' rows)."""
        for snap in snapshots:
            if not isinstance(snap, Mapping):
                continue
            phases = snap.get(ANATOMY_KEY)
            if not isinstance(phases, Mapping) or not phases:
                continue  # a worker that timed nothing (or an older one) says nothing of it
            try:
                role, rank = str(snap["role"]), int(snap["rank"])
                seen = (role, rank, snap.get("time"))
                if seen in self._seen or seen in self._seen_incoming:
                    continue  # one snapshot logged twice (under two prefixes)
                self._seen_incoming.add(seen)
                _add(self._incoming.setdefault(role, {}).setdefault(rank, {}), phases)
            except (KeyError, TypeError, ValueError):
                continue  # the merge reports a malformed snapshot; its anatomy is left out

    def rows(self) -> dict[str, Any]:
        """The ``anatomy/*`` rows of the step being sealed; its end starts the next step."""
        end, start = self._end, self._start
        if end is None:  # sealed without a call (flush with only OTel data): nothing to say
            return {}
        self._start, self._end = end, None
        workers = self._workers
        if workers:
            self._workers = {}
            self._seen.clear()
        elif not self._timed and end[2] is start[2] and not end[3]:
            return {}  # nothing timed yet, and nothing now: no anatomy to tell (one check a step)
        wall = end[0] - start[0]
        phases = _spent(start, end)
        if not self._timed:
            if not phases and not workers:
                return {}
            self._timed = True
        key_of = self._key_of
        rows: dict[str, Any] = {key_of(path, "/seconds"): spent for path, spent in phases.items()}
        untimed = wall - sum(phases.values())
        rows[UNTIMED] = untimed if untimed > 0.0 else 0.0
        rows[WALL] = wall
        # (who, what is shown, the link's row, seconds); untimed is no timer's path
        links = [("driver", "untimed", CRITICAL_UNTIMED, rows[UNTIMED])]
        for path, spent in phases.items():
            if spent > links[0][3]:
                links[0] = ("driver", path, key_of(path, "/seconds", "critical/"), spent)
        if workers:
            links += self._worker_rows(workers, wall, rows)
        for _, _, key, spent in links:
            rows[key] = spent
        # The text only where the path changed: a tracker keeps text as one file per step (MLflow).
        chain = tuple((who, shown) for who, shown, _, _ in links)
        if chain != self._last_chain:
            self._last_chain = chain
            rows[CRITICAL_PATH] = " > ".join(f"{who}:{shown}" for who, shown in chain)
        return rows

    def _worker_rows(
        self, workers: dict[str, dict[int, dict[str, float]]], wall: float, rows: dict[str, Any]
    ) -> list[tuple[str, str, str, float]]:
        """Each role's busy fraction and busiest rank into ``rows``; the critical path's link of
        the busiest rank of the busiest role, if it timed anything."""
        busiest: tuple[float, str, int, dict[str, float]] | None = None
        for role, ranks in sorted(workers.items()):
            busy = {rank: sum(p.values()) for rank, p in ranks.items()}
            slowest = min(busy, key=lambda rank: (-busy[rank], rank))
            if wall > 0:
                rows[self._key_of(role, "/busy_fraction")] = statistics.median(busy.values()) / wall
            rows[self._key_of(role, "/busiest_rank")] = float(slowest)
            if busiest is None or busy[slowest] > busiest[0]:
                busiest = (busy[slowest], role, slowest, ranks[slowest])
        if busiest is None or not busiest[3]:
            return []
        _, role, rank, phases = busiest
        path, spent = max(phases.items(), key=lambda item: item[1])
        key = self._key_of(f"{role}/{path}", "/seconds", "critical/")
        return [(f"{role} rank {rank}", path, key, spent)]

    def _key_of(self, path: str, suffix: str, under: str = "") -> str:
        """The row key of ``path`` (built once)."""
        keys = self._keys
        key = keys.get((under, path, suffix))
        if key is None:
            key = keys[(under, path, suffix)] = f"{PREFIX}{under}{_unreserved(path)}{suffix}"
        return key

    def _reading(self, now: float, ident: int) -> _Mark:
        reading = self._clock.reading(ident)
        if reading is None:
            return (now, ident, _NO_TOTALS, "", now)
        events, totals, top, since = reading
        if self._copied != (ident, events):
            # Equal event counts mean equal totals: a step of many calls copies them once.
            self._copy, self._copied = dict(totals), (ident, events)
        return (now, ident, self._copy, top, since)


def _unreserved(path: str) -> str:
    """``path`` as its rows name it: a first name that is one of the anatomy's own
    (``untimed``, ``wall``, ``critical``) gets ``_timer`` after it, so a timer named ``wall``
    neither hides the step's wall time nor is taken for it."""
    first, sep, rest = path.partition("/")
    return f"{first}_timer{sep}{rest}" if first in RESERVED else path


def _add(into: dict[str, float], phases: Mapping[str, Any]) -> None:
    for path, spent in phases.items():
        into[str(path)] = into.get(str(path), 0.0) + float(spent)


def _spent(start: _Mark, end: _Mark) -> dict[str, float]:
    """Exclusive seconds by timed path between two readings of one thread (each reading's open
    interval charged to its innermost path up to the reading's time)."""
    start_now, _, before, start_top, start_since = start
    end_now, _, after, end_top, end_since = end
    out: dict[str, float] = {}
    if after is not before:  # the same copy: no timer started or stopped in between
        for path, total in after.items():
            if path and total != before.get(path, 0.0):
                out[path] = total - before.get(path, 0.0)
    if end_top:
        out[end_top] = out.get(end_top, 0.0) + (end_now - end_since)
    if start_top:
        out[start_top] = out.get(start_top, 0.0) - (start_now - start_since)
    return {path: spent for path, spent in out.items() if spent > 0.0}
