"""The run's own health as OTel instruments (Prometheus/OTLP only, never tracker rows).

Observable instruments read counters the Logger and its exporters keep anyway, so they cost
nothing until a reader collects: steps sealed (``rate()`` is the training throughput), the last
step, each tracker's queue depth, delivered records and records lost by reason, non-finite
values logged. Names, units and descriptions: :mod:`otel_rl.core.catalogue`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.core import catalogue
from otel_rl.core.failures import LOSS_REASONS


def install_self_telemetry(
    meter: Meter,
    exporters: Sequence[Any],
    stats: Mapping[str, Any],
    last_step: Callable[[], int | None],
) -> None:
    def per_tracker(read: Callable[[Any], float]) -> Callable[[Any], list[Observation]]:
        def observe(options: Any) -> list[Observation]:
            return [Observation(read(e), {"tracker": e.name}) for e in exporters]

        return observe

    def counter(name: str) -> Callable[[Any], list[Observation]]:
        return lambda options: [Observation(stats[name])]

    def last(options: Any) -> list[Observation]:
        step = last_step()
        return [] if step is None else [Observation(step)]

    def dropped(options: Any) -> list[Observation]:
        return [
            Observation(e.stats.get(f"dropped.{reason}", 0), {"tracker": e.name, "reason": reason})
            for e in exporters
            for reason in LOSS_REASONS
        ]

    catalogue.STEPS.create(meter, [counter("steps")])
    catalogue.STEP.create(meter, [last])
    catalogue.EXPORTER_QUEUE.create(meter, [per_tracker(lambda e: e.pending)])
    catalogue.EXPORTER_DELIVERED.create(meter, [per_tracker(lambda e: e.stats["delivered"])])
    catalogue.EXPORTER_DROPPED.create(meter, [dropped])
    catalogue.VALUES_NONFINITE.create(meter, [counter("nonfinite")])


def install_otlp_telemetry(meter: Meter, failures: Callable[[], int]) -> None:
    """``otel_rl.otlp.export.failures``: OTLP metric exports that failed (a collector down or
    refusing), which the log reports once rather than at every export."""
    catalogue.OTLP_EXPORT_FAILURES.create(meter, [lambda options: [Observation(failures())]])
