"""What a run's files say happened when: spans on lanes, steps, stalls, GPU use, each step's
anatomy, where the job's processes were; read from ``LOG_DIR`` alone (``traces.jsonl``,
``metrics.jsonl``, ``stalls/``, ``job/``).

A lane is one thread of one process (its role, rank, pid, host, and the thread's name where the
span says it). Times are seconds since the run's first span or row (``t0``, Unix seconds), so
that lanes of several processes and nodes line up on one axis, as the spans' own clocks do.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from otel_rl.telemetry.trace_file import read_requests, tail_lines
from otel_rl.telemetry.tracing import STEP_ATTRIBUTE, STEP_SPAN
from otel_rl.watch.job_state import DirectoryBoard, JobStates
from otel_rl.watch.job_verdict import job_verdict
from otel_rl.watch.stalls import StallFile

_GPU_UTIL = re.compile(r"^ray/node\.(?P<node>[^.]+)\.gpu\.(?P<gpu>.+)\.util$")
_ANATOMY_PHASE = re.compile(r"^anatomy/(?P<phase>[^/]+(?:/[^/]+)*)/seconds$")
#: The step's wall time among the anatomy rows (not a phase of it).
_WALL = "wall"


@dataclass
class Span:
    lane: int
    name: str
    start: float  # seconds since t0
    end: float
    step: int | None
    attributes: dict[str, Any]
    trace_id: str
    span_id: str
    parent_id: str
    #: The launch of the run that recorded it (``otel_rl.attempt``; a relaunch is the next), or
    #: of its step's ``rl.step`` span where its own resource does not say (a worker's).
    attempt: int | None = None


@dataclass
class Lane:
    process: str  # "driver 0 · pid 123 · host"
    thread: str
    resource: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.process} · {self.thread}" if self.thread else self.process


@dataclass
class Step:
    step: int
    start: float
    end: float
    #: Phase → seconds (the step's ``anatomy/<phase>/seconds`` rows), when anatomy is on.
    anatomy: dict[str, float] = field(default_factory=dict)
    #: The launch it is shown at (its latest), and whether an earlier one ran it too.
    attempt: int = 1
    redone: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class StallSpan:
    """A stall on the picture: from the end of the last step before it to the next step (``end``
    ``None``: it never ended), read from its report (:class:`~otel_rl.watch.stalls.StallFile`)."""

    start: float
    end: float | None
    last_step: int | None
    verdict: str
    report: str
    attempt: int = 1
    #: How long it had lasted when its report was last written (one that never ended).
    lasted: float = 0.0


@dataclass
class Places:
    """Where each process of the job was (``when``), as the verdict names them (``sentence``:
    the ones not where the rest are; empty when all are alike)."""

    when: str
    sentence: str
    #: (process, its last step, where it was, named by the verdict).
    processes: list[tuple[str, str, str, bool]]


@dataclass
class RunPicture:
    log_dir: Path
    t0: float
    lanes: list[Lane]
    spans: list[Span]
    steps: list[Step]
    stalls: list[StallSpan]
    #: "node n · GPU i" → [(seconds since t0, utilisation %)].
    gpus: dict[str, list[tuple[float, float]]]
    places: list[Places] = field(default_factory=list)


def load_run(log_dir: str | Path, tail_bytes: int | None = None) -> RunPicture:
    """Everything the picture shows, read from the run's files (missing files: empty parts);
    ``tail_bytes``: only about the last that many bytes of the trace files and of
    ``metrics.jsonl`` (the latest steps of a long run, read in a bounded time)."""
    root = Path(log_dir)
    raw_spans = list(_otlp_spans(read_requests(root, tail_bytes)))
    rows = list(_jsonl(root / "metrics.jsonl", tail_bytes))
    stall_reports = _stall_reports(root / "stalls")
    starts = [s["start"] for s in raw_spans]
    starts += [r["time"] for r in rows]
    starts += [_start(s) for s in stall_reports]
    t0 = min(starts, default=0.0)

    launch_of = _launches(raw_spans, rows)
    lanes: list[Lane] = []
    lane_of: dict[tuple[Any, ...], int] = {}
    names: dict[tuple[Any, ...], int] = {}  # threads of one process with one name: numbered
    spans: list[Span] = []
    for raw in sorted(raw_spans, key=lambda s: s["start"]):
        resource, attributes = raw["resource"], raw["attributes"]
        process = (resource.get("host.name"), resource.get("process.pid"),
                   resource.get("otel_rl.role"), resource.get("otel_rl.rank"))  # fmt: skip
        thread = str(attributes.get("thread.name", ""))
        key = (*process, attributes.get("thread.id", thread))
        if key not in lane_of:
            lane_of[key] = len(lanes)
            named = (*process, thread)
            seen = names[named] = names.get(named, 0) + 1
            label = thread if seen == 1 else f"{thread} #{seen}"
            lanes.append(Lane(_process_name(resource), label, resource))
        step = attributes.get(STEP_ATTRIBUTE)
        attempt = resource.get("otel_rl.attempt")
        if launch_of and isinstance(attempt, int):
            attempt = launch_of[resource.get("otel_rl.run_id"), attempt]
        spans.append(Span(
            lane=lane_of[key], name=raw["name"], start=raw["start"] - t0, end=raw["end"] - t0,
            step=step if isinstance(step, int) else None, attributes=attributes,
            trace_id=raw["trace_id"], span_id=raw["span_id"], parent_id=raw["parent_id"],
            attempt=attempt if isinstance(attempt, int) else None,
        ))  # fmt: skip
    _of_their_step(spans)
    steps = _steps(spans, rows, t0)
    stalls = [_stall(report, steps, t0, launch_of) for report in stall_reports]
    places = _places(stall_reports, root / "job", t0)
    return RunPicture(root, t0, lanes, spans, steps, stalls, _gpus(rows, t0), places)


def _launches(raw_spans: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[Any, int]:
    """When more than one run wrote to the folder (a script run twice on one log_dir, each with
    its own run_id): ``{(run_id, attempt): launch}``, the launches numbered 1, 2, ... in the
    order they began, which then stand for the attempts (the latest launch of a step is the one
    shown, as a relaunch's is); the rows' ``attempt`` is renumbered so too. Else empty: a run's
    own attempts stand."""
    began: dict[tuple[Any, int], float] = {}
    for raw in raw_spans:
        resource = raw["resource"]
        attempt = resource.get("otel_rl.attempt")
        if isinstance(attempt, int):
            key = (resource.get("otel_rl.run_id"), attempt)
            began[key] = min(began.get(key, raw["start"]), raw["start"])
    for row in rows:
        key = (row.get("run_id"), _attempt(row))
        began[key] = min(began.get(key, row["time"]), row["time"])
    if len({run_id for run_id, _ in began}) < 2:
        return {}
    order = sorted(began, key=lambda key: (began[key], key[1]))
    launch_of = {key: number for number, key in enumerate(order, 1)}
    for row in rows:
        row["attempt"] = launch_of[row.get("run_id"), _attempt(row)]
    return launch_of


def _stall(
    report: StallFile, steps: list[Step], t0: float, launch_of: Mapping[Any, int]
) -> StallSpan:
    """A stall runs from the end of the last step before it to the next step. A report with its
    times in whole seconds only starts at that step's end, where the run has it. Of a folder of
    several runs, its attempt is its run's launch (:func:`_launches`)."""
    start = _start(report) - t0
    attempt = launch_of.get((report.run_id, report.attempt), report.attempt)
    last = next((s for s in steps if s.step == report.last_step), None)
    if not report.precise and last is not None and abs(last.end - start) < 2.0:
        start = last.end
    seconds = report.ended_seconds
    return StallSpan(start, None if seconds is None else start + seconds, report.last_step,
                     report.verdict, report.path, attempt,
                     lasted=report.since_step or 0.0)  # fmt: skip


def _process_name(resource: Mapping[str, Any]) -> str:
    role = resource.get("otel_rl.role") or resource.get("service.name") or "process"
    rank = resource.get("otel_rl.rank")
    parts = [str(role) if rank is None else f"{role} {rank}"]
    parts.append(f"pid {resource.get('process.pid', '?')}")
    if resource.get("host.name"):
        parts.append(str(resource["host.name"]))
    return " · ".join(parts)


def _of_their_step(spans: list[Span]) -> None:
    """A span inside a step's trace belongs to that step, and to that step's launch where it
    does not say its own (its ``rl.step`` root says which)."""
    roots = {s.trace_id: s for s in spans if s.name == STEP_SPAN}
    for span in spans:
        root = roots.get(span.trace_id)
        if root is not None:
            span.step = root.step if span.step is None else span.step
            span.attempt = root.attempt if span.attempt is None else span.attempt


def _steps(spans: list[Span], rows: list[dict[str, Any]], t0: float) -> list[Step]:
    """Steps from the ``rl.step`` spans of each step's latest attempt (a relaunch redoes steps:
    the earlier attempt's are left out, as ``otel-rl why`` leaves out its rows); without
    tracing, from the rows: a step ends when its row was written (which may lag a step behind)
    and lasts its ``anatomy/wall/seconds``."""
    latest_rows: dict[int, dict[str, Any]] = {}
    row_attempts: dict[int, set[int]] = {}
    for row in rows:
        if row.get("axis") is not None or type(row.get("step")) is not int:
            continue
        row_attempts.setdefault(row["step"], set()).add(_attempt(row))
        kept = latest_rows.get(row["step"])
        if kept is None or _attempt(row) >= _attempt(kept):
            latest_rows[row["step"]] = row
    anatomy = {step: _anatomy(row["metrics"]) for step, row in latest_rows.items()}
    attempts: dict[int, set[int]] = {}
    for span in spans:
        if span.name == STEP_SPAN and span.step is not None:
            attempts.setdefault(span.step, set()).add(span.attempt or 1)
    by_step: dict[int, Step] = {}
    for span in spans:  # a step may be several spans (a segment per log call that opened it)
        if span.name != STEP_SPAN or span.step is None:
            continue
        ran = attempts[span.step]
        if (span.attempt or 1) != max(ran):
            continue
        known = by_step.get(span.step)
        if known is None:
            by_step[span.step] = Step(span.step, span.start, span.end, _phases(anatomy, span.step),
                                      max(ran), len(ran) > 1)  # fmt: skip
        else:
            known.start, known.end = min(known.start, span.start), max(known.end, span.end)
    if by_step:
        return sorted(by_step.values(), key=lambda s: s.step)
    steps: list[Step] = []
    for step, row in sorted(latest_rows.items(), key=lambda item: item[1]["time"]):
        end = row["time"] - t0
        wall = anatomy[step].get(_WALL)
        steps.append(Step(step, end - wall if wall else end, end, _phases(anatomy, step),
                          _attempt(row), len(row_attempts[step]) > 1))  # fmt: skip
    return sorted(steps, key=lambda s: s.step)


def _attempt(row: Mapping[str, Any]) -> int:
    attempt = row.get("attempt")
    return attempt if type(attempt) is int else 1


def _phases(anatomy: Mapping[int, Mapping[str, float]], step: int) -> dict[str, float]:
    return {k: v for k, v in anatomy.get(step, {}).items() if k != _WALL}


def _anatomy(metrics: Any) -> dict[str, float]:
    phases: dict[str, float] = {}
    if not isinstance(metrics, dict):
        return phases
    for key, value in metrics.items():
        match = _ANATOMY_PHASE.match(key)
        if match is None or not isinstance(value, (int, float)):
            continue
        if not match["phase"].startswith("critical/"):  # the critical path's copy of a phase
            phases[match["phase"]] = float(value)
    return phases


def _gpus(rows: Iterable[dict[str, Any]], t0: float) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        when, metrics = row["time"], row.get("metrics")
        if row.get("axis") is None or not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            match = _GPU_UTIL.match(key)
            if match and type(value) in (int, float) and math.isfinite(value):
                name = f"node {match['node']} · GPU {match['gpu']}"
                series.setdefault(name, []).append((when - t0, float(value)))
    return series


def _stall_reports(folder: Path) -> list[StallFile]:
    """The stall reports that say when their stall began."""
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            report = StallFile.read(path)
        except (OSError, ValueError):
            continue
        if report.began is not None:
            found.append(report)
    return found


def _start(report: StallFile) -> float:
    """When the stall began: the end of the last step before it (Unix time)."""
    assert report.began is not None
    return report.began - (report.since_step or 0.0)


def _places(reports: list[StallFile], job_dir: Path, t0: float) -> list[Places]:
    """Where the job's processes were: as the verdict of the run's last stall that has one names
    them, and as each last published (``<log_dir>/job/``, compared as of the last of them)."""
    places = []
    judged = [r for r in reports if r.job is not None]
    if judged:
        last = max(judged, key=_start)
        after = "before the first step" if last.last_step is None else (
            f"after step {last.last_step}")  # fmt: skip
        places.append(_job_places(last.job or {}, f"at the stall {after}"))
    found = JobStates()
    found.states = [s for s in DirectoryBoard(job_dir, started=0.0).read()[0]
                    if s.published >= t0]  # fmt: skip
    if found.states:
        at = max(s.published for s in found.states)
        clock = datetime.fromtimestamp(at, timezone.utc).strftime("%H:%M:%S UTC")
        places.append(_job_places(job_verdict(found, at).to_json(),
                                  f"as each last published ({job_dir}), at {clock}"))  # fmt: skip
    return places


def _job_places(job: Mapping[str, Any], when: str) -> Places:
    """A job verdict's processes (a stall report's ``job``), each with where it was."""
    named = {(p.get("pid"), p.get("node")): p.get("last_heard")
             for key in ("odd_ones_out", "not_heard_from")
             for p in _dicts(job.get(key))}  # fmt: skip
    ended = {(p.get("pid"), p.get("node")): p.get("ended") for p in _dicts(job.get("ended"))}
    rows = []
    for process in _dicts(job.get("processes")):
        phase, wait, at = process.get("phase"), process.get("wait"), process.get("at")
        where = [f"inside {' > '.join(str(phase).split('/'))}" if phase else "outside any timer",
                 f"waits on {wait}" if wait else f"at {at}" if at else "",
                 f"pid {process.get('pid')} on {process.get('node')}"]  # fmt: skip
        key = (process.get("pid"), process.get("node"))
        if named.get(key):
            where.append(f"not heard from since {named[key]}")
        elif ended.get(key):
            where.append(f"finished its run at {ended[key]}")
        step = process.get("step")
        rows.append((str(process.get("name")), "" if step is None else str(step),
                     ", ".join(w for w in where if w), key in named))  # fmt: skip
    return Places(when, str(job.get("sentence") or ""), rows)


def _jsonl(path: Path, tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        return
    for line in tail_lines([path], tail_bytes):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        when = row.get("time") if isinstance(row, dict) else None
        if type(when) in (int, float) and math.isfinite(float(when)):  # type: ignore[arg-type]
            yield row  # a row without a time has no place on the axis


def _otlp_spans(requests: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each span of OTLP JSON requests, flattened: name, start/end (Unix seconds), ids,
    attributes and its resource's attributes. What is not shaped as OTLP is skipped."""
    for request in requests:
        for resource_spans in _dicts(request.get("resourceSpans")):
            resource_node = resource_spans.get("resource")
            resource = _attributes(
                resource_node.get("attributes") if isinstance(resource_node, dict) else None
            )
            for scope_spans in _dicts(resource_spans.get("scopeSpans")):
                for span in _dicts(scope_spans.get("spans")):
                    try:
                        start = int(span["startTimeUnixNano"]) / 1e9
                        end = int(span.get("endTimeUnixNano") or span["startTimeUnixNano"]) / 1e9
                    except (KeyError, ValueError, TypeError):
                        continue
                    yield {
                        "name": str(span.get("name", "")), "start": start, "end": end,
                        "attributes": _attributes(span.get("attributes")),
                        "resource": resource, "trace_id": str(span.get("traceId", "")),
                        "span_id": str(span.get("spanId", "")),
                        "parent_id": str(span.get("parentSpanId", "")),
                    }  # fmt: skip


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _attributes(key_values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in _dicts(key_values):
        value = kv.get("value")
        if not isinstance(value, dict):
            continue
        key = str(kv.get("key", ""))
        for kind, item in value.items():
            if kind == "intValue":
                with contextlib.suppress(TypeError, ValueError):
                    out[key] = int(item)
            elif kind in ("stringValue", "doubleValue", "boolValue"):
                out[key] = item
            elif kind == "arrayValue" and isinstance(item, dict):
                out[key] = [next(iter(v.values()), None) for v in _dicts(item.get("values"))]
    return out
