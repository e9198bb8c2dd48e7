"""The Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open:
a process per process of the run, a thread per lane, each span a complete (``X``) event, step
boundaries and stalls as instant (``i``) events, GPU utilisation as counter (``C``) events."""

from __future__ import annotations

from typing import Any

from otel_rl.timeline.run_picture import RunPicture
from otel_rl.timeline.window import Window

_US = 1e6


def trace_events(picture: RunPicture, window: Window) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    for index, lane in enumerate(picture.lanes):
        if lane.process not in pids:
            pids[lane.process] = len(pids) + 1
            events.append(_meta("process_name", pids[lane.process], 0, lane.process))
        pid = pids[lane.process]
        events.append(_meta("thread_name", pid, index + 1, lane.thread or "main"))
    for span in window.spans:
        lane = picture.lanes[span.lane]
        args = {str(k): _plain(v) for k, v in span.attributes.items()}
        if span.step is not None:
            args.setdefault("rl.step", span.step)
        ts, end = round(span.start * _US, 3), round(span.end * _US, 3)
        events.append({
            "name": span.name, "cat": "span", "ph": "X", "ts": ts,
            "dur": round(max(0.0, end - ts), 3),
            "pid": pids[lane.process], "tid": span.lane + 1, "args": args,
        })  # fmt: skip
    run_pid = len(pids) + 1
    events.append(_meta("process_name", run_pid, 0, "run"))
    for step in window.steps:
        events.append({"name": f"step {step.step}", "cat": "step", "ph": "i", "s": "g",
                       "ts": round(step.start * _US, 3), "pid": run_pid, "tid": 0,
                       "args": {"seconds": round(step.seconds, 6), **step.anatomy}})  # fmt: skip
    for stall in window.stalls:
        events.append({"name": "stall", "cat": "stall", "ph": "i", "s": "g",
                       "ts": round(stall.start * _US, 3), "pid": run_pid, "tid": 0,
                       "args": {"verdict": stall.verdict, "report": stall.report}})  # fmt: skip
    for name, points in window.gpus.items():
        for when, value in points:
            events.append({"name": name, "cat": "gpu", "ph": "C", "ts": round(when * _US, 3),
                           "pid": run_pid, "args": {"utilization %": value}})  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"log_dir": str(picture.log_dir), "t0_unix_s": picture.t0},
    }


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
