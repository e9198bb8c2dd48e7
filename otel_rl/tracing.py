"""Timers as OTel spans (opt-in: ``tracing: {enabled: true}``).

When tracing is on, every ``timer()`` block is also a span of the same name, so a collector
(Tempo, Jaeger) shows each step's timeline; nested timers become child spans. Spans leave through
a ``BatchSpanProcessor`` (its own thread) to OTLP when ``otlp.enabled`` is set. When tracing is
off nothing here is imported and timers cost what they did before.

The tracer provider is private to the run: the global one is left to the application.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from otel_rl.errors import ConfigError

_DEFAULT_HTTP = "http://127.0.0.1:4318"
_DEFAULT_GRPC = "http://127.0.0.1:4317"


def build_tracer_provider(enabled: bool, otlp: Mapping[str, Any] | None, resource: Any) -> Any:
    """A ``TracerProvider`` for the run's timers, or ``None`` when tracing is off.

    ``otlp`` is the logger's ``otlp`` config section when OTLP export is enabled, else ``None``
    (spans are then only seen by span processors the caller adds).
    """
    if not enabled:
        return None
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    # The SDK's own span metrics would otherwise land on the global meter provider, which
    # otel-rl routes into the trackers' rows.
    quiet = NoOpMeterProvider()
    provider = TracerProvider(resource=resource, shutdown_on_exit=False, meter_provider=quiet)
    if otlp is not None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = otlp_span_exporter(otlp, meter_provider=quiet)
        provider.add_span_processor(BatchSpanProcessor(exporter, meter_provider=quiet))
    return provider


def otlp_span_exporter(otlp: Mapping[str, Any], meter_provider: Any = None) -> Any:
    """An OTLP span exporter configured like the metric one (same endpoint, headers, timeout)."""
    protocol = (
        otlp.get("protocol")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    endpoint = otlp.get("endpoint")
    headers = dict(otlp.get("headers") or {}) or None
    # unset: the exporter reads OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT itself
    timeout = float(otlp["timeout"]) if otlp.get("timeout") is not None else None
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigError(
                "tracing over otlp needs 'opentelemetry-exporter-otlp-proto-http': "
                "pip install 'otel-rl[otlp]'"
            ) from exc
        if endpoint is None and not env_endpoint:
            endpoint = _DEFAULT_HTTP
        if endpoint is not None:
            base = endpoint.rstrip("/").removesuffix("/v1/metrics")
            endpoint = base if base.endswith("/v1/traces") else base + "/v1/traces"
        return OTLPSpanExporter(
            endpoint=endpoint, headers=headers, timeout=timeout, meter_provider=meter_provider
        )
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "tracing over otlp with protocol grpc needs "
                "'opentelemetry-exporter-otlp-proto-grpc': pip install 'otel-rl[otlp]'"
            ) from exc
        if endpoint is None and not env_endpoint:
            endpoint = _DEFAULT_GRPC
        return GrpcSpanExporter(
            endpoint=endpoint, headers=headers, timeout=timeout, insecure=otlp.get("insecure")
        )
    raise ConfigError(f"otlp.protocol must be 'http/protobuf' or 'grpc', got {protocol!r}")
