"""Why a run's a run's slow steps were slow, from what the run wrote (``otel-rl why``).

Reads ``metrics.jsonl`` (one row per step, streamed: only the rows that say where time went are
kept, as columns of floats), ``events.jsonl`` beside it (the straggler and stall events) and
``stalls/*.json`` (the stall reports), and answers in plain words: the run's slowest steps
against its median, one step's anatomy (each phase against its own median over the run, the
critical path, the workers' busy fractions and slowest ranks), and the stalls and stragglers
found. No server, no tracker SDK: the files alone.

Which rows it reads (docs/anatomy.md): ``anatomy/<path>/seconds`` (a timer path's own seconds
in the step), ``anatomy/untimed/seconds``, ``anatomy/wall/seconds``,
``anatomy/critical/<link>/seconds`` and the text row ``anatomy/critical_path``,
``anatomy/<role>/busy_fraction`` and ``anatomy/<role>/busiest_rank`` (or ``slowest_rank``), and
every reduced timing's ``…timing/<name>``, ``…/slowest_rank`` and ``…/skew``. A run without
anatomy rows (logged before they existed) is measured by the sum of its top-level
``timing/<name>`` rows instead, and the answer says so. Of a relaunched run, each step is its
latest attempt's (``otel_rl.core.attempts``): the rows a later attempt's resume record
supersedes are left out, and the answer says where each attempt resumed and how many it left out.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.analysis.metrics_rows import (
    ANATOMY,
    BUSY,
    CRITICAL_PREFIX,
    EVENTS_FILE,
    METRICS_FILE,
    RANK_KINDS,
    SECONDS,
    SKEW,
    SLOWEST,
    STALL_EVENT,
    STALLS_FOLDER,
    STRAGGLER_EVENT,
    TIMING,
    WALL_KEY,
    SkippedLines,
    StepColumns,
    json_lines,
    read_metrics,
)
from otel_rl.watch.stalls import NotAStallReport, StallFile

__all__ = ["Answer", "WhyError", "duration", "explain", "percent", "step_ranges", "times"]

#: Slowest steps listed by default.
TOP = 5


class WhyError(Exception):
    """Input that cannot be answered (a missing file, a step not in the run): one line, exit 2."""


def duration(value: float) -> str:
    """``48.0 s``, ``2.0 s``, ``12.1 ms``, ``27.2 µs``: seconds in tenths, less in three digits."""
    if value != value:
        return "n/a"
    if abs(value) >= 1.0 or value == 0:
        return f"{value:.1f} s"
    if abs(value) >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def percent(fraction: float) -> str:
    """``97 %``, ``0.23 %``: whole percents, two digits below one."""
    value = fraction * 100
    return f"{value:.0f} %" if abs(value) >= 1 or value == 0 else f"{value:.2g} %"


def times(ratio: float) -> str:
    """``1.6x``, ``397x``: how many times the median, in tenths below ten."""
    return f"{ratio:.1f}x" if ratio < 9.95 else f"{ratio:.0f}x"  # 9.96 is "10x", not "10.0x"


def step_ranges(steps: Iterable[int]) -> str:
    """``0-4, 9, 12-20``: the steps of a run, runs of consecutive steps joined."""
    ordered = sorted(set(steps))
    parts: list[str] = []
    start = previous = None
    for step in ordered:
        if previous is not None and step == previous + 1:
            previous = step
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = step
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ", ".join(parts)


@dataclass
class Phase:
    """One phase of a step: its seconds, its median over the run, and (a reduced timing of the
    same name) the rank that was slowest at it and by how much."""

    name: str
    seconds: float
    median: float
    slowest_rank: int | None = None
    skew: float | None = None

    def words(self) -> str:
        text = f"{self.name} {duration(self.seconds)} (median {duration(self.median)})"
        if self.slowest_rank is not None:
            text += f", its slowest rank {self.slowest_rank}"
            if self.skew is not None and math.isfinite(self.skew):
                text += f" (skew {self.skew:.1f})"
        return text


@dataclass
class Role:
    """A worker role's share of the step inside its timers (median rank), and its slowest."""

    role: str
    busy_fraction: float
    rank: int | None
    #: Which rank the row names: ``slowest`` or ``busiest`` (the most seconds in its timers).
    rank_kind: str = "slowest"

    def words(self) -> str:
        text = f"{self.role}: busy {percent(self.busy_fraction)} of the step (median rank)"
        if self.rank is not None:
            text += f", {self.rank_kind} rank {self.rank}"
        return text


