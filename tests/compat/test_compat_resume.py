"""The drop-ins resume as their frameworks do: a relaunch continues the run's history.

Each test runs the framework's logger in real processes, as its users run it: a first launch
logs steps 0..30 and is SIGKILLed, a relaunch with the same config (nothing passed by hand)
logs 21..40, as NeMo RL and verl do after reloading a checkpoint of step 20. Read back from each
tracker's own storage: one W&B run id, one MLflow run tagged with two attempts, one value per
step in TensorBoard and in the JSONL's latest-attempt view, the relaunch's values for 21..30.
A value is ``1000 * launch + step``, so each says which launch wrote it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.tracker_readers import (
    read_wandb,
    wandb_folder_run_id,
    wandb_number,
    wandb_run_dirs,
)

FIRST = range(0, 31)
SECOND = range(21, 41)
#: Each step's value once the run has resumed: the relaunch's from its first step on.
EXPECTED = {step: 1000 * (2 if step >= SECOND.start else 1) + step for step in range(0, 41)}

NEMO_RL_CHILD = r"""
import json, sys, time
from otel_rl.compat.nemo_rl import Logger, get_next_experiment_dir

base, launch, first, last, kill = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
config = {  # a NeMo RL experiment's logger section, log_dir as examples/run_grpo.py sets it
    "log_dir": get_next_experiment_dir(base),
    "wandb_enabled": True, "tensorboard_enabled": True, "mlflow_enabled": True,
    "swanlab_enabled": False, "jsonl_enabled": True, "monitor_gpus": False,
    "num_val_samples_to_print": 0,
    "wandb": {"project": "grpo-math", "name": "qwen-resume"},
    "tensorboard": {},
    "mlflow": {"experiment_name": "grpo-math", "run_name": "qwen-resume"},
    "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
}
logger = Logger(config)
print(json.dumps({"log_dir": logger.base_log_dir, "run_id": logger.core.run_id,
                  "attempt": logger.core.history.attempt}), flush=True)
for step in range(first, last + 1):
    logger.log_metrics({"loss": 1000.0 * launch + step}, step, prefix="train")
    logger.log_metrics({"total_step_time": 0.01}, step, prefix="timing/train", step_finished=True)
if kill:
    assert logger.flush(60), "not written in 60 s"
    print("LOGGED", flush=True)
    time.sleep(600)
logger.finish()
"""

VERL_CHILD = r"""
import json, sys, time
from otel_rl.compat.verl import Tracking

launch, first, last, kill = map(int, sys.argv[1:5])
config = {  # verl's trainer config, as RayPPOTrainer hands it to its Tracking
    "trainer": {"project_name": "gsm8k-ppo", "experiment_name": "qwen-resume",
                "logger": ["console", "wandb", "mlflow", "tensorboard", "file"],
                "resume_mode": "auto", "default_local_dir": "checkpoints/gsm8k-ppo/qwen-resume"},
}
tracking = Tracking(project_name=config["trainer"]["project_name"],
                    experiment_name=config["trainer"]["experiment_name"],
                    default_backend=config["trainer"]["logger"], config=config)
print(json.dumps({"run_id": tracking.core.run_id, "attempt": tracking.core.history.attempt,
                  "log_dir": str(tracking.core.log_dir)}), flush=True)
for step in range(first, last + 1):
    tracking.log({"actor/loss": 1000.0 * launch + step}, step=step)
if kill:
    assert tracking.flush(60), "not written in 60 s"
    print("LOGGED", flush=True)
    time.sleep(600)
