"""Ray integration: GPU/node metrics from Ray's Prometheus endpoints, and a metrics aggregator
actor for workers. Nothing here imports ``ray`` until it is used."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "RayNodeScraper": "otel_rl.ray.scraper",
    "GpuMonitor": "otel_rl.ray.bridge",
    "parse_node_metrics": "otel_rl.ray.gpu_metrics",
    "MetricsAggregator": "otel_rl.ray.aggregator",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_rl.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
