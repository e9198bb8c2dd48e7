"""Ray's per-node Prometheus text → the GPU and host values otel-rl reports.

Ray's reporter agent on every node exports (Ray 2.60 names):

======================================  ==================================================
``ray_node_gpus_utilization``           percent; ``-1`` when NVML could not read it
``ray_node_gram_used``                  **MiB**, although Ray declares the unit as bytes
``ray_node_gram_available``             **MiB** (used + available = the GPU's total)
``ray_node_gpu_power_milliwatts``       milliwatts
``ray_node_gpu_temperature_celsius``    °C
``ray_node_mem_used``/``_total``        bytes (host memory)
``ray_node_cpu_utilization``            percent of all cores
======================================  ==================================================

GPU series carry ``GpuIndex`` and ``GpuDeviceName``; Ray 2.x adds ``GpuUuid`` and, on the
OpenTelemetry recorder path, ``otel_scope_*`` labels. Only ``GpuIndex`` is required here. A MIG
slice is reported with ``GpuIndex = parent * 1000 + slice`` (and a ``MIG-`` UUID / "MIG" in the
device name), so slice 0 of GPU 0 has index 0: a MIG slice is recognised by its index, UUID or
name, not by the index alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: Bytes per MiB and per GiB. Tracker rows use GiB under NeMo RL's ``*_gb`` names.
MIB = 1024**2
GIB = 1024**3

GPU_UTILIZATION = "ray_node_gpus_utilization"
GPU_MEMORY_USED = "ray_node_gram_used"
GPU_MEMORY_AVAILABLE = "ray_node_gram_available"
GPU_POWER = "ray_node_gpu_power_milliwatts"
GPU_TEMPERATURE = "ray_node_gpu_temperature_celsius"
HOST_MEMORY_USED = "ray_node_mem_used"
HOST_MEMORY_TOTAL = "ray_node_mem_total"
CPU_UTILIZATION = "ray_node_cpu_utilization"

_GPU_FAMILIES = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_AVAILABLE, GPU_POWER, GPU_TEMPERATURE)
_NODE_FAMILIES = (HOST_MEMORY_USED, HOST_MEMORY_TOTAL, CPU_UTILIZATION)
_WANTED = _GPU_FAMILIES + _NODE_FAMILIES

# A real node's endpoint holds ~900 series (~300 KB); parsing all of it costs ~80 ms, the few
# families used here ~2 ms. Lines are kept by exact family name, so ``ray_node_mem_used_host``
# does not pass as ``ray_node_mem_used``.
_KEEP = tuple(
    prefix
    for name in _WANTED
    for prefix in (f"{name}{{", f"{name} ", f"# HELP {name} ", f"# TYPE {name} ")
)


class MalformedMetrics(ValueError):
    """The response is not Prometheus text with Ray node metrics in it."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU (or MIG slice) of a node, in Ray's units except where the name says."""

    index: int
    device: str
    uuid: str | None = None
    utilization: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None

    @property
    def is_mig(self) -> bool:
        uuid = self.uuid or ""
        return self.index >= 1000 or uuid.startswith("MIG-") or " MIG " in f" {self.device} "

    @property
    def parent(self) -> int:
        """The physical GPU's index (the index itself for a whole GPU)."""
        return self.index // 1000 if self.is_mig else self.index

    @property
    def mig_slice(self) -> int | None:
        return self.index % 1000 if self.is_mig else None

    @property
    def label(self) -> str:
        """The GPU's part of a tracker key: ``3`` or, for a MIG slice, ``3.mig.1``."""
        mig = self.mig_slice
        return str(self.index) if mig is None else f"{self.parent}.mig.{mig}"


@dataclass(frozen=True)
class NodeSample:
    """What one scrape of one node yielded."""

    gpus: dict[int, GpuSample] = field(default_factory=dict)
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    cpu_utilization: float | None = None
    ip: str | None = None
    series: int = 0


