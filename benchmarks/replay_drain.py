"""Replaying a large backlog: ``otel-rl replay`` streams the spool; the replay before it held it.

N step records of 20 keys wait for two trackers (JSONL and TensorBoard), as a run whose trackers
were down for its whole length leaves them (spools written with ``Spool.append`` in batches,
``meta.json`` as a run writes it). Each replay runs in a process of its own, on the same spools
(its marks and outputs removed, the disk synced in between); we report records per second (both
trackers' records over the replay's wall time) and the peak resident memory of that process (its
``VmHWM``). The baseline is the replay as it was before it streamed, kept in this file: read
every waiting record into a list, resolve the checkpoints, sort by step, deliver.

    python -m benchmarks.replay_drain [--records 500000] [--only ours]

The full size (2,000,000 records per tracker) takes about 10 minutes on 2 cores: 1.5 to build
the spools (2.5 GB, and as much again for the trackers' outputs), 4 for our replay, 4 for the
baseline, which peaks at 7.2 GB (it is skipped, saying so, when the machine has less than 1.5
times its estimate available). ``--quick``: 20,000 records, a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEYS = 20
TRACKERS = ("jsonl", "tensorboard")
#: What the baseline held per record and tracker (measured: 3.9 KB at 1.75 million records).
BASELINE_BYTES_PER_RECORD = 4_200


# ---- the backlog ------------------------------------------------------------------------------


def build_backlog(
    log_dir: Path, records: int, trackers: tuple[str, ...] = TRACKERS, backwards: bool = False
) -> None:
    """Spools of ``records`` 20-key step records (steps 0, 1, ...; ``backwards``: the last
    step first, the worst order for a replay) waiting for each tracker, as a run of ``log_dir``
    leaves them when its trackers never came up (seals, a run id, the metadata a replay reads).
    Every tracker's spool gets the same lines but for their numbers."""
    from otel_rl.core.records import StepBatch
    from otel_rl.delivery.spool import Spool, spool_root

    names = [f"train/metric_{i:02d}" for i in range(KEYS)]
    spools = [Spool(spool_root(log_dir) / tracker / "run1") for tracker in trackers]
    started = 1.795e9
    batch = 5_000
    for first in range(0, records, batch):
        steps = range(first, min(records, first + batch))
        # One StepBatch for every spool: its line is encoded once (encode_record keeps it).
        batches = [
            StepBatch(step=records - 1 - s if backwards else s,
                      values={k: s * 1e-3 + i / 7 for i, k in enumerate(names)},
                      time=started + s * 0.25, seal=s)
            for s in steps
        ]  # fmt: skip
        for spool in spools:
            spool.append(batches)
    for tracker, spool in zip(trackers, spools, strict=True):
        spool.close()
        spool.write_meta({
            "tracker": tracker, "run_id": "run1", "log_dir": str(log_dir), "cwd": os.getcwd(),
            "config": {"log_dir": str(log_dir), "tensorboard_enabled": "tensorboard" in trackers,
                       "jsonl_enabled": "jsonl" in trackers, "run_id": "run1"},
            "resume": {}, "exit_code": 137, "last_seq": spool.last_seq,
        })  # fmt: skip


