"""What a run's watchers hear when it stops moving or waits for one rank: the glue between the
training loop, the stall watchdog (:mod:`otel_rl.watch.stalls`), the straggler watch
(:mod:`otel_rl.watch.stragglers`) and the run's outputs.

On the training thread :meth:`RunWatch.stamp` costs a clock read and two attribute checks per
``log_metrics`` call. Everything else happens on the watchdog's thread: the report, one warning
through ``logging``, an :class:`~otel_rl.core.records.Event` to every tracker, a span event on the
current ``rl.step`` span (tracing) and an OTel log record (OTLP), and the gauges
``otel_rl.stalled`` and ``otel_rl.seconds_since_step`` that Prometheus and OTLP read.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.core.records import Event
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.watch.job_state import (
    PUBLISH_EVERY,
    StatePublisher,
    publisher_of_this_process,
    shared_directory,
)
from otel_rl.watch.job_verdict import job_verdict
from otel_rl.watch.stalls import (
    StallReport,
    StallWatchdog,
    ended_summary,
    gpu_readings,
    nccl_flight_recorder,
    ray_stacks,
    seconds,
    thread_stacks,
)
from otel_rl.watch.stragglers import SLOWEST_SUFFIX, Straggler, StragglerWatch

__all__ = ["STALL_SECONDS_KEY", "RunWatch"]

#: The row that carries a stall's length, at the first step after it.
STALL_SECONDS_KEY = "stall/seconds"
STALL_EVENT = "otel_rl/stall"
STRAGGLER_EVENT = "otel_rl/straggler"
#: Finished steps whose wall times are kept (more than any straggler window needs).
KEPT_WALLS = 1024


class RunWatch:
    """The stall watchdog and the straggler watch of one run, and everything they tell.

    ``send`` queues a record for the trackers; ``step_spans`` (tracing) gets span events;
    ``log_records`` (OTLP) emits OTel log records; ``gpu_latest`` returns the GPU bridge's last
    readings by node; ``engines`` the rollout monitor's engines as of its latest scrape
    (:meth:`otel_rl.rollout.monitor.RolloutMonitor.engine_states`).
    """

    def __init__(
        self,
        *,
        run_id: str,
        log_dir: Path,
        section: Mapping[str, Any],
        send: Callable[[Any], Any],
        step_spans: Any = None,
        log_records: Any = None,
        gpu_latest: Callable[[], Mapping[int, Any]] | None = None,
        engines: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
        attempt: int = 1,
    ) -> None:
        self.run_id = run_id
        self.report_dir = log_dir / "stalls"
        self._send = send
        self._step_spans = step_spans
        self._log_records = log_records
        self._gpu_latest = gpu_latest
        self._engines = engines
        self._stacks_timeout = float(section["stacks_timeout"])
        self.last_call: float | None = None
        self._step: int | None = None
        self._step_starts: deque[float] = deque(maxlen=32)
        # A step's wall time runs from the last call of the step before (the run's start for
        # the first) to its own last call; finished steps' are kept for the straggler window.
        self._previous_end = time.monotonic()
        self._walls: deque[tuple[int | None, float]] = deque(maxlen=KEPT_WALLS)
        self._watched: list[str] = []
        self.stragglers = StragglerWatch(
            int(section["straggler_window"]), self._on_straggler, float(section["straggler_skew"]),
            walls=self._step_walls,
        )  # fmt: skip
        if self.stragglers.window > KEPT_WALLS // 2:
            self._walls = deque(maxlen=2 * self.stragglers.window)
        self.watchdog: StallWatchdog | None = None
        if section["enabled"]:
            from otel_rl.telemetry.timing import open_phases, phase_history

            self.watchdog = StallWatchdog(
                run_id=run_id,
                attempt=attempt,
                report_dir=self.report_dir,
                after=float(section["after"]),
                factor=float(section["factor"]),
                activity=self._activity,
                gather=self._gather,
                on_stall=self._on_stall,
                on_end=self._on_end,
                phase_after=float(section["phase_after"]),
                phases=open_phases,
                history=phase_history,
            )
            self.watchdog.start()
        #: This process's state, published for the job's verdict (None: stalls not watched).
        self.job: StatePublisher | None = None
        if self.watchdog is not None:
            self.job = publisher_of_this_process(
                self._job_activity, directory=shared_directory(log_dir), driver=True,
                phase_after=float(section["phase_after"]), factor=float(section["factor"]),
                run_id=run_id, attempt=attempt,
            )  # fmt: skip

    # ---- training thread -----------------------------------------------------------------------

    def stamp(self, step: int, values: dict[str, Any]) -> None:
        """A ``log_metrics`` call at ``step`` with ``values`` (added to: ``stall/seconds`` at
        the first call after a stall)."""
        now = time.monotonic()
        if step != self._step:
            last = self.last_call
            if last is not None:  # the step before has ended: its wall time
                self._walls.append((self._step, last - self._previous_end))
                self._previous_end = last
            self._step = step
            self._step_starts.append(now)
        self.last_call = now
        watchdog = self.watchdog
        if watchdog is not None and watchdog.current is not None:
            report = watchdog.current
            length = watchdog.resumed(now, step)
            if length is not None:
                values[STALL_SECONDS_KEY] = length
                if self._step_spans is not None:
                    # Here, once per stall: the span of the step that moved again is open now;
                    # by the time the watchdog tells the rest, it may have ended.
                    self._step_spans.add_event(
                        "otel_rl.stall.ended", self._end_attributes(report, length)
                    )
        if self._watched:
            self._observe(step, values, self._watched)

    def new_keys(self, step: int, values: Mapping[str, Any], keys: Any) -> None:
        """Keys logged for the first time: a reduced timing's ``slowest_rank`` is watched."""
        watched = [k for k in keys if StragglerWatch.watches(k)]
        if watched:
            self._watched += watched
            self._observe(step, values, watched)

    def _observe(self, step: int, values: Mapping[str, Any], keys: list[str]) -> None:
        for key in keys:
            rank = values.get(key)
            if type(rank) is float:
                timing = key[: -len(SLOWEST_SUFFIX)]
                skew, spent = values.get(timing + "/skew"), values.get(timing)
                self.stragglers.observe(step, key, rank, skew if type(skew) is float else None,
                                        spent if type(spent) is float else None)  # fmt: skip

    def _step_walls(self, steps: Sequence[int]) -> dict[int, float]:
        """The wall time of each of ``steps`` known (the current one's: so far), from the calls'
        stamps: what the step's ``anatomy/wall/seconds`` row says, as it is measured the same
        way."""
        walls = dict(self._walls)
        out: dict[int, float] = {}
        for step in steps:
            wall = walls.get(step)
            if wall is None and step == self._step and self.last_call is not None:
                wall = self.last_call - self._previous_end
            if wall is not None:
                out[step] = wall
        return out

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching: a stall's end still pending is told first (to the trackers, which
        are still open), then OTLP's log records are sent within ``timeout``."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.job is not None:  # its last publication says this process ended
            self.job.release(timeout)
        if self._log_records is not None:
            self._log_records.shutdown(timeout)

    # ---- what Prometheus and OTLP read ---------------------------------------------------------

    def stalled(self) -> int:
        return int(self.watchdog is not None and self.watchdog.stalled)

    def seconds_since_step(self) -> float:
        if self.watchdog is not None:
            return self.watchdog.seconds_since_step()
        return 0.0 if self.last_call is None else time.monotonic() - self.last_call

    # ---- the watchdog's thread -----------------------------------------------------------------

    def _activity(self) -> tuple[float | None, int | None, list[float]]:
        return self.last_call, self._step, list(self._step_starts)

    def _job_activity(self) -> tuple[int | None, float | None]:
        last = self.last_call
        return self._step, None if last is None else time.time() - (time.monotonic() - last)

    def _gather(self, report: StallReport) -> None:
        from otel_rl.telemetry.timing import open_timers
        from otel_rl.watch.stalls import thread_names

        if self.job is not None:  # the others' verdicts see this stall at once
            self.job.publish_soon()
        names = thread_names()
        now = time.monotonic()
        report.open_timers = {
            names.get(ident, str(ident)): [
                {"name": n, "seconds": round(now - at, 3)} for n, at in stack
            ]
            for ident, stack in open_timers().items()
        }
        watchdog = self.watchdog
        skip = watchdog._thread.ident if watchdog is not None else None
        report.threads = thread_stacks(skip=skip)
        deadline = time.monotonic() + self._stacks_timeout
        report.ray = ray_stacks(self._stacks_timeout)
        report.workers = _worker_timers(max(0.5, deadline - time.monotonic()))
        report.gpus = gpu_readings(self._gpu_latest() if self._gpu_latest else {})
        report.stragglers = [s.describe() for s in self.stragglers.found]
        report.stragglers += [
            f"{name}: still inside {' > '.join(t[0] for t in stack)}"
            for name, info in report.workers.items()
            if isinstance(info, Mapping)
            for stack in (info.get("timers") or {}).values()
            if stack
        ]
        stamp = datetime.datetime.fromtimestamp(report.began, datetime.timezone.utc)
        report.nccl = nccl_flight_recorder(self.report_dir, f"{stamp:%Y%m%dT%H%M%SZ}")
        report.verdict = self._verdict(report, skip, max(1.0, deadline - time.monotonic()))

    def _verdict(self, report: StallReport, skip: int | None, timeout: float) -> dict[str, Any]:
        """The chain the run waits on; what failed to be known is said in it, never raised.

        Built on a thread of its own, waited for ``timeout`` seconds and one more: reading the
        application's objects (a queue's size, an argument's text) runs their code, which may
        block, and the watchdog must outlive it to report this stall and the next ones."""
        from otel_rl.watch.verdict import build_verdict

        built: list[dict[str, Any]] = []

        def build() -> None:
            try:
                job = None
                if self.job is not None and self.job.boards():  # one of a job's processes
                    # the others publish every PUBLISH_EVERY s: each is given one round to
                    # say where it is since the stall began
                    found = self.job.read_fresh(report.began, min(PUBLISH_EVERY + 1, timeout / 2))
                    job = job_verdict(found, time.time())
                verdict = build_verdict(report, timeout=timeout, engines=self._engines, skip=skip,
                                        job=job)  # fmt: skip
                built.append(verdict.to_json())
            except Exception as exc:  # the rest of the report stands without it
                built.append(_no_verdict(f"building it failed ({type(exc).__name__}: {exc})"))

        builder = threading.Thread(target=build, name="otel-rl-verdict", daemon=True)
        builder.start()
        builder.join(timeout + 1.0)
        if built:
            return built[0]
        return _no_verdict(f"building it took longer than {timeout + 1.0:.0f} s (a call it made "
                           "into the application's objects did not return)")  # fmt: skip

    def _on_stall(self, report: StallReport) -> None:
        _log.warning("otel-rl: %s", report.summary)
        step = report.step if report.step is not None else 0
        title = f"run stalled: no step for {seconds(report.since_step)}"
        self._tell(Event(STALL_EVENT, step, title, report.summary), "otel_rl.stall",
                   {"otel_rl.stall.report": str(report.path or ""),
                    "otel_rl.stall.seconds": round(report.since_step, 3)})  # fmt: skip

    def _on_end(self, report: StallReport, length: float, step: int | None) -> None:
        """The stall ended at ``step``: the first step logged after it, which carries the
        ``stall/seconds`` row."""
        text = _ended_text(report, length)
        where = f" (report {report.path})" if report.path is not None else ""
        _log.warning("otel-rl: run %s: %s%s", self.run_id, text, where)
        step = step if step is not None else 0
        self._tell(Event(STALL_EVENT, step, text, text, level="info"), "otel_rl.stall.ended",
                   self._end_attributes(report, length), span=False)  # fmt: skip

    def _end_attributes(self, report: StallReport, length: float) -> dict[str, Any]:
        return {"otel_rl.run_id": self.run_id, "otel_rl.summary": _ended_text(report, length),
                "otel_rl.stall.report": str(report.path or ""),
                "otel_rl.stall.seconds": round(length, 3)}  # fmt: skip

    def _on_straggler(self, found: Straggler) -> None:
        text = found.describe()
        _log.warning("otel-rl: %s", text)
        event = Event(STRAGGLER_EVENT, found.step, f"straggler: rank {found.rank}", text)
        self._tell(event, "otel_rl.straggler",
                   {"otel_rl.timing": found.timing, "otel_rl.rank": found.rank})  # fmt: skip

    def _tell(
        self, event: Event, name: str, attributes: dict[str, Any], span: bool = True
    ) -> None:
        """The event to every tracker, the current step's span and OTLP's logs."""
        attributes = {"otel_rl.run_id": self.run_id, "otel_rl.summary": event.text, **attributes}
        outputs: list[Callable[[], Any]] = [lambda: self._send(event)]
        if span and self._step_spans is not None:
            outputs.append(lambda: self._step_spans.add_event(name, attributes))
        if self._log_records is not None:
            outputs.append(lambda: self._log_records.emit(event, attributes))
        for deliver in outputs:
            try:
                deliver()
            except Exception as exc:  # one output failing must not silence the others
                _log.warning("otel-rl: could not report %s: %s", name, exc)


