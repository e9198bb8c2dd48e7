"""NeMo RL's ``RayGpuMonitorLogger``: GPU and host memory of every Ray node, polled on a thread of
its own and handed to a parent logger as ``<prefix>/node.<i>.gpu.<j>.util`` and friends.

The metric names and units are otel-rl's Ray bridge's (:mod:`otel_rl.ray.gpu_metrics`: Ray
reports GPU memory in MiB under a bytes unit, host memory in bytes). The drop-in ``Logger``
uses the bridge itself (``Logger.gpu_monitor``: concurrent scrapes, per-node timeouts, rows on
the step axis); this class is for code that builds NeMo RL's monitor by hand, with NeMo RL's
constructor, methods and buffer. ``ray``, ``requests`` and the collection loop's ``time`` are
looked up on ``otel_rl.compat.nemo_rl`` at each use (see :mod:`otel_rl.compat.nemo_sdks`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypedDict

from otel_rl.compat.nemo_sdks import sdk
from otel_rl.ray.gpu_metrics import (
    GIB,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    HOST_MEMORY_TOTAL,
    HOST_MEMORY_USED,
    MIB,
)

__all__ = ["GpuMetricSnapshot", "RayGpuMonitorLogger"]

#: Seconds one node's ``/metrics`` may take.
FETCH_TIMEOUT = 5.0


class GpuMetricSnapshot(TypedDict):
    """One collection: seconds since the monitor started (its step), and the values."""

    step: int
    metrics: dict[str, Any]


class RayGpuMonitorLogger:
    """Collects every ``collection_interval`` seconds and, every ``flush_interval``, calls
    ``parent_logger.log_metrics(metrics, step=<seconds since start>, prefix=metric_prefix,
    step_metric=step_metric)`` for each collection, with ``metrics[step_metric] = step``."""

    def __init__(
        self,
        collection_interval: int | float,
        flush_interval: int | float,
        metric_prefix: str,
        step_metric: str,
        parent_logger: Any = None,
    ) -> None:
        self.collection_interval = collection_interval
        self.flush_interval = flush_interval
        self.metric_prefix = metric_prefix
        self.step_metric = step_metric
        self.parent_logger = parent_logger
        self.metrics_buffer: list[GpuMetricSnapshot] = []
        self.last_flush_time = sdk("time").time()
        self.is_running = False
        self.collection_thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.start_time: float = float("-inf")

    def start(self) -> None:
        """Start the collection thread (Ray must be initialised; a second call does nothing)."""
        if not sdk("ray").is_initialized():
            raise ValueError("Ray must be initialized (ray.init()) before GPU monitoring starts")
        if self.is_running:
            return
        self.start_time = sdk("time").time()
        self.is_running = True
        self.collection_thread = threading.Thread(
            target=self._collection_loop, name="otel-rl-nemo-gpu-monitor", daemon=True
        )
        self.collection_thread.start()
        print(
            f"GPU monitoring started with collection interval={self.collection_interval}s, "
            f"flush interval={self.flush_interval}s"
        )

    def stop(self) -> None:
        """Stop collecting and hand what is buffered to the parent logger."""
        self.is_running = False
        if self.collection_thread is not None:
            self.collection_thread.join(timeout=self.collection_interval * 2)
        self.flush()
        print("GPU monitoring stopped")

    def _collection_loop(self) -> None:
        while self.is_running:
            clock = sdk("time")  # NeMo RL's module's clock (see the module docstring)
            try:
                collected_at = clock.time()
                metrics = self._collect_metrics()
                if metrics:
                    with self.lock:
                        self.metrics_buffer.append(
                            {"step": int(collected_at - self.start_time), "metrics": metrics}
                        )
                now = clock.time()
                if now - self.last_flush_time >= self.flush_interval:
                    self.flush()
                    self.last_flush_time = now
            except Exception as exc:  # the monitor outlives a bad round
                print(f"Error in GPU monitoring collection loop: {exc}")
            clock.sleep(self.collection_interval)

    def _parse_metric(self, sample: Any, node_idx: int) -> dict[str, Any]:
        """One Prometheus sample as ``{name: value}`` under NeMo RL's names; ``{}`` for others."""
        name, labels, value = sample.name, sample.labels, sample.value
        if name == GPU_UTILIZATION:
            return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.util": value}
        if name == GPU_MEMORY_USED:  # MiB, although Ray declares bytes
            return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.mem_gb": value * MIB / GIB}
        if name == HOST_MEMORY_USED:
            return {f"node.{node_idx}.mem_gb": value / GIB}
        if name == HOST_MEMORY_TOTAL:
            return {f"node.{node_idx}.mem_total_gb": value / GIB}
        return {}

    def _parse_gpu_sku(self, sample: Any, node_idx: int) -> dict[str, str]:
        """``{node.<i>.gpu.<j>.type: device name}`` from a GPU sample; ``{}`` for others."""
        labels = sample.labels
        if "GpuIndex" not in labels or "GpuDeviceName" not in labels:
            return {}  # a CPU node
        if sample.name not in (GPU_UTILIZATION, GPU_MEMORY_USED):
            return {}
        return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.type": labels["GpuDeviceName"]}

    def _collect_gpu_sku(self) -> dict[str, str]:
        """The device name of every GPU in the cluster."""
        return self._collect(sku=True)

    def _collect_metrics(self) -> dict[str, Any]:
        """The values of every node now."""
        return self._collect(metrics=True)

    def _collect(self, metrics: bool = False, sku: bool = False) -> dict[str, Any]:
        if metrics == sku:
            raise ValueError(f"collect either metrics or sku, not both: {metrics=}, {sku=}")
        parser: Callable[[Any, int], dict[str, Any]] = (
            self._parse_metric if metrics else self._parse_gpu_sku
        )
        ray = sdk("ray")
        if not ray.is_initialized():
            print("Ray is not initialized. Cannot collect GPU metrics.")
            return {}
        try:
            nodes = ray.nodes()
            if not nodes:
                print("No Ray nodes found.")
                return {}
            # Nodes in ray.nodes() order, each endpoint once; dead nodes stay listed by Ray.
            addresses = dict.fromkeys(
                f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
                for node in nodes
                if node.get("MetricsExportPort") and node.get("Alive", True)
            )
            collected: dict[str, Any] = {}
            for node_idx, address in enumerate(addresses):
                collected.update(self._fetch_and_parse_metrics(node_idx, address, parser))
            return collected
        except Exception as exc:
            print(f"Error collecting GPU metrics: {exc}")
            return {}

    def _fetch_and_parse_metrics(
        self, node_idx: int, metric_address: str, parser_fn: Callable[[Any, int], dict[str, Any]]
    ) -> dict[str, Any]:
        """``http://<metric_address>/metrics`` parsed sample by sample with ``parser_fn``."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            url = f"http://{metric_address}/metrics"
            response = sdk("requests").get(url, timeout=FETCH_TIMEOUT)
            if response.status_code != 200:
                print(f"Error: Status code {response.status_code} from {metric_address}")
                return {}
            values: dict[str, Any] = {}
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    values.update(parser_fn(sample, node_idx))
            return values
        except Exception as exc:
            print(f"Error fetching metrics from {metric_address}: {exc}")
            return {}

    def flush(self) -> None:
        """Hand every buffered collection to the parent logger (at its own step), then clear."""
        with self.lock:
            if not self.metrics_buffer:
                return
            if self.parent_logger is not None:
                for entry in self.metrics_buffer:
                    step, metrics = entry["step"], entry["metrics"]
                    metrics[self.step_metric] = step
                    self.parent_logger.log_metrics(
                        metrics, step=step, prefix=self.metric_prefix, step_metric=self.step_metric
                    )
            self.metrics_buffer = []
