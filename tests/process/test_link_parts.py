"""The delivery process's link, part by part, on real pipes and files: the backlog's bounds, and
the writer's handoff to a file when the reader of the pipe falls behind, read back by the
delivery process's own reader of the stream (``otel_rl.delivery.delivery_process.messages``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from otel_rl.core.failures import losses
from otel_rl.delivery.delivery_process import messages
from otel_rl.delivery.frames import encode_frame
from otel_rl.delivery.link_backlog import Backlog
from otel_rl.delivery.link_state import LinkState, Pipe
from otel_rl.delivery.link_writer import FrameWriter
from otel_rl.delivery.options import ExportOptions
from otel_rl.process.deadline import Deadline


def _record_frame(number: int, size: int = 0) -> bytes:
    return encode_frame("rec", None, b"x" * size + number.to_bytes(4, "big"), number)


def test_where_records_go_moves_one_way_and_a_leftover_file_written_stays_where_they_go():
    """The link's one state, as the delivery process's start, death and the run's end move it:
    a sender waiting while the leftover file is written is woken when it is, and nothing later
    (the pipe's close, a second death, the run's end) sends records anywhere else."""
    state = LinkState(["jsonl"])
    assert state.pipe is Pipe.OPEN and not state.dead
    woken: list[Pipe] = []

    def sender() -> None:  # as ServiceLink.send waits while the leftover file is written
        with state.cond:
            while state.pipe is Pipe.LEAVING or not woken:
                woken.append(state.pipe)
                state.cond.wait(5)
            woken.append(state.pipe)

    with state.cond:
        assert state.leaving_locked()  # the delivery process died during the run
    waiting = threading.Thread(target=sender)
    waiting.start()
    while not woken:
        time.sleep(0.01)
    with state.cond:
        state.close_pipe_locked()  # the pusher saw the broken pipe: the leaving state stays
        assert state.pipe is Pipe.LEAVING and state.dead
        state.left_locked(kept=True)
    waiting.join(5)
    assert not waiting.is_alive() and woken[0] is Pipe.LEAVING and woken[-1] is Pipe.TO_FILE
    with state.cond:
        assert not state.leaving_locked()  # the status reader hears the end after the kill
        state.close_pipe_locked()
        assert state.end_run_locked() and not state.end_run_locked()  # finish(), then again
    assert state.pipe is Pipe.TO_FILE and state.ended

    clean = LinkState(["jsonl"])
    with clean.cond:
        assert clean.end_run_locked()
        clean.close_pipe_locked()  # the end frame is out
    assert clean.pipe is Pipe.CLOSED and clean.dead

    forked = LinkState(["jsonl"])
    lock = forked.cond
    forked.abandon_after_fork()
    assert forked.pipe is Pipe.CLOSED and forked.ended and forked.cond is not lock


def test_a_full_backlog_under_drop_oldest_drops_the_oldest_record_after_the_first():
    state = LinkState(["jsonl"])
    backlog = Backlog(state, ExportOptions(queue_size=3, on_full="drop_oldest"), handoff=False)
    with state.cond:
        for number in range(1, 6):
            state.handed["jsonl"] += 1
            backlog.add_locked(_record_frame(number), ("jsonl",), number)
        kept = [entry[3] for entry in backlog.entries]
    # The first frame may be half in the pipe already: the oldest after it goes each time.
    assert kept == [1, 4, 5]
    assert backlog.records == 3
    assert state.handed == {"jsonl": 3}
    assert state.local_stats["jsonl"]["dropped.queue_full"] == 2


def test_control_frames_never_count_against_the_queue():
    state = LinkState(["jsonl"])
    backlog = Backlog(state, ExportOptions(queue_size=2, on_full="drop_oldest"), handoff=False)
    with state.cond:
        backlog.add_locked(_record_frame(1), ("jsonl",), 1)
        for flush_id in range(5):
            backlog.queue_control_locked(encode_frame("flush", flush_id, 1.0))
        backlog.add_locked(_record_frame(2), ("jsonl",), 2)
        numbers = [entry[3] for entry in backlog.entries]
    assert (numbers, backlog.records, state.local_stats["jsonl"]) == ([1, 0, 0, 0, 0, 0, 2], 2, {})


def test_kept_frames_are_let_go_up_to_the_number_the_child_says_it_spooled():
    state = LinkState(["jsonl"])
    backlog = Backlog(state, ExportOptions(), handoff=False)
    for number in range(1, 1001):
        backlog.kept.add(number, _record_frame(number), ("jsonl",))
    backlog.let_go(700)  # in batches under the lock: the training thread is never held long
    assert [entry[0] for entry in backlog.kept.after(0)] == list(range(701, 1001))
    assert backlog.spooled_through == 700
    backlog.let_go(650)  # an older report changes nothing
    assert backlog.spooled_through == 700
    with state.cond:
        left = backlog.take_unspooled_locked()
    assert [entry[0] for entry in left] == list(range(701, 1001))
    assert not backlog.kept.numbers


def test_frames_the_pipe_cannot_take_go_to_a_handoff_file_and_arrive_once_in_order(
    tmp_path: Path,
):
    """Nobody reads the pipe while 3 MB are written (a 64 KiB pipe): what waits a quarter of
    ``fsync_interval`` goes to a handoff file. Then a reader starts; it gets every record once,
    in the order sent, the file's frames where they belong, and the end frame last."""
    records_r, records_w = os.pipe()
    state = LinkState(["jsonl"])
    options = ExportOptions(fsync_interval=0.2)
    backlog = Backlog(state, options, handoff=True)
    writer = FrameWriter(state, backlog, tmp_path / "handoff", options.fsync_interval)
    writer.attach(records_w)
    writer.start(encode_frame("hello", {"handoff_dir": str(tmp_path / "handoff"),
                                        "pid": os.getpid()}), None)  # fmt: skip
    total, size = 1500, 2000
    try:
        for number in range(1, total + 1):
            with state.cond:
                state.handed["jsonl"] += 1
                backlog.add_locked(_record_frame(number, size), ("jsonl",), number)
            if number % 100 == 0:
                time.sleep(0.02)
        files = list((tmp_path / "handoff").glob(f"handoff-{os.getpid()}-*.frames"))
        assert files, "the pipe was full for longer than a quarter of fsync_interval"

        got: list[tuple[Any, ...]] = []
        reader = threading.Thread(target=lambda: got.extend(messages(records_r)))
        reader.start()
        assert backlog.send_control(encode_frame("end", 0, 5.0), Deadline(20))
        with state.cond:
            state.close_pipe_locked()
            while backlog.pushing:
                state.cond.wait(0.05)
        writer.close_handoff()
        writer.close()
        reader.join(20)
        assert not reader.is_alive()
    finally:
        os.close(records_r)
    stream = [message for message in got if message[0] != "read"]  # ("read", file) ends a file
    assert stream[0][0] == "hello" and stream[-1][:2] == ("end", 0)
    numbers = [message[3] for message in got if message[0] == "rec"]
    assert numbers == list(range(1, total + 1))
    bodies = {message[2][-4:] for message in got if message[0] == "rec"}
    assert bodies == {n.to_bytes(4, "big") for n in range(1, total + 1)}
    read_files = {Path(message[1]) for message in got if message[0] == "read"}
    assert read_files == set((tmp_path / "handoff").glob("handoff-*.frames"))
    # Only what went by the pipe is kept until spooled: the files outlive the child.
    kept = list(backlog.kept.numbers)
    assert 0 < len(kept) < total and kept == sorted(kept)
    assert state.sent == {"jsonl": total}
    assert losses(state.local_stats["jsonl"]) == {}
