"""OTLP output: a periodic reader per provider that pushes metrics to an OTel Collector.

Every setting is resolved in the same order: a key set in the ``otlp:`` config wins; a key left
unset (``null``) falls back to the standard ``OTEL_EXPORTER_OTLP_*`` / ``OTEL_METRIC_EXPORT_*``
env vars (the signal-specific ``..._METRICS_...`` one before the generic one); then to otel-rl's
default. Headers are the exception: env headers and config headers are merged, config winning per
header name. docs/outputs.md has the full table.

A collector that is down costs the training thread nothing: exports run on the reader's own
thread, each bounded by a short timeout (5 s unless set), and nothing here is ever flushed from
the training loop.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from otel_rl.errors import ConfigError
from otel_rl.fork_safe_log import log as _log

PROTOCOLS = ("http/protobuf", "grpc")
HISTOGRAMS = ("explicit", "exponential")

DEFAULT_HTTP_ENDPOINT = "http://127.0.0.1:4318"
DEFAULT_GRPC_ENDPOINT = "http://127.0.0.1:4317"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 10.0
_HTTP_METRICS_PATH = "/v1/metrics"
# The spec gives OTLP timeouts in milliseconds; the Python SDK (and so otel-rl) reads seconds.
_TIMEOUT_LOOKS_LIKE_MS = 300.0


@dataclass(frozen=True)
class OtlpSettings:
    """The resolved OTLP settings of one run (see :func:`resolve_otlp`)."""

    protocol: str
    endpoint: str
    timeout_s: float
    interval_s: float
    headers: dict[str, str] = field(default_factory=dict)
    insecure: bool | None = None
    # None: as OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION says (explicit if unset)
    histogram: str | None = None


def resolve_otlp(otlp: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> OtlpSettings:
    """Resolve the ``otlp:`` config section against the environment (config wins per key)."""
    env = os.environ if environ is None else environ
    protocol = otlp.get("protocol") or _env(
        env, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = protocol or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"otlp protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r} "
            "(from the config or OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL)"
        )
    endpoint, basic_auth = _split_userinfo(_endpoint(otlp.get("endpoint"), protocol, env))
    headers = _headers(otlp.get("headers"), env)
    if basic_auth is not None:
        # The endpoint's ``user:password@`` becomes the Basic auth header HTTP clients derive from
        # it, so that the endpoint itself (shown in log lines and errors) carries no secret. An
        # explicit Authorization header wins, as it would over the URL's userinfo.
        headers.setdefault("authorization", basic_auth)
    return OtlpSettings(
        protocol=protocol,
        endpoint=endpoint,
        timeout_s=_timeout(otlp.get("timeout"), env),
        interval_s=_interval(otlp.get("interval"), env),
        headers=headers,
        insecure=_insecure(otlp.get("insecure")),
        histogram=_histogram(otlp.get("histogram")),
    )


def check_otlp_config(otlp: Mapping[str, Any]) -> None:
    """Reject bad ``otlp:`` values at config time (env vars are checked when the run starts)."""
    resolve_otlp(otlp, environ={})


def otlp_readers(otlp: Mapping[str, Any]) -> list[PeriodicExportingMetricReader]:
    """One periodic OTLP reader (call once per provider: a reader serves one provider)."""
    settings = resolve_otlp(otlp)
    exporter = build_exporter(settings)
    # DEBUG only: the endpoint is already free of userinfo (see resolve_otlp), but where metrics
    # go is the Logger's message to give, once.
    _log.debug("otel-rl: OTLP metrics reader for %s (%s)", settings.endpoint, settings.protocol)
    return [
        PeriodicExportingMetricReader(
            exporter,
            export_interval_millis=settings.interval_s * 1000,
            export_timeout_millis=settings.timeout_s * 1000,
        )
    ]


def build_exporter(settings: OtlpSettings) -> Any:
    """The OTLP metric exporter for ``settings`` (HTTP or gRPC package imported here, lazily)."""
    common: dict[str, Any] = {
        "endpoint": settings.endpoint,
        "headers": settings.headers or None,
        "timeout": settings.timeout_s,
        "preferred_aggregation": _aggregation(settings.histogram),
    }
    if settings.protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "otlp needs 'opentelemetry-exporter-otlp-proto-http': pip install 'otel-rl[otlp]'"
            ) from exc
        return OTLPMetricExporter(**common)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )
    except ImportError as exc:
        raise ConfigError(
            "otlp with protocol grpc needs 'opentelemetry-exporter-otlp-proto-grpc': "
            "pip install 'otel-rl[otlp]'"
        ) from exc
    return GrpcMetricExporter(insecure=settings.insecure, **common)


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def _endpoint(configured: str | None, protocol: str, env: Mapping[str, str]) -> str:
    if protocol == "grpc":
        return str(
            configured
            or _env(env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
            or DEFAULT_GRPC_ENDPOINT
        )
    if configured:
        return _with_metrics_path(str(configured))
    # Per the spec, the signal-specific variable is the full URL; the generic one is a base.
    specific = _env(env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if specific:
        return specific
    return _with_metrics_path(_env(env, "OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_HTTP_ENDPOINT)


def _split_userinfo(endpoint: str) -> tuple[str, str | None]:
    """``http://user:pw@host/x`` → (``http://host/x``, ``"Basic <base64(user:pw)>"``)."""
    parts = urlsplit(endpoint)
    if "@" not in parts.netloc:
        return endpoint, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    credentials = f"{unquote(user)}:{unquote(password)}".encode()
    stripped = urlunsplit(parts._replace(netloc=hostport))
    return stripped, "Basic " + base64.b64encode(credentials).decode("ascii")


