"""The demo, end to end, through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import servers
from testkit.readers import jsonl_rows, tensorboard_scalars

mlflow_server = servers.mlflow_server  # the session's one shared server (fixture)


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """``otel-rl demo ARGS`` through the installed console script (the module if none)."""
    exe = shutil.which("otel-rl")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rl.cli"]
    return subprocess.run(
        [*cmd, "demo", *args], capture_output=True, text=True, timeout=120, check=True
    )


def test_demo_runs_and_writes_every_output(tmp_path):
    out = demo("--steps", "5", "--log-dir", str(tmp_path / "demo"))
    run = tmp_path / "demo" / "exp_001"
    assert f"This run is in {run}/:" in out.stdout
    assert f"metrics (JSONL):  {run / 'metrics.jsonl'}" in out.stdout
    assert f"tensorboard --logdir {tmp_path / 'demo'}" in out.stdout
    assert "step 0" in out.stderr  # the console table

    rows = jsonl_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        m = row["metrics"]
        assert m["train/reward/count"] == 16.0
        assert m["train/reward/min"] <= m["train/reward/mean"] <= m["train/reward/max"]
        assert m["timing/generation"] > 0.003 and m["timing/train"] > 0.002
        assert {"train/loss", "train/kl", "train/response_length/p90"} <= set(m)
        # where the step went: the phases and untimed add up to the step's wall time
        phases = {k: v for k, v in m.items() if k.startswith("anatomy/") and
                  k.endswith("/seconds") and k.split("/")[1] not in ("critical", "wall", "untimed")}
        assert set(phases) == {"anatomy/generation/seconds", "anatomy/reward/seconds",
                               "anatomy/train/seconds", "anatomy/train/worker_step/seconds"}
        assert phases["anatomy/generation/seconds"] >= 0.004  # its sleep
        assert phases["anatomy/train/worker_step/seconds"] >= 0.0045  # the two workers' sleeps
        assert sum(phases.values()) + m["anatomy/untimed/seconds"] == pytest.approx(
            m["anatomy/wall/seconds"], rel=1e-6
        )
        assert 0 < m["anatomy/trainer/busy_fraction"] < 1
        if m["train/timing/worker_step/skew"] > 1.05:  # the rank slowest at its one timer
            assert m["anatomy/trainer/busiest_rank"] == m["train/timing/worker_step/slowest_rank"]
    assert rows[0]["metrics"]["anatomy/critical_path"].startswith("driver:")
    assert f"where steps went: otel-rl why {run}" in out.stdout
    # loss falls, reward mean rises (noisy per step, clear over the run)
    assert rows[-1]["metrics"]["train/loss"] < rows[0]["metrics"]["train/loss"]

    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4]
    assert json.loads((run / "hyperparams.json").read_text())["steps"] == 5


@pytest.mark.slow
def test_demo_run_again_into_the_same_log_dir_gets_its_own_run_directory(tmp_path):
    """NeMo RL's exp_<N> convention: each run its own directory, none appended to another."""
    base = tmp_path / "demo"
    (base / "exp_007").mkdir(parents=True)  # numbering continues after what is there
    (base / "notes").mkdir()
    runs = []
    for steps in (3, 4):
        out = demo("--steps", str(steps), "--log-dir", str(base), "--backends", "jsonl,tensorboard")
        runs.append(out.stdout)
    assert f"This run is in {base / 'exp_008'}/:" in runs[0]
    assert f"This run is in {base / 'exp_009'}/:" in runs[1]
    assert sorted(p.name for p in base.iterdir()) == ["exp_007", "exp_008", "exp_009", "notes"]
    assert not (base / "metrics.jsonl").exists()
    for name, steps in (("exp_008", 3), ("exp_009", 4)):
        rows = jsonl_rows(base / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(steps))  # step 0 once
        assert len({r["run_id"] for r in rows}) == 1
        scalars = tensorboard_scalars(base / name / "tensorboard")
        assert [s for s, _ in scalars["train/loss"]] == list(range(steps))
    first = {r["run_id"] for r in jsonl_rows(base / "exp_008" / "metrics.jsonl")}
    second = {r["run_id"] for r in jsonl_rows(base / "exp_009" / "metrics.jsonl")}
    assert first != second


def test_demo_backends_flag_and_bad_backend(tmp_path, capsys):
    from otel_rl.cli.main import main

    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "jsonl"]) == 0
    run = tmp_path / "exp_001"
    assert (run / "metrics.jsonl").exists() and not (run / "tensorboard").exists()
    assert "TensorBoard" not in capsys.readouterr().out
    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "nope"]) == 2
    assert "otel-rl demo: unknown backend(s) nope; choose from" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp_001"]  # no directory claimed


