"""A record sent to a tracker after its delivery was shut down is lost: it is counted
(``after_shutdown``) and said once, in both delivery modes, and never raises on the caller.

The trackers are real (JSONL, read back); in ``process`` mode the delivery process is a real
child process.
"""

from __future__ import annotations

import pytest

from otel_rl import Logger
from otel_rl.core.records import Hyperparams, StepBatch
from testkit.readers import jsonl_rows


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_records_sent_after_the_shutdown_are_counted_lost_and_said_once(
    tmp_path, otel_rl_warnings, delivery
):
    """Three steps before ``finish()``, then five records through the run's fan-out (what the
    drop-ins and sources send through) and a checkpoint of a pending step, which is no record of
    its own: the five are counted, the checkpoint is not."""
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": True,
                     "export": {"delivery": delivery}})  # fmt: skip
    for step in range(3):
        logger.log_metrics({"x": float(step)}, step=step)
    logger.finish()
    (jsonl,) = logger.exporters
    assert jsonl.lost == {}
    otel_rl_warnings.clear()

    for step in range(3, 7):
        assert logger.fanout.send(StepBatch(step=step, values={"x": 1.0})) == ["jsonl"]
    logger.fanout.send(Hyperparams({"lr": 0.1}))
    logger.fanout.send(StepBatch(step=7, values={"x": 1.0}, provisional=True))

    assert jsonl.lost == {"after_shutdown": 5}
    assert jsonl.stats["dropped"] == 5
    said = [r.getMessage() for r in otel_rl_warnings.records]
    assert len(said) == 1, said
    assert "after shutdown" in said[0] and "after_shutdown" in said[0]
    assert [r["step"] for r in jsonl_rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_values_logged_after_finish_are_counted_lost_in_every_tracker(tmp_path, delivery):
    """``log_metrics`` and ``log_histogram`` after ``finish()`` never raise and reach no
    tracker: each tracker counts one loss (``after_shutdown``) per call, as for any record it
    is sent after its shutdown."""
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": True,
                     "export": {"delivery": delivery}})  # fmt: skip
    logger.log_metrics({"x": 0.0}, step=0)
    logger.finish()
    logger.log_metrics({"x": 1.0}, step=1)
    logger.log_metrics({"x": 2.0})
    logger.log_histogram([1.0, 2.0], step=3, name="h")
    (jsonl,) = logger.exporters
    assert jsonl.lost == {"after_shutdown": 3}
    assert [r["step"] for r in jsonl_rows(tmp_path / "metrics.jsonl")] == [0]
