"""A run's ``metrics.jsonl`` read as columns: the rows that say where each step's time went.

Streamed: only the ``anatomy/*`` and ``timing/*`` rows are kept, one ``array('d')`` per key, so a
run of 100k steps costs a few MB. A line in the JSONL exporter's own layout is read by a byte
filter; anything else is decoded as JSON. Of a relaunched run, each step is its latest attempt's
(``otel_rl.core.attempts``).
"""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.core.attempts import FIRST_ATTEMPT, ResumePoint, Resumes, attempt_of, resume_of

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
STALLS_FOLDER = "stalls"
STALL_EVENT = "otel_rl/stall"
STRAGGLER_EVENT = "otel_rl/straggler"

ANATOMY = "anatomy/"
WALL_KEY = "anatomy/wall/seconds"
CRITICAL_PREFIX = "anatomy/critical/"
CRITICAL_PATH_KEY = "anatomy/critical_path"
SECONDS = "/seconds"
BUSY = "/busy_fraction"
SLOWEST = "/slowest_rank"
SKEW = "/skew"
TIMING = "timing/"
#: ``anatomy/<role>/<kind>_rank``: the rank with the most seconds inside its own timers.
RANK_KINDS = ("slowest", "busiest")


def _wanted(key: str) -> bool:
    """The rows that say where a step's time went (and nothing else is kept)."""
    return key.startswith(ANATOMY) or key.startswith(TIMING) or "/timing/" in key


