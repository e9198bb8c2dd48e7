"""One run's OTel plumbing: resource, meter providers, readers and operator outputs.

Two providers share one resource:

- ``provider`` holds timers and every instrument that code creates through OTel's API. Its
  :class:`StepReader` is collected at each ``log_metrics`` call on the caller's thread, so what
  those instruments record is attributed to the step it happened in.
- ``side_provider`` holds one observable gauge per logged key (whose callback reads the latest
  value) plus otel-rl's own telemetry and GPU data. It is read only by the operator outputs
  (Prometheus, OTLP) on their own threads, never at a step boundary: collecting 100 gauges
  costs ~1 ms, which the training thread must not pay every step.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.exemplar import AlwaysOffExemplarFilter
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from otel_rl.step_reader import StepReader

_log = logging.getLogger("otel_rl")


def build_resource(cfg: Mapping[str, Any], run_id: str) -> Resource:
    """Resource attributes that identify the run; ``OTEL_RESOURCE_ATTRIBUTES`` is merged in,
    and ``OTEL_SERVICE_NAME`` is used unless ``service_name`` is set in the config."""
    attributes: dict[str, Any] = {
        "otel_rl.run_id": run_id,
        "otel_rl.role": str(cfg["role"]),
        "otel_rl.rank": int(cfg["rank"]),
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
    }
    if cfg.get("experiment"):
        attributes["otel_rl.experiment"] = str(cfg["experiment"])
    service = cfg.get("service_name") or os.environ.get("OTEL_SERVICE_NAME") or "otel-rl"
    attributes["service.name"] = service
    return Resource.create(attributes)


class Pipeline:
    """Builds the providers and operator outputs for one run, and shuts them down."""

    def __init__(self, cfg: Mapping[str, Any], resource: Resource) -> None:
        self.resource = resource
        self.step_reader = StepReader()
        main_readers: list[MetricReader] = [self.step_reader]
        side_readers: list[MetricReader] = []
        self._closers: list[Any] = []
        self.prometheus_url: str | None = None
        if cfg["prometheus"]["enabled"]:
            self._add_prometheus(cfg["prometheus"], main_readers, side_readers)
        if cfg["otlp"]["enabled"]:
            from otel_rl.otlp import otlp_readers

            main_readers.extend(otlp_readers(cfg["otlp"]))
            side_readers.extend(otlp_readers(cfg["otlp"]))
        common = {
            "resource": resource,
            "exemplar_filter": AlwaysOffExemplarFilter(),
            "shutdown_on_exit": False,
        }
        self.provider = MeterProvider(metric_readers=main_readers, **common)
        self.side_provider = MeterProvider(metric_readers=side_readers, **common)
        self.has_side_readers = bool(side_readers)

    def _add_prometheus(
        self,
        prom: Mapping[str, Any],
        main_readers: list[MetricReader],
        side_readers: list[MetricReader],
    ) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        main_readers.append(PrometheusMetricReader(registry=registry))
        # One target_info per endpoint: the second reader must not render it again.
        side_readers.append(PrometheusMetricReader(registry=registry, disable_target_info=True))
        host, port = str(prom["host"]), int(prom["port"])
        server, _thread = start_http_server(port, addr=host, registry=registry)
        bound = server.server_address[1]
        self.prometheus_url = f"http://{host}:{bound}/metrics"
        self.prometheus_registry = registry
        self._closers.append(lambda: (server.shutdown(), server.server_close()))
        _log.info("otel-rl: Prometheus metrics at %s", self.prometheus_url)

    def shutdown(self, timeout_millis: float) -> None:
        """Shut both providers down (final OTLP export within its timeout), then the server."""
        for provider in (self.provider, self.side_provider):
            try:
                provider.shutdown(timeout_millis=timeout_millis)
            except Exception as exc:  # shutdown must finish whatever one reader does
                _log.warning("otel-rl: meter provider shutdown: %s", exc)
        for close in self._closers:
            try:
                close()
            except Exception as exc:
                _log.warning("otel-rl: closing an output: %s", exc)

    @staticmethod
    def readers_of(provider: MeterProvider) -> Sequence[MetricReader]:
        return provider._sdk_config.metric_readers
