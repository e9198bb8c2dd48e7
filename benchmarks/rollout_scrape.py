"""Cost of one rollout-monitoring round over 8, 64 and 256 local inference engines.

Every engine serves the vLLM V1 fixture page (testkit/fixtures/rollout/, ~95 KB, 607 lines) from a
separate process (testkit/gpu_nodes.NodeFarm: one asyncio server per port), so the servers do not
share the client's interpreter. Ours: one :class:`RolloutMonitor` round (``flush()``: GET every
engine concurrently, parse, close a marked step, emit its rows) on the monitor's thread.
Baseline, measured in the same run and alternated with ours: the straightforward scraper, one
engine after another with ``requests.get(url, timeout=5)`` and the whole page parsed by
``prometheus_client.parser``. All engines are on this machine, so the client shares its cores with
the servers: parsing, not the network, bounds both sides.

    python -m benchmarks.rollout_scrape [--engines 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_scrape import serial_scrape

PAGE = Path(__file__).resolve().parent.parent / "testkit" / "fixtures" / "rollout"


def _serve(count: int, conn: Any) -> None:
    from testkit.gpu_nodes import NodeFarm

    body = (PAGE / "vllm-v1-8gpu-tp.prom").read_text()
    with NodeFarm() as farm:
        conn.send([farm.add(body) for _ in range(count)])
        conn.recv()  # until the parent is done


def serial_baseline(urls: list[str]) -> tuple[float, int]:
    """One engine after another, whole page parsed; counts the engines that answered."""
    return serial_scrape(urls, "vllm:num_requests_running")


class Ours:
    def __init__(self, urls: list[str]) -> None:
        from otel_rl.rollout import RolloutMonitor

        self.emitted: dict[str, float] = {}
        self.monitor = RolloutMonitor(urls, emit=self._emit, collection_interval=3600)
        self.monitor.wait_rounds(1, timeout=60)
        self.step = 0

    def _emit(self, step: int, values: dict[str, float]) -> None:
        self.emitted = values

    def round(self) -> tuple[float, int]:
        self.step += 1
        self.monitor.mark_step(self.step)
        started = time.perf_counter()
        if not self.monitor.flush(60):
            raise RuntimeError("rollout round did not finish within 60 s")
        return time.perf_counter() - started, int(self.emitted["rollout/engines_reporting"])

    def close(self) -> None:
        self.monitor.close()


def scenario(engines: int, rounds: int) -> dict[str, Any]:
    parent, child = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(engines, child), daemon=True)
    server.start()
    try:
        urls = parent.recv()
        ours = Ours(urls)
        try:
            mine, serial = [], []
            for r in range(rounds):
                order = ("ours", "serial") if r % 2 == 0 else ("serial", "ours")
                for which in order:
                    if which == "ours":
                        wall, seen_ours = ours.round()
                        mine.append(wall)
                    else:
                        wall, seen_serial = serial_baseline(urls)
                        serial.append(wall)
        finally:
            ours.close()
    finally:
        parent.send("done")
        server.join(15)
    ours_s, serial_s = statistics.median(mine), statistics.median(serial)
    return {
        "engines": engines,
        "ours_ms_per_round": round(ours_s * 1000, 1),
        "ours_ms_per_engine": round(ours_s * 1000 / engines, 2),
        "ours_engines_seen": seen_ours,
        "serial_ms_per_round": round(serial_s * 1000, 1),
        "serial_engines_seen": seen_serial,
        "ratio": round(serial_s / ours_s, 1),
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    if quick:
        return [scenario(8, 1)]
    return [scenario(n, rounds) for n, rounds in ((8, 5), (64, 3), (256, 3))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=0, help="one size (default 8, 64, 256)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [args.engines] if args.engines else [8, 64, 256]
    for n in sizes:
        row = scenario(n, args.rounds)
        print(
            f"{n:4d} engines | ours {row['ours_ms_per_round']:8.1f} ms/round "
            f"({row['ours_ms_per_engine']:.2f} ms/engine, {row['ours_engines_seen']} seen) | "
            f"serial {row['serial_ms_per_round']:8.1f} ms/round | {row['ratio']:5.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
