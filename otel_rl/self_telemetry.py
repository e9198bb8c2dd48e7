"""The run's own health as OTel instruments (Prometheus/OTLP only, never tracker rows).

Observable instruments read counters the Logger and its exporters keep anyway, so they cost
nothing until a reader collects: steps sealed (``rate()`` is the training throughput), the last
step, each tracker's queue depth, delivered records and records lost by reason, non-finite
values logged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.failures import LOSS_REASONS


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

    meter.create_observable_counter("otel_rl.steps", [counter("steps")], unit="{step}")
    meter.create_observable_gauge("otel_rl.step", [last], unit="{step}")
    meter.create_observable_gauge(
        "otel_rl.exporter.queue", [per_tracker(lambda e: e.pending)], unit="{record}"
    )
    meter.create_observable_counter(
        "otel_rl.exporter.delivered", [per_tracker(lambda e: e.stats["delivered"])]
    )
    def dropped(options: Any) -> list[Observation]:
        return [
            Observation(e.stats.get(f"dropped.{reason}", 0), {"tracker": e.name, "reason": reason})
            for e in exporters
            for reason in LOSS_REASONS
        ]

    meter.create_observable_counter(
        "otel_rl.exporter.dropped",
        [dropped],
        unit="{record}",
        description="records lost for good, by tracker and reason (docs/reliability.md)",
    )
    meter.create_observable_counter("otel_rl.values.nonfinite", [counter("nonfinite")])


def install_otlp_telemetry(meter: Meter, failures: Callable[[], int]) -> None:
    """``otel_rl.otlp.export.failures``: OTLP metric exports that failed (a collector down or
    refusing), which the log reports once rather than at every export."""
    meter.create_observable_counter(
        "otel_rl.otlp.export.failures",
        [lambda options: [Observation(failures())]],
        unit="{export}",
    )
