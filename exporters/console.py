"""Console exporter: a compact rich table of the latest values every ``console.every`` steps."""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TextIO

from otel_rl.core.records import HistogramValue, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import ConfigKey, TrackerConfig, TrackerExporter
from otel_rl.process.fork_safe_log import writing_shared_stream

#: The names of the tables otel-rl itself sends (``otel_rl/run_time``).
OWN_TABLE_PREFIX = "otel_rl/"


class ConsoleExporter(TrackerExporter):
    name: ClassVar[str] = "console"
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="a rich table on stderr",
        order=30,
        keys={
            "every": ConfigKey("count", "print every N-th step", default=1),
        },
    )  # fmt: skip

    def __init__(self, every: int = 1, stream: TextIO | None = None, **kwargs: Any) -> None:
        self.every = every
        self._stream = stream
        self._console: Any = None
        self._out: TextIO = sys.stderr
        self._rows_seen = 0
        super().__init__(**kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> ConsoleExporter:
        return cls(every=cfg.tracker_section("console").every, **kwargs)

    def open(self) -> None:
        from rich.console import Console

        self._out = self._stream or sys.stderr
        shown = Console(file=self._out, highlight=False)  # knows the terminal: colours and width
        # Rendered into memory, written by _show: rich would touch the stream outside the guard.
        self._console = Console(
            file=io.StringIO(), highlight=False, force_terminal=shown.is_terminal,
            color_system=shown.color_system, width=shown.width,  # type: ignore[arg-type]
        )  # fmt: skip

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        if batch.axis is not None:
            return  # time-axis data (GPU) would flood the terminal
        self._rows_seen += 1
        if (self._rows_seen - 1) % self.every:
            return
        from rich.table import Table

        table = Table(title=f"step {step}", show_header=True, header_style="bold", box=None)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in sorted(rows):
            table.add_row(key, _format(rows[key]))
        self._show(table)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        """otel-rl's own tables (where the run's time went, at the end) are a few short rows
        and printed; a user's tables (samples) would flood the terminal: skipped, said once."""
        if not name.startswith(OWN_TABLE_PREFIX):
            super().write_table(name, step, columns, rows)
            return
        from rich.table import Table

        table = Table(title=f"{name} at step {step}", show_header=True, header_style="bold",
                      box=None)  # fmt: skip
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(c if isinstance(c, str) else _format(c) for c in row))
        self._show(table)

    def write_page(self, name: str, step: int, html: str, png: bytes) -> None:
        """A terminal shows no page (``otel-rl timeline`` writes one to open)."""

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._show(f"[bold]hyperparameters[/bold]: {len(params)} values")

    def _show(self, renderable: Any) -> None:
        rendered = self._console.file
        self._console.print(renderable)
        text = rendered.getvalue()
        rendered.seek(0)
        rendered.truncate()
        with writing_shared_stream():  # the process's stderr: a fork waits for the write
            self._out.write(text)
            self._out.flush()


def _format(value: RowValue) -> str:
    if isinstance(value, str):
        return value if len(value) <= 60 else value[:57] + "..."
    if isinstance(value, HistogramValue):
        return f"histogram n={value.count} mean={value.mean:.4g}"
    if math.isnan(value) or math.isinf(value):
        return f"[bold red]{value}[/bold red]"
    return f"{value:.6g}"
