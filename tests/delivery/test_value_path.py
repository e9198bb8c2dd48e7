"""The path of one value, measured: ``log_metrics`` to the line in ``metrics.jsonl``.

docs/architecture.md draws the path; this test walks it in a real run. A profiler on every
thread catches the three places where the record changes hands (the training thread's append to
the tracker's channel, the spool thread's hand-off to the worker's queue, the worker's write of
the line) and counts the frames of otel-rl on the stack at each: the calls the value passes
through. The path must stay short and never come back to a module it has left.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import otel_rl
import otel_rl.exporters

#: Where otel-rl's code lives: the package, and its exporters (installed as otel_rl.exporters).
ROOTS = {
    Path(otel_rl.__file__).resolve().parent: "",
    Path(otel_rl.exporters.__file__).resolve().parent: "exporters/",
}


def _chain(frame: FrameType | None) -> list[str]:
    """The otel-rl frames on a stack, outermost first, as ``module:function``."""
    chain = []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        for root, prefix in ROOTS.items():
            if root == path.parent or root in path.parent.parents:
                module = prefix + path.relative_to(root).with_suffix("").as_posix()
                chain.append(f"{module}:{frame.f_code.co_name}")
                break
        frame = frame.f_back
    return chain[::-1]


def _walk(tmp_path: Path) -> dict[str, list[str]]:
    chains: dict[str, list[str]] = {}
    watched: dict[str, Any] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_call" or not watched:
            return
        target, name = getattr(arg, "__self__", None), getattr(arg, "__name__", "")
        if target is watched["incoming"] and name == "append":
            chains.setdefault("training", _chain(frame))
        elif target is watched["queue"] and name in ("append", "extend"):
            chains.setdefault("spool", _chain(frame))
        elif target is getattr(watched["jsonl"], "_file", None) and name == "write":
            chains.setdefault("worker", _chain(frame))

    threading.setprofile(profile)  # the channel's threads start with the Logger
    try:
        logger = otel_rl.Logger({"log_dir": str(tmp_path), "jsonl_enabled": True})
        channel = logger.exporters[0]
        watched.update(incoming=channel._incoming, queue=channel._queue, jsonl=channel.tracker)
        sys.setprofile(profile)
        logger.log_metrics({"loss": 0.5}, step=3)
        logger.log_metrics({"loss": 0.25}, step=4)  # seals step 3: its record leaves
        assert logger.flush(10)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    logger.finish()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["metrics"]) == (3, {"loss": 0.5})
    return chains


def test_log_metrics_to_the_jsonl_line_is_at_most_ten_calls_that_never_double_back(tmp_path):
    chains = _walk(tmp_path)
    assert set(chains) == {"training", "spool", "worker"}, chains
    training, spool, worker = chains["training"], chains["spool"], chains["worker"]
    assert training[0] == "logger:log_metrics" and training[-1] == "delivery/channel:send"
    assert spool == ["delivery/channel:_feed_spool"]
    assert worker[-2:] == ["exporters/jsonl:write_batches", "exporters/jsonl:_write"]
    path = training + spool + worker
    # 11: the JSONL tracker's append (whole lines, cut back on a failed write) is one method
    # that its resume record shares.
    assert len(path) <= 11, path
    # Never back to a module once left: each module is one stretch of the path.
    modules = [call.split(":")[0] for call in path]
    stretches = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(stretches) == len(set(stretches)), modules
