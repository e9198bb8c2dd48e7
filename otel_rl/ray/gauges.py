"""Observable gauges over the scraper's cache, for OTLP and Prometheus (with attributes).

The callbacks run on the reading exporter's thread (the Prometheus scrape, the OTLP timer) and
only read :attr:`RayNodeScraper.latest`, a dict the scraper swaps whole: never the network.

OTel units are base units (bytes, watts), unlike the tracker rows which follow NeMo RL (GiB):

=================================  =====  ===================================
``ray.node.gpu.utilization``       %      {node, host, gpu, device[, mig]}
``ray.node.gpu.memory.used``       By     same
``ray.node.gpu.memory.total``      By     same
``ray.node.gpu.power``             W      same
``ray.node.gpu.temperature``       Cel    same
``ray.node.memory.used``           By     {node, host}
``ray.node.memory.total``          By     {node, host}
``ray.node.cpu.utilization``       %      {node, host}
=================================  =====  ===================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.ray.gpu_metrics import MIB, GpuSample, NodeSample
from otel_rl.ray.scraper import RayNodeScraper

_GPU_GAUGES: tuple[tuple[str, str, str, Callable[[GpuSample], float | None]], ...] = (
    ("ray.node.gpu.utilization", "%", "GPU utilization", lambda g: g.utilization),
    (
        "ray.node.gpu.memory.used",
        "By",
        "GPU memory in use",
        lambda g: g.memory_used_mib * MIB if g.memory_used_mib is not None else None,
    ),
    (
        "ray.node.gpu.memory.total",
        "By",
        "GPU memory in total",
        lambda g: g.memory_total_mib * MIB if g.memory_total_mib is not None else None,
    ),
    ("ray.node.gpu.power", "W", "GPU power draw", lambda g: g.power_w),
    ("ray.node.gpu.temperature", "Cel", "GPU temperature", lambda g: g.temperature_c),
)

_NODE_GAUGES: tuple[tuple[str, str, str, Callable[[NodeSample], float | None]], ...] = (
    ("ray.node.memory.used", "By", "host memory in use", lambda s: s.memory_used_bytes),
    ("ray.node.memory.total", "By", "host memory in total", lambda s: s.memory_total_bytes),
    ("ray.node.cpu.utilization", "%", "host CPU utilization", lambda s: s.cpu_utilization),
)


def install_gpu_gauges(meter: Meter, scraper: RayNodeScraper) -> None:
    """Create the ``ray.node.*`` observable gauges on ``meter``."""
    for name, unit, description, read in _GPU_GAUGES:
        meter.create_observable_gauge(
            name, callbacks=[_gpu_callback(scraper, read)], unit=unit, description=description
        )
    for name, unit, description, read_node in _NODE_GAUGES:
        meter.create_observable_gauge(
            name, callbacks=[_node_callback(scraper, read_node)], unit=unit, description=description
        )


def gpu_attributes(node: int, host: str, gpu: GpuSample) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "node": node,
        "host": host,
        "gpu": gpu.parent,
        "device": gpu.device,
    }
    if gpu.mig_slice is not None:
        attributes["mig"] = gpu.mig_slice
    return attributes


def _gpu_callback(
    scraper: RayNodeScraper, read: Callable[[GpuSample], float | None]
) -> Callable[[Any], Iterator[Observation]]:
    def callback(options: Any) -> Iterator[Observation]:
        for cached in list(scraper.latest.values()):
            for gpu in cached.sample.gpus.values():
                value = read(gpu)
                if value is not None:
                    yield Observation(value, gpu_attributes(cached.node, cached.target.host, gpu))

    return callback


def _node_callback(
    scraper: RayNodeScraper, read: Callable[[NodeSample], float | None]
) -> Callable[[Any], Iterator[Observation]]:
    def callback(options: Any) -> Iterator[Observation]:
        for cached in list(scraper.latest.values()):
            value = read(cached.sample)
            if value is not None:
                yield Observation(value, {"node": cached.node, "host": cached.target.host})

    return callback
