"""When a run stops moving: the stall watchdog and the report that says where it stopped.

The training thread only stamps the time of each ``log_metrics`` call and of each new step
(:class:`~otel_rl.run.steps.StepAssembler`). A :class:`StallWatchdog` (one daemon thread) reads
those stamps: when no call came for longer than ``max(stalls.after, stalls.factor * median step time
of the recent steps)``, or a timer path has been open with no call for longer than its
:func:`phase_deadline` (``max(stalls.phase_after, stalls.factor * p95 of its recent uses)``), the
run is *stalled*. It then writes ``<log_dir>/stalls/<step>-<time>-<pid>.txt`` (never over a
report already there: processes sharing ``log_dir`` each keep theirs) and a ``.json`` twin
holding: the verdict (one sentence naming what the run waits for, down to
what is stuck: :mod:`otel_rl.watch.verdict`), the last step and how long ago, the timers open on
every thread (outermost first), the Python stack of every thread, the stacks of the run's Ray
actors (Ray's state API for the pids, ``py-spy`` for the stacks, within
``stalls.stacks_timeout``; the reason is written when they cannot be had), the timers open in
workers that reported them, the last GPU readings of the GPU bridge, the ranks that keep being
the slowest, and PyTorch's NCCL flight recorder dump of this process when it is on. Whoever
watches is told through ``on_stall`` (the Logger: gauges, an event to every output, one
warning); when the next step comes, through ``on_end`` (the stall's length), and "stall ended"
is added to the report.

Nothing here runs on the training thread, and a failure to gather one part of the report is
written into the report instead of it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.process.fork_safe_log import log as _log

__all__ = [
    "OpenPhase", "StallReport", "StallWatchdog", "overdue_phase", "phase_deadline",
    "stall_threshold",
]  # fmt: skip

#: Steps whose durations make the "median step time" of the threshold.
RECENT_STEPS = 20
#: The stall report's format (its ``version``); a report without one is of an older release
#: (1: ``stalled_at`` in whole seconds only, before ``stalled_at_unix``).
REPORT_VERSION = 2


def seconds(value: float) -> str:
    """``612 s``, ``2.5 s``, ``0.25 s``: as many digits as the size of the number needs."""
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def stall_threshold(after: float, factor: float, step_starts: Sequence[float]) -> float:
    """Seconds without a step after which the run is stalled: ``max(after, factor * median of the
    recent step durations)`` (``after`` alone before two steps have started)."""
    starts = list(step_starts)[-(RECENT_STEPS + 1) :]
    durations = [b - a for a, b in itertools.pairwise(starts)]
    if not durations:
        return after
    return max(after, factor * statistics.median(durations))


def p95(durations: Sequence[float]) -> float:
    """The 95th percentile of ``durations`` (linear between the two nearest ranks; the value
    itself for one)."""
    ordered = sorted(durations)
    position = 0.95 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def phase_deadline(after: float, factor: float, durations: Sequence[float]) -> float | None:
    """Seconds a timer path may stay open with no step logged: ``max(after, factor * p95 of its
    recent completed uses)``; ``None`` for a path never completed (the step-level threshold
    alone watches it)."""
    if not durations:
        return None
    return max(after, factor * p95(durations))


@dataclass(frozen=True)
class OpenPhase:
    """A timer path open on one thread, and its deadline."""

    thread: int
    path: str
    #: Monotonic time since which it has been open with no step logged: its start, or the last
    #: ``log_metrics`` call when that came later (a timer around the logging call is not stuck
    #: while steps come).
    since: float
    deadline: float
    p95: float
    uses: int

    @property
    def due(self) -> float:
        """Monotonic time it becomes a stall."""
        return self.since + self.deadline

    def reason(self, after: float, factor: float, now: float, thread: str) -> str:
        return (
            f"phase {self.path} ({thread}) open {now - self.since:.1f} s without a step: its "
            f"deadline max(phase_after {after:g} s, factor {factor:g} x p95 {self.p95:.3g} s of "
            f"its last {self.uses} uses)"
        )


def open_phases_with_deadlines(
    after: float,
    factor: float,
    phases: Mapping[int, Sequence[tuple[str, float]]],
    history: Callable[[str], Sequence[float]],
    last_call: float | None,
) -> list[OpenPhase]:
    """The open timer paths (``phases``: per thread, ``(path, monotonic start)``) that have a
    deadline, innermost first on each thread."""
    out: list[OpenPhase] = []
    for thread, stack in phases.items():
        for path, started in reversed(stack):
            durations = history(path)
            deadline = phase_deadline(after, factor, durations)
            if deadline is None:
                continue
            since = started if last_call is None else max(started, last_call)
            out.append(OpenPhase(thread, path, since, deadline, p95(durations), len(durations)))
    return out


def overdue_phase(watched: Sequence[OpenPhase], now: float) -> OpenPhase | None:
    """The phase to blame among those past their deadline at ``now``: the innermost (the run is
    stuck in ``step/generation`` rather than in ``step``), then the one furthest past it."""
    late = [phase for phase in watched if now > phase.due]
    if not late:
        return None
    return max(late, key=lambda p: (p.path.count("/"), (now - p.since) / p.deadline))


@dataclass
class StallReport:
    """One stall: what was known when it began, and how it ended."""

    run_id: str
    step: int | None  # the last step logged (None: none yet)
    began: float  # Unix time the watchdog saw the stall
    since_step: float  # seconds without a step then
    threshold: float
    threshold_reason: str
    open_timers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    threads: dict[str, list[str]] = field(default_factory=dict)
    ray: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    gpus: dict[str, Any] = field(default_factory=dict)
    stragglers: list[str] = field(default_factory=list)
    nccl: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    ended: dict[str, Any] | None = None
    #: Monotonic time of the last ``log_metrics`` call before the stall.
    last_call: float = 0.0
    #: What the run waits for (:mod:`otel_rl.watch.verdict`): ``{text, chain, missing}``.
    verdict: dict[str, Any] | None = None
    #: The launch of the run it happened in (a relaunch is the next attempt).
    attempt: int = 1

    @property
    def summary(self) -> str:
        """One paragraph: the verdict's sentence, then how long, since which step, inside which
        timers."""
        last = "no step logged yet" if self.step is None else f"last step {self.step}"
        where = "; ".join(
            f"{thread}: {' > '.join(t['name'] for t in timers)}"
            for thread, timers in self.open_timers.items()
            if timers
        )
        text = (
            f"run {self.run_id} stalled: no step for {seconds(self.since_step)} ({last}; "
            f"threshold {seconds(self.threshold)})"
        )
        if self.verdict is not None:
            text = f"{self.verdict['text']}. {text[0].upper()}{text[1:]}"
        if where:
            text += f"; open timers: {where}"
        if self.stragglers:
            text += f"; {self.stragglers[0]}"
        text += f"; report: {self.path}" if self.path is not None else "; no report (see above)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "run_id": self.run_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "last_step": self.step,
            "stalled_at": _iso(self.began),
            # the same instant to the microsecond: a picture of the run places the stall by it
            "stalled_at_unix": round(self.began, 6),
            "attempt": self.attempt,
            "seconds_since_step": round(self.since_step, 3),
            "threshold_seconds": round(self.threshold, 3),
            "threshold": self.threshold_reason,
            "open_timers": self.open_timers,
            "threads": self.threads,
            "ray": self.ray,
            "workers": self.workers,
            "gpus": self.gpus,
            "stragglers": self.stragglers,
            "verdict": self.verdict,
            "job": (self.verdict or {}).get("job"),
            "nccl_flight_recorder": self.nccl,
            "ended": self.ended,
        }

    def to_text(self) -> str:
        lines = ["otel-rl stall report"]
        if self.verdict is not None:
            lines += [f"verdict: {self.verdict['text']}", "how it is known:"]
            lines += [*chain_lines(self.verdict), ""]
        lines += [
            f"run {self.run_id}, pid {os.getpid()} on {socket.gethostname()}",
            f"stalled at {_iso(self.began)}: no step logged for {self.since_step:.1f} s "
            f"(threshold {self.threshold:.1f} s = {self.threshold_reason})",
            "last step: " + ("none yet" if self.step is None else str(self.step)),
            "",
            "open timers (outermost first):",
        ]
        if not any(self.open_timers.values()):
            lines.append("  none")
        for thread, timers in self.open_timers.items():
            if timers:
                chain = " > ".join(t["name"] for t in timers)
                lines.append(f"  {thread}: {chain} (innermost open {timers[-1]['seconds']:.1f} s)")
        if self.workers:
            lines += ["", "workers (timers open when they last reported):"]
            for name, info in self.workers.items():
                lines.append(f"  {name}: {info}")
        if self.stragglers:
            lines += ["", "ranks the run waits for:"] + [f"  {s}" for s in self.stragglers]
        lines += ["", "GPUs (last readings of the GPU bridge):"]
        lines += _indented(self.gpus)
        lines += ["", "threads of this process:"]
        for thread, stack in self.threads.items():
            lines.append(f"  {thread}:")
            lines += [f"    {line}" for frame in stack for line in frame.rstrip().splitlines()]
        lines += ["", "Ray actors and workers:"]
        lines += _indented(self.ray)
        lines += ["", "NCCL flight recorder:"]
        lines += _indented(self.nccl)
        if self.ended is not None:
            lines += ["", f"{self.ended['summary']} (at {self.ended['at']})"]
        return "\n".join(lines) + "\n"


def ended_summary(length: float, ran: bool = True) -> str:
    """The sentence of a stall's end, ``length`` seconds after the last call: steps resumed,
    or (``ran`` False) the run ended in it."""
    how = "steps resumed" if ran else "the run ended"
    return f"stall ended: {how} after {length:.1f} s without a step"


class NotAStallReport(ValueError):
    """A file among the stall reports that holds no report (JSON, but not an object)."""


@dataclass
class StallFile:
    """A stall report as its readers see it (``otel-rl why``, the run's picture): read back from
    its JSON file by :meth:`read`, the one place that knows the file's fields. Any version
    reads: a field an older report lacks is ``None`` (or its default)."""

    path: str
    #: Unix time the stall was seen: to the microsecond (``precise``), else from the whole
    #: seconds of ``stalled_at`` (reports of version 1); ``None`` when the report has neither.
    began: float | None
    precise: bool
    stalled_at: str | None
    last_step: int | None
    attempt: int
    #: Seconds without a step when the report was last written.
    since_step: float | None
    threshold: float | None
    #: The verdict's sentence ("" when it had none), and a summary a report of an older
    #: release may have in its place.
    verdict: str
    summary: str | None
    #: Each thread's open timers, outermost first, by name.
    open_timers: dict[str, list[str]]
    stragglers: list[str]
    #: The stall's end, once it ended: its summary and how long it lasted.
    ended: str | None
    ended_seconds: float | None
    #: The job verdict's parts (``JobVerdict.to_json``), when the job was compared.
    job: dict[str, Any] | None
    version: int = 1
    #: The run it happened in (two runs may share a log_dir; ``None``: the report names none).
    run_id: str | None = None

    @classmethod
    def read(cls, path: Path) -> StallFile:
        """The report at ``path``; ``OSError`` when it cannot be read, ``ValueError`` when it is
        not a stall report."""
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise NotAStallReport(f"{path} is not a stall report (not a JSON object)")
        return cls.from_json(raw, str(path))

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], path: str) -> StallFile:
        stalled_at = raw.get("stalled_at")
        at = read_number(raw.get("stalled_at_unix"), float)
        precise = at is not None
        if not precise:
            with contextlib.suppress(TypeError, ValueError, OverflowError, OSError):
                at = datetime.datetime.fromisoformat(str(stalled_at)).timestamp()
        verdict, ended, job = raw.get("verdict"), raw.get("ended"), raw.get("job")
        timers = raw.get("open_timers")
        stragglers = raw.get("stragglers")
        return cls(
            path=path, began=at, precise=precise,
            stalled_at=None if stalled_at is None else str(stalled_at),
            last_step=read_number(raw.get("last_step"), int),
            attempt=read_number(raw.get("attempt"), int) or 1,
            since_step=_seconds(raw.get("seconds_since_step")),
            threshold=_seconds(raw.get("threshold_seconds")),
            verdict=str((verdict.get("text") if isinstance(verdict, Mapping) else verdict) or ""),
            summary=str(raw["summary"]) if raw.get("summary") else None,
            open_timers={
                str(thread): [str(t.get("name")) for t in stack if isinstance(t, Mapping)]
                for thread, stack in (timers.items() if isinstance(timers, Mapping) else ())
                if isinstance(stack, list)
            },
            stragglers=[str(s) for s in stragglers] if isinstance(stragglers, list) else [],
            ended=str(ended.get("summary")) if isinstance(ended, Mapping) else None,
            ended_seconds=_seconds(ended.get("seconds")) if isinstance(ended, Mapping) else None,
            job=job if isinstance(job, dict) else None,
            version=read_number(raw.get("version"), int) or 1,
            run_id=raw["run_id"] if isinstance(raw.get("run_id"), str) else None,
        )  # fmt: skip


def read_number(value: Any, kind: type) -> Any:
    """A number read back from a file (a stall report, a job state) as ``kind``: an ``int`` only
    when it is one, a ``float`` only when finite; anything else (a bool, text) is ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind is int:
        return value if isinstance(value, int) else None
    return float(value) if math.isfinite(value) else None


def _seconds(value: Any) -> float | None:
    """A finite, non-negative number of seconds, else ``None``."""
    seconds = read_number(value, float)
    return seconds if seconds is not None and seconds >= 0 else None


def chain_lines(verdict: Mapping[str, Any]) -> Iterator[str]:
    """The report's lines for a verdict's chain (:mod:`otel_rl.watch.verdict`): each link with
    its evidence."""
    for number, link in enumerate(verdict.get("chain") or [], 1):
        yield f"  {number}. {link['process']}: {link['evidence']}"
    for note in verdict.get("missing") or []:
        yield f"  not known: {note}"


class StallWatchdog:
    """One daemon thread that notices a run that stopped logging steps and reports it.

    ``activity`` returns ``(last_call, last_step, step_starts)``: the monotonic time of the last
    ``log_metrics`` call (``None``: none yet), the last step logged, and the monotonic times
    recent steps began. ``gather`` fills a report's parts (called on this thread).

    With ``phases`` (the open timer paths per thread, :func:`otel_rl.telemetry.timing.open_phases`)
    and ``history`` (a path's recent durations, :func:`~otel_rl.telemetry.timing.phase_history`),
    a timer path open with no step logged for longer than its :func:`phase_deadline` is a stall
    too, reported at that moment; the step-level threshold still watches code outside timers and
    paths never completed.
    """

    def __init__(
        self,
        *,
        run_id: str,
        report_dir: Path,
        after: float,
        factor: float,
        activity: Callable[[], tuple[float | None, int | None, Sequence[float]]],
        gather: Callable[[StallReport], None],
        on_stall: Callable[[StallReport], None],
        on_end: Callable[[StallReport, float, int | None], None],
        started: float | None = None,
        phase_after: float = 30.0,
        phases: Callable[[], Mapping[int, Sequence[tuple[str, float]]]] | None = None,
        history: Callable[[str], Sequence[float]] | None = None,
        attempt: int = 1,
    ) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self.report_dir = report_dir
        self.after = float(after)
        self.factor = float(factor)
        self.phase_after = float(phase_after)
        self._phases = phases
        self._history = history
        #: Monotonic time the next open phase passes its deadline, as of the last look.
        self._due: float | None = None
        self._activity = activity
        self._gather = gather
        self._on_stall = on_stall
        self._on_end = on_end
        self._started = time.monotonic() if started is None else started
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._ended: tuple[StallReport, float, int | None] | None = None
        #: The stall under way, else ``None``.
        self.current: StallReport | None = None
        #: Every stall of the run, in order.
        self.reports: list[StallReport] = []
        self._thread = threading.Thread(
            target=self._run, name="otel-rl-stall-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def seconds_since_step(self) -> float:
        last, _, _ = self._activity()
        return time.monotonic() - (self._started if last is None else last)

    @property
    def stalled(self) -> bool:
        return self.current is not None

    def check(self) -> StallReport | None:
        """One look (the thread calls it; tests may too): hand on a stall that ended, or begin
        one. Returns the stall begun by this look, if any."""
        self._due = None
        with self._lock:
            ended, self._ended = self._ended, None
        if ended is not None:
            self._finish(*ended)
        if self.current is not None:
            return None
        last, step, starts = self._activity()
        now = time.monotonic()
        since_at = self._started if last is None else last
        since = now - since_at
        phase = self._overdue(last, now)
        if phase is not None:
            self._due = None
            thread = thread_names().get(phase.thread, f"thread {phase.thread}")
            reason = phase.reason(self.phase_after, self.factor, now, thread)
            return self._begin(step, since_at, since, phase.deadline, reason)
        threshold = stall_threshold(self.after, self.factor, starts)
        if since <= threshold:
            return None
        self._due = None
        return self._begin(step, since_at, since, threshold, self._step_reason(starts))

    def _overdue(self, last: float | None, now: float) -> OpenPhase | None:
        """The open phase past its deadline, if any; notes when the next one will be."""
        if self._phases is None or self._history is None:
            return None
        watched = open_phases_with_deadlines(
            self.phase_after, self.factor, self._phases(), self._history, last
        )
        self._due = min((p.due for p in watched if p.due >= now), default=None)
        return overdue_phase(watched, now)

    def resumed(self, at: float, step: int) -> float | None:
        """Called on the training thread by the first ``log_metrics`` after a stall, stamped
        ``at`` (monotonic) at ``step``: the stall's length (from the last call before it to
        that one: the row and the "stall ended" event say the same seconds, at the same step),
        handed on to this thread. Costs a lock; ``None`` when no stall was under way."""
        with self._lock:
            current = self.current
            if current is None:
                return None
            self.current = None
            length = at - current.last_call
            self._ended = (current, length, step)
        self._wake.set()
        return length

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._wait())
            self._wake.clear()
            try:
                self.check()
            except Exception as exc:  # the watchdog must outlive any bug of its own
                _log.warning("otel-rl: stall watchdog: %s: %s", type(exc).__name__, exc)
        with self._lock:
            ended, self._ended = self._ended, None
            unended, self.current = self.current, None
        if ended is not None:
            self._finish(*ended)
        if unended is not None:  # the run ended in it (its finish): that is its end
            self._finish(unended, time.monotonic() - unended.last_call, unended.step, ran=False)

    def _period(self) -> float:
        # Often enough to notice within a few percent of `after`, never busy; and to see a
        # phase well before its deadline (at least `phase_after` away), then wake when it is due.
        shortest = self.after if self._phases is None else min(self.after, self.phase_after)
        return min(5.0, max(0.05, shortest / 8))

    def _wait(self) -> float:
        period = self._period()
        due = self._due
        if due is None:
            return period
        return min(period, max(0.01, due - time.monotonic() + 0.01))

    def _step_reason(self, starts: Sequence[float]) -> str:
        reason = f"max(after {self.after:g} s, factor {self.factor:g} x median step "
        durations = [b - a for a, b in itertools.pairwise(starts)][-RECENT_STEPS:]
        return reason + (f"{statistics.median(durations):.3g} s)" if durations else "n/a)")

    def _begin(
        self, step: int | None, last_call: float, since: float, threshold: float, reason: str
    ) -> StallReport:
        report = StallReport(self.run_id, step, time.time(), since, threshold, reason)
        report.attempt = self.attempt
        report.last_call = last_call  # the recorded stamp: one clock, no second read
        try:
            self._gather(report)
        except Exception as exc:
            report.threads.setdefault("<report>", []).append(f"could not gather: {exc!r}")
        report.path = self._write(report)
        with self._lock:
            self.current = report
            self.reports.append(report)
        self._on_stall(report)
        # A call may have come while the report was gathered (stacks take seconds): then the
        # stall is already over, and no later call would tell.
        last, moved_to, _ = self._activity()
        if last is not None and last > report.last_call + 1e-9:
            with self._lock:
                if self.current is report:
                    self.current = None
                    self._ended = (report, last - report.last_call, moved_to)
            self._wake.set()
        return report

    def _finish(
        self, report: StallReport, length: float, step: int | None, ran: bool = True
    ) -> None:
        """The stall ended ``length`` seconds after the last call: at ``step``, the first
        logged after it, or (``ran`` False) with the run, still in it."""
        report.ended = {
            "at": _iso(time.time()),
            "seconds": round(length, 3),
            "summary": ended_summary(length, ran),
        }
        self._write(report)
        self._on_end(report, length, step)

    def _write(self, report: StallReport) -> Path | None:
        """The report's two files: its own again once it ended, else new ones under a name no
        other report has (the process's pid in it, then ``-2``, ``-3``… should it be taken)."""
        stamp = datetime.datetime.fromtimestamp(report.began, datetime.timezone.utc)
        name = f"{'none' if report.step is None else report.step}-{stamp:%Y%m%dT%H%M%SZ}"
        text, n = report.to_text().encode(), 1
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = report.path
            if path is not None:
                write_whole(path, text)
            while path is None:
                try:
                    path = self.report_dir / f"{name}-{os.getpid()}{'' if n == 1 else f'-{n}'}.txt"
                    write_whole(path, text, over=False)
                except FileExistsError:
                    path, n = None, n + 1
            data = json.dumps(report.to_json(), indent=2, default=str).encode()
            write_whole(path.with_suffix(".json"), data)
        except OSError as exc:
            _log.warning(
                "otel-rl: cannot write the stall report under %s: %s", self.report_dir, exc
            )
            return report.path
        return path


# ---- the parts of a report ---------------------------------------------------------------------


def thread_stacks(skip: int | None = None) -> dict[str, list[str]]:
    """The Python stack of every thread of this process (innermost last), by thread name: the
    main thread first, then the application's, then otel-rl's own (waiting, as a rule: their
    innermost frame only)."""
    names = {t.ident: t for t in threading.enumerate()}
    main: dict[str, list[str]] = {}
    others: dict[str, list[str]] = {}
    ours: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        thread = names.get(ident)
        name = thread.name if thread is not None else f"thread {ident}"
        stack = traceback.format_stack(frame)
        if thread is threading.main_thread():
            main[name + " (main)"] = stack
        elif name.startswith("otel-rl"):
            ours[name] = stack[-1:]
        else:
            others[name] = stack
    return {**main, **others, **ours}


def thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


def ray_state_address() -> str | None:
    """Where Ray's state API is to ask about the cluster this process is connected to: that
    cluster's dashboard. Left to itself the API looks for any cluster on this machine and refuses
    when it finds two (another job's, a second ``ray.init()`` beside this one), and a cluster
    started without its dashboard still records the default port, where another cluster's
    dashboard would answer about tasks it never ran. Raises ``LookupError`` when this cluster
    runs no dashboard; ``None`` where Ray cannot say (the API's own lookup then)."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            return None
        from ray._private.worker import get_dashboard_url

        url = str(get_dashboard_url() or "")  # type: ignore[no-untyped-call]
    except Exception:
        return None
    if not url:
        raise LookupError("no dashboard runs in this Ray cluster")
    return url if "://" in url else f"http://{url}"


def ray_stacks(timeout: float) -> dict[str, Any]:
    """The stacks of this job's live Ray actors, or why they cannot be had: ``py-spy dump`` of
    each actor's process on this node; on another node, the same dump run there by that node's
    Ray agent (asked through the dashboard, which allows it when the head node was started with
    ``RAY_DASHBOARD_ENABLE_PROFILING=1``)."""
    if "ray" not in sys.modules:
        return {"available": False, "reason": "Ray is not used in this process"}
    import ray

    if not ray.is_initialized():
        return {"available": False, "reason": "ray.init() has not been called in this process"}
    deadline = time.monotonic() + timeout
    try:
        from ray.util.state import list_actors

        context = ray.get_runtime_context()
        job, here = context.get_job_id(), context.get_node_id()
        dashboard = ray_state_address()
        actors = list_actors(
            address=dashboard,
            filters=[("job_id", "=", job), ("state", "=", "ALIVE")],
            timeout=max(1, int(timeout)),
            raise_on_missing_output=False,
        )
    except Exception as exc:
        reason = (f"Ray's state API did not answer ({type(exc).__name__}: {exc}); it needs the "
                  "dashboard (ray[default], include_dashboard not False)")  # fmt: skip
        return {"available": False, "reason": reason}
    local = _local_addresses()
    out: dict[str, Any] = {"available": True, "actors": []}
    for actor in actors:
        info = actor if isinstance(actor, Mapping) else vars(actor)
        name = info.get("name") or ""
        entry: dict[str, Any] = {
            "actor": f"{info.get('class_name')}{f' {name!r}' if name else ''}",
            "actor_id": info.get("actor_id"),
            "pid": info.get("pid"),
            "node": info.get("node_id"),
        }
        address = (info.get("address") or {}) if isinstance(info.get("address"), Mapping) else {}
        ip = address.get("ip_address") or info.get("ip") or None
        left = deadline - time.monotonic()
        pid = info.get("pid")
        if left <= 0:
            entry["stack"] = None
            entry["reason"] = f"stalls.stacks_timeout ({timeout:g} s) ran out"
        elif not pid:
            entry["stack"], entry["reason"] = None, "Ray did not report the actor's pid"
        elif info.get("node_id") not in (None, here) and dashboard is not None:
            entry["stack"], why_not = agent_py_spy_dump(dashboard, info["node_id"], int(pid), left)
            entry["via"] = f"the Ray agent of node {str(info['node_id'])[:8]}…"
            if why_not and (ip is None or ip in local):  # another raylet of this machine
                entry["via"] = f"py-spy on this machine (the agent: {why_not})"
                entry["stack"], why_not = py_spy_dump(int(pid), deadline - time.monotonic())
            if why_not:
                entry["reason"] = why_not
        elif ip is not None and ip not in local:
            entry["stack"], entry["reason"] = None, f"on another node ({ip}): run py-spy there"
        else:
            entry["stack"], why_not = py_spy_dump(int(pid), left)
            if why_not:
                entry["reason"] = why_not
        out["actors"].append(entry)
    return out


def agent_py_spy_dump(
    dashboard: str, node_id: str, pid: int, timeout: float
) -> tuple[str | None, str | None]:
    """``py-spy dump`` of ``pid`` run by the Ray agent of node ``node_id``, asked through the
    dashboard, or ``(None, why not)``."""
    import requests  # Ray's dashboard (ray[default]) depends on it

    headers: dict[str, str] = {}
    with contextlib.suppress(Exception):  # the cluster's token, as Ray's own state API sends it
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )

        headers = dict(get_auth_headers_if_auth_enabled({}))
    try:
        reply = requests.get(f"{dashboard.rstrip('/')}/worker/traceback",
                             params={"node_id": node_id, "pid": str(pid)}, headers=headers,
                             timeout=max(0.5, timeout))  # fmt: skip
    except requests.RequestException as exc:
        return None, f"the dashboard did not answer for node {node_id[:8]}… ({exc})"
    if reply.ok:
        return reply.text, None
    said = " ".join(reply.text.split())[:200]
    if "RAY_DASHBOARD_ENABLE_PROFILING" in reply.text:
        said = "start the head node with RAY_DASHBOARD_ENABLE_PROFILING=1 to allow it"
    return None, (f"node {node_id[:8]}…'s Ray agent did not dump pid {pid} "
                  f"(HTTP {reply.status_code}: {said})")  # fmt: skip


def py_spy_dump(pid: int, timeout: float) -> tuple[str | None, str | None]:
    """``py-spy dump --pid`` output, or ``(None, why not)``."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy")
    if exe is None:
        return None, "py-spy is not installed (pip install py-spy, or ray[default])"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=max(0.5, timeout))  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"py-spy did not answer within {timeout:.1f} s"
    except OSError as exc:
        return None, f"py-spy failed to start: {exc}"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        return None, f"py-spy could not read pid {pid}: {reason[-1] if reason else done.returncode}"
    return done.stdout, None


