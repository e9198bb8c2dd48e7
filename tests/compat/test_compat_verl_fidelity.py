"""verl's public behaviour, difference by difference: what ``verl.utils.tracking`` writes, names
and warns, observed through ``otel_rl.compat.verl`` with each tracker's own reader."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest

from otel_rl.compat.verl import Tracking, ValidationGenerationsLogger, active_tracking
from testkit import servers
from testkit.readers import tensorboard_accumulator

mlflow_server = servers.mlflow_server

_ENV = (
    "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID", "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "OTEL_RL_LOG_DIR",
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory, none of verl's variables set, no Tracking alive."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)
    gc.collect()  # a Tracking a previous test dropped is finished by now
    assert active_tracking() is None
    return tmp_path


# ---- verl's MLflow metric names and warnings ----------------------------------------------------

#: Key → the name verl's MLflow adapter logs it under.
VERL_NAMES = {
    "val:acc": "val:acc",                      # MLflow allows colons: verl keeps them
    "a!!b": "a__b",                            # one "_" per refused character
    "val-core/gsm8k/reward/mean@1": "val-core/gsm8k/reward/mean_at_1",
    "val-aux//reward/best@4": "val-aux/reward/best_at_4",
    "bad key#": "bad key_",                    # the space stays
    "actor/pg_loss": "actor/pg_loss",          # valid: unchanged, no warning
}


@pytest.mark.slow
def test_mlflow_names_and_warnings_are_verls(workdir, monkeypatch, mlflow_server, caplog):
    """Against a real ``mlflow server``: every key is stored under verl's name, and each
    renamed key gets verl's warning on ``verl.utils.tracking`` naming the original key."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    caplog.set_level(logging.WARNING, logger="verl.utils.tracking")
    with Tracking("verl-names", "run-1", ["mlflow"]) as tracking:
        for step in (1, 2):
            tracking.log({key: float(i + step) for i, key in enumerate(VERL_NAMES)}, step=step)
        exporter = tracking.logger["mlflow"]
    run_id = exporter.run_id  # known once the tracker's thread has opened the run

    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(run_id)
    assert sorted(run.data.metrics) == sorted(VERL_NAMES.values())
    for i, (key, name) in enumerate(VERL_NAMES.items()):
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert points == [(1, float(i + 1)), (2, float(i + 2))], key
    assert run.info.run_name == "run-1"
    assert client.get_experiment(run.info.experiment_id).name == "verl-names"

    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "verl.utils.tracking")
    assert warnings == sorted(
        f"[MLflow] Metric key '{key}' sanitized to '{name}' due to invalid characters."
        for key, name in VERL_NAMES.items()
        if key != name
    )
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.name == "verl.utils.tracking")


# ---- ValidationGenerationsLogger where no Tracking lives ----------------------------------------

SAMPLES = [("What is 2+2?", "4", 1.0), ("What is 3+3?", "7", 0.0)]


def _texts(log_dir: Path, tag: str = "val/generations") -> list[tuple[int, str]]:
    acc = tensorboard_accumulator(log_dir)
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def test_standalone_generations_reach_tensorboard_dir(workdir, monkeypatch, caplog):
    """verl's async rollouter: a ValidationGenerationsLogger with no Tracking in the process
    writes the generations itself, TensorBoard text under ``TENSORBOARD_DIR``."""
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    caplog.set_level(logging.WARNING, logger="otel_rl")
    generations = ValidationGenerationsLogger("gsm8k", "ppo-qwen")
    for step in (3, 6):
        samples = [(q, a, s * step) for q, a, s in SAMPLES]
        generations.log(["console", "tensorboard", "wandb"], samples, step)
    assert generations.flush(timeout=30)
    generations.finish()

    texts = _texts(workdir / "tb")
    assert [step for step, _ in texts] == [3, 6]
    assert "| What is 2+2? | 4 | 3.0 |" in texts[0][1]
    assert "| What is 3+3? | 7 | 0.0 |" in texts[1][1]
    assert "| What is 2+2? | 4 | 6.0 |" in texts[1][1]
    # No W&B run in this process: one clear warning instead of a silent drop.
    wandb_warnings = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert len(wandb_warnings) == 1 and "no W&B run in this process" in wandb_warnings[0]


def test_standalone_generations_default_directories_follow_verl(workdir):
    named = ValidationGenerationsLogger("p", "e")
    named.log_generations_to_tensorboard(SAMPLES, 1)
    unnamed = ValidationGenerationsLogger()
    unnamed.log("tensorboard", SAMPLES, 2)
    named.finish()
    unnamed.finish()
    assert [s for s, _ in _texts(workdir / "tensorboard_log" / "p" / "e")] == [1]
    assert [s for s, _ in _texts(workdir / "tensorboard_log")] == [2]


