"""``otel-rl replay <log_dir>``: deliver what a run's trackers did not get.

Reads each tracker's spool under ``<log_dir>/.otel-rl/spool/``, rebuilds the tracker from the
run's saved config (plus what the tracker recorded to reopen its run, e.g. the MLflow or W&B run
id), and writes every record not yet marked done, in step order, on this thread. Each record is
marked done as soon as the tracker holds it, so a replay killed at any moment and run again
converges to every record delivered exactly once.

A spool line that cannot be read is reported (file, byte offset, reason) and makes the command
exit non-zero; every other record, tracker and run is still replayed. A reported line is set aside
(noted in the spool), so the next replay passes over it.

Each spool is delivered under its lock (:class:`~otel_rl.delivery.spool.SpoolLock`): the training
process holds it while it runs, a replay while it delivers, so two replays or a replay and the
live run never deliver the same records. A tracker runs in the directory the run started in, so
relative paths (``log_dir``, ``jsonl.path``, an MLflow ``sqlite:///`` store) land where the run
wrote them, whichever directory the replay is started from; this changes the process's working
directory while a tracker is replayed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
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

from otel_rl.config.loading import resolve_config
from otel_rl.core.failures import describe_losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.registry import exporter_class
from otel_rl.delivery.spool import (
    DoneMarks,
    Skipped,
    SpoolBusy,
    SpoolLock,
    read_acks,
    scan,
    spool_root,
    waiting_records,
    write_meta,
)
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.process.lifecycle import KILLED_EXIT_CODE

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
        def held(line: Skipped) -> int:
            return len(line.seqs) if line.seqs is not None else 1

        lost = {
            "corrupt": sum(held(s) for s in self.skipped if s.kind != "missing"),
            "spool_vanished": sum(held(s) for s in self.skipped if s.kind == "missing"),
            "refused": self.rejected,
        }
        return {reason: n for reason, n in lost.items() if n}


def spooled_runs(log_dir: str | Path) -> list[Path]:
    """Spool directories (one per tracker and run) under ``log_dir``: each with its
    ``meta.json``, or with segments only (its metadata lost: reported, never skipped)."""
    root = spool_root(log_dir)
    found = {p.parent for p in root.glob("*/*/meta.json")}
    found |= {p.parent for p in root.glob("*/*/wal-*.jsonl")}
    return sorted(found)


def replay(
    log_dir: str | Path, progress: bool = True, timeout: float = 300.0, wait: float = 0.0
) -> list[ReplayResult]:
    """Replay every spool under ``log_dir``; returns what each tracker had and got.

    A spool in use (the run is alive, or another replay delivers it) is waited for up to
    ``wait`` seconds, then left alone and reported (``ReplayResult.busy``).
    """
    log_dir = Path(log_dir).absolute()  # trackers run in the run's directory, not this one
    results = []
    with _signals_deferred() as interrupted:
        for directory in spooled_runs(log_dir):
            if interrupted:
                break
            try:
                results.append(
                    _replay_one(directory, log_dir, progress, timeout, interrupted, wait)
                )
            except Exception as exc:  # one broken spool must not stop the others
                results.append(
                    ReplayResult(directory.parent.name, directory.name, _waiting(directory), 0,
                                 error=f"{type(exc).__name__}: {exc}")
                )  # fmt: skip
    if interrupted:
        raise _Interrupted(interrupted[0], results)
    return results


def _waiting(directory: Path) -> int:
    """Records waiting in a spool that could not be replayed (0 when even that is unreadable)."""
    try:
        return len(scan(directory)[0])
    except Exception:
        return 0


class _Interrupted(Exception):
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


def run(
    log_dir: str | Path, progress: bool = True, timeout: float = 300.0, wait: float = 0.0
) -> int:
    """The command: replay, print one line per tracker and run, return the exit code."""
    import sys

    if not str(log_dir) or not Path(log_dir).is_dir():
        print(f"otel-rl replay: {str(log_dir) or repr('')} is not a directory", file=sys.stderr)
        return 2
    if not spooled_runs(log_dir):
        counts = {
            run.parent: sum(waiting_records(d) for d in spooled_runs(run.parent))
            for run in _runs_below(Path(log_dir))
        }
        below = sorted(folder for folder, n in counts.items() if n)
        waiting = sum(counts.values())
        if waiting:  # the parent of the runs' folders (logs/demo for logs/demo/exp_001, ...)
            runs = ", ".join(str(p) for p in below[:5]) + (", ..." if len(below) > 5 else "")
            print(f"otel-rl replay: nothing spooled under {log_dir} itself, but {waiting} "
                  f"record(s) wait below it, in {runs}: replay each of those",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"otel-rl replay: nothing spooled under {log_dir}", file=sys.stderr)
        return 0
    interrupted = 0
    try:
        results = replay(log_dir, progress=progress, timeout=timeout, wait=wait)
    except _Interrupted as stop:
        results, interrupted = stop.results, stop.signum
    status = 0
    busy = False
    for r in results:
        if r.busy is not None:
            busy = True
            print(f"{r.tracker:<12} run {_shown(r.run_id)}: skipped, the spool is in use by "
                  f"{r.busy}; run replay again once it has ended (or pass --wait SECONDS)")
            continue
        line = f"{r.tracker:<12} run {_shown(r.run_id)}: {r.delivered}/{r.pending} record(s) "
        line += "delivered"
        lost = r.lost
        if lost:
            line += f"; lost: {describe_losses(lost)}"
        print(line)
        for s in r.skipped:
            if s.kind == "missing" and s.seqs:
                print(f"  records {s.seqs[0]}..{s.seqs[-1]} are missing from {s.path}: "
                      f"{s.reason}; lost")  # fmt: skip
                continue
            print(f"  skipped an unreadable spool line: {s.path} at byte {s.offset}: {s.reason}"
                  f"{_held(s)}; set aside, later replays pass over it")  # fmt: skip
        if r.error:
            print(f"  {r.tracker}: {r.error}", file=sys.stderr)
        if not r.complete and r.busy is None:
            status = 1
    if interrupted:
        print(f"otel-rl replay: stopped by signal {interrupted}; what was delivered is marked "
              "done, run it again to finish", file=sys.stderr)
        return 128 + interrupted
    if status:
        print("otel-rl replay: some records were not delivered (see above); fix the cause and "
              "run it again: what was delivered is never sent twice", file=sys.stderr)
        return status
    return BUSY_EXIT_CODE if busy else 0


def _held(line: Skipped) -> str:
    if line.seqs is None:
        return ""
    if len(line.seqs) == 1:
        return f" (record {line.seqs[0]})"
    return f" (records {line.seqs[0]}..{line.seqs[-1]})" if line.seqs else " (no record)"


def _replay_one(
    directory: Path,
    log_dir: Path,
    progress: bool,
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
        waiting = len(scan(directory)[0])
        return ReplayResult(tracker, run_id, waiting, 0, error=(
            f"{directory / 'meta.json'} {problem}: the tracker's settings are not known, so "
            f"its {waiting} waiting record(s) cannot be delivered; restore the file (each "
            "spool folder of the run holds the same config) and run replay again"
        ))  # fmt: skip
    lock = SpoolLock(directory, "otel-rl replay")
    try:
        lock.acquire(wait, stop=lambda: bool(interrupted))  # Ctrl-C ends the wait too
    except SpoolBusy as busy:
        return ReplayResult(tracker, run_id, 0, 0, busy=busy.holder)
    except OSError as exc:
        return ReplayResult(tracker, run_id, len(scan(directory)[0]), 0,
                            error=_unwritable(directory, exc))  # fmt: skip
    try:
        return _deliver_spool(directory, log_dir, meta, progress, timeout, interrupted)
    finally:
        lock.release()


def _shown(run_id: str) -> str:
    """A run id as one line can show it (quoted when it holds a newline or another control)."""
    return run_id if run_id.isprintable() else repr(run_id)


def _runs_below(folder: Path) -> list[Path]:
    """The ``.otel-rl`` folders of runs one or two levels below ``folder``."""
    return [*folder.glob("*/.otel-rl"), *folder.glob("*/*/.otel-rl")]


def _unwritable(directory: Path, exc: OSError) -> str:
    waiting = len(scan(directory)[0])
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
    progress: bool,
    timeout: float,
    interrupted: list[int],
) -> ReplayResult:
    tracker, run_id = meta["tracker"], str(meta.get("run_id", directory.name))
    records, skipped, sealed = scan(directory, int(meta.get("last_seq") or 0))
    done_already, sendable = _resolve_checkpoints(records, sealed)
    cfg = resolve_config(_merge(meta.get("config") or {}, meta.get("resume") or {}))
    # Rows written by replay name the run they belong to, as the live run's rows do.
    cfg["run_id"] = cfg["run_id"] or run_id
    # The folder holding the spool is the run's log_dir, wherever it was moved or copied: the
    # outputs kept inside it (the trackers' defaults) are written there.
    cfg["log_dir"] = str(log_dir)
    base = run_directory(meta, log_dir)
    started = meta.get("cwd")
    if started and base != Path(started):
        _log.warning(
            "otel-rl replay: %s: the run started in %s%s; its relative paths start at %s",
            tracker, started, "" if Path(started).is_dir() else " (gone)", base or Path.cwd(),
        )  # fmt: skip
    with _working_directory(base):
        # Built only when something waits: a spool with nothing to send needs no tracker (an
        # exporter given to the Logger as an instance may have no entry point to build it by).
        exporter = exporter_class(tracker).from_config(cfg) if sendable else None
        landed: set[int] = set()
        if exporter is not None:
            landed = _landed_before_the_kill(directory, exporter, {seq for seq, _ in sendable})
            sendable = [(seq, record) for seq, record in sendable if seq not in landed]
        result = ReplayResult(tracker, run_id, len(sendable), 0, skipped)
        marks = DoneMarks(directory)
        try:
            marks.mark(done_already + sorted(landed))
            if exporter is not None and sendable:
                opened = exporter  # its resume_config is set as the tracker opens its run
                _deliver(exporter, meta, sendable, marks, result, progress, timeout, interrupted,
                         lambda: _save_resume(directory, meta, opened.resume_config))
            marks.set_aside(skipped)
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


def _landed_before_the_kill(directory: Path, exporter: Any, pending: set[int]) -> set[int]:
    """Records of the last write attempted that the tracker holds although they were never
    marked done (the process died between the write and its mark)."""
    attempt = read_acks(directory).attempt
    if attempt is None:
        return set()
    uncertain = {seq for seq in range(attempt.first, attempt.last + 1) if seq in pending}
    if not uncertain:
        return set()
    # A kill can cut even one write call short: a tracker that counts what it holds is told
    # how many records the write carried (older trackers take the position alone).
    counts = "records" in inspect.signature(exporter.holds_since).parameters
    if attempt.records is not None and counts:
        holds = exporter.holds_since(attempt.position, records=attempt.records)
    else:
        holds = exporter.holds_since(attempt.position)
    return uncertain if holds else set()


def _resolve_checkpoints(
    records: list[tuple[int, Any]], sealed: set[int]
) -> tuple[list[int], list[tuple[int, Any]]]:
    """Split undelivered records into those already done in effect (checkpoints of a step that
    was sealed later, older checkpoints of the same step, entries that cannot be replayed) and
    those to send, in step order."""
    done: list[int] = []
    latest: dict[int, int] = {}  # seal -> index in records of its newest checkpoint
    for index, (seq, record) in enumerate(records):
        if isinstance(record, StepBatch) and record.provisional:
            if record.seal in sealed or record.seal is None:
                done.append(seq)
                continue
            if record.seal in latest:
                done.append(records[latest[record.seal]][0])
            latest[record.seal] = index
        elif record is None:
            done.append(seq)
    keep = set(latest.values())
    sendable = [
        (seq, record)
        for index, (seq, record) in enumerate(records)
        if record is not None
        and (not (isinstance(record, StepBatch) and record.provisional) or index in keep)
    ]
    # Step batches in step order; other records (hyperparams, plots) keep their place.
    sendable.sort(key=lambda item: (_step_of(item[1]), item[0]))
    return done, sendable


def _deliver(
    exporter: Any,
    meta: Mapping[str, Any],
    sendable: list[tuple[int, Any]],
    marks: DoneMarks,
    result: ReplayResult,
    progress: bool,
    timeout: float,
    interrupted: list[int],
    on_open: Callable[[], None],
) -> None:
    writer = exporter.writer()
    advance = _progress(progress, exporter.name, len(sendable))
    deadline = time.monotonic() + timeout
    backoff = 0.0
    position = 0
    try:
        while position < len(sendable):
            if interrupted:
                result.error = f"interrupted by signal {interrupted[0]}"
                break
            chunk = _next_chunk(sendable, position, exporter.max_batch)
            opened = writer.opened
            done, failure = writer.write(chunk, marks.note_attempt)
            if writer.opened and not opened:
                on_open()
            flush_failure = writer.flush() if done else None
            if flush_failure is not None:
                failure = flush_failure
            else:
                marks.mark([seq for seq, _ in chunk[:done]])
                position += done
                # Records the tracker refused are set aside, done but not delivered.
                result.delivered = position - exporter.stats.get("rejected", 0)
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
        result.rejected = exporter.stats.get("rejected", 0)
        result.delivered = position - result.rejected
        advance(position, done=True)


def _next_chunk(
    sendable: list[tuple[int, Any]], position: int, max_batch: int
) -> list[tuple[int, Any]]:
    first = sendable[position]
    chunk = [first]
    if isinstance(first[1], StepBatch):
        for item in sendable[position + 1 : position + max(1, max_batch)]:
            # Consecutive sequence numbers only: a write attempt is noted as a range.
            if not isinstance(item[1], StepBatch) or item[0] != chunk[-1][0] + 1:
                break
            chunk.append(item)
    return chunk


def _step_of(record: Any) -> float:
    if isinstance(record, StepBatch):
        return float(record.step) if record.axis is None else float("inf")
    return float(getattr(record, "step", -1))


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _progress(enabled: bool, tracker: str, total: int) -> Callable[..., None]:
    """A callable ``(completed, done=False)`` drawing a progress bar (or nothing)."""
    if not enabled:
        return lambda completed, done=False: None
    from rich.progress import Progress

    bar = Progress(transient=False)
    bar.start()
    task = bar.add_task(f"replay {tracker}", total=total)

    def update(completed: int, done: bool = False) -> None:
        bar.update(task, completed=completed)
        if done:
            bar.stop()

    return update
