"""The demo, end to end, through the installed console script."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.readers import jsonl_rows, tensorboard_scalars


def test_demo_runs_and_writes_every_output(tmp_path):
    exe = shutil.which("otel-rl")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rl.cli"]
    out = subprocess.run(
        [*cmd, "demo", "--steps", "5", "--log-dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert f"tensorboard --logdir {tmp_path / 'demo' / 'tensorboard'}" in out.stdout
    assert "step 0" in out.stderr  # the console table

    rows = jsonl_rows(tmp_path / "demo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        m = row["metrics"]
        assert m["train/reward/count"] == 16.0
        assert m["train/reward/min"] <= m["train/reward/mean"] <= m["train/reward/max"]
        assert m["timing/generation"] > 0.003 and m["timing/train"] > 0.002
        assert {"train/loss", "train/kl", "train/response_length/p90"} <= set(m)
    # loss falls, reward mean rises (noisy per step, clear over the run)
    assert rows[-1]["metrics"]["train/loss"] < rows[0]["metrics"]["train/loss"]

    scalars = tensorboard_scalars(tmp_path / "demo" / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4]
    assert (tmp_path / "demo" / "hyperparams.json").exists()


def test_demo_backends_flag_and_bad_backend(tmp_path):
    from otel_rl.cli import main

    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "jsonl"]) == 0
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "nope"]) == 2
