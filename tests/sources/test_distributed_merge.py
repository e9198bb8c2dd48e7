"""Merging worker snapshots on the driver: reductions, timings, histograms, rules, conflicts, and
``Logger.log_worker_metrics`` writing the merged rows at their step (read back from the files)."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from otel_rl import ConfigError, Logger, MetricError
from otel_rl.core.records import HistogramValue
from otel_rl.distributed import ReductionConflictError, WorkerMetrics, merge_snapshots
from testkit.readers import jsonl_rows, tensorboard_scalars


def timing_snapshot(rank: int, seconds: float, role: str = "actor") -> dict:
    """A worker snapshot holding one known timing total (real timers can't give exact values)."""
    worker = WorkerMetrics(rank=rank, role=role)
    snap = worker.snapshot()
    snap["timings"]["timing/step"] = (seconds, 1)
    return snap


def test_each_reduction_over_four_workers():
    workers = [WorkerMetrics(rank=r, role="actor") for r in range(4)]
    for r, w in enumerate(workers):
        w.record("loss", float(r + 1))  # default: mean
        w.record("loss", float(r + 3))
        w.record("tokens", 100 * (r + 1), reduce="sum")
        w.record("grad_norm", r * 0.5, reduce="max")
        w.record("entropy", 1.0 - 0.1 * r, reduce="min")
        w.record("reward", float(r), weight=r + 1)  # weighted mean
        if r in (1, 2):
            w.record("only_some", 10.0 * r)
    rows = merge_snapshots([w.snapshot() for w in workers], prefix="train")
    assert rows == {
        "train/loss": pytest.approx((1 + 2 + 3 + 4 + 3 + 4 + 5 + 6) / 8, rel=1e-15),
        "train/tokens": 1000.0,
        "train/grad_norm": 1.5,
        "train/entropy": pytest.approx(0.7, rel=1e-15),
        "train/reward": pytest.approx((0 * 1 + 1 * 2 + 2 * 3 + 3 * 4) / (1 + 2 + 3 + 4), rel=1e-15),
        "train/only_some": 15.0,  # reduced over the workers that recorded it
    }


def test_last_takes_the_latest_value_by_wall_clock():
    early, late = WorkerMetrics(rank=0), WorkerMetrics(rank=1)
    late.record("lr", 2e-6, reduce="last")
    early.record("lr", 1e-6, reduce="last")  # recorded after: it is the last
    assert merge_snapshots([late.snapshot(), early.snapshot()]) == {"lr": 1e-6}


def test_timings_take_the_max_of_each_workers_total_with_opt_in_min_and_mean():
    snaps = [timing_snapshot(0, 1.0), timing_snapshot(1, 3.0), timing_snapshot(2, 2.0)]
    snaps.append(timing_snapshot(0, 2.5))  # a second snapshot of rank 0: its total is 3.5
    # rank 0 is the slowest (3.5 s against a median of 3.0 s over the totals 3.5, 3.0, 2.0)
    straggler = {"timing/step/slowest_rank": 0.0, "timing/step/skew": 3.5 / 3.0}
    assert merge_snapshots(snaps) == {"timing/step": 3.5, **straggler}
    rows = merge_snapshots(snaps, {"timing/*": ["max", "min", "mean"]})
    assert rows == {"timing/step": 3.5, "timing/step/min": 2.0, "timing/step/mean": 8.5 / 3,
                    **straggler}  # fmt: skip
    # not reduced with max: no slowest rank
    assert merge_snapshots(snaps, {"timing/step": "sum"}) == {"timing/step": 8.5}
    # one worker: nobody to be slower than
    assert merge_snapshots([timing_snapshot(0, 1.0)]) == {"timing/step": 1.0}


def test_a_nan_timing_has_no_place_among_the_slowest_whatever_the_order_of_the_workers():
    """NaN keeps the timing NaN, and is left out of the slowest rank (its comparisons are all
    false, so the rank named depended on the workers' order); all NaN: no slowest rank."""
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        times = {0: math.nan, 1: 0.5, 2: 0.2}
        rows = merge_snapshots([timing_snapshot(r, times[r]) for r in order])
        assert math.isnan(rows["timing/step"])
        assert rows["timing/step/slowest_rank"] == 1.0, order
        assert rows["timing/step/skew"] == 0.5 / 0.35
        nans = merge_snapshots([timing_snapshot(r, math.nan) for r in order])
        assert all(math.isnan(v) for v in nans.values()) and len(nans) == 3


def test_histograms_from_four_workers_merge_to_the_histogram_of_all_raw_values():
    bounds = [0.0, 1.0, 2.5, 5.0, 10.0, 50.0]
    rng = random.Random(7)
    raw = [[rng.uniform(0, 60) for _ in range(50 + 17 * r)] for r in range(4)]
    raw[0] += [1.0, 2.5, 0.0]  # values on a bound belong to the bucket below it (OTel: (lo, hi])
    snaps = []
    for r, values in enumerate(raw):
        worker = WorkerMetrics(rank=r)
        hist = worker.meter.create_histogram(
            "response_len", explicit_bucket_boundaries_advisory=bounds
        )
        for v in values:
            hist.record(v)
        snaps.append(worker.snapshot())

    everything = [v for values in raw for v in values]
    counts = [0] * (len(bounds) + 1)
    for v in everything:
        counts[bisect.bisect_left(bounds, v)] += 1
    expected = HistogramValue(
        tuple(bounds), tuple(counts), len(everything), math.fsum(everything),
        min(everything), max(everything),
    )  # fmt: skip
    rows = merge_snapshots(snaps)
    merged = rows["response_len"]
    assert (merged.bounds, merged.counts, merged.count) == (
        expected.bounds, expected.counts, expected.count,
    )  # fmt: skip
    assert (merged.min, merged.max) == (expected.min, expected.max)
    assert merged.sum == pytest.approx(expected.sum, rel=1e-12)
    assert rows["response_len/count"] == float(len(everything))
    assert rows["response_len/mean"] == pytest.approx(expected.sum / len(everything), rel=1e-12)

    # one provider fed every value gives the same histogram
    single = WorkerMetrics(rank=9)
    hist = single.meter.create_histogram("response_len", explicit_bucket_boundaries_advisory=bounds)
    for v in everything:
        hist.record(v)
    bounds_, counts_, count_, _sum, lo, hi = single.snapshot()["histograms"]["response_len"]
    assert (tuple(bounds_), tuple(counts_), count_, lo, hi) == (
        merged.bounds, merged.counts, merged.count, merged.min, merged.max,
    )  # fmt: skip


def test_rules_match_the_workers_key_or_the_prefixed_key_first_match_wins():
    workers = [WorkerMetrics(rank=r) for r in range(2)]
    for r, w in enumerate(workers):
        w.record("sample_count", 8 + r)
        w.record("kl", 0.1 * (r + 1))
        w.record("kl_coef", 0.5)
    snaps = [w.snapshot() for w in workers]
    rules = {"train/*_count": "sum", "kl": ["max", "min"], "*": "last"}
    rows = merge_snapshots(snaps, rules, prefix="train")
    assert rows["train/sample_count"] == 17.0  # matched with the prefix
    assert rows["train/kl"] == pytest.approx(0.2) and rows["train/kl/min"] == pytest.approx(0.1)
    assert rows["train/kl_coef"] == 0.5  # "*" → last
    # under another prefix "*" → last: rank 1 recorded after rank 0
    assert merge_snapshots(snaps, rules, prefix="eval")["eval/sample_count"] == 9.0


def test_conflicting_reductions_are_a_clear_error():
    a, b = WorkerMetrics(rank=0), WorkerMetrics(rank=1)
    a.record("loss", 1.0, reduce="mean")
    b.record("loss", 2.0, reduce="sum")
    message = r"'train/loss': reduce='mean' on worker rank 0, reduce='sum' on worker rank 1"
    with pytest.raises(ReductionConflictError, match=message):
        merge_snapshots([a.snapshot(), b.snapshot()], prefix="train")

    a.record("tokens", 1.0, reduce="mean")
    with pytest.raises(ReductionConflictError, match="reductions config says 'sum'"):
        merge_snapshots([a.snapshot()], {"tokens": "sum"})

    a.record("timing/step", 1.0)
    with pytest.raises(ReductionConflictError, match="as a scalar and as a timing"):
        merge_snapshots([a.snapshot(), timing_snapshot(1, 2.0)])

    with pytest.raises(ConfigError, match="unknown reduction 'median'"):
        merge_snapshots([], {"x": "median"})


def test_log_worker_metrics_lands_at_the_step_in_jsonl_and_tensorboard(log_dir):
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "reductions": {"timing/*": ["max", "mean"], "*_count": "sum"},
    }
    with Logger(cfg) as logger:
        for step in range(3):
            workers = [WorkerMetrics(rank=r) for r in range(2)]
            for r, w in enumerate(workers):
                w.record("loss", step + r)
                w.record("sample_count", 4)
            snaps = [w.snapshot() for w in workers]
            snaps[0]["timings"]["timing/update"] = (1.0 + step, 1)
            snaps[1]["timings"]["timing/update"] = (2.0 + step, 1)
            logger.log_worker_metrics(snaps, step=step * 10, prefix="train")
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert rows == {
        10 * s: {
            "train/loss": s + 0.5,
            "train/sample_count": 8.0,
            "train/timing/update": 2.0 + s,
            "train/timing/update/mean": 1.5 + s,
            "train/timing/update/slowest_rank": 1.0,
            "train/timing/update/skew": (2.0 + s) / (1.5 + s),  # max ÷ median of two
        }
        for s in range(3)
    }
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["train/timing/update"] == [(0, 2.0), (10, 3.0), (20, 4.0)]
    assert scalars["train/loss"] == [(0, 0.5), (10, 1.5), (20, 2.5)]


