"""The run's timeline in its trackers (``tracing.picture``): the page as an HTML artifact on a
real MLflow server and as a W&B HTML panel (offline files, W&B's own reader), its image in
TensorBoard (read back with TensorBoard's reader), where the run's time went as a table at the
end, and a picture that fails costing only itself."""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.run import picture
from testkit import servers
from testkit.readers import jsonl_rows, tensorboard_accumulator

mlflow_server = servers.mlflow_server

pytestmark = pytest.mark.slow  # a drawing process per picture (~2 s of CPU each)

STEPS = 14


def _train(logger: Logger, steps: int, pause: float = 0.0) -> None:
    for step in range(steps):
        _train_one(logger, step)
        time.sleep(pause)


def _train_one(logger: Logger, step: int) -> None:
    with logger.timer("generation"):
        time.sleep(0.01)
    with logger.timer("train"):
        time.sleep(0.005)
    logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)


def _page_data(page: str) -> dict:
    """What the page's script draws: the JSON it holds (``const RUN = {...};``)."""
    found = re.search(r"<script>const RUN = (\{.*?\});</script>", page, re.S)
    assert found, "the page holds no run data"
    return json.loads(found.group(1))


def test_the_last_steps_reach_mlflow_w_b_and_tensorboard_at_the_end(
    mlflow_server, offline_trackers, tmp_path
):
    log_dir = tmp_path / "logs"
    experiment = f"timeline-{uuid.uuid4().hex[:8]}"
    cfg = {
        "log_dir": str(log_dir), "tensorboard_enabled": True,
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": mlflow_server.url, "experiment_name": experiment},
        "wandb_enabled": True, "wandb": {"project": experiment, "mode": "offline"},
        "tracing": {"enabled": True, "picture_every": 0, "picture_steps": 5},
    }  # fmt: skip
    with Logger(cfg) as logger:
        _train(logger, STEPS)
        exporters = {e.name: e for e in logger.exporters}
    last = STEPS - 1

    # JSONL keeps the page beside its plots; it is the page the other trackers got.
    (page_file,) = (log_dir / "pages" / "otel_rl" / "timeline").iterdir()
    assert page_file.name == f"step_{last}.html"
    page = page_file.read_text(encoding="utf-8")
    data = _page_data(page)
    assert [s["step"] for s in data["steps"]] == list(range(STEPS - 5, STEPS))
    drawn = sorted({(s["step"], s["name"]) for s in data["spans"] if s["name"] != "rl.step"})
    assert drawn == sorted((step, name) for step in range(STEPS - 5, STEPS)
                           for name in ("generation", "train"))  # fmt: skip

    from mlflow.tracking import MlflowClient

    mlflow = exporters["mlflow"].tracker
    client = MlflowClient(mlflow_server.url)
    folder = "pages/otel_rl/timeline"
    assert [Path(f.path).name for f in client.list_artifacts(mlflow.run_id, folder)] == [
        f"step_{last}.html"
    ]
    fetched = client.download_artifacts(mlflow.run_id, f"{folder}/step_{last}.html", str(tmp_path))
    assert Path(fetched).read_text(encoding="utf-8") == page

    # Where the run's time went, at the last step: each phase is its anatomy rows summed.
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))  # no row of its own
    generation = sum(r["metrics"]["anatomy/generation/seconds"] for r in rows)
    wall = sum(r["metrics"]["anatomy/wall/seconds"] for r in rows)
    (table,) = [t for t in jsonl_rows(log_dir / "tables.jsonl") if t["table"] == picture.TIME_TABLE]
    assert (table["step"], table["columns"]) == (last, ["part", "value"])
    parts = dict(table["rows"])
    assert parts["steps, seconds"] == pytest.approx(wall, rel=1e-6)
    assert parts["phase generation, seconds"] == pytest.approx(generation, rel=1e-6)
    held = f"tables/{picture.TIME_TABLE}"
    fetched = client.download_artifacts(mlflow.run_id, f"{held}/step_{last}.json", str(tmp_path))
    assert json.loads(Path(fetched).read_text())["data"] == table["rows"]

    images = tensorboard_accumulator(log_dir / "tensorboard").Images(picture.PAGE_NAME)
    assert [image.step for image in images] == [last]
    from PIL import Image

    png = Image.open(io.BytesIO(images[0].encoded_image_string))
    assert png.format == "PNG" and png.width >= 800

    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    run_dir = wandb_run_dirs(log_dir)[0]
    (panel,) = [r for r in read_wandb(run_dir).history if f"{picture.PAGE_NAME}._type" in r]
    assert (panel["global_step"], panel[f"{picture.PAGE_NAME}._type"]) == (last, "html-file")
    held = (run_dir / "files" / panel[f"{picture.PAGE_NAME}.path"]).read_text(encoding="utf-8")
    assert _page_data(held) == data  # the page itself, without W&B's styles injected


