"""``otel-rl replay <log_dir>``: deliver what a run's trackers did not get.

Reads each tracker's spool under ``<log_dir>/.otel-rl/spool/``, rebuilds the tracker from the
run's saved config (plus what the tracker recorded to reopen its run, e.g. the MLflow run id),
re-sends every record not yet marked done in step order, and marks each one done as it is
delivered — so a second replay sends nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_rl.config import resolve_config
from otel_rl.records import StepBatch
from otel_rl.registry import exporter_class
from otel_rl.spool import mark_done, spool_root, undelivered

_log = logging.getLogger("otel_rl")

KILLED_EXIT_CODE = 137


@dataclass
class ReplayResult:
    tracker: str
    run_id: str
    pending: int
    delivered: int


def spooled_runs(log_dir: str | Path) -> list[Path]:
    """Spool directories (one per tracker and run) under ``log_dir``."""
    root = spool_root(log_dir)
    return sorted(p.parent for p in root.glob("*/*/meta.json"))


def replay(
    log_dir: str | Path, progress: bool = True, timeout: float = 300.0
) -> list[ReplayResult]:
    """Replay every spool under ``log_dir``; returns what each tracker had and got."""
    results = []
    for directory in spooled_runs(log_dir):
        results.append(_replay_one(directory, progress, timeout))
    return results


def _replay_one(directory: Path, progress: bool, timeout: float) -> ReplayResult:
    meta = json.loads((directory / "meta.json").read_text())
    tracker, run_id = meta["tracker"], str(meta.get("run_id", directory.name))
    records = undelivered(directory)
    if not records:
        return ReplayResult(tracker, run_id, 0, 0)
    # Step batches in step order; other records (hyperparams, plots) keep their place.
    order = sorted(
        range(len(records)),
        key=lambda i: (_step_of(records[i][1]), records[i][0]),
    )
    ordered = [records[i] for i in order]
    cfg = resolve_config(_merge(meta.get("config") or {}, meta.get("resume") or {}))
    # No spool while replaying (the records are already in one); a full queue waits.
    exporter = exporter_class(tracker).from_config(cfg, on_full="block")
    skipped = [seq for seq, record in ordered if record is None]
    sendable = [(seq, record) for seq, record in ordered if record is not None]
    delivered = 0
    advance = _progress(progress, tracker, len(sendable))
    try:
        for _, record in sendable:
            exporter.submit(record)
        deadline = time.monotonic() + timeout
        while not exporter.force_flush(timeout_millis=200) and time.monotonic() < deadline:
            advance(exporter.stats["delivered"])
    finally:
        # A run that never reached finish() (no exit code saved) died: SIGKILL's 137 marks it
        # killed in trackers that keep a status, never "finished".
        exit_code = int(meta.get("exit_code", KILLED_EXIT_CODE))
        exporter.shutdown(timeout_millis=5_000, exit_code=exit_code)
        # The worker delivers in submission order: the first N were written.
        delivered = min(exporter.stats["delivered"], len(sendable))
        advance(delivered, done=True)
        mark_done(directory, skipped + [seq for seq, _ in sendable[:delivered]])
    return ReplayResult(tracker, run_id, len(ordered), delivered + len(skipped))


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


def _progress(enabled: bool, tracker: str, total: int) -> Any:
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
