"""WorkerMetrics: what one worker (a Ray actor, a torch rank) records between two snapshots."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.resources import OTELResourceDetector, Resource

from otel_rl.core.errors import shown_key
from otel_rl.core.keys import KeyRegistry
from otel_rl.distributed.reductions import REDUCTIONS, ReductionConflictError
from otel_rl.distributed.snapshot import (
    ANATOMY_KEY,
    LAST,
    LAST_TIME,
    MAX,
    MIN,
    REDUCE,
    SPANS_DROPPED_KEY,
    SPANS_KEY,
    SUM,
    WEIGHT,
    WSUM,
    N,
    add_otel_data,
    empty_snapshot,
)
from otel_rl.process.fork_safe_log import log
from otel_rl.telemetry.span_transfer import SpanCollector
from otel_rl.telemetry.step_reader import StepReader
from otel_rl.telemetry.timing import PhaseClock, PhaseTimer, TimerFactory, timing_totals
from otel_rl.telemetry.tracing import RunTracer, hook_active, hook_resource, hook_spans
from otel_rl.watch.job_state import publisher_of_this_process

#: The scope of ``WorkerMetrics.meter``.
USER_SCOPE = "otel_rl.worker"


class WorkerMetrics:
    """Record metrics and timings in a worker; hand them to the driver as small snapshots.

    ``record(key, value, reduce=..., weight=...)`` keeps a per-step accumulator (a dict update:
    cheap on the hot path, and exact for signed values, which OTel histograms would drop).
    ``timer(name)`` times a block into ``timing/<name>`` (seconds); ``meter`` gives plain OTel
    instruments on this worker's own MeterProvider.
    ``snapshot()`` returns everything since the previous snapshot as plain, picklable data
    (see :mod:`otel_rl.distributed.snapshot`) for ``Logger.log_worker_metrics`` on the driver.

    With tracing each timer is also a span, a child of whatever span is current — in a Ray actor
    method called by a traced driver, the driver's (docs/tracing.md). ``tracing=None`` (default)
    traces when the Ray tracing hook (``otel_rl.ray.tracing:setup``) ran in this process and then
    exports through the hook's OTLP exporter; ``tracing=True`` always traces, exporting to OTLP
    when ``otlp`` — the logger's ``otlp`` config section — is given, else through the hook's
    exporter if any (``tracer_provider`` accepts more span processors). Each span's resource
    names the run (``otel_rl.run_id``) of the driver call it runs in — learnt from the call's
    W3C baggage, span by span, so a worker that timed a warm-up before the run existed still
    labels its later spans — or ``run_id`` when given.
    """

    def __init__(
        self,
        rank: int = 0,
        role: str = "worker",
        *,
        tracing: bool | None = None,
        otlp: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.rank = int(rank)
        self.role = str(role)
        attributes: dict[str, Any] = {
            "otel_rl.role": self.role,
            "otel_rl.rank": self.rank,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
        if run_id:
            attributes["otel_rl.run_id"] = run_id
        if "service.name" not in OTELResourceDetector().detect().attributes:
            # the driver's default, unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name it
            attributes["service.name"] = "otel-rl"
        self.resource = Resource.create(attributes)
        if tracing is None:
            tracing = hook_active()
        self._reader = StepReader()
        self.meter_provider = MeterProvider(
            metric_readers=[self._reader],
            resource=self.resource,
            exemplar_filter=AlwaysOffExemplarFilter(),
            shutdown_on_exit=False,
        )
        #: Plain OTel instruments: counters sum across workers, histograms merge exactly,
        #: gauges follow the driver's ``reductions`` (default ``mean``).
        self.meter = self.meter_provider.get_meter(USER_SCOPE)
        # Each span names the run of the driver call it runs in (W3C baggage), whenever that run
        # began: timers of a warm-up before the driver's Logger existed leave no mark on later
        # spans. A ``run_id`` given here names every span.
        # A tracing worker's spans also travel to the driver in its snapshots (its trace file);
        # where the Ray hook ran, with the process's other spans (Ray's own): their parents.
        self._spans = (hook_spans() or SpanCollector()) if tracing else None
        self._tracer: RunTracer | None = (
            RunTracer(self._span_resource, otlp, processors=[self._spans]) if tracing else None
        )
        self._span_attributes = {"otel_rl.role": self.role, "otel_rl.rank": self.rank}
        self._keys = KeyRegistry()
        # the worker's own timers' time (a worker inside the driver's process counts only its own)
        self._clock = PhaseClock()
        self._timers = TimerFactory(
            self._keys, self._tracer, self._span_attributes, clock=self._clock
        )
        self._declared: dict[str, str | None] = {}
        self._said: set[tuple[str, str]] = set()
        self._scalars: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        #: The last step snapshotted and its Unix time, for the job's stall verdict.
        self._last_step: tuple[int | None, float | None] = (None, None)
        publisher_of_this_process(self._job_activity, role=self.role, rank=self.rank)

    def record(
        self,
        key: str,
        value: float,
        reduce: str | None = None,
        weight: float | None = None,
    ) -> None:
        """Record ``value`` under ``key`` for the current step.

        ``reduce`` says how values combine, within this worker's step and across workers:
        ``"mean"`` (weighted by ``weight``, default 1 per value), ``"sum"``, ``"min"``, ``"max"``
        or ``"last"``. ``None`` leaves it to the driver's ``reductions`` config (default
        ``mean``). A key keeps the reduction it was first declared with; declaring another raises
        :class:`ReductionConflictError`.
        """
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError) as exc:  # it costs only itself
            self._report(key, f"value {value!r:.40} skipped: no number ({exc})")
            return
        if weight is None:
            w = 1.0
        else:
            w = float(weight)
            if not w >= 0.0:
                raise ValueError(f"metric {key!r}: weight must be >= 0, got {weight!r}")
        now = time.time()
        with self._lock:
            acc = self._scalars.get(key)
            if acc is None:
                declared = self._declare(key, reduce)
                self._scalars[key] = [declared, 1, v, v * w, w, v, v, v, now]
                return
            if reduce is not None and reduce != acc[REDUCE]:
                acc[REDUCE] = self._declare(key, reduce)
            acc[N] += 1
            acc[SUM] += v
            acc[WSUM] += v * w
            acc[WEIGHT] += w
            # written so that a NaN, once seen, stays: a NaN loss must reach the driver
            if (v < acc[MIN] or v != v) and acc[MIN] == acc[MIN]:
                acc[MIN] = v
            if (v > acc[MAX] or v != v) and acc[MAX] == acc[MAX]:
                acc[MAX] = v
            acc[LAST] = v
            acc[LAST_TIME] = now

    def timer(self, name: str) -> PhaseTimer:
        """Time a block or function into ``timing/<name>`` (seconds; repeated uses within one
        snapshot add up; the driver reduces the per-worker totals with ``max`` by default)."""
        return self._timers.checked_timer(name, self._report)

    def snapshot(self, step: int | None = None) -> dict[str, Any]:
        """Everything recorded since the previous snapshot, as plain picklable data.

        ``step`` tags the snapshot (the Ray aggregator's ``drain(step)`` uses it); the driver
        still logs it at the step it passes to ``log_worker_metrics``.
        """
        now = time.time()
        if step is not None:
            self._last_step = (step, now)
        with self._lock:
            scalars, self._scalars = self._scalars, {}
        snap = empty_snapshot(self.rank, self.role, step, now)
        snap["scalars"] = {key: tuple(acc) for key, acc in scalars.items()}
        for key in add_otel_data(snap, self._reader.take(), now):
            self._report(key, "recorded with record() and by an OTel instrument of this worker's "
                         "meter: the record()ed values are kept, the instrument's left out (give "
                         "them two names)")  # fmt: skip
        snap["timings"].update(timing_totals(self._timers.take()))
        snap[ANATOMY_KEY] = self._clock.take()
        if self._spans is not None:
            snap[SPANS_KEY], snap[SPANS_DROPPED_KEY] = self._spans.take()
        return snap

    def _job_activity(self) -> tuple[int | None, float | None]:
        return self._last_step

    @property
    def tracer_provider(self) -> Any:
        """The provider of this worker's timer spans (``None`` without tracing); span
        processors added to it see the spans of every run."""
        return None if self._tracer is None else self._tracer.provider

    def close(self) -> None:
        """Shut the worker's providers down (flushes spans to OTLP, if configured)."""
        self.meter_provider.shutdown(timeout_millis=5_000)
        if self._tracer is not None:
            self._tracer.shutdown()

    def _span_resource(self) -> Resource:
        base = hook_resource()
        if base is not None:  # the process's service name and Ray node, then this worker's own
            return cast(Resource, base.merge(self.resource))
        return self.resource

    def __enter__(self) -> WorkerMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _report(self, key: str, reason: str) -> None:
        """Say once per key and reason what became of a value, a timer or an instrument."""
        if (key, reason) not in self._said:
            self._said.add((key, reason))
            log.warning("otel-rl: worker %s %d: %s: %s", self.role, self.rank, shown_key(key),
                        reason)  # fmt: skip

    def _declare(self, key: str, reduce: str | None) -> str | None:
        """The reduction ``key`` keeps (caller holds the lock)."""
        known = self._declared.get(key)
        if reduce is None:
            if key not in self._declared:
                self._declared[key] = None
            return known
        if reduce not in REDUCTIONS:
            raise ValueError(
                f"metric {key!r}: unknown reduction {reduce!r}; choose from {', '.join(REDUCTIONS)}"
            )
        if known is not None and known != reduce:
            raise ReductionConflictError(
                key, f"declared with reduce={known!r} before, now reduce={reduce!r}"
            )
        self._declared[key] = reduce
        return reduce