@dataclass
class ReducedTiming:
    """A timing reduced across ranks that no phase of the driver's is named after."""

    key: str
    seconds: float
    slowest_rank: int
    skew: float | None

    def words(self) -> str:
        skew = ""
        if self.skew is not None and math.isfinite(self.skew):
            skew = f" (skew {self.skew:.1f})"
        return f"{self.key} {duration(self.seconds)}, slowest rank {self.slowest_rank}{skew}"


@dataclass
class AnatomyOfStep:
    step: int
    seconds: float
    median: float
    measured_by: str
    phases: list[Phase]
    critical_path: str | None
    roles: list[Role]
    timings: list[ReducedTiming]

    def sentence(self) -> str:
        if not self.phases and not math.isfinite(self.seconds):
            return f"step {self.step}: no row says where its time went"
        took = "took" if self.measured_by == "anatomy" else "spent in its timers"
        head = f"step {self.step} {took} {duration(self.seconds)}, median {duration(self.median)}"
        if not self.phases:
            return head + " (no phase rows at this step)"
        return head + ": " + "; ".join(p.words() for p in self.phases)


@dataclass
class SlowStep:
    step: int
    seconds: float
    times_median: float | None
    phase: str | None
    phase_seconds: float | None

    def words(self) -> str:
        ratio = f" ({times(self.times_median)} median)" if self.times_median is not None else ""
        most = (
            f", most in {self.phase} {duration(self.phase_seconds)}"
            if self.phase is not None and self.phase_seconds is not None else ""
        )  # fmt: skip
        return f"step {self.step}: {duration(self.seconds)}{ratio}{most}"


@dataclass
class Stall:
    """One stall report: when, after which step, its verdict (else its summary), its end."""

    report: str
    stalled_at: str | None
    last_step: int | None
    text: str
    ended: str | None
    #: From the last step to the next one once the stall ended; before that, how long it
    #: had lasted when its report was last written.
    seconds: float | None = None
    #: Whether it ended (a run killed in it never wrote its end).
    over: bool = False
    #: The launch of the run it happened in (reports of earlier releases: 1).
    attempt: int = 1
    #: The run it happened in (``None``: its report names none).
    run_id: str | None = None

    def lines(self) -> list[str]:
        after = "before any step" if self.last_step is None else f"after step {self.last_step}"
        when = self.stalled_at or "at an unknown time"
        end = self.ended or "had not ended when the report was last written"
        where = "report" if self.report.endswith(".json") else "events"
        return [f"{when}, {after}: {self.text}", f"  {end}", f"  {where}: {self.report}"]


@dataclass
class StragglerSeen:
    step: int | None
    text: str

    def words(self) -> str:
        return f"step {self.step}: {self.text}" if self.step is not None else self.text


@dataclass
class Attempts:
    """Of a relaunched run (``core/attempts.py``): where each later attempt resumed
    (``{"run_id", "attempt", "step"}``) and how many rows of each earlier attempt it superseded
    (``{"run_id", "attempt", "rows"}``), left out of every number of the answer."""

    resumes: list[dict[str, Any]]
    superseded: list[dict[str, Any]]


