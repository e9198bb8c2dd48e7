"""verl's per-backend logger classes used on their own: ``FileLogger`` and ``ClearMLLogger``.

Each has verl's constructor and its ``log(data, step)`` and ``finish()``; each writes through a core
:class:`otel_rl.Logger` of its own, so ``log`` only queues and the file or ClearML task is written
on the tracker's thread. ``Tracking`` does not use them (its ``file`` and ``clearml`` backends are
trackers of its own core Logger); they are for code that builds one directly.

Differences on purpose (docs/migrating.md): ``FileLogger`` appends to its file (verl truncates
it), and ``finish()`` also runs when the object is collected or the interpreter exits, so what
was logged is written; ``ClearMLLogger`` stores ``config`` as the task's ``General`` parameters
(verl: a configuration object named ``Hyperparameters``), and a key without ``/`` is both title
and series (verl raises ``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from otel_rl.compat.common import finish_when_collected
from otel_rl.compat.verl_config import core_config, file_logger_path

__all__ = ["ClearMLLogger", "FileLogger", "helper_core"]


def helper_core(cfg: dict[str, Any], exporters: list[Any] | None = None) -> Any:
    """A core Logger for a helper beside the application's own telemetry: it takes no global
    meters and leaves signal handling alone (interpreter exit still finishes it)."""
    from otel_rl.logger import Logger as CoreLogger

    cfg["capture_global_meters"] = False
    cfg["export"] = {"handle_signals": False}
    return CoreLogger(cfg, exporters=exporters or [])


class _OwnCore:
    """The shared part: a core Logger, ``log``, ``flush``, ``finish`` and the finalizer."""

    core: Any = None
    finished = True

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """One row at ``step`` (nested mappings flattened with ``/``), queued for the tracker."""
        self.core.log_metrics(data, step=int(step), step_finished=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was logged is written."""
        return bool(self.core.flush(timeout))

    def finish(self, exit_code: int | None = None) -> None:
        """Write what is queued and close the file or task (a second call does nothing)."""
        from otel_rl.compat.common import exit_code_now

        if self.finished:
            return
        self.finished = True
        self.core.finish(exit_code=exit_code_now() if exit_code is None else int(exit_code))

    def __del__(self) -> None:
        finish_when_collected(self)


class FileLogger(_OwnCore):
    """verl's ``FileLogger``: one JSON line ``{"step": N, "data": {...}}`` per ``log`` call, in
    ``VERL_FILE_LOGGER_PATH``, else ``<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl``.
    ``filepath`` is that path; the file is opened for appending."""

    def __init__(self, project_name: str, experiment_name: str) -> None:
        from otel_rl.compat.verl_exporters import VerlFileExporter

        self.project_name = project_name
        self.experiment_name = experiment_name
        self.filepath = file_logger_path(project_name, experiment_name)
        directory = os.path.dirname(self.filepath)
        if directory:
            os.makedirs(directory, exist_ok=True)
        print(f"Creating file logger at {os.path.abspath(self.filepath)}")  # verl's line
        self.exporter = VerlFileExporter(self.filepath)
        self.core = helper_core(core_config(project_name, experiment_name, []), [self.exporter])
        self.finished = False


class ClearMLLogger(_OwnCore):
    """verl's ``ClearMLLogger``: a ClearML task named ``experiment_name`` in ``project_name``
    (``continue_last_task=True, output_uri=False`` as in verl), ``config`` as its parameters.

    ``log(data, step)``: numbers go to ``report_scalar`` with the key split at its first ``/``
    into title and series, a ``pandas.DataFrame`` to ``report_table``, strings to the task's
    console log. The ClearML ``Task`` is :attr:`task` once the tracker's thread has opened it.
    """

    def __init__(
        self, project_name: str, experiment_name: str, config: Mapping[str, Any] | None
    ) -> None:
        from otel_rl.compat.common import plain_config

        self.project_name = project_name
        self.experiment_name = experiment_name
        cfg = core_config(project_name, experiment_name, ["clearml"])
        self.core = helper_core(cfg)
        self.finished = False
        if config:
            self.core.log_hyperparams(plain_config(config, "ClearMLLogger config"))

    @property
    def task(self) -> Any:
        """The ClearML ``Task`` (``None`` until the tracker's thread has opened it, or when the
        tracker runs in the delivery process)."""
        delivery = self.core.fanout.named("clearml")
        tracker = delivery.tracker if delivery is not None else None
        return tracker.task if tracker is not None else None

    def log(self, data: Mapping[str, Any], step: int) -> None:
        tables = {k: v for k, v in data.items() if _is_dataframe(v)}
        if tables:
            from otel_rl.compat.tracker_tables import cell, submit_table

            for key, frame in tables.items():
                rows = [[cell(v) for v in row] for row in frame.itertuples(index=False)]
                columns = [str(c) for c in frame.columns]
                submit_table(self.core.fanout, str(key), int(step), columns, rows)
            data = {k: v for k, v in data.items() if k not in tables}
            if not data:
                return
        super().log(data, step)


def _is_dataframe(value: Any) -> bool:
    kind = type(value)
    return kind.__name__ == "DataFrame" and kind.__module__.startswith("pandas")
