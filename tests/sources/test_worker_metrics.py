"""WorkerMetrics: per-step accumulation, timers, plain OTel meters, picklable delta snapshots."""

from __future__ import annotations

import math
import pickle
import time

import pytest

import otel_rl
from otel_rl.distributed import ReductionConflictError, WorkerMetrics


def test_exported_lazily_from_the_package():
    assert otel_rl.WorkerMetrics is WorkerMetrics


def test_record_accumulates_a_step_and_snapshot_is_a_delta():
    worker = WorkerMetrics(rank=3, role="actor")
    worker.record("loss", 2.0)
    worker.record("loss", 4.0)
    worker.record("tokens", 10, reduce="sum")
    worker.record("tokens", 5, reduce="sum")
    worker.record("acc", 1.0, weight=3)
    worker.record("acc", 0.0, weight=1)
    snap = worker.snapshot(step=7)
    assert (snap["rank"], snap["role"], snap["step"], snap["format"]) == (3, "actor", 7, 1)
    # (reduce, n, sum, weighted sum, weight, min, max, last, last time)
    assert snap["scalars"]["loss"][:8] == (None, 2, 6.0, 6.0, 2.0, 2.0, 4.0, 4.0)
    assert snap["scalars"]["tokens"][:8] == ("sum", 2, 15.0, 15.0, 2.0, 5.0, 10.0, 5.0)
    assert snap["scalars"]["acc"][:8] == (None, 2, 1.0, 3.0, 4.0, 0.0, 1.0, 0.0)
    # the next snapshot holds only what came after
    worker.record("loss", 1.0)
    assert set(worker.snapshot()["scalars"]) == {"loss"}
    assert worker.snapshot()["scalars"] == {}


def test_timers_sum_within_a_snapshot_and_meters_are_plain_otel():
    worker = WorkerMetrics(rank=0)
    gen = worker.timer("generate")
    for _ in range(3):
        with gen:
            time.sleep(0.01)

    @worker.timer("decorated")
    def work() -> int:
        time.sleep(0.005)
        return 42

    assert work() == 42
    lengths = worker.meter.create_histogram("lengths", explicit_bucket_boundaries_advisory=[10, 99])
    for v in (5, 50, 500, 50):
        lengths.record(v)
    worker.meter.create_counter("samples").add(7)
    worker.meter.create_gauge("queue").set(3.5)

    snap = worker.snapshot()
    total, count = snap["timings"]["timing/generate"]
    assert count == 3 and total >= 0.03
    assert snap["timings"]["timing/decorated"][1] == 1
    assert snap["histograms"]["lengths"] == ((10, 99), (1, 2, 1), 4, 605, 5, 500)
    assert snap["scalars"]["samples"][:3] == ("sum", 1, 7.0)
    assert snap["scalars"]["queue"][:3] == (None, 1, 3.5)
    # DELTA: nothing recorded since → nothing in the next snapshot
    again = worker.snapshot()
    assert again["timings"] == again["histograms"] == {}
    assert "samples" not in again["scalars"]


def test_snapshot_is_plain_picklable_data():
    worker = WorkerMetrics(rank=1, role="critic")
    worker.record("v", 1.5, reduce="max")
    with worker.timer("t"):
        pass
    worker.meter.create_histogram("h", explicit_bucket_boundaries_advisory=[1.0]).record(0.5)
    snap = worker.snapshot()
    assert pickle.loads(pickle.dumps(snap)) == snap
    allowed = (dict, tuple, list, str, int, float, type(None))

    def walk(value):
        assert isinstance(value, allowed), type(value)
        if isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                walk(v)

    walk(snap)


def test_nan_is_kept_and_conflicting_declarations_raise():
    worker = WorkerMetrics()
    worker.record("loss", 1.0, reduce="max")
    worker.record("loss", math.nan)
    worker.record("loss", 0.5)
    entry = worker.snapshot()["scalars"]["loss"]
    assert math.isnan(entry[5]) and math.isnan(entry[6])  # min and max stay NaN
    worker.record("loss", 1.0)  # no reduce: keeps the declared "max"
    assert worker.snapshot()["scalars"]["loss"][0] == "max"
    with pytest.raises(ReductionConflictError, match=r"'loss'.*reduce='max'.*reduce='sum'"):
        worker.record("loss", 1.0, reduce="sum")
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        worker.record("x", 1.0, reduce="median")
    with pytest.raises(ValueError, match="weight must be >= 0"):
        worker.record("x", 1.0, weight=-1)


def test_a_bad_value_timer_name_or_key_costs_only_itself_and_is_said_once(otel_rl_warnings):
    """A worker has no strict mode: what ``log_metrics`` would report, ``WorkerMetrics`` says
    once and goes on (``record(None)`` raised ``TypeError``, a second non-ASCII timer name
    ``ValueError`` into the worker's loop). A key both ``record()``ed and an OTel instrument's
    keeps the recorded values (the instrument's silently replaced them)."""

    worker = WorkerMetrics(rank=0, role="actor")
    for bad in (None, 10**400, "n/a", None):
        worker.record("loss", bad)
    worker.record("loss", 2.0)
    with worker.timer("ref-logprob"):
        time.sleep(0.01)
    with worker.timer("ref_logprob"):  # the same OTel name: rows kept, said
        time.sleep(0.01)
    with worker.timer("日本"), worker.timer("中文"):  # both become the OTel name timing_
        pass
    worker.record("tokens", 5, reduce="sum")
    worker.meter.create_counter("tokens").add(3)
    worker.meter.create_counter("requests").add(2)
    snap = worker.snapshot()
    said = [r.getMessage() for r in otel_rl_warnings.records]
    assert sum("'loss'" in m and "skipped: no number" in m for m in said) == 3  # once per reason
    assert any("timing/ref_logprob" in m and "collides" in m for m in said), said
    assert any("timing/中文" in m for m in said), said
    assert any("'tokens'" in m and "record()ed values are kept" in m for m in said), said
    assert snap["scalars"]["loss"][1:3] == (1, 2.0)
    assert snap["scalars"]["tokens"][:3] == ("sum", 1, 5.0)
    assert snap["scalars"]["requests"][2] == 2.0
    assert set(snap["timings"]) >= {"timing/ref-logprob", "timing/ref_logprob", "timing/日本",
                                    "timing/中文"}  # fmt: skip
    assert snap["timings"]["timing/ref_logprob"][0] >= 0.01


def test_an_up_down_counter_is_a_level_the_latest_of_a_worker_and_the_sum_of_workers(log_dir):
    """An up-down counter's point is its level (in flight now), not a change: of one worker's
    two snapshots in a step the latest counts (3 then 4 gave 7), and two workers' levels add up;
    a plain counter's changes still add up."""
    from otel_rl import Logger
    from testkit.readers import rows_by_step

    first, second = WorkerMetrics(rank=0), WorkerMetrics(rank=1)
    inflight = first.meter.create_up_down_counter("inflight")
    requests = first.meter.create_counter("requests")
    other = second.meter.create_up_down_counter("inflight")
    inflight.add(3)
    requests.add(3)
    early = first.snapshot()
    inflight.add(1)
    requests.add(1)
    other.add(10)
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_worker_metrics([early, first.snapshot(), second.snapshot()], step=0)
        inflight.add(-2)
        logger.log_worker_metrics([first.snapshot(), second.snapshot()], step=1)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert (rows[0]["inflight"], rows[0]["requests"]) == (14.0, 4.0)
    assert rows[1]["inflight"] == 12.0  # 2 on rank 0 (the level) + 10 on rank 1
