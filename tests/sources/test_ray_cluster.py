"""The bridge against a real single-node Ray cluster (one per module: ~6 s, ~500 MiB).

tests/conftest.py keeps the cluster on loopback (``NodeManagerAddress`` is 127.0.0.1).
"""

from __future__ import annotations

import gzip
import re
import time
import urllib.request

import pytest

from otel_rl import Logger
from otel_rl.ray.scraper import RayNodeScraper
from testkit.readers import jsonl_rows

pytestmark = pytest.mark.slow

_MEM = re.compile(r"^(ray_node_mem_used|ray_node_mem_total)\{[^}]*\} (\S+)$", re.M)


def endpoint_memory(url: str) -> dict[str, float]:
    """``ray_node_mem_used``/``_total`` read straight from the node's endpoint."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return {name: float(value) for name, value in _MEM.findall(body.decode())}


@pytest.fixture(scope="module")
def ray_node():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=1,
        include_dashboard=False,  # the per-node agent that serves /metrics still starts
        object_store_memory=100 * 2**20,
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        assert node["NodeManagerAddress"] == "127.0.0.1"
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        deadline = time.monotonic() + 60
        while True:  # the reporter agent publishes its first node stats a few seconds in
            try:
                if "ray_node_mem_used" in endpoint_memory(url):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{url} never served ray_node_mem_used"
            time.sleep(0.25)
        yield node, url
    finally:
        ray.shutdown()


def test_bridge_finds_the_node_and_reports_its_host_memory(ray_node):
    node, url = ray_node
    scraper = RayNodeScraper(timeout=5.0)  # no endpoints: discovery through ray.nodes()
    before = endpoint_memory(url)
    collection = scraper.collect_once()
    after = endpoint_memory(url)

    assert scraper.node_ids.known() == {node["NodeID"]: 0}
    assert collection.failures == {}
    cached = scraper.latest[0]
    assert cached.target.url == url
    assert cached.target.host == node["NodeManagerAddress"]
    assert cached.sample.gpus == {}  # a CPU-only node emits no GPU series
    # Ray refreshes the values every 5 s: the bridge saw what the endpoint served around it.
    served = {before["ray_node_mem_used"], after["ray_node_mem_used"]}
    assert cached.sample.memory_used_bytes in served
    assert cached.sample.memory_total_bytes == after["ray_node_mem_total"]


def test_logger_writes_the_node_rows_on_the_ray_axis(ray_node, log_dir):
    _node, url = ray_node
    cfg = {
        "log_dir": str(log_dir),
        "monitor_gpus": True,
        "gpu_monitoring": {"collection_interval": 0.3, "flush_interval": 0.3},
    }
    seen = {endpoint_memory(url)["ray_node_mem_used"]}
    with Logger(cfg) as logger:
        for step in range(10):
            logger.log_metrics({"loss": float(step)}, step=step)
            seen.add(endpoint_memory(url)["ray_node_mem_used"])
            time.sleep(0.1)
    seen.add(endpoint_memory(url)["ray_node_mem_used"])
    total = endpoint_memory(url)["ray_node_mem_total"]

    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "axis" not in r] == list(range(10))
    gpu = [r for r in rows if r.get("axis") == "ray/ray_step"]
    assert gpu, "no node rows were written"
    for row in gpu:
        metrics = row["metrics"]
        assert metrics["ray/node.0.mem_total_gb"] == total / 2**30
        # what the endpoint served while the run lasted (polled faster than Ray's 5 s refresh)
        assert metrics["ray/node.0.mem_gb"] * 2**30 in seen
        assert 0 <= metrics["ray/node.0.cpu_util"] <= 100
