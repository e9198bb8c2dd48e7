"""Draining a backlog that lives on disk: time per record must not grow with the backlog.

A tracker is down while N step records are logged (beyond ``export.queue_size`` they wait in the
spool only), then comes back; we time from its return until every record is written. The
baseline is linear growth: the drain of the large backlog divided by the small one's, against
the ratio of their sizes. Before the spool reader kept its place, 20k records took 0.3 s and 120k
took 7.3 s (24x for 6x the records).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from otel_rl.core.records import StepBatch
from otel_rl.exporters.base import TrackerExporter


class _Gated(TrackerExporter):
    """Stands for a tracker that is down until ``up`` is set; writes cost nothing."""

    name = "gated"
    max_batch = 256

    def __init__(self, **kwargs: Any) -> None:
        self.up = threading.Event()
        self.written = 0
        super().__init__(**kwargs)

    def write_batches(self, batches: Any) -> None:
        if not self.up.is_set():
            raise ConnectionError("down")
        self.written += len(batches)

    def write_step(self, step: int, rows: Any, batch: StepBatch) -> None:
        self.write_batches([batch])


def _drain_seconds(records: int, directory: Path) -> float:
    tracker = _Gated(spool_dir=directory, queue_size=10_000, retry_max_backoff=0.05)
    tracker.delivery.start()
    for step in range(records):
        tracker.delivery.submit(StepBatch(step=step, values={"loss": 0.5, "reward": float(step)}))
    while tracker.delivery.stats["spilled"] + 10_000 < records:  # the spool thread has written them
        time.sleep(0.01)
    started = time.perf_counter()
    tracker.up.set()
    while tracker.written < records:
        time.sleep(0.002)
    elapsed = time.perf_counter() - started
    tracker.shutdown(timeout_millis=10_000)
    return elapsed


def run(quick: bool = False) -> list[dict[str, Any]]:
    small, large = (5_000, 30_000) if quick else (20_000, 120_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        times = {n: _drain_seconds(n, Path(tmp) / str(n)) for n in (small, large)}
    for n, seconds in times.items():
        rows.append({"records": n, "drain_s": round(seconds, 3),
                     "us_per_record": round(seconds / n * 1e6, 1)})
    growth = times[large] / times[small] if times[small] else float("nan")
    rows.append({"records": f"{large}/{small}", "drain_s": f"x{growth:.1f}",
                 "us_per_record": f"linear would be x{large / small:.1f}"})
    return rows
