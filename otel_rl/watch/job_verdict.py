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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from otel_rl.watch.job_state import SILENT_AFTER, JobStates, name_of
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


def _names(states: Sequence[Mapping[str, Any]], by_world_rank: bool = False) -> str:
    """``ranks 0, 1, 3`` (of one role, or in a process group: by their rank in it), else each
    one's name."""
    key = "world_rank" if by_world_rank else "rank"
    ranks = [s.get(key) for s in states]
    if len(states) > 1 and all(isinstance(r, int) for r in ranks):
        roles = {(s.get("role"), s.get("actor")) for s in states}
        if by_world_rank or len(roles) == 1:
            first = "rank 0" if by_world_rank else name_of(states[0])
            numbers = ", ".join(str(r) for r in sorted(cast(list[int], ranks)))
            return first.rsplit(" ", 1)[0] + "s " + numbers
    return ", ".join(_rank_name(s) if by_world_rank else name_of(s) for s in states)


def _rank_name(state: Mapping[str, Any]) -> str:
    """A process in a process group, by its rank in the default group: ``rank 2``, or
    ``TrainerWorker rank 2`` for a Ray actor (its class)."""
    rank = state.get("world_rank")
    if not isinstance(rank, int):
        return name_of(state)
    return f"{state['actor']} rank {rank}" if state.get("actor") else f"rank {rank}"


def _where_is(state: Mapping[str, Any], now: float) -> str:
    """Where a process is, each fact with its age: its wait, else its line of code, its open
    timer, its node and pid, and how old the state is."""
    def age(since: Any) -> str:
        return f" ({seconds(now - float(since))})" if isinstance(since, (int, float)) else ""

    parts = []
    wait = state.get("wait")
    if isinstance(wait, Mapping) and wait.get("words"):
        parts.append(f"waits on {wait['words']}{age(wait.get('since'))}")
    elif state.get("at"):
        parts.append(f"is at {state['at']}{age(state.get('at_since'))}")
    if state.get("phase"):
        since = state.get("phase_since")
        opened = f" for {seconds(now - float(since))}" if since else ""
        parts.append(f"inside {' > '.join(str(state['phase']).split('/'))}{opened}")
    step = state.get("step")
    parts.append(f"last step {step}" if step is not None else "no step logged")
    where = f"pid {state.get('pid')} on {state.get('node')}"
    if state.get("node_id"):
        where += f", node {str(state['node_id'])[:8]}…"
    parts.append(where)
    said = now - float(state.get("published") or now)
    return ", ".join(parts) + f"; as it said {seconds(said)} ago"


def _summary(state: Mapping[str, Any], now: float) -> dict[str, Any]:
    wait = state.get("wait") if isinstance(state.get("wait"), Mapping) else None
    return {
        "name": name_of(state),
        "role": state.get("role"),
        "rank": state.get("rank"),
        "pid": state.get("pid"),
        "node": state.get("node"),
        "node_id": state.get("node_id"),
        "actor": state.get("actor"),
        "run_id": state.get("run_id"),
        "attempt": state.get("attempt"),
        "step": state.get("step"),
        "phase": state.get("phase"),
        "at": state.get("at"),
        "wait": wait.get("words") if wait else None,
        "collectives": state.get("collectives") or {},
        "seconds_old": round(now - float(state.get("published") or now), 3),
    }


