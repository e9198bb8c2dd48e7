"""The verl drop-in (otel_rl.compat.verl): a verl-style training script configured only through
verl's environment variables, read back with each tracker's own reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from otel_rl import ConfigError
from otel_rl.compat.verl import Tracking, ValidationGenerationsLogger
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars

_ENV = (
    "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID", "SWANLAB_MODE", "SWANLAB_LOG_DIR", "VERL_FILE_LOGGER_PATH",
    "VERL_FILE_LOGGER_ROOT", "OTEL_RL_LOG_DIR", "WANDB_ENTITY", "WANDB_DIR",
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory and none of verl's variables set."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def f32(x: float) -> float:
    return float(np.float32(x))


def verl_metrics(step: int) -> dict:
    """What verl's PPO trainer logs each step (numpy scalars and '@' included)."""
    return {
        "actor/pg_loss": np.float32(0.5 / step),
        "critic/score/mean": 0.1 * step,
        "timing_s/gen": 1.25 * step,
        "training/global_step": step,
        "val-core/openai/gsm8k/reward/mean@1": 0.5 + step / 100,
    }


def run_verl_script(steps: range, backends: list[str]) -> None:
    tracking = Tracking(project_name="gsm8k", experiment_name="ppo-qwen",
                        default_backend=backends)
    for step in steps:
        tracking.log(data=verl_metrics(step), step=step)
    tracking.finish()


