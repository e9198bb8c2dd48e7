"""The training thread's cost in the working tree beside a git revision, in the same run.

    python -m benchmarks --against REV            # e.g. --against main, --against HEAD~3
    python -m benchmarks --against REV --quick

``REV`` is extracted with ``git archive`` into a temporary folder; then the loop of
``benchmarks/hot_loop.py`` (the tail loop with JSONL + TensorBoard + MLflow + W&B on) runs in a
fresh interpreter on one tree, then on the other, alternating, ``ROUNDS`` times for each
``export.delivery`` and each kind of step: the keys alone, and the timed step (five timers, one
inside another, then the same keys: ``hot_loop.timed_step``). A fresh interpreter per run keeps
one tree's imports, threads and garbage out of the other's numbers; alternating spreads the
machine's own drift over both sides.

Each row gives both trees' medians over the rounds (of each run's median, p99.9, max and loop
wall time) and the ratio now / before: above 1 the working tree is slower. A timed step's row
also gives each tree's median step over its median step of keys alone (``*_over_keys``): what
the five timers add, in that tree. The tail targets (p99.9 ≤ 1 ms, max ≤ 5 ms in process mode)
are read from the working tree's row of keys.
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

from benchmarks.hot_loop import STEP_KINDS

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


def one_run(tree: Path, delivery: str, steps: int, step: str = "keys") -> dict[str, Any]:
    """One loop in a fresh interpreter whose ``otel_rl`` is ``tree``'s; ``step`` is a name of
    ``hot_loop.STEP_KINDS``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, str(LOOP), "--delivery", delivery, "--steps", str(steps),
         "--step", step],
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
        trees = {"before": before_tree, "now": CHECKOUT}
        for delivery in ("process", "thread"):
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {
                (step, side): [] for step in STEP_KINDS for side in trees
            }
            for _ in range(rounds):  # each round: both kinds of step, each on both trees
                for step in STEP_KINDS:
                    for side, tree in trees.items():
                        runs[step, side].append(one_run(tree, delivery, steps, step))
            for step in STEP_KINDS:
                row: dict[str, Any] = {"delivery": delivery, "step": step,
                                       "against": commit[:10], "steps": steps,
                                       "rounds": rounds}  # fmt: skip
                for measure in MEASURES:
                    before = _median(runs[step, "before"], measure)
                    now = _median(runs[step, "now"], measure)
                    row[f"before_{measure}"] = round(before, 2)
                    row[f"now_{measure}"] = round(now, 2)
                    row[f"ratio_{measure}"] = round(now / before, 3) if before else None
                row["now_p99.9_each_us"] = [round(r["p99.9_us"]) for r in runs[step, "now"]]
                if step != "keys":
                    for side in trees:
                        keys = _median(runs["keys", side], "median_us")
                        timed = _median(runs[step, side], "median_us")
                        row[f"{side}_median_over_keys"] = round(timed / keys, 2) if keys else None
                rows.append(row)
    return rows


def _median(runs: list[dict[str, Any]], measure: str) -> float:
    return float(statistics.median(r[measure] for r in runs))
