"""Inference-engine (vLLM, SGLang) metrics as rollout rows per training step; see
docs/rollout-monitoring.md. Nothing here imports aiohttp or prometheus_client until it is used."""

from __future__ import annotations

from otel_rl.core.lazy_exports import lazy_exports

_LAZY: dict[str, str] = {
    "RolloutMonitor": "otel_rl.rollout.monitor",
    "EngineInfo": "otel_rl.rollout.monitor",
    "parse_engine_page": "otel_rl.rollout.engines",
    "histogram_quantile": "otel_rl.rollout.rows",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
