"""verl's whole tracking surface: every backend of verl 0.9's ``Tracking.supported_backend``
(``clearml``, ``vemlp_wandb``, ``rl_insight`` and ``file`` here, next to test_compat_verl.py),
its ``FileLogger`` and ``ClearMLLogger`` classes, and ``log_generations_to_clearml``. Each
backend's output is read back from its own storage: ClearML's offline session, the file
backend's file, TensorBoard's event files with TensorBoard's reader, a W&B offline run with W&B's
decoder, the Prometheus page with Prometheus's parser, the console captured."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

pytest.importorskip("clearml")
pytest.importorskip("omegaconf")

from omegaconf import OmegaConf

from otel_rl.compat.verl import (
    ClearMLLogger,
    DapoFilteredRewardTableLogger,
    FileLogger,
    Tracking,
    ValidationGenerationsLogger,
)
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars
from tests.compat.test_compat_config_reach import prometheus_samples
from tests.exporters.test_clearml_exporter import read_clearml, table_of

#: ``Tracking.supported_backend`` of verl 0.9 (verl/utils/tracking.py), in its order.
VERL_BACKENDS = [
    "wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio",
    "file", "rl_insight",
]  # fmt: skip
SAMPLES = [("What is 2+2?", "4", 1.0), ("What is 3+3?", "7", 0.0)]
_ENV = (
    "TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "OTEL_RL_LOG_DIR",
    "WANDB_ENTITY", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID",
)  # fmt: skip


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory, none of verl's variables set, ClearML offline with its
    sessions under ``<tmp>/clearml``."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def f32(x: float) -> float:
    return float(np.float32(x))


def verl_metrics(step: int) -> dict:
    """What verl's PPO trainer logs each step (numpy scalars included)."""
    return {
        "actor/pg_loss": np.float32(0.5 / step),
        "critic/score/mean": 0.1 * step,
        "timing_s/gen": 1.25 * step,
        "training/global_step": step,
    }


def verl_config(backends: list[str]):
    """verl's Hydra config as verl hands it to Tracking: an OmegaConf DictConfig."""
    return OmegaConf.create({
        "trainer": {
            "project_name": "gsm8k", "experiment_name": "ppo-${trainer.project_name}",
            "logger": backends, "total_epochs": 2,
        },
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}},
    })  # fmt: skip


def test_supported_backends_are_verls():
    assert Tracking.supported_backend == VERL_BACKENDS


def test_console_clearml_file_tensorboard_from_a_verl_config(workdir, monkeypatch, capsys):
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(workdir / "metrics" / "run.jsonl"))
    config = verl_config(["console", "clearml", "file", "tensorboard"])
    trainer = config.trainer
    tracking = Tracking(project_name=trainer.project_name, experiment_name=trainer.experiment_name,
                        default_backend=trainer.logger, config=config)  # fmt: skip
    assert tracking.backends == ["console", "clearml", "file", "tensorboard"]
    generations = ValidationGenerationsLogger(trainer.project_name, trainer.experiment_name)
    for step in (1, 2, 3):
        tracking.log(data=verl_metrics(step), step=step)
    generations.log(trainer.logger, SAMPLES, 3)
    tracking.finish()

    expected = {key: [(s, float(verl_metrics(s)[key])) for s in (1, 2, 3)]
                for key in verl_metrics(1)}  # fmt: skip
    # ClearML: title and series split at the first "/", the config as parameters, the
    # generations as verl's table (step, input, output, score).
    session = read_clearml(workdir / "clearml", "ppo-gsm8k")
    assert session.project == "gsm8k"
    assert session.scalars == {tuple(k.split("/", 1)): v for k, v in expected.items()}
    assert session.parameters["General"]["actor_rollout_ref.actor.optim.lr"] == "1e-06"
    assert session.parameters["General"]["trainer.experiment_name"] == "ppo-gsm8k"
    ((step, table),) = session.plots[("val", "generations")]
    assert step == 3
    assert table_of(table) == (
        ["step", "input", "output", "score"],
        [[3, "What is 2+2?", "4", 1.0], [3, "What is 3+3?", "7", 0.0]],
    )
    # file: verl's line layout.
    rows = jsonl_rows(workdir / "metrics" / "run.jsonl")
    assert rows == [{"step": s, "data": {k: float(v) for k, v in verl_metrics(s).items()}}
                    for s in (1, 2, 3)]  # fmt: skip
    # TensorBoard: the scalars (float32) and verl's generations text.
    assert tensorboard_scalars(workdir / "tb") == {
        k: [(s, f32(v)) for s, v in series] for k, series in expected.items()
    }
    texts = tensorboard_accumulator(workdir / "tb").Tensors("val/generations")
    assert [e.step for e in texts] == [3]
    assert "**Input:** What is 3+3?" in texts[0].tensor_proto.string_val[0].decode()
    # console: verl's LocalLogger lines.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
    assert lines == [
        f"step:{s} - actor/pg_loss:{f32(0.5 / s)!r} - critic/score/mean:{0.1 * s!r} - "
        f"timing_s/gen:{1.25 * s!r} - training/global_step:{float(s)!r}"
        for s in (1, 2, 3)
    ]


