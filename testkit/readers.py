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
