"""A real ``trl.GRPOTrainer`` run with :class:`~otel_rl.compat.transformers.OtelRLCallback`.

A two-layer Llama and a byte-level BPE built here (tests/compat/hf_tiny.py) train for three GRPO
steps on CPU, offline. What TRL hands ``Trainer.log`` at each step (recorded by a plain
``TrainerCallback`` beside ours) is read back at that step from the JSONL file, TensorBoard's
event files (TensorBoard's reader) and a real MLflow server (``MlflowClient``); the step timer,
the reward function's timer and TRL's completions (compared with the parquet file TRL writes
itself) are there too. A reward function that hangs gives a stall report naming it, and the
exception that ends that run marks it failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testkit import servers
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars
from tests.compat.hf_tiny import PROMPTS, offline, tiny_llama, tiny_tokenizer

pytest.importorskip("trl")
from transformers import TrainerCallback  # after the skip: trl brings it

mlflow_server = servers.mlflow_server  # the session's one shared server (fixture)

STEPS = (1, 2, 3)
GENERATIONS = 4  # completions per prompt; one prompt per step
#: Seconds without a step after which the run is stalled: above what one step of the tiny model
#: takes on a busy machine, so that the report comes while the reward function hangs.
STALL_AFTER_S = 4.0
HANG_LIMIT_S = 60.0  # the hanging reward function gives up after this, report or not


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [len(c) / 10 for c in completions]


@pytest.fixture
def hf_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    yield tmp_path


class Recorder(TrainerCallback):  # type: ignore[misc]
    """A plain ``TrainerCallback``'s view of the run: the logs TRL gives at each step."""

    def __init__(self) -> None:
        self.logs: dict[int, dict[str, Any]] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.setdefault(state.global_step, {}).update(logs or {})