@dataclass
class StepColumns:
    """The kept rows of every step, one ``array('d')`` per key indexed by the step's slot (NaN:
    the step has no such row), so that 100k steps cost a few MB, not a dict per step."""

    slots: dict[int, int] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    runs: list[str | None] = field(default_factory=list)
    columns: dict[str, array[float]] = field(default_factory=dict)
    critical_paths: dict[int, str] = field(default_factory=dict)
    rows: int = 0
    #: Steps a later run wrote again (its row replaced the earlier run's).
    rewritten: set[int] = field(default_factory=set)
    #: Rows on another x-axis (the GPU bridge's seconds): not training steps.
    other_axis: int = 0
    run_ids: dict[str | None, None] = field(default_factory=dict)
    #: Each slot's attempt and its number of rows (a relaunched run, ``core/attempts.py``).
    attempts: list[int] = field(default_factory=list)
    slot_rows: list[int] = field(default_factory=list)
    resumes: Resumes = field(default_factory=Resumes)
    #: ``{(run_id, attempt): rows}`` superseded by a later attempt's resume record, left out.
    superseded: dict[tuple[str | None, int], int] = field(default_factory=dict)
    #: Slots whose rows were all superseded (their step has no row unless a later one fills it).
    vacant: set[int] = field(default_factory=set)
    #: The step time (``anatomy/wall/seconds``) of the superseded rows: steps a later attempt
    #: of the run did again.
    redone_seconds: float = 0.0

    def live_steps(self) -> list[int]:
        """The steps that have rows, in the order first seen."""
        if not self.vacant:
            return self.steps
        return [step for slot, step in enumerate(self.steps) if slot not in self.vacant]

    def has_step(self, step: int) -> bool:
        slot = self.slots.get(step)
        return slot is not None and slot not in self.vacant

    def value(self, key: str, slot: int) -> float:
        column = self.columns.get(key)
        if column is None or slot >= len(column):
            return math.nan
        return column[slot]

    def present(self, key: str) -> list[tuple[int, float]]:
        """``[(slot, value)]`` of the steps that have ``key`` (finite values only)."""
        column = self.columns.get(key)
        if column is None:
            return []
        return [(slot, v) for slot, v in enumerate(column) if math.isfinite(v)]

    def add(
        self, step: int, run_id: str | None, pairs: Iterable[tuple[str, Any]],
        attempt: int = FIRST_ATTEMPT,
    ) -> None:  # fmt: skip
        """One row of ``step``: its kept ``(key, value)`` pairs (numbers, and the critical path's
        text). A row of another run than the one that wrote the step replaces that run's; a row
        a later attempt's resume record supersedes is left out (counted)."""
        self.rows += 1
        self.run_ids.setdefault(run_id, None)
        if self.resumes and self.resumes.supersedes(run_id, attempt, step):
            left_out = (run_id, attempt)
            self.superseded[left_out] = self.superseded.get(left_out, 0) + 1
            self.redone_seconds += sum(
                v for k, v in pairs if k == WALL_KEY and type(v) in (int, float) and v == v
            )
            return
        slot = self.slots.get(step)
        if slot is None:
            slot = self.slots[step] = len(self.steps)
            self.steps.append(step)
            self.runs.append(run_id)
            self.attempts.append(attempt)
            self.slot_rows.append(0)
        elif slot in self.vacant:
            self.vacant.discard(slot)
            self.runs[slot], self.attempts[slot], self.slot_rows[slot] = run_id, attempt, 0
        elif self.runs[slot] != run_id:
            # Another run (a resumed one) wrote this step again: its row is the step now.
            self.runs[slot], self.attempts[slot], self.slot_rows[slot] = run_id, attempt, 0
            self.rewritten.add(step)
            self._clear(slot)
        elif attempt > self.attempts[slot]:
            self.attempts[slot] = attempt
        self.slot_rows[slot] += 1
        columns = self.columns
        for key, value in pairs:
            if type(value) is float or type(value) is int:
                kept = columns.get(key)
                if kept is None:
                    kept = columns[key] = array("d")
                size = len(kept)
                if size == slot:  # the usual case: a key every step has, at a new step
                    kept.append(value)
                    continue
                if size < slot:
                    kept.extend([math.nan] * (slot - size))
                    kept.append(value)
                    continue
                kept[slot] = value
            elif key == CRITICAL_PATH_KEY and isinstance(value, str):
                self.critical_paths[slot] = value

    def resume(self, point: ResumePoint) -> None:
        """A resume record: the rows already kept that it supersedes are taken out (their
        steps keep a slot, vacant until a row of the new attempt fills it)."""
        self.resumes.add(point)
        supersedes = self.resumes.supersedes
        for slot, step in enumerate(self.steps):
            run_id, attempt = self.runs[slot], self.attempts[slot]
            if slot in self.vacant or run_id != point.run_id or attempt >= point.attempt:
                continue
            if supersedes(run_id, attempt, step):
                key = (run_id, attempt)
                self.superseded[key] = self.superseded.get(key, 0) + self.slot_rows[slot]
                wall = self.value(WALL_KEY, slot)
                if math.isfinite(wall):
                    self.redone_seconds += wall
                self.slot_rows[slot] = 0
                self.vacant.add(slot)
                self._clear(slot)

    def _clear(self, slot: int) -> None:
        for column in self.columns.values():
            if slot < len(column):
                column[slot] = math.nan
        self.critical_paths.pop(slot, None)

    def step_times(self) -> tuple[array[float], str]:
        """Each slot's step time and what measured it: ``anatomy/wall/seconds``, or (a run
        without anatomy rows) the sum of the step's top-level ``timing/<name>`` rows."""
        wall = self.columns.get(WALL_KEY)
        if wall is not None and any(math.isfinite(v) for v in wall):
            return wall, "anatomy"
        total = array("d", [math.nan] * len(self.steps))
        for key in self.top_level_timings():
            for slot, value in self.present(key):
                total[slot] = value if total[slot] != total[slot] else total[slot] + value
        return total, "timing"

    def top_level_timings(self) -> list[str]:
        return [k for k in self.columns if k.startswith(TIMING) and "/" not in k[len(TIMING) :]]

    def phase_keys(self, measured_by: str) -> dict[str, str]:
        """``{row key: phase name}`` of the rows that split a step's time into phases."""
        if measured_by == "timing":
            return {key: key[len(TIMING) :] for key in self.top_level_timings()}
        return {
            key: key[len(ANATOMY) : -len(SECONDS)]
            for key in self.columns
            if key.startswith(ANATOMY) and key.endswith(SECONDS)
            and key != WALL_KEY and not key.startswith(CRITICAL_PREFIX)
        }  # fmt: skip


@dataclass
class SkippedLines:
    """Lines of a file that are not rows: their numbers, and a torn last line."""

    name: str
    lines: list[int] = field(default_factory=list)
    torn_end: int | None = None

    def notes(self) -> list[str]:
        notes = []
        if self.torn_end is not None:
            notes.append(
                f"{self.name}: skipped its last line (line {self.torn_end}), cut short: the run "
                "stopped while writing it (a crash or a kill)"
            )
        if self.lines:
            first = ", ".join(map(str, self.lines[:5])) + (", …" if len(self.lines) > 5 else "")
            notes.append(
                f"{self.name}: skipped {len(self.lines)} line(s) that are not rows of an "
                f"otel-rl run (line {first})"
            )
        return notes


def json_lines(path: Path, skipped: SkippedLines) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each JSON object line of ``path``, streamed; other lines are
    counted in ``skipped``."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            record = _json_line(raw, number, skipped)
            if record is not None:
                yield number, record


