"""Timers as OTel spans (opt-in: ``tracing: {enabled: true}``), one trace per RL step.

When tracing is on, every ``timer()`` block is also a span of the same name, so a collector
(Tempo, Jaeger) shows each step's timeline; nested timers become child spans. The driver's
outermost timers are children of an ``rl.step`` span (:class:`StepSpans`), one per training step,
so that a step and everything it called — Ray actors included, see :mod:`otel_rl.ray.tracing` —
is one trace. Spans leave through a ``BatchSpanProcessor`` (its own thread) to OTLP when
``otlp.enabled`` is set, or through the process's exporter installed by the Ray tracing hook.
When tracing is off the OTel tracing SDK is not imported and timers cost what they did before.
The drop-ins' timers (``otel_rl.compat``), which belong to no Logger, find the newest live one's
step spans through :mod:`otel_rl.telemetry.timing`. A worker's spans name the run of the driver
call they run in (:class:`RunTracer`), span by span.

The Logger's tracer provider is private to the run: the global one is left to the application
(the Ray hook, which the application opts into, sets it when nobody else has).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from otel_rl.core.records import OWN_SCOPE
from otel_rl.telemetry import timing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

#: Name and attribute of the span that stands for one training step.
STEP_SPAN = "rl.step"
STEP_ATTRIBUTE = "rl.step"
#: W3C baggage entry that carries the driver's run id to the workers it calls.
RUN_ID_BAGGAGE = "otel_rl.run_id"
#: The row column that links a step's curves to its trace.
TRACE_ID_KEY = "trace_id"
#: Spans the trace file's span processor holds before it drops the newest.
TRACE_FILE_QUEUE = 32_768

# Set once per process by ``otel_rl.ray.tracing.setup`` (the Ray tracing hook): the span processor
# that exports to the collector named by ``OTEL_EXPORTER_OTLP_*`` (``None`` when
# ``OTEL_TRACES_EXPORTER=none``), the resource naming this process (service, node, pid), and the
# span collector of the process's spans that no run's provider makes (Ray's own), for the trace
# file: taken by a worker's snapshots, or by the trace file of a run in this process.
_hook: dict[str, Any] = {}


def build_tracer_provider(
    enabled: bool,
    otlp: Mapping[str, Any] | None,
    resource: Any,
    active_span_processor: Any = None,
    trace_file: Any = None,
) -> Any:
    """A ``TracerProvider`` for the run's timers, or ``None`` when tracing is off.

    ``otlp`` is the logger's ``otlp`` config section when OTLP export is enabled, else ``None``
    (spans are then only seen by span processors the caller adds). ``active_span_processor``
    (a ``SynchronousMultiSpanProcessor``) lets providers of other resources share the span
    processors this one gets. ``trace_file`` (a :class:`~otel_rl.telemetry.trace_file.TraceFile`)
    gets every span too, through a span processor of its own.
    """
    if not enabled:
        return None
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    # The SDK's own span metrics would otherwise land on the global meter provider, which
    # otel-rl routes into the trackers' rows.
    quiet = NoOpMeterProvider()
    provider = TracerProvider(
        resource=resource,
        shutdown_on_exit=False,
        active_span_processor=active_span_processor,
        meter_provider=quiet,
    )
    provider.add_span_processor(cast("SpanProcessor", _SpanThread()))
    if trace_file is not None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # A loop that times a few phases per step flat out ends more spans in the processor's
        # 5 s than its default queue holds (2,048): the file's holds a larger burst.
        provider.add_span_processor(
            BatchSpanProcessor(
                trace_file, max_queue_size=TRACE_FILE_QUEUE, schedule_delay_millis=1000,
                meter_provider=quiet,
            )
        )  # fmt: skip
    if otlp is not None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = otlp_span_exporter(otlp, meter_provider=quiet)
        provider.add_span_processor(BatchSpanProcessor(exporter, meter_provider=quiet))
    else:
        # No OTLP section: the spans go where the Ray tracing hook sends this process's spans,
        # if it runs here (now or later: a Logger may be built before ``ray.init``).
        provider.add_span_processor(cast("SpanProcessor", _HookForwarder()))
    return provider


def hook_active() -> bool:
    """Whether the Ray tracing hook (:func:`otel_rl.ray.tracing.setup`) ran in this process."""
    return bool(_hook)


def install_hook(processor: Any, resource: Any, spans: Any = None) -> None:
    """Record the process-wide span processor, resource and span collector (called by the Ray
    tracing hook)."""
    _hook.update(processor=processor, resource=resource, spans=spans)


def hook_spans() -> Any:
    """The span collector of the process's spans the Ray tracing hook keeps, or ``None``."""
    return _hook.get("spans")


