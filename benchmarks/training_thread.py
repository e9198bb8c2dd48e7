"""Training-thread cost of logging 100 keys per step to TensorBoard, MLflow, W&B and JSONL at once.

Ours: ``Logger.log_metrics(row, step, step_finished=True)`` with TensorBoard, MLflow (a real
``mlflow server`` on 127.0.0.1, SQLite backend), W&B (offline) and JSONL enabled.

Baseline, measured in the same run and alternated with ours: a synchronous fan-out that calls the
same SDKs directly in the loop, as NeMo RL's and verl's loggers do — torch's
``SummaryWriter.add_scalar`` per key, ``MlflowClient.log_batch`` per step to the same server,
``wandb.log`` per step (offline), one JSON line per step.

Both sides open their trackers and log the run's config before the loop (not timed), so the loop
measures steady-state logging. Reported: per-step median, p99 and mean in µs, the ratio of the
medians, and the time until every row is durable — for ours, the loop plus ``finish()`` (which
drains every queue and closes every run); for the baseline, the loop itself (each call returned
after its SDK took the row) and, separately, the loop plus closing the writers and runs.

W&B runs offline in a temporary directory (``WANDB_MODE=offline``, ``WANDB_SILENT=true``).
``--quick`` uses 30 steps, one round and a local SQLite MLflow store instead of a server.

    python -m benchmarks.training_thread [--steps 500] [--keys 100] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.hot_loop import STEP_KINDS

HYPERPARAMS = {"lr": 1e-6, "batch_size": 256, "model": "bench-model", "kl_coef": 0.01}


def make_rows(steps: int, keys: int) -> list[dict[str, float]]:
    names = [f"train/metric_{i:04d}" for i in range(keys)]
    return [{k: step * 0.001 + i for i, k in enumerate(names)} for step in range(steps)]


@contextmanager
def tracker_environment(root: Path) -> Iterator[None]:
    """W&B offline and silent with all of its files under ``root``, MLflow quiet; restored after."""
    settings = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(root / "wandb-dir"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }
    import_sdks()  # mlflow sets its loggers' levels on import: import first, then quiet them
    saved = {k: os.environ.get(k) for k in settings}
    # MLflow's SQLite store logs its schema migrations at INFO on first use (quick mode).
    quiet = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.WARNING)
    for key, value in settings.items():
        os.environ[key] = value
        if key.endswith("_DIR"):
            Path(value).mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_sdks() -> None:
    """Import every SDK once up front, so neither side pays an import inside its loop."""
    import mlflow  # noqa: F401
    import wandb  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401


def percentile(values: list[float], pct: float) -> float:
    """The ``pct``-th percentile (to a tenth: 99.9), interpolated between measured values
    (never beyond them)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(pct * 10) - 1]


# ---- ours -------------------------------------------------------------------------------------


def timed_loop(
    log: Callable[[dict[str, float], int], object], rows: list[dict[str, float]], pause: float
) -> tuple[list[float], float]:
    """µs per ``log(row, step)`` call, and the loop's wall time in seconds (pauses included)."""
    costs = []
    start = time.perf_counter()
    for step, row in enumerate(rows):
        if pause:
            time.sleep(pause)  # the rest of a training step: waiting on the GPU, GIL released
        t0 = time.perf_counter_ns()
        log(row, step)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    return costs, time.perf_counter() - start


def four_trackers(log_dir: Path, tracking_uri: str, delivery: str = "thread") -> dict[str, Any]:
    """Ours: TensorBoard, MLflow (``tracking_uri``), W&B (offline) and JSONL."""
    experiment = f"bench-ours-{uuid.uuid4().hex[:8]}"
    return {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "jsonl_enabled": True,
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": tracking_uri, "experiment_name": experiment},
        "wandb_enabled": True,
        "wandb": {"project": "otel-rl-bench", "name": experiment, "mode": "offline",
                  "dir": str(log_dir)},
        "export": {"delivery": delivery},
    }  # fmt: skip


def run_ours(
    log_dir: Path,
    rows: list[dict[str, float]],
    tracking_uri: str,
    pause: float = 0.0,
    delivery: str = "thread",
    step: str = "keys",
) -> dict[str, Any]:
    return run_logger(four_trackers(log_dir, tracking_uri, delivery), rows, pause,
                      STEP_KINDS[step])  # fmt: skip


def run_logger(
    cfg: dict[str, Any],
    rows: list[dict[str, float]],
    pause: float = 0.0,
    step: Callable[[Any, dict[str, Any], int], None] = STEP_KINDS["keys"],
) -> dict[str, Any]:
    """One ``Logger(cfg)`` through ``rows``, each call one ``step(logger, row, step number)``
    (one of :data:`benchmarks.hot_loop.STEP_KINDS`: the keys alone, or five timers and the
    keys)."""
    from otel_rl import Logger

    logger = Logger(cfg)
    logger.log_hyperparams(HYPERPARAMS)
    if not logger.flush(timeout=120):  # every tracker open, as after a real run's set-up
        raise RuntimeError("trackers did not open within 120 s")
    start = time.perf_counter()
    costs, loop = timed_loop(functools.partial(step, logger), rows, pause)
    logger.finish()
    durable = time.perf_counter() - start
    for exporter in logger.exporters:  # every row reached every tracker, or the numbers lie
        delivered = exporter.stats["delivered"] - 1  # the hyperparameters record
        # (more is fine: a run with tracing also sends its timeline page at the end)
        if delivered < len(rows) or getattr(exporter, "undelivered", 0):
            raise RuntimeError(f"{exporter.name} delivered {delivered} of {len(rows)} rows")
    return {"costs": costs, "loop_s": loop, "durable_s": durable}


