"""SwanLab exporter.

The ``swanlab`` config section is passed to ``swanlab.init`` as it is (``project``, ``name``,
``mode``, ``workspace``, ``tags``, ``id``, ``resume``, ...). ``mode`` (or ``SWANLAB_MODE``) is one
of ``online`` (SwanLab's own default; needs ``swanlab login``), ``local``, ``offline`` or
``disabled``. Files go to ``SWANLAB_LOG_DIR`` when set, else ``<log_dir>/swanlab``.

SwanLab keeps a step per key, so rows on another x-axis (GPU data on ``ray/ray_step``) are logged
at their own axis value without touching the training step. It keeps the *first* value logged
for a (key, step) and silently discards later ones; a training step that goes backwards is
warned about here and still sent (keys that have no value at that step yet are stored).

Strings become ``swanlab.Text``, plots ``swanlab.Image``; SwanLab has no histogram or table type,
so a histogram is logged as its ``/count, /sum, /mean, /min, /max`` scalars and tables are
skipped with one warning.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import Event, HistogramValue, RowValue, StepBatch, TableRows
from otel_rl.exporters.conversions import png_to_image
from otel_rl.exporters.sdk_run import SdkRunExporter


class SwanLabExporter(SdkRunExporter):
    name: ClassVar[str] = "swanlab"
    backwards_policy: ClassVar[str] = (
        "SwanLab keeps only the first value of a key at a step, so values of keys already "
        "logged at that step are discarded by SwanLab (keys new at that step are kept)"
    )
    repeat_is_backwards: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("swanlab",)

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._swanlab: Any = None
        super().__init__(init_kwargs, **kwargs)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **kwargs: Any) -> SwanLabExporter:
        init_kwargs = dict(cfg["swanlab"])
        given = {"log_dir", "logdir"} & init_kwargs.keys()
        if not given and not os.environ.get("SWANLAB_LOG_DIR"):
            init_kwargs["log_dir"] = str(Path(cfg["log_dir"]) / "swanlab")
        return cls(init_kwargs, **kwargs)

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        import swanlab

        self._swanlab = swanlab
        kwargs = dict(self.init_kwargs)
        # SwanLab before 0.7 called the directory ``logdir``.
        accepted = inspect.signature(swanlab.init).parameters
        for ours, theirs in (("log_dir", "logdir"), ("logdir", "log_dir")):
            if ours in kwargs and ours not in accepted and theirs in accepted:
                kwargs[theirs] = kwargs.pop(ours)
        directory = kwargs.get("log_dir") or kwargs.get("logdir")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = swanlab.init(**kwargs)
        run_id = getattr(self.run, "id", None)
        if run_id and "id" in accepted and "resume" in accepted:
            # ``otel-rl replay`` reopens this very run rather than starting another one.
            self.resume_config = {"swanlab": {"id": str(run_id), "resume": "allow"}}

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        data: dict[str, Any] = {}
        for key, value in rows.items():
            if type(value) is float:
                data[key] = value
            elif isinstance(value, str):
                data[key] = self._swanlab.Text(value)
            elif isinstance(value, HistogramValue):
                # SwanLab has no histogram type: keep the summary (OTel histograms already
                # come with these keys; log_histogram values do not).
                for stat, number in _summary(value).items():
                    data.setdefault(f"{key}/{stat}", number)
        if batch.axis is not None:
            data.setdefault(batch.axis, float(step))
        if data:
            self._log(data, step)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params))

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        self._log({name: self._swanlab.Image(png_to_image(png))}, step)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        # SwanLab has no table type that its charts show: the table is logged as Markdown text.
        from otel_rl.exporters.tensorboard_summaries import markdown_table

        self._log({name: self._swanlab.Text(markdown_table(columns, rows))}, step)

    def write_event(self, event: Event) -> None:
        self._log({event.name: self._swanlab.Text(f"{event.title}\n\n{event.text}")}, event.step)

    def close(self, exit_code: int) -> None:
        if self.run is None:
            return
        if exit_code == 0:
            self.run.finish()
        else:
            self.run.finish(state="crashed", error=f"training exited with code {exit_code}")
        self.run = None

    # ---- helpers -----------------------------------------------------------------------------

    def _log(self, data: dict[str, Any], step: int) -> None:
        with self.refused_content():
            self.run.log(data, step=step)


def _summary(value: HistogramValue) -> dict[str, float]:
    return {
        "count": float(value.count),
        "sum": value.sum,
        "mean": value.mean,
        "min": value.min,
        "max": value.max,
    }