tracking.finish()
"""


def _environment(tmp_path: Path) -> dict[str, str]:
    # W&B keeps its service's address in WANDB_SERVICE (set by any W&B run of this process):
    # each launch starts its own service, as a relaunched job does.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_RL_", "MLFLOW_")) and k != "WANDB_SERVICE"}  # fmt: skip
    path = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off", PYTHONPATH=path)
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        env[name] = str(tmp_path / name.lower())
    return env


def _killed_launch(args: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """A launch that logs, has it written, and is SIGKILLed: a node lost mid-run."""
    errors = cwd / "killed-launch.stderr"
    with open(errors, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", *args], cwd=cwd, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=stderr)  # fmt: skip
    try:
        assert child.stdout is not None
        lines = iter(child.stdout.readline, "")
        said = next((line for line in lines if line.startswith("{")), "null")
        assert any(line.strip() == "LOGGED" for line in lines), errors.read_text()[-3000:]
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    assert child.returncode == -signal.SIGKILL
    return dict(json.loads(said))


def _relaunch(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """A relaunch run to its end: what it said of itself, and its output before that."""
    done = subprocess.run([sys.executable, "-c", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("{"))
    return dict(json.loads(lines[said])), "\n".join(lines[:said])


def _one_wandb_run(root: Path, key: str) -> None:
    """One run id across the launches' run folders (W&B names each ``offline-run-<time>-<id>``);
    the relaunch's folder resumes that run and holds the relaunch's values.

    W&B's own service writes the offline file in the background and buffers it: a launch
    SIGKILLed within seconds of its rows leaves the file with what the service had written, often
    nothing (the rows had reached the SDK, so the spool holds none of them). Whatever it holds is
    the first launch's, at its steps.
    """
    folders = wandb_run_dirs(root)
    assert len(folders) == 2
    assert len({wandb_folder_run_id(folder) for folder in folders}) == 1
    killed, relaunched = (read_wandb(folder) for folder in folders)
    assert relaunched.run_id == wandb_folder_run_id(folders[0]) and relaunched.resumed
    first, second = (
        {row["global_step"]: wandb_number(row[key]) for row in run.history if key in row}
        for run in (killed, relaunched)
    )
    assert first.items() <= {step: 1000.0 + step for step in FIRST}.items()
    assert second == {step: 2000.0 + step for step in SECOND}


def _one_mlflow_run(tracking_uri: str, experiment: str, key: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["otel_rl.attempts"] == "2"
    assert run.data.tags["otel_rl.resume_steps"] == str(SECOND.start)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, key)
    # MLflow keeps both attempts' values of 21..30; the later one of each step counts.
    latest: dict[int, float] = {}
    for metric in sorted(history, key=lambda m: m.timestamp):
        latest[metric.step] = metric.value
    assert latest == EXPECTED
    assert len(history) == len(FIRST) + len(SECOND)


def _one_value_per_step(tensorboard_dir: Path, key: str) -> None:
    """TensorBoard's reader, with the relaunch's purge step, shows each step once."""
    series = tensorboard_scalars(tensorboard_dir)[key]
    assert [step for step, _ in series] == sorted(EXPECTED)
    assert {step: value for step, value in series} == pytest.approx(EXPECTED)


def _latest_attempt(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each training step's values in a ``metrics.jsonl``, the latest attempt's: a row of
    attempt a at step s is superseded when a resume record of an attempt b > a starts at a step
    <= s (docs/outputs.md)."""
    resumes = [(row["resume"]["attempt"], row["resume"]["step"]) for row in rows if "resume" in row]
    out: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "resume" in row or "axis" in row:
            continue
        attempt, step = row.get("attempt", 1), row["step"]
        if any(b > attempt and start <= step for b, start in resumes):
            continue
        out.setdefault(step, {}).update(row["metrics"])
    return out


