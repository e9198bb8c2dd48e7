"""Who may read a run's folders: the log dir and what the trackers write there take the umask's
mode (teammates read ``metrics.jsonl`` and TensorBoard files), the spool stays private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from otel_rl import Logger
from testkit.readers import jsonl_rows, tensorboard_scalars


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_log_dir_follows_the_umask_and_the_spool_stays_private(tmp_path, umask):
    old = os.umask(umask)
    try:
        log_dir = tmp_path / "a" / "b" / "run1"  # a, a/b and run1 are all created by the run
        cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": True}
        with Logger(cfg) as logger:
            logger.log_hyperparams({"lr": 1e-6})
            for step in range(3):
                logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            assert logger.flush(timeout=30)
            spool = log_dir / ".otel-rl"
            private = [spool, *spool.rglob("*")]
            private_modes = {p: _mode(p) for p in private}
    finally:
        os.umask(old)

    folder_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    shared_folders = [tmp_path / "a", tmp_path / "a" / "b", log_dir, log_dir / "tensorboard"]
    assert {p: _mode(p) for p in shared_folders} == dict.fromkeys(shared_folders, folder_mode)
    shared_files = [
        log_dir / "metrics.jsonl",
        log_dir / "hyperparams.json",
        *(log_dir / "tensorboard").glob("events.out.tfevents.*"),
    ]
    assert len(shared_files) == 3
    assert {p: _mode(p) for p in shared_files} == dict.fromkeys(shared_files, file_mode)

    spool_folders = {p: m for p, m in private_modes.items() if p.is_dir()}
    spool_files = {p: m for p, m in private_modes.items() if not p.is_dir()}
    assert any(p.name == "meta.json" for p in spool_files), private_modes
    assert set(spool_folders.values()) == {0o700}, spool_folders
    assert set(spool_files.values()) == {0o600}, spool_files

    # What the shared files hold is the run, step by step.
    assert [(r["step"], r["metrics"]["loss"]) for r in jsonl_rows(log_dir / "metrics.jsonl")] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3)),
    ]  # fmt: skip
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert [s for s, _ in scalars["loss"]] == [0, 1, 2]


def test_an_existing_log_dir_keeps_its_mode_and_a_new_spool_is_private(tmp_path):
    """A log dir the user made (0750 here) is left as it is; the spool inside is 0700."""
    log_dir = tmp_path / "team"
    log_dir.mkdir()
    os.chmod(log_dir, 0o750)
    with Logger({"log_dir": str(log_dir), "jsonl_enabled": True}) as logger:
        logger.log_metrics({"x": 2.0}, step=0)
        assert logger.flush(timeout=30)
    assert _mode(log_dir) == 0o750
    assert _mode(log_dir / ".otel-rl") == 0o700
    assert _mode(log_dir / ".otel-rl" / "spool") == 0o700
    assert [r["metrics"]["x"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [2.0]
