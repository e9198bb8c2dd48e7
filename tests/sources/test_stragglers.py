"""The rank everyone waits for: ``timing/<name>/slowest_rank`` and ``/skew`` from four workers
(``log_worker_metrics``) and four real gloo ranks (``reduce_across_ranks``), where rank 2 sleeps
longer inside the timed block; and the one warning for a rank that keeps being the slowest."""

from __future__ import annotations

import datetime
import math
import pickle
import statistics
import time
import traceback
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.distributed import WorkerMetrics
from otel_rl.watch.stragglers import StragglerWatch
from testkit.readers import jsonl_rows

WORLD = 4
SLOW_RANK = 2


def _pause(rank: int) -> float:
    return 0.12 if rank == SLOW_RANK else 0.02


def test_four_workers_name_the_slow_one_and_its_skew_in_the_rows(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        totals_per_step = []
        for step in range(3):
            workers = [WorkerMetrics(rank=r) for r in range(WORLD)]
            for rank, worker in enumerate(workers):
                with worker.timer("generation"):
                    time.sleep(_pause(rank))
            snaps = [w.snapshot() for w in workers]
            totals_per_step.append([s["timings"]["timing/generation"][0] for s in snaps])
            logger.log_worker_metrics(snaps, step=step)
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    for step, totals in enumerate(totals_per_step):
        assert rows[step]["timing/generation"] == max(totals)
        assert rows[step]["timing/generation/slowest_rank"] == SLOW_RANK
        assert rows[step]["timing/generation/skew"] == pytest.approx(
            max(totals) / statistics.median(totals)
        )
        assert rows[step]["timing/generation/skew"] > 3  # 0.12 s against ~0.02 s


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from otel_rl.distributed import reduce_across_ranks

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    out: dict = {}
    try:
        started = time.perf_counter()
        time.sleep(_pause(rank))
        out["mine"] = time.perf_counter() - started
        out["reduced"] = reduce_across_ranks(
            {"timing/generation": out["mine"], "loss": float(rank)}, {"timing/*": "max"}
        )
        # NaN on one rank, in turn on each: max and min are NaN whichever rank holds it
        out["nan"] = [
            reduce_across_ranks({"g": math.nan if rank == k else 0.01 * (rank + 1)},
                                {"g": ["max", "min"]})
            for k in range(WORLD)
        ]
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
        dist.destroy_process_group()


@pytest.mark.slow
def test_four_gloo_ranks_agree_on_the_slowest_rank_and_its_skew(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}:\n{result['error']}"
    mine = [result["mine"] for result in results]
    for result in results:
        reduced = result["reduced"]
        assert reduced["timing/generation"] == max(mine)
        assert reduced["timing/generation/slowest_rank"] == SLOW_RANK
        assert reduced["timing/generation/skew"] == pytest.approx(
            max(mine) / statistics.median(mine)
        )
        assert "loss/slowest_rank" not in reduced  # not a timing
        assert all(math.isnan(r["g"]) and math.isnan(r["g/min"]) for r in result["nan"])


def test_a_rank_slowest_in_most_of_the_window_is_named_once(log_dir, otel_rl_warnings):
    """Through ``log_metrics`` (the rows ``reduce_across_ranks`` gives rank 0): rank 3 is the
    slowest in 7 of 10 steps, then 10 of 10; one warning names it; rank 1, slowest 3 times in
    10, is never named."""
    with Logger({"log_dir": str(log_dir), "stalls": {"straggler_window": 10}}) as logger:
        for step in range(30):
            slowest = 1 if step % 10 in (2, 5, 8) else 3
            rows = {"timing/train/step": 1.0, "timing/train/step/slowest_rank": float(slowest),
                    "timing/train/step/skew": 1.5}  # fmt: skip
            logger.log_metrics(rows, step=step)
    said = [r.getMessage() for r in otel_rl_warnings.records if "the slowest" in r.getMessage()]
    assert len(said) == 1
    assert "rank 3 was the slowest at timing/train/step in 7 of the last 10 steps" in said[0]
    assert "rank 1" not in said[0]
    # The same finding, once, as an event every tracker shows (here the JSONL tracker's file).
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["step"], e["title"]) for e in events] == [
        ("otel_rl/straggler", 9, "straggler: rank 3"),
    ]
    assert events[0]["text"] == said[0].removeprefix("otel-rl: ")


def test_the_window_counts_a_step_once_and_needs_more_than_half():
    found = []
    watch = StragglerWatch(4, found.append)
    for step, rank in enumerate([2, 2, 0, 1]):  # 2 of 4: not more than half
        watch.observe(step, "timing/x/slowest_rank", float(rank), 1.2)
    assert found == []
    watch.observe(4, "timing/x/slowest_rank", 0.0, 1.2)  # window 2, 0, 1, 0: still 2 of 4
    watch.observe(4, "timing/x/slowest_rank", 1.0, 1.2)  # the same step again: replaced
    assert found == []
    watch.observe(5, "timing/x/slowest_rank", 1.0, 1.7)  # window 0, 1, 1, 1: 3 of 4
    assert [(f.timing, f.rank, f.times, f.step) for f in found] == [("timing/x", 1, 3, 5)]
    watch.observe(6, "timing/x/slowest_rank", 1.0, 1.7)
    assert len(found) == 1  # once per (timing, rank)
    watch.observe(7, "timing/x/slowest_rank", float("nan"), 1.0)  # nobody had it: ignored
    assert watch.last_slowest() == {"timing/x": 1}
    watch.observe(8, "timing/x/slowest_rank", 3.0, 1.05)  # barely slower: nobody's step
    assert watch.last_slowest() == {}


def test_a_rank_always_slowest_by_a_hair_is_not_a_straggler():
    found = []
    watch = StragglerWatch(4, found.append, min_skew=1.2)
    for step in range(10):
        watch.observe(step, "timing/x/slowest_rank", 1.0, 1.11)
    assert found == []
