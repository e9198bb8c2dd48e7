"""SwanLab exporter, offline: read back from ``run-<id>.swanlab`` with SwanLab's own
``DataStoreReader`` and record protobufs, plus the media and config files it wrote."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from otel_rl.config.loading import resolve_settings

pytest.importorskip("swanlab")

from otel_rl import Logger
from otel_rl.core.records import StepBatch
from otel_rl.exporters.swanlab import SwanLabExporter
from testkit.tracker_readers import read_swanlab, swanlab_run_dirs


@pytest.fixture
def swanlab_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))
    return tmp_path / "logs"


def _config(log_dir: Path, **swanlab: object) -> dict:
    return {
        "log_dir": str(log_dir),
        "jsonl_enabled": False,
        "swanlab_enabled": True,
        "swanlab": {"project": "otel-rl-tests", "mode": "offline", **swanlab},
    }


@pytest.mark.slow
def test_metrics_text_config_plot_and_gpu_axis(swanlab_home):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(2, 2))
    axes.plot([0, 1], [1, 0])
    with Logger(_config(swanlab_home, name="rows")) as logger:
        logger.log_hyperparams({"optimizer": {"lr": 3e-4}, "seed": 7})
        for step in range(4):
            logger.log_metrics(
                {
                    "loss": 1.0 / (step + 1),
                    "kl": math.nan if step == 2 else 0.1 * step,
                    "sample": f"answer {step}",
                },
                step=step,
                prefix="train",
            )
            if step == 1:  # GPU rows between training steps, on their own axis
                (exporter,) = logger.exporters
                for seconds in (30, 35):
                    exporter.submit(
                        StepBatch(
                            step=seconds,
                            values={"ray/node.n1.gpu.0.util": float(seconds)},
                            axis="ray/ray_step",
                        )
                    )
        logger.log_plot(figure, step=3, name="plots/reward")
        logger.log_histogram([1.0, 2.0, 2.0, 7.0], step=3, name="adv", bins=2)
    plt.close(figure)

    (run_dir,) = swanlab_run_dirs(swanlab_home / "swanlab")
    run = read_swanlab(run_dir)
    assert run.scalars["train/loss"] == [(s, 1.0 / (s + 1)) for s in range(4)]
    kl = run.scalars["train/kl"]
    assert [s for s, _ in kl] == [0, 1, 2, 3]
    assert math.isnan(kl[2][1]) and kl[3] == (3, pytest.approx(0.3))
    assert run.scalars["ray/node.n1.gpu.0.util"] == [(30, 30.0), (35, 35.0)]
    assert run.scalars["ray/ray_step"] == [(30, 30.0), (35, 35.0)]

    texts = run.media["train/sample"]
    assert [(step, kind) for step, kind, _ in texts] == [(s, "COLUMN_TYPE_TEXT") for s in range(4)]
    for step, _, (filename,) in texts:
        assert run.media_file("text", filename).read_text() == f"answer {step}"
    ((step, kind, (image,)),) = run.media["plots/reward"]
    assert (step, kind) == (3, "COLUMN_TYPE_IMAGE")
    assert run.media_file("image", image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # No histogram type in SwanLab: the summary arrives as scalars.
    assert {k: v for k, v in run.scalars.items() if k.startswith("adv/")} == {
        "adv/count": [(3, 4.0)], "adv/sum": [(3, 12.0)], "adv/mean": [(3, 3.0)],
        "adv/min": [(3, 1.0)], "adv/max": [(3, 7.0)],
    }
    assert run.config == {"optimizer.lr": 3e-4, "seed": 7}
    assert run.finish_state == "RUN_STATE_FINISHED"


@pytest.mark.slow
def test_backwards_step_first_value_wins_and_is_warned_and_crash_state(
    swanlab_home, caplog
):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    with pytest.raises(RuntimeError), Logger(_config(swanlab_home, name="back")) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
        logger.log_metrics({"loss": 99.0, "late": 5.0}, step=1)
        (exporter,) = logger.exporters
        raise RuntimeError("training crashed")
    assert exporter.stats["backwards_steps"] == 1
    assert any("swanlab: step went backwards (1 after 2)" in r.getMessage() for r in caplog.records)

    run = read_swanlab(swanlab_run_dirs(swanlab_home / "swanlab")[0])
    # SwanLab keeps the first value at (loss, 1); a key new at that step is stored.
    assert run.scalars["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert run.scalars["late"] == [(1, 5.0)]
    assert run.finish_state == "RUN_STATE_CRASHED"
    assert run.finish_error == "training exited with code 1"


def test_log_dir_default_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    cfg = resolve_settings({"log_dir": str(tmp_path), "swanlab": {"mode": "offline"}})
    exporter = SwanLabExporter.from_config(cfg)
    try:
        assert exporter.init_kwargs == {"mode": "offline", "log_dir": str(tmp_path / "swanlab")}
    finally:
        exporter.shutdown()
    # SWANLAB_LOG_DIR (read by SwanLab itself) wins over the default.
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "elsewhere"))
    exporter = SwanLabExporter.from_config(cfg)
    try:
        assert "log_dir" not in exporter.init_kwargs
    finally:
        exporter.shutdown()


@pytest.mark.slow
def test_swanlab_mode_from_environment_and_disabled(monkeypatch, swanlab_home, tmp_path):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "from-env"))
    cfg = {"log_dir": str(swanlab_home), "jsonl_enabled": False, "swanlab_enabled": True}
    with Logger({**cfg, "swanlab": {"project": "otel-rl-tests"}}) as logger:
        logger.log_metrics({"loss": 0.5}, step=4)
    run = read_swanlab(swanlab_run_dirs(tmp_path / "from-env")[0])
    assert run.scalars["loss"] == [(4, 0.5)]

    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "disabled"))
    with Logger({**cfg, "swanlab": {"mode": "disabled"}}) as logger:
        logger.log_metrics({"loss": 0.5}, step=4)
        (exporter,) = logger.exporters
    assert exporter.stats["delivered"] == 1 and exporter.stats["retries"] == 0
    assert swanlab_run_dirs(tmp_path / "disabled") == []
