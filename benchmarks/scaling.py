"""How the training-thread cost grows with the number of keys, and whether memory stays flat.

For 10, 100, 1,000 and 10,000 keys per step: ``log_metrics`` (JSONL on, one tracker thread)
against OTel's own ``Gauge.set`` for the same keys on an SDK MeterProvider with one reader —
the floor any OTel-based logger pays — alternated in the same run. Then RSS over many steps.

    python -m benchmarks.scaling [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _ours(log_dir: Path, keys: int, steps: int) -> list[float]:
    from otel_rl import Logger

    row_keys = [f"train/k{i:05d}" for i in range(keys)]
    logger = Logger({"log_dir": str(log_dir)})
    costs = []
    for step in range(steps):
        row = {k: step + i * 0.5 for i, k in enumerate(row_keys)}
        t0 = time.perf_counter_ns()
        logger.log_metrics(row, step=step, step_finished=True)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    logger.finish()
    return costs


def _raw_otel(keys: int, steps: int) -> list[float]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    meter = provider.get_meter("bench")
    gauges = [meter.create_gauge(f"train.k{i:05d}") for i in range(keys)]
    costs = []
    for step in range(steps):
        t0 = time.perf_counter_ns()
        for i, gauge in enumerate(gauges):
            gauge.set(step + i * 0.5)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    provider.shutdown()
    return costs


def keys_scaling(quick: bool = False) -> list[dict[str, Any]]:
    sizes = (10, 100, 1_000) if quick else (10, 100, 1_000, 10_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for keys in sizes:
            steps = max(20, min(300, 300_000 // keys // (10 if quick else 1)))
            ours, raw = [], []
            for r in range(1 if quick else 2):
                ours += _ours(Path(tmp) / f"{keys}-{r}", keys, steps)
                raw += _raw_otel(keys, steps)
            o, b = statistics.median(ours), statistics.median(raw)
            rows.append({
                "keys": keys,
                "ours_median_us": round(o, 1),
                "otel_gauge_set_median_us": round(b, 1),
                "ours_per_key_us": round(o / keys, 3),
                "ratio_vs_raw_otel": round(b / o, 2),
            })
    return rows


def memory_over_steps(quick: bool = False) -> dict[str, Any]:
    """RSS over a long run of 100-key steps (JSONL on), sampled every tenth of the run.

    The loop logs as fast as it can (~30,000 steps/s, far above any training loop), so the
    exporter falls behind and its bounded queue fills; each sample is taken after ``flush()``
    (queue drained) and ``gc.collect()``, so it shows what is kept, not what is in flight. The
    first tenth sets the high-water mark of the queue's memory, which Python keeps for reuse.
    """
    from otel_rl import Logger

    steps = 5_000 if quick else 100_000
    every = steps // 10
    row = {f"train/k{i:03d}": float(i) for i in range(100)}
    samples: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        logger = Logger({"log_dir": tmp})
        for step in range(steps):
            logger.log_metrics(row, step=step, step_finished=True)
            if (step + 1) % every == 0:
                logger.flush()
                gc.collect()
                samples.append(_rss_mib())
        logger.finish()
    return {
        "steps": steps,
        "rss_at_10pct_mib": round(samples[0], 1),
        "rss_at_20pct_mib": round(samples[1], 1),
        "rss_end_mib": round(samples[-1], 1),
        "growth_20pct_to_end_mib": round(samples[-1] - samples[1], 1),
        "rss_every_10pct_mib": " ".join(f"{v:.0f}" for v in samples),
    }


def otel_sdk_costs(quick: bool = False) -> list[dict[str, Any]]:
    """What the OTel SDK itself costs: ``Gauge.set`` per call and one ``collect()`` of N gauges.

    The reason logged keys are not synchronous instruments collected at every step: the collect
    alone would cost more than our whole ``log_metrics``. One reader, no attributes, exemplars off.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics._internal.exemplar import AlwaysOffExemplarFilter
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    rows = []
    for n in (100, 200):
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader], exemplar_filter=AlwaysOffExemplarFilter())
        gauges = [provider.get_meter("bench").create_gauge(f"k{i:04d}") for i in range(n)]
        sets, collects = [], []
        for step in range(20 if quick else 200):
            t0 = time.perf_counter_ns()
            for gauge in gauges:
                gauge.set(step * 0.5)
            t1 = time.perf_counter_ns()
            reader.get_metrics_data()
            collects.append((time.perf_counter_ns() - t1) / 1e6)
            sets.append((t1 - t0) / 1000 / n)
        provider.shutdown()
        rows.append({
            "gauges": n,
            "gauge_set_us": round(statistics.median(sets), 2),
            "collect_ms": round(statistics.median(collects), 3),
        })  # fmt: skip
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    return {
        "keys": keys_scaling(quick),
        "otel_sdk": otel_sdk_costs(quick),
        "memory": memory_over_steps(quick),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    for row in result["keys"]:
        print(row)
    print(result["memory"])


if __name__ == "__main__":
    main()
