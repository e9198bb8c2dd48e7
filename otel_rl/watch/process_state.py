"""One process's published state: the file format the job's boards hold, written and read here.

A state is a few hundred bytes of JSON (:meth:`JobState.to_json`): who the process is and where
it runs, its last step, its open timer path, the wait the verdict recognises, the collectives it
entered on each process group, and since when each was true. :meth:`JobState.from_json` is the one
reader: every field of its type, every text capped and redacted, and ``None`` for anything that
is not a state (another program's file, a torn or huge write), so that a bad state costs only
itself. A state written before states carried ``version`` (version 1) reads the same way.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_rl.core.redaction import redact_text
from otel_rl.watch.stalls import read_number

__all__ = ["MAX_STATE_BYTES", "MAX_TEXT", "STATE_VERSION", "GroupCount", "JobState",
           "PublishedWait", "text"]  # fmt: skip

#: The format written; version 1 had no ``version`` field and reads the same.
STATE_VERSION = 2
#: Longest text kept of any one field: a state stays a few hundred bytes whatever the program.
MAX_TEXT = 300
#: Process groups whose counts a state carries (a job's own groups are a handful).
MAX_GROUPS = 64
#: Largest state read from a board: what one process publishes is a few kilobytes at most.
MAX_STATE_BYTES = 64 * 1024


def text(value: Any) -> str:
    """``value`` as a state holds text: redacted, at most :data:`MAX_TEXT` characters."""
    said = redact_text(str(value))
    return said if len(said) <= MAX_TEXT else said[: MAX_TEXT - 1] + "…"


def _text_or_none(value: Any) -> str | None:
    return None if value is None else text(value)


@dataclass(frozen=True)
class PublishedWait:
    """The innermost wait the verdict recognised on the process's training thread."""

    words: str  # "HTTP POST http://127.0.0.1:8000/v1/reward", "torch.distributed.all_reduce (…)"
    since: float | None  # Unix time the wait began (as far as the publisher saw it)
    kind: str | None = None  # http | ray | collective | sync | lock | subprocess
    host: str | None = None  # http: "host:port"
    op: str | None = None  # collective: the torch.distributed function, "all_reduce"
    group: str | None = None  # collective: the process group's name

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k == "since"}

    @classmethod
    def from_json(cls, raw: Any) -> PublishedWait | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("words"), str):
            return None
        kind, host, op, group = (_text_or_none(raw.get(k)) for k in ("kind", "host", "op", "group"))
        return cls(text(raw["words"]), read_number(raw.get("since"), float), kind, host, op, group)


@dataclass(frozen=True)
class GroupCount:
    """The collectives a process entered on one process group (the backend's own sequence
    number; ``None`` where the backend keeps none) and the group's size."""

    count: int | None
    size: int | None = None
    backend: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k == "count"}

    @classmethod
    def from_json(cls, raw: Any) -> GroupCount | None:
        if not isinstance(raw, dict):
            return None
        return cls(read_number(raw.get("count"), int), read_number(raw.get("size"), int),
                   _text_or_none(raw.get("backend")))  # fmt: skip


_TEXTS = ("role", "node", "actor", "node_id", "actor_id", "ip", "phase", "at", "run_id", "job")
_NUMBERS = ("every", "step_at", "phase_since", "at_since", "ended")
_INTEGERS = ("pid", "rank", "world_rank", "world_size", "step", "attempt")


@dataclass(frozen=True)
class JobState:
    """Where one process of a job was when it published (``published``, Unix time)."""

    published: float
    pid: int | None = None
    node: str | None = None  # the host name
    role: str | None = None  # driver | rank | actor | process, or the role a worker was given
    rank: int | None = None
    world_rank: int | None = None  # its rank in the default process group
    world_size: int | None = None
    node_id: str | None = None  # Ray's
    actor_id: str | None = None
    actor: str | None = None  # the actor's class
    ip: str | None = None
    run_id: str | None = None  # its Logger's run
    attempt: int | None = None
    job: str | None = None  # the job it is of, in words (a board's ``job``)
    step: int | None = None  # the last step logged, at ``step_at`` (Unix time)
    step_at: float | None = None
    every: float | None = None  # seconds between its publications
    phase: str | None = None  # the open timer path, "step/generation", since ``phase_since``
    phase_since: float | None = None
    at: str | None = None  # one line of the training thread's stack, since ``at_since``
    at_since: float | None = None
    wait: PublishedWait | None = None
    collectives: dict[str, GroupCount] = field(default_factory=dict)
    ended: float | None = None  # Unix time its last Logger finished
    version: int = STATE_VERSION

    @property
    def where(self) -> tuple[str | None, int | None]:
        """The process, as the states of one job are told apart: its host and pid."""
        return self.node, self.pid

    def name(self) -> str:
        """How the process is named in a sentence: ``rank 2``, ``policy rank 1``, ``the driver``,
        ``TrainerWorker rank 3`` (the actor's class)."""
        role, rank = self.role, self.rank
        who = self.actor or (None if role in ("rank", "process") else role)
        if role == "driver" and rank is None:
            return "the driver"
        if rank is None:
            return f"{who or 'process'} (pid {self.pid})"
        return f"{who} rank {rank}" if who else f"rank {rank}"

    def key(self) -> str:
        """Its key on a board: ``rank-<n>`` by its default-group rank (the torch store reads
        the ranks by these keys), else a short name of its role, rank, host and pid."""
        if self.world_rank is not None:
            return f"rank-{self.world_rank}"
        role, node = (re.sub(r"[^\w.-]", "_", str(v))[:40] for v in (self.role, self.node))
        return f"{role}-{self.rank}-{node}-{self.pid}"

    def to_json(self) -> bytes:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "wait":
                value = None if value is None else value.to_json()
            elif f.name == "collectives":
                value = {group: count.to_json() for group, count in value.items()}
            out[f.name] = value
        return json.dumps(out).encode()

    @classmethod
    def from_json(cls, payload: bytes | str | None) -> JobState | None:
        """The state in ``payload``, or ``None`` when it is not one."""
        if payload is None or len(payload) > MAX_STATE_BYTES:
            return None
        try:
            raw = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(raw, dict):
            return None
        published = read_number(raw.get("published"), float)
        if published is None:
            return None
        fields: dict[str, Any] = {name: _text_or_none(raw.get(name)) for name in _TEXTS}
        fields.update({name: read_number(raw.get(name), float) for name in _NUMBERS})
        fields.update({name: read_number(raw.get(name), int) for name in _INTEGERS})
        groups = raw.get("collectives")
        counts = {}
        if isinstance(groups, dict):
            for group, entry in list(groups.items())[:MAX_GROUPS]:
                count = GroupCount.from_json(entry)
                if count is not None:
                    counts[text(group)] = count
        version = read_number(raw.get("version"), int) or 1
        return cls(published=published, wait=PublishedWait.from_json(raw.get("wait")),
                   collectives=counts, version=version, **fields)  # fmt: skip

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> JobState:
        """A state from keyword fields as a publisher gathers them (unknown names left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})
