"""verl's ``file`` and ``console`` backends as otel-rl tracker exporters (own worker thread each).

- ``file``: one JSON line per logged row, ``{"step": N, "data": {key: value}}``, as verl's
  ``FileLogger`` writes it. The file is opened for appending: a resumed or repeated run adds to
  it and never truncates it (verl opens it with ``"wb"``); a relaunch of the run writes one
  ``"resume"`` line where its attempt begins (:meth:`VerlFileExporter.write_resume`).
  Non-finite numbers are written as ``null`` (orjson's spelling, which both ``json`` and
  ``orjson`` read); histograms as their ``count, sum, mean, min, max``. Built on the JSONL
  exporter, so hyperparameters, plots and tables land beside the file as they do for ``jsonl``
  (``hyperparams.json``, ``plots/``, ``tables.jsonl``).
- ``console``: verl's ``LocalLogger`` line, ``step:N - key:value - ...`` (numbers only), on stdout.
- MLflow metric names as verl's MLflow adapter writes them (:func:`verl_mlflow_key`), with its
  warning on the ``verl.utils.tracking`` logger.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import pprint
import re
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, TextIO

from otel_rl.core.records import HistogramValue, Resume, RowValue, StepBatch
from otel_rl.exporters.base import TrackerExporter
from otel_rl.exporters.jsonl import JsonlExporter
from otel_rl.process.fork_safe_log import fork_safe, writing_shared_stream


class VerlFileExporter(JsonlExporter):
    """otel-rl's JSONL exporter writing verl's line layout (training rows only)."""

    name: ClassVar[str] = "file"

    def format_line(self, batch: StepBatch) -> bytes | None:
        return _line(batch) if batch.axis is None else None

    def write_resume(self, resume: Resume) -> None:
        """One line where a relaunch's attempt begins, in verl's layout with an empty ``data``:
        ``{"step": S, "data": {}, "resume": {"attempt": N, "step": S}}``. verl's lines carry no
        attempt: the lines above this one at steps ``>= S`` are superseded by the lines below
        it."""
        record = {"step": resume.step, "data": {},
                  "resume": {"attempt": resume.attempt, "step": resume.step}}  # fmt: skip
        self._write((json.dumps(record, separators=(",", ":")) + "\n").encode())


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
    """verl's console backend, also ``Tracking.console_logger`` (verl: a ``LocalLogger``):
    ``log(data, step)``, ``flush()`` and ``print_to_console`` work as there, the printing
    happening on this tracker's thread."""

    name: ClassVar[str] = "console"

    def __init__(
        self, stream: TextIO | None = None, print_to_console: bool = True, **kwargs: Any
    ) -> None:
        self._stream = stream
        #: verl's switch: False silences the console lines.
        self.print_to_console = print_to_console
        super().__init__(**kwargs)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """verl's ``LocalLogger.log``: one ``step:N - key:value`` line for ``data``."""
        from otel_rl.core.values import flatten_into

        values: dict[str, Any] = {}
        flatten_into(values, data, "", lambda key, reason: None)  # non-numbers are not printed
        self.delivery.submit(StepBatch(step=int(step), values=values))

    def flush(self) -> None:
        """verl's ``LocalLogger.flush`` (a no-op there): wait until queued lines are printed."""
        self.force_flush()

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        if batch.axis is not None or not self.print_to_console:
            return
        parts = [f"step:{step}"]
        parts.extend(
            f"{key}:{pprint.pformat(value)}"
            for key, value in rows.items()
            if type(value) is float
        )
        stream = self._stream or sys.stdout
        with writing_shared_stream():  # the process's stdout: a fork waits for the line
            print(" - ".join(parts), file=stream, flush=True)


# ---- verl's MLflow metric names --------------------------------------------------------------

#: The logger verl's MLflow adapter warns on (``verl.utils.tracking``), kept so that logging
#: configured for verl applies unchanged.
VERL_TRACKING_LOGGER = "verl.utils.tracking"
_verl_log = fork_safe(logging.getLogger(VERL_TRACKING_LOGGER))

#: Characters verl keeps in an MLflow key: MLflow's own set (letters, digits, ``_ - . / :`` and
#: spaces). Each other character becomes one ``_``.
_VERL_INVALID = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")


def verl_mlflow_key(key: str) -> str:
    """verl's spelling of a metric key in MLflow: ``@`` → ``_at_``, runs of ``/`` → one ``/``,
    every other character MLflow refuses → ``_`` (``val:acc`` stays, ``a!!b`` → ``a__b``)."""
    return _VERL_INVALID.sub("_", _SLASHES.sub("/", key.replace("@", "_at_")))


def mlflow_accepts(name: str) -> bool:
    """Whether MLflow stores ``name`` as it is: its characters, at most 250 of them, and a name
    that is a normalised relative path (no leading or trailing ``/``, no ``.``/``..`` parts)."""
    from otel_rl.exporters.mlflow_names import MAX_NAME_LENGTH

    if not name or len(name) > MAX_NAME_LENGTH or _VERL_INVALID.search(name):
        return False
    normal = posixpath.normpath(name)
    return normal == name and normal != "." and not normal.startswith(("..", "/"))


def use_verl_mlflow_names(exporter: Any) -> None:
    """Give an MLflow exporter verl's metric names and verl's warning for each renamed key."""
    from otel_rl.exporters.mlflow_names import NameMap

    current = getattr(exporter, "metric_names", None)
    if isinstance(current, NameMap):
        exporter.metric_names = VerlMetricNames(file_store=current.file_store)


class VerlMetricNames:
    """Row key → MLflow metric name as verl's MLflow adapter names it, stable for the run.

    A key verl changes is reported once, on the ``verl.utils.tracking`` logger, with verl's
    message naming the original key and the new name. A verl name MLflow would still refuse
    (a leading ``/``, a ``..`` part, over 250 characters) or, with the file store, a name that is
    also another metric's folder, goes on through otel-rl's MLflow rules
    (:class:`~otel_rl.exporters.mlflow_names.NameMap`), which report it in their own words.
    """

    def __init__(self, *, file_store: bool) -> None:
        from otel_rl.exporters.mlflow_names import NameMap

        self.file_store = file_store
        self._fallback = NameMap("metric", file_store=file_store)
        self._names: dict[str, str] = {}
        #: Keys whose MLflow name differs from the key, with that name.
        self.renamed: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self._assign(key)
        return name

    def _assign(self, key: str) -> str:
        verl = verl_mlflow_key(key)
        if verl != key:
            _verl_log.warning(
                "[MLflow] Metric key '%s' sanitized to '%s' due to invalid characters.", key, verl
            )
        # The file store is a tree of files: only NameMap tells metrics from folders.
        name = verl if mlflow_accepts(verl) and not self.file_store else self._fallback(verl)
        if name != key:
            self.renamed[key] = name
        return name
