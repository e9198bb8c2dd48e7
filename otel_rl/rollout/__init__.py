"""Inference-engine (vLLM, SGLang) metrics as rollout rows per training step; see
docs/rollout-monitoring.md. Nothing here imports aiohttp or prometheus_client until it is used."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "RolloutMonitor": "otel_rl.rollout.monitor",
    "EngineInfo": "otel_rl.rollout.monitor",
    "parse_engine_page": "otel_rl.rollout.engines",
    "histogram_quantile": "otel_rl.rollout.rows",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_rl.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
