"""Every tracker enabled in one Logger run holds identical data, each read back with its own
reader: W&B offline, SwanLab offline, Trackio's SQLite store, MLflow's client on its local SQLite
store, TensorBoard's EventAccumulator, and the JSONL file."""

from __future__ import annotations

import math
import uuid
from typing import Any

import numpy as np
import pytest

from otel_rl import Logger
from otel_rl.core.records import StepBatch
from testkit.readers import jsonl_rows, tensorboard_accumulator
from testkit.tracker_readers import (
    read_swanlab,
    read_trackio,
    read_wandb,
    swanlab_run_dirs,
    wandb_run_dirs,
)

for _module in ("wandb", "swanlab", "trackio"):
    pytest.importorskip(_module)

Rows = dict[float, dict[str, Any]]


def _same(value: Any) -> Any:
    """NaN compares equal to itself here; trackers spell non-finite numbers differently."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        value = float(value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return float(value) if isinstance(value, (int, float)) else value


def _rows(pairs: list[tuple[float, dict[str, Any]]]) -> Rows:
    out: Rows = {}
    for step, row in pairs:
        out.setdefault(float(step), {}).update({k: _same(v) for k, v in row.items()})
    return out


@pytest.mark.slow
def test_identical_rows_in_every_tracker(offline_trackers, tmp_path):
    log_dir = tmp_path / "logs"
    project = f"otel-rl-tests-{uuid.uuid4().hex[:8]}"
    cfg = {
        "log_dir": str(log_dir),
        "jsonl_enabled": True,
        "wandb_enabled": True,
        "wandb": {"project": project, "name": "together"},
        "swanlab_enabled": True,
        "swanlab": {"project": project, "name": "together", "mode": "offline"},
        "trackio_enabled": True,
        "trackio": {"project": project, "name": "together", "auto_log_cpu": False},
        "tensorboard_enabled": True,
        "mlflow_enabled": True,
        "mlflow": {"experiment_name": project, "run_name": "together"},
    }
    with Logger(cfg) as logger:
        logger.log_hyperparams({"optimizer": {"lr": 1e-5}, "group_size": 8, "algo": "grpo"})
        for step in range(5):
            with logger.timer("generation"):
                pass
            logger.log_metrics(
                {
                    "loss": 0.5 / (step + 1),
                    "reward/mean": step - 2.5,
                    "kl": math.nan if step == 3 else 0.01 * step,
                    "sample": f"step {step}: 42",
                },
                step=step,
                prefix="train",
            )
            if step in (1, 3):
                gpu = StepBatch(
                    step=10 * step,
                    values={"ray/node.n1.gpu.0.util": 40.0 + step, "ray/node.n1.mem_gb": 3.5},
                    axis="ray/ray_step",
                )
                for exporter in logger.exporters:
                    exporter.submit(gpu)
        exporters = {e.name: e for e in logger.exporters}
    assert {n: e.stats["delivered"] for n, e in exporters.items()} == {
        "jsonl": 10, "wandb": 10, "swanlab": 10, "trackio": 10, "tensorboard": 10, "mlflow": 10
    }  # 5 steps + 2 GPU rows + hyperparams + the run's timeline page and time table at the end

    # JSONL is the reference: what the Logger handed every tracker.
    jsonl = jsonl_rows(log_dir / "metrics.jsonl")
    training = _rows([(r["step"], r["metrics"]) for r in jsonl if "axis" not in r])
    gpu_rows = _rows([(r["step"], r["metrics"]) for r in jsonl if r.get("axis")])
    for step, row in gpu_rows.items():  # the trackers also store the axis value in the row
        row["ray/ray_step"] = step
    assert sorted(training) == [0.0, 1.0, 2.0, 3.0, 4.0] and sorted(gpu_rows) == [10.0, 30.0]
    assert training[3.0]["train/kl"] == "nan"
    assert training[2.0]["train/sample"] == "step 2: 42"
    assert "timing/generation" in training[4.0]
    config = {"optimizer.lr": 1e-5, "group_size": 8, "algo": "grpo"}

    wb = read_wandb(wandb_run_dirs(log_dir)[0])
    internal = ("_step", "_runtime", "_timestamp", "global_step")
    # the run's timeline panel and time table, at the last step (docs/timeline.md)
    pictures = ("otel_rl/timeline.", "otel_rl/run_time.")

    def strip(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in internal and not k.startswith(pictures)}

    assert _rows([(r["global_step"], strip(r)) for r in wb.history if "global_step" in r]) == (
        training
    )
    assert _rows([(r["ray/ray_step"], strip(r)) for r in wb.history if "ray/ray_step" in r]) == (
        gpu_rows
    )
    assert wb.config == config

    sl = read_swanlab(swanlab_run_dirs(log_dir / "swanlab")[0])
    sl_pairs = [(s, {k: v}) for k, series in sl.scalars.items() for s, v in series]
    sl_pairs += [
        (s, {k: sl.media_file("text", f).read_text()})
        for k, items in sl.media.items()
        if not k.startswith("otel_rl/")  # the run's timeline image
        for s, _, (f,) in items
    ]
    sl_rows = _rows(sl_pairs)
    assert {s: sl_rows[s] for s in training} == training
    assert {s: sl_rows[s] for s in gpu_rows} == gpu_rows
    assert set(sl_rows) == set(training) | set(gpu_rows)
    assert sl.config == config

    tk_rows, tk_config = read_trackio(project, "together")
    meta = ("step", "timestamp")
    tk = [(r["step"], {k: v for k, v in r.items()
                       if k not in meta and k not in ("otel_rl/timeline", "otel_rl/run_time")})
          for r in tk_rows]  # fmt: skip
    assert _rows([p for p in tk if "ray/ray_step" not in p[1]]) == training
    assert _rows([p for p in tk if "ray/ray_step" in p[1]]) == gpu_rows
    assert tk_config == config

    # TensorBoard: scalars as float32, text through the text plugin; GPU rows at their seconds.
    acc = tensorboard_accumulator(log_dir / "tensorboard")
    tb = {tag: {float(e.step): e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for step, row in {**training, **gpu_rows}.items():
        for key, value in row.items():
            if key == "ray/ray_step":
                continue
            if value == "nan":
                assert math.isnan(tb[key][step])
            elif isinstance(value, float):
                assert tb[key][step] == float(np.float32(value)), (key, step)
            else:
                (text,) = [e for e in acc.Tensors(key) if e.step == step]
                assert text.tensor_proto.string_val[0].decode() == value

    # MLflow: every number at its step (NaN stays NaN), from its own client.
    from mlflow.tracking import MlflowClient

    mlflow_exporter = exporters["mlflow"].tracker
    client = MlflowClient(mlflow_exporter.tracking_uri)
    for step, row in training.items():
        for key, value in row.items():
            if not isinstance(value, float) and value != "nan":
                continue  # text goes to artifacts (tests/exporters/test_mlflow.py)
            history = {m.step: m.value for m in client.get_metric_history(
                mlflow_exporter.run_id, key)}
            assert _same(history[int(step)]) == value, (key, step)
    assert client.get_run(mlflow_exporter.run_id).data.params["optimizer.lr"] == "1e-05"
