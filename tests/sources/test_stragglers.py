"""The rank everyone waits for: ``timing/<name>/slowest_rank`` and ``/skew`` from four workers
(``log_worker_metrics``, rank 2's timed block holding the others') and four real gloo ranks
(``reduce_across_ranks``, rank 2 sleeping longer); and the one warning for a rank that keeps
being the slowest, with what it cost: its share of the step time over the window."""

from __future__ import annotations

import datetime
import math
import pickle
import re
import statistics
import time
import traceback
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.distributed import WorkerMetrics
from otel_rl.watch.stragglers import Straggler, StragglerWatch
from testkit.readers import jsonl_rows

WORLD = 4
SLOW_RANK = 2


def _pause(rank: int) -> float:
    return 0.12 if rank == SLOW_RANK else 0.02


def _generation(workers: list[WorkerMetrics], slow: int) -> None:
    """Each worker times a ``generation``; ``slow``'s block holds the others' blocks, so it is the
    slowest, by more than twice the median, however long a loaded machine takes over each sleep."""
    with workers[slow].timer("generation"):
        time.sleep(_pause(SLOW_RANK))
        for rank, worker in enumerate(workers):
            if rank != slow:
                with worker.timer("generation"):
                    time.sleep(_pause(rank if rank != SLOW_RANK else 0))


def test_four_workers_name_the_slow_one_and_its_skew_in_the_rows(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        totals_per_step = []
        for step in range(3):
            workers = [WorkerMetrics(rank=r) for r in range(WORLD)]
            _generation(workers, SLOW_RANK)
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
        assert rows[step]["timing/generation/skew"] > 2  # it held the three others


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
        # the rank that took longest, whichever a loaded machine made it (most often rank 2)
        assert reduced["timing/generation/slowest_rank"] == mine.index(max(mine))
        assert reduced["timing/generation/skew"] == pytest.approx(
            max(mine) / statistics.median(mine)
        )
        assert "loss/slowest_rank" not in reduced  # not a timing
        assert all(math.isnan(r["g"]) and math.isnan(r["g/min"]) for r in result["nan"])


def test_a_rank_slowest_in_most_of_the_window_is_named_once(log_dir, otel_rl_warnings):
    """Through ``log_metrics`` (the rows ``reduce_across_ranks`` gives rank 0): rank 3 is the
    slowest in 7 of 10 steps, then 10 of 10; one warning names it with what it cost; rank 1,
    slowest 3 times in 10, is never named."""
    with Logger({"log_dir": str(log_dir), "stalls": {"straggler_window": 10}}) as logger:
        for step in range(30):
            slowest = 1 if step % 10 in (2, 5, 8) else 3
            time.sleep(0.02)
            rows = {"timing/train/step": 0.01, "timing/train/step/slowest_rank": float(slowest),
                    "timing/train/step/skew": 1.5}  # fmt: skip
            logger.log_metrics(rows, step=step)
    said = [r.getMessage() for r in otel_rl_warnings.records if "the slowest" in r.getMessage()]
    assert len(said) == 1
    # 7 steps at which the median rank waited 0.01 - 0.01 / 1.5 s for rank 3
    assert "rank 3 cost " in said[0]
    assert f"({7 * (0.01 - 0.01 / 1.5):.3g} s of " in said[0]
    assert "the slowest at timing/train/step in 7 of them (up to step 9;" in said[0]
    assert "rank 1" not in said[0]
    # The same finding, once, as an event every tracker shows (here the JSONL tracker's file).
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["step"], e["title"]) for e in events] == [
        ("otel_rl/straggler", 9, "straggler: rank 3"),
    ]
    assert events[0]["text"] == said[0].removeprefix("otel-rl: ")


_COST = re.compile(r"rank (\d+) cost (\S+) % of the step time over the last (\d+) steps "
                   r"\((\S+) s of (\S+) s\)")  # fmt: skip