def grpo_trainer(output_dir: Path, reward_funcs: list[Any], callbacks: list[Any]) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=8,
        max_steps=len(STEPS),
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        log_completions=True,
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": list(PROMPTS) * 4})
    return GRPOTrainer(
        model=tiny_llama(tokenizer),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def f32(x: float) -> float:
    """What TensorBoard keeps of a float."""
    return float(np.float32(x))


#: What TRL logs at every step (``Trainer.log``), checked in every tracker.
TRL_KEYS = ("reward", "completions/mean_length", "loss", "rewards/length_reward/mean", "step_time")


@pytest.mark.slow  # a real trainer: seconds, not milliseconds
def test_grpo_run_reaches_every_tracker(hf_offline: Path, mlflow_server: Any) -> None:
    from mlflow import MlflowClient

    from otel_rl.compat.transformers import OtelRLCallback, timed_rewards

    log_dir = hf_offline / "logs"
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": mlflow_server.url, "experiment_name": "trl-grpo"},
    }
    recorder = Recorder()
    otel = OtelRLCallback(cfg)
    trainer = grpo_trainer(hf_offline / "out", timed_rewards([length_reward]), [recorder, otel])
    otel.watch(trainer)
    assert otel.logger is not None  # created with the trainer, on the main (only) process
    trainer.train()
    assert otel.finished  # on_train_end finished the run
    mlflow = next(e.tracker for e in otel.logger.exporters if e.name == "mlflow")
    logs = recorder.logs
    assert sorted(logs) == list(STEPS)

    # ---- JSONL: one row per step, TRL's values under transformers' names -----------------
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == list(STEPS)
    for step in STEPS:
        row = rows[step]
        for key in TRL_KEYS:
            assert row[f"train/{key}"] == logs[step][key], (step, key)
        # the optimizer step holds TRL's training_step, which holds the reward function
        assert row["timing/step"] >= row["train/step_time"] > 0
        assert 0 < row["timing/reward/length_reward"] < row["timing/step"]
    assert rows[3]["train/train_runtime"] == logs[3]["train_runtime"]  # the last log, same step
    params = json.loads((log_dir / "hyperparams.json").read_text())
    assert params["learning_rate"] == 1e-3 and params["num_generations"] == GENERATIONS
    assert params["hidden_size"] == 16 and params["model_type"] == "llama"

    # ---- TensorBoard ----------------------------------------------------------------------
    tb = tensorboard_scalars(log_dir / "tensorboard")
    for key in TRL_KEYS:
        assert tb[f"train/{key}"] == [(s, f32(logs[s][key])) for s in STEPS], key
    assert [s for s, _ in tb["timing/step"]] == list(STEPS)

    # ---- MLflow: the server's run ---------------------------------------------------------
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(mlflow.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "trl-grpo"
    for key in TRL_KEYS:
        history = client.get_metric_history(mlflow.run_id, f"train/{key}")
        assert sorted((m.step, m.value) for m in history) == [
            (s, pytest.approx(logs[s][key])) for s in STEPS
        ], key
    assert run.data.params["num_generations"] == str(GENERATIONS)
    assert run.data.params["hidden_size"] == "16"

    # ---- the completions, as TRL keeps them in its own parquet files ----------------------
    import pandas as pd

    tables = [json.loads(line) for line in (log_dir / "tables.jsonl").read_text().splitlines()]
    # the run's time table comes once at the end, with its timeline (docs/timeline.md)
    assert [t["step"] for t in tables if t["table"] == "otel_rl/run_time"] == [STEPS[-1]]
    tables = [t for t in tables if t["table"] != "otel_rl/run_time"]
    assert [t["step"] for t in tables] == list(STEPS)  # once per step, the last log included
    texts = tensorboard_accumulator(log_dir / "tensorboard").Tensors("train/completions")
    assert [e.step for e in texts] == list(STEPS)
    for table in tables:
        step = table["step"]
        assert table["table"] == "train/completions"
        assert table["columns"] == ["step", "prompt", "completion", "length_reward", "advantage"]
        trl = pd.read_parquet(
            hf_offline / "out" / "completions" / f"completions_{step:05d}.parquet"
        )
        assert len(table["rows"]) == GENERATIONS == len(trl)
        for ours, (_, theirs) in zip(table["rows"], trl.iterrows(), strict=True):
            assert ours[0] == step and ours[1] == theirs["prompt"]
            assert ours[2] == theirs["completion"]
            assert ours[3] == pytest.approx(theirs["length_reward"])
            assert ours[4] == pytest.approx(theirs["advantage"])
        artifact = client.download_artifacts(
            mlflow.run_id, f"tables/train/completions/step_{step}.json", str(hf_offline / "dl")
        )
        kept = json.loads(Path(artifact).read_text())
        assert kept["columns"] == table["columns"]
        assert [r[2] for r in kept["data"]] == [r[2] for r in table["rows"]]
        text = texts[step - 1].tensor_proto.string_val[0].decode()
        assert all(str(r[1]) in text for r in table["rows"])


@pytest.mark.slow
def test_a_hanging_reward_function_is_named_in_the_stall_report(
    hf_offline: Path, mlflow_server: Any, otel_rl_warnings: Any
) -> None:
    """The reward function hangs at the second step (as a reward server that stops answering
    would), then raises at the third: a stall report names it inside the step, the step after
    the stall carries its length, and the exception marks the run failed. (A first step slower
    than the threshold gives a report of its own, before any step: not this one.)"""
    from mlflow import MlflowClient

    from otel_rl.compat.transformers import OtelRLCallback, timed_rewards

    log_dir = hf_offline / "logs"
    calls = []

    def remote_judge(completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(len(completions))
        if len(calls) == 2:  # hangs until the watchdog has reported it (step 1: the last one)
            deadline = time.monotonic() + HANG_LIMIT_S
            while not list((log_dir / "stalls").glob("1-*.json")):
                assert time.monotonic() < deadline, "no stall report"
                time.sleep(0.05)
        if len(calls) == 3:
            raise TimeoutError("the judge server did not answer")
        return [1.0 for _ in completions]

    cfg = {
        "log_dir": str(log_dir),
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": mlflow_server.url, "experiment_name": "trl-grpo-stall"},
        "stalls": {"after": STALL_AFTER_S, "factor": 1},
    }
    otel = OtelRLCallback(cfg)
    trainer = grpo_trainer(hf_offline / "out", timed_rewards([remote_judge]), [otel])
    with pytest.raises(TimeoutError), otel:
        trainer.train()
    assert otel.finished and otel.logger is not None
    mlflow = next(e.tracker for e in otel.logger.exporters if e.name == "mlflow")

    reports = [json.loads(p.read_text()) for p in sorted((log_dir / "stalls").glob("*.json"))]
    named = [
        r for r in reports
        if [t["name"] for t in r["open_timers"].get("MainThread", [])]
        == ["step", "reward/remote_judge"]
    ]  # fmt: skip
    assert len(named) == 1, reports
    (report,) = named
    assert report["last_step"] == 1  # it hung in the second step
    assert report["seconds_since_step"] >= STALL_AFTER_S
    assert report["ended"]["seconds"] >= STALL_AFTER_S
    (text,) = [p.read_text() for p in (log_dir / "stalls").glob("1-*.txt")]
    assert "MainThread: step > reward/remote_judge" in text
    assert "in remote_judge" in text  # its frame, in the main thread's stack

    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == [1, 2]  # the third step raised
    assert rows[2]["stall/seconds"] == pytest.approx(report["ended"]["seconds"], abs=2e-3)
    assert 0 < rows[2]["timing/reward/remote_judge"] < rows[2]["stall/seconds"]
    events = [json.loads(x) for x in (log_dir / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in events if "step > reward/remote_judge" in e["text"]]
    assert event["event"] == "otel_rl/stall" and event["step"] == 1

    # without watch(trainer), TRL's completions are not samples, and the run says so once
    (warning,) = [
        r.getMessage() for r in otel_rl_warnings.records if "log_completions" in r.getMessage()
    ]
    assert "OtelRLCallback.watch(trainer)" in warning

    run = MlflowClient(tracking_uri=mlflow_server.url).get_run(mlflow.run_id)
    assert run.info.status == "FAILED"


# ---- the callback's events one by one, with transformers' own TrainingArguments and TrainerState


def test_eval_logs_none_values_and_logs_after_the_run_finished(
    tmp_path: Path, otel_rl_warnings: Any
) -> None:
    """transformers' names (``eval_`` → ``eval/``), a ``None`` left out of the row, an
    evaluation timed from its first prediction step to its log (at the step of its metrics:
    ``on_evaluate`` comes after the log), the last log merged into the last step, and a log after
    ``on_train_end`` refused with one warning."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from otel_rl.compat.transformers import OtelRLCallback

    log_dir = tmp_path / "logs"
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    otel = OtelRLCallback({"log_dir": str(log_dir)})
    otel.on_init_end(args, state, control)
    otel.on_train_begin(args, state, control)
    for step in (1, 2):
        otel.on_step_begin(args, state, control)
        time.sleep(0.01)
        state.global_step = step
        otel.on_step_end(args, state, control)
    otel.on_log(args, state, control, logs={"loss": 0.5, "reward": None, "epoch": 1.0})
    for _ in range(2):  # two evaluation batches
        otel.on_prediction_step(args, state, control)
        time.sleep(0.02)
    # transformers' order: the evaluation's metrics are logged, then on_evaluate
    otel.on_log(args, state, control, logs={"eval_loss": 0.25, "test_accuracy": 0.75})
    otel.on_evaluate(args, state, control)
    otel.on_step_begin(args, state, control)  # the next step: the evaluation is not its
    state.global_step = 3
    otel.on_step_end(args, state, control)
    otel.on_train_end(args, state, control)
    assert otel.finished
    otel.on_log(args, state, control, logs={"eval_loss": 0.125})  # trainer.evaluate() after

    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3]
    assert {k for k in rows[1] if not k.startswith("anatomy/")} == {"timing/step"}
    assert {k for k in rows[3] if not k.startswith("anatomy/")} == {"timing/step"}
    assert rows[1]["timing/step"] >= 0.01
    # the callback's step timer is the step's phase (docs/anatomy.md)
    assert rows[1]["anatomy/step/seconds"] == pytest.approx(rows[1]["timing/step"], abs=0.002)
    assert rows[2]["timing/evaluate"] >= 0.04
    assert {k: v for k, v in rows[2].items() if not k.startswith(("timing/", "anatomy/"))} == {
        "train/loss": 0.5, "train/epoch": 1.0, "eval/loss": 0.25, "test/accuracy": 0.75,
    }  # fmt: skip
    params = json.loads((log_dir / "hyperparams.json").read_text())
    assert params["output_dir"] == str(tmp_path / "out") and params["use_cpu"] is True
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert not [m for m in messages if "reward" in m]  # TRL's None: no value, no warning
    (late,) = [m for m in messages if "after the run finished" in m]
    assert "finish_on_train_end=False" in late


def test_timed_rewards_keep_names_and_kinds_and_time_into_the_step(tmp_path: Path) -> None:
    import asyncio
    import functools
    import inspect

    import torch
    from trl.trainer.utils import get_callable_name, is_async_callable

    from otel_rl.compat.transformers import OtelRLCallback, timed_reward, timed_rewards

    def exact(completions: list[str], **kwargs: Any) -> list[float]:
        return [1.0 for _ in completions]

    async def judge(completions: list[str], **kwargs: Any) -> list[float]:
        await asyncio.sleep(0.01)
        return [0.5 for _ in completions]

    class Scorer:
        def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
            return [0.0 for _ in completions]

    reward_model = torch.nn.Linear(2, 1)
    timed = timed_rewards([exact, judge, Scorer(), functools.partial(exact), reward_model, "id"])
    # TRL's own view of them: the same names, the same kinds
    assert [get_callable_name(f) for f in timed[:4]] == ["exact", "judge", "Scorer", "exact"]
    assert [is_async_callable(f) for f in timed[:4]] == [False, True, False, False]
    assert inspect.iscoroutinefunction(timed[1])
    assert timed[4] is reward_model and timed[5] == "id"  # TRL runs these itself
    assert timed_reward(exact, name="accuracy").__name__ == "accuracy"

    assert timed[0](completions=["a", "b"]) == [1.0, 1.0]  # no live callback: untimed
    log_dir = tmp_path / "logs"
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    with OtelRLCallback({"log_dir": str(log_dir)}) as otel:
        otel.on_init_end(args, state, control)
        otel.on_step_begin(args, state, control)
        assert timed[0](completions=["a"]) == [1.0]
        assert asyncio.run(timed[1](completions=["a", "b"])) == [0.5, 0.5]
        state.global_step = 1
        otel.on_step_end(args, state, control)
    (row,) = jsonl_rows(log_dir / "metrics.jsonl")
    assert row["step"] == 1
    assert row["metrics"]["timing/reward/judge"] >= 0.01
    assert 0 < row["metrics"]["timing/reward/exact"] < row["metrics"]["timing/step"]