def _with_metrics_path(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(_HTTP_METRICS_PATH) else base + _HTTP_METRICS_PATH


def _timeout(configured: Any, env: Mapping[str, str]) -> float:
    if configured is not None:
        return _positive(configured, "otlp.timeout")
    raw = _env(env, "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    seconds = _positive(raw, "OTEL_EXPORTER_OTLP_[METRICS_]TIMEOUT")
    if seconds > _TIMEOUT_LOOKS_LIKE_MS:
        _log.warning(
            "otel-rl: OTEL_EXPORTER_OTLP_[METRICS_]TIMEOUT=%s is read in seconds (as the Python "
            "OTel SDK reads it); a value in milliseconds makes shutdown wait that long",
            raw,
        )
    return seconds


def _interval(configured: Any, env: Mapping[str, str]) -> float:
    if configured is not None:
        return _positive(configured, "otlp.interval")
    raw = _env(env, "OTEL_METRIC_EXPORT_INTERVAL")
    if raw is None:
        return DEFAULT_INTERVAL_S
    return _positive(raw, "OTEL_METRIC_EXPORT_INTERVAL") / 1000  # milliseconds, as the spec says


def _headers(configured: Mapping[str, Any] | None, env: Mapping[str, str]) -> dict[str, str]:
    from opentelemetry.util.re import parse_env_headers

    raw = _env(env, "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    merged = {k.lower(): v for k, v in parse_env_headers(raw or "", liberal=True).items()}
    merged.update({str(k).lower(): str(v) for k, v in (configured or {}).items()})
    return merged


def _insecure(configured: Any) -> bool | None:
    """Only what the config sets: left ``None``, the SDK's gRPC exporter reads
    ``OTEL_EXPORTER_OTLP_[METRICS_]INSECURE`` itself, then the endpoint's scheme."""
    if configured is not None and not isinstance(configured, bool):
        raise ConfigError(f"otlp.insecure must be true, false or null, got {configured!r}")
    return configured


def _histogram(configured: Any) -> str | None:
    if configured is None:
        return None
    if configured not in HISTOGRAMS:
        raise ConfigError(
            f"otlp.histogram must be one of {', '.join(HISTOGRAMS)} or null, got {configured!r}"
        )
    return str(configured)


def _aggregation(histogram: str | None) -> dict[type, Any] | None:
    """Exporter-level histogram aggregation: it applies to this reader only, so Prometheus keeps
    explicit buckets (a View would change every reader of the provider)."""
    if histogram is None:
        return None  # the exporter reads OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import (
        ExplicitBucketHistogramAggregation,
        ExponentialBucketHistogramAggregation,
    )

    if histogram == "exponential":
        return {Histogram: ExponentialBucketHistogramAggregation()}
    # No boundaries given: each histogram keeps its advisory ones (timers: TIMING_BUCKETS).
    return {Histogram: ExplicitBucketHistogramAggregation()}


def _positive(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a positive number, got {value!r}") from exc
    if not number > 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    return number