def test_run_demo_refuses_a_step_count_below_one(tmp_path):
    from otel_rl.cli.demo import run_demo

    for steps in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive integer"):
            run_demo(steps=steps, log_dir=tmp_path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def _printed(stdout: str, label: str) -> str:
    """The text after ``label`` on its summary line (``  W&B (offline):    /path``)."""
    (line,) = [ln for ln in stdout.splitlines() if ln.strip().startswith(label)]
    return line.strip().removeprefix(label).strip()


@pytest.mark.slow
def test_demo_names_every_trackers_run_and_how_to_open_it(tmp_path, monkeypatch):
    """The real command with W&B, SwanLab and ClearML offline, MLflow in its local SQLite store
    and Trackio in its store: every path printed exists and holds the run, step by step, with
    the values JSONL got; each command printed names that path."""
    pytest.importorskip("clearml")
    from mlflow import MlflowClient

    from testkit.tracker_readers import (
        read_swanlab,
        read_trackio,
        read_wandb,
        wandb_number,
        wandb_offline_env,
    )
    from tests.exporters.test_clearml_exporter import read_clearml_session

    wandb_offline_env(monkeypatch, tmp_path, mode=None)
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # TRACKIO_DIR: tracker_readers'
    backends = "jsonl,wandb,mlflow,swanlab,trackio,clearml"
    out = demo("--steps", "3", "--log-dir", str(tmp_path / "demo"), "--backends", backends).stdout
    run = tmp_path / "demo" / "exp_001"
    loss = {r["step"]: r["metrics"]["train/loss"] for r in jsonl_rows(run / "metrics.jsonl")}
    assert sorted(loss) == [0, 1, 2]

    wandb_dir = Path(_printed(out, "W&B (offline):"))
    assert wandb_dir.parent == run / "wandb" and wandb_dir.name.startswith("offline-run-")
    assert _printed(out, "upload it:      wandb sync") == str(wandb_dir)
    history = read_wandb(wandb_dir).series("train/loss")
    assert [(s, wandb_number(v)) for s, v in history] == sorted(loss.items())

    uri = f"sqlite:///{run / 'mlflow' / 'mlflow.db'}"
    run_id, _, store = _printed(out, "MLflow:").removeprefix("run ").partition(" in ")
    assert store == uri and (run / "mlflow" / "mlflow.db").is_file()
    assert _printed(out, "view it:        mlflow ui").startswith(f"--backend-store-uri {uri} ")
    points = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    assert sorted((p.step, p.value) for p in points) == sorted(loss.items())

    swanlab_dir = Path(_printed(out, "SwanLab (offline):"))
    assert swanlab_dir.parent == run / "swanlab" and swanlab_dir.is_dir()
    assert _printed(out, "upload it:      swanlab sync") == str(swanlab_dir)
    assert read_swanlab(swanlab_dir).scalars["train/loss"] == sorted(loss.items())

    name, _, store = _printed(out, "Trackio:").removeprefix("run ").partition(" in ")
    assert Path(store).is_file() and Path(store).name == "otel-rl-demo.db"
    assert _printed(out, "view it:        trackio show") == "--project otel-rl-demo"
    rows, _ = read_trackio("otel-rl-demo", name)
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == sorted(
        loss.items()
    )

    session = Path(_printed(out, "ClearML (offline):"))
    assert session.suffix == ".zip" and session.is_file()
    assert session.parent == tmp_path / "clearml" / "offline"
    assert f"Task.import_offline_session('{session}')" in _printed(out, "upload it:      python")
    scalars = read_clearml_session(session.with_suffix("")).scalars
    assert scalars[("train", "loss")] == sorted(loss.items())


def test_demo_without_any_backend_is_refused_and_claims_no_directory(tmp_path, capsys):
    """``--backends ''`` alone would run into nothing and print nothing: refused (exit 2)."""
    from otel_rl.cli.main import main

    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", ""]) == 2
    err = capsys.readouterr().err
    assert "otel-rl demo: no backend given (--backends '')" in err
    assert "name a tracker (e.g. --backends jsonl)" in err
    assert list(tmp_path.iterdir()) == []


def test_demo_without_a_tracker_but_with_prometheus_says_where_the_values_went(
    tmp_path, capsys
):
    from otel_rl.cli.main import main

    argv = ["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "",
            "--prometheus-port", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Prometheus:       http://127.0.0.1:" in out
    assert "no tracker (--backends ''): the values went to the outputs above only" in out
    assert "metrics (JSONL)" not in out
    assert not (tmp_path / "exp_001" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_demo_with_an_mlflow_server_names_the_runs_page(mlflow_server, tmp_path, monkeypatch):
    """``MLFLOW_TRACKING_URI`` set: the run is on the server, and the page printed is its own."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    out = demo("--steps", "3", "--log-dir", str(tmp_path), "--backends", "mlflow").stdout
    run_id, _, store = _printed(out, "MLflow:").removeprefix("run ").partition(" in ")
    assert store == mlflow_server.url
    run = MlflowClient(mlflow_server.url).get_run(run_id)
    page = f"{mlflow_server.url}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    assert _printed(out, "open it:") == page
    points = MlflowClient(mlflow_server.url).get_metric_history(run_id, "train/reward/count")
    assert sorted((p.step, p.value) for p in points) == [(0, 16.0), (1, 16.0), (2, 16.0)]
