"""ClearML exporter.

The ``clearml`` config section is passed to ``clearml.Task.init`` as it is (``project_name``,
``task_name``, ``tags``, ``task_type``, ``continue_last_task``, ``output_uri``, ...), with
``offline: true`` on top for ClearML's offline mode (``Task.set_offline(True)``; the
``CLEARML_OFFLINE_MODE=1`` variable does the same). ``project_name`` defaults to ``experiment`` or
``otel-rl``, ``task_name`` to the run id. ClearML's automatic hooks default to off:
``auto_connect_frameworks`` (its TensorBoard, matplotlib and torch hooks would report otel-rl's
values a second time), ``auto_connect_streams``, ``auto_connect_arg_parser`` and
``auto_resource_monitoring`` (otel-rl's GPU monitoring covers it); set them in the section to
turn them on.

Scalars go to the task's logger as ``report_scalar(title, series, value, iteration=step)``, the key
split at its first ``/`` as verl's ``ClearMLLogger`` splits it (``actor/pg_loss`` → title
``actor``, series ``pg_loss``); a key without ``/`` is both title and series. ClearML would store a
NaN or infinity as ``0.0``: such a value is left out, with one warning per key. Strings, events
and tables go where ClearML keeps them: a string is a line of the task's console log
(``report_text``: ``[step N] key: value``), a table ``report_table`` at its step, a plot a debug
image, a histogram ``report_histogram`` from its buckets. Hyperparameters are the task's
``General`` parameter section (``Task.update_parameters``, keys flattened with ``.``).

ClearML keeps every point, also a repeated or earlier iteration. Rows on another x-axis (GPU data
on ``ray/ray_step``) are reported at their axis value as the iteration. ClearML reports from a
process it forks on Linux by default; the exporter runs its reporting on threads instead
(``Task._report_subprocess_enabled``), since a fork from a tracker thread of a multi-threaded
training process is unsafe.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import Failure
from otel_rl.core.records import Event, HistogramValue, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import SdkInit, TrackerConfig
from otel_rl.exporters.conversions import histogram_edges, png_to_image
from otel_rl.exporters.sdk_run import SdkRunExporter

#: The parameter section hyperparameters go to (ClearML's own default section name).
PARAMETER_SECTION = "General"
#: ``Task.init`` hooks that are off unless the ``clearml`` section turns them on.
QUIET_HOOKS = {
    # As a dict, not False: False leaves the repository analysis on, which reads the script's
    # git tree and packages in the background (~150 s for a console-script entry point) and
    # holds the task's close past the run's deadline.
    "auto_connect_frameworks": {
        name: False
        for name in (
            "catboost", "fastai", "gradio", "hydra", "joblib", "lightgbm", "matplotlib",
            "megengine", "pytorch", "scikit", "tensorboard", "tensorflow", "tfdefines", "xgboost",
            "detect_repository",
        )
    },
    "auto_connect_streams": False,
    "auto_connect_arg_parser": False,
    "auto_resource_monitoring": False,
}


def title_series(key: str) -> tuple[str, str]:
    """ClearML's ``(title, series)`` of a row key: split at the first ``/`` (verl's split);
    a key without ``/`` (or with nothing on one side of it) is both."""
    title, sep, series = key.partition("/")
    if not (sep and title and series):
        return key, key
    return title, series


class ClearMLExporter(SdkRunExporter):
    name: ClassVar[str] = "clearml"
    backwards_policy: ClassVar[str] = "ClearML keeps both points at that iteration"
    requires: ClassVar[tuple[str, ...]] = ("clearml",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="ClearML",
        order=80,
        mapping=(
            "given to `clearml.Task.init` (`project_name`, `task_name`, `tags`, ...), plus "
            "`offline` ([backends/clearml.md](backends/clearml.md)); checked against its parameters"
        ),
        sdk_init=SdkInit(
            package="clearml",
            init_files=("task.py",),
            init_class="Task",
            declared=frozenset({
                "project_name", "task_name", "task_type", "tags", "reuse_last_task_id",
                "continue_last_task", "output_uri", "auto_connect_arg_parser",
                "auto_connect_frameworks", "auto_resource_monitoring", "auto_connect_streams",
                "deferred_init",
            }),
            # The exporter's own switch for ClearML's offline mode (Task.set_offline).
            also=frozenset({"offline"}),
        ),
    )  # fmt: skip

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        given = dict(init_kwargs or {})
        #: ClearML's offline mode (``clearml.offline``), else ``CLEARML_OFFLINE_MODE``.
        offline = given.pop("offline", False)
        if not isinstance(offline, bool):  # "false" would turn it on
            raise ConfigError(
                f"clearml.offline must be true or false, got {offline!r} (write it without "
                "quotes)"
            )
        self.offline = offline
        self._logger: Any = None
        super().__init__({"project_name": "otel-rl", **QUIET_HOOKS, **given}, **kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> ClearMLExporter:
        init_kwargs = dict(cfg.tracker_section("clearml"))
        init_kwargs.setdefault("project_name", cfg.experiment or "otel-rl")
        if cfg.run_id:
            init_kwargs.setdefault("task_name", cfg.run_id)
        return cls(init_kwargs, **kwargs)

    @property
    def task(self) -> Any:
        """The ClearML ``Task`` once the tracker is open (``run`` is the same object)."""
        return self.run

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        from clearml import Task

        if hasattr(Task, "_report_subprocess_enabled"):
            # Report from threads: ClearML's default on Linux forks a reporting process, and a
            # fork from this thread of a multi-threaded training process is unsafe.
            setattr(Task, "_report_subprocess_enabled", False)  # noqa: B010
        if self.offline or _offline_by_environment():
            # ClearML reads CLEARML_OFFLINE_MODE once, when it is imported: a run started after
            # that (a second Logger, a test) follows the variable as it is now.
            Task.set_offline(True)
        self.run = Task.init(**self.init_kwargs)
        self._logger = self.run.get_logger()
        if not Task.is_offline():
            # ``otel-rl replay`` continues this very task rather than starting another one.
            self.resume_config = {"clearml": {"continue_last_task": str(self.run.id)}}

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        logger = self._logger
        with self.refused_content():
            for key, value in rows.items():
                if type(value) is float:
                    if math.isfinite(value):
                        title, series = title_series(key)
                        logger.report_scalar(title, series, value, step)
                    else:
                        self._left_out(key, value)
                elif isinstance(value, str):
                    logger.report_text(f"[step {step}] {key}: {value}", print_console=False)
                elif isinstance(value, HistogramValue):
                    self._histogram(key, step, value)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        with self.refused_content():
            self.run.update_parameters(
                {f"{PARAMETER_SECTION}/{key}": _parameter(value) for key, value in params.items()}
            )

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        title, series = title_series(name)
        with self.refused_content():
            image = _opaque(png_to_image(png))
            self._logger.report_image(title, series, iteration=step, image=image)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        title, series = title_series(name)
        table = [list(columns), *[list(row) for row in rows]]
        with self.refused_content():
            self._logger.report_table(title, series, iteration=step, table_plot=table)

    def write_event(self, event: Event) -> None:
        level = logging.WARNING if event.level == "warning" else logging.INFO
        self._logger.report_text(
            f"[step {event.step}] {event.title}\n{event.text}", level=level, print_console=False
        )

    def flush_backend(self) -> None:
        if self.run is not None:
            self.run.flush(wait_for_uploads=True)

    def close(self, exit_code: int) -> None:
        if self.run is None:
            return
        task, self.run, self._logger = self.run, None, None
        task.flush(wait_for_uploads=True)
        if exit_code != 0:
            task.mark_failed(
                ignore_errors=True, status_reason=f"training exited with code {exit_code}"
            )
        task.close()

    def classify_error(self, exc: BaseException, phase: str) -> Failure:
        if type(exc).__name__ == "UsageError" and "already created" in str(exc):
            return Failure(
                "permanent", exc, "ClearML keeps one task per process: finish the other ClearML "
                "run of this process first, or give both the same task_name",
            )  # fmt: skip
        return super().classify_error(exc, phase)

    # ---- helpers -----------------------------------------------------------------------------

    def _histogram(self, key: str, step: int, value: HistogramValue) -> None:
        layout = histogram_edges(value)
        if layout is None:
            return
        counts, edges = layout
        labels = [f"{lo:.6g}..{hi:.6g}" for lo, hi in itertools.pairwise(edges)]
        title, series = title_series(key)
        self._logger.report_histogram(title, series, values=counts, iteration=step, xlabels=labels)

    def _left_out(self, key: str, value: float) -> None:
        self._warn_once(
            f"non-finite:{key}",
            "clearml: %r is %s; ClearML would store it as 0.0, so non-finite values of this key "
            "are left out (the other trackers keep them)",
            key,
            value,
        )


def _offline_by_environment() -> bool:
    return os.environ.get("CLEARML_OFFLINE_MODE", "").strip().lower() in ("1", "true", "yes", "on")


def _opaque(image: Any) -> Any:
    """``image`` without transparency, on white: ClearML stores debug images as JPEG, and its
    upload thread drops an RGBA image (matplotlib's PNGs are RGBA) with only a log line."""
    if image.mode in ("RGB", "L"):
        return image
    from PIL import Image

    rgba = image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, (255, 255, 255))
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


def _parameter(value: Any) -> Any:
    """A parameter value ClearML stores as it is: numbers, strings, booleans and None stay;
    anything else (a list, an object) becomes its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)



def table_to_process_task(key: str, table: list[list[Any]], step: int) -> bool:
    """A table (its header row first) under ``key`` into the ClearML task this process started
    itself (``Task.current_task()``), without importing ClearML; ``False`` when there is none."""
    import sys

    clearml = sys.modules.get("clearml")
    task = clearml.Task.current_task() if clearml is not None else None
    if task is None:
        return False
    title, series = title_series(key)
    task.get_logger().report_table(title, series, iteration=step, table_plot=table)
    return True