@dataclass
class TimeSpent:
    """Where the whole run's time went: the steps' time by phase (each step's anatomy, summed),
    what stalls and relaunches cost, and how idle each role of workers was."""

    steps_seconds: float
    #: ``(phase, seconds)``, the largest first; the phases add up to ``steps_seconds``.
    phases: list[tuple[str, float]]
    stalls: int
    #: From each stall's start to the next step (part of the steps' time); a stall the run never
    #: got out of counts until its report was last written. Stalls in steps a later attempt did
    #: again are in ``redone_seconds`` instead.
    stalls_seconds: float
    #: Of those, the stalls that never ended.
    stalls_not_over: int
    #: The step time of the rows a later attempt did again (outside the steps' time).
    redone_steps: int
    redone_seconds: float
    #: ``(role, idle share of the steps' time its workers were there for)``.
    idle: list[tuple[str, float]]

    def lines(self) -> list[str]:
        total = self.steps_seconds
        lines = [f"where the run's time went ({duration(total)} of steps):", "  by phase:"]
        width = max((len(name) for name, _ in self.phases), default=0)
        for name, seconds in self.phases:
            share = percent(seconds / total) if total > 0 else "-"
            lines.append(f"    {name:<{width}}  {duration(seconds):>9}  {share:>5}")
        if self.stalls:
            share = f" ({percent(self.stalls_seconds / total)} of the steps' time)" if total else ""
            if self.stalls_not_over:
                share += f"; {self.stalls_not_over} never ended: counted until last reported"
            lines.append(f"  lost to {self.stalls} stall(s): {duration(self.stalls_seconds)}"
                         f"{share}")  # fmt: skip
        if self.redone_steps:
            lines.append(
                f"  lost to relaunches: {duration(self.redone_seconds)} "
                f"({self.redone_steps} step row(s) a later attempt did again)"
            )
        lines += [f"  {role} idle {percent(share)} of the steps' time" for role, share in self.idle]
        return lines


