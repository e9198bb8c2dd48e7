"""A record sent after ``finish()``, once the delivery process has exited: counted lost, at once.

The training process learns that its delivery process exited on a thread of its own (the status
pipe ends). When that came after a normal end of the run, the link stayed marked as writing the
leftover file of a delivery process that died early, which no one was writing: the next record
sent (a ``log_metrics`` after ``finish()``, a source's last rows) waited for it forever, on the
training thread. Which came first, the send or the exit, was up to the machine, so the hang was
a race; here the send always comes after the exit. A real delivery process and JSONL tracker.
"""

from __future__ import annotations

import threading
import time

from otel_rl import Logger
from otel_rl.core.records import StepBatch
from testkit.readers import jsonl_rows


def test_a_record_sent_once_the_delivery_process_exited_is_counted_and_never_waits(tmp_path):
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": True,
                     "export": {"delivery": "process"}})  # fmt: skip
    logger.log_metrics({"x": 0.0}, step=0)
    (jsonl,) = logger.exporters
    link = jsonl.link
    logger.finish()
    assert link.process is not None and link.process.wait(30) == 0
    deadline = time.monotonic() + 30
    while not link._state.dead:  # the status thread has seen the exit
        assert time.monotonic() < deadline, "the exit was never seen"
        time.sleep(0.01)

    sent = threading.Thread(
        target=logger.fanout.send, args=(StepBatch(step=1, values={"x": 1.0}),), daemon=True
    )
    sent.start()
    sent.join(30)
    assert not sent.is_alive(), "the send after the end waits for a leftover file never written"
    assert jsonl.lost == {"after_shutdown": 1}
    assert [r["step"] for r in jsonl_rows(tmp_path / "metrics.jsonl")] == [0]
