"""TensorBoard output read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import math

import numpy as np

from otel_rl import Logger
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars


def f32(x: float) -> float:
    """TensorBoard stores scalars as float32 (``simple_value``)."""
    return float(np.float32(x))


def test_every_key_every_step_exact_values(log_dir):
    expected: dict[str, dict[int, float]] = {}
    with Logger({"log_dir": str(log_dir), "tensorboard_enabled": True}) as logger:
        for step in range(20):
            train = {"loss": 1.0 / (step + 1), "Reward/Mean": step * 0.37 - 3, "kl": 1e-7 * step}
            val = {"accuracy": step / 20}
            logger.log_metrics(train, step=step, prefix="train")
            if step % 5 == 0:
                logger.log_metrics(val, step=step, prefix="validation")
                for k, v in val.items():
                    expected.setdefault(f"validation/{k}", {})[step] = v
            for k, v in train.items():
                expected.setdefault(f"train/{k}", {})[step] = v

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert set(expected) <= set(scalars)
    for tag, by_step in expected.items():
        assert [s for s, _ in scalars[tag]] == sorted(by_step), tag
        assert [v for _, v in scalars[tag]] == [f32(by_step[s]) for s in sorted(by_step)], tag


def test_nan_and_inf_arrive(log_dir):
    with Logger({"log_dir": str(log_dir), "tensorboard_enabled": True}) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        logger.log_metrics({"loss": float("nan"), "grad": float("inf")}, step=1)
        logger.log_metrics({"loss": 0.25, "grad": -float("inf")}, step=2)
        assert logger.stats["nonfinite"] == 3

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    loss = dict(scalars["loss"])
    assert loss[0] == 0.5 and loss[2] == 0.25
    assert math.isnan(loss[1])
    assert dict(scalars["grad"]) == {1: math.inf, 2: -math.inf}


def test_text_histogram_and_custom_dir(tmp_path):
    tb_dir = tmp_path / "elsewhere"
    cfg = {"log_dir": str(tmp_path / "logs"), "tensorboard_enabled": True,
           "tensorboard": {"log_dir": str(tb_dir)}}
    with Logger(cfg) as logger:
        logger.log_metrics({"sample": "the answer is 42"}, step=3, prefix="val")
        logger.log_histogram([0.0, 1.0, 1.0, 2.0, 10.0], step=4, name="train/advantages")

    assert not (tmp_path / "logs" / "tensorboard").exists()
    acc = tensorboard_accumulator(tb_dir)
    text = acc.Tensors("val/sample")
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in text] == [
        (3, "the answer is 42")
    ]
    (hist,) = acc.Histograms("train/advantages")
    assert hist.step == 4
    assert hist.histogram_value.num == 5
    assert hist.histogram_value.sum == 14.0
    assert (hist.histogram_value.min, hist.histogram_value.max) == (0.0, 10.0)
    assert sum(hist.histogram_value.bucket) == 5


def test_many_keys_and_steps_are_not_capped(log_dir):
    """EventAccumulator keeps only 10,000 points per tag by default; we read with no cap."""
    keys = [f"k{i:03d}" for i in range(120)]
    with Logger({"log_dir": str(log_dir), "tensorboard_enabled": True}) as logger:
        for step in range(50):
            logger.log_metrics({k: float(i * step) for i, k in enumerate(keys)}, step=step)
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert set(keys) <= set(scalars)
    assert dict(scalars["k119"]) == {s: f32(119.0 * s) for s in range(50)}


def test_a_lone_surrogate_costs_only_its_key_and_a_text_keeps_its_row(tmp_path, otel_rl_warnings):
    """Bytes decoded with ``surrogateescape`` leave lone surrogates, which no UTF-8 holds. A key
    with one is left out, reported; a text value with one reaches TensorBoard with U+FFFD in its
    place, and the rest of its row arrives (before, TensorBoard refused the whole row); in a
    hyperparameter's name or value it is shown as U+FFFD too (before, TensorBoard refused the
    hyperparameters and every row written after them)."""
    cfg = {"log_dir": str(tmp_path), "tensorboard_enabled": True, "jsonl_enabled": True}
    with Logger(cfg) as logger:
        logger.log_hyperparams({"lr": 0.1, "data\udc80": "x\udc80"})
        logger.log_metrics({"loss": 0.5, "note": "file \udc80.txt", "bad\udc80key": 1.0}, step=3)
        logger.log_metrics({"loss": 0.25}, step=4)
    acc = tensorboard_accumulator(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 0.5), (4, 0.25)]
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("note")] == [
        (3, "file \ufffd.txt")
    ]
    assert not any("bad" in tag for tag in acc.Tags()["scalars"])
    rows = jsonl_rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (3, {"loss": 0.5, "note": "file \udc80.txt"}), (4, {"loss": 0.25})
    ]
    said = otel_rl_warnings.messages
    assert any("'bad\\udc80key'" in m and "lone surrogate" in m for m in said), said


def test_replay_counts_the_events_a_write_cut_short_left_whole(tmp_path):
    """A kill inside one write leaves its first events whole and a torn one: ``landed_since``
    counts the whole step events after the noted position (the hyperparameter record the write
    starts with is not one), so replay sends only the rest. The cut is made by truncating the
    real event file where the kill would have stopped the copy."""
    from otel_rl.core.records import StepBatch
    from otel_rl.exporters.tensorboard import TensorBoardExporter

    exporter = TensorBoardExporter(tmp_path / "tb")
    writer = exporter.delivery.writer()
    assert writer.open() is None
    exporter.write_hyperparams({"lr": 0.1})  # pending: written just before the first step
    position = exporter.write_position()
    batches = [(s, StepBatch(step=s, values={"x": float(s)})) for s in range(8)]
    assert writer.write(batches) == (8, None)
    writer.flush()
    path = tmp_path / "tb" / position["file"]
    whole = path.stat().st_size
    assert exporter.holds_since(position, 9)  # the hyperparameters and eight steps
    assert exporter.landed_since(position, 8) == 8
    with path.open("r+b") as f:  # the last event torn: seven whole after the hyperparameters
        f.truncate(whole - 5)
    assert exporter.landed_since(position, 8) == 7
    assert not exporter.holds_since(position, 8)
    exporter.close(0)
