"""The parts of a tracker's channel on their own: the bounded queue with a real spool behind it,
and the end-of-run message the channel builds from plain values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.core.failures import Failure, losses
from otel_rl.core.records import StepBatch
from otel_rl.delivery.messages import CLOSE_GRACE, undelivered_message
from otel_rl.delivery.record_queue import RecordQueue
from otel_rl.delivery.spool import Spool


def _warnings() -> tuple[list[str], Callable[..., None]]:
    said: list[str] = []

    def warn_once(kind: str, message: str, *args: object) -> None:
        said.append(message % args)

    return said, warn_once


def test_a_full_queue_leaves_records_on_disk_and_reads_them_back_in_order(tmp_path):
    """``on_full: spool``: past ``queue_size`` records live only in the spool, from one sequence
    number on (later ones too, so that order is kept), and come back in order, ``queue_size``
    at a time, without the checkpoints the spool holds among them."""
    spool = Spool(tmp_path / "spool")
    stats = {"spilled": 0, "waits": 0, "dropped": 0}
    said, warn_once = _warnings()
    queue = RecordQueue("t", stats, warn_once)
    queue.configure(3, "spool", 8, spool.dir, spool.last_seq)
    records = [StepBatch(step=s, values={"x": float(s)}) for s in range(10)]
    records.insert(6, StepBatch(step=5, values={"x": 0.5}, provisional=True))
    seqs = spool.append(records)
    with queue.cond:
        for seq, record in zip(seqs, records, strict=True):
            if not record.provisional:
                queue.put_locked(seq, record)
        queue.spooled_upto = seqs[-1]
        # one record after the spill, though the queue has room again: it still waits on disk
        queue.done_locked(1)
        late = StepBatch(step=10, values={"x": 10.0})
        (late_seq,) = spool.append([late])
        queue.put_locked(late_seq, late)
        queue.spooled_upto = late_seq
        assert [r.step for _, r in queue.items] == [1, 2]
        assert queue.overflow_from == seqs[3]
        assert queue.on_disk_locked() == 9  # steps 3..10 and the checkpoint among them
    assert stats["spilled"] == 8
    assert said == ["t: tracker is behind by 3 records; further records wait on disk only"]

    delivered = []
    while True:
        with queue.cond:
            if not queue.has_work_locked():
                break
            items = queue.take_locked() if queue.items else None
        if items is None:
            queue.load_overflow()
            continue
        with queue.cond:
            assert queue.inflight == len(items) <= 3
            delivered += [record.step for _, record in items]
            queue.done_locked(len(items))
    assert delivered == list(range(1, 11))
    assert stats["dropped"] == 0 and queue.overflow_from is None


def test_records_vanished_from_the_spool_are_counted_and_the_rest_go_on(tmp_path):
    """A spool segment deleted from outside while records wait there only: they are counted
    lost (``spool_vanished``) and named once; records spooled after them still arrive."""
    spool = Spool(tmp_path / "spool")
    stats = {"spilled": 0, "dropped": 0}
    said, warn_once = _warnings()
    queue = RecordQueue("t", stats, warn_once)
    queue.configure(1, "spool", 1, spool.dir, spool.last_seq)
    first = [StepBatch(step=s, values={"x": 1.0}) for s in range(3)]
    first_seqs = spool.append(first)
    with queue.cond:
        for seq, record in zip(first_seqs, first, strict=True):
            queue.put_locked(seq, record)
    for segment in Path(spool.dir).glob("wal-*.jsonl"):
        segment.unlink()
    later = StepBatch(step=3, values={"x": 1.0})
    (later_seq,) = spool.append([later])  # a new segment: the old one is gone
    with queue.cond:
        queue.put_locked(later_seq, later)
        queue.spooled_upto = later_seq
        queue.done_locked(1)  # step 0 was in memory
    queue.load_overflow()
    with queue.cond:
        assert [record.step for _, record in queue.items] == [3]
        assert queue.overflow_from is None
    assert losses(stats) == {"spool_vanished": 2}
    assert any("2 spooled record(s) vanished from" in m for m in said)


def test_the_end_message_names_the_deadline_in_the_unit_it_was_given_in():
    """The run's ``export.shutdown_timeout`` is said in seconds; the one given to an exporter's
    own ``shutdown()`` in OpenTelemetry's milliseconds; the last error and the replay command
    (or, without a spool, that the records are lost) follow."""
    error = Failure(kind="transient", error=ConnectionError("refused"))
    common: dict[str, Any] = {
        "checkpoints": 0,
        "failure": None,
        "last_error": error,
        "log_dir": "/logs",
    }
    by_run = undelivered_message(
        "mlflow", left=4, timeout=0.0, run_timeout=2.5, spool_dir=Path("/spool"), **common
    )
    assert by_run.startswith(
        "mlflow: 4 record(s) not delivered before the shutdown timeout "
        f"(export.shutdown_timeout: 2.5 s; last error: {error.describe()}; raise "
    )
    assert by_run.endswith(
        " They are in the spool (/spool); deliver them with: otel-rl replay /logs"
    )
    given = undelivered_message(
        "mlflow", left=4, timeout=0.25, run_timeout=None, spool_dir=None, **common
    )
    assert given.startswith("mlflow: 4 record(s) not delivered within the 250 ms given to ")
    assert f"{CLOSE_GRACE:g} s more let the tracker end its write and close" in given
    assert given.endswith(" There is no spool (export.spool: false): they are lost.")
    only_checkpoints = undelivered_message(
        "mlflow", left=2, timeout=0.0, run_timeout=1.0, spool_dir=Path("/spool"),
        **{**common, "checkpoints": 2},
    )  # fmt: skip
    assert only_checkpoints.startswith(
        "mlflow: the step still being logged when the run ended was checkpointed "
        "(2 checkpoint(s)); no other record is undelivered."
    )


def test_a_tracker_left_behind_with_records_left_is_said_once_with_where_they_are():
    """A tracker still in a write when its grace ran out: one message says how many records are
    left, that it is left behind (no advice to wait longer: it had not come back) and where the
    records are: the spool and the command, or, for a tracker whose records live in memory
    only, that they are lost and why, in its own words."""
    common: dict[str, Any] = {
        "left": 3, "checkpoints": 0, "timeout": 0.0, "run_timeout": 2.0, "failure": None,
        "last_error": None, "log_dir": "/logs", "left_behind": True,
    }  # fmt: skip
    spooled = undelivered_message("mlflow", spool_dir=Path("/spool"), **common)
    assert spooled == (
        "mlflow: 3 record(s) not delivered before the shutdown timeout (export.shutdown_timeout: "
        f"2 s; it had not returned from a write or its close {CLOSE_GRACE:g} s later and is left "
        "behind). They are in the spool (/spool); deliver them with: otel-rl replay /logs"
    )
    in_memory = undelivered_message(
        "calls", spool_dir=None, memory_only="its records hold live objects", **common
    )
    assert in_memory.endswith(" and is left behind). They are lost: its records hold live objects.")