def nccl_flight_recorder(report_dir: Path, stamp: str) -> dict[str, Any]:
    """This process's dump of PyTorch's NCCL flight recorder (the last collectives of its rank),
    or why there is none."""
    if "torch" not in sys.modules:
        return {"available": False, "reason": "torch is not imported in this process"}
    import torch

    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return {"available": False,
                "reason": "torch.distributed is not initialised in this process"}  # fmt: skip
    backend = str(dist.get_backend())
    if "nccl" not in backend:
        return {"available": False,
                "reason": f"the process group's backend is {backend}: the flight recorder "
                          "records NCCL collectives only"}  # fmt: skip
    size = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    if not size.isdigit() or int(size) <= 0:
        reason = ("the flight recorder is off: set TORCH_NCCL_TRACE_BUFFER_SIZE (e.g. 2000) in "
                  "every rank's environment before the process group starts")  # fmt: skip
        return {"available": False, "reason": reason}
    try:
        dump = torch._C._distributed_c10d._dump_nccl_trace()  # type: ignore[attr-defined]
    except Exception as exc:
        return {"available": False, "reason": f"the dump failed: {type(exc).__name__}: {exc}"}
    path = report_dir / f"{stamp}-nccl-rank{dist.get_rank()}.pickle"
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dump)
    except OSError as exc:
        return {"available": False, "reason": f"cannot write {path}: {exc}"}
    return {"available": True, "rank": dist.get_rank(), "path": str(path)}


