"""What each tracker holds, read back with that tracker's own reader, as per-key series.

A tracker's delivery is ``{key: [(step, value), ...]}`` in the order the tracker stored the
points, so one checker serves every tracker: a step twice in a key's series is a duplicate, a
step lower than the one before it is out of order.

- JSONL: each line parsed with ``json`` (a line that does not parse is reported as torn).
- TensorBoard: every event of every event file with TensorBoard's ``EventFileLoader``, files in
  the order they were started, records in file order. Not ``EventAccumulator``: it drops points
  when a step goes back (``purge_orphaned_data``), which would hide the duplicates looked for.
- MLflow: ``MlflowClient.get_metric_history`` of every run of the experiment. MLflow keeps one
  point per (key, step, timestamp, value) and orders history by its own rules, so for MLflow
  only missing steps, values and a run split in two are observable, not duplicates or order.
- The test tracker: its JSON-lines file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults import fault_tracker
from tests.faults.plan import KEYS

Series = dict[str, list[tuple[int, float]]]


@dataclass
class Delivered:
    tracker: str
    series: Series = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # torn lines, split runs, unreadable files
    ordered: bool = True  # whether the reader sees the tracker's storage order

    def add(self, step: int, key: str, value: float) -> None:
        self.series.setdefault(key, []).append((step, value))


def jsonl(path: Path) -> Delivered:
    out = Delivered("jsonl")
    if not path.exists():
        return out
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, metrics = record["step"], record["metrics"]
        except (ValueError, KeyError, TypeError) as exc:
            out.problems.append(f"line {number} does not parse ({exc}): {line[:120]!r}")
            continue
        for key, value in metrics.items():
            if key in KEYS:
                out.add(step, key, value)
    return out


def tensorboard(directory: Path) -> Delivered:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = Delivered("tensorboard")
    if not directory.exists():
        return out
    files = []
    for path in directory.glob("events.out.tfevents.*"):
        events = list(EventFileLoader(str(path)).Load())
        started = events[0].wall_time if events else 0.0
        files.append((started, path.name, events))
    for _, _, events in sorted(files):
        for event in events:
            for value in event.summary.value:
                if value.tag in KEYS:
                    number = float(tensor_util.make_ndarray(value.tensor).item())
                    out.add(event.step, value.tag, number)
    return out


def faultfile(path: Path) -> Delivered:
    out = Delivered(fault_tracker.NAME)
    try:
        rows = fault_tracker.read_rows(path)
    except ValueError as exc:
        out.problems.append(f"{path} does not parse: {exc}")
        return out
    for step, values in rows:
        for key, value in values.items():
            if key in KEYS:
                out.add(step, key, value)
    return out


def mlflow(tracking_uri: str, experiment_name: str) -> Delivered:
    from mlflow.tracking import MlflowClient

    out = Delivered("mlflow", ordered=False)
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return out
    runs = client.search_runs([experiment.experiment_id])
    with_rows = 0
    points: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        found = False
        for key in KEYS:
            history = client.get_metric_history(run.info.run_id, key)
            points.setdefault(key, []).extend((m.step, m.value) for m in history)
            found = found or bool(history)
        with_rows += found
    if with_rows > 1:
        out.problems.append(f"rows split over {with_rows} MLflow runs of one training run")
    for key, series in points.items():
        for step, value in sorted(series):
            out.add(step, key, value)
    return out
