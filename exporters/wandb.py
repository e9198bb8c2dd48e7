"""Weights & Biases exporter.

Every row becomes one W&B history row logged *without* ``step=``; the training step travels
inside the row as ``global_step`` and each metric is bound to its x-axis with ``define_metric``:
training metrics to ``global_step``, metrics on another axis (``ray/ray_step`` for GPU data) to
that axis, and metrics under a prefix logged with ``step_metric`` to that metric. Why: W&B keeps
one monotonic internal step per run and silently drops any row whose ``step=`` is below it, and a
row logged without ``step=`` advances it. Mixing both (NeMo RL's GPU rows) drops training rows;
passing the training step as ``step=`` also loses every row after a step goes backwards (a
resume from an older checkpoint). With the step as data, W&B's internal ``_step`` is only a row
counter and nothing is ever dropped; a step that goes backwards is warned about and kept.

Runs are written under ``<log_dir>/wandb/`` unless ``wandb.dir`` says otherwise; the ``wandb``
config section is passed to ``wandb.init`` as it is (``project``, ``name``, ``entity``, ``group``,
``tags``, ``mode``, ``id``, ``resume``, ``settings``, ...).

A relaunched run (same ``run_id`` and ``log_dir``, ``otel_rl/run/history.py``) reopens the W&B
run of the launch before it (``id``, ``resume: allow``). Its first step may repeat steps the
earlier attempt logged; W&B's rewind (``resume_from``) needs its server and W&B's own row counter,
so the exporter does not rewind: with the step as data the new attempt's rows are kept as further
points at their ``global_step``, marked with ``otel_rl/attempt``, and the run's config records the
attempts (:meth:`WandbExporter.write_resume`). A rewind given by hand (``wandb.resume_from``) wins
over the relaunch's ``resume``, which W&B refuses beside it.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import Event, HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import SdkInit, TrackerConfig
from otel_rl.exporters.conversions import histogram_edges, png_to_image
from otel_rl.exporters.sdk_run import RESUME_STEPS_KEY, SdkRunExporter, attempts_config

#: The row key that carries the training step (the x-axis of every training metric).
STEP_KEY = "global_step"
#: The row key that carries a relaunched attempt's number in each of its training rows (rows
#: without it are the first attempt's), so that charts can tell the attempts apart.
ATTEMPT_KEY = "otel_rl/attempt"
#: W&B refuses histograms with more buckets than this.
_MAX_BINS = 512


class WandbExporter(SdkRunExporter):
    name: ClassVar[str] = "wandb"
    backwards_policy: ClassVar[str] = (
        f"the row is kept at {STEP_KEY}=<step> (W&B never sees a backwards step= from otel-rl)"
    )
    requires: ClassVar[tuple[str, ...]] = ("wandb",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="Weights & Biases",
        order=40,
        mapping=(
            "given to `wandb.init` (`project`, `name`, `entity`, `tags`, ...); checked against its "
            "parameters"
        ),
        sdk_init=SdkInit(
            package="wandb",
            init_files=("sdk/wandb_init.py",),
            declared=frozenset({
                "entity", "project", "dir", "id", "name", "notes", "tags", "config",
                "config_exclude_keys", "config_include_keys", "allow_val_change", "group",
                "job_type", "mode", "force", "reinit", "resume", "resume_from", "fork_from",
                "save_code", "tensorboard", "sync_tensorboard", "monitor_gym", "settings",
                "anonymous",
            }),
        ),
    )  # fmt: skip

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._wandb: Any = None
        self._axis_of: dict[str, str | None] = {}
        #: This launch's attempt once the run was relaunched (:meth:`write_resume`), else None.
        self._attempt: int | None = None
        super().__init__(init_kwargs, **kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> WandbExporter:
        init_kwargs = dict(cfg.tracker_section("wandb"))
        # wandb.init(dir=X) writes to X/wandb/, so runs land in <log_dir>/wandb/.
        init_kwargs.setdefault("dir", str(Path(cfg.log_dir)))
        return cls(init_kwargs, **kwargs)

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        import wandb

        self._wandb = wandb
        directory = self.init_kwargs.get("dir")
        if directory:
            # Absolute: W&B's service process outlives a run and resolves a relative dir against
            # its own working directory, the one of the process's first W&B run.
            self.init_kwargs["dir"] = str(Path(directory).absolute())
            Path(directory).mkdir(parents=True, exist_ok=True)
        if "mode" not in self.init_kwargs and os.environ.get("WANDB_MODE"):
            # W&B reads WANDB_MODE once per process, at its first run: a later run (a second
            # Logger, a replay in-process) follows the variable as it is now.
            self.init_kwargs["mode"] = os.environ["WANDB_MODE"]
        if self.init_kwargs.get("resume_from") or self.init_kwargs.get("fork_from"):
            # A rewind or fork given by hand names its own run moment; W&B refuses it beside
            # ``resume`` (which a relaunch adds to continue the run), and a fork needs a new id.
            self.init_kwargs.pop("resume", None)
            if self.init_kwargs.get("fork_from"):
                self.init_kwargs.pop("id", None)
        if not self.init_kwargs.get("id") and not self.init_kwargs.get("fork_from"):
            # Named before ``wandb.init`` (seconds long) and kept in the spool's metadata: a
            # launch killed while W&B starts its run is continued under that run's id, never
            # beside it under a second one.
            self.init_kwargs["id"] = _new_run_id()
            self.resume_config = {"wandb": {"id": self.init_kwargs["id"], "resume": "allow"}}
            self._remember_resume()
        self.run = wandb.init(**self.init_kwargs)
        # ``otel-rl replay`` reopens this very run rather than starting another one.
        self.resume_config = {"wandb": {"id": self.run.id, "resume": "allow"}}
        self._define(STEP_KEY, None)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        axis = batch.axis
        data: dict[str, Any] = {}
        for key, value in rows.items():
            converted = self._convert(key, value)
            if converted is not None:
                data[key] = converted
        if axis is None:
            if STEP_KEY in data and data[STEP_KEY] != step:
                self._warn_once(
                    "step-key",
                    "wandb: the logged key %r is replaced by the training step (%s is the x-axis "
                    "of every training metric)",
                    STEP_KEY,
                    STEP_KEY,
                )
            data[STEP_KEY] = step
            if self._attempt is not None:
                data[ATTEMPT_KEY] = self._attempt
            for key in data:
                if key not in self._axis_of:
                    self._define(key, _step_metric_for(key, batch.step_metrics))
        else:
            data.setdefault(axis, step)
            self._define(axis, None)
            for key in data:
                if key not in self._axis_of:
                    self._define(key, axis)
        self._log(data)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        self._write_media(name, step, lambda: self._wandb.Image(png_to_image(png)))

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        data = [list(r) for r in rows]
        self._write_media(name, step, lambda: self._wandb.Table(columns=list(columns), data=data))

    def write_page(self, name: str, step: int, html: str, png: bytes) -> None:
        # inject=False: the page is whole (its own styles and scripts), W&B's styles stay out.
        self._write_media(name, step, lambda: self._wandb.Html(html, inject=False))

    def write_event(self, event: Event) -> None:
        import html

        text = f"<b>{html.escape(event.title)}</b><pre>{html.escape(event.text)}</pre>"
        self._write_media(event.name, event.step, lambda: self._wandb.Html(text))
        levels = self._wandb.AlertLevel
        level = levels.WARN if event.level == "warning" else levels.INFO
        try:  # W&B's alerts reach Slack/e-mail on a live run; an offline run has none
            self.run.alert(title=event.title, text=event.text[:4000], level=level)
        except Exception as exc:
            self._warn_once("alert", "%s: W&B alert not sent (%s); the event is in the run as "
                            "the %r panel", self.name, exc, event.name)  # fmt: skip

    def write_resume(self, resume: Resume) -> None:
        """Record the attempt in the run's config: ``otel_rl.attempts`` (the latest attempt)
        and ``otel_rl.resume_steps`` (where each attempt after the first began; online, W&B
        hands a resumed run its config, so the steps of earlier relaunches are kept; an offline
        part knows only its own); and in each training row from here on (``otel_rl/attempt``).
        W&B keeps every row, since ``global_step`` is data (docs/backends/wandb.md, "A run that
        resumes")."""
        earlier = self.run.config.get(RESUME_STEPS_KEY)
        attempts = attempts_config(resume.attempt, resume.step, earlier)
        self.run.config.update(attempts, allow_val_change=True)
        # One more key per row (no cost measurable against W&B's ~0.6 ms per row of 100 keys,
        # on this thread): a chart of it against global_step shows where each attempt ran.
        self._attempt = resume.attempt

    def close(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    # ---- helpers -----------------------------------------------------------------------------

    def _write_media(self, name: str, step: int, make_media: Callable[[], Any]) -> None:
        _keep_media_folder()
        media = make_media()
        if name not in self._axis_of:
            self._define(name, STEP_KEY)
        self._log({name: media, STEP_KEY: step})

    def _log(self, data: dict[str, Any]) -> None:
        with self.refused_content():
            self.run.log(data)

    def _define(self, key: str, step_metric: str | None) -> None:
        if key in self._axis_of:
            return
        self._axis_of[key] = step_metric
        if "*" in key:  # define_metric reads '*' as a glob; such a key keeps W&B's default axis
            return
        if step_metric is None:
            self.run.define_metric(key)
        else:
            self.run.define_metric(key, step_metric=step_metric)

    def _convert(self, key: str, value: RowValue) -> Any:
        if isinstance(value, HistogramValue):
            layout = histogram_edges(value)
            if layout is None:
                return None
            counts, edges = layout
            if len(counts) > _MAX_BINS:
                self._warn_once(
                    f"bins:{key}",
                    "wandb: histogram %r has %d buckets (W&B allows %d); only its summary "
                    "scalars are logged",
                    key,
                    len(counts),
                    _MAX_BINS,
                )
                return None
            return self._wandb.Histogram(np_histogram=(counts, edges))
        return value


def _step_metric_for(key: str, step_metrics: Mapping[str, str]) -> str | None:
    """The x-axis of a training-axis key: the ``step_metric`` of its longest matching prefix,
    none for a step metric itself (it is an axis), else the training step."""
    if key in step_metrics.values():
        return None
    matches = [prefix for prefix in step_metrics if prefix and key.startswith(prefix + "/")]
    if matches:
        return step_metrics[max(matches, key=len)]
    return STEP_KEY


def _keep_media_folder() -> None:
    """Make W&B's media folder again if it is gone. W&B writes every image, table and HTML
    panel to one temporary folder it makes at import and removes at exit (an ``atexit``
    function), so a fork child that exits normally removes its parent's folder, as does a
    ``/tmp`` cleaner over a run of days; without it every media write after fails. One
    ``mkdir`` per media record, which is rare."""
    try:
        from wandb.sdk.data_types._private import MEDIA_TMP
    except ImportError:  # a W&B release that keeps it elsewhere: nothing to mend
        return
    os.makedirs(MEDIA_TMP.name, exist_ok=True)


def _new_run_id() -> str:
    """A run id as W&B makes them: eight lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def table_to_process_run(
    key: str, table: Callable[[], tuple[list[str], list[list[Any]]]], step: int
) -> bool:
    """The table ``table()`` makes (its columns and rows, made only when there is a run) under
    ``key`` into the W&B run this process started itself (``wandb.run``, not one of otel-rl's),
    without importing W&B; ``False`` when there is none."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return False
    columns, data = table()
    wandb.log({key: wandb.Table(columns=columns, data=data)}, step=step)
    return True
