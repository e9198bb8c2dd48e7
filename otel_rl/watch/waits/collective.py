"""A wait in a ``torch.distributed`` collective (or point-to-point call) of a process group: the
op, the tensor, the group's name, backend and size. Which rank has not joined it is the job's
verdict's to say (:mod:`otel_rl.watch.job_verdict`), from every rank's published state."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

from otel_rl.watch.locks import where as _where
from otel_rl.watch.waits.base import Following, Wait, in_module, local_vars

__all__ = ["COLLECTIVES", "CollectiveWait", "group_name", "recognise"]

#: ``torch.distributed`` functions that are collectives (or point-to-point waits) of a group.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced",
    "new_group", "init_process_group",
})  # fmt: skip


@dataclass
class CollectiveWait(Wait):
    kind: ClassVar[str] = "collective"
    op: str | None = None  # the torch.distributed function: "all_reduce"
    group: str | None = None  # the process group's name: "default", its description

    def follow(self, following: Following) -> None:
        job = following.verdict.job
        if job is None:
            following.verdict.missing.append("which rank has not joined it (each rank's own "
                                             "stall report says where that rank is)")  # fmt: skip
        elif not job.sentence:
            following.verdict.missing.append("which rank has not joined it: every rank that "
                                             "published its state is in it")  # fmt: skip


def recognise(frames: list[FrameType]) -> CollectiveWait | None:
    for frame in frames:
        if not in_module(frame, "torch/distributed/distributed_c10d.py"):
            continue
        op = frame.f_code.co_name
        if op not in COLLECTIVES:
            continue
        variables = local_vars(frame)
        group = variables.get("group", variables.get("pg"))
        details = _group_details(group)
        tensor = variables.get("tensor", variables.get("tensors"))
        if hasattr(tensor, "shape") and hasattr(tensor, "dtype"):
            details.insert(0, f"{str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)}")
        words = f"torch.distributed.{op}" + (f" ({', '.join(details)})" if details else "")
        return CollectiveWait(words, f"its stack, frame {_where(frame)}", op=op,
                              group=group_name(group))  # fmt: skip
    return None


def group_name(group: Any) -> str:
    """A process group's name, the same on every rank: ``default`` for the default group
    (``None``), else its description or its name in ``torch.distributed``'s registry."""
    dist = sys.modules.get("torch.distributed")
    if group is None or dist is None:
        return "default"
    c10d = dist.distributed_c10d
    with contextlib.suppress(Exception):
        if group is c10d._get_default_group():
            return "default"
    desc = getattr(group, "group_desc", "")
    if isinstance(desc, str) and desc and desc != "undefined":
        return desc
    with contextlib.suppress(Exception):
        return str(c10d._world.pg_names[group])
    return "a group"


def _group_details(group: Any) -> list[str]:
    """The process group's backend and size, when torch can say."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return []
    details = []
    with contextlib.suppress(Exception):
        details.append(str(dist.get_backend(group)))
    with contextlib.suppress(Exception):
        details.append(f"{dist.get_world_size(group)} ranks")
    return details
