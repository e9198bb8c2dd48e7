"""OTLP output: a periodic reader that pushes metrics to an OTel Collector.

Config (``otlp:``) wins where it is set; otherwise the standard ``OTEL_EXPORTER_OTLP_*`` env vars
apply as the OTel SDK reads them. Exports run on the reader's own thread with a short timeout,
so a collector that is down costs the training thread nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from otel_rl.errors import ConfigError

_DEFAULT_HTTP = "http://127.0.0.1:4318"
_DEFAULT_GRPC = "http://127.0.0.1:4317"


def otlp_readers(otlp: Mapping[str, Any]) -> list[PeriodicExportingMetricReader]:
    """One periodic OTLP reader (each provider gets its own)."""
    protocol = (
        otlp.get("protocol")
        or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    endpoint = otlp.get("endpoint")
    headers = dict(otlp.get("headers") or {}) or None
    timeout = float(otlp.get("timeout") or 5.0)
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "otlp needs 'opentelemetry-exporter-otlp-proto-http': "
                "pip install 'otel-rl[otlp]'"
            ) from exc
        if endpoint is None and not _env_endpoint():
            endpoint = _DEFAULT_HTTP
        if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/metrics"):
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
        exporter = OTLPMetricExporter(endpoint=endpoint, headers=headers, timeout=timeout)
    elif protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "otlp with protocol grpc needs 'opentelemetry-exporter-otlp-proto-grpc': "
                "pip install 'otel-rl[otlp]'"
            ) from exc
        if endpoint is None and not _env_endpoint():
            endpoint = _DEFAULT_GRPC
        exporter = GrpcExporter(
            endpoint=endpoint, headers=headers, timeout=timeout, insecure=otlp.get("insecure")
        )
    else:
        raise ConfigError(f"otlp.protocol must be 'http/protobuf' or 'grpc', got {protocol!r}")
    interval_ms = float(otlp.get("interval") or 10.0) * 1000
    return [
        PeriodicExportingMetricReader(
            exporter,
            export_interval_millis=interval_ms,
            export_timeout_millis=timeout * 1000,
        )
    ]


def _env_endpoint() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
