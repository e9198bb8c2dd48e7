"""A real OTLP/HTTP traces receiver on 127.0.0.1 that decodes ``POST /v1/traces`` with the
official ``opentelemetry-proto`` messages (``/v1/metrics`` is accepted and ignored)."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from testkit.otlp_receiver import attributes_of, serve_otlp_http


class OtlpTraceReceiver:
    """Collects every span it receives as ``(resource attributes, span)`` pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []
        self._cond = threading.Condition()
        # metrics pushed to the same collector address are accepted and ignored
        self.server = serve_otlp_http(
            "/v1/traces",
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
            lambda request, headers: self._add(request),
            accepted_paths=("/v1/metrics",),
        )
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        with self._cond:
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.spans) >= count, timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
