"""Values that arrive late: logged for a step a tracker has already committed (verl's final
validation after the last training step, NeMo RL's validation at the step ``step_finished=True``
closed) or for an earlier step. Each tracker is read back from its own storage: TensorBoard with
its EventAccumulator, the JSONL file, MLflow's client on its local SQLite store, W&B's offline
run with W&B's own decoder, SwanLab's offline file with its reader, Trackio's SQLite store."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from otel_rl import Logger
from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.tracker_readers import (
    read_swanlab,
    read_trackio,
    read_wandb,
    swanlab_run_dirs,
    wandb_run_dirs,
)

for _module in ("wandb", "swanlab", "trackio", "mlflow"):
    pytest.importorskip(_module)


@pytest.fixture(autouse=True)
def _mlflow_local_store(monkeypatch):
    """MLflow's default local store under ``log_dir``, whatever the environment names."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _every_tracker(log_dir: Path, project: str) -> dict[str, Any]:
    return {
        "log_dir": str(log_dir),
        "jsonl_enabled": True,
        "tensorboard_enabled": True,
        "wandb_enabled": True,
        "wandb": {"project": project, "name": "late"},
        "swanlab_enabled": True,
        "swanlab": {"project": project, "name": "late", "mode": "offline"},
        "trackio_enabled": True,
        "trackio": {"project": project, "name": "late", "auto_log_cpu": False},
        "mlflow_enabled": True,
        "mlflow": {"experiment_name": project, "run_name": "late"},
    }


@pytest.mark.slow
def test_a_value_logged_after_its_step_finished_reaches_every_tracker_at_that_step(
    offline_trackers, tmp_path
):
    log_dir = tmp_path / "logs"
    project = f"otel-rl-late-{uuid.uuid4().hex[:8]}"
    with Logger(_every_tracker(log_dir, project)) as logger:
        for step in (598, 599, 600):
            logger.log_metrics({"train/loss": step / 1000}, step=step, step_finished=True)
        logger.log_metrics({"val/score": 0.7}, step=600)  # the final validation, after the step
        logger.log_metrics({"val/early": 0.5}, step=599)  # and one for a step before it
        exporters = {e.name: e for e in logger.exporters}
    assert {name: e.stats["delivered"] for name, e in exporters.items()} == dict.fromkeys(
        ("jsonl", "tensorboard", "wandb", "swanlab", "trackio", "mlflow"), 5
    )
    assert all(e.stats["dropped"] == e.stats["rejected"] == 0 for e in exporters.values())
    loss = [(598, 0.598), (599, 0.599), (600, 0.6)]
    want = {"train/loss": loss, "val/score": [(600, 0.7)], "val/early": [(599, 0.5)]}

    jsonl = [(r["step"], r["metrics"]) for r in jsonl_rows(log_dir / "metrics.jsonl")]
    assert {k: [(s, m[k]) for s, m in jsonl if k in m] for k in want} == want

    tensorboard = tensorboard_scalars(log_dir / "tensorboard")
    assert {k: [(s, pytest.approx(v)) for s, v in tensorboard[k]] for k in want} == want

    from mlflow.tracking import MlflowClient

    mlflow = exporters["mlflow"].tracker
    client = MlflowClient(mlflow.tracking_uri)
    assert {
        k: sorted((m.step, m.value) for m in client.get_metric_history(mlflow.run_id, k))
        for k in want
    } == want

    (wandb_dir,) = wandb_run_dirs(log_dir)
    wandb = read_wandb(wandb_dir)
    assert {k: wandb.series(k) for k in want} == want

    (swanlab_dir,) = swanlab_run_dirs(log_dir / "swanlab")
    swanlab = read_swanlab(swanlab_dir)
    assert {k: swanlab.scalars[k] for k in want} == want

    rows, _ = read_trackio(project, "late")
    assert {k: [(int(r["step"]), r[k]) for r in rows if k in r] for k in want} == want


