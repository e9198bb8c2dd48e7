"""Driver-side cost of merging worker snapshots, and the worker-side cost of producing them.

    python -m benchmarks.merge [--quick]      # 8, 64, 512 worker snapshots x 200 keys

Each worker snapshot is built by a real ``WorkerMetrics``: ~85 % scalars (mixed reductions),
~10 % timings, ~5 % OTel histograms. Reported per call (medians): ``merge_snapshots`` alone;
``Logger.log_worker_metrics`` (merge + the normal ``log_metrics`` path, JSONL on); the baseline,
a hand-written reduction of plain ``{key: float}`` dicts by a per-key rule (what training code
without otel-rl does, with no histograms, weights or conflict checks), measured alternately in
the same run; the worker's ``record`` and ``snapshot``; and the pickled snapshot size.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

REDUCES = (None, "mean", "sum", "max", "min")


def _build_worker(rank: int, keys: int) -> tuple[Any, Callable[[int], None]]:
    from otel_rl import WorkerMetrics

    worker = WorkerMetrics(rank=rank, role="trainer")
    n_timers = max(1, keys // 10)
    n_hists = max(1, keys // 20)
    n_scalars = keys - n_timers - n_hists
    timers = [worker.timer(f"phase_{i}") for i in range(n_timers)]
    bounds = [1, 10, 100]
    hists = [
        worker.meter.create_histogram(f"dist_{i}", explicit_bucket_boundaries_advisory=bounds)
        for i in range(n_hists)
    ]

    def record_step(step: int) -> None:
        for i in range(n_scalars):
            worker.record(f"metric_{i}", rank + i + step, reduce=REDUCES[i % len(REDUCES)])
        for timer in timers:
            with timer:
                pass
        for h in hists:
            h.record(float(step % 50 + rank))

    return worker, record_step


def _hand_reduce(reports: list[dict[str, float]], rule: dict[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, how in rule.items():
        values = [r[key] for r in reports if key in r]
        if how == "sum":
            out[key] = sum(values)
        elif how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(workers: int, keys: int, repeat: int) -> dict[str, Any]:
    from otel_rl import Logger
    from otel_rl.distributed import ReductionRules, merge_snapshots

    built = [_build_worker(r, keys) for r in range(workers)]
    for _, record_step in built:
        record_step(0)
    snaps = [w.snapshot(step=0) for w, _ in built]
    rules = ReductionRules({"timing/*": ["max", "min", "mean"], "*_count": "sum"})
    plain = [{k: float(i + r) for i, k in enumerate(f"metric_{j}" for j in range(keys))}
             for r in range(workers)]  # fmt: skip
    rule = {k: ("mean", "sum", "max", "min")[i % 4] for i, k in enumerate(plain[0])}

    merge, baseline, log = [], [], []
    with tempfile.TemporaryDirectory() as tmp, Logger({"log_dir": tmp}) as logger:
        logger.log_worker_metrics(snaps, step=0, prefix="train")  # creates the instruments
        for step in range(1, repeat + 1):
            merge.append(_timed(lambda: merge_snapshots(snaps, rules, prefix="train")))
            baseline.append(_timed(lambda: _hand_reduce(plain, rule)))
            log.append(_timed(
                lambda s=step: logger.log_worker_metrics(snaps, step=s, prefix="train")
            ))  # fmt: skip

    worker, record_step = built[0]
    record = _median([_timed(lambda: worker.record("metric_0", 1.0)) for _ in range(2000)])
    snapshot = []
    for step in range(1, 21):
        record_step(step)
        snapshot.append(_timed(worker.snapshot))
    record_step(1)
    size = len(pickle.dumps(worker.snapshot()))
    return {
        "workers": workers,
        "keys": keys,
        "merge_ms": round(_median(merge) * 1e3, 3),
        "log_worker_metrics_ms": round(_median(log) * 1e3, 3),
        "baseline_dict_reduce_ms": round(_median(baseline) * 1e3, 3),
        "ours_over_baseline": round(_median(merge) / _median(baseline), 1),
        "worker_record_us": round(record * 1e6, 2),
        "worker_snapshot_ms": round(_median(snapshot) * 1e3, 3),
        "snapshot_bytes": size,
    }


#: Worker counts and how many merges each is timed over (fewer for the slow, large merges).
FULL = ((8, 200), (64, 50), (512, 10))
QUICK = ((8, 10), (64, 3))


def run(quick: bool = False, keys: int = 200) -> list[dict[str, Any]]:
    return [measure(workers, keys, repeat) for workers, repeat in (QUICK if quick else FULL)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    for row in run(parser.parse_args().quick):
        print(row)


if __name__ == "__main__":
    main()
