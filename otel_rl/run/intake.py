"""What the training thread hands to a run, on the caller's thread and cheap.

Values are flattened and checked (:func:`otel_rl.core.values.flatten_into`), each new key is
claimed once (and becomes an observable gauge for Prometheus/OTLP, read on their threads),
the stall watch is stamped, and the values merge into the pending step. Worker snapshots are
merged here first; plots and tables have their name and step checked before they are queued.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import Observation

from otel_rl.core.catalogue import ANATOMY, Metric
from otel_rl.core.errors import MetricError
from otel_rl.core.keys import KeyCollisionError
from otel_rl.core.paths import safe_relative
from otel_rl.core.records import OWN_SCOPE, StepBatch
from otel_rl.core.values import flatten_into
from otel_rl.distributed.reductions import ReductionRules
from otel_rl.run.anatomy import StepAnatomy
from otel_rl.run.run import Run
from otel_rl.run.steps import checked_step
from otel_rl.telemetry.timing import PhaseTimer


class Intake:
    """The caller's side of one :class:`~otel_rl.run.run.Run`."""

    def __init__(
        self,
        run: Run,
        reductions: Mapping[str, Any],
        *,
        strict: bool,
        report: Callable[[object, str], None],
        anatomy: bool = True,
    ) -> None:
        self._steps = run.steps
        self._fanout = run.fanout
        self._strict = strict
        self._report = report
        self._stats = run.stats
        self._keys = run.keys
        self._watch = run.sources.watch
        self._side_meter = run.pipeline.side_provider.get_meter(OWN_SCOPE)
        self._side_readers = run.pipeline.has_side_readers
        self._reductions = ReductionRules(reductions)
        self._timers = run.timers
        self._known: set[str] = set()
        self._latest: dict[str, float] = {}
        self._anatomy: StepAnatomy | None = None
        self._steps.admit = self._admit
        if anatomy:
            self._anatomy = StepAnatomy()
            self._steps.before_seal = self._anatomy_rows
            mark = self._anatomy.mark
            self._steps.after_add.append(lambda values: mark())
        if self._side_readers:  # Prometheus/OTLP read the latest value of each key
            self._steps.after_add.append(self._latest.update)

    def log(
        self,
        metrics: Mapping[Any, Any],
        step: int | None,
        prefix: str,
        step_metric: str | None,
        step_finished: bool,
    ) -> None:
        steps = self._steps
        if steps.closed:
            self._report("<log_metrics>", "called after finish(); values ignored")
            self._lost_after_finish(metrics, step)
            return
        if type(metrics) is not dict and not isinstance(metrics, Mapping):  # (an ABC check)
            raise MetricError(metrics, f"metrics must be a mapping, got {type(metrics).__name__}")
        fresh: dict[str, Any] = {}
        if step_metric is not None and prefix and step_metric in metrics:
            # NeMo RL convention: the step metric keeps its own name, unprefixed.
            metrics = dict(metrics)
            self._stats["nonfinite"] += flatten_into(
                fresh, {step_metric: metrics.pop(step_metric)}, "", self._report
            )
        self._stats["nonfinite"] += flatten_into(fresh, metrics, prefix, self._report)
        steps.log(step, fresh, prefix, step_metric, step_finished, self._strict)

    def _lost_after_finish(self, metrics: Any, step: Any) -> None:
        """Values logged after ``finish()`` reach no tracker: each tracker's delivery counts
        them (``after_shutdown``), as it counts any record it is sent after its shutdown."""
        values: dict[str, Any] = {}
        if isinstance(metrics, Mapping):
            flatten_into(values, metrics, "", lambda key, reason: None)
        self._fanout.send(StepBatch(step=step if type(step) is int else 0, values=values))

    def _admit(self, step: int, fresh: dict[str, Any]) -> None:
        """A call's values before they join the pending step (under the step lock): the stall
        watch is stamped, new keys are claimed (a collision refuses the call in strict mode)."""
        watch = self._watch
        if watch is not None:
            watch.stamp(step, fresh)
        if self._known.issuperset(fresh):  # the usual call: no new key, and no set built
            return
        new = fresh.keys() - self._known
        if new:
            self._refuse_unstorable(new, fresh)
            self._register(new, fresh)
            if watch is not None:
                watch.new_keys(step, fresh, new)

    def merged(
        self, snapshots: Sequence[Mapping[str, Any] | None], prefix: str
    ) -> dict[str, Any] | None:
        """``WorkerMetrics`` snapshots reduced into one row, or ``None`` (reported) when they
        cannot be merged."""
        from otel_rl.distributed.merge import merge_snapshots

        if self._anatomy is not None:
            self._steps.exclusively(self._anatomy.add_workers, snapshots)
        try:
            report = None if self._strict else self._report
            return merge_snapshots(snapshots, self._reductions, prefix, report=report)
        except MetricError:
            if self._strict:
                raise
        except Exception as exc:  # lenient mode: a malformed snapshot must not stop training
            if self._strict:
                raise MetricError("<log_worker_metrics>", f"{type(exc).__name__}: {exc}") from exc
            self._report("<log_worker_metrics>", f"failed: {type(exc).__name__}: {exc}")
        return None

    def _anatomy_rows(self, step: int) -> Mapping[str, Any]:
        """The sealed step's ``anatomy/*`` rows, their keys claimed as any logged key's are
        (step lock held)."""
        assert self._anatomy is not None
        rows = self._anatomy.rows()
        if not self._known.issuperset(rows):  # a phase timed for the first time
            self._register(set(rows.keys() - self._known), rows, ANATOMY)
        if self._side_readers:
            self._latest.update(rows)
        return rows

    def timer(self, name: Any) -> PhaseTimer:
        """The timer ``name``, its name checked as a logged key's is (each finding reported,
        raised in strict mode: :meth:`~otel_rl.telemetry.timing.TimerFactory.checked_timer`)."""
        return self._timers.checked_timer(name, self._report)

    def checked_record(self, name: Any, step: Any, what: str) -> int | None:
        """The step of a plot or table, or ``None`` (reported) when its name or step is refused.

        Trackers get the name as given; file-based ones store it through
        :func:`otel_rl.core.paths.safe_relative`, so a name with no usable path part is refused
        here, on the caller's thread, rather than on a tracker's.
        """
        try:
            if not isinstance(name, str):
                raise MetricError(name, f"{what} name must be a string, got {type(name).__name__}")
            try:
                safe_relative(name)
            except ValueError as exc:
                raise MetricError(name, f"{what} skipped: {exc}") from None
            try:
                return checked_step(step)
            except MetricError as exc:
                raise MetricError(name, f"{what} skipped: {exc.reason}") from None
        except MetricError as exc:
            self._report(exc.key, exc.reason)  # raises in strict mode
            return None

    def _refuse_unstorable(self, new: set[str], fresh: dict[str, Any]) -> None:
        """Leave out (reported) a new key that no tracker can store: one with a lone surrogate
        (``"\\udc80"``, from bytes decoded with ``surrogateescape``), which is no UTF-8."""
        for key in [k for k in new if not k.isascii()]:
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                new.discard(key)
                del fresh[key]
                self._report(key, "key skipped: it holds a lone surrogate, which no "
                             "tracker can store (decode its bytes with errors='replace')")

    def _register(
        self, new: set[str], fresh: Mapping[str, Any], family: Metric | None = None
    ) -> None:
        for key in [k for k in fresh if k in new]:  # in the call's order: the first one wins
            try:
                name = self._keys.claim(key, "gauge")
            except KeyCollisionError as exc:
                # The key still reaches the trackers; only the OTel instrument is refused.
                self._report(key, str(exc))
                self._known.add(key)
                continue
            self._known.add(key)
            # A key of yours whose first value is text may be a number later (its gauge reads
            # none until then); a histogram never is, nor otel-rl's own text rows.
            first = type(fresh[key])
            if self._side_readers and (first is float or (first is str and family is None)):
                if family is None:
                    self._side_meter.create_observable_gauge(name, callbacks=[self._observe(key)])
                else:  # one of otel-rl's own rows: its description from the catalogue
                    member = key.split("/", 1)[1]
                    family.create(self._side_meter, [self._observe(key)], name=name,
                                  description=family.member(member)[1])  # fmt: skip

    def _observe(self, key: str) -> Callable[[Any], list[Observation]]:
        latest = self._latest

        def callback(options: Any) -> list[Observation]:
            value = latest.get(key)
            if type(value) is float and math.isfinite(value):
                return [Observation(value)]
            return []

        return callback
