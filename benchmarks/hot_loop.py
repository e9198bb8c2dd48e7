"""One training loop's cost on the training thread, for one source tree, printed as JSON.

The loop of the tail benchmark with every tracker on: ``STEPS`` steps of 50 keys (a 256-value
list every 10th step), ``step_finished=True``, JSONL + TensorBoard + MLflow (a local SQLite
store) + W&B (offline). It prints the median, p99, p99.9 and max of ``log_metrics`` in µs and
the loop's wall time. With ``--step timers+keys`` each step is a timed step (:func:`timed_step`:
five timers, one inside another, then the same ``log_metrics``), and the costs are of the whole
step.

It imports nothing of this checkout but ``otel_rl.Logger`` and the config keys every version
has (and uses only ``Logger.timer`` and ``Logger.log_metrics``), so ``benchmarks/against.py``
can run it on an older tree (``PYTHONPATH=<tree>``) beside the working tree, in the same run;
``benchmarks/training_thread.py`` and ``benchmarks/timed_step.py`` take their steps from here:

    python benchmarks/hot_loop.py --delivery process --steps 10000 [--step timers+keys]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KEYS, LIST_EVERY, LIST_SIZE = 50, 10, 256

#: The timers of :func:`timed_step` used one after another; ``train`` then holds ``forward``.
SEQUENTIAL_TIMERS = ("generation", "reward", "ref_logprobs")


def keys_step(logger: Any, row: dict[str, Any], step: int) -> None:
    """A step of keys alone: the step's values, and the step sealed."""
    logger.log_metrics(row, step=step, step_finished=True)


def timed_step(logger: Any, row: dict[str, Any], step: int) -> None:
    """A step as an instrumented training loop writes it: five timers around the step's phases
    (here empty: what is measured is the instrumentation), ``forward`` inside ``train``, then
    :func:`keys_step`."""
    for name in SEQUENTIAL_TIMERS:
        with logger.timer(name):
            pass
    with logger.timer("train"), logger.timer("forward"):  # forward opens inside train
        pass
    keys_step(logger, row, step)


class _BareBlock:
    """The least a timer can be: a context manager that reads the clock at its start and end
    and appends each reading (for :func:`floor_step`)."""

    __slots__ = ("readings",)

    def __init__(self) -> None:
        self.readings: list[float] = []

    def __enter__(self) -> _BareBlock:
        self.readings.append(time.monotonic())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.readings.append(time.monotonic())


_BARE = {name: _BareBlock() for name in (*SEQUENTIAL_TIMERS, "train", "forward")}


def floor_step(logger: Any, row: dict[str, Any], step: int) -> None:
    """:func:`timed_step` with the five timers replaced by :class:`_BareBlock`: what five
    ``with`` blocks cost this interpreter at the least, whatever a timer does inside them."""
    for name in SEQUENTIAL_TIMERS:
        with _BARE[name]:
            pass
    with _BARE["train"], _BARE["forward"]:
        pass
    for block in _BARE.values():
        block.readings.clear()
    keys_step(logger, row, step)


#: The steps a loop can time, by the name its rows give them.
STEP_KINDS: dict[str, Callable[[Any, dict[str, Any], int], None]] = {
    "keys": keys_step,
    "timers+keys": timed_step,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def config(root: Path, delivery: str, trackers: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "log_dir": str(root), "jsonl_enabled": True,
        "export": {"shutdown_timeout": 10.0, "delivery": delivery},
    }  # fmt: skip
    if trackers == "all":
        cfg["tensorboard_enabled"] = True
        cfg["mlflow_enabled"] = True
        cfg["mlflow"] = {
            "tracking_uri": f"sqlite:///{(root / 'mlflow.db').as_posix()}",
            "experiment_name": "hot-loop",
        }
        cfg["wandb_enabled"] = True
        cfg["wandb"] = {"project": "hot-loop", "name": "run", "mode": "offline"}
    return cfg


def run_loop(steps: int, delivery: str, trackers: str, step_kind: str = "keys") -> dict[str, Any]:
    import mlflow  # noqa: F401  (the SDKs' own import time stays out of the loop)
    import wandb  # noqa: F401

    import otel_rl
    from otel_rl import Logger

    # A tracker left behind at the deadline (a loaded machine) may still be writing its spool
    # when the loop ends: its leftovers are not the loop's business.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.environ[name] = str(root / name.lower())
            Path(os.environ[name]).mkdir()
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off",
                          MLFLOW_DISABLE_TELEMETRY="true")  # fmt: skip
        logger = Logger(config(root / "run", delivery, trackers))
        one_step = STEP_KINDS[step_kind]
        names = [f"train/metric_{i:03d}" for i in range(KEYS)]
        rewards = [float(i % 7) for i in range(LIST_SIZE)]
        costs = []
        loop_began = time.perf_counter()
        for step in range(steps):
            row: dict[str, Any] = {k: step * 0.001 + i for i, k in enumerate(names)}
            if step % LIST_EVERY == 0:
                row["train/rewards"] = rewards
            began = time.perf_counter()
            one_step(logger, row, step)
            costs.append((time.perf_counter() - began) * 1e6)
        wall = time.perf_counter() - loop_began
        finish_began = time.perf_counter()
        logger.finish()
        finish = time.perf_counter() - finish_began
    return {
        "tree": str(Path(otel_rl.__file__).resolve().parent.parent),
        "median_us": statistics.median(costs),
        "p99_us": percentile(costs, 99),
        "p99.9_us": percentile(costs, 99.9),
        "max_us": max(costs),
        "loop_s": wall,
        "finish_s": finish,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--delivery", choices=("thread", "process"), default="process")
    parser.add_argument("--trackers", choices=("all", "jsonl"), default="all")
    parser.add_argument("--step", choices=tuple(STEP_KINDS), default="keys")
    args = parser.parse_args(argv)
    result = run_loop(args.steps, args.delivery, args.trackers, args.step)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
