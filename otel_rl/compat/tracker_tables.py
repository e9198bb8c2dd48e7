"""Send a table (validation samples) to each tracker in the form that tracker shows best.

Trackers with a table type get a :class:`~otel_rl.records.Table` through their ``write_table``:
W&B (``wandb.Table``), Trackio (``trackio.Table``), MLflow (a JSON artifact
``tables/<name>/step_<N>.json``), TensorBoard (a Markdown table in the TEXT tab). SwanLab has no
table type in otel-rl's exporter, so it gets the same Markdown table as ``swanlab.Text``. Trackers
that show neither (console, JSONL) are skipped rather than warned about: the samples are printed
on the console already.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from otel_rl.records import Table

#: Trackers that get the table as Markdown text instead.
TEXT_TRACKERS = frozenset({"swanlab"})


@dataclass(frozen=True)
class TextRecord:
    """Markdown text at a step for a tracker without tables (delivered on its worker thread)."""

    name: str
    step: int
    text: str

    def deliver_to(self, exporter: Any) -> None:
        if exporter.name == "swanlab":
            import swanlab

            exporter.run.log({self.name: swanlab.Text(self.text)}, step=self.step)


def takes_tables(exporter: Any) -> bool:
    """Whether the exporter stores tables itself (overrides ``write_table``)."""
    from otel_rl.exporters.base import TrackerExporter

    method = getattr(type(exporter), "write_table", None)
    return method is not None and method is not TrackerExporter.write_table


def submit_table(
    exporters: Iterable[Any],
    name: str,
    step: int,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    only: Collection[str] | None = None,
    per_tracker: Mapping[str, tuple[Sequence[str], Sequence[Sequence[Any]]]] | None = None,
) -> list[str]:
    """Queue the table for every exporter (or those named in ``only``); returns their names.

    ``per_tracker`` replaces ``(columns, rows)`` for the trackers it names (W&B's wide layout in
    the verl surface). Only queue hand-offs happen here.
    """
    from otel_rl.exporters.tensorboard_summaries import markdown_table

    reached = []
    for exporter in exporters:
        tracker = getattr(exporter, "name", "")
        if only is not None and tracker not in only:
            continue
        cols, body = (per_tracker or {}).get(tracker, (columns, rows))
        if tracker in TEXT_TRACKERS:
            exporter.submit(TextRecord(name, int(step), markdown_table(cols, body)))
        elif takes_tables(exporter):
            exporter.submit(
                Table(name, int(step), tuple(map(str, cols)), tuple(tuple(r) for r in body))
            )
        else:
            continue
        reached.append(tracker)
    return reached


def cell(value: Any) -> str | int | float:
    """A table cell every tracker accepts: numbers stay numbers, anything else becomes text."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy/torch scalar
        return value.item()
    return str(value)
