"""The benchmark harness runs: ``python -m benchmarks --quick --only scaling`` exits 0 and writes
its results. Nothing about speed is asserted (the numbers belong in docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_scaling_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "scaling", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert [row["keys"] for row in results["scaling"]["keys"]] == [10, 100, 1000]


@pytest.mark.slow
@pytest.mark.long  # eight fresh interpreters, each importing mlflow and wandb
def test_against_a_revision_measures_both_trees_in_one_run(tmp_path: Path) -> None:
    """``--against REV`` runs the hot loop on REV's tree (extracted by git) and on the working
    tree: each side imports its own otel_rl (checked inside), and each row has both sides'
    numbers and their ratio."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    out = tmp_path / "against.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--against", "HEAD", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["against"]
    assert [(row["delivery"], row["step"]) for row in rows] == [
        (delivery, step) for delivery in ("process", "thread") for step in ("keys", "timers+keys")
    ]
    for row in rows:
        assert row["against"] == head[:10] and row["steps"] == 300
        for measure in ("median_us", "p99.9_us", "max_us", "loop_s"):
            before, now = row[f"before_{measure}"], row[f"now_{measure}"]
            assert before > 0 and now > 0
        for measure in ("median_us", "p99.9_us", "max_us"):  # (loop_s is too coarse to redo)
            before, now = row[f"before_{measure}"], row[f"now_{measure}"]
            assert row[f"ratio_{measure}"] == pytest.approx(now / before, rel=0.01, abs=0.002)
    for keys, timed in zip(rows[::2], rows[1::2], strict=True):  # a timed step over keys alone
        for side in ("before", "now"):
            assert timed[f"{side}_median_over_keys"] == pytest.approx(
                timed[f"{side}_median_us"] / keys[f"{side}_median_us"], rel=0.01, abs=0.01
            )
    assert "ratio_median_us" in done.stdout  # the table is printed too


@pytest.mark.slow
def test_quick_timed_step_benchmark_runs(tmp_path: Path) -> None:
    """Five timers and 100 keys beside the keys alone: each row has both sides' median, p99.9
    and max, and the ratio of each."""
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "timed_step", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["timed_step"]
    assert [row["trackers"] for row in rows] == [
        "TensorBoard + MLflow + W&B + JSONL",
        "JSONL + TensorBoard (defaults)",
        "JSONL + TensorBoard (defaults + tracing off)",
    ]
    for row in rows:
        for measure in ("median", "p99.9", "max"):
            keys, timed = row[f"keys_{measure}_us"], row[f"timed_{measure}_us"]
            assert keys > 0 and timed > 0
            assert row[f"ratio_{measure}"] == pytest.approx(timed / keys, rel=0.01, abs=0.01)
    assert rows[2]["timed_median_vs_default"] == pytest.approx(
        rows[2]["timed_median_us"] / rows[1]["timed_median_us"], rel=0.01, abs=0.01
    )


def test_against_an_unknown_revision_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--against", "no-such-rev-x", "--quick",
         "--out", str(tmp_path / "a.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--against 'no-such-rev-x': git knows no such revision" in done.stderr
    assert "Traceback" not in done.stderr
