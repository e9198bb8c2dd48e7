"""JSONL exporter: one JSON object per row in ``<log_dir>/metrics.jsonl``.

Each line is ``{"step": N, "time": <unix seconds>, "metrics": {key: value}}`` (plus ``"axis"``
for rows on a custom x-axis such as GPU data). Values are numbers, strings, or histograms as
``{"count", "sum", "min", "max", "bounds", "counts"}``. NaN and ±inf are written as the bare
tokens ``NaN``/``Infinity``/``-Infinity`` that Python's ``json`` and pandas read back. The file is
opened for appending: a second run adds to it, never truncates it. Plots are stored beside it as
``plots/<name>/step_<N>.png`` and tables as lines of ``tables.jsonl``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.exporters.base import TrackerExporter

from otel_rl.records import HistogramValue, RowValue, StepBatch


class JsonlExporter(TrackerExporter):
    name: ClassVar[str] = "jsonl"
    max_batch: ClassVar[int] = 256

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        self.path = Path(path)
        self._file: Any = None
        super().__init__(**kwargs)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **kwargs: Any) -> JsonlExporter:
        path = cfg["jsonl"].get("path") or Path(cfg["log_dir"]) / "metrics.jsonl"
        return cls(path, **kwargs)

    def format_line(self, batch: StepBatch) -> bytes | None:
        """One JSON line for ``batch`` (``None`` skips it); subclasses change the layout."""
        return _line(batch).encode("utf-8")

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        # Unbuffered: each batch is one write of whole lines, on disk at once or not at all.
        self._file = self.path.open("ab", buffering=0)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        lines = [line for line in map(self.format_line, batches) if line is not None]
        if not lines:
            return
        data = b"".join(lines)
        start = self._file.seek(0, os.SEEK_END)
        try:
            written = self._file.write(data)
            if written != len(data):
                raise OSError(errno.ENOSPC, "short write", str(self.path))
        except OSError:
            # A full disk wrote part of the batch: cut it back, so no line is ever torn and
            # the retry writes the whole batch once.
            with contextlib.suppress(OSError):
                self._file.truncate(start)
            raise

    def write_position(self) -> Any:
        return self.path.stat().st_size if self.path.exists() else 0

    def holds_since(self, position: Any) -> bool:
        # Batches are written whole (above): a file longer than before holds the batch.
        try:
            return self.path.stat().st_size > int(position)
        except (OSError, TypeError, ValueError):
            return False

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        path = self.path.with_name("hyperparams.json")
        merged: dict[str, Any] = {}
        if path.exists():
            try:
                merged = json.loads(path.read_text())
            except ValueError:
                merged = {}
        merged.update({k: _jsonable(v) for k, v in params.items()})
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(merged, indent=2, sort_keys=True))
        tmp.replace(path)

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        # One file per step, never overwritten: <dir of metrics.jsonl>/plots/<name>/step_<N>.png
        path = self.path.parent / "plots" / name / f"step_{step}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)

    def write_table(
        self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        record = {"step": step, "table": name, "columns": list(columns),
                  "rows": [[_jsonable(c) for c in row] for row in rows]}
        with self.path.with_name("tables.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def flush_backend(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, exit_code: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line without its newline (a write cut by a crash) before appending."""
    try:
        with path.open("r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            position = max(0, size - 65536)
            while True:
                f.seek(position)
                chunk = f.read(size - position)
                cut = chunk.rfind(b"\n")
                if cut >= 0 or position == 0:
                    f.truncate(position + cut + 1 if cut >= 0 else 0)
                    return
                position = max(0, position - 65536)
    except FileNotFoundError:
        return


def _line(batch: StepBatch) -> str:
    record: dict[str, Any] = {"step": batch.step, "time": round(batch.time, 6)}
    if batch.axis:
        record["axis"] = batch.axis
    record["metrics"] = {k: _value(v) for k, v in batch.rows.items()}
    return json.dumps(record, separators=(",", ":")) + "\n"


def _value(value: RowValue) -> Any:
    if isinstance(value, HistogramValue):
        return {
            "count": value.count,
            "sum": value.sum,
            "min": value.min,
            "max": value.max,
            "bounds": list(value.bounds),
            "counts": list(value.counts),
        }
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
