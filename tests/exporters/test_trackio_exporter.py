"""Trackio exporter: read back from Trackio's SQLite store (``$TRACKIO_DIR/<project>.db``) with
Trackio's own ``SQLiteStorage``. ``testkit.tracker_readers`` points ``TRACKIO_DIR`` at a temporary
directory before Trackio is first imported."""

from __future__ import annotations

import logging
import math
import uuid

import pytest

from testkit.tracker_readers import read_trackio, trackio_dir

pytest.importorskip("trackio")

from otel_rl import Logger
from otel_rl.core.records import StepBatch


def _config(tmp_path, project: str, **trackio: object) -> dict:
    return {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": False,
        "trackio_enabled": True,
        "trackio": {"project": project, "name": "run", "auto_log_cpu": False, **trackio},
    }


def _project() -> str:
    return f"otel-rl-tests-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
def test_rows_config_and_gpu_axis(tmp_path):
    project = _project()
    expected = {}
    with Logger(_config(tmp_path, project)) as logger:
        logger.log_hyperparams({"optimizer": {"lr": 3e-4}, "seed": 7})
        for step in range(4):
            row = {"train/loss": 1.0 / (step + 1), "train/sample": f"answer {step}"}
            if step == 2:
                row["train/kl"] = math.nan
            logger.log_metrics(row, step=step)
            expected[step] = row
            if step == 1:
                (exporter,) = logger.exporters
                exporter.submit(
                    StepBatch(step=35, values={"ray/node.n1.gpu.0.util": 35.0}, axis="ray/ray_step")
                )

    assert (trackio_dir() / f"{project}.db").exists()
    rows, config = read_trackio(project, "run")
    assert config == {"optimizer.lr": 3e-4, "seed": 7}
    training = [r for r in rows if "train/loss" in r]
    assert [int(r["step"]) for r in training] == [0, 1, 2, 3]
    for row in training:
        want = expected[int(row["step"])]
        got = {k: v for k, v in row.items() if k not in ("step", "timestamp")}
        assert set(got) == set(want)
        for key, value in want.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[key])
            else:
                assert got[key] == value
    (gpu,) = [r for r in rows if "ray/ray_step" in r]
    assert int(gpu["step"]) == 35 and gpu["ray/node.n1.gpu.0.util"] == 35.0
    assert gpu["ray/ray_step"] == 35


@pytest.mark.slow
def test_backwards_step_kept_late_hyperparams_and_media(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    project = _project()
    with Logger(_config(tmp_path, project)) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
        logger.log_metrics({"loss": 99.0}, step=1)
        logger.log_hyperparams({"seed": 11})  # after the first rows
        logger.log_histogram([0.0, 1.0, 1.0, 2.0], step=3, name="adv", bins=2)
        logger.log_table("samples", ["prompt", "score"], [["1+1", 1.0]], step=3)
        (exporter,) = logger.exporters
    assert exporter.stats["backwards_steps"] == 1
    assert any("trackio: step went backwards (1 after 2)" in r.getMessage() for r in caplog.records)

    rows, config = read_trackio(project, "run")
    assert [(int(r["step"]), r["loss"]) for r in rows if "loss" in r] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (1, 99.0)
    ]
    assert config == {"seed": 11}
    (hist,) = [r["adv"] for r in rows if "adv" in r]
    assert hist["_type"] == "trackio.histogram"
    assert hist["values"] == [1, 3] and hist["bins"] == [0.0, 1.0, 2.0]
    (table,) = [r["samples"] for r in rows if "samples" in r]
    assert table["_type"] == "trackio.table"
    assert table["_value"] == [{"prompt": "1+1", "score": 1.0}]


@pytest.mark.slow
def test_hyperparams_after_the_last_row_are_stored(tmp_path):
    project = _project()
    with Logger(_config(tmp_path, project)) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        logger.flush()
        logger.log_hyperparams({"seed": 5, "model": {"name": "tiny"}})
    rows, config = read_trackio(project, "run")
    assert config == {"seed": 5, "model.name": "tiny"}
    assert [(int(r["step"]), r.get("loss")) for r in rows] == [(0, 0.5), (0, None)]
