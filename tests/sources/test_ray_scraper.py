"""RayNodeScraper against simulated GPU nodes served on 127.0.0.1 (real HTTP, real parsing)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from otel_rl.ray.discovery import targets_from_ray_nodes
from otel_rl.ray.scraper import RayNodeScraper, next_slot
from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node

TEMPLATE = H100_FIXTURE.read_text()


@pytest.fixture
def farm():
    with NodeFarm() as nodes:
        yield nodes


@pytest.mark.slow
def test_the_default_timeout_is_exact_not_rounded_up_to_a_whole_second(farm):
    """A hanging node costs the 5 s default, not up to 6: the request starts just after a whole
    second of the event loop's clock, where a deadline rounded up to the next second (aiohttp's
    own habit from 5 s on) would add ~0.9 s."""
    scraper = RayNodeScraper([farm.add(mode="hang")], timeout=5.0)
    while not 0.02 < time.monotonic() % 1 < 0.08:  # the loop's clock is time.monotonic()
        time.sleep(0.005)
    collection = scraper.collect_once()
    (result,) = collection.results.values()
    assert result.kind == "timeout"
    assert 5.0 <= result.seconds < 5.5, result.seconds


@pytest.mark.slow
def test_64_nodes_in_parallel_with_a_hanging_a_refusing_and_a_malformed_node(farm):
    timeout = 2.0
    urls: list[str] = []
    healthy: dict[str, int] = {}  # url → simulated node number
    for k in range(61):
        url = farm.add(render(simulated_node(k), TEMPLATE))
        healthy[url] = k
        urls.append(url)
    bad = {
        "timeout": farm.add(mode="hang"),
        "refused": farm.add(mode="refused"),
        "malformed": farm.add(render(simulated_node(99), TEMPLATE), mode="malformed"),
    }
    # Spread the failures through the list, as they would be in a cluster.
    urls.insert(5, bad["timeout"])
    urls.insert(33, bad["refused"])
    urls.insert(60, bad["malformed"])
    assert len(urls) == 64

    scraper = RayNodeScraper(urls, timeout=timeout)
    started = time.monotonic()
    collection = scraper.collect_once()
    wall = time.monotonic() - started

    # One hanging node costs one timeout, not 64 of them (generous margin for a loaded CI box).
    assert wall < timeout + 1.5, wall
    ids = scraper.node_ids.known()
    assert [ids[u] for u in urls] == list(range(64))  # first-seen order of the list

    samples = collection.samples
    assert len(samples) == 61
    assert sum(len(s.gpus) for s in samples.values()) == 488
    for url, k in healthy.items():
        expected = simulated_node(k)
        sample = samples[ids[url]]
        assert sample.ip == expected.ip
        assert sample.memory_used_bytes == expected.mem_used
        assert sample.cpu_utilization == expected.cpu_util
        for i, gpu in expected.gpus.items():
            got = sample.gpus[i]
            assert got.utilization == gpu.utilization
            assert got.memory_used_mib == gpu.used_mib
            assert got.memory_total_mib == gpu.used_mib + gpu.available_mib
            assert got.power_w == gpu.power_mw / 1000
            assert got.temperature_c == gpu.temperature_c

    kinds = {r.target.url: r.kind for r in collection.failures.values()}
    assert kinds == {url: kind for kind, url in bad.items()}
    assert scraper.stats["errors"] == 3
    assert dict(scraper.stats["errors_by_node"]) == {ids[u]: 1 for u in bad.values()}
    assert farm.gzip_served >= 61  # every healthy node was asked for, and sent, gzip
    assert set(scraper.latest) == set(samples)


def test_failing_node_is_warned_once_per_state_change(farm, caplog):
    caplog.set_level(logging.INFO, logger="otel_rl")
    good = farm.add(render(simulated_node(1), TEMPLATE))
    flaky = farm.add(render(simulated_node(2), TEMPLATE), mode="malformed")
    scraper = RayNodeScraper([good, flaky], timeout=2.0)

    def messages() -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in caplog.records if "node 1" in r.getMessage()]

    for _ in range(3):
        scraper.collect_once()
    assert [level for level, _ in messages()] == [logging.WARNING]
    assert "unparsable" in messages()[0][1]
    farm.set_mode(flaky, "ok")
    for _ in range(2):
        scraper.collect_once()
    assert [level for level, _ in messages()] == [logging.WARNING, logging.INFO]
    assert "answers again" in messages()[1][1]
    farm.set_mode(flaky, "hang")
    scraper.timeout = 0.3
    for _ in range(2):
        scraper.collect_once()
    assert [level for level, _ in messages()] == [logging.WARNING, logging.INFO, logging.WARNING]
    assert "within 0.3 s" in messages()[2][1]
    assert scraper.stats["errors_by_node"][1] == 5
    assert scraper.stats["errors_by_node"][0] == 0
    # The good node was never warned about.
    assert not [r for r in caplog.records if "node 0" in r.getMessage()]


def test_nodes_joining_and_leaving_keep_their_ids(farm):
    """The node list has the shape of ``ray.nodes()`` entries (NodeID, Alive,
    NodeManagerAddress, MetricsExportPort) pointing at real servers: a multi-node Ray cluster
    does not fit on a 2-core CI machine. Discovery from a real ``ray.nodes()`` is covered in
    tests/sources/test_ray_cluster.py."""
    urls = {name: farm.add(render(simulated_node(k), TEMPLATE)) for k, name in enumerate("abcd")}

    def entry(name: str, alive: bool = True) -> dict:
        port = int(urls[name].rsplit(":", 1)[1].split("/")[0])
        return {
            "NodeID": f"node-{name}",
            "Alive": alive,
            "NodeManagerAddress": "127.0.0.1",
            "MetricsExportPort": port,
        }

    listing: list[dict] = []
    scraper = RayNodeScraper(discover=lambda: targets_from_ray_nodes(listing), timeout=2.0)

    def served() -> dict[int, float]:
        """node id → the host memory it reported (unique per simulated node)."""
        return {n: c.sample.memory_used_bytes for n, c in scraper.latest.items()}

    mem = {name: simulated_node(k).mem_used for k, name in enumerate("abcd")}

    listing[:] = [entry("a"), entry("b")]
    scraper.collect_once()
    assert served() == {0: mem["a"], 1: mem["b"]}

    listing[:] = [entry("b"), entry("c")]  # a left; b moved to position 0; c joined
    scraper.collect_once()
    assert served() == {1: mem["b"], 2: mem["c"]}

    # a is back, d is listed but dead (Ray keeps dead nodes in ray.nodes() with Alive: False)
    listing[:] = [entry("d", alive=False), entry("c"), entry("a"), entry("b")]
    scraper.collect_once()
    assert served() == {0: mem["a"], 1: mem["b"], 2: mem["c"]}

    listing[:] = [entry("d"), entry("a")]
    scraper.collect_once()
    assert served() == {0: mem["a"], 3: mem["d"]}
    assert scraper.node_ids.known() == {"node-a": 0, "node-b": 1, "node-c": 2, "node-d": 3}


@pytest.mark.parametrize(
    ("started", "now", "expected"),
    [
        (0.0, 0.2, (0.4, 0)),  # a 0.2 s round: the next starts 0.4 s after this one began
        (0.4, 0.79, (0.8, 0)),  # not interval + round time
        (0.0, 0.4, (0.8, 1)),  # overran by exactly one slot: that slot is skipped
        (0.0, 1.3, (1.6, 3)),  # overran by three slots: skipped, not run back to back
    ],
)
def test_rounds_keep_a_fixed_rate_and_skip_the_slots_an_overrun_covered(started, now, expected):
    """The schedule itself (what the scraper's thread waits for), without wall-clock timing."""
    next_at, missed = next_slot(started, now, 0.4)
    assert (round(next_at, 9), missed) == expected


def test_the_scraper_thread_runs_rounds_and_counts_skipped_slots(farm):
    """A round slower than the interval: the thread goes on and counts what it skipped."""
    url = farm.add(render(simulated_node(0), TEMPLATE), delay=0.3)
    scraper = RayNodeScraper([url], interval=0.1, timeout=5.0)
    rounds = threading.Semaphore(0)
    scraper.add_listener(lambda c: rounds.release())
    scraper.start()
    try:
        for _ in range(3):
            assert rounds.acquire(timeout=30)
    finally:
        scraper.stop()
    assert scraper.stats["collections"] >= 3
    assert scraper.stats["skipped_slots"] >= 2 * 2  # each 0.3 s round covers two more slots
    assert scraper.last is not None and scraper.last.failures == {}


def test_stop_cancels_a_round_stuck_on_a_hanging_node(farm):
    ok = farm.add(render(simulated_node(3), TEMPLATE))
    hang = farm.add(mode="hang")
    scraper = RayNodeScraper([ok, hang], interval=30, timeout=20)
    scraper.start()
    deadline = time.monotonic() + 5
    while farm.requests[int(hang.rsplit(":", 1)[1].split("/")[0])] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    began = time.monotonic()
    scraper.stop()
    assert time.monotonic() - began < 3.0
    assert not scraper.running
    assert scraper.stats["collections"] == 0  # the cancelled round produced nothing
