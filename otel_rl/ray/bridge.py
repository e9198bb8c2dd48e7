"""GpuMonitor: the scraper wired into a run — OTel gauges, self-telemetry, and tracker rows.

Tracker rows go on their own x-axis, as NeMo RL names it: every collection becomes one
``StepBatch(step=<whole seconds since start>, axis="ray/ray_step")`` whose row holds
``ray/ray_step`` (seconds since start, ms precision) and ``ray/node.{n}.…`` values. Rows are
buffered and handed to the trackers every ``flush_interval`` seconds. Trackers keep them apart
from training rows: W&B plots ``ray/*`` against ``ray/ray_step`` without touching its own step,
JSONL marks the line with ``"axis"``, TensorBoard writes the ``ray/…`` tags at step = seconds.
With ``collection_interval`` below one second several points share a whole-second step in
trackers with integer steps; ``ray/ray_step`` in the row stays exact.

Each GPU's device name is sent once, as text (``ray/node.{n}.gpu.{i}.device``) in the first row
that has the GPU, and logged at INFO.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from otel_rl.core.records import StepBatch
from otel_rl.delivery.channel import Channel
from otel_rl.delivery.fanout import Fanout
from otel_rl.delivery.tracker import Tracker
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.ray.gpu_metrics import tracker_rows
from otel_rl.ray.scraper import Collection, RayNodeScraper

#: The tracker x-axis of GPU data (NeMo RL's name).
AXIS = "ray/ray_step"
#: OTel instrumentation scope of the GPU gauges and scrape telemetry.
SCOPE = "otel_rl.ray"


class ScrapeSettings(Protocol):
    """What the scraper reads of the ``gpu_monitoring:`` section of the typed logger config."""

    @property
    def endpoints(self) -> Sequence[str]: ...
    @property
    def collection_interval(self) -> float: ...
    @property
    def timeout(self) -> float: ...
    @property
    def flush_interval(self) -> float: ...


class GpuMonitoringConfig(Protocol):
    """What :meth:`GpuMonitor.from_config` reads of the typed logger config
    (``otel_rl.config.schema.LoggerSettings``, a layer above this one)."""

    @property
    def gpu_monitoring(self) -> ScrapeSettings: ...


class GpuMonitor:
    """Runs a :class:`RayNodeScraper` for a run and feeds its data to the pipeline.

    ``meter_provider`` gets the ``ray.node.*`` gauges and ``otel_rl.scrape.*`` metrics (pass the
    Logger's side provider: read by Prometheus/OTLP only). ``exporters`` (a
    :class:`~otel_rl.delivery.fanout.Fanout`, or trackers, each delivered by its channel) get the
    tracker rows.
    """

    def __init__(
        self,
        scraper: RayNodeScraper,
        *,
        meter_provider: Any = None,
        exporters: Fanout | Sequence[Tracker] = (),
        flush_interval: float = 10.0,
    ) -> None:
        self.scraper = scraper
        self.fanout = (
            exporters if isinstance(exporters, Fanout)
            else Fanout([Channel.of(tracker) for tracker in exporters])
        )  # fmt: skip
        self.flush_interval = float(flush_interval)
        self._buffer: list[StepBatch] = []
        self._lock = threading.Lock()
        self._last_flush = scraper.seconds_since_start()
        self._devices: dict[tuple[int, int], str] = {}
        self.stats = {"rows": 0, "flushes": 0}
        if meter_provider is not None:
            from otel_rl.ray.gauges import install_gpu_gauges
            from otel_rl.ray.scrape_telemetry import install_scrape_telemetry

            meter = meter_provider.get_meter(SCOPE)
            install_gpu_gauges(meter, scraper)
            install_scrape_telemetry(meter, scraper)
        if len(self.fanout):
            scraper.add_listener(self._on_collection)

    @classmethod
    def from_config(
        cls,
        cfg: GpuMonitoringConfig,
        *,
        meter_provider: Any = None,
        exporters: Fanout | Sequence[Any] = (),
    ) -> GpuMonitor:
        """Build from the typed logger config (its ``gpu_monitoring`` section)."""
        gpu = cfg.gpu_monitoring
        scraper = RayNodeScraper(
            gpu.endpoints or (), interval=gpu.collection_interval, timeout=gpu.timeout
        )
        return cls(
            scraper,
            meter_provider=meter_provider,
            exporters=exporters,
            flush_interval=gpu.flush_interval,
        )

    def start(self) -> None:
        self.scraper.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop collecting and hand the buffered rows to the trackers."""
        self.scraper.stop(timeout)
        self.flush()

    def flush(self) -> None:
        """Submit the buffered rows to every exporter now (queue hand-off only)."""
        with self._lock:
            batches, self._buffer = self._buffer, []
            self._last_flush = self.scraper.seconds_since_start()
        if not batches:
            return
        self.stats["flushes"] += 1
        for batch in batches:
            self.fanout.send(batch)

    # ---- scraper thread -------------------------------------------------------------------------

    def _on_collection(self, collection: Collection) -> None:
        batch = self.batch_for(collection)
        if batch is not None:
            with self._lock:
                self._buffer.append(batch)
            self.stats["rows"] += 1
        if self.scraper.seconds_since_start() - self._last_flush >= self.flush_interval:
            self.flush()

    def batch_for(self, collection: Collection) -> StepBatch | None:
        """The tracker row of one collection (``None`` when no node answered)."""
        samples = collection.samples
        if not samples:
            return None
        values: dict[str, Any] = {AXIS: round(collection.elapsed, 3)}
        for node, sample in sorted(samples.items()):
            values.update(tracker_rows(node, sample))
            for gpu in sample.gpus.values():
                if self._devices.get((node, gpu.index)) != gpu.device:
                    self._devices[(node, gpu.index)] = gpu.device
                    values[f"ray/node.{node}.gpu.{gpu.label}.device"] = gpu.device
                    _log.info(
                        "otel-rl: GPU monitoring: node %d (%s) GPU %s: %s",
                        node,
                        collection.results[node].target.host,
                        gpu.label,
                        gpu.device,
                    )
        return StepBatch(
            step=int(collection.elapsed), values=values, time=collection.time, axis=AXIS
        )
