"""Ray integration: GPU/node metrics from Ray's Prometheus endpoints, and a metrics aggregator
actor for workers. Nothing here imports ``ray`` until it is used."""

from __future__ import annotations

from otel_rl.core.lazy_exports import lazy_exports

_LAZY: dict[str, str] = {
    "RayNodeScraper": "otel_rl.ray.scraper",
    "GpuMonitor": "otel_rl.ray.bridge",
    "parse_node_metrics": "otel_rl.ray.gpu_metrics",
    "MetricsAggregator": "otel_rl.ray.aggregator",
}

__getattr__ = lazy_exports(__name__, _LAZY)
