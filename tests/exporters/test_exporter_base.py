"""The tracker exporter base: isolation, retries, ordering and shutdown.

The trackers here are small in-memory ``TrackerExporter`` subclasses: they stand for a tracker
whose SDK raises or stalls, which no real tracker does on demand.
"""

from __future__ import annotations

import threading
import time

import pytest

from otel_rl import Logger
from otel_rl.exporters.base import RowRejected, TrackerExporter


class FlakyTracker(TrackerExporter):
    """Raises on every write until ``fail_until`` (monotonic seconds), then stores rows."""

    name = "flaky"

    def __init__(self, fail_for: float, **kwargs):
        self.fail_until = time.monotonic() + fail_for
        self.rows: list[tuple[int, dict]] = []
        self.failures = 0
        self.closed_with: int | None = None
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        if time.monotonic() < self.fail_until:
            self.failures += 1
            raise ConnectionError("tracker is down")
        self.rows.append((step, dict(rows)))

    def close(self, exit_code):
        self.closed_with = exit_code


@pytest.mark.slow
def test_backend_down_for_3s_then_recovers(log_dir, otel_rl_warnings):
    tracker = FlakyTracker(fail_for=3.0, retry_max_backoff=0.5)
    logger = Logger({"log_dir": str(log_dir), "jsonl_enabled": False}, exporters=[tracker])
    for step in range(200):
        logger.log_metrics({"loss": step / 10, "reward": -step}, step=step)
    # The loop never waited on the dead tracker: it ended while the tracker was still failing,
    # with nothing delivered yet (how fast it is: benchmarks/, never here).
    assert time.monotonic() < tracker.fail_until and tracker.rows == []
    assert logger.flush(timeout=20)
    logger.finish()
    assert tracker.failures > 0

    assert [s for s, _ in tracker.rows] == list(range(200))
    assert tracker.rows[57][1] == {"loss": 5.7, "reward": -57.0}
    assert tracker.closed_with == 0
    failures = [r for r in otel_rl_warnings.records if "write failed" in r.getMessage()]
    assert len(failures) == 1, "one warning per error kind, not one per retry"


class SlowTracker(TrackerExporter):
    """Each write takes ``delay`` seconds, once ``gate`` (if given) is open; ``writing`` is set
    as the first write begins."""

    name = "slow"

    def __init__(self, delay: float, gate: threading.Event | None = None, **kwargs):
        self.delay, self.gate = delay, gate
        self.steps: list[int] = []
        self.writing = threading.Event()
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        self.writing.set()
        if self.gate is not None:
            self.gate.wait(60)
        time.sleep(self.delay)
        self.steps.append(step)


def test_slow_tracker_does_not_delay_fast_one(log_dir):
    gate = threading.Event()  # the slow tracker writes nothing until the fast one has all
    slow, fast = SlowTracker(0.05, gate=gate), SlowTracker(0.0)
    logger = Logger({"log_dir": str(log_dir), "jsonl_enabled": False}, exporters=[slow, fast])
    for step in range(40):
        logger.log_metrics({"x": step}, step=step)
    logger.log_metrics({}, step_finished=True)
    assert fast.force_flush(5_000)
    assert len(fast.steps) == 40
    assert slow.steps == []  # still in its first write
    gate.set()
    logger.finish()
    assert slow.steps == list(range(40))


def test_shutdown_timeout_reports_undelivered(log_dir, otel_rl_warnings):
    slow = SlowTracker(1.0)
    logger = Logger(
        {"log_dir": str(log_dir), "jsonl_enabled": False, "export": {"shutdown_timeout": 0.5}},
        exporters=[slow],
    )
    for step in range(5):
        logger.log_metrics({"x": step}, step=step)
    started = time.monotonic()
    logger.finish()
    assert time.monotonic() - started < 3.0
    messages = " ".join(r.getMessage() for r in otel_rl_warnings.records)
    assert "not delivered before the shutdown timeout" in messages


