""":class:`~otel_rl.compat.accelerate.OtelRLTracker` in a real ``accelerate.Accelerator`` on CPU.

A loop written on accelerate (``init_trackers``, ``log``, ``end_training``) trains a small
model; the losses it logs, the config it starts with and its status are read back from the JSONL
file and TensorBoard's event files (TensorBoard's reader), at the steps they were logged at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars
from tests.compat.hf_tiny import offline

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

STEPS = (1, 2, 3, 4, 5)


def f32(x: float) -> float:
    return float(np.float32(x))


def session_status(tb_dir: Path) -> Any:
    """The run's status in TensorBoard's HPARAMS tab (``session_end_info``)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = (
        tensorboard_accumulator(tb_dir)
        .SummaryMetadata("_hparams_/session_end_info")
        .plugin_data.content
    )
    return plugin_data_pb2.HParamsPluginData.FromString(content).session_end_info.status


def accelerator_with(cfg: dict[str, Any]) -> tuple[Any, Any]:
    from accelerate import Accelerator

    from otel_rl.compat.accelerate import OtelRLTracker

    tracker = OtelRLTracker(cfg)
    return Accelerator(cpu=True, log_with=[tracker]), tracker


def train(accelerator: Any, steps: tuple[int, ...], fail_at: int | None = None) -> dict[int, float]:
    """A regression on CPU through the accelerator; the loss of each step, as logged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True)
    logger = accelerator.get_tracker("otel_rl", unwrap=True)
    losses = {}
    for step in steps:
        if step == fail_at:
            raise RuntimeError("CUDA out of memory")
        with logger.timer("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        accelerator.log({"train/loss": losses[step], "train/lr": 0.1}, step=step)
    return losses


def test_an_accelerate_loop_logs_through_otel_rl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.plugins.hparams import api_pb2

    from otel_rl import Logger

    offline(monkeypatch)
    log_dir = tmp_path / "logs"
    accelerator, tracker = accelerator_with({"log_dir": str(log_dir), "tensorboard_enabled": True})
    accelerator.init_trackers("tiny", config={"lr": 0.1, "model": {"in_features": 4}})
    assert isinstance(accelerator.get_tracker("otel_rl", unwrap=True), Logger)
    assert accelerator.get_tracker("otel_rl") is tracker
    losses = train(accelerator, STEPS)
    # accelerate's own log_kwargs reach the tracker: a prefix, and the step sealed at once
    accelerator.log({"accuracy": 0.5}, step=6, log_kwargs={"otel_rl": {"prefix": "eval"}})
    for value in (1.0, 2.0):  # no step: each call a step of its own, after the highest
        accelerator.log({"grad_norm": value})
    accelerator.end_training()
    assert tracker.finished

    # what the loop logged (the steps' anatomy rows aside: docs/anatomy.md)
    rows = {r["step"]: {k: v for k, v in r["metrics"].items() if not k.startswith("anatomy/")}
            for r in jsonl_rows(log_dir / "metrics.jsonl")}  # fmt: skip
    assert sorted(rows) == [*STEPS, 6, 7, 8]
    assert (rows[7], rows[8]) == ({"grad_norm": 1.0}, {"grad_norm": 2.0})
    for step in STEPS:
        assert rows[step]["train/loss"] == losses[step]
        assert rows[step]["train/lr"] == 0.1
        assert rows[step]["timing/forward"] > 0
    assert losses[5] < losses[1]  # it trained
    assert rows[6] == {"eval/accuracy": 0.5}
    params = json.loads((log_dir / "hyperparams.json").read_text())
    assert params == {"lr": 0.1, "model.in_features": 4}

    tb = tensorboard_scalars(log_dir / "tensorboard")
    assert tb["train/loss"] == [(s, f32(losses[s])) for s in STEPS]
    assert tb["eval/accuracy"] == [(6, 0.5)]
    assert session_status(log_dir / "tensorboard") == api_pb2.STATUS_SUCCESS


def test_end_training_after_an_exception_marks_the_run_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.plugins.hparams import api_pb2

    offline(monkeypatch)
    log_dir = tmp_path / "logs"
    accelerator, _ = accelerator_with({"log_dir": str(log_dir), "tensorboard_enabled": True})
    accelerator.init_trackers("tiny", config={"lr": 0.1})
    with pytest.raises(RuntimeError):
        try:
            train(accelerator, STEPS, fail_at=3)
        finally:
            accelerator.end_training()  # no exit code: the exception under way decides
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == [1, 2]
    assert session_status(log_dir / "tensorboard") == api_pb2.STATUS_FAILURE
