"""Send a table (validation samples) to each tracker in the form that tracker shows best.

Trackers with a table type get a :class:`~otel_rl.core.records.Table` through their
``write_table``: W&B (``wandb.Table``), Trackio (``trackio.Table``), ClearML (``report_table`` at
the step), MLflow (a JSON artifact ``tables/<name>/step_<N>.json``), TensorBoard (a Markdown table
in the TEXT tab), SwanLab (the same Markdown table as ``swanlab.Text``: its charts show no table
type). Trackers that show neither (console, JSONL) are skipped rather than warned about: the
samples are printed on the console already.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from otel_rl.core.records import Table
from otel_rl.delivery.fanout import Delivery, Fanout
from otel_rl.delivery.tracker import Tracker


def takes_tables(delivery: Delivery) -> bool:
    """Whether the tracker stores tables itself (overrides ``write_table``), also when it runs
    in the delivery process."""
    return delivery.tracker_class.write_table is not Tracker.write_table


def submit_table(
    fanout: Fanout,
    name: str,
    step: int,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    only: Collection[str] | None = None,
    per_tracker: Mapping[str, tuple[Sequence[str], Sequence[Sequence[Any]]]] | None = None,
) -> list[str]:
    """Queue the table for every exporter that stores tables (or those named in ``only``);
    returns their names. SwanLab shows it as Markdown text, TensorBoard in its text plugin.

    ``per_tracker`` replaces ``(columns, rows)`` for the trackers it names (W&B's wide layout in
    the verl surface). Only queue hand-offs happen here.
    """
    reached = []
    for exporter in fanout.select(only):
        if not takes_tables(exporter):
            continue
        tracker = exporter.name
        cols, body = (per_tracker or {}).get(tracker, (columns, rows))
        table = Table(name, int(step), tuple(map(str, cols)), tuple(tuple(r) for r in body))
        reached.extend(fanout.send(table, to=(tracker,)))
    return reached


def cell(value: Any) -> str | int | float:
    """A table cell every tracker accepts: numbers stay numbers, anything else becomes text."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy/torch scalar
        item: str | int | float = value.item()
        return item
    return str(value)
