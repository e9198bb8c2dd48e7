"""The tracker exporter: a tracker that is also an OTel ``MetricExporter``.

A subclass writes to one tracker through the verbs of :class:`~otel_rl.delivery.tracker.Tracker`
(``open``, ``write_step``, ``close``, and what else the tracker supports), each on its delivery's
thread. The delivery (queue, worker, retries, spool, counters) is a
:class:`~otel_rl.delivery.channel.Channel` around the tracker, :attr:`TrackerExporter.delivery`:
a tracker that raises or hangs delays only its own channel. A Logger delivers the exporters it
is given through that same channel; code without a Logger hands the exporter to an OTel reader.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otel_rl.core.failures import RowRejected
from otel_rl.core.records import StepBatch, last_gauge_value
from otel_rl.delivery.channel import Channel
from otel_rl.delivery.tracker import Tracker
from otel_rl.telemetry.step_reader import STEP_TEMPORALITY

__all__ = [
    "ConfigKey", "RowRejected", "SdkInit", "Tracker", "TrackerConfig", "TrackerExporter",
]  # fmt: skip


class ConfigKey(NamedTuple):
    """A key of a tracker's own ``<name>:`` section that otel-rl types and documents: ``kind``
    is ``"path"`` (a path, unset by default) or ``"count"`` (an integer >= 1)."""

    kind: str
    meaning: str
    default: Any = None
    #: The default as docs/configuration.md shows it, where the value alone reads poorly.
    shown_default: str | None = None


class SdkInit(NamedTuple):
    """Where a ``<name>:`` mapping goes: keyword arguments of ``package``'s ``init``
    (``init_class``'s method, where given), read from ``init_files`` of the installed package
    without importing it; ``declared``: its parameters when they cannot be read; ``also``: names
    accepted beside them (aliases the SDK or the exporter maps)."""

    package: str
    init_files: tuple[str, ...]
    declared: frozenset[str]
    also: frozenset[str] = frozenset()
    init_class: str | None = None


@dataclass(frozen=True)
class TrackerConfig:
    """A tracker's place in the logger config: its ``<name>_enabled`` flag (``flag``: the docs'
    line; ``enabled``: its default), its place among the flags and among the trackers a config
    enables (``order``), and its ``<name>:`` section: keys otel-rl types (``keys``), or a mapping
    handed over as given (``mapping``: the docs' line) whose names are checked against
    ``accepted`` or the SDK's ``init`` (``sdk_init``)."""

    flag: str
    order: int
    enabled: bool = False
    keys: Mapping[str, ConfigKey] = field(default_factory=dict)
    mapping: str = ""
    accepted: frozenset[str] | None = None
    sdk_init: SdkInit | None = None


#: Names already warned about: each deprecated alias says so once per process.
_MOVED_WARNED: set[str] = set()


def _moved_to_delivery(name: str) -> Any:
    """A read-only alias of ``self.delivery.<name>`` that warns once (``DeprecationWarning``).

    The counters moved to the delivery (the tracker holds only its verbs); code that
    read them on the exporter keeps working one more release, told where they went.
    """

    def moved(self: TrackerExporter) -> Any:
        if name not in _MOVED_WARNED:
            _MOVED_WARNED.add(name)
            warnings.warn(
                f"{type(self).__name__}.{name} is deprecated and will be removed in the next "
                f"release: a tracker's counters are its delivery's, read "
                f"exporter.delivery.{name} (or the entry of logger.exporters)",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(self.delivery, name)

    return property(moved, doc=f"Deprecated: ``delivery.{name}``.")


class TrackerExporter(Tracker, MetricExporter):
    """A :class:`~otel_rl.delivery.tracker.Tracker` an OTel reader can export to. The keyword
    arguments set how its :attr:`delivery` works, over the ``export.*`` options of a Logger."""

    #: What the logger config holds for this tracker, when otel-rl registers it (its own
    #: trackers: the schema, its checks and docs/configuration.md's rows derive from it).
    config: ClassVar[TrackerConfig | None] = None

    def __init__(
        self, *, queue_size: int | None = None, on_full: str | None = None,
        retry_max_backoff: float | None = None, spool_dir: str | os.PathLike[str] | None = None,
        fsync_interval: float | None = None, spool_meta: Mapping[str, Any] | None = None,
        time_axis: str = "otel_rl/elapsed_s", step_gauge: str | None = None,
    ) -> None:  # fmt: skip
        MetricExporter.__init__(self, preferred_temporality=STEP_TEMPORALITY)
        self._time_axis, self._step_gauge = time_axis, step_gauge
        self._started_at = time.monotonic()
        given = {"queue_size": queue_size, "on_full": on_full, "fsync_interval": fsync_interval,
                 "retry_max_backoff": retry_max_backoff}  # fmt: skip
        #: This tracker's delivery: its counters (``stats``, ``lost``, ``pending``, ``failure``,
        #: ``undelivered``), ``spool_dir`` and ``submit``.
        self.delivery = Channel(self, given={k: v for k, v in given.items() if v is not None})
        if spool_dir is not None:
            self.delivery.attach(None, spool_dir, spool_meta)

    # Deprecated aliases of the delivery's counters (removed in the next release).
    stats = _moved_to_delivery("stats")
    lost = _moved_to_delivery("lost")
    pending = _moved_to_delivery("pending")
    failure = _moved_to_delivery("failure")
    undelivered = _moved_to_delivery("undelivered")

    # ---- OTel MetricExporter API -------------------------------------------------------------

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        """Hand-off from a periodic reader: the data goes on a time (or step-gauge) axis."""
        step, axis = self._axis_point(metrics_data)
        self.delivery.submit(StepBatch(step=step, otel=(metrics_data,), axis=axis))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        """Wait until every queued record is written (or the timeout passes)."""
        return self.delivery.wait_idle(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Drain within the timeout, then close the tracker (``exit_code`` kwarg: run status).
        Accepts the SDK's ``timeout`` keyword (milliseconds) as well as ``timeout_millis``."""
        if kwargs.get("timeout") is not None:
            timeout_millis = float(kwargs["timeout"])
        self.delivery.shutdown(timeout_millis / 1000, int(kwargs.get("exit_code", 0) or 0))

    def _axis_point(self, metrics_data: MetricsData) -> tuple[int, str | None]:
        step = last_gauge_value(metrics_data, self._step_gauge) if self._step_gauge else None
        if step is not None:
            return int(step), None
        return int(time.monotonic() - self._started_at), self._time_axis
