"""A worker's spans, carried to the driver in its snapshot, the way its metrics travel.

A worker (a Ray actor, a torch rank) may have no collector to send spans to and no disk the
driver reads; its snapshot already reaches the driver. So a worker that traces keeps the spans
that ended since its last snapshot (:class:`SpanCollector`, bounded), as plain tuples (cheap to
make on the worker's thread, small to pickle), and the driver turns them back into SDK spans
(:func:`readable_spans`) for its trace file's span processor, which writes them on its thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

#: Spans a worker keeps between two snapshots; beyond it the oldest go (and are counted).
MAX_SPANS = 2_000

#: A span in a snapshot: (name, trace id, span id, parent span id or 0, start ns, end ns,
#: attributes, resource attributes, scope name).
PlainSpan = tuple[str, int, int, int, int, int, dict[str, Any], dict[str, Any], str]


class SpanCollector:
    """A span processor that keeps ended spans as :data:`PlainSpan` until :meth:`take`."""

    def __init__(self, limit: int = MAX_SPANS) -> None:
        self._spans: deque[PlainSpan] = deque(maxlen=limit)
        self._lock = threading.Lock()
        # One dict per resource, so that a snapshot pickles it once (the resource is held, so
        # that its id is not reused for another while cached).
        self._resources: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.dropped = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        context, parent = span.context, span.parent
        cached = self._resources.get(id(span.resource))
        if cached is None or cached[0] is not span.resource:
            if len(self._resources) >= 64:  # a worker that served many runs
                self._resources.clear()
            cached = self._resources[id(span.resource)] = (
                span.resource,
                dict(span.resource.attributes),
            )
        resource = cached[1]
        plain = (
            span.name, context.trace_id, context.span_id, parent.span_id if parent else 0,
            span.start_time or 0, span.end_time or 0, dict(span.attributes or {}), resource,
            span.instrumentation_scope.name if span.instrumentation_scope else "",
        )  # fmt: skip
        with self._lock:
            if len(self._spans) == self._spans.maxlen:
                self.dropped += 1
            self._spans.append(plain)

    def take(self) -> tuple[list[PlainSpan], int]:
        """The spans kept since the last call, and how many were dropped for room."""
        with self._lock:
            spans, self._spans = list(self._spans), deque(maxlen=self._spans.maxlen)
            dropped, self.dropped = self.dropped, 0
        return spans, dropped

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def readable_spans(plain: list[PlainSpan]) -> list[Any]:
    """SDK spans (``ReadableSpan``) for spans of a snapshot; malformed entries are skipped."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, TraceFlags

    sampled = TraceFlags(TraceFlags.SAMPLED)
    resources: dict[int, Any] = {}
    spans = []
    for item in plain:
        try:
            name, trace_id, span_id, parent_id, start, end, attributes, resource, scope = item
            if id(resource) not in resources:
                resources[id(resource)] = Resource(dict(resource))
            spans.append(ReadableSpan(
                name=str(name),
                context=SpanContext(int(trace_id), int(span_id), False, sampled),
                parent=SpanContext(int(trace_id), int(parent_id), True, sampled)
                if parent_id else None,
                resource=resources[id(resource)],
                attributes=dict(attributes),
                start_time=int(start), end_time=int(end),
                instrumentation_scope=InstrumentationScope(str(scope)),
            ))  # fmt: skip
        except Exception:  # a malformed entry (an id out of range, a bad type): only itself
            continue
    return spans
