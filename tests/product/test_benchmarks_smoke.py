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
