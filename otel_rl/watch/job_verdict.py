"""The job's verdict: which processes are not where the rest are, from every process's published
state (:mod:`otel_rl.watch.job_state`).

Ranks that wait in a collective are compared by the collectives each entered on that process
group (the backend's sequence numbers): the ones that entered fewer have not joined it, and are
named with where they are instead. Processes of one role that are elsewhere than most of that
role are named too; a process whose state stopped coming is named with the time it was last
heard from, and a rank that never published with its rank. Every fact carries its age.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from otel_rl.watch.job_state import SILENT_AFTER, JobStates
from otel_rl.watch.process_state import JobState
from otel_rl.watch.stalls import seconds

__all__ = ["JobVerdict", "job_verdict"]


@dataclass
class JobVerdict:
    """The sentence naming the odd ones out (empty when every process is where the rest are),
    and its parts for the report's ``job`` section."""

    sentence: str = ""
    processes: list[dict[str, Any]] = field(default_factory=list)
    odd_ones_out: list[dict[str, Any]] = field(default_factory=list)
    not_heard_from: list[dict[str, Any]] = field(default_factory=list)
    #: Processes whose run had finished (their last state says when).
    ended: list[dict[str, Any]] = field(default_factory=list)
    #: Ranks that never published, and boards that could not be read.
    missing: list[str] = field(default_factory=list)
    #: What the sentence does not say: the boards that could not be read.
    unknown: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "sentence": self.sentence,
            "processes": self.processes,
            "odd_ones_out": self.odd_ones_out,
            "not_heard_from": self.not_heard_from,
            "ended": self.ended,
            "missing": self.missing,
        }


