"""Every metric otel-rl itself emits as an OTel instrument, declared once.

Each :class:`Metric` holds an instrument's name, kind, unit, description and attributes; the
code that creates the instrument calls :meth:`Metric.create`, so the OTel description — and
with it Prometheus' ``# HELP`` — and the unit come from here and nowhere else.
docs/metrics.md is generated from :data:`CATALOGUE` (``python docs/gen_metrics_table.py``), and
tests/core/test_metric_catalogue.py checks the catalogue against a real ``/metrics`` page.

An entry may also say how OTLP renames it with ``otlp.semantic_conventions: true``
(:class:`Semconv`): only where a current OpenTelemetry semantic convention defines the same
quantity. Tracker rows and Prometheus keep otel-rl's names whatever the option says.

Values logged with ``log_metrics`` become gauges too, named by their keys: they are the
application's metrics, not otel-rl's, and are not listed here (docs/outputs.md names them).

The modules that create the instruments import this one; it holds data and imports nothing
those modules do not load anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from otel_rl.core.records import OWN_SCOPE

#: Where a family's member name goes in its :attr:`Metric.name` and :attr:`Metric.description`.
NAME = "<name>"

KINDS = ("counter", "histogram", "observable_counter", "observable_gauge")


@dataclass(frozen=True)
class Semconv:
    """What an instrument becomes on OTLP under an OpenTelemetry semantic convention.

    ``per``: the convention's value is otel-rl's divided by it (100 for percent to a 0..1
    fraction). ``kind``: the convention's instrument (``updowncounter`` is sent as a
    non-monotonic cumulative sum, what an observable up-down counter sends). ``constant``:
    attributes the convention asks for whose value is always the same here.
    """

    name: str
    unit: str
    kind: str
    description: str
    convention: str
    per: float = 1.0
    constant: tuple[tuple[str, str], ...] = ()

    def point_attributes(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """A point's attributes under the convention (every mapping is a GPU one so far):
        ``hw.id`` (required: a GPU id unique in the run, ``node<n>.gpu<i>[.mig<j>]``),
        ``hw.parent`` (a MIG slice's GPU), ``hw.model`` (the device name, was ``device``) and
        the constant ones; otel-rl's ``node``, ``host``, ``gpu`` and ``mig`` stay, for the
        queries that group by them."""
        out = {k: v for k, v in attributes.items() if k != "device"}
        gpu_id = f"node{attributes.get('node')}.gpu{attributes.get('gpu')}"
        mig = attributes.get("mig")
        out["hw.id"] = gpu_id if mig is None else f"{gpu_id}.mig{mig}"
        if mig is not None:
            out["hw.parent"] = gpu_id
        if "device" in attributes:
            out["hw.model"] = attributes["device"]
        out.update(self.constant)
        return out


@dataclass(frozen=True)
class Metric:
    """One instrument (or, with :data:`NAME` in ``name``, a family of them)."""

    name: str
    kind: str
    unit: str
    description: str
    #: When the instrument is there.
    when: str
    attributes: tuple[str, ...] = ()
    #: Attributes only some points carry (and when).
    optional_attributes: tuple[tuple[str, str], ...] = ()
    semconv: Semconv | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def is_family(self) -> bool:
        return NAME in self.name

    def member(self, name: str) -> tuple[str, str]:
        """A family member's instrument name and description (``timing/generation``)."""
        return self.name.replace(NAME, name), self.description.replace(NAME, name)

    def create(
        self,
        meter: Any,
        callbacks: Iterable[Callable[[Any], Iterable[Any]]] = (),
        *,
        name: str | None = None,
        description: str | None = None,
        **advisory: Any,
    ) -> Any:
        """Create the instrument on ``meter`` (``name``/``description``: a family member's,
        see :meth:`member`); ``callbacks`` for an observable kind, ``advisory`` (bucket
        boundaries) for a histogram."""
        factory = getattr(meter, f"create_{self.kind}")
        options = {"unit": self.unit, "description": description or self.description}
        if self.kind.startswith("observable_"):
            return factory(name or self.name, callbacks=list(callbacks), **options)
        return factory(name or self.name, **options, **advisory)


_PROMETHEUS_OR_OTLP = "`prometheus` or `otlp` on"
_GPU = "`monitor_gpus`"
_GPU_LABELS = ("node", "host", "gpu", "device")
_MIG = (("mig", "MIG slices only"),)
_HW_GPU = "hardware/gpu.md"
_HW_COMMON = "hardware/common.md"

STEPS = Metric(
    "otel_rl.steps", "observable_counter", "{step}",
    "training steps sealed so far; rate() is the training throughput", _PROMETHEUS_OR_OTLP,
)  # fmt: skip
STEP = Metric(
    "otel_rl.step", "observable_gauge", "{step}", "the last training step sealed",
    _PROMETHEUS_OR_OTLP,
)  # fmt: skip
EXPORTER_QUEUE = Metric(
    "otel_rl.exporter.queue", "observable_gauge", "{record}",
    "records handed to a tracker and not yet delivered", _PROMETHEUS_OR_OTLP, ("tracker",),
)  # fmt: skip
EXPORTER_DELIVERED = Metric(
    "otel_rl.exporter.delivered", "observable_counter", "{record}",
    "records a tracker has written", _PROMETHEUS_OR_OTLP, ("tracker",),
)  # fmt: skip
EXPORTER_DROPPED = Metric(
    "otel_rl.exporter.dropped", "observable_counter", "{record}",
    "records lost for good, by tracker and reason (docs/reliability.md)", _PROMETHEUS_OR_OTLP,
    ("tracker", "reason"),
)  # fmt: skip
VALUES_NONFINITE = Metric(
    "otel_rl.values.nonfinite", "observable_counter", "{value}",
    "NaN and infinite values logged (they reach the trackers, not Prometheus or OTLP)",
    _PROMETHEUS_OR_OTLP,
)  # fmt: skip
OTLP_EXPORT_FAILURES = Metric(
    "otel_rl.otlp.export.failures", "observable_counter", "{export}",
    "OTLP metric exports that failed (a collector down or refusing)", "`otlp` on",
)  # fmt: skip
STALLED = Metric(
    "otel_rl.stalled", "observable_gauge", "",
    "1 while the run is stalled (no step for longer than the stall threshold), else 0",
    _PROMETHEUS_OR_OTLP, ("run_id",),
)  # fmt: skip
# No unit: Prometheus would add a second "_seconds" to a name that says it already.
SECONDS_SINCE_STEP = Metric(
    "otel_rl.seconds_since_step", "observable_gauge", "",
    "seconds since the last log_metrics call", _PROMETHEUS_OR_OTLP, ("run_id",),
)  # fmt: skip
TIMING = Metric(
    f"timing/{NAME}", "histogram", "s", f"duration of {NAME}",
    "`logger.timer(name)` used, `prometheus` or `otlp` on",
)  # fmt: skip
TIMINGS_DROPPED = Metric(
    "otel_rl.timings.dropped", "observable_counter", "{timing}",
    "timings left out of the timing histograms because Prometheus/OTLP had not collected the "
    "200,000 before them (the trackers' timing/* rows keep every one)",
    "`logger.timer(name)` used, `prometheus` or `otlp` on",
)  # fmt: skip
# Gauges of the step's anatomy rows (docs/anatomy.md): no unit, their names say it.
ANATOMY = Metric(
    f"anatomy/{NAME}", "observable_gauge", "", f"where the step's time went: {NAME}",
    "timers used (`anatomy` on), `prometheus` or `otlp` on",
)  # fmt: skip

GPU_UTILIZATION = Metric(
    "ray.node.gpu.utilization", "observable_gauge", "%", "GPU utilization", _GPU, _GPU_LABELS,
    _MIG,
    Semconv(
        "hw.gpu.utilization", "1", "gauge", "Fraction of time spent in a specific task.",
        _HW_GPU, per=100, constant=(("hw.gpu.task", "general"),),
    ),
)  # fmt: skip
GPU_MEMORY_USED = Metric(
    "ray.node.gpu.memory.used", "observable_gauge", "By", "GPU memory in use", _GPU,
    _GPU_LABELS, _MIG,
    Semconv("hw.gpu.memory.usage", "By", "updowncounter", "GPU memory used.", _HW_GPU),
)  # fmt: skip
GPU_MEMORY_TOTAL = Metric(
    "ray.node.gpu.memory.total", "observable_gauge", "By", "GPU memory in total", _GPU,
    _GPU_LABELS, _MIG,
    Semconv("hw.gpu.memory.limit", "By", "updowncounter", "Size of the GPU memory.", _HW_GPU),
)  # fmt: skip
GPU_POWER = Metric(
    "ray.node.gpu.power", "observable_gauge", "W", "GPU power draw", _GPU, _GPU_LABELS, _MIG,
    Semconv(
        "hw.power", "W", "gauge", "Instantaneous power consumed by the component.", _HW_COMMON,
        constant=(("hw.type", "gpu"),),
    ),
)  # fmt: skip
GPU_TEMPERATURE = Metric(
    "ray.node.gpu.temperature", "observable_gauge", "Cel", "GPU temperature", _GPU,
    _GPU_LABELS, _MIG,
)  # fmt: skip
NODE_MEMORY_USED = Metric(
    "ray.node.memory.used", "observable_gauge", "By", "host memory in use", _GPU,
    ("node", "host"),
)  # fmt: skip
NODE_MEMORY_TOTAL = Metric(
    "ray.node.memory.total", "observable_gauge", "By", "host memory in total", _GPU,
    ("node", "host"),
)  # fmt: skip
NODE_CPU_UTILIZATION = Metric(
    "ray.node.cpu.utilization", "observable_gauge", "%", "host CPU utilization", _GPU,
    ("node", "host"),
)  # fmt: skip

SCRAPE_DURATION = Metric(
    "otel_rl.scrape.duration", "histogram", "s",
    "wall time of one collection over all Ray nodes", _GPU,
)  # fmt: skip
SCRAPE_ERRORS = Metric(
    "otel_rl.scrape.errors", "counter", "{error}", "failed scrapes of a node", _GPU,
    ("node", "reason"),
)  # fmt: skip
SCRAPE_SERIES = Metric(
    "otel_rl.scrape.series", "observable_gauge", "{series}", "series in the last round", _GPU
)
SCRAPE_NODES = Metric(
    "otel_rl.scrape.nodes", "observable_gauge", "{node}", "nodes in the last round", _GPU,
    ("state",),
)  # fmt: skip

#: Every entry, in the order docs/metrics.md lists them.
CATALOGUE: tuple[Metric, ...] = (
    STEPS, STEP, EXPORTER_QUEUE, EXPORTER_DELIVERED, EXPORTER_DROPPED, VALUES_NONFINITE,
    OTLP_EXPORT_FAILURES, STALLED, SECONDS_SINCE_STEP, TIMING, TIMINGS_DROPPED, ANATOMY,
    GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_POWER, GPU_TEMPERATURE,
    NODE_MEMORY_USED, NODE_MEMORY_TOTAL, NODE_CPU_UTILIZATION,
    SCRAPE_DURATION, SCRAPE_ERRORS, SCRAPE_SERIES, SCRAPE_NODES,
)  # fmt: skip

#: ``{otel-rl name: entry}`` of the entries a semantic convention renames.
SEMCONV_BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE if m.semconv is not None}