def test_rl_insight_serves_the_trainer_metrics_for_prometheus_to_scrape(workdir, caplog):
    """verl's ``rl_insight`` backend reports the trainer's scalars to RL-Insight, whose
    Prometheus stores them; otel-rl serves the same values on its Prometheus endpoint."""
    config = {"otel_rl": {"prometheus": {"port": 0}}}
    with Tracking("gsm8k", "ppo", ["console", "rl_insight"], config=config) as tracking:
        assert tracking.backends == ["console", "rl_insight"]
        assert tracking.prometheus_url.startswith("http://127.0.0.1:")
        for step in (1, 2):
            tracking.log(data=verl_metrics(step), step=step)
        assert tracking.flush(timeout=30)
        page = prometheus_samples(tracking.prometheus_url)
        assert page["actor_pg_loss"] == f32(0.25)
        assert page["critic_score_mean"] == pytest.approx(0.2, rel=1e-12)
        assert page["timing_s_gen"] == 2.5
        # Only some backends: the endpoint (fed by rows for every backend) does not take it.
        tracking.log({"only_console": 1.0}, step=3, backend=["rl_insight"])
        assert tracking.flush(timeout=30)
        assert "only_console" not in prometheus_samples(tracking.prometheus_url)
    assert any("naming 'rl_insight' without every other backend" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.slow
def test_vemlp_wandb_is_a_wandb_run_with_verls_settings(workdir, offline_trackers):
    pytest.importorskip("wandb")
    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    config = verl_config(["vemlp_wandb"])
    with Tracking("gsm8k", "ppo-vemlp", ["vemlp_wandb"], config=config) as tracking:
        assert tracking.backends == ["vemlp_wandb"]  # the W&B tracker is not added twice
        assert tracking.logger["vemlp_wandb"] is tracking.logger["wandb"]
        for step in (1, 2):
            tracking.log(data=verl_metrics(step), step=step)
        ValidationGenerationsLogger("gsm8k", "ppo-vemlp").log_generations_to_vemlp_wandb(
            SAMPLES, 2
        )
    (run_dir,) = wandb_run_dirs(workdir / "otel_rl_logs" / "gsm8k" / "ppo-vemlp")
    run = read_wandb(run_dir)
    assert run.series("critic/score/mean") == [(1, 0.1), (2, 0.2)]
    assert run.config["trainer.experiment_name"] == "ppo-gsm8k"
    (row,) = [r for r in run.history if "val/generations._type" in r]
    table = json.loads((run_dir / "files" / row["val/generations.path"]).read_text())
    assert table["data"] == [[2, "What is 2+2?", "4", 1.0, "What is 3+3?", "7", 0.0]]


@pytest.mark.slow
def test_dapo_filtered_reward_table_goes_to_wandb_only(workdir, offline_trackers, caplog):
    pytest.importorskip("wandb")
    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    key = "training/filter_groups/filtered_reward_counts"
    table_logger = DapoFilteredRewardTableLogger("gsm8k", "dapo")
    table_logger.log(["wandb"], {1.0: 2}, step=0)  # no Tracking yet: one warning
    assert any("DAPO filtered-reward table at step 0 not logged" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    with Tracking("gsm8k", "dapo", ["wandb", "tensorboard"]) as tracking:
        tracking.log({"loss": 1.0}, step=1)
        table_logger.log(["wandb", "tensorboard"], {1.0: 3, 0.0: 2}, step=1)
        table_logger.log("tensorboard", {0.0: 9}, step=2)  # verl: W&B only
        table_logger.log(["wandb"], {np.float32(0.5): np.int64(4)}, step=3)
    (run_dir,) = wandb_run_dirs(workdir / "otel_rl_logs" / "gsm8k" / "dapo")
    rows = [r for r in read_wandb(run_dir).history if f"{key}._type" in r]
    assert [r["global_step"] for r in rows] == [1, 3]
    table = json.loads((run_dir / "files" / rows[-1][f"{key}.path"]).read_text())
    assert table["columns"] == ["step", "reward_counts"]
    assert table["data"] == [[1, "0:2, 1:3"], [3, "0.5:4"]]
    tb_tags = tensorboard_accumulator(workdir / "tensorboard_log" / "gsm8k" / "dapo").Tags()
    assert tb_tags["scalars"] == ["loss"] and tb_tags["tensors"] == []


def test_file_logger_on_its_own(workdir, monkeypatch, capsys):
    target = workdir / "root"
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(target))
    path = target / "proj" / "exp.jsonl"
    logger = FileLogger("proj", "exp")
    assert logger.filepath == str(path)
    assert capsys.readouterr().out == f"Creating file logger at {path}\n"
    logger.log({"actor": {"lr": np.float64(1e-6)}, "n": np.int64(3)}, step=1)
    logger.log({"loss": float("nan")}, step=2)
    logger.finish()
    logger.finish()  # a second finish does nothing
    # A second logger on the same file appends; collecting it writes what it holds.
    again = FileLogger("proj", "exp")
    again.log({"loss": 0.5}, step=3)
    del again
    gc.collect()
    assert jsonl_rows(target / "proj" / "exp.jsonl") == [
        {"step": 1, "data": {"actor/lr": 1e-6, "n": 3.0}},
        {"step": 2, "data": {"loss": None}},
        {"step": 3, "data": {"loss": 0.5}},
    ]


def test_clearml_logger_on_its_own_and_generations_to_the_process_task(workdir, otel_rl_warnings):
    import pandas as pd

    ValidationGenerationsLogger("p", "e").log_generations_to_clearml(SAMPLES, 1)
    assert any("not logged to clearml: no live Tracking and no ClearML task" in r.getMessage()
               for r in otel_rl_warnings.records)  # fmt: skip

    config = OmegaConf.create({"trainer": {"total_epochs": 2}, "seed": 7})
    logger = ClearMLLogger("proj", "exp", config)
    frame = pd.DataFrame({"prompt": ["a", "b"], "reward": [1.0, 0.5]})
    logger.log({"actor/loss": 0.5, "score": 1, "val/table": frame}, step=1)
    logger.log({"actor/loss": 0.25}, step=2)
    assert logger.flush(timeout=60)
    assert logger.task is not None and logger.task.name == "exp"
    # No Tracking lives: the generations go to the process's ClearML task, verl's way.
    ValidationGenerationsLogger("proj", "exp").log_generations_to_clearml(SAMPLES, 2)
    logger.finish()

    session = read_clearml(workdir / "clearml", "exp")
    assert session.project == "proj"
    assert session.scalars == {("actor", "loss"): [(1, 0.5), (2, 0.25)],
                               ("score", "score"): [(1, 1.0)]}  # fmt: skip
    assert session.parameters["General"] == {"trainer.total_epochs": "2", "seed": "7"}
    ((step, table),) = session.plots[("val", "table")]
    assert (step, table_of(table)) == (1, (["prompt", "reward"], [["a", 1.0], ["b", 0.5]]))
    ((step, table),) = session.plots[("val", "generations")]
    assert (step, table_of(table)) == (2, (
        ["step", "input", "output", "score"],
        [[2, "What is 2+2?", "4", 1.0], [2, "What is 3+3?", "7", 0.0]],
    ))  # fmt: skip
