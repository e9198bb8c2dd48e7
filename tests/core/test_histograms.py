"""``log_histogram`` at the edges of the float range, and numpy's binning of large arrays.

A histogram of any values costs only itself: degenerate ranges (one value, values all equal,
subnormal differences whose bin width rounds to zero, a range beyond the largest float) are
binned by one documented rule (docs/configuration.md, "NaN and inf in lists and histograms"),
and values that are not numbers skip that histogram with a warning. Arrays, tensors and lists
of ``NUMPY_SUMMARY_FROM`` elements and more are binned by numpy with the same bounds and counts
as the exact path.

Environment: ``OTEL_RL_PROPERTY_SEED`` (default 12) seeds the search.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import example, given, seed, settings
from hypothesis import strategies as st

from otel_rl import Logger
from otel_rl.core.records import CountedHistogram, histogram_of
from otel_rl.core.values import NUMPY_SUMMARY_FROM, _histogram_of_array, histogram_of_values
from testkit.readers import jsonl_rows

SEED = int(os.environ.get("OTEL_RL_PROPERTY_SEED", "12"))
INF, NAN = math.inf, math.nan
MAX = sys.float_info.max
TINY = 5e-324  # the smallest subnormal


def make_logger(log_dir) -> Logger:
    return Logger({"log_dir": str(log_dir), "export": {"spool": False, "on_full": "block"}})


def step_rows(log_dir, step: int) -> dict:
    (row,) = [r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl") if r["step"] == step]
    return row


# (values, bins, bounds, counts): what each degenerate range becomes.
DEGENERATE = {
    # A bin width of (5e-324 - 0) / 4 rounds to 0.0: binned as one value is.
    "subnormal pair": ([0.0, TINY], 4, [1.0, 2.0, 3.0], [2, 0, 0, 0]),
    "subnormals only": ([TINY, 2 * TINY, 3 * TINY], 30, [TINY + i for i in range(1, 30)],
                        [3] + [0] * 29),
    "one value": ([7.0], 4, [8.0, 9.0, 10.0], [1, 0, 0, 0]),
    "all equal": ([-2.5] * 5, 3, [-1.5, -0.5], [5, 0, 0]),
    "negative zero and zero": ([-0.0, 0.0], 2, [1.0], [2, 0]),
    # hi - lo overflows to inf: measured in halves, every bound finite.
    "plus and minus the largest float": ([-MAX, MAX], 4, [-MAX / 2, 0.0, MAX / 2], [1, 0, 0, 1]),
    "the largest float with inf and nan": ([-MAX, INF, MAX, NAN, -INF], 4,
                                           [-MAX / 2, 0.0, MAX / 2], [1, 0, 0, 1]),
}  # fmt: skip


@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_ranges_give_a_histogram_of_finite_bounds(log_dir, case):
    values, bins, bounds, counts = DEGENERATE[case]
    with make_logger(log_dir) as logger:
        logger.log_histogram(values, step=0, name="h", bins=bins)
        logger.log_metrics({"after": 1.0}, step=0)
    row = step_rows(log_dir, 0)
    finite = [v for v in values if math.isfinite(v)]
    hist = row["h"]
    assert hist["bounds"] == pytest.approx(bounds, rel=1e-15)
    assert hist["counts"] == counts
    assert all(math.isfinite(b) for b in hist["bounds"])
    assert hist["bounds"] == sorted(hist["bounds"])
    assert (hist["count"], hist["min"], hist["max"]) == (len(finite), min(finite), max(finite))
    assert hist["sum"] == math.fsum(finite)
    assert row.get("h/nan_count", 0.0) == sum(1 for v in values if v != v)
    assert row.get("h/inf_count", 0.0) == sum(1 for v in values if math.isinf(v))
    assert row["after"] == 1.0


def test_only_nan_and_inf_give_an_empty_histogram_and_their_counts(log_dir):
    with make_logger(log_dir) as logger:
        logger.log_histogram([NAN, INF, -INF, NAN], step=0, name="h", bins=2)
    row = step_rows(log_dir, 0)
    assert (row["h"]["count"], row["h"]["counts"]) == (0, [0, 0])
    assert (row["h/nan_count"], row["h/inf_count"]) == (2.0, 2.0)


@pytest.mark.parametrize(
    ("values", "bins", "reason"),
    [
        ([1.0, None], 30, "TypeError"),
        ([1.0, "loss"], 30, "ValueError"),
        ([1.0, 2.0], 0, "bins must be an integer from 1 to 10000, not 0"),
        ([1.0, 2.0], 2.5, "bins must be an integer from 1 to 10000, not 2.5"),
        ([1.0, 2.0], True, "bins must be an integer from 1 to 10000, not True"),
        # checked before the values are read: 10**9 bins would take seconds and gigabytes
        ([1.0, 2.0], 10**9, "bins must be an integer from 1 to 10000, not 1000000000"),
        (list(range(100_000)), 10_001, "not 10001"),
    ],
)
def test_a_histogram_that_cannot_be_made_is_skipped_alone_with_a_warning(
    log_dir, otel_rl_warnings, values, bins, reason
):
    with make_logger(log_dir) as logger:
        logger.log_histogram(values, step=0, name="h", bins=bins)
        logger.log_metrics({"loss": 0.5}, step=0)
    assert step_rows(log_dir, 0) == {"loss": 0.5}
    (message,) = [r.getMessage() for r in otel_rl_warnings.records if "'h'" in r.getMessage()]
    assert "histogram skipped" in message and reason in message


def test_bins_may_be_any_integer_type_up_to_the_most(log_dir):
    np = pytest.importorskip("numpy")
    with make_logger(log_dir) as logger:
        logger.log_histogram([0.0, 1.0, 2.0, 3.0], step=0, name="h", bins=np.int64(2))
        logger.log_histogram([0.0, 1.0], step=1, name="h", bins=10_000)
    assert step_rows(log_dir, 0)["h"]["counts"] == [2, 2]
    assert len(step_rows(log_dir, 1)["h"]["counts"]) == 10_000


def assert_same_histogram(fast: CountedHistogram, exact: CountedHistogram) -> None:
    """Everything equal, the sum to within float rounding (numpy's pairwise sum)."""
    assert fast.bounds == exact.bounds
    assert fast.counts == exact.counts
    assert (fast.count, fast.nan_count, fast.inf_count) == (
        exact.count, exact.nan_count, exact.inf_count
    )
    assert (fast.min, fast.max) == (exact.min, exact.max)
    assert math.copysign(1.0, fast.min) == math.copysign(1.0, exact.min)
    if math.isinf(exact.sum):
        assert fast.sum == exact.sum
    else:
        scale = max(abs(fast.min), abs(fast.max), 1.0)
        assert fast.sum == pytest.approx(exact.sum, rel=1e-9, abs=scale * fast.count * 1e-15)


def both_paths(value, bins: int) -> tuple[CountedHistogram, CountedHistogram]:
    """numpy's histogram of ``value`` (which it must take) and the exact one of its values."""
    is_array = hasattr(value, "shape")
    fast = _histogram_of_array(value, bins, is_array)
    assert fast is not None
    assert histogram_of_values(value, bins) == fast  # large inputs take numpy's path
    as_list = value.reshape(-1).tolist() if is_array else value
    return fast, histogram_of([float(x) for x in as_list], bins)


N = NUMPY_SUMMARY_FROM
RNG = np.random.default_rng(SEED)
EDGE_CASES = {
    "normal float64": RNG.normal(3.0, 100.0, N),
    "uniform float32": RNG.uniform(-1.0, 1.0, 3 * N).astype(np.float32),
    # Integers on a grid of 31 values in 30 bins: hundreds of values exactly on a bin edge.
    "integers on the bin edges": np.arange(2 * N) % 31,
    "thirds on the bin edges": (np.arange(N) % 10) / 3.0,
    "bool": RNG.normal(size=N) > 0,
    "with nan and inf": np.where(RNG.random(N) < 0.01, np.nan,
                                 np.where(RNG.random(N) < 0.01, np.inf, RNG.normal(size=N))),
    "only nan": np.full(N, np.nan),
    "all equal": np.full(N, 1e300),
    "subnormals": np.resize(np.array([0.0, TINY, 2 * TINY]), N),
    "plus and minus the largest float": np.resize(np.array([-MAX, MAX, 0.0, MAX / 3]), N),
    "sum beyond the float range": np.full(N, MAX / 2),
    "negative zeros": np.resize(np.array([-0.0, 0.0, 1.0]), N),
    "two dimensions": RNG.normal(size=(64, N // 32)),
    "list of floats": RNG.normal(size=N).tolist(),
    "tuple of ints and floats": tuple([1, 2.5, -3] * N),
}  # fmt: skip


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("bins", [1, 7, 30])
def test_numpy_bins_a_large_input_as_the_exact_path_does(case, bins):
    fast, exact = both_paths(EDGE_CASES[case], bins)
    assert_same_histogram(fast, exact)
    assert sum(fast.counts) == fast.count


def test_values_exactly_on_the_bin_edges_and_the_maximum_fall_in_the_same_bins():
    """The exact path's own bounds, and the max, logged as values: each lands where the exact
    path puts it (the max in the last bin)."""
    data = RNG.normal(0.0, 1e-3, N)
    bounds = histogram_of(data.tolist(), 30).bounds
    value = np.concatenate([data, bounds, bounds, [data.max()] * 5])
    fast, exact = both_paths(value, 30)
    assert_same_histogram(fast, exact)
    assert fast.counts[-1] >= 5


def test_a_tensor_is_binned_as_its_list():
    torch = pytest.importorskip("torch")
    tensor = torch.tensor(RNG.normal(size=2 * N)).bfloat16().reshape(2, -1)
    fast, exact = both_paths(tensor, 30)
    assert_same_histogram(fast, exact)


def test_a_large_list_numpy_cannot_read_as_numbers_takes_the_exact_path():
    values = [Decimal("1.5"), Decimal("-2")] * N
    assert _histogram_of_array(values, 30, False) is None
    assert histogram_of_values(values, 30) == histogram_of([float(v) for v in values], 30)
    with pytest.raises(TypeError):
        histogram_of_values([1.0] * N + [None], 30)


@settings(max_examples=60, deadline=None, database=None)
@seed(SEED)
@given(
    size=st.integers(min_value=N, max_value=3 * N),
    bins=st.integers(min_value=1, max_value=64),
    center=st.sampled_from([0.0, 1.0, -1e6, 1e300, TINY]),
    spread=st.sampled_from([0.0, TINY, 1e-300, 1e-9, 1.0, 1e6, 1e307]),
    special=st.integers(min_value=0, max_value=20),
    rng_seed=st.integers(min_value=0, max_value=2**32 - 1),
    dtype=st.sampled_from(["float64", "float32"]),
)
@example(size=N, bins=30, center=0.0, spread=TINY, special=0, rng_seed=0, dtype="float64")
@example(size=N, bins=30, center=0.0, spread=1e307, special=3, rng_seed=1, dtype="float64")
def test_numpy_and_the_exact_path_agree_on_random_arrays(
    size, bins, center, spread, special, rng_seed, dtype
):
    rng = np.random.default_rng(rng_seed)
    with np.errstate(over="ignore"):
        value = (center + spread * rng.standard_normal(size)).astype(dtype)
        places = rng.choice(size, special, replace=False)
        value[places] = rng.choice([np.nan, np.inf, -np.inf], special)
    fast, exact = both_paths(value, bins)
    assert_same_histogram(fast, exact)


def test_log_histogram_of_a_large_array_gives_the_rows_of_its_list(log_dir):
    value = RNG.normal(size=2 * N).astype(np.float32)
    value[::97] = np.nan
    with make_logger(log_dir) as logger:
        logger.log_histogram(value, step=0, name="array", bins=30)
        logger.log_histogram(value.tolist(), step=0, name="list", bins=30)
        logger.log_histogram(value[:100].tolist(), step=1, name="small", bins=30)
        logger.log_histogram(value[:100], step=1, name="small_array", bins=30)
    row = step_rows(log_dir, 0)
    for part in ("bounds", "counts", "count", "min", "max"):
        assert row["array"][part] == row["list"][part], part
    assert row["array"]["sum"] == pytest.approx(row["list"]["sum"], rel=1e-9)
    assert row["array/nan_count"] == row["list/nan_count"] == len(value[::97])
    small = step_rows(log_dir, 1)
    assert small["small"] == small["small_array"]


def test_a_large_list_is_binned_without_importing_numpy():
    """numpy stays unloaded unless the caller loaded it: a large list takes the exact path."""
    code = (
        "import sys, otel_rl\n"
        "from otel_rl.core.values import histogram_of_values\n"
        f"h = histogram_of_values([float(i % 31) for i in range({2 * N})], 30)\n"
        "print(sum(h.counts), h.counts[0], 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(2 * N), str(len(range(0, 2 * N, 31))), "False"]
