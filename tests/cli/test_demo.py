"""The demo, end to end, through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from testkit.readers import jsonl_rows, tensorboard_scalars


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """``otel-rl demo ARGS`` through the installed console script (the module if none)."""
    exe = shutil.which("otel-rl")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rl.cli"]
    return subprocess.run(
        [*cmd, "demo", *args], capture_output=True, text=True, timeout=120, check=True
    )


def test_demo_runs_and_writes_every_output(tmp_path):
    out = demo("--steps", "5", "--log-dir", str(tmp_path / "demo"))
    run = tmp_path / "demo" / "exp_001"
    assert f"This run is in {run}/:" in out.stdout
    assert f"metrics (JSONL):  {run / 'metrics.jsonl'}" in out.stdout
    assert f"tensorboard --logdir {tmp_path / 'demo'}" in out.stdout
    assert "step 0" in out.stderr  # the console table

    rows = jsonl_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        m = row["metrics"]
        assert m["train/reward/count"] == 16.0
        assert m["train/reward/min"] <= m["train/reward/mean"] <= m["train/reward/max"]
        assert m["timing/generation"] > 0.003 and m["timing/train"] > 0.002
        assert {"train/loss", "train/kl", "train/response_length/p90"} <= set(m)
    # loss falls, reward mean rises (noisy per step, clear over the run)
    assert rows[-1]["metrics"]["train/loss"] < rows[0]["metrics"]["train/loss"]

    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4]
    assert json.loads((run / "hyperparams.json").read_text())["steps"] == 5


@pytest.mark.slow
def test_demo_run_again_into_the_same_log_dir_gets_its_own_run_directory(tmp_path):
    """NeMo RL's exp_<N> convention: each run its own directory, none appended to another."""
    base = tmp_path / "demo"
    (base / "exp_007").mkdir(parents=True)  # numbering continues after what is there
    (base / "notes").mkdir()
    runs = []
    for steps in (3, 4):
        out = demo("--steps", str(steps), "--log-dir", str(base), "--backends", "jsonl,tensorboard")
        runs.append(out.stdout)
    assert f"This run is in {base / 'exp_008'}/:" in runs[0]
    assert f"This run is in {base / 'exp_009'}/:" in runs[1]
    assert sorted(p.name for p in base.iterdir()) == ["exp_007", "exp_008", "exp_009", "notes"]
    assert not (base / "metrics.jsonl").exists()
    for name, steps in (("exp_008", 3), ("exp_009", 4)):
        rows = jsonl_rows(base / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(steps))  # step 0 once
        assert len({r["run_id"] for r in rows}) == 1
        scalars = tensorboard_scalars(base / name / "tensorboard")
        assert [s for s, _ in scalars["train/loss"]] == list(range(steps))
    first = {r["run_id"] for r in jsonl_rows(base / "exp_008" / "metrics.jsonl")}
    second = {r["run_id"] for r in jsonl_rows(base / "exp_009" / "metrics.jsonl")}
    assert first != second


def test_demo_backends_flag_and_bad_backend(tmp_path, capsys):
    from otel_rl.cli.main import main

    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "jsonl"]) == 0
    run = tmp_path / "exp_001"
    assert (run / "metrics.jsonl").exists() and not (run / "tensorboard").exists()
    assert "TensorBoard" not in capsys.readouterr().out
    assert main(["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "nope"]) == 2
    assert "otel-rl demo: unknown backend(s) nope; choose from" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp_001"]  # no directory claimed


def test_run_demo_refuses_a_step_count_below_one(tmp_path):
    from otel_rl.cli.demo import run_demo

    for steps in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive integer"):
            run_demo(steps=steps, log_dir=tmp_path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