@pytest.mark.parametrize("keyword", ["timeout_millis", "timeout"])
def test_a_tracker_shut_down_by_hand_speaks_of_its_deadline_in_the_unit_it_was_given(
    keyword, otel_rl_warnings
):
    """``shutdown`` takes milliseconds, as OpenTelemetry's exporters do (its periodic reader
    passes ``timeout=``): the message says so, in milliseconds, and names no config key the
    caller never set."""
    from otel_rl.core.records import StepBatch

    slow = SlowTracker(0.3)
    for step in range(5):
        slow.delivery.submit(StepBatch(step=step, values={"x": float(step)}))
    assert slow.writing.wait(30)  # a write in flight at the deadline, however late it began
    slow.shutdown(**{keyword: 1.0})
    said = [r.getMessage() for r in otel_rl_warnings.records]
    (message,) = [m for m in said if "record(s) not delivered" in m]
    assert "1 ms given to shutdown()" in message and "milliseconds" in message
    assert not any("export.shutdown_timeout" in m for m in said)
    # The write in flight ends (within the close grace, or later on a busy machine: the wait
    # below does not hold the test to a clock); no new one begins after the deadline.
    assert _wait_for(lambda: slow.steps, 30)
    time.sleep(2 * slow.delay)
    assert 1 <= len(slow.steps) < 5


def _wait_for(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class RejectingTracker(TrackerExporter):
    name = "rejecting"

    def __init__(self, **kwargs):
        self.steps: list[int] = []
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        if "bad" in rows:
            raise RowRejected("value 'bad' is not allowed")
        self.steps.append(step)


def test_rejected_row_is_skipped_and_counted(log_dir):
    tracker = RejectingTracker()
    with Logger({"log_dir": str(log_dir)}, exporters=[tracker]) as logger:
        logger.log_metrics({"x": 1}, step=0)
        logger.log_metrics({"bad": 1}, step=1)
        logger.log_metrics({"x": 2}, step=2)
    assert tracker.steps == [0, 2]
    assert tracker.delivery.stats["rejected"] == 1
    assert tracker.delivery.stats["delivered"] == 2  # written; the refused one is counted apart
    assert tracker.delivery.lost == {"refused": 1}


def test_bounded_queue_drops_oldest_and_says_so(otel_rl_warnings):
    gate = threading.Event()

    class Blocked(TrackerExporter):
        name = "blocked"

        def __init__(self, **kwargs):
            self.steps: list[int] = []
            super().__init__(**kwargs)

        def write_step(self, step, rows, batch):
            writing.set()
            gate.wait()
            self.steps.append(step)

    from otel_rl.core.records import StepBatch

    writing = threading.Event()
    tracker = Blocked(queue_size=5)
    tracker.delivery.submit(StepBatch(step=0, values={"x": 0.0}))
    assert writing.wait(5)  # step 0 is being written (held by the gate)
    for step in range(1, 12):
        tracker.delivery.submit(StepBatch(step=step, values={"x": float(step)}))
    gate.set()
    assert tracker.force_flush(5_000)
    tracker.shutdown()
    # The record in flight is never dropped; of the rest, the oldest made room for the newest.
    assert tracker.delivery.stats["dropped"] == 7
    assert tracker.steps == [0, 8, 9, 10, 11]
    assert any("queue full" in r.getMessage() for r in otel_rl_warnings.records)


def test_exporter_works_under_a_periodic_reader(tmp_path):
    """A tracker exporter is an OTel MetricExporter: plug it into the SDK's own periodic reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    tracker = SlowTracker(0.0)
    rows: list = []
    tracker.write_step = lambda step, r, batch: rows.append((batch.axis, dict(r)))
    reader = PeriodicExportingMetricReader(tracker, export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("lib").create_counter("lib.requests")
    counter.add(3)
    counter.add(4)
    provider.shutdown()  # final collect + export, then exporter.shutdown(timeout_millis=...)
    assert rows == [("otel_rl/elapsed_s", {"lib.requests": 7.0})]


@pytest.mark.parametrize("exit_code", [0, 3])
def test_exit_code_reaches_close(log_dir, exit_code):
    tracker = FlakyTracker(fail_for=0)
    logger = Logger({"log_dir": str(log_dir)}, exporters=[tracker])
    logger.log_metrics({"x": 1}, step=0)
    logger.finish(exit_code=exit_code)
    assert tracker.closed_with == exit_code


def test_context_manager_marks_exception_as_failure(log_dir):
    tracker = FlakyTracker(fail_for=0)
    logger = Logger({"log_dir": str(log_dir)}, exporters=[tracker])
    with pytest.raises(RuntimeError), logger:
        logger.log_metrics({"x": 1}, step=0)
        raise RuntimeError("training crashed")
    assert tracker.closed_with == 1
