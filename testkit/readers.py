"""Read back what trackers stored, with each tracker's own reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from otel_rl.core.attempts import latest_attempt, resume_of


def tensorboard_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` read with TensorBoard's EventAccumulator (no size cap)."""
    acc = tensorboard_accumulator(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_accumulator(log_dir: str | Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(log_dir),
        size_guidance={"scalars": 0, "tensors": 0, "histograms": 0, "images": 0},
    )
    acc.Reload()
    return acc


def jsonl_rows(path: str | Path, torn_tail: bool = False) -> list[dict[str, Any]]:
    """Every line of a JSONL file, decoded, as written: of a relaunched run's ``metrics.jsonl``,
    every attempt's rows and the resume records too (:func:`metric_rows` reads the rows that
    count). ``torn_tail``: a last line without its newline (its writer killed in the middle of a
    write; the tracker cuts it when it next opens the file) is left out instead of failing."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    if torn_tail and lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def metric_rows(path: str | Path, every_attempt: bool = False) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``, in file order: of a relaunched run, the latest attempt of
    each step (``otel_rl.core.attempts``; no resume record, no superseded row). ``every_attempt``:
    every row of every attempt, still without the resume records."""
    records = jsonl_rows(path)
    if every_attempt:
        return [r for r in records if resume_of(r) is None]
    return latest_attempt(records).rows


def rows_by_step(path: str | Path, every_attempt: bool = False) -> dict[int, dict[str, Any]]:
    """Each step's values in a ``metrics.jsonl``, the rows of one step merged in file order: of
    a relaunched run, the latest attempt's (``every_attempt``: every attempt's rows merged, the
    later lines winning)."""
    out: dict[int, dict[str, Any]] = {}
    for row in metric_rows(path, every_attempt):
        out.setdefault(row["step"], {}).update(row["metrics"])
    return out


def anatomy_phases(row: dict[str, Any], untimed: bool = False) -> dict[str, float]:
    """The exclusive seconds of each timer path in a row's ``anatomy/<path>/seconds``
    (``untimed`` too when asked), not the step's wall time or its critical links."""
    left_out = ("anatomy/critical/", "anatomy/wall/") + (() if untimed else ("anatomy/untimed/",))
    return {
        key[len("anatomy/") : -len("/seconds")]: value
        for key, value in row.items()
        if key.startswith("anatomy/") and key.endswith("/seconds") and not key.startswith(left_out)
    }


def trace_file_spans(log_dir: str | Path) -> list[tuple[dict[str, Any], Any]]:
    """(resource attributes, span) of every span in a run's ``traces.jsonl`` (and the file it
    rotated to), parsed by OpenTelemetry's own OTLP JSON messages (``opentelemetry-proto-json``,
    which reads hex ids as the specification writes them)."""
    from opentelemetry.proto_json.collector.trace.v1.trace_service import (
        ExportTraceServiceRequest,
    )

    from otel_rl.telemetry.trace_file import trace_files

    out = []
    for path in trace_files(log_dir):
        for line in filter(None, path.read_text().splitlines()):
            for rs in ExportTraceServiceRequest.from_json(line).resource_spans:
                resource = {kv.key: next((v for v in (kv.value.string_value, kv.value.int_value)
                                          if v is not None), None)
                            for kv in rs.resource.attributes}  # fmt: skip
                out.extend((resource, span) for ss in rs.scope_spans for span in ss.spans)
    return out