@pytest.mark.slow
def test_standalone_generations_reach_mlflow_run_of_the_environment(workdir, monkeypatch):
    """MLflow standalone: the generations land in the run ``MLFLOW_RUN_ID`` names (the
    platform's run), read back with MlflowClient from a local SQLite store."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{(workdir / 'mlflow.db').as_posix()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("platform")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)

    generations = ValidationGenerationsLogger("gsm8k", "ppo-qwen")
    generations.log(["mlflow"], SAMPLES, 5)
    generations.finish()
    path = client.download_artifacts(run_id, "tables/val/generations/step_5.json",
                                     str(workdir / "dl"))
    assert json.loads(Path(path).read_text()) == {
        "columns": ["input", "output", "score"],
        "data": [["What is 2+2?", "4", 1.0], ["What is 3+3?", "7", 0.0]],
    }


def test_a_live_tracking_still_takes_the_generations(workdir, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    with Tracking("p", "e", ["tensorboard"]) as tracking:
        ValidationGenerationsLogger("p", "e").log(["tensorboard"], SAMPLES, 4)
        assert tracking.flush(timeout=30)
    assert [s for s, _ in _texts(workdir / "tb")] == [4]
    assert len(list((workdir / "tb").glob("events.out.tfevents.*"))) == 1  # one writer


# ---- Tracking().console_logger ------------------------------------------------------------------


def test_console_logger_is_the_console_backend(workdir, capsys):
    with Tracking("p", "e", ["console"]) as tracking:
        console = tracking.console_logger
        assert tracking.logger["console"] is console
        assert console.print_to_console is True
        console.log({"actor/lr": 1e-6, "note": "text is skipped", "n": 3}, step=7)
        console.flush()
        assert capsys.readouterr().out == "step:7 - actor/lr:1e-06 - n:3.0\n"
        console.print_to_console = False
        tracking.log({"x": 1.0}, step=8)
        console.flush()
        assert capsys.readouterr().out == ""
    with Tracking("p", "e", ["tensorboard"]) as tracking:
        assert not hasattr(tracking, "console_logger")  # verl sets it only with "console"


def test_mlflow_names_are_verls_with_the_trackers_in_the_delivery_process(workdir, monkeypatch):
    """``export.delivery: process`` from ``config["otel_rl"]``: the MLflow tracker runs in the
    delivery process, and verl's metric names reach it there (a local SQLite store)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{(workdir / 'mlflow.db').as_posix()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config = {"otel_rl": {"export": {"delivery": "process"}}}
    with Tracking("verl-names-process", "run-1", ["mlflow"], config=config) as tracking:
        assert type(tracking.logger["mlflow"]).__name__ == "ServiceTracker"
        tracking.log({key: float(i) for i, key in enumerate(VERL_NAMES)}, step=1)

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("verl-names-process").experiment_id])
    assert sorted(run.data.metrics) == sorted(VERL_NAMES.values())


_OWN_RUNS = """
import sys, wandb, swanlab
from otel_rl.compat.verl import ValidationGenerationsLogger

root = sys.argv[1]
run = wandb.init(project="gsm8k", name="ppo", mode="offline", dir=f"{root}/wandb-root")
swanlab.init(project="gsm8k", experiment_name="ppo", mode="offline", logdir=f"{root}/swanlog")
generations = ValidationGenerationsLogger("gsm8k", "ppo")
for step in (2, 4):
    samples = [("What is 2+2?", "4", 1.0 * step), ("What is 3+3?", "7", 0.0)]
    generations.log(["wandb", "swanlab"], samples, step)
generations.finish()
run.finish()
swanlab.finish()
"""


@pytest.mark.slow  # two tracker SDKs started in a process of their own
def test_standalone_generations_reach_the_process_own_wandb_and_swanlab_runs(workdir):
    """verl's rollouter in a process whose W&B and SwanLab runs it started itself (no Tracking):
    the generations go into those runs, W&B's as verl's wide table (rows accumulating),
    SwanLab's as Markdown text; read back with each tracker's own files."""
    import subprocess
    import sys

    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")
    from testkit.tracker_readers import read_swanlab, read_wandb, wandb_run_dirs

    env = {**__import__("os").environ, "PYTHONPATH": __import__("os").pathsep.join(sys.path),
           "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "SWANLAB_ROOT": str(workdir / "swanlab-root")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _OWN_RUNS, str(workdir)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not logged" not in done.stderr

    (run_dir,) = wandb_run_dirs(workdir / "wandb-root")
    tables = [r for r in read_wandb(run_dir).history if "val/generations._type" in r]
    assert [r["_step"] for r in tables] == [2, 4]
    table = json.loads((run_dir / "files" / tables[-1]["val/generations.path"]).read_text())
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2",
                                "output_2", "score_2"]  # fmt: skip
    assert table["data"] == [[2, "What is 2+2?", "4", 2.0, "What is 3+3?", "7", 0.0],
                             [4, "What is 2+2?", "4", 4.0, "What is 3+3?", "7", 0.0]]  # fmt: skip

    (swan_dir,) = [p for p in (workdir / "swanlog").glob("run-*") if p.is_dir()]
    swan = read_swanlab(swan_dir)
    assert [(s, kind) for s, kind, _ in swan.media["val/generations"]] == [
        (2, "COLUMN_TYPE_TEXT"), (4, "COLUMN_TYPE_TEXT")]
    (_, _, (filename,)) = swan.media["val/generations"][1]
    assert "| What is 2+2? | 4 | 4.0 |" in swan.media_file("text", filename).read_text()
