"""Exporter-thread throughput of the W&B, SwanLab and Trackio exporters: rows/s of 100 scalars.

The training thread only appends to each exporter's queue (see benchmarks/training_thread.py);
this measures how fast each exporter's worker thread turns queued rows into SDK calls. Each
tracker runs locally (W&B offline, SwanLab offline, Trackio's SQLite store) in a temporary
directory. After a warm-up row (which opens the run), ``--rows`` step batches are queued at once
and timed until the exporter's queue is empty (``force_flush``): that is the worker-thread rate.
The time ``shutdown`` then takes is the SDK draining what it buffered (W&B's service process,
Trackio's batch writer) and is reported separately.

    python -m benchmarks.sdk_tracker_throughput [--rows 2000] [--keys 100] [--trackers wandb,...]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from otel_rl.core.records import StepBatch


def _exporter(name: str, root: Path) -> Any:
    if name == "wandb":
        from otel_rl.exporters.wandb import WandbExporter

        return WandbExporter({"project": "bench", "dir": str(root), "mode": "offline"})
    if name == "swanlab":
        from otel_rl.exporters.swanlab import SwanLabExporter

        return SwanLabExporter(
            {"project": "bench", "mode": "offline", "log_dir": str(root / "swanlab")}
        )
    if name == "trackio":
        from otel_rl.exporters.trackio import TrackioExporter

        return TrackioExporter({"project": f"bench-{os.getpid()}", "auto_log_cpu": False})
    raise SystemExit(f"unknown tracker {name!r}")


def _batches(rows: int, keys: int, start: int) -> list[StepBatch]:
    names = [f"train/metric_{i:03d}" for i in range(keys)]
    rng = random.Random(0)
    return [
        StepBatch(step=start + s, values={k: rng.random() for k in names}) for s in range(rows)
    ]


def measure(name: str, rows: int, keys: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRACKIO_DIR", str(Path(tmp) / "trackio"))
        exporter = _exporter(name, Path(tmp))
        warm = _batches(1, keys, 0)[0]
        t0 = time.perf_counter()
        exporter.delivery.submit(warm)
        exporter.force_flush(timeout_millis=120_000)
        opened = time.perf_counter() - t0
        batches = _batches(rows, keys, 1)
        t0 = time.perf_counter()
        for batch in batches:
            exporter.delivery.submit(batch)
        drained = exporter.force_flush(timeout_millis=600_000)
        worker = time.perf_counter() - t0
        t1 = time.perf_counter()
        exporter.shutdown(timeout_millis=600_000)
        closing = time.perf_counter() - t1
        assert drained and exporter.delivery.stats["delivered"] == rows + 1, exporter.delivery.stats
    return {
        "open_s": opened,
        "rows_per_s": rows / worker,
        "ms_per_row": 1000 * worker / rows,
        "shutdown_s": closing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--trackers", default="wandb,swanlab,trackio")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    print(f"{args.rows} rows of {args.keys} scalars, one exporter at a time")
    print(f"{'tracker':10} {'open s':>8} {'rows/s':>9} {'ms/row':>8} {'shutdown s':>11}")
    for name in args.trackers.split(","):
        r = measure(name, args.rows, args.keys)
        print(
            f"{name:10} {r['open_s']:8.2f} {r['rows_per_s']:9.0f} {r['ms_per_row']:8.3f} "
            f"{r['shutdown_s']:11.2f}"
        )


if __name__ == "__main__":
    main()
