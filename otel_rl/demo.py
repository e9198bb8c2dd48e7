"""A simulated GRPO training loop that exercises the whole pipeline in a few seconds."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from otel_rl.config import BACKEND_FLAGS

DEMO_BACKENDS = ("tensorboard", "jsonl", "console")


def demo_config(
    log_dir: str | Path,
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
) -> dict[str, Any]:
    """The demo's embedded defaults: TensorBoard, JSONL and the console, no server needed."""
    unknown = [b for b in backends if b not in BACKEND_FLAGS]
    if unknown:
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKEND_FLAGS)}"
        )
    cfg: dict[str, Any] = {flag: name in backends for name, flag in BACKEND_FLAGS.items()}
    cfg.update(
        log_dir=str(log_dir),
        experiment="otel-rl-demo",
        console={"every": 10},
        wandb={"project": "otel-rl-demo", "mode": "offline"},
        mlflow={"experiment_name": "otel-rl-demo"},
        swanlab={"project": "otel-rl-demo", "mode": "offline"},
        trackio={"project": "otel-rl-demo"},
    )
    if prometheus_port is not None:
        cfg["prometheus"] = {"enabled": True, "port": prometheus_port}
    if otlp_endpoint is not None:
        cfg["otlp"] = {"enabled": True, "endpoint": otlp_endpoint}
    return cfg


def simulated_worker(rank: int, step: int, rng: random.Random) -> dict[str, float]:
    """What one training worker reports for a step: its loss, grad norm and timings."""
    return {
        "loss": 2.0 * math.exp(-step / 20) + rng.gauss(0, 0.02) + 0.01 * rank,
        "grad_norm": 1.0 + rng.random(),
        "tokens": float(rng.randint(3000, 5000)),
        "time_s": 0.004 + 0.002 * rank + rng.random() * 0.002,
    }


def reduce_workers(reports: Sequence[dict[str, float]]) -> dict[str, float]:
    """Merge worker reports: losses averaged, tokens summed, timings and norms by max."""
    n = len(reports)
    return {
        "loss": sum(r["loss"] for r in reports) / n,
        "grad_norm": max(r["grad_norm"] for r in reports),
        "tokens": sum(r["tokens"] for r in reports),
        "worker_time_s": max(r["time_s"] for r in reports),
    }


def run_demo(
    steps: int = 50,
    log_dir: str | Path = "logs/demo",
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the simulated loop; returns where the results are."""
    from otel_rl.logger import Logger

    rng = random.Random(seed)
    cfg = demo_config(log_dir, backends, prometheus_port, otlp_endpoint)
    with Logger(cfg) as logger:
        logger.log_hyperparams(
            {"algorithm": "grpo", "policy": {"lr": 1e-6, "model": "demo-0.5b"}, "steps": steps}
        )
        for step in range(steps):
            with logger.timer("generation"):
                time.sleep(0.004)
                lengths = [rng.randint(64, 512) + 4 * step for _ in range(16)]
            with logger.timer("reward"):
                base = -1.0 + 2.0 * (1 - math.exp(-step / 15))
                rewards = [base + rng.gauss(0, 0.3) for _ in range(16)]
            with logger.timer("train"):
                workers = [simulated_worker(rank, step, rng) for rank in range(2)]
                time.sleep(0.003)
            logger.log_metrics(
                {
                    "reward": rewards,
                    "kl": 0.002 * step + abs(rng.gauss(0, 0.001)),
                    "response_length": lengths,
                    **reduce_workers(workers),
                },
                step=step,
                prefix="train",
                step_finished=True,
            )
        summary = {
            "log_dir": str(Path(log_dir)),
            "tensorboard": str(Path(log_dir) / "tensorboard"),
            "jsonl": str(Path(log_dir) / "metrics.jsonl"),
            "prometheus": logger._pipeline.prometheus_url,
            "steps": steps,
        }
    return summary