def test_a_straggler_is_told_with_its_share_of_the_step_time(log_dir, otel_rl_warnings):
    """Real ``WorkerMetrics`` snapshots through ``log_worker_metrics``: rank 0 is the slowest at
    steps 0-1, rank 2 from step 2 on, so the window of 4 steps that names rank 2 is steps 1-4.
    The warning and the event say what rank 2 cost: the seconds the median rank waited for it
    (``max - max / skew`` of the rows, at the steps it was the slowest) over the wall time of
    those 4 steps (from the last call of step 0 to that of step 4, bracketed by this test's own
    clock reads around the calls)."""
    window = 4
    calls: dict[int, tuple[float, float]] = {}
    with Logger({"log_dir": str(log_dir), "stalls": {"straggler_window": window}}) as logger:
        for step in range(6):
            slow = 0 if step < 2 else SLOW_RANK
            workers = [WorkerMetrics(rank=r) for r in range(WORLD)]
            _generation(workers, slow)
            snaps = [w.snapshot() for w in workers]
            before = time.monotonic()
            logger.log_worker_metrics(snaps, step=step)
            calls[step] = (before, time.monotonic())
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    timing = "timing/generation"
    waited = sum(
        rows[s][timing] - rows[s][timing] / rows[s][f"{timing}/skew"]
        for s in range(1, 5)
        if rows[s][f"{timing}/slowest_rank"] == SLOW_RANK
    )
    assert waited > 3 * 0.12  # steps 2-4: rank 2's block held the others' and slept 0.12 s more
    wall_low, wall_high = calls[4][0] - calls[0][1], calls[4][1] - calls[0][0]

    said = [r.getMessage() for r in otel_rl_warnings.records if "the slowest" in r.getMessage()]
    assert len(said) == 1, said
    match = _COST.search(said[0])
    assert match is not None, said[0]
    rank, share, steps, told_waited, told_wall = match.groups()
    assert (int(rank), int(steps)) == (SLOW_RANK, window)
    assert float(told_waited) == pytest.approx(waited, rel=5e-3)
    assert wall_low * 0.995 <= float(told_wall) <= wall_high * 1.005
    assert 100 * waited / wall_high - 0.5 <= float(share) <= 100 * waited / wall_low + 0.5
    assert "the slowest at timing/generation in 3 of them (up to step 4;" in said[0]
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["step"], e["title"]) for e in events] == [
        ("otel_rl/straggler", 4, f"straggler: rank {SLOW_RANK}"),
    ]
    assert events[0]["text"] == said[0].removeprefix("otel-rl: ")


def test_the_cost_is_the_median_ranks_wait_over_the_windows_wall_time():
    """With known step wall times: rank 1 took 2 s against a median of 1 s at 3 of 4 steps of
    1 s each (3 s of 4 s); a skew of inf (the median rank took no time) counts the whole time."""
    found: list[Straggler] = []
    walls = {step: 1.0 for step in range(20)}
    watch = StragglerWatch(4, found.append, walls=lambda steps: {s: walls[s] for s in steps})
    for step, rank in enumerate([1, 0, 1, 1]):
        watch.observe(step, "timing/gen/slowest_rank", float(rank), 2.0, 2.0)
    (straggler,) = found
    assert (straggler.cost, straggler.waited, straggler.wall) == (0.75, 3.0, 4.0)
    assert straggler.describe().startswith(
        "rank 1 cost 75 % of the step time over the last 4 steps (3 s of 4 s): the slowest at "
        "timing/gen in 3 of them (up to step 3; its time was 2.00x the median rank's at that "
        "step): the other ranks wait for it"
    )
    for step in range(10, 14):
        watch.observe(step, "timing/idle/slowest_rank", 3.0, float("inf"), 0.25)
    assert found[-1].rank == 3 and found[-1].waited == 1.0 and found[-1].cost == 0.25
    assert "the median rank took no time at that step" in found[-1].describe()


def test_a_cost_that_cannot_be_known_is_said_so_with_the_reason():
    """No ``<timing>`` row (only ``slowest_rank`` and ``skew`` logged), no wall times, or
    timings longer than the steps (work that runs beside them): the warning still names the
    rank, and says why its cost is missing, or that it exceeds the steps' wall time."""
    found: list[Straggler] = []
    watch = StragglerWatch(2, found.append, walls=lambda steps: {s: 1.0 for s in steps})
    for step in range(2):
        watch.observe(step, "timing/a/slowest_rank", 1.0, 1.5)  # no seconds
    assert found[-1].cost is None
    assert found[-1].describe() == (
        "rank 1 was the slowest at timing/a in 2 of the last 2 steps (up to step 1; its time "
        "was 1.50x the median rank's at that step): the other ranks wait for it; what it cost "
        "is unknown: no timing/a and timing/a/skew rows at step 0"
    )
    blind = StragglerWatch(2, found.append)
    for step in range(2):
        blind.observe(step, "timing/b/slowest_rank", 0.0, 1.5, 3.0)
    assert found[-1].cost is None
    assert found[-1].describe().endswith(
        "what it cost is unknown: the steps' wall times are not known here"
    )
    gappy = StragglerWatch(2, found.append, walls=lambda steps: {s: 1.0 for s in steps if s})
    for step in range(2):
        gappy.observe(step, "timing/c/slowest_rank", 0.0, 1.5, 3.0)
    assert found[-1].describe().endswith("what it cost is unknown: no wall time for step 0")
    for step in range(2):
        watch.observe(step, "timing/d/slowest_rank", 2.0, 3.0, 6.0)  # 4 s waited per 1 s step
    assert found[-1].cost == 4.0
    assert found[-1].describe().startswith(
        "rank 2 cost 8 s over the last 2 steps, more than their 2 s of wall time (the timing "
        "overlaps the steps): the slowest at timing/d in 2 of them"
    )


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