def hook_resource() -> Any:
    """The resource the Ray tracing hook built for this process, or ``None``."""
    return _hook.get("resource")


def _worker_timer_tracer() -> Any:
    """The tracer of drop-in timers (``otel_rl.compat``) in a Ray worker where the hook ran:
    spans exported through the hook with the process's resource and the run id of the driver
    call they run in, and kept with the process's spans for the trace file. ``None`` without the
    hook, and in the driver (its timers trace only with a Logger's ``tracing.enabled``)."""
    if not _hook:
        return None
    tracer = _hook.get("timer_tracer")
    if tracer is None:
        resource = _hook.get("resource")
        if resource is not None and resource.attributes.get("otel_rl.role") == "driver":
            return None
        spans = filter(None, [hook_spans()])
        tracer = _hook.setdefault("timer_tracer", RunTracer(hook_resource, processors=spans))
    return tracer


timing.set_process_tracer(_worker_timer_tracer)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=timing.drop_step_tracers_after_fork)


class _AtStart:
    """A span processor that only acts when a span starts (the rest of the interface, duck-typed
    so that the tracing SDK is imported only when tracing is on, does nothing)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise NotImplementedError

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class _SpanThread(_AtStart):
    """Names the thread a span starts on (``thread.id``, ``thread.name``, OpenTelemetry's
    attributes for it): the timeline draws a lane per thread."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        span.set_attribute("thread.id", threading.get_ident())
        span.set_attribute("thread.name", threading.current_thread().name)


class _HookForwarder:
    """A span processor that hands spans to the hook's exporter, when there is one.

    It never shuts the shared processor down (other providers in the process use it); shutting
    down the provider that owns this forwarder only flushes.
    """

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        processor = _hook.get("processor")
        if processor is not None:
            processor.on_start(span, parent_context=parent_context)

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        processor = _hook.get("processor")
        if processor is not None:
            processor.on_end(span)

    def shutdown(self) -> None:
        self.force_flush()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        processor = _hook.get("processor")
        return True if processor is None else bool(processor.force_flush(timeout_millis))