def _clock(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime("%H:%M:%S UTC")


def _names(states: Sequence[JobState], by_world_rank: bool = False) -> str:
    """``ranks 0, 1, 3`` (of one role, or in a process group: by their rank in it), else each
    one's name."""
    ranks = [s.world_rank if by_world_rank else s.rank for s in states]
    if len(states) > 1 and all(isinstance(r, int) for r in ranks):
        roles = {(s.role, s.actor) for s in states}
        if by_world_rank or len(roles) == 1:
            first = "rank 0" if by_world_rank else states[0].name()
            numbers = ", ".join(str(r) for r in sorted(cast(list[int], ranks)))
            return first.rsplit(" ", 1)[0] + "s " + numbers
    return ", ".join(_rank_name(s) if by_world_rank else s.name() for s in states)


def _rank_name(state: JobState) -> str:
    """A process in a process group, by its rank in the default group: ``rank 2``, or
    ``TrainerWorker rank 2`` for a Ray actor (its class)."""
    rank = state.world_rank
    if rank is None:
        return state.name()
    return f"{state.actor} rank {rank}" if state.actor else f"rank {rank}"


def _where_is(state: JobState, now: float) -> str:
    """Where a process is, each fact with its age: its wait, else its line of code, its open
    timer, its node and pid, and how old the state is."""
    def age(since: float | None) -> str:
        return "" if since is None else f" ({seconds(now - since)})"

    parts = []
    if state.wait is not None and state.wait.words:
        parts.append(f"waits on {state.wait.words}{age(state.wait.since)}")
    elif state.at:
        parts.append(f"is at {state.at}{age(state.at_since)}")
    if state.phase:
        since = state.phase_since
        opened = f" for {seconds(now - since)}" if since else ""
        parts.append(f"inside {' > '.join(state.phase.split('/'))}{opened}")
    parts.append(f"last step {state.step}" if state.step is not None else "no step logged")
    where = f"pid {state.pid} on {state.node}"
    if state.node_id:
        where += f", node {state.node_id[:8]}…"
    parts.append(where)
    return ", ".join(parts) + f"; as it said {seconds(now - state.published)} ago"


def _summary(state: JobState, now: float) -> dict[str, Any]:
    return {
        "name": state.name(),
        "role": state.role,
        "rank": state.rank,
        "pid": state.pid,
        "node": state.node,
        "node_id": state.node_id,
        "actor": state.actor,
        "run_id": state.run_id,
        "attempt": state.attempt,
        "step": state.step,
        "phase": state.phase,
        "at": state.at,
        "wait": None if state.wait is None else state.wait.words,
        "collectives": {group: count.to_json() for group, count in state.collectives.items()},
        "seconds_old": round(now - state.published, 3),
    }


def _collective_odd_ones(
    alive: Sequence[JobState], now: float
) -> tuple[list[str], list[dict[str, Any]]]:
    """For each process group where some rank waits in a collective: the ranks that entered
    fewer collectives on it than the ones waiting."""
    sentences: list[str] = []
    odd: list[dict[str, Any]] = []
    waiting: dict[str, list[JobState]] = {}
    for state in alive:
        wait = state.wait
        if wait is not None and wait.kind == "collective" and wait.group:
            waiting.setdefault(wait.group, []).append(state)
    for group, in_it in waiting.items():
        known = [c for c in (_count(s, group) for s in in_it) if c is not None]
        if not known:
            continue
        top = max(known)
        ahead = [s for s in in_it if _count(s, group) == top]
        behind = [(s, count) for s in alive if s not in ahead
                  for count in [_count(s, group)] if count is not None and count < top]  # fmt: skip
        if not behind:
            continue
        first = ahead[0]
        op = (first.wait.op if first.wait is not None else None) or "collective"
        label = "the default group" if group == "default" else f"group {group}"
        entry = first.collectives.get(group)
        label += f" ({entry.size} ranks)" if entry is not None and entry.size else ""
        for state, count in behind:
            sentences.append(
                f"{_rank_name(state)} has not joined {op} #{top:,} on {label}, which "
                f"{_names(ahead, by_world_rank=True)} {'wait' if len(ahead) > 1 else 'waits'} "
                f"in: it entered only #{count:,} "
                f"({top - count:,} behind) and {_where_is(state, now)}"
            )
            odd.append({**_summary(state, now), "group": group, "count": count,
                        "behind": top - count, "others_in": top})  # fmt: skip
    return sentences, odd


def _count(state: JobState, group: str) -> int | None:
    entry = state.collectives.get(group)
    return None if entry is None else entry.count


def _position(state: JobState) -> tuple[str | None, str | None]:
    return state.phase, (state.wait.kind if state.wait is not None else None) or state.at


def _position_words(state: JobState) -> str:
    """Where the most of a role are: ``inside rollout, waiting on Queue.get``."""
    parts = [f"inside {' > '.join(state.phase.split('/'))}" if state.phase
             else "outside any timer"]  # fmt: skip
    parts.append(f"waiting on {state.wait.words}" if state.wait else f"at {state.at}")
    return ", ".join(parts)


def _role_odd_ones(
    alive: Sequence[JobState], named: set[tuple[str | None, int | None]], now: float
) -> tuple[list[str], list[dict[str, Any]]]:
    """Within each role of three processes or more: the ones not where most of them are."""
    sentences: list[str] = []
    odd: list[dict[str, Any]] = []
    roles: dict[tuple[str | None, str | None], list[JobState]] = {}
    for state in alive:
        roles.setdefault((state.role, state.actor), []).append(state)
    for peers in roles.values():
        if len(peers) < 3:
            continue
        (most, many), *_ = Counter(_position(s) for s in peers).most_common(1)
        if many <= len(peers) / 2:
            continue
        others = [s for s in peers if _position(s) != most and s.where not in named]
        if not others:
            continue
        alike = [s for s in peers if _position(s) == most]
        sentences.append(
            f"{'; '.join(f'{s.name()} {_where_is(s, now)}' for s in others)}; not where "
            f"{_names(alike)} are ({_position_words(alike[0])})"
        )
        odd += [_summary(s, now) for s in others]
    return sentences, odd


def job_verdict(found: JobStates, now: float) -> JobVerdict:
    """Compare the states in ``found`` as of ``now`` (Unix time)."""
    verdict = JobVerdict()
    verdict.processes = [_summary(s, now) for s in found.states]
    verdict.missing = list(found.unreadable)
    verdict.unknown = list(found.unreadable)
    alive: list[JobState] = []
    silent: list[JobState] = []
    ended: list[JobState] = []
    for state in found.states:
        if state.ended is not None:
            ended.append(state)
            continue
        quiet = now - state.published > max(SILENT_AFTER, 4 * (state.every or 0))
        (silent if quiet else alive).append(state)
    sentences, odd = _collective_odd_ones(alive, now)
    named = {(s.get("node"), s.get("pid")) for s in odd}
    more, more_odd = _role_odd_ones(alive, named, now)
    sentences += more
    odd += more_odd
    for state in silent:
        published = state.published
        verdict.not_heard_from.append({**_summary(state, now), "last_heard": _clock(published)})
        sentences.append(
            f"{_rank_name(state)} (pid {state.pid} on {state.node}) has not been "
            f"heard from since {_clock(published)} ({seconds(now - published)} ago), when it "
            + _where_is(state, published).split("; as it")[0]
        )
    for state in ended:
        at, step = cast(float, state.ended), state.step
        verdict.ended.append({**_summary(state, now), "ended": _clock(at)})
        sentences.append(
            f"{_rank_name(state)} (pid {state.pid} on {state.node}) finished its "
            f"run at {_clock(at)} ({seconds(now - at)} ago)"
            + ("" if step is None else f", after step {step}")
        )
    for rank in found.missing:
        verdict.missing.append(f"{rank} never published its state")
        sentences.append(f"{rank} never said where it is (it has no Logger or WorkerMetrics, "
                         "or has not reached one)")  # fmt: skip
    verdict.odd_ones_out = odd
    verdict.sentence = "; ".join(sentences)
    return verdict