@pytest.mark.slow
def test_nemo_rl_drop_in_delivers_a_validation_logged_after_step_finished(
    offline_trackers, tmp_path
):
    """NeMo RL's pattern through its drop-in: W&B's run gets the late value at its step."""
    from otel_rl.compat.nemo_rl import Logger as NemoLogger

    log_dir = tmp_path / "logs"
    logger = NemoLogger({
        "log_dir": str(log_dir), "wandb_enabled": True, "tensorboard_enabled": True,
        "mlflow_enabled": False, "swanlab_enabled": False, "monitor_gpus": False,
        "wandb": {"project": "otel-rl-late", "name": "nemo"},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    })  # fmt: skip
    logger.log_metrics({"loss": 0.25}, 600, prefix="train", step_finished=True)
    logger.log_metrics({"accuracy": 0.75}, 600, prefix="validation")
    logger.finish()

    wandb = read_wandb(wandb_run_dirs(log_dir)[0])
    assert wandb.series("train/loss") == [(600, 0.25)]
    assert wandb.series("validation/accuracy") == [(600, 0.75)]
    tensorboard = tensorboard_scalars(log_dir / "tensorboard")
    assert tensorboard["validation/accuracy"] == [(600, 0.75)]


@pytest.mark.slow
def test_verl_drop_in_delivers_the_final_validation_after_the_last_step(
    offline_trackers, tmp_path, monkeypatch
):
    """verl's trainer logs the final validation after the last training step's ``log``, and a
    late value for the step before it reaches W&B, TensorBoard and verl's file at their step."""
    from otel_rl.compat.verl import Tracking

    for name in ("TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", "OTEL_RL_LOG_DIR", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    with Tracking("gsm8k", "late", ["wandb", "tensorboard", "file"]) as tracking:
        tracking.log({"actor/pg_loss": 0.5}, step=599)
        tracking.log({"actor/pg_loss": 0.25}, step=600)
        tracking.log({"val-core/reward/mean@1": 0.7}, step=600)
        tracking.log({"val-aux/early": 0.5}, step=599)
    want = {
        "actor/pg_loss": [(599, 0.5), (600, 0.25)],
        "val-core/reward/mean@1": [(600, 0.7)],
        "val-aux/early": [(599, 0.5)],
    }
    (run_dir,) = wandb_run_dirs(tmp_path / "otel_rl_logs" / "gsm8k" / "late")
    wandb = read_wandb(run_dir)
    assert {k: wandb.series(k) for k in want} == want
    tensorboard = tensorboard_scalars(tmp_path / "tensorboard_log" / "gsm8k" / "late")
    assert {k: [(s, pytest.approx(v)) for s, v in tensorboard[k]] for k in want} == want
    rows = jsonl_rows(tmp_path / "gsm8k" / "late.jsonl")
    assert [(r["step"], r["data"]) for r in rows] == [
        (599, {"actor/pg_loss": 0.5}),
        (600, {"actor/pg_loss": 0.25}),
        (600, {"val-core/reward/mean@1": 0.7}),
        (599, {"val-aux/early": 0.5}),
    ]


@pytest.mark.slow
def test_nemo_wandb_logger_reports_the_values_w_and_b_would_drop(
    offline_trackers, tmp_path, monkeypatch, otel_rl_warnings
):
    """NeMo RL's own ``WandbLogger`` passes ``step=`` to W&B, which drops a value logged below
    its step without an error: such a value is reported by name, step and reason."""
    from otel_rl.compat.nemo_backends import WandbLogger

    monkeypatch.chdir(tmp_path)  # no git repository: the code and diffs are not saved
    backend = WandbLogger({"project": "otel-rl-late", "name": "nemo-backend", "mode": "offline"},
                          log_dir=str(tmp_path / "out"))  # fmt: skip
    backend.log_metrics({"loss": 0.5}, 599, prefix="train", step_finished=True)
    backend.log_metrics({"accuracy": 0.6}, 600, prefix="validation")  # before the step ends
    backend.log_metrics({"loss": 0.25}, 600, prefix="train", step_finished=True)
    backend.log_metrics({"accuracy": 0.75}, 600, prefix="validation")  # after it: too late
    backend.log_metrics({"accuracy": 0.8}, 600, prefix="validation")  # counted, said once
    backend.log_histogram([1.0, 2.0], 598, "adv")
    backend.finish()

    warnings = [r.getMessage() for r in otel_rl_warnings.records]
    said = [m for m in warnings if "W&B cannot store" in m]
    assert len(said) == 2, warnings
    assert "'validation/accuracy' at step 600: the run is already at step 601" in said[0]
    assert "'adv' at step 598: the run is already at step 601" in said[1]
    assert backend.late_values == {"validation/accuracy": 2, "adv": 1}

    run = read_wandb(wandb_run_dirs(tmp_path / "out")[0])
    assert run.series("train/loss", axis="_step") == [(599, 0.5), (600, 0.25)]
    # What W&B stored: only the value logged while step 600 was open.
    assert run.series("validation/accuracy", axis="_step") == [(600, 0.6)]


@pytest.mark.slow
def test_nemo_wandb_logger_follows_w_and_b_s_step(
    offline_trackers, tmp_path, monkeypatch, otel_rl_warnings
):
    """No report for what W&B keeps: a step ahead, the open step, ``step_metric`` rows."""
    from otel_rl.compat.nemo_backends import WandbLogger

    monkeypatch.chdir(tmp_path)
    backend = WandbLogger({"project": "otel-rl-late", "mode": "offline"},
                          log_dir=str(tmp_path / "out"))  # fmt: skip
    try:
        backend.log_metrics({"loss": 1.0}, 3)
        backend.log_metrics({"kl": 0.1}, 3)  # the open step
        backend.log_metrics({"node.0.util": 50.0, "ray/ray_step": 1}, 2, prefix="ray",
                            step_metric="ray/ray_step")  # fmt: skip
        backend.log_metrics({"loss": 0.5}, 3, step_finished=True)
        assert backend.late_values == {}
        backend.log_metrics({"loss": 0.4}, 3)
        assert backend.late_values == {"loss": 1}
    finally:
        backend.finish()
    assert logging.WARNING in {r.levelno for r in otel_rl_warnings.records}


def test_swanlab_names_each_value_it_would_discard_and_stores_the_rest(
    offline_trackers, tmp_path, otel_rl_warnings
):
    """SwanLab keeps the first value of a key at a step and discards later ones in silence: a
    late value of a key that already has one there is not sent but named; a late value of a new
    key at that step, or of a step the key has no value at, is stored."""
    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "jsonl_enabled": False, "swanlab_enabled": True,
           "swanlab": {"project": "otel-rl-late", "mode": "offline"}}  # fmt: skip
    with Logger(cfg) as logger:
        for step in (9, 10):
            logger.log_metrics({"loss": step / 10, "kl": step / 100}, step=step,
                               step_finished=True)  # fmt: skip
        logger.log_metrics({"loss": 0.5, "score": 0.7}, step=10)  # loss repeats, score is new
        logger.log_metrics({"loss": 0.4, "kl": 0.3}, step=9)
        (exporter,) = logger.exporters
    assert exporter.tracker.refused_repeats == {"loss": 2, "kl": 1}
    said = [m for m in (r.getMessage() for r in otel_rl_warnings.records)
            if "not sent: SwanLab keeps" in m]  # fmt: skip
    assert len(said) == 2, said
    assert "swanlab: 'loss' at step 10 not sent: SwanLab keeps the first value" in said[0]
    assert "swanlab: 'kl' at step 9 not sent: SwanLab keeps" in said[1]

    run = read_swanlab(swanlab_run_dirs(log_dir / "swanlab")[0])
    assert run.scalars["loss"] == [(9, 0.9), (10, 1.0)]
    assert run.scalars["kl"] == [(9, 0.09), (10, 0.1)]
    assert run.scalars["score"] == [(10, 0.7)]


