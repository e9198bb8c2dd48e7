"""A real OTLP metrics receiver on 127.0.0.1 (HTTP and gRPC) that decodes what it gets with the
official ``opentelemetry-proto`` messages, for tests that check what a collector would see."""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)


@dataclass
class Received:
    request: ExportMetricsServiceRequest
    headers: dict[str, str]


class _Store:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self._cond = threading.Condition()

    def add(self, request: ExportMetricsServiceRequest, headers: dict[str, str]) -> None:
        with self._cond:
            self.received.append(Received(request, headers))
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.received) >= count, timeout)

    def points(self) -> Iterator[tuple[dict[str, Any], str, Any, Any]]:
        """Every data point received: (resource attributes, metric name, metric, point)."""
        for item in self.received:
            for rm in item.request.resource_metrics:
                resource = attributes_of(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            yield resource, metric.name, metric, point

    def last_point(self, name: str) -> Any:
        """The last data point received for the metric ``name`` (raises if none)."""
        found = [p for _, n, _, p in self.points() if n == name]
        if not found:
            raise AssertionError(f"no data point for {name!r}; got {sorted(self.names())}")
        return max(found, key=lambda p: p.time_unix_nano)

    def names(self) -> set[str]:
        return {n for _, n, _, _ in self.points()}


def serve_otlp_http(
    path: str,
    request_type: Any,
    response_type: Any,
    on_request: Callable[[Any, dict[str, str]], None],
    accepted_paths: tuple[str, ...] = (),
    more: dict[str, tuple[Any, Any, Callable[[Any, dict[str, str]], None]]] | None = None,
) -> ThreadingHTTPServer:
    """An OTLP/HTTP endpoint on 127.0.0.1 (a free port): ``POST <path>`` bodies (gzip/deflate
    accepted) are decoded as ``request_type`` and passed to ``on_request(request, headers)``;
    ``more`` maps other paths to their own ``(request_type, response_type, on_request)``;
    ``accepted_paths`` answer 200 and are ignored, anything else 404."""
    routes = {path: (request_type, response_type, on_request), **(more or {})}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path not in routes:
                self.send_response(200 if self.path in accepted_paths else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            request_class, response_class, handle = routes[self.path]
            request = request_class()
            request.ParseFromString(body)
            handle(request, {k.lower(): v for k, v in self.headers.items()})
            reply = response_class().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    ).start()
    return server


class OtlpHttpReceiver(_Store):
    """What a collector receives on ``endpoint`` over OTLP/HTTP (``application/x-protobuf``,
    gzip/deflate accepted): metric points at ``/v1/metrics`` (``points()``, ``names()``), spans at
    ``/v1/traces`` (``spans``) and log records at ``/v1/logs`` (``logs``), each as (resource
    attributes, message)."""

    def __init__(self) -> None:
        super().__init__()
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
            ExportLogsServiceRequest,
            ExportLogsServiceResponse,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[tuple[dict[str, Any], Any]] = []
        self.logs: list[tuple[dict[str, Any], Any]] = []
        #: The request headers of each export of spans and of log records, in order.
        self.span_headers: list[dict[str, str]] = []
        self.log_headers: list[dict[str, str]] = []

        def add_spans(request: Any, headers: dict[str, str]) -> None:
            with self._cond:
                self.span_headers.append(headers)
                for resource_spans in request.resource_spans:
                    resource = attributes_of(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        self.spans.extend((resource, s) for s in scope_spans.spans)
                self._cond.notify_all()

        def add_logs(request: Any, headers: dict[str, str]) -> None:
            self.log_headers.append(headers)
            for resource_logs in request.resource_logs:
                resource = attributes_of(resource_logs.resource.attributes)
                for scope_logs in resource_logs.scope_logs:
                    self.logs.extend((resource, r) for r in scope_logs.log_records)

        self.server = serve_otlp_http(
            "/v1/metrics", ExportMetricsServiceRequest, ExportMetricsServiceResponse, self.add,
            more={
                "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse, add_spans),
                "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse, add_logs),
            },
        )  # fmt: skip
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def wait_for_spans(self, count: int, timeout: float = 30.0) -> list[tuple[dict, Any]]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.spans) >= count, timeout)
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class OtlpGrpcReceiver(_Store):
    """The OTLP ``MetricsService/Export`` gRPC method on 127.0.0.1, without TLS."""

    def __init__(self) -> None:
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        store = self

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> ExportMetricsServiceResponse:
                store.add(request, {k: v for k, v in context.invocation_metadata()})
                return ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


def attributes_of(key_values: Any) -> dict[str, Any]:
    """OTLP ``KeyValue`` list → plain dict."""
    out: dict[str, Any] = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind else None
    return out


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
