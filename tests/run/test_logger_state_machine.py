"""A stateful property test of the Logger against a model of what must be delivered.

Hypothesis drives a real ``Logger`` through sequences of operations — log (several calls per
step merge), step jumps forward, flush, a tracker outage beginning and ending, the spool folder
lost mid-run, finish — while a plain model records the rows that must arrive: one row per step,
the merge of every value logged at that step, in step order. After a ``flush()`` or ``finish()``
with the tracker up, what each tracker holds equals the model exactly (keys and values per step,
in order, no row twice). Two trackers are checked against the same model: the JSONL exporter
(a real tracker, read back from its file) and :class:`OutageTracker`.

Environment: ``OTEL_RL_PROPERTY_SEED`` (default 12) seeds the search; the slow tier runs more
and longer examples.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from otel_rl import Logger
from otel_rl.core.records import RowValue, StepBatch
from otel_rl.delivery.spool import spool_root
from otel_rl.exporters.base import TrackerExporter

SEED = int(os.environ.get("OTEL_RL_PROPERTY_SEED", "12"))
NUMBER_KEYS = ("loss", "reward", "kl", "lr")
TEXT_KEY = "sample"  # always text: a key that changes kind mid-step is another test's subject

Row = tuple[int, dict[str, Any]]


class OutageTracker(TrackerExporter):
    """An in-memory tracker whose writes raise ``ConnectionError`` while ``down`` is set.

    It stands for a backend outage (what a tracker client raises when its server is
    unreachable): no real tracker can be taken down and brought back between two operations of
    a hypothesis example in milliseconds. A write either stores all its rows or raises before
    storing any, as one request to a tracker server does.
    """

    name = "outage"
    max_batch = 8

    def __init__(self, **kwargs: Any) -> None:
        self.down = False
        self.rows: list[Row] = []
        self._rows_lock = threading.Lock()
        super().__init__(**kwargs)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        if self.down:
            raise ConnectionError("outage: the tracker server is unreachable")
        with self._rows_lock:
            self.rows.extend((b.step, dict(b.rows)) for b in batches)

    def delivered(self) -> list[Row]:
        with self._rows_lock:
            return list(self.rows)


numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(2**40), max_value=2**40),
)
calls = st.dictionaries(
    st.sampled_from(NUMBER_KEYS), numbers, min_size=1, max_size=4
) | st.fixed_dictionaries({TEXT_KEY: st.text(alphabet="ab €\n\"", max_size=6)})


def _row_value(value: Any) -> Any:
    return float(value) if isinstance(value, int) else value


class LoggerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="otel-rl-machine-"))
        self.log_dir = self.dir / "logs"
        self.tracker = OutageTracker()
        self.logger = Logger(
            {
                "log_dir": str(self.log_dir),
                "jsonl_enabled": True,
                "capture_global_meters": False,
                "export": {
                    "fsync_interval": 0.05,
                    "retry_max_backoff": 0.05,
                    # a bound, not a wait: finish() returns once the trackers caught up
                    "shutdown_timeout": 10.0,
                    "handle_signals": False,
                },
            },
            exporters=[self.tracker],
        )
        self.step = 0
        self.sealed: list[Row] = []  # the model: rows that must arrive, in order
        self.pending: dict[str, Any] | None = None  # the step being logged
        self.pending_step: int | None = None
        self.finished = False

    # ---- model --------------------------------------------------------------------------------

    def _seal(self) -> None:
        if self.pending is not None:
            self.sealed.append((self.pending_step, self.pending))
        self.pending, self.pending_step = None, None

    def _jsonl(self) -> list[Row]:
        path = self.log_dir / "metrics.jsonl"
        if not path.exists():
            return []
        # Only whole lines: the exporter's buffered file may hold half a line between flushes.
        whole = path.read_bytes().rpartition(b"\n")[0]
        return [(r["step"], r["metrics"]) for r in map(json.loads, whole.splitlines())]

    def _check_delivered(self, when: str) -> None:
        for tracker, got in (("outage", self.tracker.delivered()), ("jsonl", self._jsonl())):
            assert got == self.sealed, (
                f"{tracker} after {when}: got steps {[s for s, _ in got]}, "
                f"model steps {[s for s, _ in self.sealed]}"
            )

    # ---- rules --------------------------------------------------------------------------------

    @precondition(lambda self: not self.finished)
    @rule(values=calls)
    def log(self, values: dict[str, Any]) -> None:
        if self.pending_step is not None and self.pending_step != self.step:
            self._seal()
        self.logger.log_metrics(values, step=self.step)
        if self.pending is None:
            self.pending, self.pending_step = {}, self.step
        self.pending.update({k: _row_value(v) for k, v in values.items()})

    @precondition(lambda self: not self.finished)
    @rule(jump=st.integers(min_value=1, max_value=1000))
    def step_forward(self, jump: int) -> None:
        self.step += jump

    @precondition(lambda self: not self.finished and not self.tracker.down)
    @rule()
    def flush(self) -> None:
        assert self.logger.flush(timeout=30), "flush() did not catch up with the tracker up"
        self._seal()
        self.step += 1  # a step flushed is sent: logging it again would be a second row
        self._check_delivered("flush()")

    @precondition(lambda self: not self.finished and self.tracker.down)
    @rule()
    def flush_while_down(self) -> None:
        self.logger.flush(timeout=0.05)  # cannot catch up; must not raise or lose anything
        self._seal()
        self.step += 1
        # The healthy tracker is not held back: it catches up while the other is still down.
        jsonl = next(e for e in self.logger.exporters if e.name == "jsonl")
        assert jsonl.force_flush(timeout_millis=30_000)
        assert self._jsonl() == self.sealed

    @precondition(lambda self: not self.finished and not self.tracker.down)
    @rule()
    def outage_begins(self) -> None:
        self.tracker.down = True

    @precondition(lambda self: not self.finished and self.tracker.down)
    @rule()
    def outage_ends(self) -> None:
        self.tracker.down = False

    @precondition(lambda self: not self.finished)
    @rule(how=st.sampled_from(["removed", "replaced by a file"]))
    def spool_lost(self, how: str) -> None:
        """The spool folder vanishes (a cleanup job, a full disk remounted); "read-only" is not
        used because the tests may run as root, whom permissions do not stop."""
        root = spool_root(self.log_dir)
        shutil.rmtree(root, ignore_errors=True)
        if how == "replaced by a file":
            root.parent.mkdir(parents=True, exist_ok=True)
            # The run's spool thread makes the folder again as soon as it is gone (what it is
            # for): remove it until the file takes its place.
            for _ in range(100):
                try:
                    root.write_text("not a directory")
                    break
                except IsADirectoryError:
                    shutil.rmtree(root, ignore_errors=True)

    @precondition(lambda self: not self.finished and not self.tracker.down)
    @rule()
    def finish(self) -> None:
        self.logger.finish()
        self.finished = True
        self._seal()
        self._check_delivered("finish()")

    @precondition(lambda self: self.finished)
    @rule(values=calls)
    def log_after_finish(self, values: dict[str, Any]) -> None:
        self.logger.log_metrics(values, step=self.step)  # documented: ignored, reported
        self._check_delivered("a log_metrics call after finish()")

    @invariant()
    def trackers_only_ever_hold_a_prefix_of_the_model(self) -> None:
        for tracker, got in (("outage", self.tracker.delivered()), ("jsonl", self._jsonl())):
            assert got == self.sealed[: len(got)], (
                f"{tracker} holds rows the model does not (yet): steps {[s for s, _ in got]}, "
                f"model steps {[s for s, _ in self.sealed]}"
            )

    def teardown(self) -> None:
        try:
            if not self.finished:
                self.tracker.down = False
                self.logger.finish()
                self._seal()
                self._check_delivered("finish() at teardown")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _run(max_examples: int, steps: int) -> None:
    @seed(SEED)
    def machine() -> LoggerMachine:
        return LoggerMachine()

    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,  # no example database written into the checkout
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.slow
def test_logger_delivers_exactly_the_model(caplog):
    caplog.set_level(logging.ERROR, logger="otel_rl")  # outages warn by design; keep reports short
    _run(max_examples=60, steps=40)


@pytest.mark.slow
@pytest.mark.long
def test_logger_delivers_exactly_the_model_long_runs(caplog):
    caplog.set_level(logging.ERROR, logger="otel_rl")
    _run(max_examples=200, steps=60)
