"""SwanLab exporter.

The ``swanlab`` config section is passed to ``swanlab.init`` as it is (``project``, ``name``,
``mode``, ``workspace``, ``tags``, ``id``, ``resume``, ...). ``mode`` (or ``SWANLAB_MODE``) is one
of ``online`` (SwanLab's own default; needs ``swanlab login``), ``local``, ``offline`` or
``disabled``. Files go to ``SWANLAB_LOG_DIR`` when set, else ``<log_dir>/swanlab``.

SwanLab keeps a step per key, so rows on another x-axis (GPU data on ``ray/ray_step``) are logged
at their own axis value without touching the training step. It keeps the *first* value logged
for a (key, step) and silently discards later ones: the exporter keeps the steps each key was
sent at (as SwanLab does, in a compressed bitmap) and, rather than sending a value SwanLab would
discard, names it in a warning and counts it (``refused_repeats``). A value for a step its key
has no value at yet (a validation logged after its step was finished) is stored.

A relaunched run (same ``run_id`` and ``log_dir``, ``otel_rl/run/history.py``) reopens the
SwanLab run of the launch before it (``id``, ``resume: allow``): offline and local, each launch
writes its own ``run-<time>-<id>`` folder with the same id; online (and when such a folder is
synced) SwanLab refuses the values of steps that run already holds, keeping the earlier
attempt's. :meth:`SwanLabExporter.write_resume` says so, with the step, and records the attempts
in the run's config.

Strings become ``swanlab.Text``, plots ``swanlab.Image``; SwanLab has no histogram or table type,
so a histogram is logged as its ``/count, /sum, /mean, /min, /max`` scalars and tables are
skipped with one warning.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import Event, HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import SdkInit, TrackerConfig
from otel_rl.exporters.conversions import png_to_image
from otel_rl.exporters.sdk_run import RESUME_STEPS_KEY, SdkRunExporter, attempts_config
from otel_rl.process.fork_safe_log import log as _log


class SwanLabExporter(SdkRunExporter):
    name: ClassVar[str] = "swanlab"
    backwards_policy: ClassVar[str] = (
        "SwanLab keeps only the first value of a key at a step: values of keys already logged "
        "at that step are not sent and are named in a warning of their own (keys new at that "
        "step are kept)"
    )
    repeat_is_backwards: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("swanlab",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="SwanLab",
        order=60,
        mapping="given to `swanlab.init`; checked against its parameters",
        sdk_init=SdkInit(
            package="swanlab",
            init_files=("sdk/cmd/init.py", "data/sdk.py", "__init__.pyi"),
            declared=frozenset({
                "reinit", "log_dir", "mode", "workspace", "project", "public", "name", "color",
                "description", "job_type", "group", "tags", "id", "resume", "parallel", "config",
                "settings", "callbacks",
            }),
            # SwanLab maps these aliases itself (and drops any other extra keyword silently);
            # the exporter renames log_dir/logdir to what the installed version takes.
            also=frozenset({"experiment_name", "notes", "logdir", "log_dir"}),
        ),
    )  # fmt: skip

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._swanlab: Any = None
        #: Values not sent because SwanLab keeps the value their key already has at that step.
        self.refused_repeats: dict[str, int] = {}
        self._held = StepsHeld(self.refused_repeats)
        super().__init__(init_kwargs, **kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> SwanLabExporter:
        init_kwargs = dict(cfg.tracker_section("swanlab"))
        given = {"log_dir", "logdir"} & init_kwargs.keys()
        if not given and not os.environ.get("SWANLAB_LOG_DIR"):
            init_kwargs["log_dir"] = str(Path(cfg.log_dir) / "swanlab")
        return cls(init_kwargs, **kwargs)

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        import swanlab

        self._swanlab = swanlab
        self._held = StepsHeld(self.refused_repeats, follow=True)
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

    def write_resume(self, resume: Resume) -> None:
        """Record the attempt in the run's config (``otel_rl.attempts``,
        ``otel_rl.resume_steps``, as W&B's) and say what SwanLab keeps of the repeated steps."""
        earlier = self.run.config.get(RESUME_STEPS_KEY)
        self.run.config.update(attempts_config(resume.attempt, resume.step, earlier))
        self._warn_once(
            "resume",
            "%s: run resumed at step %d (attempt %d). SwanLab keeps the first value of a key at "
            "a step: online, and when this offline run is synced, the values this attempt logs "
            "at steps the earlier attempt already logged are refused by SwanLab, which keeps "
            "the earlier attempt's; the steps after those hold this attempt's values",
            self.name, resume.step, resume.attempt,
        )  # fmt: skip

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
        data, new = self._held.split(data, step)
        if new:
            _log.warning(
                "otel-rl: %s: %s at step %d not sent: SwanLab keeps the first value of a key at "
                "a step and would discard it, since the key has a value there already; further "
                "repeats of these keys are counted in the exporter's refused_repeats",
                self.name, ", ".join(repr(key) for key in new), step,
            )  # fmt: skip
        if not data:
            return
        with self.refused_content():
            self.run.log(data, step=step)
        self._held.add(data, step)  # after the SDK took them: a retried row is sent whole


class StepsHeld:
    """The steps each key has a value at in one SwanLab run. SwanLab keeps the first value of a
    key at a step and discards later ones without an error: :meth:`split` holds those back and
    counts them by key in ``counts`` (the caller's, which it names to users). Followed with
    ``pyroaring.BitMap64`` per key, SwanLab's own dependency since 0.7; without it (or before
    ``follow``), nothing is held back."""

    def __init__(self, counts: dict[str, int], follow: bool = False) -> None:
        self.counts = counts
        self._steps_of: dict[str, Any] | None = None
        if follow:
            try:
                from pyroaring import BitMap64
            except ImportError:
                return
            self._bitmap = BitMap64
            self._steps_of = {}

    def split(self, data: dict[str, Any], step: int) -> tuple[dict[str, Any], list[str]]:
        """``data`` without the keys that have a value at ``step`` already, and those of them
        never held back before (to be named once)."""
        steps_of = self._steps_of
        if steps_of is None or step < 0:  # SwanLab refuses a negative step itself
            return data, []
        repeated = [key for key in data if key in steps_of and step in steps_of[key]]
        if not repeated:
            return data, []
        new = [key for key in repeated if key not in self.counts]
        for key in repeated:
            self.counts[key] = self.counts.get(key, 0) + 1
        return {k: v for k, v in data.items() if k not in repeated}, new

    def add(self, keys: Iterable[str], step: int) -> None:
        """``keys`` have a value at ``step`` now (SwanLab took them)."""
        steps_of = self._steps_of
        if steps_of is None or step < 0:
            return
        for key in keys:
            held = steps_of.get(key)
            if held is None:
                held = steps_of[key] = self._bitmap()
            held.add(step)


def _summary(value: HistogramValue) -> dict[str, float]:
    return {
        "count": float(value.count),
        "sum": value.sum,
        "mean": value.mean,
        "min": value.min,
        "max": value.max,
    }


def text_to_process_run(key: str, text: str, step: int) -> bool:
    """Text under ``key`` into the SwanLab run this process started itself, without importing
    SwanLab; ``False`` when there is none."""
    import sys

    swanlab = sys.modules.get("swanlab")
    has_run = getattr(swanlab, "get_run", None) if swanlab is not None else None
    if swanlab is None or has_run is None or has_run() is None:
        return False
    swanlab.log({key: swanlab.Text(text)}, step=step)
    return True