# ---- baseline ---------------------------------------------------------------------------------


class SyncFanOut:
    """What users run today: every tracker's SDK called directly on the training thread."""

    def __init__(self, log_dir: Path, tracking_uri: str) -> None:
        import wandb
        from mlflow import MlflowClient
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"bench-baseline-{uuid.uuid4().hex[:8]}"
        self._writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        self._mlflow = MlflowClient(tracking_uri=tracking_uri)
        experiment_id = self._mlflow.create_experiment(name)
        self._run_id = self._mlflow.create_run(experiment_id, run_name=name).info.run_id
        self._mlflow.log_batch(self._run_id, params=[_param(k, v) for k, v in HYPERPARAMS.items()])
        self._wandb = wandb.init(
            project="otel-rl-bench", name=name, mode="offline", dir=str(log_dir),
            config=HYPERPARAMS,
        )  # fmt: skip
        self._jsonl = (log_dir / "metrics.jsonl").open("a")

    def log(self, row: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        for key, value in row.items():
            self._writer.add_scalar(key, value, step)
        now = int(time.time() * 1000)
        self._mlflow.log_batch(
            self._run_id, metrics=[Metric(k, v, now, step) for k, v in row.items()]
        )
        self._wandb.log(row, step=step)
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), "metrics": row}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        self._writer.close()
        self._mlflow.set_terminated(self._run_id)
        self._wandb.finish()
        self._jsonl.close()


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, str(value))


def run_baseline(
    log_dir: Path, rows: list[dict[str, float]], tracking_uri: str, pause: float = 0.0
) -> dict[str, Any]:
    sink = SyncFanOut(log_dir, tracking_uri)
    start = time.perf_counter()
    costs, loop = timed_loop(sink.log, rows, pause)
    sink.close()
    return {"costs": costs, "loop_s": loop, "durable_s": time.perf_counter() - start}


# ---- the comparison ---------------------------------------------------------------------------


def compare(
    steps: int,
    keys: int,
    rounds: int,
    tracking_uri: str,
    root: Path,
    pause: float = 0.0,
    delivery: str = "thread",
) -> dict[str, Any]:
    """Alternate ours and the baseline ``rounds`` times against ``tracking_uri``."""
    rows = make_rows(steps, keys)
    ours: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    with tracker_environment(root):
        for r in range(rounds):  # alternate so drift hits both sides equally
            first, second = (run_ours, run_baseline) if r % 2 == 0 else (run_baseline, run_ours)
            for fn in (first, second):
                where = root / f"{fn.__name__}-{pause}-{delivery}-{r}"
                result = (
                    run_ours(where, rows, tracking_uri, pause, delivery)
                    if fn is run_ours
                    else run_baseline(where, rows, tracking_uri, pause)
                )
                (ours if fn is run_ours else base).append(result)
    o = [c for r in ours for c in r["costs"]]
    b = [c for r in base for c in r["costs"]]
    o_med, b_med = statistics.median(o), statistics.median(b)
    return {
        "loop": f"{pause * 1000:g} ms pause/step" if pause else "back-to-back",
        "delivery": delivery,
        "steps": steps,
        "keys": keys,
        "rounds": rounds,
        "ours_median_us": round(o_med, 1),
        "ours_p99_us": round(percentile(o, 99), 1),
        "ours_mean_us": round(statistics.fmean(o), 1),
        "ours_max_us": round(max(o), 1),
        "baseline_median_us": round(b_med, 1),
        "baseline_p99_us": round(percentile(b, 99), 1),
        "baseline_mean_us": round(statistics.fmean(b), 1),
        "ratio_median": round(b_med / o_med, 1),
        "ratio_mean": round(statistics.fmean(b) / statistics.fmean(o), 1),
        "ours_loop_s": round(statistics.median(r["loop_s"] for r in ours), 3),
        "ours_durable_s": round(statistics.median(r["durable_s"] for r in ours), 2),
        "baseline_loop_s": round(statistics.median(r["loop_s"] for r in base), 2),
        "baseline_durable_s": round(statistics.median(r["durable_s"] for r in base), 2),
    }


def tracking_store(quick: bool, root: Path) -> tuple[str, str]:
    """(tracking URI, what it is): the shared local server, or in quick mode a SQLite file."""
    if quick:
        uri = f"sqlite:///{(root / 'mlflow.db').as_posix()}"
        return uri, "local SQLite store (quick mode: no server)"
    from benchmarks.mlflow_server import shared_server_url

    return shared_server_url(), "mlflow server on 127.0.0.1"


#: The paced variant: 200 steps with a 50 ms pause before each (GIL released, as while waiting
#: on the GPU), closer to a real loop: the trackers keep up and every call starts cold.
PACED_STEPS, PAUSE_S = 200, 0.05


def run(
    quick: bool = False, steps: int | None = None, rounds: int | None = None
) -> list[dict[str, Any]]:
    steps = steps or (30 if quick else 500)
    rounds = rounds or (1 if quick else 3)
    with tempfile.TemporaryDirectory(prefix="otel-rl-bench-") as tmp:
        uri, store = tracking_store(quick, Path(tmp))
        results = [compare(steps, 100, rounds, uri, Path(tmp))]
        if not quick:
            results.append(compare(steps, 100, 1, uri, Path(tmp), delivery="process"))
            results.append(compare(PACED_STEPS, 100, 1, uri, Path(tmp), pause=PAUSE_S))
    return [{"mlflow": store, **result} for result in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for result in run(args.quick, args.steps, args.rounds):
        width = max(map(len, result))
        for k, v in result.items():
            print(f"{k:<{width}}  {v}")
        print()


if __name__ == "__main__":
    main()
