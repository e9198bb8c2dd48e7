"""Replay: deliver what a run's trackers did not get.

Reads each tracker's spool under ``<log_dir>/.otel-rl/spool/``, rebuilds the tracker from the
run's saved config (plus what the tracker recorded to reopen its run, e.g. the MLflow or W&B run
id), and writes every record not yet marked done, in step order. The trackers are replayed side
by side, each on a thread of its own (:func:`_side_by_side`; the launches of one tracker's run
one after another on it, in the order they ran), so a slow tracker holds back only itself. Each
record is marked done as soon as the tracker holds it, so a replay killed at any moment and run
again converges to every record delivered exactly once.

The backlog is never held in memory, however long: each spool is read once for what to send and
in what order (:class:`~otel_rl.delivery.replay_plan.ReplayPlan`: a few numbers per run of
records in step order, none per record), then again as the records are sent, each decoded when
its turn comes.

A spool line that cannot be read is reported (file, byte offset, reason) and makes the command
exit non-zero; every other record, tracker and run is still replayed. A reported line is set aside
(noted in the spool), so the next replay passes over it.

Each spool is delivered under its lock (:class:`~otel_rl.delivery.spool.SpoolLock`): the training
process holds it while it runs, a replay while it delivers, so two replays or a replay and the
live run never deliver the same records. A tracker runs in the directory the run started in, so
relative paths (``log_dir``, ``jsonl.path``, an MLflow ``sqlite:///`` store) land where the run
wrote them, whichever directory the replay is started from; this changes the process's working
directory while a tracker is replayed (:class:`_WorkingDirectory`: trackers whose runs started in
one directory share it, one started elsewhere waits for it).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.config.loading import resolve_settings
from otel_rl.delivery.channel import Channel
from otel_rl.delivery.handoff import complete_spools
from otel_rl.delivery.registry import exporter_class
from otel_rl.delivery.replay_plan import (
    PlanStopped,
    ReplayPlan,
    SpoolChanged,
    Waiting,
    landed_before_the_kill,
)
from otel_rl.delivery.spool import (
    REPLAY_LOCK,
    DoneMarks,
    SeqSet,
    Skipped,
    SpoolBusy,
    SpoolLock,
    pending_count,
    read_acks,
    read_meta,
    spool_dirs,
    spools_of_run,
    tracker_runs_of,
    waiting_records,
    write_meta,
)
from otel_rl.delivery.tracker import Tracker
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.process.lifecycle import KILLED_EXIT_CODE
from otel_rl.run.history import ATTEMPT_KEY, LAUNCH_KEY

#: ``otel-rl replay``'s exit code when a spool was in use (by the live run or another replay)
#: and everything else went through: try again later (``EX_TEMPFAIL``).
BUSY_EXIT_CODE = 75


@dataclass
class ReplayResult:
    """What one tracker of one run had waiting and what it got."""

    tracker: str
    run_id: str
    pending: int
    delivered: int
    skipped: list[Skipped] = field(default_factory=list)
    rejected: int = 0
    error: str | None = None
    #: Who held the spool, when it was in use (nothing was delivered then).
    busy: str | None = None

    @property
    def complete(self) -> bool:
        return (
            self.error is None
            and self.busy is None
            and not self.skipped
            and self.delivered + self.rejected >= self.pending  # refused ones: set aside
        )

    @property
    def lost(self) -> dict[str, int]:
        """Records this replay could not deliver and never will, by reason (docs/reliability.md):
        ``corrupt`` (unreadable spool lines), ``refused`` (the tracker refused them)."""
        lost = {
            "corrupt": _records_of([s for s in self.skipped if s.kind != "missing"]),
            "spool_vanished": _records_of([s for s in self.skipped if s.kind == "missing"]),
            "refused": self.rejected,
        }
        return {reason: n for reason, n in lost.items() if n}


def _records_of(lines: list[Skipped]) -> int:
    """The records ``lines`` held, each once: the pieces of a line damage cut in two name the
    same numbers (a line whose numbers nothing tells held one)."""
    count = sum(1 for line in lines if line.seqs is None)
    reach = None  # the end of the numbers counted so far, in order of their start
    for seqs in sorted((line.seqs for line in lines if line.seqs), key=lambda r: r.start):
        start = seqs.start if reach is None else max(seqs.start, reach)
        count += max(0, seqs.stop - start)
        reach = seqs.stop if reach is None else max(reach, seqs.stop)
    return count


def spooled_runs(
    log_dir: str | Path, run_id: str | None = None, before_attempt: int | None = None
) -> list[Path]:
    """Spool directories (one per tracker and launch of a run) under ``log_dir``: each with its
    ``meta.json``, or with segments only (its metadata lost: reported, never skipped). The
    launches of one run come in the order they ran (their attempt), so a tracker gets an earlier
    attempt's records before a later one's. ``run_id``: only that run's; ``before_attempt``: only
    its launches before that one (a relaunch completing its earlier launches, never its own)."""
    found = set(spool_dirs(log_dir))
    if run_id is not None:
        found = {d for d in found if _run_of(d) == run_id}
    if before_attempt is not None:
        found = {d for d in found if _attempt_of(d) < before_attempt}
    return sorted(found, key=lambda d: (d.parent.name, _run_of(d), _attempt_of(d), d.name))


def _run_of(directory: Path) -> str:
    meta = read_meta(directory)
    return str(meta.get("run_id", directory.name.partition("%restart-")[0]))


def _attempt_of(directory: Path) -> int:
    attempt = read_meta(directory).get("attempt", 1)
    return attempt if type(attempt) is int else 1


def replay(
    log_dir: str | Path,
    progress: bool = True,
    timeout: float = 300.0,
    wait: float = 0.0,
    run_id: str | None = None,
    before_attempt: int | None = None,
) -> list[ReplayResult]:
    """Replay every spool under ``log_dir`` (``run_id``, ``before_attempt``: that run's only, as
    :func:`spooled_runs` selects); returns what each tracker had and got.

    A spool in use (the run is alive, or another replay delivers it) is waited for up to
    ``wait`` seconds, then left alone and reported (``ReplayResult.busy``).
    """
    log_dir = Path(log_dir).absolute()  # trackers run in the run's directory, not this one
    results = []
    with _signals_deferred() as interrupted:
        # What delivery processes were handed and never spooled joins the spools first.
        # A relaunch completing its earlier launches (before_attempt) waits for no live
        # launch's handoff: the one in use is its own delivery process's.
        handoffs_wait = 0.0 if before_attempt is not None else wait
        for intake in complete_spools(log_dir, handoffs_wait, stop=lambda: bool(interrupted)):
            if intake.busy is not None and before_attempt is not None:
                continue
            if intake.busy is not None or intake.error is not None:
                results.append(ReplayResult("handoff", f"pid {intake.pid}", 0, 0,
                                            busy=intake.busy, error=intake.error))  # fmt: skip
        bars = _Bars(progress)
        workdir = _WorkingDirectory()

        def replay_one(directory: Path) -> ReplayResult:
            try:
                return _replay_one(directory, log_dir, bars, workdir, timeout, interrupted, wait)
            except Exception as exc:  # one broken spool must not stop the others
                return ReplayResult(directory.parent.name, directory.name, _waiting(directory),
                                    0, error=f"{type(exc).__name__}: {exc}")  # fmt: skip

        try:
            results += _side_by_side(spooled_runs(log_dir, run_id, before_attempt), replay_one,
                                     interrupted)  # fmt: skip
        finally:
            bars.close()
    if interrupted:
        raise Interrupted(interrupted[0], results)
    return results


def _side_by_side(
    directories: list[Path], replay_one: Callable[[Path], ReplayResult], interrupted: list[int]
) -> list[ReplayResult]:
    """``replay_one`` of each spool directory, every tracker's on a thread of its own, so that a
    slow tracker (a server taking 40 steps a second) holds back no other; a tracker's launches
    go one after another on its thread, in the order given (an earlier attempt's records before
    a later one's). Results come in the order of ``directories``, whichever finished first.
    SIGINT/SIGTERM reach the calling thread, which waits here; each thread stops between two
    writes (``interrupted``) and starts no further spool."""
    by_tracker: dict[str, list[int]] = {}
    for index, directory in enumerate(directories):
        by_tracker.setdefault(directory.parent.name, []).append(index)
    found: list[ReplayResult | None] = [None] * len(directories)

    def deliver(indices: list[int]) -> None:
        for index in indices:
            if interrupted:
                break
            found[index] = replay_one(directories[index])

    if len(by_tracker) <= 1:  # one tracker: this thread, as ever
        for indices in by_tracker.values():
            deliver(indices)
    else:
        threads = [
            threading.Thread(
                target=deliver, args=(indices,), name=f"otel-rl replay {tracker}", daemon=True
            )
            for tracker, indices in by_tracker.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # a timed join: the signal handlers run in between
                thread.join(0.2)
    return [result for result in found if result is not None]


class _WorkingDirectory:
    """The process's one working directory, shared by the trackers replayed side by side. A
    tracker runs in the directory its run started in (its relative paths land where the run
    wrote them); trackers that need the same directory are in it together, one that needs
    another waits until no tracker is in it (a process has one working directory: a relaunch in
    another folder, or a log dir replayed both from where it was and from a copy)."""

    def __init__(self) -> None:
        try:
            self.home: Path | None = Path(os.getcwd())
        except OSError:  # the replay's own directory was removed: relative paths stay unusable
            self.home = None
        self._free = threading.Condition()
        self._held = self.home
        self._users = 0

    @contextlib.contextmanager
    def at(self, directory: Path | None) -> Iterator[None]:
        """In ``directory`` (``None``: the directory the replay started in) while it lasts."""
        wanted = directory if directory is not None else self.home
        with self._free:
            while self._users and self._held != wanted:
                self._free.wait()
            if not self._users and wanted is not None and wanted != self._held:
                os.chdir(wanted)  # raises (a folder gone) before it counts as held
                self._held = wanted
            self._users += 1
        try:
            yield
        finally:
            with self._free:
                self._users -= 1
                if not self._users:
                    if self.home is not None and self._held != self.home:
                        with contextlib.suppress(OSError):
                            os.chdir(self.home)
                    self._held = self.home
                    self._free.notify_all()


def _waiting(directory: Path) -> int:
    """Records waiting in a spool that could not be replayed (0 when even that is unreadable)."""
    try:
        return pending_count(directory)
    except Exception:
        return 0


class Interrupted(Exception):
    def __init__(self, signum: int, results: list[ReplayResult]) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum
        self.results = results


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """SIGINT/SIGTERM stop the replay between two writes, never between a write and its mark
    (which would send that record again next time). Yields the list the signal lands in."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def note(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)




def _replay_one(
    directory: Path,
    log_dir: Path,
    bars: _Bars,
    workdir: _WorkingDirectory,
    timeout: float,
    interrupted: list[int],
    wait: float,
) -> ReplayResult:
    tracker, run_id = directory.parent.name, directory.name
    try:
        meta = json.loads((directory / "meta.json").read_text())
        tracker, run_id = meta["tracker"], str(meta.get("run_id", directory.name))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # Without its metadata the tracker cannot be rebuilt: say so, with what waits there.
        problem = "is missing" if isinstance(exc, FileNotFoundError) else f"is unreadable ({exc})"
        waiting = pending_count(directory)
        return ReplayResult(tracker, run_id, waiting, 0, error=(
            f"{directory / 'meta.json'} {problem}: the tracker's settings are not known, so "
            f"its {waiting} waiting record(s) cannot be delivered; restore the file (each "
            "spool folder of the run holds the same config) and run replay again"
        ))  # fmt: skip
    if not meta.get("resume"):
        # A launch that ended before its tracker opened a run continues the run another launch
        # of it opened (replayed in attempt order: an earlier one's replay may just have).
        opened = tracker_runs_of(log_dir, run_id).get(tracker)
        if opened:
            meta = {**meta, "resume": opened}
    ended = _ended_later(log_dir, run_id, tracker, meta)
    if ended is not None:  # the run's status is its latest launch's, not this earlier one's
        meta = {**meta, "exit_code": ended}
    lock = SpoolLock(directory, REPLAY_LOCK)
    try:
        lock.acquire(wait, stop=lambda: bool(interrupted))  # Ctrl-C ends the wait too
    except SpoolBusy as busy:
        return ReplayResult(tracker, run_id, 0, 0, busy=busy.holder)
    except OSError as exc:
        return ReplayResult(tracker, run_id, pending_count(directory), 0,
                            error=_unwritable(directory, exc))  # fmt: skip
    try:
        return _deliver_spool(directory, log_dir, meta, bars, workdir, timeout, interrupted)
    finally:
        lock.release()


def _ended_later(
    log_dir: Path, run_id: str, tracker: str, meta: Mapping[str, Any]
) -> int | None:
    """The exit code of the latest launch of ``run_id`` after the one ``meta`` describes that
    ended and closed ``tracker``'s run, if any."""
    attempt = meta.get("attempt", 1)
    later = [
        (m["attempt"], m["exit_code"])
        for m in map(read_meta, spools_of_run(log_dir, run_id))
        if m.get("tracker") == tracker and type(m.get("attempt")) is int
        and type(attempt) is int and m["attempt"] > attempt and type(m.get("exit_code")) is int
    ]  # fmt: skip
    return max(later)[1] if later else None


def shown(run_id: str) -> str:
    """A run id as one line can show it (quoted when it holds a newline or another control)."""
    return run_id if run_id.isprintable() else repr(run_id)


def runs_below(folder: Path) -> list[Path]:
    """The ``.otel-rl`` folders of runs one or two levels below ``folder``."""
    return [*folder.glob("*/.otel-rl"), *folder.glob("*/*/.otel-rl")]


def _unwritable(directory: Path, exc: OSError) -> str:
    waiting = pending_count(directory)
    what = exc.strerror or type(exc).__name__
    path = exc.filename or directory
    owner = ""
    with contextlib.suppress(OSError):
        import pwd

        uid = directory.stat().st_uid
        with contextlib.suppress(KeyError):
            owner = f", owned by {pwd.getpwuid(uid).pw_name}"
    return (
        f"cannot write the spool: {path}: {what} ({directory}{owner}). {waiting} record(s) wait "
        "there; run `otel-rl replay` as the user who ran the training, or make the folder "
        "writable, then run it again"
    )


def _deliver_spool(
    directory: Path,
    log_dir: Path,
    meta: Mapping[str, Any],
    bars: _Bars,
    workdir: _WorkingDirectory,
    timeout: float,
    interrupted: list[int],
) -> ReplayResult:
    tracker, run_id = meta["tracker"], str(meta.get("run_id", directory.name))
    acks = read_acks(directory)
    try:
        plan = ReplayPlan(directory, acks, int(meta.get("last_seq") or 0),
                          stop=lambda: bool(interrupted))  # fmt: skip
    except PlanStopped:
        return ReplayResult(tracker, run_id, waiting_records(directory), 0,
                            error=f"interrupted by signal {interrupted[0]}")  # fmt: skip
    try:
        return _deliver_plan(plan, tracker, run_id, log_dir, meta, bars, workdir, timeout,
                             interrupted)  # fmt: skip
    finally:
        plan.close()


def _deliver_plan(
    plan: ReplayPlan,
    tracker: str,
    run_id: str,
    log_dir: Path,
    meta: Mapping[str, Any],
    bars: _Bars,
    workdir: _WorkingDirectory,
    timeout: float,
    interrupted: list[int],
) -> ReplayResult:
    directory = plan.directory
    saved = dict(meta.get("config") or {})
    # The launch's own keys (added by the Logger to its resolved config, never the user's).
    launch = {key: saved.pop(key) for key in (ATTEMPT_KEY, LAUNCH_KEY) if key in saved}
    cfg = resolve_settings(_merge(saved, meta.get("resume") or {}))
    # Rows written by replay name the run and the attempt they belong to, as the live run's do.
    cfg.run_id = cfg.run_id or run_id
    if ATTEMPT_KEY in launch:
        cfg.set_launch(int(launch[ATTEMPT_KEY]), launch.get(LAUNCH_KEY))
    # The folder holding the spool is the run's log_dir, wherever it was moved or copied: the
    # outputs kept inside it (the trackers' defaults) are written there.
    cfg.log_dir = str(log_dir)
    base = run_directory(meta, log_dir)
    started = meta.get("cwd")
    if started and base != Path(started):
        _log.warning(
            "otel-rl replay: %s: the run started in %s%s; its relative paths start at %s",
            tracker, started, "" if Path(started).is_dir() else " (gone)", base or workdir.home,
        )  # fmt: skip
    with workdir.at(base):
        # Built only when something waits: a spool with nothing to send needs no tracker (an
        # exporter given to the Logger as an instance may have no entry point to build it by).
        exporter = exporter_class(tracker).from_config(cfg) if plan.sendable else None
        landed = SeqSet()
        if exporter is not None:
            landed = landed_before_the_kill(plan.acks.attempt, exporter, plan.in_attempt)
        result = ReplayResult(tracker, run_id, plan.sendable - len(landed), 0, plan.skipped)
        marks = DoneMarks(directory, plan.acks)
        try:
            marks.mark(itertools.chain(plan.done, landed))
            if exporter is not None and result.pending:
                opened = exporter  # its resume_config is set as the tracker opens its run
                _deliver(exporter, meta, plan.records(landed), marks, result, bars, timeout,
                         interrupted, lambda: _save_resume(directory, meta, opened.resume_config))
            marks.set_aside(plan.skipped)
        finally:
            marks.close()
    return result


def run_directory(meta: Mapping[str, Any], log_dir: Path) -> Path | None:
    """The directory the run's relative paths start from: the one it was started in (``cwd`` in
    the spool's metadata) while ``log_dir`` is still where the run left it; else the directory
    from which the recorded relative ``log_dir`` reaches the folder being replayed (it was moved
    or copied); ``None`` when neither can be told (paths then resolve from here)."""
    recorded = Path(str(meta.get("log_dir", "")))
    started = meta.get("cwd")
    here = log_dir.resolve()
    if recorded.is_absolute():
        return Path(started) if started and Path(started).is_dir() else None
    if started and (Path(started) / recorded).resolve() == here:
        return Path(started)
    parts = Path(os.path.normpath(recorded)).parts
    if parts and ".." not in parts and here.parts[-len(parts) :] == parts:
        return Path(*here.parts[: -len(parts)])
    return Path(started) if started and Path(started).is_dir() else None


@contextlib.contextmanager
def _working_directory(directory: Path | None) -> Iterator[None]:
    if directory is None:
        yield
        return
    previous = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


def _save_resume(directory: Path, meta: Mapping[str, Any], resume: Mapping[str, Any]) -> None:
    """Keep the run this replay opened (e.g. a new MLflow run when the training process died
    before saving its own), so that the next replay continues it instead of starting another."""
    merged = _merge(meta.get("resume") or {}, resume)
    if not resume or merged == meta.get("resume"):
        return
    write_meta(directory, {**meta, "resume": merged})




def _deliver(
    exporter: Tracker,
    meta: Mapping[str, Any],
    records: Iterator[tuple[int, Any]],
    marks: DoneMarks,
    result: ReplayResult,
    bars: _Bars,
    timeout: float,
    interrupted: list[int],
    on_open: Callable[[], None],
) -> None:
    channel = Channel.of(exporter)  # its writer calls the tracker here, on this thread
    writer = channel.writer()
    advance = bars.bar(exporter.name, result.pending)
    deadline = time.monotonic() + timeout
    backoff = 0.0
    position = 0
    waiting = Waiting(records)
    try:
        while True:
            if interrupted:
                result.error = f"interrupted by signal {interrupted[0]}"
                break
            try:
                chunk = waiting.chunk(exporter.max_batch)
            except (SpoolChanged, OSError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
                break
            if not chunk:
                break
            opened = writer.opened
            done, failure = writer.write(chunk, marks.note_attempt)
            if writer.opened and not opened:
                on_open()
            flush_failure = writer.flush() if done else None
            if flush_failure is not None:
                failure = flush_failure
            else:
                marks.mark([seq for seq, _ in chunk[:done]])
                waiting.drop(done)
                position += done
                # Records the tracker refused are set aside, done but not delivered.
                result.delivered = position - channel.stats["rejected"]
                advance(position)
            if failure is None:
                backoff = 0.0
                continue
            if failure.kind == "permanent" or time.monotonic() >= deadline:
                result.error = failure.describe()
                break
            backoff = min(max(backoff * 2, 0.1), 10.0)
            left = max(0.0, deadline - time.monotonic())
            wake = time.monotonic() + min(backoff * random.uniform(0.5, 1.0), left)
            while not interrupted and time.monotonic() < wake:  # a signal ends the wait
                time.sleep(0.05)
    finally:
        # A run that never reached finish() (no exit code saved) died: SIGKILL's 137 marks it
        # killed in trackers that keep a status, never "finished".
        writer.close(int(meta.get("exit_code", KILLED_EXIT_CODE)))
        result.rejected = channel.stats["rejected"]
        result.delivered = position - result.rejected
        advance(position, done=True)




def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class _Bars:
    """One progress display for the trackers replayed side by side (a terminal holds one live
    display): a bar per tracker and run, each moved by its tracker's thread."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._display: Any = None

    def bar(self, tracker: str, total: int) -> Callable[..., None]:
        """A callable ``(completed, done=False)`` moving a new bar (or nothing)."""
        if not self._enabled:
            return lambda completed, done=False: None
        with self._lock:
            if self._display is None:
                from rich.progress import Progress

                self._display = Progress(transient=False)
                self._display.start()
            display = self._display
            task = display.add_task(f"replay {tracker}", total=total)

        def update(completed: int, done: bool = False) -> None:
            display.update(task, completed=completed)

        return update

    def close(self) -> None:
        with self._lock:
            if self._display is not None:
                self._display.stop()
                self._display = None
