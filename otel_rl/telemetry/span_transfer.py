"""A worker's spans, carried to the driver in its snapshot, the way its metrics travel.

A worker (a Ray actor, a torch rank) may have no collector to send spans to and no disk the
driver reads; its snapshot already reaches the driver. So a worker that traces keeps the spans
that ended since its last snapshot (:class:`SpanCollector`, bounded), as plain tuples (cheap to
make on the worker's thread, small to pickle), and the driver's trace file writes them as they
are (``trace_file.plain_json_line``) on its thread. A span still
running at the snapshot (Ray's span around the call that takes it) is in it too, as it stands,
marked :data:`OPEN`: the trace file keeps it until the span comes whole in a later snapshot.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

#: Spans a worker keeps between two snapshots; beyond it the oldest go (and are counted).
MAX_SPANS = 2_000

#: A span in a snapshot: (name, trace id, span id, parent span id or 0, start ns, end ns,
#: attributes, resource attributes, scope name).
PlainSpan = tuple[str, int, int, int, int, int, dict[str, Any], dict[str, Any], str]
#: The attribute of a span still running when the snapshot was taken (its end is the snapshot's).
OPEN = "otel_rl.span.open"


class SpanCollector:
    """A span processor that keeps ended spans as :data:`PlainSpan` until :meth:`take`, which
    also hands over the spans still running, as they stand (:data:`OPEN`)."""

    def __init__(self, limit: int = MAX_SPANS) -> None:
        self._spans: deque[PlainSpan] = deque(maxlen=limit)
        self._open: dict[int, Any] = {}  # span id -> a span started here, not ended yet
        self._lock = threading.Lock()
        # One dict per resource, so that a snapshot pickles it once (the resource is held, so
        # that its id is not reused for another while cached).
        self._resources: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.dropped = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        with self._lock:
            if len(self._open) < MAX_SPANS:  # spans never ended do not pile up
                self._open[span.context.span_id] = span

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        plain = self._plain(span, span.end_time or 0, {})
        with self._lock:
            self._open.pop(plain[2], None)
            if len(self._spans) == self._spans.maxlen:
                self.dropped += 1
            self._spans.append(plain)

    def _plain(self, span: Any, end: int, more: dict[str, Any]) -> PlainSpan:
        context, parent = span.context, span.parent
        cached = self._resources.get(id(span.resource))
        if cached is None or cached[0] is not span.resource:
            if len(self._resources) >= 64:  # a worker that served many runs
                self._resources.clear()
            cached = self._resources[id(span.resource)] = (
                span.resource,
                dict(span.resource.attributes),
            )
        return (
            span.name, context.trace_id, context.span_id, parent.span_id if parent else 0,
            span.start_time or 0, end, {**(span.attributes or {}), **more}, cached[1],
            span.instrumentation_scope.name if span.instrumentation_scope else "",
        )  # fmt: skip

    def take(self) -> tuple[list[PlainSpan], int]:
        """The spans kept since the last call and those still running (ending now, marked
        :data:`OPEN`), and how many were dropped for room."""
        now = time.time_ns()
        with self._lock:
            spans, self._spans = list(self._spans), deque(maxlen=self._spans.maxlen)
            dropped, self.dropped = self.dropped, 0
            running = list(self._open.values())
        spans += [self._plain(span, now, {OPEN: True}) for span in running]
        return spans, dropped

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
