"""Wall time of one GPU collection over 8, 64 and 256 simulated Ray nodes: ours vs a serial scrape.

The nodes serve the 8 x H100 fixture with values varied per node (testkit/gpu_nodes.py) from a
separate process, so the servers do not share the client's interpreter. Baseline, measured in the
same run and alternated with ours: NeMo RL's way, one node after another with
``requests.get(url, timeout=5)`` and the whole page parsed by ``prometheus_client.parser``.

Scenarios in ``python -m benchmarks``: 8, 64 and 256 healthy nodes serving a page of real size
(the fixture plus the ~900 other series of the real CPU-node capture, ~240 KB) answered after
30 ms, the time a local Ray 2.60 node takes to render its page; 64 healthy nodes with the bare
fixture page (40 KB) answered at once; 64 nodes of which one hangs, one refuses connections and
one returns malformed text. Timeout 5 s per node. The nodes are all on this machine, so both
sides share its 2 cores with the servers: parsing, not the network, bounds ours.

    python -m benchmarks.gpu_scrape [--nodes 64] [--rounds 3]   # the four scenarios at one size
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

TIMEOUT = 5.0


def _serve(pages: list[tuple[str, str]], delay: float, conn: Any) -> None:
    from testkit.gpu_nodes import NodeFarm

    with NodeFarm() as farm:
        conn.send([farm.add(body, mode=mode, delay=delay) for body, mode in pages])
        conn.recv()  # until the parent is done


def _pages(nodes: int, big: bool, failures: bool) -> list[tuple[str, str]]:
    from testkit.gpu_nodes import CPU_FIXTURE, H100_FIXTURE, render, simulated_node

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


def serial_scrape(urls: list[str], sample: str) -> tuple[float, int]:
    """One endpoint after another, whole page parsed (as NeMo RL's GPU monitor does); returns the
    wall time and how many samples named ``sample`` were read."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    started = time.perf_counter()
    seen = 0
    for url in urls:
        try:
            response = requests.get(url, timeout=TIMEOUT)
            if response.status_code != 200:
                continue
            for family in text_string_to_metric_families(response.text):
                seen += sum(1 for s in family.samples if s.name == sample)
        except Exception:
            continue
    return time.perf_counter() - started, seen


def serial_nemo_style(urls: list[str]) -> tuple[float, int]:
    return serial_scrape(urls, "ray_node_gpus_utilization")


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
) -> dict[str, Any]:
    """Ours and the serial scrape alternated ``rounds`` times; medians of the wall times."""
    pages = _pages(nodes, big, failures)
    size = statistics.mean(len(body) for body, mode in pages if mode == "ok")
    parent, child = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(pages, delay, child), daemon=True)
    server.start()
    try:
        urls = parent.recv()
        ours, serial = [], []
        for r in range(rounds):
            order = (parallel_ours, serial_nemo_style)
            for fn in order if r % 2 == 0 else reversed(order):
                wall, gpus = fn(urls)
                if fn is parallel_ours:
                    ours.append(wall)
                    gpus_ours = gpus
                else:
                    serial.append(wall)
                    gpus_serial = gpus
    finally:
        parent.send("done")
        server.join(15)
    ours_s, serial_s = statistics.median(ours), statistics.median(serial)
    return {
        "scenario": name,
        "nodes": nodes,
        "page_kb": round(size / 1024, 1),
        "ours_s": round(ours_s, 3),
        "ours_gpus": gpus_ours,
        "serial_s": round(serial_s, 3),
        "serial_gpus": gpus_serial,
        "ratio": round(serial_s / ours_s, 1),
    }


# A real Ray 2.60 node takes ~30 ms to render its page (measured on a local node).
RENDER_S = 0.03


def run(quick: bool = False) -> list[dict[str, Any]]:
    if quick:  # small fixture pages, no render time, no hanging node (which costs the timeout)
        return [scenario("healthy, fixture page", 8, 1, big=False, failures=False)]
    rows = [
        scenario("healthy, real-size page, 30 ms render", nodes, rounds, True, False, RENDER_S)
        for nodes, rounds in ((8, 3), (64, 3), (256, 2))
    ]
    rows.append(scenario("healthy, fixture page, no render time", 64, 3, False, False))
    rows.append(scenario("1 hanging, 1 refusing, 1 malformed", 64, 1, False, True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.nodes} nodes, timeout {TIMEOUT:g} s per node, median of {args.rounds} rounds")
    for row in (
        scenario("healthy, fixture page", args.nodes, args.rounds, big=False, failures=False),
        scenario("healthy, real-size page", args.nodes, args.rounds, big=True, failures=False),
        scenario("healthy, real-size page, 30 ms render", args.nodes, args.rounds, True, False,
                 RENDER_S),
        scenario("1 hanging, 1 refusing, 1 malformed", args.nodes, args.rounds, False, True),
    ):  # fmt: skip
        print(
            f"{row['scenario']:<42} page {row['page_kb']:6.1f} KB | ours {row['ours_s']:7.3f} s "
            f"({row['ours_gpus']} GPUs) | serial {row['serial_s']:7.3f} s "
            f"({row['serial_gpus']} GPUs) | {row['ratio']:6.1f}x"
        )


if __name__ == "__main__":
    main()
