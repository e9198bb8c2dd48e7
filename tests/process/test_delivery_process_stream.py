"""The delivery process (``python -m otel_rl.run.service``, a real child process with a real
JSONL tracker) fed a stream of frames written here by hand, as the training process's link
writes them: records it can read arrive at their steps, with their values; a record frame it
cannot read costs only itself (counted as refused, said once) and the stream goes on."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from otel_rl.config.loading import resolve_settings
from otel_rl.core.failures import losses
from otel_rl.core.records import Hyperparams, StepBatch
from otel_rl.delivery.frames import encode_frame, record_body
from testkit.readers import jsonl_rows


def _deliver(tmp_path: Path, stream: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """Start a delivery process, write the hello frame and ``stream`` to its records pipe,
    close it; its exit code and every status line it wrote."""
    cfg = resolve_settings({
        "log_dir": str(tmp_path / "logs"), "jsonl_enabled": True,
        "export": {"delivery": "process", "fsync_interval": 0.1},
    })  # fmt: skip
    settings = {
        "cfg": cfg, "run_id": "stream", "cwd": str(tmp_path), "pid": os.getpid(),
        "log_dir": str(cfg.log_dir), "shutdown_timeout": cfg.export.shutdown_timeout,
        "log_level": logging.WARNING, "sys_path": list(sys.path), "launch": "a1b2c3",
        "handoff_dir": None, "cores": None,
    }  # fmt: skip
    records_r, records_w = os.pipe()
    status_r, status_w = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "otel_rl.run.service", str(records_r), str(status_w)],
            pass_fds=(records_r, status_w), stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        os.close(records_r)
        os.close(status_w)
    lines: list[dict[str, Any]] = []

    def read_status() -> None:
        with os.fdopen(status_r, "rb") as status:
            lines.extend(json.loads(line) for line in status)

    reader = threading.Thread(target=read_status)
    reader.start()
    with os.fdopen(records_w, "wb") as pipe:
        pipe.write(encode_frame("hello", settings))
        for frame in stream:
            pipe.write(frame)
    code = process.wait(60)
    reader.join(10)
    assert not reader.is_alive()
    return code, lines


def _rec(number: int, body: bytes) -> bytes:
    return encode_frame("rec", None, body, number)


def _step(step: int, **flags: Any) -> bytes:
    values = {"loss": 1.0 / (step + 1), "odd": math.nan, "note": f"s{step}"}
    return record_body(StepBatch(step=step, values=values, **flags))


def test_records_arrive_at_their_steps_and_an_unreadable_frame_costs_only_itself(tmp_path):
    stream = [
        _rec(1, record_body(Hyperparams({"lr": 0.001}))),
        _rec(2, _step(0, seal=0)),
        _rec(3, b"not a pickled record"),
        _rec(4, pickle.dumps({"kind": "nonesuch"})),
        _rec(5, _step(1, seal=1)),
        _rec(6, _step(2, seal=2, provisional=True)),  # a checkpoint: to the spool only
        _rec(7, _step(2, seal=2)),
        encode_frame("end", 0, 10.0),
    ]
    code, status = _deliver(tmp_path, stream)
    assert code == 0
    assert status[0]["started"] is True
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        step, metrics = r["step"], r["metrics"]
        assert metrics["loss"] == 1.0 / (step + 1) and math.isnan(metrics["odd"])
        assert metrics["note"] == f"s{step}"
    assert json.loads((tmp_path / "logs" / "hyperparams.json").read_text())["lr"] == 0.001
    last = status[-1]
    assert last["finished"] == {"jsonl": 0}
    assert last["intake"] == 7  # every frame is spooled (or set aside) up to the last
    stats = last["stats"]["jsonl"]
    assert losses(stats) == {"refused": 2}
    assert stats["delivered"] == 4  # the hyperparameters and three steps
    said = [text for level, text in (line["log"] for line in status if "log" in line)]
    unreadable = [text for text in said if "cannot be read in the delivery process" in text]
    assert len(unreadable) == 1 and unreadable[0].startswith("otel-rl: jsonl: "), said


def test_without_the_end_frame_every_record_is_delivered_before_the_run_is_closed(tmp_path):
    """The training process died without ending the run (the pipe ends with no end frame):
    what the pipe held is delivered, then the trackers are closed and the end reported."""
    code, status = _deliver(tmp_path, [_rec(n + 1, _step(n, seal=n)) for n in range(5)])
    assert code == 0
    assert [r["step"] for r in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")] == list(range(5))
    last = status[-1]
    assert last["finished"] == {"jsonl": 0} and last["intake"] == 5
    assert last["stats"]["jsonl"]["delivered"] == 5 and losses(last["stats"]["jsonl"]) == {}