@dataclass
class Answer:
    """Everything ``otel-rl why`` says about a run; :meth:`to_text` and :meth:`to_json`."""

    metrics: str
    steps: int
    step_ranges: str
    measured_by: str
    median: float | None
    slowest: list[SlowStep]
    anatomy: AnatomyOfStep | None
    stalls: list[Stall]
    stragglers: list[StragglerSeen]
    notes: list[str]
    #: A relaunched run's resume points and the rows of earlier attempts they superseded.
    attempts: Attempts = field(default_factory=lambda: Attempts([], []))
    time_spent: TimeSpent | None = None

    def to_text(self) -> str:
        lines = [f"otel-rl why: {self.metrics} ({self.steps} steps: {self.step_ranges})"]
        if self.median is not None:
            what = "step time" if self.measured_by == "anatomy" else "time in top-level timers"
            lines += ["", f"slowest steps ({what}; median {duration(self.median)}):"]
            lines += [f"  {s.words()}" for s in self.slowest]
        if self.anatomy is not None:
            lines += ["", self.anatomy.sentence()]
            if self.anatomy.critical_path:
                lines.append(f"  critical path: {self.anatomy.critical_path}")
            lines += [f"  workers {r.words()}" for r in self.anatomy.roles]
            lines += [f"  reduced timing {t.words()}" for t in self.anatomy.timings]
        if self.time_spent is not None:
            lines += ["", *self.time_spent.lines()]
        lines += ["", f"stalls: {len(self.stalls) or 'none found'}"]
        lines += [f"  {line}" for stall in self.stalls for line in stall.lines()]
        lines += [f"stragglers: {len(self.stragglers) or 'none found'}"]
        lines += [f"  {s.words()}" for s in self.stragglers]
        if self.notes:
            lines += ["", "notes:"] + [f"  {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        anatomy = None
        if self.anatomy is not None:
            anatomy = {**_plain(self.anatomy), "text": self.anatomy.sentence()}
        return {
            "metrics": self.metrics,
            "steps": self.steps,
            "step_ranges": self.step_ranges,
            "measured_by": self.measured_by,
            "median_seconds": _finite(self.median),
            "slowest": [_plain(s) for s in self.slowest],
            "step": anatomy,
            "stalls": [_plain(s) for s in self.stalls],
            "stragglers": [_plain(s) for s in self.stragglers],
            "notes": self.notes,
            "attempts": _plain(self.attempts),
            "time_spent": _plain(self.time_spent) if self.time_spent is not None else None,
        }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _plain(obj: Any) -> Any:
    """A dataclass as JSON-ready data (NaN and inf as ``null``)."""
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return {name: _plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
    return obj


# ---- putting it together ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFiles:
    metrics: Path
    events: Path
    stalls: Path | None


def run_files(target: str | Path) -> RunFiles:
    """Where a run's files are: ``LOG_DIR/metrics.jsonl``, ``events.jsonl`` beside it and
    ``LOG_DIR/stalls/``; or a metrics file given itself (``jsonl.path``: its events are
    ``<stem>.events.jsonl`` beside it, and only ``metrics.jsonl`` has a stalls folder beside)."""
    path = Path(target)
    if path.is_file():
        if path.name == METRICS_FILE:
            return RunFiles(path, path.with_name(EVENTS_FILE), path.parent / STALLS_FOLDER)
        return RunFiles(path, path.with_name(f"{path.stem}.{EVENTS_FILE}"), None)
    if not path.is_dir():
        what = "is not a file or a directory" if path.exists() else "does not exist"
        raise WhyError(f"{path} {what}: give a run's log_dir or its metrics.jsonl")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        runs = sorted(p.parent.name for p in path.glob(f"*/{METRICS_FILE}"))
        hint = f"; runs under it: {', '.join(runs)} (pass one of them)" if runs else ""
        raise WhyError(
            f"no {METRICS_FILE} in {path}: otel-rl why reads the rows of the JSONL tracker "
            f"(enable it: jsonl_enabled: true; with jsonl.path elsewhere, pass that file){hint}"
        )
    return RunFiles(metrics, path / EVENTS_FILE, path / STALLS_FOLDER)


def explain(target: str | Path, step: int | None = None, top: int = TOP) -> Answer:
    """The answer for the run at ``target`` (a log_dir or a metrics file): the ``top`` slowest
    steps, the anatomy of ``step`` (default: the slowest), the stalls and stragglers."""
    files = run_files(target)
    try:
        table, skipped = read_metrics(files.metrics)
    except OSError as exc:
        raise WhyError(f"cannot read {files.metrics}: {exc.strerror or exc}") from None
    notes = skipped.notes()
    steps = table.live_steps()
    if not steps:
        raise WhyError(f"{files.metrics} holds no step rows" + (f" ({notes[0]})" if notes else ""))
    if step is not None and not table.has_step(step):
        raise WhyError(f"step {step} is not in the run; its steps: {step_ranges(steps)}")

    times, measured_by = table.step_times()
    known = [(table.steps[slot], t) for slot, t in enumerate(times) if math.isfinite(t)]
    phases = table.phase_keys(measured_by)
    median: float | None = None
    slowest: list[SlowStep] = []
    if known:
        median = statistics.median(t for _, t in known)
        for s, t in sorted(known, key=lambda st: (-st[1], st[0]))[: max(0, top)]:
            name, seconds = _largest_phase(table, table.slots[s], phases)
            ratio = t / median if median > 0 else None
            slowest.append(SlowStep(s, t, ratio, name, seconds))
    if measured_by == "timing":
        notes.append(
            "this run has no anatomy rows (anatomy/wall/seconds): a step's time here is the sum "
            "of its top-level timing/<name> rows, which leaves out untimed time and counts a "
            "timer nested in another twice"
            if known else "no row says how long a step took: this run has neither anatomy rows "
            "(anatomy/wall/seconds) nor top-level timing/<name> rows (Logger.timer)"
        )  # fmt: skip
    elif len(known) < len(steps):
        notes.append(f"the step time is known for {len(known)} of the {len(steps)} steps")
    if table.resumes:
        notes.append(_attempts_note(table))
    if table.rewritten:
        notes.append(
            f"{len(table.rewritten)} step(s) were written again by a later run (a resumed run): "
            f"the later run's row counts ({_short_ranges(table.rewritten)})"
        )
    if len(table.run_ids) > 1:
        ids = ", ".join(str(r) for r in table.run_ids)
        notes.append(f"{files.metrics.name} holds rows of {len(table.run_ids)} runs ({ids})")

    chosen = step if step is not None else (slowest[0].step if slowest else None)
    anatomy = None
    if chosen is not None:
        anatomy = _anatomy(table, chosen, times, median, measured_by, phases)

    stalls, stragglers, more = _events_and_stalls(files)
    time_spent = _time_spent(table, phases, stalls) if measured_by == "anatomy" else None
    return Answer(
        metrics=str(files.metrics),
        steps=len(steps),
        step_ranges=_short_ranges(steps),
        measured_by=measured_by,
        median=median,
        slowest=slowest,
        anatomy=anatomy,
        stalls=stalls,
        stragglers=stragglers,
        notes=notes + more,
        attempts=_attempts(table),
        time_spent=time_spent,
    )


def _redone(table: StepColumns, stall: Stall) -> bool:
    """Whether the step the stall held up was done again by a later attempt of the run, or by
    a run that came after it in the same log_dir (a script run again there)."""
    held = None if stall.last_step is None else table.slots.get(stall.last_step + 1)
    if held is None:
        return False
    run = table.runs[held]
    if stall.run_id is None or run == stall.run_id:
        return table.attempts[held] > stall.attempt
    order = list(table.run_ids)  # the runs as their rows came, first to last
    return stall.run_id in order and run in order and order.index(run) > order.index(stall.run_id)


def _time_spent(table: StepColumns, phases: Mapping[str, str], stalls: list[Stall]) -> TimeSpent:
    """The whole run's :class:`TimeSpent`, from its anatomy rows (the steps kept: a row a later
    attempt superseded counts as redone, not twice)."""
    total = sum(v for _, v in table.present(WALL_KEY))
    by_phase = sorted(
        ((name, sum(v for _, v in table.present(key))) for key, name in phases.items()),
        key=lambda item: (-item[1], item[0]),
    )
    wall = table.columns.get(WALL_KEY)
    idle = []
    for key in sorted(k for k in table.columns if k.startswith(ANATOMY) and k.endswith(BUSY)):
        there = [
            (fraction, wall[slot])
            for slot, fraction in table.present(key)
            if wall is not None and slot < len(wall) and math.isfinite(wall[slot])
        ]
        seconds = sum(w for _, w in there)
        if seconds > 0:
            busy = sum(min(1.0, max(0.0, f)) * w for f, w in there)
            idle.append((key[len(ANATOMY) : -len(BUSY)], 1.0 - busy / seconds))
    # A stall belongs to the steps' time unless a later attempt did its step again.
    kept = [s for s in stalls if not _redone(table, s)]
    return TimeSpent(
        steps_seconds=total, phases=by_phase, stalls=len(kept),
        stalls_seconds=sum(s.seconds for s in kept if s.seconds is not None),
        stalls_not_over=sum(1 for s in kept if not s.over),
        redone_steps=sum(table.superseded.values()), redone_seconds=table.redone_seconds,
        idle=idle,
    )  # fmt: skip


def _attempts(table: StepColumns) -> Attempts:
    return Attempts(
        resumes=[{"run_id": p.run_id, "attempt": p.attempt, "step": p.step}
                 for p in table.resumes.points()],
        superseded=[{"run_id": run_id, "attempt": attempt, "rows": rows}
                    for (run_id, attempt), rows in sorted(
                        table.superseded.items(), key=lambda item: (str(item[0][0]), item[0][1]))],
    )  # fmt: skip


def _attempts_note(table: StepColumns) -> str:
    """``attempt 2 resumed at step 501; 30 superseded rows of attempt 1 left out`` (each run
    named when the file holds several)."""
    named = len(table.run_ids) > 1
    by_run: dict[str | None, list[str]] = {}
    for point in table.resumes.points():
        by_run.setdefault(point.run_id, []).append(
            f"attempt {point.attempt} resumed at step {point.step}"
        )
    for (run_id, attempt), rows in sorted(
        table.superseded.items(), key=lambda item: (str(item[0][0]), item[0][1])
    ):
        by_run.setdefault(run_id, []).append(
            f"{rows} superseded row{'' if rows == 1 else 's'} of attempt {attempt} left out"
        )
    return "; ".join(
        (f"run {run_id}: " if named else "") + "; ".join(parts)
        for run_id, parts in by_run.items()
    )


def _short_ranges(steps: Iterable[int], most: int = 12) -> str:
    parts = step_ranges(steps).split(", ")
    if len(parts) <= most:
        return ", ".join(parts)
    return ", ".join(parts[: most // 2]) + ", …, " + ", ".join(parts[-most // 2 :])


def _largest_phase(
    table: StepColumns, slot: int, phases: Mapping[str, str]
) -> tuple[str | None, float | None]:
    best: tuple[str | None, float | None] = (None, None)
    for key, name in phases.items():
        value = table.value(key, slot)
        if math.isfinite(value) and (best[1] is None or value > best[1]):
            best = (name, value)
    return best


def _median(table: StepColumns, key: str) -> float:
    values = [v for _, v in table.present(key)]
    return statistics.median(values) if values else math.nan


def _anatomy(
    table: StepColumns, step: int, times: Sequence[float], median: float | None,
    measured_by: str, phases: Mapping[str, str],
) -> AnatomyOfStep:  # fmt: skip
    slot = table.slots[step]
    reduced = _reduced_timings(table, slot)
    leaves = {_leaf(key): value for key, value in reduced.items()}
    matched: set[str] = set()
    found = []
    for key, name in phases.items():
        seconds = table.value(key, slot)
        if not math.isfinite(seconds):
            continue
        phase = Phase(name, seconds, _median(table, key))
        leaf = name.rsplit("/", 1)[-1]
        if leaf in leaves:
            _, phase.slowest_rank, phase.skew = leaves[leaf]
            matched.add(leaf)
        found.append(phase)
    found.sort(key=lambda p: (-p.seconds, p.name))

    roles = []
    for key in table.columns:
        if key.startswith(ANATOMY) and key.endswith(BUSY):
            busy = table.value(key, slot)
            if math.isfinite(busy):
                role = key[len(ANATOMY) : -len(BUSY)]
                rank, kind = _role_rank(table, role, slot)
                roles.append(Role(role, busy, rank, kind))
    critical = _critical_path(table, slot, {r.role: r.rank for r in roles})
    timings = [
        ReducedTiming(key, seconds, rank, skew)
        for key, (seconds, rank, skew) in reduced.items()
        if _leaf(key) not in matched
    ]
    return AnatomyOfStep(
        step=step,
        seconds=times[slot],
        median=math.nan if median is None else median,
        measured_by=measured_by,
        phases=found,
        critical_path=critical,
        roles=roles,
        timings=timings,
    )


def _role_rank(table: StepColumns, role: str, slot: int) -> tuple[int | None, str]:
    """The rank a role's row names at this step, and which row (``slowest``, ``busiest``)."""
    for kind in RANK_KINDS:
        rank = table.value(f"{ANATOMY}{role}/{kind}_rank", slot)
        if math.isfinite(rank):
            return int(rank), kind
    return None, RANK_KINDS[0]


def _critical_path(table: StepColumns, slot: int, ranks: Mapping[str, int | None]) -> str | None:
    """The step's critical path with each link's seconds, from its ``anatomy/critical/<link>/
    seconds`` rows: a link under a role that reported at this step is that role's rank (the one
    its row names), any other the driver's. Without those rows, the latest
    ``anatomy/critical_path`` text at or before the step (the text is logged when it changes)."""
    driver, workers = [], []
    for key in table.columns:
        if not (key.startswith(CRITICAL_PREFIX) and key.endswith(SECONDS)):
            continue
        seconds = table.value(key, slot)
        if not math.isfinite(seconds):
            continue
        link = key[len(CRITICAL_PREFIX) : -len(SECONDS)]
        role, _, path = link.partition("/")
        if path and role in ranks:
            rank = ranks[role]
            who = f"{role} rank {rank}" if rank is not None else role
            workers.append(f"{who}:{path} ({duration(seconds)})")
        else:
            driver.append(f"driver:{link} ({duration(seconds)})")
    if driver or workers:
        return " > ".join(driver + workers)
    step = table.steps[slot]
    latest = max(
        ((table.steps[s], text) for s, text in table.critical_paths.items()
         if table.steps[s] <= step),
        default=None,
    )  # fmt: skip
    return latest[1] if latest is not None else None


def _reduced_timings(table: StepColumns, slot: int) -> dict[str, tuple[float, int, float | None]]:
    """``{timing key: (seconds, slowest rank, skew)}`` of the timings reduced across ranks at
    this step (``timing/<name>/slowest_rank`` rows, under any prefix)."""
    found = {}
    for key in table.columns:
        if not key.endswith(SLOWEST) or key.startswith(ANATOMY):
            continue
        stem = key[: -len(SLOWEST)]
        rank = table.value(key, slot)
        if not math.isfinite(rank) or not (stem.startswith(TIMING) or "/timing/" in stem):
            continue
        skew = table.value(stem + SKEW, slot)
        found[stem] = (table.value(stem, slot), int(rank), skew if math.isfinite(skew) else None)
    return found


def _leaf(timing_key: str) -> str:
    """``train/timing/worker_step`` → ``worker_step``: the timer's own name."""
    return timing_key.rsplit(TIMING, 1)[-1]


def _events_and_stalls(files: RunFiles) -> tuple[list[Stall], list[StragglerSeen], list[str]]:
    notes: list[str] = []
    stalls: list[Stall] = []
    if files.stalls is not None and files.stalls.is_dir():
        for path in sorted(files.stalls.glob("*.json")):
            try:
                stalls.append(_stall(StallFile.read(path)))
            except NotAStallReport as exc:
                notes.append(str(exc))
            except (OSError, ValueError) as exc:
                notes.append(f"could not read the stall report {path}: {exc}")
        stalls.sort(key=lambda s: (s.stalled_at or "", s.report))

    stragglers: list[StragglerSeen] = []
    stall_events: list[Stall] = []
    if files.events.is_file():
        skipped = SkippedLines(files.events.name)
        try:
            for _, event in json_lines(files.events, skipped):
                step = event.get("step") if type(event.get("step")) is int else None
                text = str(event.get("text") or event.get("title") or "")
                if event.get("event") == STRAGGLER_EVENT:
                    stragglers.append(StragglerSeen(step, text))
                elif event.get("event") != STALL_EVENT:
                    continue
                elif event.get("level") != "info":
                    at = event.get("time")
                    when = _iso(at) if isinstance(at, (int, float)) else None
                    stall_events.append(Stall(str(files.events), when, step, text, None))
                elif stall_events and stall_events[-1].ended is None:
                    stall_events[-1].ended = text  # the event that says it ended
        except OSError as exc:
            notes.append(f"cannot read {files.events}: {exc.strerror or exc}")
        notes += skipped.notes()
    if not stalls and stall_events:
        # The report could not be written (or lives elsewhere): the events still tell.
        stalls = stall_events
        notes.append(f"no stall report found; the stalls listed are the events of {files.events}")
    return stalls, stragglers, notes


def _iso(unix: float) -> str:
    """A Unix time as the stall reports write it (UTC, seconds)."""
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def _stall(report: StallFile) -> Stall:
    text = report.verdict or report.summary or _summary(report)
    over = report.ended_seconds is not None
    return Stall(
        report=report.path,
        stalled_at=report.stalled_at,
        last_step=report.last_step,
        text=text,
        ended=report.ended,
        seconds=report.ended_seconds if over else report.since_step,
        over=over,
        attempt=report.attempt,
        run_id=report.run_id,
    )


def _summary(report: StallFile) -> str:
    """A report without a verdict in words: how long, the threshold, the open timers."""
    text = "no step"
    if report.since_step is not None:
        text += f" for {duration(report.since_step)}"
    if report.threshold is not None:
        text += f" (threshold {duration(report.threshold)})"
    where = [f"{thread}: {' > '.join(names)}" for thread, names in report.open_timers.items()
             if names]  # fmt: skip
    if where:
        text += "; open timers: " + "; ".join(where)
    if report.stragglers:
        text += f"; {report.stragglers[0]}"
    return text
