"""``otel-rl replay <log_dir>``: deliver what a run's trackers did not get, one line printed per
tracker and run (:func:`otel_rl.run.replay.replay` does the work)."""

from __future__ import annotations

from pathlib import Path

from otel_rl.core.failures import describe_losses
from otel_rl.delivery.spool import Skipped, waiting_records
from otel_rl.run.replay import (
    BUSY_EXIT_CODE,
    Interrupted,
    replay,
    runs_below,
    shown,
    spooled_runs,
)


def run(
    log_dir: str | Path,
    progress: bool = True,
    timeout: float = 300.0,
    wait: float = 0.0,
    run_id: str | None = None,
    before_attempt: int | None = None,
) -> int:
    """The command: replay, print one line per tracker and run, return the exit code."""
    import sys

    if not str(log_dir) or not Path(log_dir).is_dir():
        print(f"otel-rl replay: {str(log_dir) or repr('')} is not a directory", file=sys.stderr)
        return 2
    if run_id is not None and not spooled_runs(log_dir, run_id, before_attempt):
        print(f"otel-rl replay: nothing spooled for run {run_id!r} under {log_dir}",
              file=sys.stderr)  # fmt: skip
        return 0
    if not spooled_runs(log_dir):
        counts = {
            run.parent: sum(waiting_records(d) for d in spooled_runs(run.parent))
            for run in runs_below(Path(log_dir))
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
        results = replay(log_dir, progress=progress, timeout=timeout, wait=wait, run_id=run_id,
                         before_attempt=before_attempt)  # fmt: skip
    except Interrupted as stop:
        results, interrupted = stop.results, stop.signum
    status = 0
    busy = False
    for r in results:
        if r.busy is not None:
            busy = True
            print(f"{r.tracker:<12} run {shown(r.run_id)}: skipped, the spool is in use by "
                  f"{r.busy}; run replay again once it has ended (or pass --wait SECONDS)")
            continue
        line = f"{r.tracker:<12} run {shown(r.run_id)}: {r.delivered}/{r.pending} record(s) "
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


