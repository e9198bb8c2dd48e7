"""verl's timing helpers, ``simple_timer`` and ``marked_timer`` (``verl.utils.profiler``, also
imported by ``verl.trainer.ppo.ray_trainer`` through ``verl.utils.debug``), with their signatures.

Each is a context manager that adds the block's elapsed seconds into ``timing_raw[name]``; verl's
trainer turns that dict into the ``timing_s/<name>`` keys of the step it logs. As in verl, a
block that raises adds nothing.

With a live Logger whose ``tracing.enabled`` is on (``otel_rl.compat.verl.Tracking`` or
``otel_rl.Logger``), each block is also an OTel span named ``name``, lasting exactly the seconds
it adds, nested as the code nests it, under the step's ``rl.step`` span; in a Ray worker where
``otel_rl.ray.tracing:setup`` ran, under the driver call that runs it (docs/tracing.md). With
tracing off the only cost is one look-up of two module globals per block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from otel_rl.telemetry.timing import TimerSpan, ambient_tracer, timer_closed, timer_opened

__all__ = ["marked_timer", "simple_timer"]


@contextmanager
def simple_timer(name: str, timing_raw: MutableMapping[str, float]) -> Iterator[None]:
    """Add the block's elapsed seconds into ``timing_raw[name]`` (created at 0)."""
    tracer = ambient_tracer()
    span = None if tracer is None else TimerSpan(tracer, name)
    timer_opened(name)
    from otel_rl.watch.job_state import publish_from_a_worker  # at first use: ~35 ms

    publish_from_a_worker()  # a worker's timer: its process says where it is
    start = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        timer_closed(name)
        if span is not None:
            span.close(time.perf_counter() - start, exc)
        raise
    elapsed = time.perf_counter() - start
    timer_closed(name)
    if name not in timing_raw:
        timing_raw[name] = 0
    timing_raw[name] += elapsed
    if span is not None:
        span.close(elapsed)


@contextmanager
def marked_timer(
    name: str,
    timing_raw: MutableMapping[str, float],
    color: str | None = None,
    **kwargs: Any,
) -> Iterator[None]:
    """:func:`simple_timer` with verl's profiler-marker arguments (``color``, ``domain``,
    ``category``), accepted and unused: verl's default, with no hardware profiler, ignores
    them too."""
    with simple_timer(name, timing_raw):
        yield
