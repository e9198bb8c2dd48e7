"""StepReader: an OTel MetricReader collected at step boundaries, on the caller's thread."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricReader, MetricsData

from otel_rl.core.records import scoped_metrics

_DELTA = AggregationTemporality.DELTA
_CUMULATIVE = AggregationTemporality.CUMULATIVE

#: Per-step temporality: counters and histograms as deltas, up-down counters as levels.
STEP_TEMPORALITY: dict[type, AggregationTemporality] = {
    Counter: _DELTA,
    Histogram: _DELTA,
    ObservableCounter: _DELTA,
    UpDownCounter: _CUMULATIVE,
    ObservableUpDownCounter: _CUMULATIVE,
    ObservableGauge: _DELTA,
}


class StepReader(MetricReader):
    """Reads what OTel instruments recorded since the previous collection (DELTA).

    Counters and histograms come as per-step deltas, up-down counters as their current level,
    gauges as their last value. DELTA also frees idle attribute sets at every collection, so a
    long run does not accumulate state. :meth:`take` hands the collected data over; the reader
    keeps nothing else.
    """

    def __init__(self) -> None:
        super().__init__(preferred_temporality=STEP_TEMPORALITY)
        self._collected: list[MetricsData] = []

    def _receive_metrics(
        self, metrics_data: MetricsData | None, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        if metrics_data is None:
            return
        if any(True for _ in scoped_metrics((metrics_data,))):
            self._collected.append(metrics_data)

    def take(self) -> list[MetricsData]:
        """Collect now and return everything collected since the last ``take``."""
        self.collect()
        taken, self._collected = self._collected, []
        return taken

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._collected = []