class RunIdFromBaggage(_AtStart):
    """A span processor that copies the driver's run id from the W3C baggage a span's parent
    context carries into the span's ``otel_rl.run_id`` attribute (Ray's own spans in workers
    have no other way to know which run called them)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        from opentelemetry import baggage

        run_id = baggage.get_baggage(RUN_ID_BAGGAGE, parent_context)
        if run_id is not None and RUN_ID_BAGGAGE not in (span.attributes or {}):
            span.set_attribute(RUN_ID_BAGGAGE, str(run_id))


class RunTracer:
    """A tracer whose spans name, in their resource, the run they were made for.

    A worker's spans carry the driver's run id (``otel_rl.run_id``) as a resource attribute,
    which a resource fixes for good; but a worker may time things before the run exists (a
    warm-up) or serve several runs. So each span takes the run id its parent context carries as
    W3C baggage (the driver's step context sets it), or, with none, the latest one seen, and is
    made by a provider of that run (a ``TracerProvider`` per run id, all sharing one set of
    span processors). A ``resource`` that names a run already keeps it.

    ``resource`` is a function, called when the first span is made (the Ray hook's resource may
    not exist before). ``otlp`` as in :func:`build_tracer_provider`.
    """

    #: Providers kept, one per run id: a long-lived worker serving many runs stays bounded.
    MAX_RUNS = 16

    def __init__(
        self, resource: Any, otlp: Mapping[str, Any] | None = None, processors: Any = ()
    ) -> None:
        self._resource_of = resource
        self._otlp = otlp
        self._processors = tuple(processors)  # more span processors, for every run's spans
        self._lock = threading.Lock()
        self._base: Any = None
        self._shared: Any = None  # the span processors every run's provider shares
        self._fixed: Any = None  # the tracer, when the resource names the run itself
        self._tracers: dict[str | None, Any] = {}
        self._latest: str | None = None

    @property
    def provider(self) -> Any:
        """The provider of spans made before any run id is known (``add_span_processor`` on it
        reaches every run's spans)."""
        if self._base is None:
            self._build()
        return self._base

    def resolve(self, context: Any = None) -> Any:
        """The tracer for a span whose parent context is ``context`` (``None``: the current)."""
        if self._base is None:
            self._build()
        if self._fixed is not None:
            return self._fixed
        from opentelemetry import baggage

        found = baggage.get_baggage(RUN_ID_BAGGAGE, context)
        if found is None:
            run_id = self._latest
        else:
            run_id = self._latest = str(found)
        tracer = self._tracers.get(run_id)
        if tracer is None:
            tracer = self._for_run(run_id)
        return tracer

    def start_as_current_span(self, name: str, context: Any = None, **kwargs: Any) -> Any:
        return self.resolve(context).start_as_current_span(name, context=context, **kwargs)

    def start_span(self, name: str, context: Any = None, **kwargs: Any) -> Any:
        return self.resolve(context).start_span(name, context=context, **kwargs)

    def shutdown(self) -> None:
        """Flush and shut the shared span processors down (once built)."""
        if self._base is not None:
            self._base.shutdown()

    def _build(self) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor

        with self._lock:
            if self._base is not None:
                return
            resource = self._resource_of()
            if resource is None:
                resource = Resource.create({})
            self._shared = SynchronousMultiSpanProcessor()  # type: ignore[no-untyped-call]
            base = build_tracer_provider(True, self._otlp, resource, self._shared)
            for processor in self._processors:
                base.add_span_processor(processor)
            if resource.attributes.get(RUN_ID_BAGGAGE):
                self._fixed = base.get_tracer(OWN_SCOPE)
            self._tracers[None] = base.get_tracer(OWN_SCOPE)
            self._base = base

    def _for_run(self, run_id: str | None) -> Any:
        from opentelemetry.metrics import NoOpMeterProvider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        with self._lock:
            tracer = self._tracers.get(run_id)
            if tracer is not None:
                return tracer
            resource = self._base.resource.merge(Resource({RUN_ID_BAGGAGE: str(run_id)}))
            provider = TracerProvider(
                resource=resource,
                shutdown_on_exit=False,
                active_span_processor=self._shared,
                meter_provider=NoOpMeterProvider(),
            )
            tracer = provider.get_tracer(OWN_SCOPE)
            runs = [key for key in self._tracers if key is not None]
            if len(runs) >= self.MAX_RUNS:  # the oldest run's spans are long done
                oldest = next(key for key in runs if key != self._latest)
                del self._tracers[oldest]
            self._tracers[run_id] = tracer
            return tracer


# ---- one trace per training step -------------------------------------------------------------


class _Segment:
    """One ``rl.step`` span and the context its children start in."""

    __slots__ = ("context", "end_ns", "span", "step")

    def __init__(self, span: Any, context: Any) -> None:
        self.span = span
        self.context = context
        self.step: int | None = None
        self.end_ns: int | None = None


class StepSpans:
    """The driver's ``rl.step`` spans: one per training step, parent of the step's timers.

    The Logger attributes a timer's value to the step of the next ``log_metrics`` call (the
    call that takes the timers' data); the spans follow the same rule, so a timer's span is
    always under the ``rl.step`` span whose ``rl.step`` attribute is the step its value is in:

    - a span opens when the step begins: at the first timer (or ``log_metrics`` call) after the
      previous ``log_metrics`` call; it starts when that call returned, so consecutive steps tile
      the timeline;
    - :meth:`take` (each ``log_metrics`` call) assigns it to the call's step; further calls at the
      same step with no timer in between extend it;
    - :meth:`seal` (the step's row handed to the trackers) ends it at its last ``log_metrics``
      call and returns its trace id for the row.

    A step whose values are logged in several calls with timers between them gets one ``rl.step``
    span per such stretch, each linked to the first (the row carries the first one's trace id).

    Only timers started with no span current get an ``rl.step`` parent: nested timers nest as
    before, and an application's own span keeps its children. ``tracer`` is what the Logger's
    timers use; everything else happens on the caller's thread in a few microseconds.
    """

    def __init__(self, provider: Any, run_id: str | None = None) -> None:
        self._tracer = provider.get_tracer(OWN_SCOPE)
        self._run_id = run_id
        self._lock = threading.Lock()
        self._open: _Segment | None = None  # collecting timers, step not known yet
        self._taken: list[_Segment] = []  # assigned to the pending step, not ended yet
        self._last_take_ns: int | None = None
        #: A tracer whose parentless spans become children of the current ``rl.step`` span.
        self.tracer = _StepTracer(self._tracer, self)
        # The drop-ins' timers (otel_rl.compat), which belong to no Logger, find it there.
        timing.add_step_tracer(self.tracer)

    def take(self, step: int) -> None:
        """A ``log_metrics`` call at ``step`` took the timers' data: what ran since belongs to
        ``step``."""
        now = time.time_ns()
        with self._lock:
            segment = self._open
            self._open = None
            if segment is None:
                same = [s for s in self._taken if s.step == step]
                # consecutive calls for one step, nothing timed between: one span
                segment = same[-1] if same else self._start()
            self._assign(segment, step, now)

    def seal(self, step: int, final: bool = False) -> str | None:
        """The row of ``step`` is sealed: end its spans; return its trace id (32 hex digits), or
        ``None`` when nothing opened a span for it.

        ``final`` is a seal by ``flush``/``finish``, which also takes the timers' data: a span
        opened since the last ``log_metrics`` call belongs to ``step`` too.
        """
        now = time.time_ns()
        with self._lock:
            if final and self._open is not None:
                segment, self._open = self._open, None
                self._assign(segment, step, now)
            segments, self._taken = self._taken, []
        trace_id = None
        for segment in segments:
            if trace_id is None and segment.step == step:
                trace_id = format(segment.span.get_span_context().trace_id, "032x")
            segment.span.end(end_time=segment.end_ns)
        return trace_id

    def close(self) -> None:
        """End every span still open (the run is over)."""
        timing.remove_step_tracer(self.tracer)
        with self._lock:
            segments = self._taken + ([self._open] if self._open is not None else [])
            self._taken, self._open = [], None
        for segment in segments:
            segment.span.end(end_time=segment.end_ns)

    def add_event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """An event on the current step's span (from any thread; the span is opened if
        needed): a stall reported while the step runs."""
        with self._lock:
            if self._open is None and not self._taken:
                self._open = self._start()
            segment = self._open if self._open is not None else self._taken[-1]
        segment.span.add_event(name, dict(attributes))

    def context(self) -> Any:
        """The context of the current step's span (opened if needed)."""
        with self._lock:
            if self._open is None:
                self._open = self._start()
            return self._open.context

    def _start(self) -> _Segment:
        from opentelemetry import baggage
        from opentelemetry.context import Context
        from opentelemetry.trace import set_span_in_context

        # A root: one trace per step, even inside an application's own long-lived span.
        span = self._tracer.start_span(STEP_SPAN, context=Context(), start_time=self._last_take_ns)
        context = set_span_in_context(span, Context())
        if self._run_id:
            context = baggage.set_baggage(RUN_ID_BAGGAGE, self._run_id, context)
        return _Segment(span, context)

    def _assign(self, segment: _Segment, step: int, now: int) -> None:
        if segment.step is None:
            segment.step = step
            segment.span.set_attribute(STEP_ATTRIBUTE, step)
            first = next((s for s in self._taken if s.step == step), None)
            if first is not None:
                segment.span.add_link(first.span.get_span_context())
            self._taken.append(segment)
        segment.end_ns = now
        self._last_take_ns = now


class _StepTracer:
    """Hands out spans like the SDK tracer; a span started with no span current starts inside
    the current step's context (the ``rl.step`` span and the run id baggage)."""

    __slots__ = ("__weakref__", "_steps", "_tracer")

    def __init__(self, tracer: Any, steps: StepSpans) -> None:
        self._tracer = tracer
        self._steps = steps

    def step_context(self) -> Any:
        """The context of the current step (its ``rl.step`` span and the run id baggage), for a
        span started with no span current."""
        return self._steps.context()

    def start_as_current_span(self, name: str, context: Any = None, **kwargs: Any) -> Any:
        from opentelemetry import trace

        if trace.get_current_span(context).get_span_context().is_valid:
            return self._tracer.start_as_current_span(name, context=context, **kwargs)
        return _InContext(self._steps.context(), self._tracer, name, kwargs)

    def start_span(self, name: str, context: Any = None, **kwargs: Any) -> Any:
        from opentelemetry import trace

        if not trace.get_current_span(context).get_span_context().is_valid:
            context = self._steps.context()
        return self._tracer.start_span(name, context=context, **kwargs)


class _InContext:
    """``start_as_current_span`` inside ``context``: the step's context is attached around the
    span (not only used as its parent) so that its baggage reaches what the span calls."""

    __slots__ = ("_context", "_inner", "_kwargs", "_name", "_tokens", "_tracer")

    def __init__(self, context: Any, tracer: Any, name: str, kwargs: dict[str, Any]) -> None:
        self._context = context
        self._tracer = tracer
        self._name = name
        self._kwargs = kwargs
        self._tokens: list[tuple[Any, Any]] = []

    def __enter__(self) -> Any:
        from opentelemetry import context as context_api

        token = context_api.attach(self._context)
        try:
            inner = self._tracer.start_as_current_span(self._name, **self._kwargs)
            span = inner.__enter__()
        except BaseException:
            context_api.detach(token)
            raise
        self._tokens.append((token, inner))
        return span

    def __exit__(self, *exc: Any) -> Any:
        from opentelemetry import context as context_api

        token, inner = self._tokens.pop()
        try:
            return inner.__exit__(*exc)
        finally:
            context_api.detach(token)


# ---- explicit W3C propagation ------------------------------------------------------------------


def _w3c() -> Any:
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def trace_carrier() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``, ``baggage``): a small dict to
    pass to code that runs where context does not follow by itself (a Ray cluster started without
    the tracing hook, a generator actor method, a torchrun rank, a thread pool). Empty when no span
    is current."""
    carrier: dict[str, str] = {}
    _w3c().inject(carrier)
    return carrier


@contextmanager
def use_trace_carrier(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block inside the context ``carrier`` (from :func:`trace_carrier`) describes, so its
    spans — ``WorkerMetrics`` timers included — are children of the span that made it.

    ``None`` or a carrier without a valid ``traceparent`` runs the block with no parent (its spans
    start their own trace); anything but a mapping raises ``TypeError``.
    """
    if carrier is None:
        carrier = {}
    if not isinstance(carrier, Mapping):
        raise TypeError(
            f"trace carrier must be a mapping of W3C headers, got {type(carrier).__name__}"
        )
    from opentelemetry import context as context_api

    token = context_api.attach(_w3c().extract(carrier))
    try:
        yield
    finally:
        context_api.detach(token)


def otlp_span_exporter(otlp: Mapping[str, Any], meter_provider: Any = None) -> Any:
    """An OTLP span exporter configured like the metric one (same collector, headers and Basic
    auth, timeout; ``OTEL_EXPORTER_OTLP_TRACES_*`` before the generic variables).

    A collector that is down costs one warning (shared with the run's metrics to the same
    collector) instead of the SDK's lines at every batch
    (:class:`otel_rl.telemetry.otlp.ExportWatch`).
    """
    from otel_rl.telemetry.otlp import WatchedSpanExporter, build_span_exporter, resolve_otlp

    settings = resolve_otlp(otlp, signal="traces")
    return WatchedSpanExporter(build_span_exporter(settings, meter_provider))
