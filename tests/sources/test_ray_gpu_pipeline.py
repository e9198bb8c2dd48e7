"""GPU data through the Logger: tracker rows on their own axis, OTel gauges on Prometheus, CLI."""

from __future__ import annotations

import importlib.util
import logging
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_rl import ConfigError, Logger
from otel_rl.cli.main import main
from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node
from testkit.readers import jsonl_rows, tensorboard_scalars

TEMPLATE = H100_FIXTURE.read_text()
HAVE_WANDB = (
    importlib.util.find_spec("otel_rl.exporters.wandb") is not None
    and importlib.util.find_spec("wandb") is not None
)


@pytest.fixture
def farm():
    with NodeFarm() as nodes:
        yield nodes


def f32(x: float) -> float:
    return float(np.float32(x))


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_training_rows_keep_their_steps_while_gpu_rows_use_the_time_axis(farm, log_dir):
    nodes = [simulated_node(k) for k in (7, 8)]
    urls = [farm.add(render(node, TEMPLATE)) for node in nodes]
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "jsonl_enabled": True,
        "monitor_gpus": True,
        "gpu_monitoring": {
            "endpoints": urls,
            "collection_interval": 0.2,
            "flush_interval": 0.5,
            "timeout": 1.0,
        },
    }
    if HAVE_WANDB:
        cfg["wandb_enabled"] = True
        cfg["wandb"] = {"mode": "offline", "project": "gpu-axis"}
    steps = 40
    with Logger(cfg) as logger:
        for step in range(steps):
            logger.log_metrics({"loss": 1.0 / (step + 1), "reward": step * 0.5}, step, "train")
            time.sleep(0.05)
    # Read once the run is finished (a round can still complete before the close), and counted as
    # rows: a round in which no node answered in time (a loaded machine) writes no row.
    collections = logger.gpu_monitor.stats["rows"]
    assert collections >= 5

    expected_loss = {s: 1.0 / (s + 1) for s in range(steps)}
    gpu_key = "ray/node.1.gpu.6.util"  # node id 1 = second endpoint = simulated node 8
    gpu_value = nodes[1].gpus[6].utilization

    # JSONL: every training step once, at its own step; GPU lines marked with their axis.
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    training = [r for r in rows if "axis" not in r]
    gpu = [r for r in rows if r.get("axis") == "ray/ray_step"]
    assert [r["step"] for r in training] == list(range(steps))
    assert {r["step"]: r["metrics"]["train/loss"] for r in training} == expected_loss
    assert not any(k.startswith("ray/") for r in training for k in r["metrics"])
    assert len(gpu) == collections
    axis = [r["metrics"]["ray/ray_step"] for r in gpu]
    assert axis == sorted(axis) and axis[-1] > axis[0]
    assert [r["step"] for r in gpu] == [int(a) for a in axis]
    assert all(r["metrics"][gpu_key] == gpu_value for r in gpu)
    assert all(
        r["metrics"]["ray/node.0.gpu.2.mem_gb"] == nodes[0].gpus[2].used_mib / 1024 for r in gpu
    )
    assert all(r["metrics"]["ray/node.1.mem_gb"] == nodes[1].mem_used / 2**30 for r in gpu)
    # The device name is sent once per GPU, as text.
    devices = [r["metrics"].get("ray/node.0.gpu.0.device") for r in gpu]
    assert devices[0] == "NVIDIA H100 80GB HBM3" and devices[1:] == [None] * (len(gpu) - 1)

    # TensorBoard: training tags hold exactly the training steps; GPU tags are at seconds.
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["train/loss"] == [(s, f32(expected_loss[s])) for s in range(steps)]
    assert [s for s, _ in scalars["train/reward"]] == list(range(steps))
    assert [s for s, _ in scalars[gpu_key]] == [int(a) for a in axis]
    assert {v for _, v in scalars[gpu_key]} == {f32(gpu_value)}

    if HAVE_WANDB:
        from testkit.tracker_readers import read_wandb, wandb_run_dirs

        (run_dir,) = wandb_run_dirs(log_dir)
        run = read_wandb(run_dir)
        loss = run.series("train/loss")
        assert [(int(s), v) for s, v in loss] == [(s, expected_loss[s]) for s in range(steps)]
        util = run.series(gpu_key, axis="ray/ray_step")
        assert [a for a, _ in util] == axis
        assert {v for _, v in util} == {gpu_value}
        assert run.metrics.get(gpu_key) == "ray/ray_step"