def gpu_readings(latest: Mapping[int, Any]) -> dict[str, Any]:
    """The GPU bridge's last reading of each node (utilisation %, memory MiB)."""
    if not latest:
        return {"available": False, "reason": "no reading yet (monitor_gpus off, or no node "
                "answered)"}  # fmt: skip
    nodes: dict[str, Any] = {}
    for node, cached in sorted(latest.items()):
        sample = cached.sample
        nodes[f"node.{node}"] = {
            "host": getattr(cached.target, "host", None),
            "seconds_ago": round(time.monotonic() - cached.at, 1),
            "gpus": {
                str(gpu.label): {"util_percent": gpu.utilization,
                                 "mem_used_mib": gpu.memory_used_mib,
                                 "mem_total_mib": gpu.memory_total_mib}
                for gpu in sample.gpus.values()
            },
        }
    return {"available": True, "nodes": nodes}


def _local_addresses() -> set[str]:
    addresses = {"127.0.0.1", "localhost"}
    with contextlib.suppress(OSError):
        addresses.add(socket.gethostbyname(socket.gethostname()))
    try:
        import ray

        addresses.add(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:
        pass
    return addresses


def _indented(value: Any, depth: int = 1) -> list[str]:
    pad = "  " * depth
    if isinstance(value, Mapping):
        lines: list[str] = []
        for key, item in value.items():
            if isinstance(item, (Mapping, list)) and item:
                lines.append(f"{pad}{key}:")
                lines += _indented(item, depth + 1)
            elif isinstance(item, str) and "\n" in item:
                lines.append(f"{pad}{key}:")
                lines += [f"{pad}  {line}" for line in item.rstrip().splitlines()]
            else:
                lines.append(f"{pad}{key}: {item}")
        return lines or [f"{pad}(none)"]
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, Mapping):
                lines += _indented(item, depth)
                lines.append("")
            else:
                lines.append(f"{pad}{item}")
        return lines or [f"{pad}(none)"]
    return [f"{pad}{value}"]


def _iso(unix: float) -> str:
    moment = datetime.datetime.fromtimestamp(unix, datetime.timezone.utc)
    return moment.isoformat(timespec="seconds")


def write_whole(path: Path, data: bytes, *, over: bool = True) -> None:
    """``data`` at ``path``, whole or not at all, through a file of this thread's beside it, made
    new (a link, a pipe, whatever was left at its name is removed, never opened). With ``over``
    ``False``, only where no file is (else ``FileExistsError``): what another process wrote is
    never written over."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(tmp, flags, 0o666), "wb") as out:
            out.write(data)
        if over:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # fails on a name taken, and shows the file whole at once
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: the name taken first, then filled
            os.close(os.open(path, flags, 0o666))
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