def _no_verdict(why: str) -> dict[str, Any]:
    text = f"no verdict: {why}"
    return {"text": text, "chain": [], "missing": [text]}


def _ended_text(report: StallReport, length: float) -> str:
    """The sentence of the stall's end: its report's, once written (steps resumed, until then)."""
    return str(report.ended["summary"]) if report.ended else ended_summary(length)


def _worker_timers(timeout: float) -> dict[str, Any]:
    """What the metrics aggregator's workers last said of their open timers (when Ray runs one)."""
    if "ray" not in sys.modules:
        return {}
    import ray

    if not ray.is_initialized():
        return {}
    from otel_rl.ray.aggregator import DEFAULT_NAME, MetricsAggregator

    try:
        ray.get_actor(DEFAULT_NAME)
    except ValueError:
        return {}
    try:
        return MetricsAggregator.connect().open_timers(timeout)
    except Exception as exc:
        return {"<aggregator>": f"no answer within {timeout:.1f} s ({type(exc).__name__})"}


class OtlpLogRecords:
    """OTel log records for the run's events, pushed to the OTLP endpoint's ``/v1/logs`` (HTTP)
    or its gRPC logs service, with the run's resource; built on the first event."""

    def __init__(self, otlp: Mapping[str, Any], resource: Any) -> None:
        self._otlp = otlp  # the ``otlp:`` config section
        self._resource = resource
        self._provider: Any = None
        self._logger: Any = None

    def emit(self, event: Event, attributes: Mapping[str, Any]) -> None:
        from opentelemetry._logs import SeverityNumber

        if self._logger is None:
            self._logger = self._build()
        severity = SeverityNumber.WARN if event.level == "warning" else SeverityNumber.INFO
        fields = {
            "timestamp": time.time_ns(),
            "severity_number": severity,
            "severity_text": "WARN" if event.level == "warning" else "INFO",
            "body": event.text,
            "attributes": {"event.name": event.name, **attributes},
        }
        try:
            self._logger.emit(**fields, event_name=event.name)
        except TypeError:  # an SDK before keyword emit(): a LogRecord object
            import opentelemetry.sdk._logs as logs

            record = logs.LogRecord(**fields, resource=self._resource)  # type: ignore[attr-defined]
            self._logger.emit(record)

    def shutdown(self, timeout: float) -> None:
        """Send what is queued, giving up after ``timeout`` seconds (a collector that is down
        must not hold the run's end)."""
        provider = self._provider
        if provider is None:
            return
        import threading

        closing = threading.Thread(target=provider.shutdown, name="otel-rl-log-records",
                                   daemon=True)  # fmt: skip
        closing.start()
        closing.join(timeout)

    def _build(self) -> Any:
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

        from otel_rl.telemetry.otlp import WatchedLogExporter, build_log_exporter, resolve_otlp

        exporter = build_log_exporter(resolve_otlp(self._otlp, signal="logs"))
        self._provider = LoggerProvider(resource=self._resource, shutdown_on_exit=False)
        # A collector that is down costs the one warning the metrics path gives, not a line each;
        # and the export runs on the processor's thread, never holding up the watchdog's.
        watched: Any = WatchedLogExporter(exporter)
        self._provider.add_log_record_processor(
            BatchLogRecordProcessor(watched, schedule_delay_millis=200)
        )
        return self._provider.get_logger("otel_rl")
