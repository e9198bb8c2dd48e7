"""``reduce_across_ranks`` on two real gloo ranks (torch.multiprocessing spawn, CPU).

Each rank runs the scenarios below and writes what it got to a file; the test checks the values
on both ranks and counts the collectives each call issued (a counting wrapper around every
collective of ``torch.distributed``).
"""

from __future__ import annotations

import datetime
import math
import pickle
import traceback
from pathlib import Path

import pytest

WORLD = 2
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "reduce_scatter", "barrier",
)  # fmt: skip


def _count_collectives(dist) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _measured(counts, fn):
    before = dict(counts)
    result = fn()
    return result, {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from otel_rl.distributed import ReductionConflictError, reduce_across_ranks

    # a bounded timeout: a mismatched collective fails the test instead of hanging it
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    counts = _count_collectives(dist)
    out: dict = {}
    try:
        rules = {"timing/*": ["max", "min", "mean"], "*tokens": "sum", "*lr": "last"}

        def same_keys(n: int) -> dict:
            metrics = {f"loss_{i}": float(rank + i) for i in range(n)}
            metrics.update({"timing/gen": 1.0 + rank, "tokens": 100.0 * (rank + 1), "lr": 0.1})
            metrics["reward"] = (1.0, 1.0) if rank == 0 else (3.0, 3.0)  # weighted mean
            return reduce_across_ranks(metrics, rules)

        out["small"], out["small_calls"] = _measured(counts, lambda: same_keys(10))
        out["large"], out["large_calls"] = _measured(counts, lambda: same_keys(1000))

        def uneven(n: int) -> dict:
            metrics = {f"shared_{i}": float(rank) for i in range(n)}
            if rank == 0:
                metrics.update({"only0/tokens": 5.0, "only0/lr": 0.5, "only0": 7.0})
            else:
                metrics.update({"timing/only1": 2.0, "only1": (4.0, 2.0)})
            return reduce_across_ranks(metrics, rules)

        out["uneven"], out["uneven_calls"] = _measured(counts, lambda: uneven(5))
        _, out["uneven_large_calls"] = _measured(counts, lambda: uneven(500))

        conflicting = {"x": "sum"} if rank == 0 else {"x": "max"}
        try:
            reduce_across_ranks({"x": 1.0}, conflicting)
        except ReductionConflictError as exc:
            out["conflict"] = str(exc)
        out["empty"] = reduce_across_ranks({}, rules)
        nan = math.nan
        out["nan_timing"] = reduce_across_ranks(
            {"timing/none": nan, "timing/half": nan if rank == 0 else 0.5}, rules
        )
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("gloo")
    mp.spawn(_rank_main, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}:\n{result['error']}"
    return results


@pytest.mark.slow
def test_values_are_reduced_and_identical_on_every_rank(ranks):
    for result in ranks:
        small = result["small"]
        assert small["loss_3"] == 3.5  # mean of 3 and 4
        assert small["tokens"] == 300.0  # sum
        assert small["lr"] == 0.1  # last (rank 1's)
        assert small["reward"] == 2.5  # (1·1 + 3·3) / (1 + 3)
        assert (small["timing/gen"], small["timing/gen/min"], small["timing/gen/mean"]) == (
            2.0, 1.0, 1.5,
        )  # fmt: skip
        assert (small["timing/gen/slowest_rank"], small["timing/gen/skew"]) == (1.0, 2.0 / 1.5)
        assert len(result["large"]) == 1000 + 6 + 2
        assert result["large"]["loss_999"] == 999.5
    assert ranks[0]["small"] == ranks[1]["small"] and ranks[0]["large"] == ranks[1]["large"]


@pytest.mark.slow
def test_keys_on_only_one_rank_are_reduced_over_the_ranks_that_have_them(ranks):
    for result in ranks:
        uneven = result["uneven"]
        assert uneven["shared_0"] == 0.5
        assert uneven["only0/tokens"] == 5.0 and uneven["only0/lr"] == 0.5
        assert uneven["only0"] == 7.0  # a mean over the one rank that has it
        assert uneven["only1"] == 4.0  # weighted by its own weight only
        assert (
            uneven["timing/only1"], uneven["timing/only1/min"], uneven["timing/only1/mean"]
        ) == (2.0, 2.0, 2.0)
        # held by one rank: it is the slowest, and as slow as the typical one
        assert (uneven["timing/only1/slowest_rank"], uneven["timing/only1/skew"]) == (1.0, 1.0)
        assert not any(math.isnan(v) or math.isinf(v) for v in uneven.values())
        assert "'x'" in result["conflict"] and "['sum']" in result["conflict"]
        assert result["empty"] == {}
    assert ranks[0]["uneven"] == ranks[1]["uneven"]


@pytest.mark.slow
def test_collectives_do_not_grow_with_the_number_of_keys(ranks):
    for result in ranks:
        # same keys everywhere: the key-set hash check, one MAX and one SUM all_reduce, and one
        # all_gather of the timings for their slowest rank and skew
        assert result["small_calls"] == result["large_calls"] == {
            "all_reduce": 3, "all_gather": 1,
        }  # fmt: skip
        # different keys: the hash disagrees → the key lists are exchanged once
        assert result["uneven_calls"] == result["uneven_large_calls"] == {
            "all_reduce": 3, "all_gather_object": 1, "all_gather": 1,
        }  # fmt: skip


@pytest.mark.slow
def test_a_timing_that_is_nan_on_every_rank_is_nan_and_not_an_error(ranks):
    """NaN is kept whichever rank holds it (docs/distributed.md): a timing NaN on every rank is
    NaN, its slowest rank too (no rank has a time: it raised ``ValueError`` on every rank);
    NaN on one rank makes the timing NaN and leaves the other the slowest."""
    for result in ranks:
        got = result["nan_timing"]
        assert all(math.isnan(got[f"timing/none{extra}"])
                   for extra in ("", "/min", "/mean", "/slowest_rank", "/skew"))  # fmt: skip
        assert math.isnan(got["timing/half"])
        assert (got["timing/half/slowest_rank"], got["timing/half/skew"]) == (1.0, 1.0)
