"""A collector that is down: what it costs the training thread, and how long ``finish()`` takes.

Two runs of 20-key steps with a timer each, alternated: OTLP off (the baseline), and OTLP on,
pointed at a closed port on 127.0.0.1 with a short export interval so that the reader thread
fails against it throughout. Reported: p50/p99 of ``log_metrics`` on each side, their ratio, and
``finish()``'s wall time with the collector down (its final export gives up within the OTLP
timeout; the providers shut down in parallel).

    python -m benchmarks.otlp_down [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

OTLP_TIMEOUT_S = 1.0


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(log_dir: Path, otlp: dict[str, Any], steps: int) -> tuple[list[float], float]:
    from otel_rl import Logger

    logger = Logger(
        {"log_dir": str(log_dir), "jsonl_enabled": False, "capture_global_meters": False,
         "otlp": otlp}
    )
    latencies = []
    for step in range(steps):
        with logger.timer("generation"):
            pass
        metrics = {f"k{i}": step * 0.01 + i for i in range(20)}
        started = time.perf_counter()
        logger.log_metrics(metrics, step=step, prefix="train")
        latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    logger.finish()
    return latencies, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(quick: bool = False, steps: int | None = None) -> dict[str, Any]:
    steps = steps or (100 if quick else 2000)
    dead = f"http://127.0.0.1:{_closed_port()}"
    down_cfg = {"enabled": True, "endpoint": dead, "interval": 0.05, "timeout": OTLP_TIMEOUT_S}
    base: list[float] = []
    down: list[float] = []
    finishes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(Path(tmp) / "warm", {"enabled": False}, min(steps, 100))  # imports, first costs
        for r in range(2 if quick else 3):
            base += one_run(Path(tmp) / f"base{r}", {"enabled": False}, steps)[0]
            lat, finish_s = one_run(Path(tmp) / f"down{r}", down_cfg, steps)
            down += lat
            finishes.append(finish_s)
    return {
        "steps": steps,
        "off_p50_us": round(_pct(base, 0.5) * 1e6, 1),
        "off_p99_us": round(_pct(base, 0.99) * 1e6, 1),
        "down_p50_us": round(_pct(down, 0.5) * 1e6, 1),
        "down_p99_us": round(_pct(down, 0.99) * 1e6, 1),
        "p99_ratio_down_vs_off": round(_pct(down, 0.99) / _pct(base, 0.99), 2),
        "finish_down_s": round(statistics.median(finishes), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    for key, value in run(steps=args.steps).items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
