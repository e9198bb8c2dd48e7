"""A traced RL driver on a local Ray cluster, run as its own process by
tests/sources/test_ray_tracing.py.

What a user writes: ``ray.init(_tracing_startup_hook="otel_rl.ray.tracing:setup")`` with the
collector's ``OTEL_EXPORTER_OTLP_*`` variables in ``runtime_env``, a Logger with
``tracing.enabled``, and actors that only use ``WorkerMetrics`` timers.

Usage: ``python testkit/ray_tracing_driver.py LOG_DIR STEPS``. The OTLP endpoint comes from the
environment. After the last step the driver prints ``STEPS-DONE`` and waits for a line on stdin
before shutting Ray down, so the workers' batch span processors export while they are alive.
"""

from __future__ import annotations

import os
import sys
import time

import ray

from otel_rl import Logger, WorkerMetrics

N_ACTORS = 2


class Trainer:
    """A worker as users write it: WorkerMetrics timers, nothing about tracing."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.metrics = WorkerMetrics(rank=rank, role="trainer")

    def generate(self, step: int) -> int:
        with self.metrics.timer("generate"):
            time.sleep(0.02 * (self.rank + 1))
        return step

    def train(self, step: int) -> dict:
        with self.metrics.timer("forward"):
            time.sleep(0.01 * (self.rank + 1))
        with self.metrics.timer("backward"):
            time.sleep(0.015 * (self.rank + 1))
        return self.metrics.snapshot(step=step)


def main(log_dir: str, steps: int) -> None:
    otlp_env = {k: v for k, v in os.environ.items() if k.startswith(("OTEL_", "RAY_ENABLE"))}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _tracing_startup_hook="otel_rl.ray.tracing:setup",
        runtime_env={"env_vars": otlp_env},
    )
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(rank) for rank in range(N_ACTORS)]
    cfg = {
        "log_dir": log_dir,
        "run_id": "traced-run",
        "tracing": {"enabled": True},
        "reductions": {"timing/*": ["max", "min"]},
    }
    with Logger(cfg) as logger:
        for step in range(steps):
            with logger.timer("rollout"):
                ray.get([t.generate.remote(step) for t in trainers])
            with logger.timer("update"):
                snapshots = ray.get([t.train.remote(step) for t in trainers])
            logger.log_worker_metrics(snapshots, step=step, prefix="workers")
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    print("STEPS-DONE", flush=True)
    sys.stdin.readline()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
