"""A job's store that is down: what the publisher of this process's state costs the training
thread when every publication fails.

Two runs of 50-key steps with a timer each and 1 ms of "work" between steps, alternated: the
publisher with no board (a process on its own, the baseline), and the publisher writing to a
``torch.distributed`` store on a closed port of 127.0.0.1, every 0.1 s instead of every 5 s and
giving up connecting after 0.05 s instead of 5 s (so that every publication reads the process's
state and fails, 50 times as often as by default: its cost shows if it has one). Reported:
p50/p99/p99.9 of ``log_metrics`` on each side and their ratio, and the publications tried.

    python -m benchmarks.job_store_down [--steps 5000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: Seconds between two publications in the measured runs (the default is 5 s).
PUBLISH_EVERY_S = 0.1
#: Seconds a publication tries to connect to the store (the default is 5 s).
BOARD_TIMEOUT_S = 0.05
#: Seconds of the loop's own work between two steps.
WORK_S = 0.001


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(log_dir: Path, store_down: bool, steps: int) -> tuple[list[float], int]:
    """``log_metrics`` latencies of one run, and the publications its publisher tried."""
    from otel_rl import Logger
    from otel_rl.watch import job_state

    logger = Logger({"log_dir": str(log_dir), "jsonl_enabled": False,
                     "capture_global_meters": False})  # fmt: skip
    publisher = job_state._PUBLISHERS[os.getpid()]
    board = job_state.TorchStoreBoard("127.0.0.1", _closed_port(), world_size=2)
    tried = [0]

    def boards() -> list[Any]:
        tried[0] += 1
        return [board] if store_down else []

    publisher.boards = boards  # type: ignore[method-assign]
    latencies = []
    try:
        for step in range(steps):
            with logger.timer("generation"):
                pass
            metrics = {f"k{i}": step * 0.01 + i for i in range(50)}
            started = time.perf_counter()
            logger.log_metrics(metrics, step=step, prefix="train")
            latencies.append(time.perf_counter() - started)
            time.sleep(WORK_S)
    finally:
        logger.finish()
        publisher.boards = lambda: []  # type: ignore[method-assign]
    return latencies, tried[0]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(quick: bool = False, steps: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    import logging

    from otel_rl.watch import job_state

    steps = steps or (200 if quick else 3000)
    rounds = rounds or (1 if quick else 3)
    defaults = job_state.PUBLISH_EVERY, job_state.BOARD_TIMEOUT
    job_state.PUBLISH_EVERY, job_state.BOARD_TIMEOUT = PUBLISH_EVERY_S, BOARD_TIMEOUT_S
    # The failing board is said once per publisher: not the subject here.
    logging.getLogger("otel_rl").setLevel(logging.ERROR)
    sides: dict[str, list[float]] = {"no board": [], "store down": []}
    tried: dict[str, int] = {"no board": 0, "store down": 0}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for index in range(rounds):
                for name, down in (("no board", False), ("store down", True)):
                    latencies, publications = one_run(Path(tmp) / f"{name}-{index}", down, steps)
                    sides[name] += latencies
                    tried[name] += publications
    finally:
        job_state.PUBLISH_EVERY, job_state.BOARD_TIMEOUT = defaults
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "publish_every_s": PUBLISH_EVERY_S}
    for name, values in sides.items():
        out[name] = {
            "p50_us": round(statistics.median(values) * 1e6, 2),
            "p99_us": round(_quantile(values, 0.99) * 1e6, 2),
            "p999_us": round(_quantile(values, 0.999) * 1e6, 2),
            "publications": tried[name],
        }
    for q in ("p50_us", "p99_us", "p999_us"):
        out[f"ratio_{q[:-3]}"] = round(out["store down"][q] / out["no board"][q], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import json

    print(json.dumps(run(quick=args.quick, steps=args.steps), indent=2))


if __name__ == "__main__":
    main()
