"""Wall time of one GPU collection over 64 simulated Ray nodes: RayNodeScraper vs a serial scrape.

The nodes serve the 8 x H100 fixture with values varied per node (tests/gpu_nodes.py) from a
separate process, so the servers do not share the client's interpreter. Baseline, measured in the
same run and alternated with ours: NeMo RL's way, one node after another with
``requests.get(url, timeout=5)`` and the whole page parsed by ``prometheus_client.parser``.

Scenarios: 64 healthy nodes with the fixture page (40 KB); 64 healthy nodes with a page of real
size (the fixture plus the ~900 other series of the real CPU-node capture, ~330 KB); 64 nodes of
which one hangs, one refuses connections and one returns malformed text; and real-size pages
answered after 30 ms, the time a local Ray 2.60 node takes to render its page. Timeout 5 s.

    python -m benchmarks.gpu_scrape [--nodes 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

TIMEOUT = 5.0


def _serve(pages: list[tuple[str, str]], delay: float, conn: Any) -> None:
    from tests.gpu_nodes import NodeFarm

    with NodeFarm() as farm:
        conn.send([farm.add(body, mode=mode, delay=delay) for body, mode in pages])
        conn.recv()  # until the parent is done


def _pages(nodes: int, big: bool, failures: bool) -> list[tuple[str, str]]:
    from tests.gpu_nodes import CPU_FIXTURE, H100_FIXTURE, render, simulated_node

    template = H100_FIXTURE.read_text()
    if big:
        # The capture's other families (components, tasks, ...): what a real page also holds.
        extra = [
            line
            for line in CPU_FIXTURE.read_text().splitlines()
            if not any(name in line for name in ("ray_node_", "python_", "process_", "target_info"))
        ]
        template = template + "\n".join(extra) + "\n"
    pages = [(render(simulated_node(k), template), "ok") for k in range(nodes)]
    if failures:
        pages[5] = ("", "hang")
        pages[33] = ("", "refused")
        pages[60 % nodes] = (pages[60 % nodes][0], "malformed")
    return pages


def serial_nemo_style(urls: list[str]) -> tuple[float, int]:
    """One node after another, whole page parsed (as NeMo RL's GPU monitor does)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    started = time.perf_counter()
    gpus = 0
    for url in urls:
        try:
            response = requests.get(url, timeout=TIMEOUT)
            if response.status_code != 200:
                continue
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name == "ray_node_gpus_utilization":
                        gpus += 1
        except Exception:
            continue
    return time.perf_counter() - started, gpus


def parallel_ours(urls: list[str]) -> tuple[float, int]:
    from otel_rl.ray.scraper import RayNodeScraper

    scraper = RayNodeScraper(urls, timeout=TIMEOUT)
    started = time.perf_counter()
    collection = scraper.collect_once()
    wall = time.perf_counter() - started
    assert collection is not None
    return wall, sum(len(s.gpus) for s in collection.samples.values())


def scenario(
    name: str, nodes: int, rounds: int, big: bool, failures: bool, delay: float = 0.0
) -> None:
    pages = _pages(nodes, big, failures)
    size = statistics.mean(len(body) for body, mode in pages if mode == "ok")
    parent, child = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(pages, delay, child), daemon=True)
    server.start()
    try:
        urls = parent.recv()
        ours, serial = [], []
        for _ in range(rounds):
            wall, gpus_ours = parallel_ours(urls)
            ours.append(wall)
            wall, gpus_serial = serial_nemo_style(urls)
            serial.append(wall)
        ours_s, serial_s = statistics.median(ours), statistics.median(serial)
        print(
            f"{name:<42} page {size / 1024:6.1f} KB | ours {ours_s:7.3f} s ({gpus_ours} GPUs) | "
            f"serial {serial_s:7.3f} s ({gpus_serial} GPUs) | {serial_s / ours_s:6.1f}x"
        )
    finally:
        parent.send("done")
        server.join(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.nodes} nodes, timeout {TIMEOUT:g} s per node, median of {args.rounds} rounds")
    scenario("healthy, fixture page", args.nodes, args.rounds, big=False, failures=False)
    scenario("healthy, real-size page", args.nodes, args.rounds, big=True, failures=False)
    # A real Ray 2.60 node takes ~30 ms to render its page (measured on a local node).
    scenario("healthy, real-size page, 30 ms render", args.nodes, args.rounds, True, False, 0.03)
    scenario("1 hanging, 1 refusing, 1 malformed", args.nodes, args.rounds, False, True)


if __name__ == "__main__":
    main()
