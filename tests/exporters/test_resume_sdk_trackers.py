"""A relaunched run (same ``run_id``, same ``log_dir``) continues its W&B, SwanLab and Trackio
runs, read back with each tracker's own reader: W&B's offline files (two ``offline-run-*`` parts
with one run id, the second resumed), SwanLab's offline folders (one id), Trackio's SQLite store
(one run). The attempts are in each run's config."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from otel_rl import Logger
from testkit.tracker_readers import (
    read_swanlab,
    read_trackio,
    read_wandb,
    swanlab_run_dirs,
    wandb_folder_run_id,
    wandb_run_dirs,
    wandb_wrote_a_run,
)

for _module in ("wandb", "swanlab", "trackio"):
    pytest.importorskip(_module)


def _launch(log_dir: Path, project: str) -> dict[str, Any]:
    """The config of every launch: only the run's identity is fixed, the tracker runs are not."""
    return {
        "log_dir": str(log_dir),
        "run_id": "grpo-job-7",
        "jsonl_enabled": False,
        "wandb_enabled": True,
        "wandb": {"project": project},
        "swanlab_enabled": True,
        "swanlab": {"project": project, "mode": "offline"},
        "trackio_enabled": True,
        "trackio": {"project": project, "auto_log_cpu": False},
    }


@pytest.mark.slow
def test_a_relaunch_continues_the_wandb_swanlab_and_trackio_runs(
    offline_trackers, tmp_path, otel_rl_warnings
):
    log_dir = tmp_path / "logs"
    project = f"otel-rl-resume-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError), Logger(_launch(log_dir, project)) as first:
        for step in range(8):  # checkpoint at 5, crash after 7
            first.log_metrics({"loss": float(step)}, step=step)
        raise RuntimeError("node lost")
    with Logger(_launch(log_dir, project)) as second:  # reloads the step-5 checkpoint
        assert second.history.attempt == 2
        for step in range(6, 10):
            second.log_metrics({"loss": 100.0 + step}, step=step)
    first_rows = [(s, float(s)) for s in range(8)]
    second_rows = [(s, 100.0 + s) for s in range(6, 10)]

    parts = [read_wandb(d) for d in wandb_run_dirs(log_dir)]
    assert len(parts) == 2 and parts[0].run_id == parts[1].run_id
    assert (parts[0].resumed, parts[1].resumed) == (False, True)
    assert (parts[0].exit_code, parts[1].exit_code) == (1, 0)
    assert parts[0].series("loss") == first_rows
    # The rewound steps are kept as the new attempt's points at their global_step.
    assert parts[1].series("loss") == second_rows
    # Each row of the relaunched attempt says so; the first attempt's rows are as ever.
    assert parts[1].series("otel_rl/attempt") == [(s, 2) for s in range(6, 10)]
    assert parts[0].series("otel_rl/attempt") == []
    assert parts[1].metrics["otel_rl/attempt"] == "global_step"
    assert parts[1].config == {"otel_rl.attempts": 2, "otel_rl.resume_steps": "6"}

    swanlab = [read_swanlab(d) for d in swanlab_run_dirs(log_dir / "swanlab")]
    assert len(swanlab) == 2 and swanlab[0].run_id == swanlab[1].run_id
    assert swanlab[0].scalars["loss"] == first_rows
    assert swanlab[1].scalars["loss"] == second_rows
    assert swanlab[1].config == {"otel_rl.attempts": 2, "otel_rl.resume_steps": "6"}
    assert (swanlab[0].finish_state, swanlab[1].finish_state) == (
        "RUN_STATE_CRASHED",
        "RUN_STATE_FINISHED",
    )
    said = [r.getMessage() for r in otel_rl_warnings.records if "swanlab: run resumed" in
            r.getMessage()]  # fmt: skip
    assert len(said) == 1 and "at step 6 (attempt 2)" in said[0]

    from trackio.sqlite_storage import SQLiteStorage

    (run,) = [r["name"] if isinstance(r, dict) else r for r in SQLiteStorage.get_runs(project)]
    rows, config = read_trackio(project, run)
    # Trackio keeps both attempts' rows at the repeated steps, in the order they came.
    assert [(int(r["step"]), r["loss"]) for r in rows if "loss" in r] == first_rows + second_rows
    assert config == {"otel_rl.attempts": 2, "otel_rl.resume_steps": "6"}


