"""The training thread's cost in the working tree beside a git revision, in the same run.

    python -m benchmarks --against REV            # e.g. --against main, --against HEAD~3
    python -m benchmarks --against REV --quick

``REV`` is extracted with ``git archive`` into a temporary folder; then the loop of
``benchmarks/hot_loop.py`` (the tail loop with JSONL + TensorBoard + MLflow + W&B on) runs in a
fresh interpreter on one tree, then on the other, alternating, ``ROUNDS`` times for each
``export.delivery``. A fresh interpreter per run keeps one tree's imports, threads and garbage
out of the other's numbers; alternating spreads the machine's own drift over both sides.

Each row gives both trees' medians over the rounds (of each run's median, p99.9, max and loop
wall time) and the ratio now / before: above 1 the working tree is slower. The tail targets
(p99.9 ≤ 1 ms, max ≤ 5 ms in process mode) are read from the working tree's row.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parent.parent
LOOP = Path(__file__).with_name("hot_loop.py")
ROUNDS, STEPS = 3, 10_000
MEASURES = ("median_us", "p99.9_us", "max_us", "loop_s")


def extract(rev: str, into: Path) -> str:
    """``rev``'s tree under ``into``; returns its full commit id. Raises ``ValueError`` naming
    the revision when git does not know it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
            cwd=CHECKOUT, check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except subprocess.CalledProcessError as exc:
        raise ValueError(f"--against {rev!r}: git knows no such revision "
                         f"({exc.stderr.strip()})") from None  # fmt: skip
    archive = into / "tree.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit], cwd=CHECKOUT, check=True, stdout=out)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="tar")
    archive.unlink()
    return commit


def one_run(tree: Path, delivery: str, steps: int) -> dict[str, Any]:
    """One loop in a fresh interpreter whose ``otel_rl`` is ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, str(LOOP), "--delivery", delivery, "--steps", str(steps)],
        env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the loop on {tree} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["tree"]) != tree.resolve():
        raise RuntimeError(f"the loop imported otel_rl from {result['tree']}, not {tree}")
    return result


def compare(rev: str, quick: bool = False) -> list[dict[str, Any]]:
    rounds, steps = (1, 300) if quick else (ROUNDS, STEPS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="otel-rl-against-") as tmp:
        commit = extract(rev, Path(tmp))
        before_tree = Path(tmp) / "tree"
        for delivery in ("process", "thread"):
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
            for _ in range(rounds):
                runs["before"].append(one_run(before_tree, delivery, steps))
                runs["now"].append(one_run(CHECKOUT, delivery, steps))
            row: dict[str, Any] = {"delivery": delivery, "against": commit[:10],
                                   "steps": steps, "rounds": rounds}  # fmt: skip
            for measure in MEASURES:
                before = statistics.median(r[measure] for r in runs["before"])
                now = statistics.median(r[measure] for r in runs["now"])
                row[f"before_{measure}"] = round(before, 2)
                row[f"now_{measure}"] = round(now, 2)
                row[f"ratio_{measure}"] = round(now / before, 3) if before else None
            row["now_p99.9_each_us"] = [round(r["p99.9_us"]) for r in runs["now"]]
            rows.append(row)
    return rows
