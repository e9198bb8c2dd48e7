"""W&B exporter, offline: every row is read back from the run's ``.wandb`` log with W&B's own
decoder (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from otel_rl import Logger
from otel_rl.core.records import StepBatch
from testkit.tracker_readers import read_wandb, wandb_number, wandb_offline_env, wandb_run_dirs


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    wandb_offline_env(monkeypatch, tmp_path)
    return tmp_path / "logs"


def _config(log_dir: Path, **wandb: object) -> dict:
    return {
        "log_dir": str(log_dir),
        "jsonl_enabled": False,
        "wandb_enabled": True,
        "wandb": {"project": "otel-rl-tests", **wandb},
    }


def _gpu_batch(seconds: int, util: float) -> StepBatch:
    """What the Ray GPU bridge hands the trackers: a row on the ``ray/ray_step`` time axis."""
    return StepBatch(
        step=seconds,
        values={"ray/node.n1.gpu.0.util": util, "ray/node.n1.gpu.0.mem_gb": util / 10},
        axis="ray/ray_step",
    )


@pytest.mark.slow
def test_rows_config_and_gpu_axis_arrive_without_dropping_a_step(wandb_offline):
    expected: dict[int, dict[str, object]] = {}
    with Logger(_config(wandb_offline, name="rows")) as logger:
        logger.log_hyperparams({"optimizer": {"lr": 3e-4, "betas": [0.9, 0.99]}, "seed": 7})
        for step in range(6):
            row = {
                "train/loss": 1.0 / (step + 1),
                "train/reward/mean": step * 0.5 - 1.0,
                "train/sample": f"answer {step}",
            }
            if step == 3:
                row["train/grad_norm"] = math.nan
                row["train/kl"] = math.inf
            logger.log_metrics(row, step=step)
            expected[step] = row
            if step in (1, 2):
                # Two GPU rows between training steps: NeMo RL's logger lets such rows advance
                # W&B's step, which then drops the following training steps.
                (exporter,) = logger.exporters
                exporter.submit(_gpu_batch(10 * step, 50.0 + step))
                exporter.submit(_gpu_batch(10 * step + 5, 60.0 + step))

    (run_dir,) = wandb_run_dirs(wandb_offline)
    run = read_wandb(run_dir)
    training = [row for row in run.history if "global_step" in row]
    assert [row["global_step"] for row in training] == list(range(6))
    for row in training:
        want = expected[row["global_step"]]
        got = {k: v for k, v in row.items() if not k.startswith("_") and k != "global_step"}
        assert set(got) == set(want)
        for key, value in want.items():
            if isinstance(value, str):
                assert got[key] == value
            elif math.isnan(value):
                assert math.isnan(wandb_number(got[key]))
            else:
                assert wandb_number(got[key]) == value

    gpu = [row for row in run.history if "ray/ray_step" in row]
    assert [(r["ray/ray_step"], r["ray/node.n1.gpu.0.util"]) for r in gpu] == [
        (10, 51.0), (15, 61.0), (20, 52.0), (25, 62.0)
    ]
    assert all("global_step" not in r for r in gpu)
    # Each metric is bound to its own x-axis.
    assert run.metrics["train/loss"] == "global_step"
    assert run.metrics["ray/node.n1.gpu.0.util"] == "ray/ray_step"
    assert run.metrics["ray/ray_step"] is None
    assert run.config == {"optimizer.lr": 3e-4, "optimizer.betas": [0.9, 0.99], "seed": 7}
    assert run.exit_code == 0


@pytest.mark.slow
def test_backwards_step_is_kept_and_warned_and_step_metric_prefix_is_bound(
    wandb_offline, caplog
):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    with Logger(_config(wandb_offline, name="backwards")) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step, prefix="train")
        logger.log_metrics({"loss": 99.0}, step=1, prefix="train")  # e.g. resumed from step 1
        logger.log_metrics(
            {"accuracy": 0.75, "val/epoch": 4.0}, step=3, prefix="val", step_metric="val/epoch"
        )
        (exporter,) = logger.exporters
    assert exporter.stats["backwards_steps"] == 1
    assert any("wandb: step went backwards (1 after 2)" in r.getMessage() for r in caplog.records)

    run = read_wandb(wandb_run_dirs(wandb_offline)[0])
    assert run.series("train/loss") == [(0, 0), (1, 1), (2, 2), (1, 99)]
    assert run.series("val/accuracy") == [(3, 0.75)]
    assert run.series("val/accuracy", axis="val/epoch") == [(4, 0.75)]
    assert run.metrics["val/accuracy"] == "val/epoch"
    assert run.metrics["val/epoch"] is None


@pytest.mark.slow
def test_plot_histogram_and_table(wandb_offline):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(2, 2))
    axes.plot([0, 1, 2], [2, 1, 3])
    with Logger(_config(wandb_offline, name="media")) as logger:
        logger.log_plot(figure, step=2, name="plots/reward")
        logger.log_histogram([0.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0], step=2, name="adv", bins=4)
        logger.log_table(
            "samples", ["prompt", "response", "score"], [["1+1", "2", 1.0], ["2+2", "5", 0.0]],
            step=2,
        )
    plt.close(figure)

    run_dir = wandb_run_dirs(wandb_offline)[0]
    run = read_wandb(run_dir)
    (image_row,) = [r for r in run.history if "plots/reward._type" in r]
    assert image_row["global_step"] == 2 and image_row["plots/reward._type"] == "image-file"
    image = run_dir / "files" / image_row["plots/reward.path"]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (hist_row,) = [r for r in run.history if "adv._type" in r]
    assert hist_row["global_step"] == 2 and hist_row["adv._type"] == "histogram"
    assert hist_row["adv.values"] == [1, 2, 1, 4]  # [0,1) [1,2) [2,3) [3,4]
    assert hist_row["adv.bins"] == [0, 1, 2, 3, 4]

    (table_row,) = [r for r in run.history if "samples._type" in r]
    assert table_row["global_step"] == 2
    table = json.loads((run_dir / "files" / table_row["samples.path"]).read_text())
    assert table["columns"] == ["prompt", "response", "score"]
    assert table["data"] == [["1+1", "2", 1.0], ["2+2", "5", 0.0]]


def test_media_still_arrives_after_w_b_s_media_folder_is_removed(wandb_offline):
    """W&B writes media to one temporary folder it makes at import and removes at exit, so a
    fork child that exits normally (running the parent's ``atexit`` functions), or a ``/tmp``
    cleaner on a long run, takes it from under the run. The fault is injected as that removal,
    between two tables: both arrive, each at its step with its own rows."""
    import shutil

    from wandb.sdk.data_types._private import MEDIA_TMP

    with Logger(_config(wandb_offline, name="media-folder")) as logger:
        logger.log_table("samples", ["prompt", "score"], [["before", 1.0]], step=1)
        logger.flush()
        shutil.rmtree(MEDIA_TMP.name)
        logger.log_table("samples", ["prompt", "score"], [["after", 2.0]], step=2)
    run_dir = wandb_run_dirs(wandb_offline)[0]
    rows = [r for r in read_wandb(run_dir).history if "samples._type" in r]
    tables = [json.loads((run_dir / "files" / r["samples.path"]).read_text()) for r in rows]
    assert [(r["global_step"], t["data"]) for r, t in zip(rows, tables, strict=True)] == [
        (1, [["before", 1.0]]), (2, [["after", 2.0]]),
    ]  # fmt: skip


@pytest.mark.slow
def test_exit_code_and_resume_by_run_id(wandb_offline):
    with pytest.raises(RuntimeError), Logger(_config(wandb_offline, id="resume-me")) as logger:
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.log_metrics({"loss": 0.5}, step=1)
        raise RuntimeError("training crashed")
    cfg = _config(wandb_offline, id="resume-me", resume="allow")
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 0.25}, step=1)  # resumed from the step-1 checkpoint
        logger.log_metrics({"loss": 0.125}, step=2)

    first, second = (read_wandb(d) for d in wandb_run_dirs(wandb_offline))
    assert first.run_id == second.run_id == "resume-me"
    assert first.exit_code == 1 and second.exit_code == 0
    assert second.resumed
    assert first.series("loss") == [(0, 1), (1, 0.5)]
    assert second.series("loss") == [(1, 0.25), (2, 0.125)]
