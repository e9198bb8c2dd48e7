"""Reduce a dict of scalars across torch.distributed ranks (SPMD, e.g. under torchrun).

``reduce_across_ranks`` costs a fixed number of collectives whatever the number of keys:

1. Key-set check: ``all_reduce(MAX)`` of two numbers, a hash of this rank's sorted
   (key, reduction) list and its negation. Equal hashes everywhere (the usual case: every rank
   logs the same keys) mean the key order agrees. Otherwise every rank sees the mismatch and the
   lists are exchanged once with ``all_gather_object``; the union of keys is used from then on.
2. ``all_reduce(MAX)`` of one float64 vector: the ``max`` values and the negated ``min`` values.
3. ``all_reduce(SUM)`` of one vector: the ``sum`` values, the weighted values and weights of
   ``mean`` keys, and the ``last`` values (only the owning rank contributes).

4. For timings (keys under ``timing/`` reduced with ``max``), when there are two ranks or more:
   one ``all_gather`` of their values, for ``<key>/slowest_rank`` (the rank with the largest
   value; the lowest rank on a tie) and ``<key>/skew`` (max ÷ median across the ranks holding
   the key): one extra collective whatever the number of timings.

Steps 2 to 4 are skipped when no key needs them (the same decision on every rank, as every rank
then holds the same key list). A key present on only
some ranks is reduced over the ranks that have it: its ``sum`` adds what they hold, ``mean``
weighs only them, ``min``/``max`` ignore the others, and ``last`` is the value of the
highest-numbered rank holding it. Two ranks declaring different reductions for one key raise
:class:`ReductionConflictError` on every rank.

Works with gloo (CPU tensors) and NCCL (tensors on the current CUDA device).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from otel_rl.distributed.merge import skew, slowest_rank
from otel_rl.distributed.reductions import (
    DEFAULT_SCALAR,
    ReductionConflictError,
    ReductionRules,
    Spec,
)

#: The hash travels in float64 slots, which hold integers exactly up to 2**53.
_HASH_MODULUS = 2**52


def reduce_across_ranks(
    metrics: Mapping[str, float | tuple[float, float]],
    reductions: ReductionRules | Mapping[str, Any] | None = None,
    group: Any = None,
    *,
    device: Any = None,
) -> dict[str, float]:
    """Reduce ``metrics`` across the ranks of ``group``; every rank gets the same result.

    A value is a number, or ``(value, weight)`` for a weighted ``mean``. ``reductions`` maps keys
    or glob patterns to a reduction or a list of them (the first gives the key's value, the
    others add ``<key>/<name>``), as in the logger's ``reductions`` config; unmatched keys take
    the ``mean``. Must be called by every rank of ``group``, like any collective.
    """
    import torch
    import torch.distributed as dist

    rules = reductions if isinstance(reductions, ReductionRules) else ReductionRules(reductions)
    local: dict[str, tuple[Spec, float, float]] = {}
    for key, raw in metrics.items():
        value, weight = (raw if isinstance(raw, tuple) else (raw, 1.0))
        spec = (rules.lookup(key) if rules else None) or DEFAULT_SCALAR
        local[key] = (spec, float(value), float(weight))
    signature = sorted((key, spec) for key, (spec, _, _) in local.items())
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if device is None:
        device = _default_device(dist, group)

    # Every vector below has one layout on every rank only if the key lists agree: check first.
    fingerprint = _fingerprint(signature)
    highest, negated_lowest = _all_reduce(
        torch, dist, [fingerprint, -fingerprint], "max", group, device
    )
    if highest == -negated_lowest:
        owners = {key: world - 1 for key, _ in signature}
    else:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, signature, group=group)
        signature, owners = _union(gathered)
    maxima = _max_vector(signature, local)
    reduced_max = _all_reduce(torch, dist, maxima, "max", group, device) if maxima else []
    sums = _sum_vector(signature, local, owners, rank)
    reduced_sum = _all_reduce(torch, dist, sums, "sum", group, device) if sums else []
    out = _results(signature, reduced_max, reduced_sum)
    timings = [key for key, spec in signature if "max" in spec and is_timing(key)]
    if timings and world > 1:
        mine = [local[key][1] if key in local else math.nan for key in timings]
        rows = _all_gather(torch, dist, mine, world, group, device)
        for column, key in enumerate(timings):
            per_rank = [row[column] for row in rows]
            out[f"{key}/slowest_rank"] = slowest_rank((v, r) for r, v in enumerate(per_rank))
            out[f"{key}/skew"] = skew(per_rank)
    return out


def is_timing(key: str) -> bool:
    """A key under ``timing/`` (``timing/generation``, ``timing/train/step``)."""
    return key.startswith("timing/")


def _all_gather(
    torch: Any, dist: Any, values: list[float], world: int, group: Any, device: Any
) -> list[list[float]]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor, group=group)
    return [part.tolist() for part in parts]


def _default_device(dist: Any, group: Any) -> Any:
    if dist.get_backend(group) == "nccl":
        import torch

        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"


def _fingerprint(signature: list[tuple[str, Spec]]) -> float:
    text = "\n".join(f"{key}\t{','.join(spec)}" for key, spec in signature)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") % _HASH_MODULUS)


def _union(gathered: list[Any]) -> tuple[list[tuple[str, Spec]], dict[str, int]]:
    """The union of every rank's (key, spec) list, and the highest rank holding each key."""
    specs: dict[str, Spec] = {}
    owners: dict[str, int] = {}
    for rank, signature in enumerate(gathered):
        for key, spec in signature:
            known = specs.get(key)
            if known is not None and known != spec:
                raise ReductionConflictError(
                    key, f"reduced with {list(known)} on one rank and {list(spec)} on rank {rank}"
                )
            specs[key] = tuple(spec)
            owners[key] = rank
    return sorted(specs.items()), owners