def _verl_latest(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """verl's ``file`` lines, the latest attempt's: a resume line supersedes the lines above it
    at steps >= its step."""
    out: dict[int, dict[str, Any]] = {}
    for line in lines:
        if "resume" in line:
            for step in [s for s in out if s >= line["resume"]["step"]]:
                del out[step]
            continue
        out.setdefault(line["step"], {}).update(line["data"])
    return out


@pytest.mark.slow
def test_nemo_rl_relaunch_continues_its_run(tmp_path):
    env = _environment(tmp_path)
    base = tmp_path / "logs" / "grpo-math"

    def args(launch: int, steps: range, kill: bool) -> list[str]:
        return [NEMO_RL_CHILD, str(base), str(launch), str(steps.start), str(steps.stop - 1),
                str(int(kill))]  # fmt: skip

    first = _killed_launch(args(1, FIRST, kill=True), tmp_path, env)
    second, said = _relaunch(args(2, SECOND, kill=False), tmp_path, env)

    # The relaunch's get_next_experiment_dir made exp_002; the run continued in exp_001.
    assert first["attempt"] == 1 and second["attempt"] == 2
    assert second["run_id"] == first["run_id"]
    assert Path(second["log_dir"]).name == Path(first["log_dir"]).name == "exp_001"
    assert sorted(p.name for p in base.iterdir()) == ["exp_001"]
    assert f"Continuing run {first['run_id']} in log directory: {base / 'exp_001'}" in said
    log_dir = base / "exp_001"

    _one_wandb_run(log_dir, "train/loss")
    _one_mlflow_run(f"sqlite:///{log_dir / 'mlflow' / 'mlflow.db'}", "grpo-math", "train/loss")
    _one_value_per_step(log_dir / "tensorboard", "train/loss")
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    resumes = [row for row in rows if "resume" in row]
    assert [row["resume"] for row in resumes] == [{"attempt": 2, "step": SECOND.start}]
    latest = _latest_attempt(rows)
    assert {step: values["train/loss"] for step, values in latest.items()} == EXPECTED


@pytest.mark.slow
def test_verl_relaunch_continues_its_run(tmp_path):
    env = _environment(tmp_path)

    def args(launch: int, steps: range, kill: bool) -> list[str]:
        return [VERL_CHILD, str(launch), str(steps.start), str(steps.stop - 1), str(int(kill))]

    first = _killed_launch(args(1, FIRST, kill=True), tmp_path, env)
    second, _ = _relaunch(args(2, SECOND, kill=False), tmp_path, env)

    assert first["run_id"] == second["run_id"] == "gsm8k-ppo/qwen-resume"
    assert first["attempt"] == 1 and second["attempt"] == 2
    log_dir = tmp_path / first["log_dir"]

    _one_wandb_run(log_dir, "actor/loss")
    _one_mlflow_run(f"sqlite:///{log_dir / 'mlflow' / 'mlflow.db'}", "gsm8k-ppo", "actor/loss")
    _one_value_per_step(tmp_path / "tensorboard_log" / "gsm8k-ppo" / "qwen-resume", "actor/loss")
    lines = jsonl_rows(tmp_path / "gsm8k-ppo" / "qwen-resume.jsonl")
    assert [line["resume"] for line in lines if "resume" in line] == [
        {"attempt": 2, "step": SECOND.start}
    ]
    latest = _verl_latest(lines)
    assert {step: values["actor/loss"] for step, values in latest.items()} == EXPECTED


def test_verl_resume_mode_decides_whether_the_run_continues(monkeypatch):
    from otel_rl.compat.verl_config import tracking_config
    from otel_rl.core.errors import ConfigError

    monkeypatch.delenv("OTEL_RL_RUN_ID", raising=False)
    monkeypatch.delenv("OTEL_RL_CONFIG", raising=False)

    def cfg(trainer: dict[str, Any], **own: Any) -> dict[str, Any]:
        config: dict[str, Any] = {"trainer": trainer}
        if own:
            config["otel_rl"] = own
        return tracking_config("proj", "exp", ["console"], config, environ=dict(os.environ))

    assert (cfg({})["resume"], cfg({})["run_id"]) == ("auto", "proj/exp")
    assert cfg({"resume_mode": "auto"})["resume"] == "auto"
    assert cfg({"resume_mode": "resume_path"})["resume"] == "auto"
    assert cfg({"resume_mode": "disable"})["resume"] == "never"
    # otel-rl's own options win over what verl's names and switch imply.
    assert cfg({"resume_mode": "disable"}, resume="must", run_id="mine")["resume"] == "must"
    assert cfg({}, run_id="mine")["run_id"] == "mine"
    with pytest.raises(ConfigError, match=r"trainer\.resume_mode.*'sometimes'"):
        cfg({"resume_mode": "sometimes"})
    monkeypatch.setenv("OTEL_RL_RUN_ID", "from-env")
    assert "run_id" not in tracking_config("proj", "exp", ["console"], {}, environ=dict(os.environ))


def test_nemo_rl_run_is_named_by_its_config_and_resume_never_keeps_the_new_folder(
    tmp_path, monkeypatch, capsys
):
    from otel_rl.compat.nemo_rl import Logger, get_next_experiment_dir

    monkeypatch.delenv("OTEL_RL_RUN_ID", raising=False)
    base = tmp_path / "logs"

    def launch(step: int, **extra: Any) -> tuple[str, str, int]:
        config = {"log_dir": get_next_experiment_dir(str(base)), "jsonl_enabled": True,
                  "wandb_enabled": False, "tensorboard_enabled": False, "mlflow_enabled": False,
                  "swanlab_enabled": False, "monitor_gpus": False,
                  "wandb": {"project": "p", "name": "n"}, **extra}  # fmt: skip
        with Logger(config) as logger:
            logger.log_metrics({"loss": float(step)}, step, prefix="train", step_finished=True)
            return Path(logger.base_log_dir).name, logger.core.run_id, logger.core.history.attempt

    name, run_id, attempt = launch(1)
    assert (name, attempt) == ("exp_001", 1) and run_id.startswith("n-")
    # resume: never is a new run in the new folder, under the same name.
    assert launch(2, resume="never") == ("exp_002", run_id, 1)
    # The next relaunch continues the latest folder that holds the run.
    capsys.readouterr()
    assert launch(3) == ("exp_002", run_id, 2)
    said = capsys.readouterr().out
    assert f"Continuing run {run_id} in log directory: {base / 'exp_002'}" in said
    assert sorted(p.name for p in base.iterdir()) == ["exp_001", "exp_002"]
    rows = jsonl_rows(base / "exp_002" / "metrics.jsonl")
    assert [(row["step"], row["attempt"], "resume" in row) for row in rows] == [
        (2, 1, False), (3, 2, True), (3, 2, False)
    ]
    # Other run names are another run; OTEL_RL_RUN_ID names the run instead of the config.
    assert launch(4, wandb={"project": "p", "name": "other"})[1:] != (run_id, 2)
    monkeypatch.setenv("OTEL_RL_RUN_ID", "job-42")
    assert launch(5)[1:] == ("job-42", 1)
