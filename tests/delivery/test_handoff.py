"""What a delivery process was handed and never spooled: ``otel-rl replay`` spools it first.

Real runs with ``export.delivery: process`` (a real delivery process, stopped with SIGSTOP to
stand for one far behind), whose ``finish()`` deadline kills it: the frames it never spooled
wait in handoff files and the leftover file, and :func:`complete_spools` appends them to the
spools, each once, also when it is stopped part-way and run again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.delivery.frames import encode_frame
from otel_rl.delivery.handoff import complete_spools, highest_frame
from otel_rl.delivery.spool import handoff_dir, spool_root, waiting_records
from otel_rl.run.replay import replay
from testkit.readers import jsonl_rows


def _far_behind_run(tmp_path: Path, steps: int) -> Logger:
    """Ten steps delivered, then the delivery process stopped while ``steps`` more are logged
    (most to handoff files), and ``finish()``'s 1 s deadline kills it."""
    logger = Logger({
        "log_dir": str(tmp_path / "logs"), "jsonl_enabled": True, "tensorboard_enabled": True,
        "export": {"delivery": "process", "fsync_interval": 0.1, "shutdown_timeout": 1.0},
    })  # fmt: skip
    for step in range(10):
        logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
    assert logger.flush(30)
    os.kill(logger.exporters[0].link.process.pid, signal.SIGSTOP)
    for step in range(10, 10 + steps):
        logger.log_metrics({"x": float(step), "pad": "p" * 1500}, step=step, step_finished=True)
    time.sleep(0.3)  # the pusher hands the backlog to handoff files meanwhile
    logger.finish()
    return logger


def _spool(tmp_path: Path, tracker: str) -> Path:
    return next((spool_root(tmp_path / "logs") / tracker).iterdir())


@pytest.mark.slow
def test_frames_left_in_files_are_spooled_once_even_when_stopped_part_way(tmp_path):
    logger = _far_behind_run(tmp_path, 3000)
    assert {e.name: e.undelivered for e in logger.exporters} == {"jsonl": 3000,
                                                                 "tensorboard": 3000}
    folder = handoff_dir(tmp_path / "logs")
    names = sorted(p.name.split("-")[0] for p in folder.iterdir())
    assert names.count("handoff") >= 1 and names.count("launch") == 2, names
    assert [waiting_records(_spool(tmp_path, t)) for t in ("jsonl", "tensorboard")] == [0, 0]

    calls = 0

    def stop_after_some() -> bool:
        nonlocal calls
        calls += 1
        return calls > 1000  # about a third of the frames: the replay was interrupted

    (first,) = complete_spools(tmp_path / "logs", stop=stop_after_some)
    assert 0 < first.spooled["jsonl"] < 3000 and first.busy is None, first
    assert any(folder.iterdir()), "the files stay until every frame is spooled"
    (second,) = complete_spools(tmp_path / "logs")
    assert first.spooled["jsonl"] + second.spooled["jsonl"] == 3000, (first, second)
    assert first.spooled["tensorboard"] + second.spooled["tensorboard"] == 3000
    assert not folder.exists()
    assert complete_spools(tmp_path / "logs") == []
    # Every spool line carries its frame; the spool holds each of the launch's frames once.
    lines = [json.loads(line) for segment in sorted(_spool(tmp_path, "jsonl").glob("wal-*.jsonl"))
             for line in segment.read_text().splitlines()]  # fmt: skip
    frames = [line["intake"][1] for line in lines if "intake" in line]
    assert frames == sorted(set(frames)) and len(frames) == len(lines)
    token = lines[0]["intake"][0]
    assert highest_frame(_spool(tmp_path, "jsonl"), token) == frames[-1]

    results = replay(tmp_path / "logs", progress=False)
    assert all(r.complete for r in results), results
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["x"]) for r in rows] == [(s, float(s)) for s in range(3010)]


def test_a_launch_whose_training_process_lives_is_left_alone(tmp_path):
    """The training process holds its launch's lock: replay neither spools its files nor
    removes them while it lives (it may still write the leftover file)."""
    logger = Logger({"log_dir": str(tmp_path / "logs"), "jsonl_enabled": True,
                     "export": {"delivery": "process"}})  # fmt: skip
    try:
        logger.log_metrics({"x": 1.0}, step=0, step_finished=True)
        (result,) = complete_spools(tmp_path / "logs")
        assert result.busy == f"the training run (pid {os.getpid()})" and result.spooled == {}
        assert (handoff_dir(tmp_path / "logs") / f"launch-{os.getpid()}.json").exists()
    finally:
        logger.finish()
    assert not handoff_dir(tmp_path / "logs").exists()  # nothing was left: the files went


@pytest.mark.slow
def test_a_frame_that_cannot_be_read_back_costs_only_itself(tmp_path):
    """A damaged record frame among the leftover ones is counted and named; every other frame
    is spooled and delivered, and the next replay has nothing more to say."""
    _far_behind_run(tmp_path, 200)
    folder = handoff_dir(tmp_path / "logs")
    (leftover,) = folder.glob("left-*.frames")
    with leftover.open("ab") as f:  # a frame numbered after every other, whose record is junk
        f.write(encode_frame("rec", None, b"not a pickled record", 10**9))
    (result,) = complete_spools(tmp_path / "logs")
    assert result.unreadable == 1 and "1 record(s)" in (result.error or ""), result
    assert result.spooled == {"jsonl": 200, "tensorboard": 200}
    assert complete_spools(tmp_path / "logs") == []
    replay(tmp_path / "logs", progress=False)
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(210))