# The JSONL exporter's own layout (otel_rl/exporters/jsonl.py): the head of a row, and a kept key
# (``anatomy/…``, ``timing/…``, ``…/timing/…``) with a number, NaN/Infinity or a string for its
# value. Only a string can hold a key followed by ``":``: between strings there are only numbers
# and punctuation, and inside one a quote is escaped (a line holding ``\"`` is decoded as JSON).
_ROW_HEAD = re.compile(
    rb'\{"step":(-?\d+),"time":[^,]*(?:,"run_id":(null|"[^"]*"))?(?:,"attempt":([1-9]\d*))?'
    rb'(?:,"resume":\{"attempt":([2-9]|[1-9]\d+),"step":(-?\d+)\})?'
    rb'(?:,"axis":(null|"[^"]*"))?,"metrics":\{'
)
_KEPT_PAIR = re.compile(
    rb'"((?:anatomy/|timing/|[^"]*/timing/)[^"]*)":(-?[0-9][0-9.eE+-]*|NaN|-?Infinity|"[^"]*")'
)


def read_metrics(path: Path) -> tuple[StepColumns, SkippedLines]:
    """The kept rows of every step of ``metrics.jsonl``; rows on another x-axis (the GPU
    bridge's) are not steps and are counted apart. Of a relaunched run, the latest attempt of
    each step (``otel_rl.core.attempts``): a resume record takes out the rows it supersedes.

    A whole line in the exporter's layout is read by :data:`_KEPT_PAIR` alone (the rows it
    keeps are a few of a row's hundred keys, and decoding the rest is most of the time); any
    other line (another layout, a last line without its newline) is decoded as JSON."""
    table = StepColumns()
    skipped = SkippedLines(path.name)
    keys: dict[bytes, str | None] = {}
    runs: dict[bytes | None, str] = {}
    wanted: dict[str, bool] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            whole = raw.endswith(b"}}\n") and b'\\"' not in raw
            head = _ROW_HEAD.match(raw) if whole else None
            if head is not None:
                step, run, attempt, resumed, resumed_at, axis = head.groups()
                run_id = runs.get(run)
                if run_id is None and run is not None and run != b"null":
                    run_id = runs[run] = json.loads(run)
                if resumed is not None:
                    table.resume(ResumePoint(int(resumed), int(resumed_at), run_id))
                    continue
                if axis is not None and axis != b"null":
                    table.other_axis += 1
                    continue
                table.add(
                    int(step), run_id, _kept_pairs(raw, head.end(), keys),
                    FIRST_ATTEMPT if attempt is None else int(attempt),
                )  # fmt: skip
                continue
            record = _json_line(raw, number, skipped)
            if record is None:
                continue
            try:
                point = resume_of(record)
            except ValueError:
                skipped.lines.append(number)
                continue
            if point is not None:
                table.resume(point)
                continue
            step_number, metrics = record.get("step"), record.get("metrics")
            if type(step_number) is not int or not isinstance(metrics, dict):
                skipped.lines.append(number)
                continue
            if record.get("axis") is not None:
                table.other_axis += 1
                continue
            run_id = record.get("run_id")
            table.add(
                step_number,
                run_id if isinstance(run_id, str) else None,
                ((k, v) for k, v in metrics.items() if _kept(k, wanted)),
                attempt_of(record),
            )
    return table, skipped


def _kept(key: str, wanted: dict[str, bool]) -> bool:
    keep = wanted.get(key)
    if keep is None:
        keep = wanted[key] = _wanted(key)
    return keep


def _kept_pairs(raw: bytes, start: int, keys: dict[bytes, str | None]) -> Iterator[tuple[str, Any]]:
    """The kept ``(key, value)`` pairs of a line in the exporter's layout."""
    for match in _KEPT_PAIR.finditer(raw, start):
        name, value = match.groups()
        key = keys.get(name, "")
        if key == "":
            text = json.loads(b'"' + name + b'"') if b"\\" in name else name.decode()
            key = keys[name] = text if _wanted(text) else None
        if key is None:
            continue
        if value[0] == 0x22:  # a string: only the critical path's text is kept
            if key == CRITICAL_PATH_KEY:
                yield key, json.loads(value)
        else:
            yield key, float(value)


def _json_line(raw: bytes, number: int, skipped: SkippedLines) -> dict[str, Any] | None:
    """A line decoded as a JSON object, or ``None`` (counted in ``skipped``; a last line without
    its newline that does not decode is a torn end)."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        if raw.endswith(b"\n"):
            skipped.lines.append(number)
        else:
            skipped.torn_end = number
        return None
    if isinstance(record, dict):
        return record
    skipped.lines.append(number)
    return None


# ---- the answer ---------------------------------------------------------------------------------
