"""One trace per RL step across Ray actors: the Ray tracing startup hook.

A driver adds one argument::

    ray.init(_tracing_startup_hook="otel_rl.ray.tracing:setup")

(or ``ray start --head --tracing-startup-hook=otel_rl.ray.tracing:setup`` for a cluster started
by hand). Ray then calls :func:`setup` in the driver and in every worker process it starts, and
carries the OTel context (W3C ``traceparent`` and ``baggage``) with every task and actor call:
an actor method called while a driver timer is open runs under a Ray span whose parent is that
timer's span, and the ``WorkerMetrics`` timers inside it are its children.

:func:`setup` installs, once per process, a ``TracerProvider`` as the global one (unless the
application set its own) with a ``BatchSpanProcessor`` to the collector named by the standard
``OTEL_EXPORTER_OTLP_*`` variables (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``..._PROTOCOL``,
``..._HEADERS``, ``..._TIMEOUT``; the default is ``http://127.0.0.1:4318``). Ray's
``runtime_env={"env_vars": {...}}`` carries them to every node. ``OTEL_TRACES_EXPORTER=none``
keeps the propagation and exports nothing. ``WorkerMetrics`` in a process where the hook ran
traces its timers with no argument and exports them through the same processor; so do the
drop-ins' timers (NeMo RL's ``Timer``, verl's ``marked_timer``/``simple_timer`` from
``otel_rl.compat``) in a worker, where no Logger lives. Each of these spans names the run of the
driver call it runs in, read from the call's baggage span by span. Ray's own spans and the
drop-ins' timers also reach the driver's trace file: a worker's in its ``WorkerMetrics``
snapshots, the driver's through its Logger.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, cast

from otel_rl.core.errors import ConfigError
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.span_transfer import SpanCollector
from otel_rl.telemetry.tracing import (
    RunIdFromBaggage,
    hook_active,
    install_hook,
    otlp_span_exporter,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

__all__ = ["hook_active", "setup"]


def setup() -> None:
    """The Ray tracing startup hook (``_tracing_startup_hook="otel_rl.ray.tracing:setup"``).

    Idempotent. Raises :class:`otel_rl.ConfigError` for an ``OTEL_TRACES_EXPORTER`` other than
    ``otlp`` or ``none`` (in the driver that is at ``ray.init``, before any worker starts).
    """
    if hook_active():
        return
    from opentelemetry import trace
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind not in ("otlp", "none"):
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={kind!r}: otel_rl.ray.tracing exports with 'otlp' "
            "(OTEL_EXPORTER_OTLP_* variables) or not at all with 'none'"
        )
    resource = _process_resource()
    # The SDK's own span metrics would otherwise land on the global meter provider, which
    # otel-rl routes into the trackers' rows.
    quiet = NoOpMeterProvider()
    processor = None
    if kind == "otlp":
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        processor = BatchSpanProcessor(otlp_span_exporter({}, meter_provider=quiet))
    # shutdown_on_exit: a worker that exits normally flushes its last spans.
    provider = TracerProvider(resource=resource, meter_provider=quiet)
    provider.add_span_processor(cast("SpanProcessor", RunIdFromBaggage()))
    if processor is not None:
        provider.add_span_processor(processor)
    # Ray's spans join the trace file with their children: a worker's in its snapshots, the
    # driver's through its run's file.
    spans = SpanCollector()
    provider.add_span_processor(cast("SpanProcessor", spans))
    install_hook(processor, resource, spans)
    current = trace.get_tracer_provider()
    if isinstance(current, trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    else:  # Ray's spans use the global provider: the application's own, then
        _log.info(
            "otel-rl: a global TracerProvider is already set; Ray's spans use it, otel-rl's "
            "timers export with OTEL_EXPORTER_OTLP_*"
        )


def _process_resource() -> Any:
    """service.name, the node and the process (Ray's node id when Ray is connected)."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    env = OTELResourceDetector().detect().attributes
    attributes: dict[str, Any] = {
        "process.pid": os.getpid(),
        "otel_rl.role": "ray-worker",
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "").strip()
        or env.get("service.name")
        or "otel-rl",
    }
    if "host.name" not in env:
        attributes["host.name"] = socket.gethostname()
    try:
        import ray._private.worker as ray_worker

        # The hook runs inside ray.init/connect, before the public runtime context answers.
        worker = ray_worker.global_worker
        if worker.mode == ray_worker.SCRIPT_MODE:
            attributes["otel_rl.role"] = "driver"
        attributes["ray.node_id"] = worker.current_node_id.hex()
        attributes["ray.job_id"] = worker.current_job_id.hex()
    except Exception:  # outside Ray (tests, a plain process): the host names the node
        pass
    return Resource.create(attributes)