def is_own_scope(scope: str) -> bool:
    """otel-rl's own scopes are ``otel_rl`` and below it (``otel_rl.ray``): only their
    instruments are renamed to semantic conventions, never an application's."""
    return scope == OWN_SCOPE or scope.startswith(OWN_SCOPE + ".")


@cache
def prometheus_family(metric: Metric) -> tuple[str, str]:
    """``(name, type)`` of the family Prometheus serves for ``metric``, as the OTel Prometheus
    exporter renders it (the unit suffix, ``_total`` for counters): one point of the instrument
    is rendered through the real exporter. A family's member part reads ``<name>``."""
    import re

    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest

    placeholder = "membername"  # survives the SDK (lower case) and the exporter as it is
    name, description = metric.member(placeholder)
    attributes = {key: "x" for key in metric.attributes}
    registry = CollectorRegistry(auto_describe=False)
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(registry=registry, disable_target_info=True)],
        shutdown_on_exit=False,
    )
    try:
        meter = provider.get_meter(OWN_SCOPE)
        one = [lambda options: [Observation(1, attributes)]]
        instrument = metric.create(meter, one, name=name, description=description)
        if metric.kind == "counter":
            instrument.add(1, attributes)
        elif metric.kind == "histogram":
            instrument.record(1, attributes)
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    found = re.search(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    if found is None:
        raise RuntimeError(f"the Prometheus exporter rendered nothing for {metric.name}")
    return found.group(1).replace(placeholder, NAME), found.group(2)