def parse_node_metrics(text: str) -> NodeSample:
    """Extract GPU and host values from one node's ``/metrics`` text.

    Raises :class:`MalformedMetrics` when the kept lines do not parse or when the text holds no
    Ray node metric at all (a wrong endpoint, an HTML error page).
    """
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_KEEP))
    gpu_values: dict[int, dict[str, float]] = {}
    gpu_labels: dict[int, dict[str, str]] = {}
    node_values: dict[str, float] = {}
    ip: str | None = None
    series = 0
    try:
        for family in text_string_to_metric_families(kept + "\n"):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                series += 1
                labels = sample.labels
                ip = ip or labels.get("ip")
                if sample.name in _NODE_FAMILIES:
                    node_values[sample.name] = float(sample.value)
                    continue
                index = _gpu_index(labels)
                if index is None:
                    continue
                gpu_values.setdefault(index, {})[sample.name] = float(sample.value)
                gpu_labels.setdefault(index, {}).update(labels)
    except (ValueError, TypeError, IndexError) as exc:
        raise MalformedMetrics(f"unparsable Prometheus text: {exc}") from exc
    if not series:
        raise MalformedMetrics("no Ray node metrics (ray_node_*) in the response")
    gpus = {index: _gpu(index, values, gpu_labels[index]) for index, values in gpu_values.items()}
    return NodeSample(
        gpus=dict(sorted(gpus.items())),
        memory_used_bytes=node_values.get(HOST_MEMORY_USED),
        memory_total_bytes=node_values.get(HOST_MEMORY_TOTAL),
        cpu_utilization=node_values.get(CPU_UTILIZATION),
        ip=ip,
        series=series,
    )


def _gpu_index(labels: dict[str, str]) -> int | None:
    raw = labels.get("GpuIndex")
    if raw is None:
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


def _gpu(index: int, values: dict[str, float], labels: dict[str, str]) -> GpuSample:
    utilization = values.get(GPU_UTILIZATION)
    if utilization is not None and utilization < 0:  # NVML read failed on the node
        utilization = None
    used = values.get(GPU_MEMORY_USED)
    available = values.get(GPU_MEMORY_AVAILABLE)
    total = used + available if used is not None and available is not None else None
    power = values.get(GPU_POWER)
    return GpuSample(
        index=index,
        device=labels.get("GpuDeviceName") or "unknown",
        uuid=labels.get("GpuUuid") or None,
        utilization=utilization,
        memory_used_mib=used,
        memory_total_mib=total,
        power_w=power / 1000.0 if power is not None else None,
        temperature_c=values.get(GPU_TEMPERATURE),
    )


def tracker_rows(node: int, sample: NodeSample) -> dict[str, float]:
    """NeMo RL's row names for one node: ``ray/node.{n}.gpu.{i}.util`` (percent),
    ``.mem_gb``/``.mem_total_gb`` (GiB), ``.power_w``, ``.temp_c``; ``ray/node.{n}.mem_gb``,
    ``.mem_total_gb`` (GiB) and ``.cpu_util`` (percent)."""
    rows: dict[str, float] = {}
    base = f"ray/node.{node}"
    for gpu in sample.gpus.values():
        key = f"{base}.gpu.{gpu.label}"
        if gpu.utilization is not None:
            rows[f"{key}.util"] = gpu.utilization
        if gpu.memory_used_mib is not None:
            rows[f"{key}.mem_gb"] = gpu.memory_used_mib / 1024
        if gpu.memory_total_mib is not None:
            rows[f"{key}.mem_total_gb"] = gpu.memory_total_mib / 1024
        if gpu.power_w is not None:
            rows[f"{key}.power_w"] = gpu.power_w
        if gpu.temperature_c is not None:
            rows[f"{key}.temp_c"] = gpu.temperature_c
    if sample.memory_used_bytes is not None:
        rows[f"{base}.mem_gb"] = sample.memory_used_bytes / GIB
    if sample.memory_total_bytes is not None:
        rows[f"{base}.mem_total_gb"] = sample.memory_total_bytes / GIB
    if sample.cpu_utilization is not None:
        rows[f"{base}.cpu_util"] = sample.cpu_utilization
    return rows
