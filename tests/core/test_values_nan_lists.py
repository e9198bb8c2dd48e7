"""NaN and ±inf inside logged lists and histograms, checked on the rows the JSONL file holds.

A list becomes ``/count, /mean, /std, /min, /max, /p50, /p90`` (docs/configuration.md). NaNs
are left out of every statistic and counted as ``/nan_count`` (only when there are some), so
where a NaN sits in the list changes nothing. Infinities are ordered values: they take part in
every statistic.

Environment: ``OTEL_RL_PROPERTY_SEED`` (default 12) seeds the property tests' search, so that a
run is reproducible; the cases they found are kept as explicit examples.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import example, given, seed, settings
from hypothesis import strategies as st

from otel_rl import Logger
from otel_rl.core.values import SUMMARY_STATS
from testkit.readers import jsonl_rows

INF = math.inf
NAN = math.nan
SEED = int(os.environ.get("OTEL_RL_PROPERTY_SEED", "12"))


def make_logger(log_dir) -> Logger:
    return Logger({"log_dir": str(log_dir), "export": {"spool": False, "on_full": "block"}})


def step_rows(log_dir, step: int) -> dict:
    (row,) = [r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl") if r["step"] == step]
    return row


def same(a: float, b: float) -> bool:
    """Equal, with NaN equal to NaN (a statistic may be NaN, e.g. the std of [1, inf])."""
    return (a != a and b != b) or a == b


def stats_of(row: dict, key: str) -> dict:
    return {name: row[f"{key}/{name}"] for name in SUMMARY_STATS if f"{key}/{name}" in row}


# Kinds of NaN a training loop produces: Python's, a negative NaN, numpy's scalar.
nans = st.sampled_from([float("nan"), -math.nan, np.float64("nan"), float(np.float32("nan"))])
numbers = st.floats(allow_nan=False, allow_infinity=True)


def test_nan_positions_change_no_statistic_and_are_counted(log_dir):
    """Property: a list with NaNs inserted anywhere arrives in the JSONL file with the
    statistics of the list without them, plus ``/nan_count`` = the number inserted; the same for
    the list given as a tuple or a numpy array, and for ``log_histogram``."""
    logger = make_logger(log_dir)
    steps = iter(range(10**6))

    @settings(max_examples=150, deadline=None, database=None)
    @seed(SEED)
    @given(
        clean=st.lists(numbers, max_size=12),
        inserted=st.lists(st.tuples(st.integers(min_value=0), nans), max_size=6),
        container=st.sampled_from([list, tuple, np.array]),
    )
    # Found by the search: a subnormal range (its bin width rounds to 0.0), and a range beyond
    # the largest float (its upper bounds overflowed to inf).
    @example(clean=[0.0, 5e-324], inserted=[], container=list)
    @example(clean=[5e-324, 0.0, 1e-323], inserted=[(1, NAN)], container=np.array)
    @example(clean=[-1.7976931348623157e308, 1.7976931348623157e308], inserted=[(0, NAN)],
             container=tuple)  # fmt: skip
    def check(clean, inserted, container):
        if not clean and not inserted:
            return  # an empty list is refused (with a warning), not summarised
        if container is np.array and len(clean) < 2:
            container = list  # a 1-element array is a scalar, not a list (documented)
        dirty = list(clean)
        for position, nan in inserted:
            dirty.insert(position % (len(dirty) + 1), nan)
        step = next(steps)
        logger.log_histogram(clean or [0.0], step, "hist_clean")
        logger.log_histogram(dirty if clean else [0.0, *dirty], step, "hist_dirty")
        logger.log_metrics(
            {"clean": container(clean) if clean else [], "dirty": container(dirty)},
            step=step,
            step_finished=True,
        )
        assert logger.flush(timeout=30)
        row = step_rows(log_dir, step)

        dirty_stats = stats_of(row, "dirty")
        if clean:
            clean_stats = stats_of(row, "clean")
            assert set(dirty_stats) == set(clean_stats) == set(SUMMARY_STATS)
            for name in SUMMARY_STATS:
                assert same(dirty_stats[name], clean_stats[name]), (name, dirty, clean)
            assert clean_stats["count"] == len(clean)
            assert clean_stats["min"] == min(clean)
            assert clean_stats["max"] == max(clean)
            assert "clean/nan_count" not in row
        else:  # only NaNs: nothing to take a statistic of
            assert dirty_stats == {"count": 0.0}
        if inserted:
            assert row["dirty/nan_count"] == len(inserted)
            assert row["hist_dirty/nan_count"] == len(inserted)
        else:
            assert "dirty/nan_count" not in row
            assert "hist_dirty/nan_count" not in row
        assert row["hist_dirty"] == row["hist_clean"]

    check()
    logger.finish()


@settings(max_examples=200, deadline=None, database=None)
@seed(SEED)
@given(
    clean=st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=40),
    positions=st.lists(st.integers(min_value=0), max_size=5),
)
def test_statistics_without_the_nans_match_numpy_on_the_clean_list(clean, positions):
    """The values themselves, against numpy on the list without NaNs (population std, linear
    percentiles)."""
    from otel_rl.core.values import summarize

    dirty = list(clean)
    for position in positions:
        dirty.insert(position % (len(dirty) + 1), NAN)
    stats = summarize(dirty)
    reference = np.array(clean)
    assert stats["count"] == len(clean)
    assert stats["min"] == reference.min() and stats["max"] == reference.max()
    assert stats["mean"] == pytest.approx(reference.mean(), rel=1e-9, abs=1e-9)
    assert stats["std"] == pytest.approx(reference.std(), rel=1e-9, abs=1e-6)
    assert stats["p50"] == pytest.approx(np.percentile(reference, 50), rel=1e-9, abs=1e-9)
    assert stats["p90"] == pytest.approx(np.percentile(reference, 90), rel=1e-9, abs=1e-9)
    assert stats.get("nan_count", 0.0) == len(positions)


def test_a_list_of_only_nans_has_a_count_of_zero_and_its_nan_count(log_dir):
    with make_logger(log_dir) as logger:
        logger.log_metrics({"reward": [NAN, NAN, NAN], "loss": 0.5}, step=3)
    row = step_rows(log_dir, 3)
    assert row == {"reward/count": 0.0, "reward/nan_count": 3.0, "loss": 0.5}


def test_the_issue_example_at_every_nan_position(log_dir):
    with make_logger(log_dir) as logger:
        logger.log_metrics({"reward": [NAN, 1.0, 3.0]}, step=0)
        logger.log_metrics({"reward": [1.0, NAN, 3.0]}, step=1)
        logger.log_metrics({"reward": [1.0, 3.0, NAN]}, step=2)
        logger.log_metrics({"reward": [1.0, 3.0]}, step=3)
    want = {"reward/count": 2.0, "reward/mean": 2.0, "reward/std": 1.0, "reward/min": 1.0,
            "reward/max": 3.0, "reward/p50": 2.0, "reward/p90": 2.8}  # fmt: skip
    for step in range(3):
        assert step_rows(log_dir, step) == pytest.approx({**want, "reward/nan_count": 1.0})
    assert step_rows(log_dir, 3) == pytest.approx(want)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        # Infinities are ordered: min, max and the percentiles are read off the sorted values
        # (p50 of [1, 3, inf] is 3, not inf x 0); the mean is infinite, the std undefined.
        ([1.0, INF, 3.0], {"count": 3, "mean": INF, "std": NAN, "min": 1.0, "max": INF,
                           "p50": 3.0, "p90": INF}),
        ([-INF, 5.0], {"count": 2, "mean": -INF, "std": NAN, "min": -INF, "max": 5.0,
                       "p50": -INF, "p90": -INF}),
        ([INF, INF], {"count": 2, "mean": INF, "std": NAN, "min": INF, "max": INF,
                      "p50": INF, "p90": INF}),
        # inf - inf is undefined: so are the mean and a percentile between -inf and +inf.
        ([-INF, 1.0, INF], {"count": 3, "mean": NAN, "std": NAN, "min": -INF, "max": INF,
                            "p50": 1.0, "p90": INF}),
        ([NAN, -INF, INF, NAN], {"count": 2, "mean": NAN, "std": NAN, "min": -INF, "max": INF,
                                 "p50": NAN, "p90": NAN, "nan_count": 2}),
    ],
)  # fmt: skip
def test_infinities_are_ordered_values_in_every_statistic(log_dir, values, want):
    with make_logger(log_dir) as logger:
        logger.log_metrics({"x": values}, step=0)
    row = step_rows(log_dir, 0)
    assert set(row) == {f"x/{name}" for name in want}
    for name, value in want.items():
        assert same(row[f"x/{name}"], float(value)), (name, row[f"x/{name}"], value)
    assert logger.stats["nonfinite"] == sum(1 for v in want.values() if not math.isfinite(v))


def test_log_histogram_buckets_finite_values_and_counts_the_others(log_dir):
    with make_logger(log_dir) as logger:
        logger.log_histogram([1.0, NAN, 2.0, INF, 3.0, -INF, NAN], step=0, name="adv", bins=2)
        logger.log_histogram([1.0, 2.0, 3.0], step=0, name="ref", bins=2)
    row = step_rows(log_dir, 0)
    assert row["adv"] == row["ref"] == {
        "count": 3, "sum": 6.0, "min": 1.0, "max": 3.0, "bounds": [2.0], "counts": [1, 2],
    }  # fmt: skip
    assert row["adv/nan_count"] == 2.0
    assert row["adv/inf_count"] == 2.0
    assert not any(key.startswith("ref/") for key in row)


def test_log_histogram_of_values_beyond_half_the_float_range(log_dir):
    """A range or a sum beyond the largest float must not make the histogram fail."""
    with make_logger(log_dir) as logger:
        logger.log_histogram([1e308, 1e308, -1e308], step=0, name="big", bins=2)
        logger.log_histogram([1e308, 1e308], step=0, name="bigger", bins=2)
    row = step_rows(log_dir, 0)
    big = row["big"]
    assert (big["count"], big["min"], big["max"], big["counts"]) == (3, -1e308, 1e308, [1, 2])
    assert big["bounds"] == [0.0]
    assert big["sum"] == pytest.approx(1e308, rel=1e-15)
    assert row["bigger"]["sum"] == INF  # beyond the float range


def test_nemo_rl_generation_metrics_across_workers_leave_nans_out(log_dir):
    """NeMo RL's per-worker lists are merged into one list, then summarised the same way."""
    from otel_rl.compat.nemo_rl import Logger as NemoLogger

    logger = NemoLogger({"log_dir": str(log_dir), "jsonl_enabled": True, "wandb_enabled": False,
                         "tensorboard_enabled": False, "mlflow_enabled": False,
                         "monitor_gpus": False})  # fmt: skip
    metrics = {"generation_logger_metrics": {"tokens": {0: [1.0, NAN], 1: [NAN, 3.0, NAN]}}}
    logger.log_metrics(metrics, step=5, prefix="gen", step_finished=True)
    logger.finish()
    row = step_rows(log_dir, 5)
    key = "gen/generation_logger_metrics/tokens"
    assert row[f"{key}/count"] == 2.0
    assert row[f"{key}/mean"] == 2.0
    assert (row[f"{key}/min"], row[f"{key}/max"]) == (1.0, 3.0)
    assert row[f"{key}/nan_count"] == 3.0