def _max_vector(
    signature: list[tuple[str, Spec]], local: Mapping[str, tuple[Spec, float, float]]
) -> list[float]:
    """Two slots per (key, max|min): the value (negated for min; a rank without the key, or with
    NaN, sends -inf, the MAX identity) and a NaN flag, so that a NaN on any rank gives NaN
    whatever its rank (MAX itself is not NaN-aware: the result would depend on the order)."""
    out: list[float] = []
    for key, spec in signature:
        held = local.get(key)
        value = held[1] if held else -math.inf
        nan = value != value
        for name in spec:
            if name == "max":
                out += [-math.inf if nan else value, 1.0 if nan else 0.0]
            elif name == "min":
                out += [-math.inf if nan or not held else -value, 1.0 if nan else 0.0]
    return out


def _sum_vector(
    signature: list[tuple[str, Spec]],
    local: Mapping[str, tuple[Spec, float, float]],
    owners: Mapping[str, int],
    rank: int,
) -> list[float]:
    """Slots per (key, sum|mean|last): sum → value; mean → value·weight, weight; last → the
    value on the owning rank, 0 elsewhere. A rank without the key sends zeros."""
    out: list[float] = []
    for key, spec in signature:
        held = local.get(key)
        value, weight = (held[1], held[2]) if held else (0.0, 0.0)
        for name in spec:
            if name == "sum":
                out.append(value)
            elif name == "mean":
                out.extend((value * weight, weight))
            elif name == "last":
                out.append(value if owners[key] == rank else 0.0)
    return out


def _results(
    signature: list[tuple[str, Spec]], maxima: list[float], sums: list[float]
) -> dict[str, float]:
    out: dict[str, float] = {}
    i = j = 0
    for key, spec in signature:
        for position, name in enumerate(spec):
            target = key if position == 0 else f"{key}/{name}"
            if name == "max":
                out[target] = math.nan if maxima[i + 1] > 0 else maxima[i]
                i += 2
            elif name == "min":
                out[target] = math.nan if maxima[i + 1] > 0 else -maxima[i]
                i += 2
            elif name == "mean":
                total, weight = sums[j], sums[j + 1]
                out[target] = total / weight if weight > 0 else math.nan
                j += 2
            else:  # sum, last
                out[target] = sums[j]
                j += 1
    return out


def _all_reduce(
    torch: Any, dist: Any, values: list[float], op: str, group: Any, device: Any
) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    reduced: list[float] = tensor.tolist()
    return reduced
