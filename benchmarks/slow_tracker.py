"""A slow tracker: the training-thread benchmark with 50 ms added to every MLflow request.

The same four trackers and the same two sides as benchmarks/training_thread.py (ours: one
``Logger`` with TensorBoard, MLflow, W&B offline and JSONL; baseline: the synchronous fan-out),
but MLflow is reached through a proxy on 127.0.0.1 (benchmarks/delay_proxy.py) that holds each
request for 50 ms, as a remote or busy tracking server would. Both sides run through the proxy
with no delay and with the delay, ours and the baseline alternated, so the only difference
between the two conditions is the latency. Ours should not move: MLflow is written on its own
thread, and a backlog leaves in few, large requests. The baseline waits for every request.

``--quick``: 10 steps, with the delay only (a server is still started: the proxy needs one).

    python -m benchmarks.slow_tracker [--steps 500] [--delay 0.05] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.delay_proxy import DelayProxy
from benchmarks.training_thread import (
    make_rows,
    percentile,
    run_baseline,
    run_ours,
    tracker_environment,
)

DELAY_S = 0.05


def measure(steps: int, delays: tuple[float, ...], server_url: str, root: Path) -> list[dict]:
    rows = make_rows(steps, 100)
    out = []
    with tracker_environment(root):
        for i, delay in enumerate(delays):
            with DelayProxy(server_url, delay) as proxy:
                sides = (run_ours, run_baseline) if i % 2 == 0 else (run_baseline, run_ours)
                results = {
                    fn.__name__: fn(root / f"{fn.__name__}-{delay}", rows, proxy.url)
                    for fn in sides
                }  # fmt: skip
            ours, base = results["run_ours"], results["run_baseline"]
            o_med = statistics.median(ours["costs"])
            b_med = statistics.median(base["costs"])
            out.append({
                "mlflow_delay_ms": round(delay * 1000),
                "steps": steps,
                "ours_median_us": round(o_med, 1),
                "ours_p99_us": round(percentile(ours["costs"], 99), 1),
                "ours_mean_us": round(statistics.fmean(ours["costs"]), 1),
                "ours_max_us": round(max(ours["costs"]), 1),
                "baseline_median_us": round(b_med, 1),
                "baseline_p99_us": round(percentile(base["costs"], 99), 1),
                "ratio_median": round(b_med / o_med, 1),
                "ours_durable_s": round(ours["durable_s"], 2),
                "baseline_loop_s": round(base["loop_s"], 2),
                "baseline_durable_s": round(base["durable_s"], 2),
            })  # fmt: skip
    return out


def prepare(quick: bool = False) -> None:
    """Boot the MLflow server while the benchmarks before this one run."""
    from benchmarks.mlflow_server import start_in_background

    start_in_background()


def run(quick: bool = False, steps: int | None = None, delay: float = DELAY_S) -> list[dict]:
    from benchmarks.mlflow_server import shared_server_url

    steps = steps or (10 if quick else 500)
    delays = (delay,) if quick else (0.0, delay)
    with tempfile.TemporaryDirectory(prefix="otel-rl-bench-") as tmp:
        return measure(steps, delays, shared_server_url(), Path(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--delay", type=float, default=DELAY_S)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(args.quick, args.steps, args.delay):
        print(row)


if __name__ == "__main__":
    main()
