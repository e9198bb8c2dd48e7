"""Read back what trackers stored, with each tracker's own reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


def jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rows_by_step(path: str | Path) -> dict[int, dict[str, Any]]:
    """Each step's values in a ``metrics.jsonl``, the rows of one step merged in file order."""
    out: dict[int, dict[str, Any]] = {}
    for row in jsonl_rows(path):
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