def test_a_third_launch_continues_the_same_trackio_run_and_records_its_attempt(
    offline_trackers, tmp_path
):
    """Every launch continues the one Trackio run; its config holds the latest attempt and the
    step it began at (Trackio does not hand a continued run its stored config back)."""
    log_dir = tmp_path / "logs"
    project = f"otel-rl-resume-{uuid.uuid4().hex[:8]}"
    cfg = {**_launch(log_dir, project), "wandb_enabled": False, "swanlab_enabled": False}
    for first_step in (0, 4, 2):
        with Logger(cfg) as logger:
            logger.log_metrics({"loss": float(first_step)}, step=first_step)
            logger.log_metrics({"loss": first_step + 0.5}, step=first_step + 1)
    from trackio.sqlite_storage import SQLiteStorage

    (run,) = [r["name"] if isinstance(r, dict) else r for r in SQLiteStorage.get_runs(project)]
    rows, config = read_trackio(project, run)
    assert [(int(r["step"]), r["loss"]) for r in rows if "loss" in r] == [
        (0, 0.0),
        (1, 0.5),
        (4, 4.0),
        (5, 4.5),
        (2, 2.0),
        (3, 2.5),
    ]
    assert config == {"otel_rl.attempts": 3, "otel_rl.resume_steps": "2"}


@pytest.mark.slow
def test_a_rewind_given_by_hand_wins_over_the_relaunch_resume(offline_trackers, tmp_path):
    """W&B refuses ``resume`` beside ``resume_from``: the relaunch's ``resume`` gives way to
    a rewind the user asks for (offline W&B ignores the rewind itself: it needs the server)."""
    from otel_rl.exporters.wandb import WandbExporter

    exporter = WandbExporter({"project": "p", "id": "abc", "resume": "allow",
                              "resume_from": "abc?_step=200", "dir": str(tmp_path)})  # fmt: skip
    try:
        exporter.open()
        assert exporter.run.id == "abc"
        assert "resume" not in exporter.init_kwargs
    finally:
        exporter.close(0)
        exporter.shutdown()


_KILLED_IN_INIT = """
import sys, time
from otel_rl import Logger
logger = Logger({"log_dir": sys.argv[1], "run_id": "grpo-job-7", "jsonl_enabled": False,
                 "wandb_enabled": True, "wandb": {"project": sys.argv[2]}})
logger.log_metrics({"loss": 1.0}, step=0)
logger.log_metrics({"loss": 1.5}, step=1)  # seals step 0: W&B starts its run to take it
time.sleep(600)  # killed long before
"""


@pytest.mark.slow
def test_a_launch_killed_while_wandb_starts_its_run_is_continued_under_that_run_id(
    offline_trackers, tmp_path
):
    """SIGKILLed while ``wandb.init`` is still starting the run (its offline folder exists, no
    run record is written yet): the relaunch continues that run id, and the steps the killed
    launch logged reach the run through the relaunch's delivery of its spool."""
    log_dir = tmp_path / "logs"
    project = f"otel-rl-resume-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    first = subprocess.Popen([sys.executable, "-c", _KILLED_IN_INIT, str(log_dir), project],
                             env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list((log_dir / "wandb").glob("offline-run-*")):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.005)
    finally:
        first.kill()
        first.wait(30)
    (killed_in_init,) = wandb_run_dirs(log_dir)
    assert not wandb_wrote_a_run(killed_in_init)  # killed before W&B wrote its run
    with Logger({**_launch(log_dir, project), "swanlab_enabled": False,
                 "trackio_enabled": False}) as relaunch:  # fmt: skip
        assert relaunch.history.attempt == 2
        relaunch.log_metrics({"loss": 2.0}, step=2)
    folders = wandb_run_dirs(log_dir)
    assert {wandb_folder_run_id(folder) for folder in folders} == {
        wandb_folder_run_id(killed_in_init)
    }
    parts = [read_wandb(folder) for folder in folders if wandb_wrote_a_run(folder)]
    assert {part.run_id for part in parts} == {wandb_folder_run_id(killed_in_init)}
    rows = sorted(row for part in parts for row in part.series("loss"))
    # Step 1 was still being logged at the kill: it arrives only if a checkpoint of it reached
    # the spool first (one is taken every export.fsync_interval; the kill may come sooner).
    assert rows in ([(0, 1.0), (2, 2.0)], [(0, 1.0), (1, 1.5), (2, 2.0)])