def test_lenient_logger_reports_a_conflict_and_keeps_the_other_keys(log_dir, otel_rl_warnings):
    a, b = WorkerMetrics(rank=0), WorkerMetrics(rank=1)
    for w, reduce in ((a, "mean"), (b, "max")):
        w.record("loss", 1.0, reduce=reduce)
        w.record("ok", 2.0)
    snaps = [a.snapshot(), b.snapshot()]
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_worker_metrics(snaps, step=0)
    assert [r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [{"ok": 2.0}]
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert any("'loss'" in m and "reduce='max'" in m for m in messages)

    strict = Logger({"log_dir": str(log_dir / "strict"), "strict": True})
    with strict, pytest.raises(MetricError, match="'loss'"):
        strict.log_worker_metrics(snaps, step=0)


def test_an_entry_that_is_no_snapshot_costs_only_itself_and_no_list_is_said(
    log_dir, otel_rl_warnings
):
    """Lenient: one malformed entry is left out (said, with its place) and the workers' other
    snapshots are merged; a call given no list is dropped, said, and never raises. Strict: both
    are a MetricError."""
    workers = [WorkerMetrics(rank=r) for r in range(2)]
    for r, w in enumerate(workers):
        w.record("loss", float(r))
    snaps = [workers[0].snapshot(), {}, None, "rank 2", workers[1].snapshot()]
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_worker_metrics(snaps, step=0)
        logger.log_worker_metrics(None, step=1)  # type: ignore[arg-type]
        logger.log_worker_metrics(5, step=1)  # type: ignore[arg-type]
        for r, w in enumerate(workers):
            w.record("loss", 10.0 + r)
        logger.log_worker_metrics(iter([w.snapshot() for w in workers]), step=2)  # read once
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert rows == {0: {"loss": 0.5}, 2: {"loss": 10.5}}
    said = otel_rl_warnings.text
    assert "entry 1 left out" in said and "entry 3 left out" in said
    assert "not NoneType" in said and "not int" in said

    strict = Logger({"log_dir": str(log_dir / "strict"), "strict": True})
    with strict:
        with pytest.raises(MetricError, match="expected a WorkerMetrics snapshot"):
            strict.log_worker_metrics(snaps, step=0)
        with pytest.raises(MetricError, match="give a list"):
            strict.log_worker_metrics(None, step=0)  # type: ignore[arg-type]


def test_reductions_and_tracing_config_are_checked_up_front():
    from otel_rl.config.loading import resolve_config

    cfg = resolve_config({"reductions": {"timing/*": ["max", "min"], "a/b": "sum"}})
    assert cfg["reductions"] == {"timing/*": ["max", "min"], "a/b": "sum"}
    assert resolve_config({})["tracing"] == {
        "enabled": None, "file": True, "file_max_mb": 64,
        "picture": True, "picture_every": 1800.0, "picture_steps": 10,
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"'reductions.timing/\*'.*unknown reduction 'p99'"):
        resolve_config({"reductions": {"timing/*": ["max", "p99"]}})
    with pytest.raises(ConfigError, match="'reductions' must be a mapping"):
        resolve_config({"reductions": ["max"]})
    with pytest.raises(ConfigError, match=r"'tracing\.enabled' must be bool"):
        resolve_config({"tracing": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match="did you mean 'enabled'"):
        resolve_config({"tracing": {"enable": True}})
