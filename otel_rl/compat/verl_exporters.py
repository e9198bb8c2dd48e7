"""verl's ``file`` and ``console`` backends as otel-rl tracker exporters (own worker thread each).

- ``file``: one JSON line per logged row, ``{"step": N, "data": {key: value}}``, as verl's
  ``FileLogger`` writes it. The file is opened for appending: a resumed or repeated run adds to
  it and never truncates it (verl opens it with ``"wb"``). Non-finite numbers are written as
  ``null`` (orjson's spelling, which both ``json`` and ``orjson`` read); histograms as their
  ``count, sum, mean, min, max``. Built on the JSONL exporter, so hyperparameters, plots and
  tables land beside the file as they do for ``jsonl`` (``hyperparams.json``, ``plots/``,
  ``tables.jsonl``).
- ``console``: verl's ``LocalLogger`` line, ``step:N - key:value - ...`` (numbers only), on stdout.
"""

from __future__ import annotations

import json
import math
import pprint
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, TextIO

from otel_rl.exporters.base import TrackerExporter
from otel_rl.exporters.jsonl import JsonlExporter
from otel_rl.records import HistogramValue, RowValue, StepBatch


class VerlFileExporter(JsonlExporter):
    """otel-rl's JSONL exporter writing verl's line layout (training rows only)."""

    name: ClassVar[str] = "file"

    def format_line(self, batch: StepBatch) -> bytes | None:
        return _line(batch) if batch.axis is None else None


def _line(batch: StepBatch) -> bytes:
    data = {key: _value(value) for key, value in batch.rows.items()}
    record = {"step": batch.step, "data": data}
    try:
        import orjson
    except ImportError:
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def _value(value: RowValue) -> Any:
    if type(value) is float:
        return value if math.isfinite(value) else None
    if isinstance(value, HistogramValue):
        return {
            "count": value.count,
            "sum": value.sum,
            "mean": value.mean if value.count else None,
            "min": value.min,
            "max": value.max,
        }
    return value


class VerlConsoleExporter(TrackerExporter):
    name: ClassVar[str] = "console"

    def __init__(self, stream: TextIO | None = None, **kwargs: Any) -> None:
        self._stream = stream
        super().__init__(**kwargs)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        if batch.axis is not None:
            return
        parts = [f"step:{step}"]
        parts.extend(
            f"{key}:{pprint.pformat(value)}"
            for key, value in rows.items()
            if type(value) is float
        )
        stream = self._stream or sys.stdout
        print(" - ".join(parts), file=stream, flush=True)


def use_verl_mlflow_names(exporter: Any) -> None:
    """Give an MLflow exporter verl's metric names: ``@`` becomes ``_at_`` (``mean@1`` →
    ``mean_at_1``) before MLflow's own rules apply, so existing MLflow queries keep working."""
    from otel_rl.exporters.mlflow_names import NameMap

    current = getattr(exporter, "metric_names", None)
    if isinstance(current, NameMap):
        exporter.metric_names = _VerlMetricNames("metric", file_store=current.file_store)


class _VerlMetricNames:
    """A :class:`~otel_rl.exporters.mlflow_names.NameMap` fed with verl's spelling of a key."""

    def __init__(self, kind: str, *, file_store: bool) -> None:
        from otel_rl.exporters.mlflow_names import NameMap

        self._names = NameMap(kind, file_store=file_store)
        self.file_store = file_store

    @property
    def renamed(self) -> dict[str, str]:
        return self._names.renamed

    def __call__(self, key: str) -> str:
        return self._names(key.replace("@", "_at_"))
