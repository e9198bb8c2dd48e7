"""A simulated GRPO training loop that exercises the whole pipeline in a few seconds."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from otel_rl.delivery.registry import BACKEND_FLAGS
from otel_rl.distributed.worker import WorkerMetrics

DEMO_BACKENDS = ("tensorboard", "jsonl", "console")


def check_backends(backends: Sequence[str]) -> None:
    """Refuse names that are not trackers, listing the valid ones."""
    unknown = [b for b in backends if b not in BACKEND_FLAGS]
    if unknown:
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKEND_FLAGS)}"
        )


def demo_config(
    log_dir: str | Path,
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    stall: float = 0.0,
) -> dict[str, Any]:
    """The demo's embedded defaults: TensorBoard, JSONL and the console, no server needed.
    ``stall``: the watchdog's threshold is 2 s (half the stall if shorter), so that it shows."""
    check_backends(backends)
    cfg: dict[str, Any] = {flag: name in backends for name, flag in BACKEND_FLAGS.items()}
    cfg.update(
        log_dir=str(log_dir),
        experiment="otel-rl-demo",
        console={"every": 10},
        wandb={"project": "otel-rl-demo", "mode": "offline"},
        mlflow={"experiment_name": "otel-rl-demo"},
        swanlab={"project": "otel-rl-demo", "mode": "offline"},
        trackio={"project": "otel-rl-demo"},
        clearml={"project_name": "otel-rl-demo", "offline": True},
    )
    if prometheus_port is not None:
        cfg["prometheus"] = {"enabled": True, "port": prometheus_port}
    if otlp_endpoint is not None:
        # A shorter push interval than the default 10 s, so a paced demo looks live in Grafana.
        cfg["otlp"] = {"enabled": True, "endpoint": otlp_endpoint, "interval": 5.0}
    if stall > 0:  # a threshold the demo's stall passes, however short it is asked to be
        cfg["stalls"] = {"after": min(2.0, max(0.2, stall / 2)), "factor": 5.0}
    return cfg


def simulated_worker(worker: WorkerMetrics, step: int, rng: random.Random) -> float:
    """One training worker's step, recorded with its reductions; returns its token count.

    The driver merges the workers' snapshots: losses averaged, tokens summed, grad norms and
    the step time (``timing/worker_step``) by max across workers.
    """
    with worker.timer("worker_step"):
        time.sleep(0.002 + 0.0005 * worker.rank)
    tokens = float(rng.randint(3000, 5000))
    worker.record("loss", 2.0 * math.exp(-step / 20) + rng.gauss(0, 0.02) + 0.01 * worker.rank)
    worker.record("grad_norm", 1.0 + rng.random(), reduce="max")
    worker.record("tokens", tokens, reduce="sum")
    return tokens


def simulate_training(
    logger: Any, steps: int, seed: int = 0, step_seconds: float = 0.0, stall: float = 0.0
) -> None:
    """The demo's GRPO-like loop on ``logger``: rewards, loss, KL, lengths, timings, throughput.
    ``stall``: half-way, one generation hangs that many seconds (a rollout that never returns)."""
    rng = random.Random(seed)
    workers = [WorkerMetrics(rank=rank, role="trainer") for rank in range(2)]
    for step in range(steps):
        started = time.perf_counter()
        with logger.timer("generation"):
            time.sleep(0.004)
            if stall > 0 and step == steps // 2:
                wait_for_a_rollout_that_hangs(stall)
            lengths = [rng.randint(64, 512) + 4 * step for _ in range(16)]
        with logger.timer("reward"):
            base = -1.0 + 2.0 * (1 - math.exp(-step / 15))
            rewards = [base + rng.gauss(0, 0.3) for _ in range(16)]
        with logger.timer("train"):
            tokens = sum(simulated_worker(worker, step, rng) for worker in workers)
        # verl's name for tokens per second; Grafana's throughput panel plots it.
        logger.log_metrics(
            {"perf/throughput": tokens / (time.perf_counter() - started)}, step=step
        )
        snapshots = [worker.snapshot(step=step) for worker in workers]  # as Ray results would be
        logger.log_worker_metrics(snapshots, step=step, prefix="train")
        logger.log_metrics(
            {
                "reward": rewards,
                "kl": 0.002 * step + abs(rng.gauss(0, 0.001)),
                "response_length": lengths,
            },
            step=step,
            prefix="train",
            step_finished=True,
        )
        if step_seconds > 0:
            time.sleep(max(0.0, step_seconds - (time.perf_counter() - started)))


def wait_for_a_rollout_that_hangs(seconds: float) -> None:
    """The demo's stall: what a stuck inference engine looks like from the training loop."""
    time.sleep(seconds)


def run_demo(
    steps: int = 50,
    log_dir: str | Path = "logs/demo",
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
    step_seconds: float = 0.0,
    hold: float = 0.0,
    on_start: Callable[[Path], object] | None = None,
    stall: float = 0.0,
) -> dict[str, Any]:
    """Run the simulated loop into a new run directory; returns where the results are.

    Each call writes into ``<log_dir>/exp_<NNN>`` with the next free number, as NeMo RL names
    its experiment directories: running the demo again never appends a second run to the
    first one's ``metrics.jsonl`` or TensorBoard files (step 0 twice in one chart).

    ``step_seconds`` paces the loop (a live dashboard needs steps spread over scrapes);
    ``hold`` keeps ``/metrics`` served that many seconds after the last step, so a Prometheus
    that scrapes every 15 s still sees the final values. ``on_start`` is called with the run
    directory once the run's Logger exists, so that a caller stopped by a signal can say where
    the steps logged so far are.

    SIGINT and SIGTERM stop the loop at a safe point (``KeyboardInterrupt``,
    ``SystemExit(143)``); the trackers are closed with 130/143 before the exception leaves.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    check_backends(backends)  # before a run directory is claimed for nothing
    from otel_rl.compat.nemo_utils import get_next_experiment_dir
    from otel_rl.logger import Logger

    run_dir = Path(get_next_experiment_dir(str(log_dir)))
    cfg = demo_config(run_dir, backends, prometheus_port, otlp_endpoint, stall)
    try:
        logger = Logger(cfg)
    except BaseException:
        # Nothing was written: give the number back rather than leave an empty exp directory.
        with contextlib.suppress(OSError):
            run_dir.rmdir()
        raise
    if on_start is not None:
        on_start(run_dir)
    with logger:
        logger.log_hyperparams(
            {"algorithm": "grpo", "policy": {"lr": 1e-6, "model": "demo-0.5b"}, "steps": steps}
        )
        simulate_training(logger, steps, seed=seed, step_seconds=step_seconds, stall=stall)
        if hold > 0:
            time.sleep(hold)
        summary = {
            "base_dir": str(Path(log_dir)),
            "log_dir": str(run_dir),
            "tensorboard": str(run_dir / "tensorboard"),
            "jsonl": str(run_dir / "metrics.jsonl"),
            "prometheus": logger.prometheus_url,
            "otlp": logger.otlp_endpoint,
            "steps": steps,
        }
    return summary
