"""What feeds a run's trackers besides the training loop, built from the config and stopped by
the run's deadline: the pending-step checkpoints, the GPU monitor (Ray nodes), the rollout
monitor (inference engines) and the stall watch. Each runs on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import Observation

from otel_rl.core.records import OWN_SCOPE, StepBatch
from otel_rl.delivery.fanout import Fanout
from otel_rl.process.deadline import Deadline, Part
from otel_rl.run.checkpoint import PendingStepCheckpointer
from otel_rl.run.steps import StepAssembler
from otel_rl.telemetry.pipeline import Pipeline, not_typed

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings, RolloutMonitoringSection
    from otel_rl.run.picture import TimelineSender
    from otel_rl.watch.run_watch import RunWatch

#: The x-axis of rollout rows (docs/rollout-monitoring.md).
ROLLOUT_AXIS = "rollout/step"


class RunSources:
    """The sources of one run; ``gpu_monitor``, ``rollout_monitor`` and ``watch`` are ``None``
    when the config leaves them off."""

    def __init__(
        self,
        cfg: Mapping[str, Any] | LoggerSettings,
        *,
        run_id: str,
        pipeline: Pipeline,
        fanout: Fanout,
        steps: StepAssembler,
        step_spans: Any,
        flush_spans: Callable[[int], bool] | None = None,
        flush_trackers: Callable[[float], bool] | None = None,
    ) -> None:
        from otel_rl.config.schema import LoggerSettings  # resolved already: no import cost here

        if not isinstance(cfg, LoggerSettings):
            raise not_typed(cfg)
        self._run_id = run_id
        self._pipeline = pipeline
        self._fanout = fanout
        # Copies the step still being logged to the spools, so that a crash during a long
        # step loses at most export.fsync_interval of it (docs/reliability.md).
        self.checkpointer = PendingStepCheckpointer(
            cfg.export.fsync_interval / 2, steps.snapshot, fanout
        )
        self.checkpointer.start()
        self.gpu_monitor: Any = None
        if cfg.monitor_gpus:
            from otel_rl.ray.bridge import GpuMonitor

            self.gpu_monitor = GpuMonitor.from_config(
                cfg, meter_provider=pipeline.side_provider, exporters=fanout
            )
            self.gpu_monitor.start()
        self.rollout_monitor: Any = self._rollout_monitor(cfg.rollout_monitoring)
        if self.rollout_monitor is not None:
            steps.on_seal.append(self.rollout_monitor.mark_step)
        self.watch: RunWatch | None = self._watch(cfg, Path(cfg.log_dir), step_spans)
        #: The timeline for the trackers (``tracing.picture``): only where spans reach the disk.
        self.timeline: TimelineSender | None = None
        if flush_spans is not None and flush_trackers is not None and cfg.tracing.picture:
            from otel_rl.run.picture import TimelineSender

            self.timeline = TimelineSender(
                Path(cfg.log_dir), every=cfg.tracing.picture_every,
                steps=cfg.tracing.picture_steps, send=fanout.send,
                last_step=lambda: steps.last_step, flush_spans=flush_spans,
                flush_trackers=flush_trackers,
            )  # fmt: skip
            self.timeline.start()

    def flush(self, deadline: Deadline) -> bool:
        """Hand the GPU rows held to the trackers, and scrape the engines once more so the
        rollout rows of the steps sealed so far are sent; whether that scrape came in time."""
        if self.gpu_monitor is not None:
            self.gpu_monitor.flush()
        if self.rollout_monitor is not None:
            return bool(self.rollout_monitor.flush(deadline.left()))
        return True

    def stopping(self, deadline: Deadline) -> list[Part]:
        """Each source's stop by ``deadline`` (the last rows of the GPU and rollout monitors and
        a pending stall's end are sent to the trackers, which are still open)."""
        parts: list[Part] = [("pending-step checkpoints", self.checkpointer.stop)]
        watch, gpus, rollout = self.watch, self.gpu_monitor, self.rollout_monitor
        if watch is not None:
            parts.append(("stall watch", lambda: watch.stop(deadline.left())))
        if gpus is not None:
            parts.append(("GPU monitor", lambda: gpus.stop(deadline.left())))
        if rollout is not None:
            parts.append(("rollout monitor", lambda: rollout.close(timeout=deadline.left())))
        if self.timeline is not None:
            timeline = self.timeline
            parts.append(("timeline picture", lambda: timeline.stop(deadline.left())))
        return parts

    def _rollout_monitor(self, section: RolloutMonitoringSection) -> Any:
        enabled = section.enabled
        wanted = section.endpoints or section.source == "ray"
        if not (wanted if enabled is None else enabled):
            return None
        from otel_rl.rollout import RolloutMonitor

        monitor = RolloutMonitor.from_config(dict(section), emit=self._emit_rollout)
        if section.sd_file:
            monitor.keep_sd_file(section.sd_file, {"otel_rl_run_id": self._run_id})
        return monitor

    def _emit_rollout(self, step: int, values: dict[str, float]) -> None:
        """Rollout rows of a sealed step (monitor thread). They come after the step's own row,
        so they are a row of their own on the ``rollout/step`` axis, whose value is the training
        step: W&B plots them against it, the other trackers at the step itself."""
        self._fanout.send(StepBatch(step=step, values=values, axis=ROLLOUT_AXIS))

    def _watch(self, cfg: LoggerSettings, log_dir: Path, step_spans: Any) -> RunWatch:
        from otel_rl.watch.run_watch import OtlpLogRecords, RunWatch

        otlp = cfg.otlp if cfg.otlp.enabled else None
        gpu, pipeline, rollout = self.gpu_monitor, self._pipeline, self.rollout_monitor
        engines = None if rollout is None else rollout.engine_states
        watch = RunWatch(
            run_id=self._run_id,
            log_dir=log_dir,
            section=cfg.stalls,
            send=self._fanout.send,
            step_spans=step_spans,
            log_records=OtlpLogRecords(otlp, pipeline.resource) if otlp else None,
            gpu_latest=(lambda: gpu.scraper.latest) if gpu is not None else None,
            engines=engines,
            attempt=cfg.attempt,
        )
        if pipeline.has_side_readers:
            from otel_rl.core.catalogue import SECONDS_SINCE_STEP, STALLED

            meter = pipeline.side_provider.get_meter(OWN_SCOPE)
            attributes = {"run_id": self._run_id}
            STALLED.create(meter, [lambda options: [Observation(watch.stalled(), attributes)]])
            SECONDS_SINCE_STEP.create(
                meter, [lambda options: [Observation(watch.seconds_since_step(), attributes)]]
            )
        return watch
