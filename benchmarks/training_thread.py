"""Training-thread cost of ``log_metrics`` (100 keys/step) with TensorBoard + JSONL enabled.

Baseline, measured in the same run and alternated with ours: a synchronous fan-out as NeMo RL's
and verl's loggers do it — ``SummaryWriter.add_scalar`` per key (torch's writer, as NeMo RL uses;
our own event encoder when torch is absent) and one JSON line per step, on the training thread.

    python -m benchmarks.training_thread [--steps 500] [--keys 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _rows(steps: int, keys: int) -> list[dict[str, float]]:
    names = [f"train/metric_{i:04d}" for i in range(keys)]
    return [{k: step * 0.001 + i for i, k in enumerate(names)} for step in range(steps)]


def run_ours(log_dir: Path, rows: list[dict[str, float]]) -> tuple[list[float], float]:
    from otel_rl import Logger

    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": True}
    logger = Logger(cfg)
    costs = []
    for step, row in enumerate(rows):
        t0 = time.perf_counter_ns()
        logger.log_metrics(row, step=step, step_finished=True)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    t0 = time.perf_counter()
    logger.finish()
    return costs, time.perf_counter() - t0


class SyncFanOut:
    """What users run today: every tracker called directly on the training thread."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer: Any = None
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        except ImportError:
            from otel_rl.exporters.tensorboard import TensorBoardExporter

            # Reuse only the event encoding: the writes happen here, synchronously.
            self._tb = TensorBoardExporter.__new__(TensorBoardExporter)
            self._tb.log_dir = log_dir / "tensorboard"
            self._tb._file = None
            self._tb.open()
        self._jsonl = (log_dir / "metrics.jsonl").open("a")

    def log(self, row: dict[str, Any], step: int) -> None:
        if self._writer is not None:
            for key, value in row.items():
                self._writer.add_scalar(key, value, step)
        else:
            self._tb._write_event(self._tb._event(step, row, time.time()))
            self._tb._file.flush()
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), "metrics": row}) + "\n")
        self._jsonl.flush()

    @property
    def kind(self) -> str:
        return "torch SummaryWriter" if self._writer is not None else "direct event writes"

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._tb._file.close()
        self._jsonl.close()


def run_baseline(log_dir: Path, rows: list[dict[str, float]]) -> tuple[list[float], str]:
    sink = SyncFanOut(log_dir)
    costs = []
    for step, row in enumerate(rows):
        t0 = time.perf_counter_ns()
        sink.log(row, step)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    sink.close()
    return costs, sink.kind


def measure(steps: int = 500, keys: int = 100, rounds: int = 3) -> dict[str, Any]:
    rows = _rows(steps, keys)
    ours: list[float] = []
    base: list[float] = []
    drain: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # alternate so drift hits both equally
            costs, drained = run_ours(Path(tmp) / f"ours{r}", rows)
            ours.extend(costs)
            drain.append(drained)
            costs, kind = run_baseline(Path(tmp) / f"base{r}", rows)
            base.extend(costs)
    ours_med = statistics.median(ours)
    base_med = statistics.median(base)
    return {
        "baseline": kind,
        "steps": steps,
        "keys": keys,
        "ours_median_us": round(ours_med, 1),
        "ours_p99_us": round(statistics.quantiles(ours, n=100)[98], 1),
        "baseline_median_us": round(base_med, 1),
        "ratio": round(base_med / ours_med, 1),
        "finish_drain_s": round(statistics.median(drain), 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    return measure(steps=100 if quick else 500, keys=100, rounds=1 if quick else 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.steps, args.keys, args.rounds)
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