def test_huge_finite_values_give_their_finite_std():
    """Squares of values beyond ~1e154 overflow; the std of such a list is still finite and
    every statistic arrives (found by the property above: [0, 0, 2.84e154] lost its summary)."""
    from otel_rl.core.values import summarize

    stats = summarize([0.0, 0.0, 2.8442255724327534e154])
    assert stats["std"] == pytest.approx(2.8442255724327534e154 * math.sqrt(2) / 3, rel=1e-12)
    assert stats["count"] == 3.0 and stats["max"] == 2.8442255724327534e154
    assert summarize([1e308, -1e308])["std"] == pytest.approx(1e308, rel=1e-12)


@settings(max_examples=40, deadline=None, database=None)
@seed(SEED)
@given(
    size=st.integers(min_value=4096, max_value=20_000),
    nans=st.integers(min_value=0, max_value=50),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    kind=st.sampled_from(["float64", "float32", "int64", "bool", "torch-bfloat16", "torch-2d"]),
)
def test_a_large_array_is_summarised_as_its_list_is(size, nans, seed, kind):
    """Arrays from NUMPY_SUMMARY_FROM elements on are summarised by numpy, in C: the same
    count, min, max, p50, p90 and nan_count as the exact path of the same values as a list, and
    mean and std to within float rounding. An infinity takes the exact path."""
    import torch

    from otel_rl.core.values import NUMPY_SUMMARY_FROM, flatten_into

    assert size >= NUMPY_SUMMARY_FROM
    rng = np.random.default_rng(seed)
    base = rng.normal(3.0, 100.0, size)
    if kind in ("float64", "float32"):
        base[rng.choice(size, nans, replace=False)] = np.nan
        value = base.astype(kind)
    elif kind == "int64":
        value = (base * 1000).astype(np.int64)
    elif kind == "bool":
        value = base > 0
    elif kind == "torch-bfloat16":
        value = torch.tensor(base).bfloat16()
    else:
        value = torch.tensor(base[: size - size % 2]).reshape(2, -1)
    fast: dict = {}
    flatten_into(fast, {"v": value}, "", lambda key, reason: pytest.fail(reason))
    as_list = value.reshape(-1).tolist() if hasattr(value, "reshape") else value.tolist()
    exact: dict = {}
    flatten_into(exact, {"v": as_list}, "", lambda key, reason: pytest.fail(reason))
    assert fast.keys() == exact.keys()
    for key in fast:
        if key.endswith(("/mean", "/std")):
            assert fast[key] == pytest.approx(exact[key], rel=1e-9, abs=1e-9), key
        else:
            assert same(fast[key], exact[key]), (key, fast[key], exact[key])
    with_inf = np.arange(float(size))
    with_inf[7] = INF
    fast, exact = {}, {}
    flatten_into(fast, {"v": with_inf}, "", lambda key, reason: None)
    flatten_into(exact, {"v": with_inf.tolist()}, "", lambda key, reason: None)
    assert all(same(fast[k], exact[k]) for k in exact) and fast.keys() == exact.keys()
