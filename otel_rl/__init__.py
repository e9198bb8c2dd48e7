"""otel-rl: an OpenTelemetry instrumentation layer for RL training on LLMs.

``import otel_rl`` is light: the Logger, OTel SDK and tracker SDKs load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otel_rl.core.errors import ConfigError, MetricError, OtelRLError
from otel_rl.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from otel_rl.distributed.worker import WorkerMetrics
    from otel_rl.logger import Logger
    from otel_rl.telemetry.tracing import trace_carrier, use_trace_carrier

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otel-rl")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _version()
__all__ = [
    "ConfigError", "Logger", "MetricError", "OtelRLError", "WorkerMetrics", "__version__",
    "trace_carrier", "use_trace_carrier",
]  # fmt: skip

_LAZY = {
    "Logger": "otel_rl.logger",
    "WorkerMetrics": "otel_rl.distributed.worker",
    "trace_carrier": "otel_rl.telemetry.tracing",
    "use_trace_carrier": "otel_rl.telemetry.tracing",
}

__getattr__ = lazy_exports(__name__, _LAZY)
