"""Tracker exporters: one OTel ``MetricExporter`` per experiment tracker.

Each module imports its tracker's SDK lazily, on the exporter's own thread. Use
:func:`otel_rl.delivery.registry.exporter_class` to find one by name.

This package is also the public API for writing a tracker of one's own (``Tracker``: the verbs;
``TrackerExporter``: a tracker that is also an OTel ``MetricExporter``)::

    from otel_rl.exporters import HistogramValue, RowRejected, StepBatch, Tracker
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otel_rl.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from otel_rl.core.failures import RowRejected
    from otel_rl.core.records import HistogramValue, StepBatch
    from otel_rl.delivery.tracker import Tracker
    from otel_rl.exporters.base import TrackerExporter

__all__ = ["HistogramValue", "RowRejected", "StepBatch", "Tracker", "TrackerExporter"]

_PUBLIC = {
    "Tracker": "otel_rl.delivery.tracker",
    "TrackerExporter": "otel_rl.exporters.base",
    "RowRejected": "otel_rl.core.failures",
    "StepBatch": "otel_rl.core.records",
    "HistogramValue": "otel_rl.core.records",
}

__getattr__ = lazy_exports(__name__, _PUBLIC)