def test_env_only_configuration_tensorboard_file_and_console(workdir, monkeypatch, capsys):
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(workdir / "metrics" / "run.jsonl"))
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(workdir / "otel"))
    run_verl_script(range(1, 4), ["console", "tensorboard", "file"])

    expected = {
        key: [(s, f32(float(verl_metrics(s)[key]))) for s in range(1, 4)]
        for key in verl_metrics(1)
    }
    assert tensorboard_scalars(workdir / "tb") == expected
    rows = jsonl_rows(workdir / "metrics" / "run.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["data"] == {k: float(v) for k, v in verl_metrics(2).items()}
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step:1 - actor/pg_loss:0.5 - critic/score/mean:0.1")
    assert len([line for line in out if line.startswith("step:")]) == 3

    # A second run (a resume) appends to the file instead of truncating it, after the line
    # that says where its attempt begins.
    run_verl_script(range(4, 6), ["file"])
    rows = jsonl_rows(workdir / "metrics" / "run.jsonl")
    assert [r["step"] for r in rows if "resume" not in r] == [1, 2, 3, 4, 5]
    assert [r["resume"] for r in rows if "resume" in r] == [{"attempt": 2, "step": 4}]


def test_default_locations_follow_verl(workdir):
    run_verl_script(range(1, 3), ["tensorboard", "file"])
    tb = workdir / "tensorboard_log" / "gsm8k" / "ppo-qwen"
    assert tensorboard_scalars(tb)["timing_s/gen"] == [(1, 1.25), (2, 2.5)]
    assert [r["step"] for r in jsonl_rows(workdir / "gsm8k" / "ppo-qwen.jsonl")] == [1, 2]


def test_backend_argument_selects_trackers_and_nan_is_kept(workdir, monkeypatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(workdir / "run.jsonl"))
    with Tracking("p", "e", ["tensorboard", "file"]) as tracking:
        tracking.log({"loss": 1.0}, step=1)
        tracking.log({"tb_only": 2.0}, step=1, backend=["tensorboard"])
        tracking.log({"loss": math.nan}, step=2, backend="file")
    rows = jsonl_rows(workdir / "run.jsonl")
    assert rows == [{"step": 1, "data": {"loss": 1.0}}, {"step": 2, "data": {"loss": None}}]
    scalars = tensorboard_scalars(workdir / "tensorboard_log" / "p" / "e")
    assert scalars == {"loss": [(1, 1.0)], "tb_only": [(1, 2.0)]}


def test_unknown_backends_are_clear_errors(workdir):
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        Tracking("p", "e", ["tensorbord"])
    with pytest.raises(ConfigError, match="did you mean 'rl_insight'"):
        Tracking("p", "e", ["console", "rl_insigt"])
    with Tracking("p", "e", ["console"]) as tracking, pytest.raises(ConfigError):
        tracking.log({"x": 1.0}, step=1, backend=["consol"])


@pytest.mark.slow
def test_every_tracker_from_env_vars_with_validation_generations(workdir, monkeypatch):
    """W&B, SwanLab, MLflow and TensorBoard configured by environment variables only; metrics,
    the config, validation generations in each tracker's native form, and a crash marked
    failed."""
    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from testkit.tracker_readers import read_swanlab, read_wandb, wandb_offline_env, wandb_run_dirs

    uri = f"sqlite:///{(workdir / 'mlflow.db').as_posix()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(workdir / "swanlog"))
    monkeypatch.setenv("SWANLAB_ROOT", str(workdir / "swanlab-root"))
    wandb_offline_env(monkeypatch, workdir)
    monkeypatch.setenv("WANDB_DIR", str(workdir / "wandb-root"))
    # An MLflow run created by the platform: MLFLOW_RUN_ID attaches to it.
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("platform")
    run_id = client.create_run(experiment).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)

    backends = ["wandb", "swanlab", "mlflow", "tensorboard"]
    samples = [("What is 2+2?", "4", 1.0), ("What is 3+3?", "7", 0.0)]
    config = {"trainer": {"total_epochs": 2, "project_name": "gsm8k"}, "lr": 1e-6}
    with (
        pytest.raises(RuntimeError, match="NCCL"),
        Tracking("gsm8k", "ppo-qwen", backends, config=config) as tracking,
    ):
        generations = ValidationGenerationsLogger("gsm8k", "ppo-qwen")
        for step in (1, 2):
            tracking.log(data=verl_metrics(step), step=step)
            generations.log(backends, [(q, a, s * step) for q, a, s in samples], step)
        raise RuntimeError("NCCL timeout")

    # MLflow: metrics in the attached run, params, the samples as JSON, the run failed.
    history = sorted(client.get_metric_history(run_id, "timing_s/gen"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(1, 1.25), (2, 2.5)]
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    # verl's MLflow spelling of '@' keeps existing MLflow queries working.
    at = client.get_metric_history(run_id, "val-core/openai/gsm8k/reward/mean_at_1")
    assert sorted((m.step, m.value) for m in at) == [(1, 0.51), (2, 0.52)]
    assert run.data.params["trainer.total_epochs"] == "2"
    path = client.download_artifacts(run_id, "tables/val/generations/step_2.json",
                                     str(workdir / "dl"))
    assert json.loads(Path(path).read_text()) == {
        "columns": ["input", "output", "score"],
        "data": [["What is 2+2?", "4", 2.0], ["What is 3+3?", "7", 0.0]],
    }

    # TensorBoard: scalars and the samples as a Markdown table in the TEXT tab.
    acc = tensorboard_accumulator(workdir / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [
        (1, f32(0.1)), (2, f32(0.2))]
    texts = [(e.step, e.tensor_proto.string_val[0].decode())
             for e in acc.Tensors("val/generations")]
    assert [s for s, _ in texts] == [1, 2]
    assert "| What is 3+3? | 7 | 0.0 |" in texts[1][1]

    # W&B: verl's wide table, one row per validation step, rows accumulating.
    (run_dir,) = wandb_run_dirs(workdir / "wandb-root")
    wandb_run = read_wandb(run_dir)
    assert wandb_run.exit_code == 1
    assert wandb_run.config["lr"] == 1e-6
    tables = [r for r in wandb_run.history if "val/generations._type" in r]
    assert [r["global_step"] for r in tables] == [1, 2]
    table = json.loads((run_dir / "files" / tables[-1]["val/generations.path"]).read_text())
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2",
                                "output_2", "score_2"]
    assert table["data"] == [[1, "What is 2+2?", "4", 1.0, "What is 3+3?", "7", 0.0],
                             [2, "What is 2+2?", "4", 2.0, "What is 3+3?", "7", 0.0]]

    # SwanLab: the samples as text, the metrics, and the crash.
    (swan_dir,) = [p for p in (workdir / "swanlog").glob("run-*") if p.is_dir()]
    swan = read_swanlab(swan_dir)
    assert swan.scalars["timing_s/gen"] == [(1, 1.25), (2, 2.5)]
    assert [(s, kind) for s, kind, _ in swan.media["val/generations"]] == [
        (1, "COLUMN_TYPE_TEXT"), (2, "COLUMN_TYPE_TEXT")]
    (_, _, (filename,)) = swan.media["val/generations"][1]
    assert "| What is 2+2? | 4 | 2.0 |" in swan.media_file("text", filename).read_text()
    assert swan.finish_state == "RUN_STATE_CRASHED"
    assert swan.config["FRAMEWORK"] == "verl"


def test_two_experiments_of_one_project_keep_their_own_files(workdir, monkeypatch):
    """verl's ``file`` backend puts every experiment of a project in one folder: each keeps its
    own hyperparameters (and tables, events, plots) beside its own JSONL, never the other's."""
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(workdir / "files"))
    for name, lr in (("e1", 1e-6), ("e2", 5e-5)):
        with Tracking(project_name="p", experiment_name=name, default_backend=["file"],
                      config={"actor": {"lr": lr}}) as tracking:  # fmt: skip
            tracking.log({"loss": lr}, step=0)
    folder = workdir / "files" / "p"
    for name, lr in (("e1", 1e-6), ("e2", 5e-5)):
        params = json.loads((folder / f"{name}.hyperparams.json").read_text())
        assert params["actor.lr"] == lr
        assert [r["data"]["loss"] for r in jsonl_rows(folder / f"{name}.jsonl")] == [lr]
    assert not (folder / "hyperparams.json").exists()


def test_console_and_file_never_take_validation_generations(workdir, monkeypatch, capsys):
    """As in verl: ``ValidationGenerationsLogger.log(["console", "file", "tensorboard"], ...)``
    writes the generations to TensorBoard only; the file backend's folder gets no table."""
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(workdir / "files"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(workdir / "otel"))
    tracking = Tracking("p", "e", ["console", "file", "tensorboard"])
    tracking.log({"score": 1.0}, step=1)
    ValidationGenerationsLogger().log(["console", "file", "tensorboard"],
                                      [("prompt", "answer", 1.0)], step=1)  # fmt: skip
    tracking.finish()
    assert sorted(p.name for p in (workdir / "files" / "p").iterdir()) == ["e.jsonl"]
    assert "answer" not in capsys.readouterr().out
    texts = tensorboard_accumulator(workdir / "tb").Tags()["tensors"]
    assert any("val/generations" in tag for tag in texts)