def reset(log_dir: Path) -> None:
    """The backlog as it was before any replay: marks and tracker outputs removed."""
    from otel_rl.delivery.spool import spool_root

    for spool in spool_root(log_dir).glob("*/*"):
        (spool / "acked.log").unlink(missing_ok=True)
    (log_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(log_dir / "tensorboard", ignore_errors=True)


# ---- the replay before it streamed (the baseline), as it was --------------------------------


@dataclass
class _Acks:
    upto: int = 0
    ones: set[int] = field(default_factory=set)
    attempt: Any = None
    set_aside: set[tuple[str, int]] = field(default_factory=set)
    gone: list[range] = field(default_factory=list)

    def done(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.ones or any(seq in r for r in self.gone)


def _read_acks(directory: Path) -> _Acks:
    from otel_rl.delivery.spool import _parse_attempt

    acks = _Acks()
    path = directory / "acked.log"
    if not path.exists():
        return acks
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        kind, _, number = line.partition(" ")
        if kind in ("try", "tried"):
            acks.attempt = _parse_attempt(number, counted=kind == "tried") or acks.attempt
            continue
        if kind == "bad":
            segment, _, offset = number.partition(" ")
            if offset.isdigit():
                acks.set_aside.add((segment, int(offset)))
            continue
        if kind == "gone":
            first, _, last = number.partition(" ")
            if first.isdigit() and last.isdigit():
                acks.gone.append(range(int(first), int(last) + 1))
            continue
        if not number.isdigit():
            continue
        if kind == "upto":
            acks.upto = max(acks.upto, int(number))
        elif kind == "one":
            acks.ones.add(int(number))
    return acks


def _read_segment(path: Path, skipped: list[Any]) -> Iterator[tuple[int, Any, int]]:
    from otel_rl.delivery.spool import (
        CorruptRecord,
        Skipped,
        _reason,
        _whole_record_after_damage,
        decode_record,
    )

    with path.open("rb") as f:
        position = 0
        for raw in f:
            start, position = position, position + len(raw)
            if not raw.endswith(b"\n"):
                skipped.append(Skipped(path, start, f"incomplete last line ({len(raw)} bytes "
                                       "without a newline: a write cut short by a crash, or "
                                       "damaged)"))  # fmt: skip
                return
            try:
                seq, record = decode_record(raw.decode("utf-8"))
            except (CorruptRecord, UnicodeDecodeError) as exc:
                skipped.append(Skipped(path, start, _reason(exc, raw)))
                whole = _whole_record_after_damage(raw)
                if whole is not None:
                    yield (*whole, position)
                continue
            yield seq, record, position


def todays_scan(
    directory: Path, known_end: int = 0
) -> tuple[list[tuple[int, Any]], list[Any], set[Any], _Acks]:
    """The spool read as the replay before it streamed read it: every waiting record in a
    list (with the marks, as that replay read them)."""
    from otel_rl.core.records import StepBatch
    from otel_rl.delivery.spool import Skipped, first_seq, segment_paths

    def missing(seqs: range) -> list[Any]:
        waiting = [seq for seq in seqs if not acks.done(seq)]
        if not waiting:
            return []
        reason = "no segment holds them: a segment was deleted or cut from outside"
        span = range(waiting[0], waiting[-1] + 1)
        return [Skipped(directory, -1, reason, span, kind="missing")]

    def placed(lines: list[Any], seqs: range | None) -> list[Any]:
        if seqs is not None and all(acks.done(seq) for seq in seqs):
            return []
        return [dataclasses.replace(line, seqs=seqs) for line in lines
                if (line.path.name, line.offset) not in acks.set_aside]  # fmt: skip

    acks = _read_acks(directory)
    records: list[tuple[int, Any]] = []
    skipped: list[Any] = []
    sealed: set[Any] = set()
    segments = segment_paths(directory)
    expected: int | None = None
    end = max(known_end, acks.upto, acks.attempt.last if acks.attempt else 0)
    for index, path in enumerate(segments):
        last = index == len(segments) - 1
        first = first_seq(path)
        if expected is not None and first > expected:
            skipped += missing(range(expected, first))
        previous = first - 1
        here: list[Any] = []
        line_start = 0
        for seq, record, line_end in _read_segment(path, here):
            start, line_start = line_start, line_end
            if seq <= previous:
                here.append(Skipped(path, start, f"sequence number {seq} comes again after "
                                    f"{previous} (a line written over another)"))  # fmt: skip
                continue
            if here:
                skipped.extend(placed(here, range(previous + 1, seq)))
                here.clear()
            previous = seq
            if isinstance(record, StepBatch) and record.seal is not None and not record.provisional:
                sealed.add(record.seal)
            if not acks.done(seq):
                records.append((seq, record))
        expected = previous + 1
        if here:
            bound = first_seq(segments[index + 1]) if not last else end + 1
            following = range(previous + 1, bound) if bound > previous + 1 or not last else None
            skipped.extend(placed(here, following))
            expected = max(expected, bound)
    if expected is None:
        expected = acks.upto + 1
    if end >= expected:
        skipped += missing(range(expected, end + 1))
    return records, skipped, sealed, acks


def _step_of(record: Any) -> float:
    from otel_rl.core.records import StepBatch

    if isinstance(record, StepBatch):
        return float(record.step) if record.axis is None else float("inf")
    return float(getattr(record, "step", -1))


def todays_order(
    records: list[tuple[int, Any]], sealed: set[Any]
) -> tuple[list[int], list[tuple[int, Any]]]:
    """``(done, sendable)``: checkpoints resolved and the records sorted as they were."""
    from otel_rl.core.records import StepBatch

    done: list[int] = []
    latest: dict[Any, int] = {}
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
    sendable.sort(key=lambda item: (_step_of(item[1]), item[0]))
    return done, sendable


def _todays_landed(attempt: Any, exporter: Any, pending: set[int]) -> set[int]:
    if attempt is None:
        return set()
    uncertain = {seq for seq in range(attempt.first, attempt.last + 1) if seq in pending}
    if not uncertain:
        return set()
    counts = "records" in inspect.signature(exporter.holds_since).parameters
    if attempt.records is not None and counts:
        holds = exporter.holds_since(attempt.position, records=attempt.records)
    else:
        holds = exporter.holds_since(attempt.position)
    return uncertain if holds else set()


def _todays_deliver(
    exporter: Any, meta: Mapping[str, Any], sendable: list[tuple[int, Any]], marks: Any,
    on_open: Callable[[], None],
) -> tuple[int, str | None]:
    from otel_rl.core.records import StepBatch

    writer = exporter.delivery.writer()
    deadline = time.monotonic() + 300
    backoff = 0.0
    position = 0
    error = None
    try:
        while position < len(sendable):
            first = sendable[position]
            chunk = [first]
            if isinstance(first[1], StepBatch):
                for item in sendable[position + 1 : position + max(1, exporter.max_batch)]:
                    if not isinstance(item[1], StepBatch) or item[0] != chunk[-1][0] + 1:
                        break
                    chunk.append(item)
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
            if failure is None:
                backoff = 0.0
                continue
            if failure.kind == "permanent" or time.monotonic() >= deadline:
                error = failure.describe()
                break
            backoff = min(max(backoff * 2, 0.1), 10.0)
            time.sleep(backoff * random.uniform(0.5, 1.0))
    finally:
        writer.close(int(meta.get("exit_code", 137)))
    return position - exporter.delivery.stats.get("rejected", 0), error


def todays_replay(log_dir: Path) -> list[dict[str, Any]]:
    """Every spool of ``log_dir`` replayed as before: load everything, sort, deliver."""
    from otel_rl.config.loading import resolve_settings
    from otel_rl.delivery.registry import exporter_class
    from otel_rl.delivery.spool import DoneMarks, SpoolLock
    from otel_rl.run import replay as ours

    log_dir = log_dir.absolute()
    results = []
    for directory in ours.spooled_runs(log_dir):
        meta = json.loads((directory / "meta.json").read_text())
        lock = SpoolLock(directory, "otel-rl replay")
        lock.acquire()
        try:
            records, skipped, sealed, acks = todays_scan(directory, int(meta.get("last_seq") or 0))
            done_already, sendable = todays_order(records, sealed)
            saved = ours._merge(meta.get("config") or {}, meta.get("resume") or {})
            saved["run_id"] = saved.get("run_id") or meta["run_id"]
            saved["log_dir"] = str(log_dir)
            cfg = resolve_settings(saved)
            with ours._working_directory(ours.run_directory(meta, log_dir)):
                exporter = exporter_class(meta["tracker"]).from_config(cfg) if sendable else None
                landed: set[int] = set()
                if exporter is not None:
                    landed = _todays_landed(acks.attempt, exporter, {s for s, _ in sendable})
                    sendable = [(seq, r) for seq, r in sendable if seq not in landed]
                marks = DoneMarks(directory)  # without the marks read: "one" lines, as before
                delivered, error = 0, None
                try:
                    marks.mark(done_already + sorted(landed))
                    if exporter is not None and sendable:
                        delivered, error = _todays_deliver(exporter, meta, sendable, marks,
                                                           lambda: None)  # fmt: skip
                    marks.set_aside(skipped)
                finally:
                    marks.close()
            results.append({"tracker": meta["tracker"], "pending": len(sendable),
                            "delivered": delivered, "error": error})  # fmt: skip
            del records, sendable
        finally:
            lock.release()
    return results


# ---- measuring --------------------------------------------------------------------------------


def _child(which: str, log_dir: Path) -> None:
    """One replay in this process; prints what it did, its time and its peak memory."""
    started = time.perf_counter()
    if which == "ours":
        from otel_rl.run.replay import replay

        results = [{"tracker": r.tracker, "pending": r.pending, "delivered": r.delivered,
                    "error": r.error} for r in replay(log_dir, progress=False)]  # fmt: skip
    else:
        results = todays_replay(log_dir)
    seconds = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"results": results, "seconds": seconds, "peak_mib": _peak_mib(usage),
                      "cpu_s": usage.ru_utime + usage.ru_stime}))  # fmt: skip


