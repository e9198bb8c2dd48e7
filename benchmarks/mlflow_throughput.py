"""Exporter-thread throughput of the MLflow exporter over HTTP: rows/s of 100 scalars.

Starts a local ``mlflow server`` (SQLite backend, 127.0.0.1) unless ``--tracking-uri`` is
given. After a warm-up row (which creates the run), ``--rows`` step batches are queued at once
and timed until the exporter's queue is empty (``force_flush``). "batched" is the exporter as
shipped (a backlog of up to 64 steps leaves in requests of up to 1000 metrics); "one request per
step" is the same exporter with ``max_batch = 1``.

    python -m benchmarks.mlflow_throughput [--rows 1000] [--keys 100] [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import StepBatch
from otel_rl.exporters.mlflow import MlflowExporter


class UnbatchedMlflowExporter(MlflowExporter):
    max_batch: ClassVar[int] = 1


def _batches(rows: int, keys: int, start: int) -> list[StepBatch]:
    names = [f"train/metric_{i:03d}" for i in range(keys)]
    rng = random.Random(0)
    return [
        StepBatch(step=start + s, values={k: rng.random() for k in names}) for s in range(rows)
    ]


def measure(cls: type[MlflowExporter], uri: str, rows: int, keys: int) -> dict[str, float]:
    exporter = cls(tracking_uri=uri, experiment_name=f"bench-{uuid.uuid4().hex[:8]}")
    exporter.delivery.submit(_batches(1, keys, 0)[0])
    exporter.force_flush(timeout_millis=120_000)
    batches = _batches(rows, keys, 1)
    for batch in batches:
        _ = batch.rows  # built on the exporter thread in real runs; not what is measured here
    t0 = time.perf_counter()
    for batch in batches:
        exporter.delivery.submit(batch)
    assert exporter.force_flush(timeout_millis=600_000), "not drained"
    elapsed = time.perf_counter() - t0
    exporter.shutdown()
    return {"rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed,
            "metrics_per_s": rows * keys / elapsed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--unbatched-rows", type=int, default=300)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--tracking-uri")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    server: Any = None
    uri = args.tracking_uri
    if uri is None:
        from testkit.servers import start_mlflow_server

        server = start_mlflow_server(Path(tempfile.mkdtemp(prefix="otel-rl-bench-mlflow-")))
        uri = server.url
    try:
        for label, cls, rows in [
            ("batched", MlflowExporter, args.rows),
            ("one request per step", UnbatchedMlflowExporter, args.unbatched_rows),
        ]:
            r = measure(cls, uri, rows, args.keys)
            print(
                f"mlflow {label:>22}: {r['rows_per_s']:8.1f} rows/s of {args.keys} keys "
                f"({r['metrics_per_s']:,.0f} metrics/s; {r['rows']} rows in {r['seconds']:.2f} s)"
            )
    finally:
        if server is not None:
            from testkit.servers import stop_mlflow_server

            stop_mlflow_server(server)


if __name__ == "__main__":
    main()