def test_pictures_come_at_their_interval_and_one_that_overruns_costs_only_itself(
    tmp_path, monkeypatch, otel_rl_warnings
):
    """Every drawing given 1 ms (injected) overruns: said once, the loop goes on, and the last
    picture, which has the end's own time, still arrives. Then, at a real time, pictures come
    at their interval, each at the last step sealed before it."""
    log_dir = tmp_path / "late"
    monkeypatch.setattr(picture, "DRAW_TIMEOUT_S", 0.001)
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True, "picture_every": 0.3},
           "export": {"shutdown_timeout": 60}}  # the end's picture has 30 s on a busy machine
    with Logger(cfg) as logger:
        _train(logger, 30, pause=0.05)
    said = [r.getMessage() for r in otel_rl_warnings.records if "run's timeline" in r.getMessage()]
    assert len(said) == 1 and "was not drawn within" in said[0]
    pages = sorted(p.name for p in (log_dir / "pages" / "otel_rl" / "timeline").iterdir())
    assert pages == ["step_29.html"]

    monkeypatch.setattr(picture, "DRAW_TIMEOUT_S", 120.0)
    log_dir = tmp_path / "every"
    folder = log_dir / "pages" / "otel_rl" / "timeline"
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True, "picture_every": 1.0},
           "export": {"shutdown_timeout": 60}}
    started = time.monotonic()
    with Logger(cfg) as logger:
        step = 0
        # Until a picture of the run has arrived (each takes a drawing process: seconds on a
        # busy machine), then a few steps more for the last one to show.
        while not (folder.is_dir() and any(folder.iterdir())) and step < 3000:
            _train_one(logger, step)
            step += 1
        for _ in range(5):
            _train_one(logger, step)
            step += 1
        took = time.monotonic() - started
    steps = sorted(int(p.stem.split("_")[1]) for p in folder.iterdir())
    assert steps[-1] == step - 1 and len(steps) >= 2, (steps, took)
    assert len(steps) <= took / 1.0 + 1  # at most one a second, and the last one
    for shown in steps:
        data = _page_data((folder / f"step_{shown}.html").read_text(encoding="utf-8"))
        assert data["steps"][-1]["step"] == shown  # a page is at the last step it shows


def test_a_drawing_process_that_answers_nonsense_costs_its_pictures_only(
    tmp_path, monkeypatch, otel_rl_warnings
):
    """A drawing process that exits 0 but prints no answer (``python -m this`` stands in for a
    broken install): the training loop and the run's end go on, said once, no page sent."""
    monkeypatch.setattr(picture, "DRAWING_MODULE", "this")
    log_dir = tmp_path / "nonsense"
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True, "picture_every": 0.2}}
    with Logger(cfg) as logger:
        _train(logger, 20, pause=0.05)
    said = [r.getMessage() for r in otel_rl_warnings.records if "run's timeline" in r.getMessage()]
    assert len(said) == 1 and "could not be sent (JSONDecodeError" in said[0], said
    assert not (log_dir / "pages").exists()
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r["metrics"]] == list(range(20))


def test_no_picture_without_spans_on_disk_or_when_turned_off(tmp_path):
    for name, tracing in (("off", {"enabled": False}),
                          ("no-file", {"enabled": True, "file": False}),
                          ("no-picture", {"enabled": True, "picture": False})):  # fmt: skip
        log_dir = tmp_path / name
        with Logger({"log_dir": str(log_dir), "tracing": tracing}) as logger:
            _train(logger, 3)
        assert not (log_dir / "pages").exists(), name
        assert not (log_dir / "tables.jsonl").exists(), name


def test_the_console_shows_the_run_s_time_but_no_page_and_warns_of_neither(
    tmp_path, otel_rl_warnings, capsys
):
    log_dir = tmp_path / "console"
    cfg = {"log_dir": str(log_dir), "console_enabled": True,
           "tracing": {"enabled": True, "picture_every": 0}}  # fmt: skip
    with Logger(cfg) as logger:
        _train(logger, 3)
    assert (log_dir / "pages" / "otel_rl" / "timeline" / "step_2.html").exists()
    assert not [r for r in otel_rl_warnings.records if r.levelno >= logging.WARNING]
    shown = capsys.readouterr().err
    assert "<html" not in shown
    assert f"{picture.TIME_TABLE} at step 2" in shown and "phase generation, seconds" in shown