def test_gpu_gauges_reach_prometheus_with_attributes(farm, log_dir):
    node = simulated_node(4)
    url = farm.add(render(node, TEMPLATE))
    dead = farm.add(mode="refused")
    cfg = {
        "log_dir": str(log_dir),
        "jsonl_enabled": False,
        "monitor_gpus": True,
        "gpu_monitoring": {"endpoints": [url, dead], "collection_interval": 0.2, "timeout": 1.0},
        "prometheus": {"enabled": True, "port": 0},
    }
    with Logger(cfg) as logger:
        _wait_for(lambda: logger.gpu_monitor.scraper.last is not None)
        with urllib.request.urlopen(logger.prometheus_url, timeout=10) as response:
            text = response.read().decode()

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)

    def value(name: str, **labels: str) -> float:
        (match,) = [
            s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return match.value

    util = next(n for n in samples if n.startswith("ray_node_gpu_utilization"))
    assert len(samples[util]) == 8
    gpu5 = {"node": "0", "gpu": "5", "device": "NVIDIA H100 80GB HBM3", "host": "127.0.0.1"}
    assert value(util, **gpu5) == node.gpus[5].utilization
    used = next(n for n in samples if n.startswith("ray_node_gpu_memory_used"))
    assert value(used, **gpu5) == node.gpus[5].used_mib * 2**20  # bytes on the OTel side
    power = next(n for n in samples if n.startswith("ray_node_gpu_power"))
    assert value(power, **gpu5) == node.gpus[5].power_mw / 1000
    host = next(n for n in samples if n.startswith("ray_node_memory_used"))
    assert value(host, node="0") == node.mem_used
    errors = next(n for n in samples if n.startswith("otel_rl_scrape_errors") and "total" in n)
    assert value(errors, node="1", reason="refused") >= 1
    nodes = next(n for n in samples if n.startswith("otel_rl_scrape_nodes"))
    assert value(nodes, state="ok") == 1 and value(nodes, state="failed") == 1
    series = next(n for n in samples if n.startswith("otel_rl_scrape_series"))
    assert value(series) == 43  # 5 GPU families x 8 GPUs + 3 host values
    assert any(n.startswith("otel_rl_scrape_duration") for n in samples)


def test_a_gpu_reading_that_is_not_finite_is_no_observation_and_no_log_line(farm, log_dir, caplog):
    """A node whose page says NaN for one GPU's utilization and +Inf for another's power: the
    OTel gauges leave those two readings out (the SDK said so at every scrape, forever), the
    other GPUs' are served."""
    import re

    node = simulated_node(4)
    page = render(node, TEMPLATE)
    for family, gpu, value in (("gpus_utilization", 0, "NaN"), ("gpu_power_milliwatts", 1, "+Inf")):
        line = rf'(ray_node_{family}\{{[^}}]*GpuIndex="{gpu}"[^}}]*\}}) \S+'
        page = re.sub(line, rf"\1 {value}", page)
    url = farm.add(page)
    cfg = {
        "log_dir": str(log_dir), "jsonl_enabled": False, "monitor_gpus": True,
        "gpu_monitoring": {"endpoints": [url], "collection_interval": 0.2, "timeout": 1.0},
        "prometheus": {"enabled": True, "port": 0},
    }  # fmt: skip
    with caplog.at_level(logging.DEBUG), Logger(cfg) as logger:
        _wait_for(lambda: logger.gpu_monitor.scraper.last is not None)
        texts = []
        for _ in range(3):
            with urllib.request.urlopen(logger.prometheus_url, timeout=10) as response:
                texts.append(response.read().decode())
    assert not [r for r in caplog.records if "non-finite" in r.getMessage()]
    for text in texts:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        util = {s.labels["gpu"]: s.value for s in samples
                if s.name.startswith("ray_node_gpu_utilization")}  # fmt: skip
        power = {s.labels["gpu"]: s.value for s in samples
                 if s.name.startswith("ray_node_gpu_power")}  # fmt: skip
        assert sorted(util) == [str(g) for g in range(1, 8)]
        assert sorted(power) == ["0", *[str(g) for g in range(2, 8)]]
        assert util["5"] == node.gpus[5].utilization


def test_cli_gpu_monitor_once_with_no_node_answering_exits_1(farm, capsys):
    """docs/gpu-monitoring.md: ``--once`` exits 0 when it got an answer, 1 when it got none; a
    round in which every node refused is no answer (the table still says why)."""
    refused = farm.add(mode="refused")
    assert main(["gpu-monitor", "--endpoint", refused, "--once", "--timeout", "2"]) == 1
    assert "0/1 nodes answered" in capsys.readouterr().out


def test_cli_gpu_monitor_prints_a_table(farm, capsys):
    node = simulated_node(12)
    url = farm.add(render(node, TEMPLATE))
    refused = farm.add(mode="refused")
    assert main(["gpu-monitor", "--endpoint", url, "--endpoint", refused, "--once"]) == 0
    out = capsys.readouterr().out
    cells = [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    ]
    node_rows = {row[0]: row for row in cells if len(row) == 6}
    gpu_rows = {row[1]: row for row in cells if len(row) == 7}
    gpu = node.gpus[3]
    assert gpu_rows["3"] == [
        "0",
        "3",
        "NVIDIA H100 80GB HBM3",
        f"{gpu.utilization:.0f}",
        f"{gpu.used_mib / 1024:.1f} / {(gpu.used_mib + gpu.available_mib) / 1024:.1f}",
        f"{gpu.power_mw / 1000:.0f}",
        f"{gpu.temperature_c:.0f}",
    ]
    assert sorted(gpu_rows) == [str(i) for i in range(8)]
    assert node_rows["0"][2] == "ok"
    assert node_rows["0"][4] == f"{node.mem_used / 2**30:.1f} / {node.mem_total / 2**30:.1f}"
    assert node_rows["1"][2].startswith("refused")


def test_bad_endpoint_is_a_config_error(log_dir):
    with pytest.raises(ConfigError, match=r"gpu_monitoring\.endpoints"):
        Logger(
            {
                "log_dir": str(log_dir),
                "monitor_gpus": True,
                "gpu_monitoring": {"endpoints": ["http://"]},
            }
        )


def test_ray_not_initialized_is_warned_once_and_retried(log_dir, caplog):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("needs a process without a Ray connection")
    caplog.set_level(logging.WARNING, logger="otel_rl")
    cfg = {
        "log_dir": str(log_dir),
        "monitor_gpus": True,
        "gpu_monitoring": {"collection_interval": 0.1},
    }
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 1.0}, step=0)
        _wait_for(lambda: logger.gpu_monitor.scraper.stats["collections"] >= 5, timeout=30)
    warnings = [r.getMessage() for r in caplog.records if "not initialized" in r.getMessage()]
    assert len(warnings) == 1
    assert "gpu_monitoring.endpoints" in warnings[0]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    (row,) = rows
    assert row == {
        "step": 0,
        "time": row["time"],
        "run_id": logger.run_id,
        "attempt": 1,
        "metrics": {"loss": 1.0},
    }


