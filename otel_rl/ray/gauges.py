"""Observable gauges over the scraper's cache, for OTLP and Prometheus (with attributes).

The callbacks run on the reading exporter's thread (the Prometheus scrape, the OTLP timer) and
only read :attr:`RayNodeScraper.latest`, a dict the scraper swaps whole: never the network. A
reading that is NaN or infinite (a broken sensor's) is no observation (its tracker row keeps it).

OTel units are base units (bytes, watts), unlike the tracker rows which follow NeMo RL (GiB).
Names, units, descriptions and attributes: :mod:`otel_rl.core.catalogue` (docs/metrics.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.core import catalogue
from otel_rl.core.catalogue import Metric
from otel_rl.ray.gpu_metrics import MIB, GpuSample, NodeSample
from otel_rl.ray.scraper import RayNodeScraper

_GPU_GAUGES: tuple[tuple[Metric, Callable[[GpuSample], float | None]], ...] = (
    (catalogue.GPU_UTILIZATION, lambda g: g.utilization),
    (
        catalogue.GPU_MEMORY_USED,
        lambda g: g.memory_used_mib * MIB if g.memory_used_mib is not None else None,
    ),
    (
        catalogue.GPU_MEMORY_TOTAL,
        lambda g: g.memory_total_mib * MIB if g.memory_total_mib is not None else None,
    ),
    (catalogue.GPU_POWER, lambda g: g.power_w),
    (catalogue.GPU_TEMPERATURE, lambda g: g.temperature_c),
)

_NODE_GAUGES: tuple[tuple[Metric, Callable[[NodeSample], float | None]], ...] = (
    (catalogue.NODE_MEMORY_USED, lambda s: s.memory_used_bytes),
    (catalogue.NODE_MEMORY_TOTAL, lambda s: s.memory_total_bytes),
    (catalogue.NODE_CPU_UTILIZATION, lambda s: s.cpu_utilization),
)


def install_gpu_gauges(meter: Meter, scraper: RayNodeScraper) -> None:
    """Create the ``ray.node.*`` observable gauges on ``meter``."""
    for metric, read in _GPU_GAUGES:
        metric.create(meter, [_gpu_callback(scraper, read)])
    for metric, read_node in _NODE_GAUGES:
        metric.create(meter, [_node_callback(scraper, read_node)])


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
                if value is not None and math.isfinite(value):  # (the SDK warns at each read)
                    yield Observation(value, gpu_attributes(cached.node, cached.target.host, gpu))

    return callback


def _node_callback(
    scraper: RayNodeScraper, read: Callable[[NodeSample], float | None]
) -> Callable[[Any], Iterator[Observation]]:
    def callback(options: Any) -> Iterator[Observation]:
        for cached in list(scraper.latest.values()):
            value = read(cached.sample)
            if value is not None and math.isfinite(value):
                yield Observation(value, {"node": cached.node, "host": cached.target.host})

    return callback
