"""Metrics from many workers, merged with per-metric reductions.

- :class:`WorkerMetrics` runs in each worker (Ray actor, torch rank) and hands out small picklable
  snapshots of what it recorded since the previous snapshot.
- :func:`merge_snapshots` (used by ``Logger.log_worker_metrics``) merges them on the driver.
- :func:`reduce_across_ranks` reduces a dict of scalars across torch.distributed ranks (SPMD).

Nothing heavy is imported until used.
"""

from __future__ import annotations

from otel_rl.core.lazy_exports import lazy_exports

_LAZY = {
    "WorkerMetrics": "otel_rl.distributed.worker",
    "merge_snapshots": "otel_rl.distributed.merge",
    "ReductionRules": "otel_rl.distributed.reductions",
    "ReductionConflictError": "otel_rl.distributed.reductions",
    "REDUCTIONS": "otel_rl.distributed.reductions",
    "reduce_across_ranks": "otel_rl.distributed.torch",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