def test_cli_gpu_monitor_pushes_the_gauges_over_otlp(farm, capsys):
    from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of

    node = simulated_node(21)
    url = farm.add(render(node, TEMPLATE))
    receiver = OtlpHttpReceiver()
    try:
        assert main(["gpu-monitor", "--endpoint", url, "--otlp", receiver.endpoint, "--once"]) == 0
        assert receiver.wait_for(1, timeout=10)
        points = {
            (name, tuple(sorted(attributes_of(p.attributes).items()))): p.as_double
            for _, name, _, p in receiver.points()
            if name.startswith("ray.node.")
        }
    finally:
        receiver.close()
    gpu2 = (("device", "NVIDIA H100 80GB HBM3"), ("gpu", 2), ("host", "127.0.0.1"), ("node", 0))
    assert points[("ray.node.gpu.utilization", gpu2)] == node.gpus[2].utilization
    assert points[("ray.node.gpu.temperature", gpu2)] == node.gpus[2].temperature_c
    assert points[("ray.node.gpu.memory.total", gpu2)] == 81_559 * 2**20
    host = (("host", "127.0.0.1"), ("node", 0))
    assert points[("ray.node.memory.used", host)] == node.mem_used
    assert points[("ray.node.cpu.utilization", host)] == node.cpu_util
