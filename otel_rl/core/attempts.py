"""Which rows of a metrics file count when a run was relaunched: the latest attempt of each step.

A relaunched run (the same ``run_id`` in the same ``log_dir``, docs/reliability.md) appends to
the same ``metrics.jsonl``: the first attempt logged steps 0..530, the second resumed from the
checkpoint of step 500 and logs 501.. again. Its JSONL rows carry ``"attempt": 2``, and one
*resume record* marks where it began::

    {"step":501,"time":...,"run_id":"x","attempt":2,"resume":{"attempt":2,"step":501},"metrics":{}}

The rule (whatever the order of the lines, so a late replay of an earlier attempt's rows reads
the same): a row of attempt ``a`` at step ``s`` is *superseded* when the file holds a resume
record of the same run with an attempt ``b > a`` and a resume step ``<= s``. A row without
``"attempt"`` (a file written before attempts existed) is attempt 1; rows on another x-axis
(``"axis"``, the GPU bridge's seconds) are never superseded; the resume records themselves are
not metric rows. Records of another ``run_id`` are not touched by a run's resume records.

:class:`Resumes` holds the rule for readers that stream a file their own way (``otel-rl why``);
:func:`latest_attempt` applies it to a file's records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTEMPT_KEY",
    "FIRST_ATTEMPT",
    "RESUME_KEY",
    "LatestAttempt",
    "ResumePoint",
    "Resumes",
    "attempt_of",
    "latest_attempt",
    "resume_of",
]

ATTEMPT_KEY = "attempt"
RESUME_KEY = "resume"
#: The attempt of a row that names none.
FIRST_ATTEMPT = 1


@dataclass(frozen=True)
class ResumePoint:
    """Attempt ``attempt`` of run ``run_id`` began at ``step``."""

    attempt: int
    step: int
    run_id: str | None = None


def attempt_of(record: Mapping[str, Any]) -> int:
    """The attempt a row belongs to: its ``"attempt"``, or 1 when it has none. A value that is
    not a whole number of at least 1 is read as 1 too: the row counts as the run's first
    attempt's, never dropped."""
    value = record.get(ATTEMPT_KEY)
    return value if type(value) is int and value >= FIRST_ATTEMPT else FIRST_ATTEMPT


def resume_of(record: Mapping[str, Any]) -> ResumePoint | None:
    """The resume point a record announces, or ``None`` for a record without ``"resume"``.

    Raises ``ValueError`` for a ``"resume"`` that is not ``{"attempt": <int >= 2>, "step":
    <int>}``: such a line is no row and no resume record, and reading on as if it were either
    would give the wrong rows."""
    body = record.get(RESUME_KEY)
    if body is None:
        return None
    attempt = body.get("attempt") if isinstance(body, Mapping) else None
    step = body.get("step") if isinstance(body, Mapping) else None
    if type(attempt) is not int or attempt <= FIRST_ATTEMPT or type(step) is not int:
        raise ValueError(
            f'a resume record needs {{"attempt": <whole number >= 2>, "step": <whole number>}}, '
            f"got {body!r}"
        )
    run_id = record.get("run_id")
    return ResumePoint(attempt, step, run_id if isinstance(run_id, str) else None)


class Resumes:
    """The resume points of a file, per run: which rows they supersede."""

    def __init__(self) -> None:
        #: ``{run_id: {attempt: resume step}}``.
        self._steps: dict[str | None, dict[int, int]] = {}
        #: ``{(run_id, attempt): first superseded step}``, rebuilt when a point is added.
        self._cutoffs: dict[tuple[str | None, int], float] = {}

    def __bool__(self) -> bool:
        return bool(self._steps)

    def add(self, point: ResumePoint) -> None:
        """One resume record. The same attempt announced twice keeps its lower step (the one
        that supersedes more: a row of the attempt before it at that step was replaced)."""
        steps = self._steps.setdefault(point.run_id, {})
        known = steps.get(point.attempt)
        if known is None or point.step < known:
            steps[point.attempt] = point.step
            self._cutoffs.clear()

    def points(self) -> list[ResumePoint]:
        """Every resume point, by run (in the order first seen) and attempt."""
        return [
            ResumePoint(attempt, step, run_id)
            for run_id, steps in self._steps.items()
            for attempt, step in sorted(steps.items())
        ]

    def cutoff(self, run_id: str | None, attempt: int) -> float:
        """The first step from which rows of ``attempt`` of ``run_id`` are superseded (the lowest
        resume step of a later attempt), ``inf`` when none is."""
        key = (run_id, attempt)
        found = self._cutoffs.get(key)
        if found is None:
            steps = self._steps.get(run_id, {})
            found = min((s for b, s in steps.items() if b > attempt), default=math.inf)
            self._cutoffs[key] = found
        return found

    def supersedes(self, run_id: str | None, attempt: int, step: int) -> bool:
        """Whether a training-axis row of ``attempt`` at ``step`` is left out."""
        return step >= self.cutoff(run_id, attempt)


@dataclass
class LatestAttempt:
    """A file's records read by the rule: the rows that count, the resume points, what was left
    out."""

    #: The rows that count, in file order (resume records are not rows): the records given
    #: (``dict`` copies of other mappings).
    rows: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[ResumePoint] = field(default_factory=list)
    #: ``{(run_id, attempt): rows left out}``: the superseded rows of each earlier attempt.
    superseded: dict[tuple[str | None, int], int] = field(default_factory=dict)


def latest_attempt(records: Iterable[Mapping[str, Any]]) -> LatestAttempt:
    """The latest attempt of each step of a metrics file, from its records (decoded lines, in
    file order; read once, so a generator will do). Records that are not training-axis rows with
    an integer ``"step"`` (axis rows, other lines) are kept as they are.

    Raises ``ValueError`` naming the record's index for a malformed resume record."""
    resumes = Resumes()
    rows: list[dict[str, Any]] = []
    for index, record in enumerate(records):
        try:
            point = resume_of(record)
        except ValueError as exc:
            raise ValueError(f"record {index}: {exc}") from None
        if point is None:
            # The decoded lines themselves, not copies: a 100,000-row file is read twice as fast.
            rows.append(record if type(record) is dict else dict(record))
        else:
            resumes.add(point)
    result = LatestAttempt(resumes=resumes.points())
    if not resumes:
        result.rows = rows
        return result
    for row in rows:
        step = row.get("step")
        if type(step) is int and row.get("axis") is None:
            run_id = row.get("run_id")
            run = run_id if isinstance(run_id, str) else None
            attempt = attempt_of(row)
            if resumes.supersedes(run, attempt, step):
                key = (run, attempt)
                result.superseded[key] = result.superseded.get(key, 0) + 1
                continue
        result.rows.append(row)
    return result