def test_nemo_swanlab_logger_reports_the_values_swanlab_would_discard(
    offline_trackers, tmp_path, otel_rl_warnings
):
    """NeMo RL's own ``SwanlabLogger`` logs at ``step=``: a validation new at the step is
    stored, a value of a key that already has one at that step (SwanLab would keep the first
    and discard this one without an error) is reported by name and counted."""
    from otel_rl.compat.nemo_backends import SwanlabLogger

    backend = SwanlabLogger(
        {"project": "otel-rl-late", "mode": "offline"}, log_dir=str(tmp_path / "swan")
    )
    backend.log_metrics({"loss": 0.5}, 600, prefix="train", step_finished=True)
    backend.log_metrics({"accuracy": 0.75}, 600, prefix="validation")  # new at 600: stored
    backend.log_metrics({"loss": 0.4, "kl": 0.1}, 600, prefix="train")  # loss repeats
    backend.log_metrics({"loss": 0.3}, 600, prefix="train")
    backend.finish()

    said = [m for m in (r.getMessage() for r in otel_rl_warnings.records) if "SwanlabLogger" in m]
    assert len(said) == 1, said
    assert "'train/loss' at step 600 not logged: SwanLab keeps the first value" in said[0]
    assert backend.late_values == {"train/loss": 2}
    run = read_swanlab(swanlab_run_dirs(tmp_path / "swan")[0])
    assert run.scalars["train/loss"] == [(600, 0.5)]
    assert run.scalars["train/kl"] == [(600, 0.1)]
    assert run.scalars["validation/accuracy"] == [(600, 0.75)]
