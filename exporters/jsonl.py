"""JSONL exporter: one JSON object per row in ``<log_dir>/metrics.jsonl``.

Each line is ``{"step": N, "time": <unix s>, "run_id": "<id>", "attempt": A, "metrics": {key:
value}}`` (plus ``"axis"`` for rows on a custom x-axis such as GPU data; ``run_id`` is the
Logger's ``run_id`` and ``attempt`` its launch, 1 unless the run was relaunched; both are left
out when the exporter is built without them). A relaunched run writes one ``"resume"`` record
where its attempt begins (:meth:`JsonlExporter.write_resume`). Values are numbers, strings, or
histograms as ``{"count", "sum", "min", "max", "bounds", "counts"}``. NaN and ±inf are written
as the bare tokens ``NaN``/``Infinity``/``-Infinity`` that Python's ``json`` and pandas read
back. The file is opened for appending: a second run adds to it, never truncates it, and says so
once (a warning naming the file) when the file's last row belongs to another run; ``run_id``
tells the runs apart.
Plots are stored beside it as ``plots/<name>/step_<N>.png`` (``<name>`` made safe by
:func:`otel_rl.core.paths.safe_relative`: never outside that folder) and tables as lines of
``tables.jsonl``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.paths import path_inside
from otel_rl.core.records import Event, HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import ConfigKey, RowRejected, TrackerConfig, TrackerExporter

# The start of a row of ours: the run id comes before the metrics, so that reading the first
# bytes of the last line tells which run wrote it, however long the row.
_ROW_HEAD = re.compile(rb'^\{"step":[^,]*,"time":[^,]*,"run_id":("(?:[^"\\]|\\.)*")')
_TAIL_CHUNK = 65536


class JsonlExporter(TrackerExporter):
    name: ClassVar[str] = "jsonl"
    max_batch: ClassVar[int] = 256
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="JSON lines, one object per row",
        enabled=True,
        order=20,
        keys={
            "path": ConfigKey(
                "path", "the file (appended, never truncated)",
                shown_default="`<log_dir>/metrics.jsonl`",
            ),
        },
    )  # fmt: skip

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_id: str | None = None,
        attempt: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.path = Path(path).absolute()  # where it is now, whatever the script's cwd later
        #: Written in every row; ``None`` leaves the field out.
        self.run_id = None if run_id is None else str(run_id)
        #: The launch of the run the rows belong to (1, 2, ... after relaunches; see
        #: :meth:`write_resume`), written in every row; ``None`` leaves the field out.
        self.attempt = None if attempt is None else int(attempt)
        self._file: Any = None
        self._checked_other_run = False
        super().__init__(**kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> JsonlExporter:
        path = cfg.tracker_section("jsonl").path or Path(cfg.log_dir) / "metrics.jsonl"
        return cls(path, run_id=cfg.run_id, attempt=cfg.attempt, **kwargs)

    def beside(self, name: str) -> Path:
        """Where the run's ``name`` (hyperparameters, tables, events, plots) is kept: beside
        ``metrics.jsonl`` as ``name``; beside any other file as ``<its stem>.<name>``, so that
        runs sharing a folder (verl's ``file`` backend: ``<project>/<experiment>.jsonl``) never
        write into each other's."""
        if self.path.name == "metrics.jsonl":
            return self.path.with_name(name)
        return self.path.with_name(f"{self.path.stem}.{name}")

    def format_line(self, batch: StepBatch) -> bytes | None:
        """One JSON line for ``batch`` (``None`` skips it); subclasses change the layout."""
        return _line(batch, self.run_id, self.attempt).encode("utf-8")

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        if not self._checked_other_run:
            self._checked_other_run = True
            self._warn_if_another_run()
        # Unbuffered: each batch is one write of whole lines, on disk at once or not at all.
        self._file = self.path.open("ab", buffering=0)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        lines = [line for line in map(self.format_line, batches) if line is not None]
        if not lines:
            return
        self._write(b"".join(lines))

    def _write(self, data: bytes) -> None:
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

    def write_resume(self, resume: Resume) -> None:
        """One record: ``{"step": <first step of the attempt>, ..., "attempt": N, "resume":
        {"attempt": N, "step": S}, "metrics": {}}``. Rows of earlier attempts at ``step >= S``
        are superseded (``otel_rl.core.attempts`` reads the file that way)."""
        self.attempt = max(self.attempt or 1, resume.attempt)
        record: dict[str, Any] = {"step": resume.step, "time": round(time.time(), 6)}
        if self.run_id is not None:
            record["run_id"] = self.run_id
        record["attempt"] = resume.attempt
        record["resume"] = {"attempt": resume.attempt, "step": resume.step}
        record["metrics"] = {}
        self._write((json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8"))

    def _warn_if_another_run(self) -> None:
        """Say once that the file already ends with another run's rows (runs would interleave
        by step in every reader that ignores ``run_id``). Reads only the last row's first bytes,
        on this exporter's thread."""
        if self.run_id is None or type(self).format_line is not JsonlExporter.format_line:
            return  # no run id to compare, or another layout (a subclass's) without one
        try:
            other = _last_run_id(self.path)
        except OSError:
            return
        if other is False or other == self.run_id:
            return
        whose = f"run {other!r}" if other is not None else "a run that wrote no run_id"
        self._warn_once(
            "other-run",
            "%s: %s already holds rows of %s; this run (%r) appends after them, so its steps "
            "repeat in the file. Give each run a fresh log_dir (or jsonl.path), or tell the runs "
            "apart by each row's run_id",
            self.name, self.path, whose, self.run_id,
        )  # fmt: skip

    def write_position(self) -> Any:
        return self.path.stat().st_size if self.path.exists() else 0

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        # One line per batch, written in one call; a kill may still cut that call short (the
        # torn tail is cut at open and the batch sent again whole).
        return holds_lines_since(self.path, position, records)

    def landed_since(self, position: Any, records: int) -> int | None:
        # One line per batch, in the order written; the torn line after them is cut at open. A
        # subclass whose format_line skips batches may count one landed that was not: a record
        # is then sent twice, never lost.
        lines = whole_lines_since(self.path, position)
        return None if lines is None else min(lines, records)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        path = self.beside("hyperparams.json")
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
        # One file per step: <dir of metrics.jsonl>/plots/<name>/step_<N>.png, the name made
        # safe so that "../x" or "/etc/x" stays inside plots/.
        try:
            folder = path_inside(self.beside("plots"), name)
        except ValueError as exc:
            raise RowRejected(f"plot {name!r:.80}: {exc}") from None
        path = folder / f"step_{step}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)

    def write_page(self, name: str, step: int, html: str, png: bytes) -> None:
        # <dir of metrics.jsonl>/pages/<name>/step_<N>.html, beside the plots' layout.
        try:
            folder = path_inside(self.beside("pages"), name)
        except ValueError as exc:
            raise RowRejected(f"page {name!r:.80}: {exc}") from None
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"step_{step}.html").write_text(html, encoding="utf-8")

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        record = {"step": step, "table": name, "columns": list(columns),
                  "rows": [[_jsonable(c) for c in row] for row in rows]}
        with self.beside("tables.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def write_event(self, event: Event) -> None:
        record = {"step": event.step, "time": round(time.time(), 6), "run_id": self.run_id,
                  "event": event.name, "level": event.level, "title": event.title,
                  "text": event.text}  # fmt: skip
        with self.beside("events.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def flush_backend(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, exit_code: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def holds_lines_since(path: str | os.PathLike[str], position: Any, records: int | None) -> bool:
    """Whether the file at ``path`` holds ``records`` whole lines after byte ``position`` (any
    whole lines, when ``records`` is ``None``): the ``holds_since`` of a tracker that writes one
    line per record, for ``otel-rl replay``."""
    try:
        with open(path, "rb") as f:
            f.seek(int(position))
            tail = f.read()
    except (OSError, TypeError, ValueError):
        return False
    if not tail.endswith(b"\n"):
        return False  # a write cut short: the line is cut at open and the batch sent again
    return records is None or tail.count(b"\n") >= records


def whole_lines_since(path: str | os.PathLike[str], position: Any) -> int | None:
    """How many whole lines the file at ``path`` holds after byte ``position`` (``None`` when it
    cannot be read there)."""
    try:
        with open(path, "rb") as f:
            f.seek(int(position))
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except (OSError, TypeError, ValueError):
        return None


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


def _last_run_id(path: Path) -> str | bool | None:
    """The ``run_id`` of the file's last row: a string, ``None`` for a row without one, or
    ``False`` when there is no row. Reads backwards from the end in chunks only as far as the
    start of the last line, then that line's first bytes."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:  # skip trailing newlines
            f.seek(end - 1)
            if f.read(1) != b"\n":
                break
            end -= 1
        if end == 0:
            return False
        start = end
        while start > 0:
            position = max(0, start - _TAIL_CHUNK)
            f.seek(position)
            cut = f.read(start - position).rfind(b"\n")
            if cut >= 0:
                start = position + cut + 1
                break
            start = position
        f.seek(start)
        head = f.read(min(1024, end - start))
    match = _ROW_HEAD.match(head)
    if match is None:
        return None
    try:
        return str(json.loads(match.group(1)))
    except ValueError:
        return None


def _line(batch: StepBatch, run_id: str | None = None, attempt: int | None = None) -> str:
    record: dict[str, Any] = {"step": batch.step, "time": round(batch.time, 6)}
    if run_id is not None:
        record["run_id"] = run_id
    if attempt is not None:
        record["attempt"] = attempt
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
