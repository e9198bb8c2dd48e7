"""Ray's node exposition → GPU/host values and NeMo RL row names (fixtures from Ray 2.60)."""

from __future__ import annotations

import re

import pytest

from otel_rl.ray.gpu_metrics import MalformedMetrics, parse_node_metrics, tracker_rows
from testkit.gpu_nodes import CPU_FIXTURE, H100_FIXTURE, render, simulated_node


def test_h100_fixture_values_and_units():
    sample = parse_node_metrics(H100_FIXTURE.read_text())
    assert sorted(sample.gpus) == list(range(8))
    gpu0 = sample.gpus[0]
    assert gpu0.device == "NVIDIA H100 80GB HBM3"
    assert gpu0.uuid == "GPU-3f1c2a9e-5b7d-4e21-9c0a-1d2e3f4a5b00"
    assert gpu0.utilization == 97.0
    # ray_node_gram_* are MiB: used + available is the H100's 81559 MiB, not 81559 bytes.
    assert gpu0.memory_used_mib == 71234.0
    assert gpu0.memory_total_mib == 81559.0
    assert gpu0.power_w == 612.45
    assert gpu0.temperature_c == 61.0
    assert sample.gpus[7].utilization == 94.0
    assert sample.memory_used_bytes == 4.32813966132e11
    assert sample.cpu_utilization == 38.6
    assert sample.ip == "10.0.0.12"

    rows = tracker_rows(5, sample)
    assert rows["ray/node.5.gpu.0.util"] == 97.0
    assert rows["ray/node.5.gpu.0.mem_gb"] == 71234.0 / 1024
    assert rows["ray/node.5.gpu.0.mem_total_gb"] == 81559.0 / 1024
    assert rows["ray/node.5.gpu.3.power_w"] == 587.904
    assert rows["ray/node.5.gpu.3.temp_c"] == 58.0
    assert rows["ray/node.5.mem_gb"] == 4.32813966132e11 / 2**30
    assert rows["ray/node.5.mem_total_gb"] == sample.memory_total_bytes / 2**30
    assert rows["ray/node.5.cpu_util"] == 38.6


def test_real_cpu_node_capture():
    sample = parse_node_metrics(CPU_FIXTURE.read_text())
    assert sample.gpus == {}
    # ray_node_mem_used, not ray_node_mem_used_host (1.249554432e9) which shares the prefix.
    assert sample.memory_used_bytes == 7.68192512e8
    assert sample.memory_total_bytes == 2.5276502016e10
    assert sample.cpu_utilization == 20.9
    assert set(tracker_rows(0, sample)) == {
        "ray/node.0.mem_gb",
        "ray/node.0.mem_total_gb",
        "ray/node.0.cpu_util",
    }


def test_utilization_minus_one_is_skipped_not_reported():
    node = simulated_node(2)
    node.gpus[3].utilization = -1.0
    sample = parse_node_metrics(render(node))
    assert sample.gpus[3].utilization is None
    assert sample.gpus[3].memory_used_mib == node.gpus[3].used_mib
    rows = tracker_rows(0, sample)
    assert "ray/node.0.gpu.3.util" not in rows
    assert rows["ray/node.0.gpu.2.util"] == node.gpus[2].utilization
    assert rows["ray/node.0.gpu.3.mem_gb"] == node.gpus[3].used_mib / 1024


def test_older_ray_label_sets():
    """Older Ray versions: no GpuUuid, no otel_scope_* labels, fewer node labels."""
    text = H100_FIXTURE.read_text()
    for label in (
        "GpuUuid",
        "otel_scope_name",
        "otel_scope_schema_url",
        "otel_scope_version",
        "RayNodeType",
        "IsHeadNode",
        "Version",
    ):
        text = re.sub(rf',?{label}="[^"]*"', "", text)
    text = text.replace("{,", "{")
    assert "GpuUuid" not in text and "otel_scope" not in text
    sample = parse_node_metrics(text)
    assert sorted(sample.gpus) == list(range(8))
    assert sample.gpus[0].uuid is None
    assert sample.gpus[0].device == "NVIDIA H100 80GB HBM3"
    assert sample.gpus[5].utilization == 99.0
    assert sample.gpus[5].memory_used_mib == 71266.0
    assert sample.memory_used_bytes == 4.32813966132e11


def _gpu_lines(index: int, uuid: str, name: str, util: float, used: float) -> str:
    labels = f'GpuDeviceName="{name}",GpuIndex="{index}",GpuUuid="{uuid}",ip="10.0.0.1"'
    return (
        f"ray_node_gpus_utilization{{{labels}}} {util}\n"
        f"ray_node_gram_used{{{labels}}} {used}\n"
        f"ray_node_gram_available{{{labels}}} {10000 - used}\n"
    )


def test_mig_slices_decode_parent_and_slice():
    mig = "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    text = (
        "# TYPE ray_node_gpus_utilization gauge\n# TYPE ray_node_gram_used gauge\n"
        "# TYPE ray_node_gram_available gauge\n"
        + _gpu_lines(0, "MIG-aaaa", mig, 10, 100)  # GPU 0 slice 0: index 0, a MIG UUID
        + _gpu_lines(1, "MIG-bbbb", mig, 11, 200)  # GPU 0 slice 1
        + _gpu_lines(1000, "MIG-cccc", mig, 12, 300)  # GPU 1 slice 0
        + _gpu_lines(3002, "MIG-dddd", mig, 13, 400)  # GPU 3 slice 2
    )
    sample = parse_node_metrics(text)
    decoded = {i: (g.parent, g.mig_slice, g.label) for i, g in sample.gpus.items()}
    assert decoded == {
        0: (0, 0, "0.mig.0"),
        1: (0, 1, "0.mig.1"),
        1000: (1, 0, "1.mig.0"),
        3002: (3, 2, "3.mig.2"),
    }
    rows = tracker_rows(4, sample)
    assert rows["ray/node.4.gpu.3.mig.2.util"] == 13.0
    assert rows["ray/node.4.gpu.1.mig.0.mem_gb"] == 300 / 1024
    assert rows["ray/node.4.gpu.0.mig.1.mem_total_gb"] == 10000 / 1024


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'ray_node_mem_used{ip="1.2.3.4" 12\n',
        '# TYPE ray_node_mem_used gauge\nray_node_mem_used{ip="1"} twelve\n',
        "",
    ],
)
def test_malformed_or_foreign_text_is_an_error(text):
    with pytest.raises(MalformedMetrics):
        parse_node_metrics(text)