def _collective_odd_ones(
    alive: Sequence[Mapping[str, Any]], now: float
) -> tuple[list[str], list[dict[str, Any]]]:
    """For each process group where some rank waits in a collective: the ranks that entered
    fewer collectives on it than the ones waiting."""
    sentences: list[str] = []
    odd: list[dict[str, Any]] = []
    waiting: dict[str, list[Mapping[str, Any]]] = {}
    for state in alive:
        wait = state.get("wait")
        if isinstance(wait, Mapping) and wait.get("kind") == "collective" and wait.get("group"):
            waiting.setdefault(str(wait["group"]), []).append(state)
    for group, in_it in waiting.items():
        counts = [_count(s, group) for s in in_it]
        known = [c for c in counts if c is not None]
        if not known:
            continue
        top = max(known)
        ahead = [s for s in in_it if _count(s, group) == top]
        behind = [s for s in alive if s not in ahead and _count(s, group) is not None
                  and _count(s, group) < top]  # type: ignore[operator]  # fmt: skip
        if not behind:
            continue
        op = str(ahead[0]["wait"].get("op") or "collective")
        label = "the default group" if group == "default" else f"group {group}"
        size = (ahead[0].get("collectives") or {}).get(group, {}).get("size")
        label += f" ({size} ranks)" if size else ""
        for state in behind:
            count = cast(int, _count(state, group))
            sentences.append(
                f"{_rank_name(state)} has not joined {op} #{top:,} on {label}, which "
                f"{_names(ahead, by_world_rank=True)} {'wait' if len(ahead) > 1 else 'waits'} "
                f"in: it entered only #{count:,} "
                f"({top - count:,} behind) and {_where_is(state, now)}"
            )
            odd.append({**_summary(state, now), "group": group, "count": count,
                        "behind": top - count, "others_in": top})  # fmt: skip
    return sentences, odd


def _count(state: Mapping[str, Any], group: str) -> int | None:
    entry = (state.get("collectives") or {}).get(group)
    count = entry.get("count") if isinstance(entry, Mapping) else None
    return count if isinstance(count, int) else None


def _position(state: Mapping[str, Any]) -> tuple[Any, Any]:
    wait = state.get("wait") if isinstance(state.get("wait"), Mapping) else {}
    return state.get("phase"), (wait or {}).get("kind") or state.get("at")


def _position_words(state: Mapping[str, Any]) -> str:
    """Where the most of a role are: ``inside rollout, waiting on Queue.get``."""
    wait = state.get("wait") if isinstance(state.get("wait"), Mapping) else None
    parts = [f"inside {' > '.join(str(state['phase']).split('/'))}" if state.get("phase")
             else "outside any timer"]  # fmt: skip
    parts.append(f"waiting on {wait['words']}" if wait else f"at {state.get('at')}")
    return ", ".join(parts)


def _role_odd_ones(
    alive: Sequence[Mapping[str, Any]], named: set[tuple[Any, Any]], now: float
) -> tuple[list[str], list[dict[str, Any]]]:
    """Within each role of three processes or more: the ones not where most of them are."""
    sentences: list[str] = []
    odd: list[dict[str, Any]] = []
    roles: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for state in alive:
        roles.setdefault((state.get("role"), state.get("actor")), []).append(state)
    for peers in roles.values():
        if len(peers) < 3:
            continue
        (most, many), *_ = Counter(_position(s) for s in peers).most_common(1)
        if many <= len(peers) / 2:
            continue
        others = [s for s in peers if _position(s) != most
                  and (s.get("node"), s.get("pid")) not in named]  # fmt: skip
        if not others:
            continue
        alike = [s for s in peers if _position(s) == most]
        sentences.append(
            f"{'; '.join(f'{name_of(s)} {_where_is(s, now)}' for s in others)}; not where "
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
    alive: list[dict[str, Any]] = []
    silent: list[dict[str, Any]] = []
    ended: list[dict[str, Any]] = []
    for state in found.states:
        if isinstance(state.get("ended"), (int, float)):
            ended.append(state)
            continue
        published = float(state.get("published") or 0)
        every = float(state.get("every") or 0)
        (silent if now - published > max(SILENT_AFTER, 4 * every) else alive).append(state)
    sentences, odd = _collective_odd_ones(alive, now)
    named = {(s.get("node"), s.get("pid")) for s in odd}
    more, more_odd = _role_odd_ones(alive, named, now)
    sentences += more
    odd += more_odd
    for state in silent:
        published = float(state.get("published") or 0)
        verdict.not_heard_from.append({**_summary(state, now), "last_heard": _clock(published)})
        sentences.append(
            f"{_rank_name(state)} (pid {state.get('pid')} on {state.get('node')}) has not been "
            f"heard from since {_clock(published)} ({seconds(now - published)} ago), when it "
            + _where_is(state, published).split("; as it")[0]
        )
    for state in ended:
        at, step = float(state["ended"]), state.get("step")
        verdict.ended.append({**_summary(state, now), "ended": _clock(at)})
        sentences.append(
            f"{_rank_name(state)} (pid {state.get('pid')} on {state.get('node')}) finished its "
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