def _peak_mib(usage: Any) -> float:
    """This process's peak resident memory: VmHWM, its own memory's high-water mark. Not
    ru_maxrss, which a child started by vfork and exec (``subprocess``) inherits from its
    parent: a replay started by a test process of 400 MB would say 400 MB."""
    with contextlib.suppress(OSError, StopIteration, ValueError, IndexError):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    return float(usage.ru_maxrss) / 1024  # KiB on Linux; elsewhere an upper bound at worst


def replay_in_a_process(which: str, log_dir: Path) -> dict[str, Any]:
    """Run one replay (``ours`` or ``today``) in a child process and return its report."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.replay_drain", "--child", which, str(log_dir)],
        capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{which} replay failed ({out.returncode}): {out.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def _available_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return None


def measure(records: int, which: tuple[str, ...] = ("ours", "today")) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="replay-drain-") as tmp:
        log_dir = Path(tmp) / "logs"
        started = time.perf_counter()
        build_backlog(log_dir, records)
        built = time.perf_counter() - started
        for name in which:
            label = "otel-rl replay (streams)" if name == "ours" else "load all + sort (before)"
            need = records * BASELINE_BYTES_PER_RECORD * 1.5
            available = _available_bytes()
            if name == "today" and available is not None and available < need:
                rows.append({"records": records, "replay": label,
                             "records_per_s": f"skipped: needs ~{need / 2**30:.0f} GiB, "
                             f"{available / 2**30:.0f} GiB available"})  # fmt: skip
                continue
            reset(log_dir)
            os.sync()  # the spools' and the last replay's writes on disk: none left to compete
            report = replay_in_a_process(name, log_dir)
            delivered = sum(r["delivered"] for r in report["results"])
            errors = [r["error"] for r in report["results"] if r["error"]]
            if delivered != records * len(TRACKERS) or errors:
                raise RuntimeError(f"{name}: delivered {delivered} of {records * 2}: {errors}")
            rows.append({
                "records": records, "replay": label,
                "records_per_s": round(delivered / report["seconds"]),
                "seconds": round(report["seconds"], 1),
                "cpu_s": round(report["cpu_s"], 1),
                "peak_rss_mib": round(report["peak_mib"]),
                "build_s": round(built, 1),
            })  # fmt: skip
    return rows


def run(quick: bool = False, records: int | None = None) -> list[dict[str, Any]]:
    records = records or (20_000 if quick else 2_000_000)
    rows = measure(records)
    measured = {row["replay"]: row for row in rows if "seconds" in row}
    if len(measured) == 2:
        ours, before = measured.values()
        rows.append({
            "records": records, "replay": "ours / before",
            "records_per_s": f"x{ours['records_per_s'] / before['records_per_s']:.2f}",
            "cpu_s": f"x{ours['cpu_s'] / before['cpu_s']:.2f}",
            "peak_rss_mib": f"x{ours['peak_rss_mib'] / before['peak_rss_mib']:.3f}",
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--only", choices=("ours", "today"), default=None)
    parser.add_argument("--child", choices=("ours", "today"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("log_dir", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, Path(args.log_dir))
        return
    which = (args.only,) if args.only else ("ours", "today")
    for row in measure(args.records, which):
        print(row)


if __name__ == "__main__":
    main()
