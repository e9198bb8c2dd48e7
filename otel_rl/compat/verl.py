"""A drop-in for ``verl.utils.tracking``: ``Tracking`` and ``ValidationGenerationsLogger``.

Change one import line::

    from verl.utils.tracking import Tracking, ValidationGenerationsLogger
    from otel_rl.compat.verl import Tracking, ValidationGenerationsLogger

Every backend of verl's ``Tracking.supported_backend`` (``wandb, mlflow, swanlab, vemlp_wandb,
tensorboard, console, clearml, trackio, file, rl_insight``), configured from verl's environment
variables, otel-rl's own options from ``config["otel_rl"]``
(:mod:`otel_rl.compat.verl_config`), every write on the trackers' own threads.
``ValidationGenerationsLogger`` writes through the live ``Tracking``, or on its own where none
lives (verl's async rollouter). Differences on purpose (docs/migrating.md): an unknown backend is
a :class:`~otel_rl.ConfigError` naming the supported ones, not an ``AssertionError``; the ``file``
backend appends; ``finish(exit_code)`` (or leaving a ``with`` block with an exception) marks a
crashed run failed in W&B, MLflow, SwanLab, ClearML and TensorBoard's HPARAMS; ``vemlp_wandb`` is
the W&B tracker with verl's settings for it (the platform's private SDK is not used) and
``rl_insight`` the Prometheus endpoint that RL-Insight's Prometheus scrapes. ``FileLogger`` and
``ClearMLLogger`` (:mod:`otel_rl.compat.verl_loggers`) and ``DapoFilteredRewardTableLogger`` are
verl's classes of the same names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_rl.compat.common import CoreOutputs, exit_code_now, finish_when_collected, plain_config
from otel_rl.compat.live import VERL_TRACKINGS
from otel_rl.compat.verl_config import (
    RL_INSIGHT,
    SUPPORTED_BACKENDS,
    TRACKER_OF,
    backend_names,
    core_config,
    file_logger_path,
    tracker_names,
    tracking_config,
)
from otel_rl.compat.verl_loggers import ClearMLLogger, FileLogger, helper_core
from otel_rl.compat.verl_timing import marked_timer, simple_timer
from otel_rl.process.fork_safe_log import log as _log

if TYPE_CHECKING:
    pass

__all__ = [
    "ClearMLLogger",
    "DapoFilteredRewardTableLogger",
    "FileLogger",
    "Tracking",
    "ValidationGenerationsLogger",
    "active_tracking",
    "marked_timer",
    "simple_timer",
]


#: The table (TensorBoard text tag, W&B key, MLflow artifact folder) validation samples go to.
GENERATIONS_KEY = "val/generations"
#: Columns of the generations table.
GENERATIONS_COLUMNS = ("input", "output", "score")
#: Backends a standalone ValidationGenerationsLogger writes with a tracker of its own.
OWN_TRACKER_BACKENDS = ("tensorboard", "mlflow")


def active_tracking() -> Tracking | None:
    """The most recently created :class:`Tracking` that is not finished, if any."""
    return VERL_TRACKINGS.latest()


class Tracking(CoreOutputs):
    """verl's ``Tracking``: ``log(data, step, backend=None)`` to every configured backend.

    ``config`` (a dict or OmegaConf container, interpolations resolved) is logged as
    hyperparameters: W&B config, MLflow params, TensorBoard HPARAMS, SwanLab/Trackio config.
    Its ``otel_rl`` mapping holds otel-rl's own options, with :class:`otel_rl.Logger`'s keys
    (``prometheus``, ``otlp``, ``rollout_monitoring``, ``tensorboard_enabled``...), over the
    ``OTEL_RL_CONFIG`` file and under what verl is told itself (the backends, the names and
    verl's environment variables; :func:`~otel_rl.compat.verl_config.tracking_config`).

    ``self.core`` is the :class:`otel_rl.Logger` underneath; ``timer``, ``prometheus_url``,
    ``otlp_endpoint``, ``rollout_monitor`` and ``gpu_monitor`` are its own.
    """

    supported_backend = list(SUPPORTED_BACKENDS)

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str] = "console",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        from otel_rl.compat.verl_exporters import (
            VerlConsoleExporter,
            VerlFileExporter,
            use_verl_mlflow_names,
        )
        from otel_rl.logger import Logger as CoreLogger

        self.project_name = str(project_name)
        self.experiment_name = str(experiment_name)
        self.backends = backend_names(default_backend)
        self.finished = False
        params = plain_config(config, "Tracking config") if config is not None else None
        cfg = tracking_config(self.project_name, self.experiment_name, self.backends, params)
        extra: list[Any] = []
        if "console" in self.backends:
            #: verl's ``LocalLogger`` of the console backend (only with ``console``, as there).
            self.console_logger = VerlConsoleExporter()
            extra.append(self.console_logger)
        if "file" in self.backends:
            path = file_logger_path(self.project_name, self.experiment_name)
            extra.append(VerlFileExporter(path))
        self.core = CoreLogger(cfg, exporters=extra)
        #: backend name → its tracker (verl: backend name → logger object; a tracker of the
        #: delivery process: its delivery's stand-in); ``vemlp_wandb`` is the W&B tracker.
        #: ``rl_insight`` has none: its values are served at :attr:`prometheus_url`.
        self.logger: dict[str, Any] = {
            e.name: e if e.tracker is None else e.tracker for e in self.core.exporters
        }
        for backend, tracker in TRACKER_OF.items():
            if backend in self.backends and tracker in self.logger:
                self.logger[backend] = self.logger[tracker]
        # Trackers switched on in config["otel_rl"] are backends like the ones verl named:
        # log(backend=...) and the validation generations reach them too.
        reached = {*self.backends, *tracker_names(self.backends)}
        added = [n for n in self.logger if n in SUPPORTED_BACKENDS and n not in reached]
        self.backends += added
        self._warned: set[str] = set()
        mlflow = self.core.fanout.named("mlflow")
        if mlflow is not None:
            # Where the tracker lives: here, or in the delivery process (export.delivery).
            mlflow.apply(use_verl_mlflow_names)
        if params:
            self.core.log_hyperparams(params)
        VERL_TRACKINGS.add(self)

    # ---- what the core Logger exposes --------------------------------------------------------

    @property
    def gpu_monitor(self) -> Any:
        """The Ray GPU/node monitor (``otel_rl.monitor_gpus``), else ``None``."""
        return self.core.gpu_monitor

    def log(
        self, data: Mapping[str, Any], step: int, backend: str | Iterable[str] | None = None
    ) -> None:
        """Log ``data`` at ``step`` to every backend, or only to those named in ``backend``.

        Each call is one row, sent at once (as verl writes each call): two calls with the same
        step give two rows at that step.
        """
        targets = self._targets(backend)
        if targets is None:
            self.core.log_metrics(data, step=step, step_finished=True)
            return
        self._log_to(targets, data, step)

    def finish(self, exit_code: int | None = None) -> None:
        """Drain every backend and close the run (``exit_code != 0``: failed/killed).

        Without ``exit_code``: failed when called while an exception propagates, else the
        process's exit status as far as known (0).
        """
        self.finished = True
        # Also for a second caller: the core's finish() waits for the one ending the run.
        self.core.finish(exit_code=exit_code_now() if exit_code is None else int(exit_code))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every backend has written what was logged."""
        return self.core.flush(timeout)

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from otel_rl.process.lifecycle import exit_code_of

        self.finish(exit_code=exit_code_of(exc_type, exc))

    def __del__(self) -> None:
        # verl finishes its backends when the Tracking is collected; so do we.
        finish_when_collected(self)

    def _targets(self, backend: str | Iterable[str] | None) -> set[str] | None:
        """``None`` for every backend, else the trackers of the enabled backends named in
        ``backend``."""
        if backend is None:
            return None
        wanted = set(backend_names(backend))
        if wanted >= set(self.backends):
            return None
        chosen = wanted & set(self.backends)
        if RL_INSIGHT in chosen and RL_INSIGHT not in self._warned:
            # The Prometheus endpoint serves the values logged to every backend: it has no
            # per-backend share of a row.
            self._warned.add(RL_INSIGHT)
            _log.warning(
                "otel-rl: log(backend=...) naming 'rl_insight' without every other backend: "
                "these values reach the trackers named, not the Prometheus endpoint that "
                "'rl_insight' serves (it takes the rows logged to every backend)"
            )
        return set(tracker_names(chosen - {RL_INSIGHT}))

    def _log_to(self, targets: set[str], data: Mapping[str, Any], step: int) -> None:
        from otel_rl.core.records import StepBatch
        from otel_rl.core.values import flatten_into

        def report(key: str, reason: str) -> None:
            _log.warning("otel-rl: metric %r: %s", key, reason)

        values: dict[str, Any] = {}
        flatten_into(values, data, "", report)
        self.core.fanout.send(StepBatch(step=int(step), values=values), to=targets)


@dataclasses.dataclass
class ValidationGenerationsLogger:
    """verl's ``ValidationGenerationsLogger``: ``(input, output, score)`` samples per tracker.

    ``log(loggers, samples, step)`` sends them to the backends named in ``loggers``, each in its
    own form under ``val/generations``: W&B (also ``vemlp_wandb``) a table with one row per
    validation step (``step, input_1, output_1, score_1, ...``, verl's layout, rows accumulating),
    MLflow a JSON artifact ``tables/val/generations/step_<N>.json``, TensorBoard verl's text in
    the TEXT tab (:func:`generations_text`), SwanLab a Markdown table as ``swanlab.Text``, Trackio a
    table, ClearML a table (``report_table``, title ``val``, series ``generations``) with verl's
    columns ``step, input, output, score``.

    They go through ``tracking``, else the live :class:`Tracking` (its enabled backends only).
    Where no Tracking lives (verl's async rollouter creates this logger on its own), it writes
    them itself, as verl does: TensorBoard to ``TENSORBOARD_DIR`` (default
    ``tensorboard_log/<project>/<experiment>``, or ``tensorboard_log`` without both names) and
    MLflow to ``MLFLOW_RUN_ID``'s run or a new run, each through a tracker of its own (its own
    thread, finished by :meth:`finish` or at exit); W&B, SwanLab and ClearML to the run (task) this
    process already has (a warning when there is none). ``console``, ``file`` and ``rl_insight``
    take no generations, as in verl.
    """

    project_name: str | None = None
    experiment_name: str | None = None
    tracking: Tracking | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._wide_columns: list[str] | None = None
        self._wide_rows: list[list[Any]] = []
        #: Standalone: backend name → the otel-rl Logger writing it.
        self._own: dict[str, Any] = {}
        self._warned: set[str] = set()

    def log(
        self, loggers: str | Iterable[str], samples: Sequence[Sequence[Any]], step: int
    ) -> None:
        from otel_rl.compat.tracker_tables import cell, submit_table

        # As in verl, its console, file and rl_insight backends never take generations.
        names = set(backend_names(loggers)) - {"console", "file", RL_INSIGHT}
        given = [tuple(sample) for sample in samples]
        rows = [tuple(cell(v) for v in _triple(sample)) for sample in given]
        tracking = self.tracking or active_tracking()
        if tracking is None:
            self._log_standalone(names, given, rows, int(step))
            return
        names &= set(tracking.backends)
        if "tensorboard" in names:
            _to_tensorboard(tracking.core.fanout, given, int(step))
        names.discard("tensorboard")
        trackers = set(tracker_names(sorted(names)))  # vemlp_wandb and wandb: one W&B run
        per_tracker: dict[str, tuple[Sequence[str], Sequence[Sequence[Any]]]] = {}
        if "wandb" in trackers:
            per_tracker["wandb"] = self._wide_table(rows, int(step))
        if "clearml" in trackers:
            per_tracker["clearml"] = clearml_generations(rows, int(step))
        submit_table(
            tracking.core.fanout,
            GENERATIONS_KEY,
            int(step),
            GENERATIONS_COLUMNS,
            rows,
            only=trackers,
            per_tracker=per_tracker,
        )

    def log_generations_to_wandb(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["wandb"], samples, step)

    def log_generations_to_swanlab(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["swanlab"], samples, step)

    def log_generations_to_mlflow(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["mlflow"], samples, step)

    def log_generations_to_tensorboard(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["tensorboard"], samples, step)

    def log_generations_to_clearml(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["clearml"], samples, step)

    def log_generations_to_vemlp_wandb(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["vemlp_wandb"], samples, step)

    def log_generations_to_trackio(self, samples: Sequence[Sequence[Any]], step: int) -> None:
        self.log(["trackio"], samples, step)

    def flush(self, timeout: float | None = None) -> bool:
        """Standalone: wait until this logger's own trackers have written what was logged."""
        return all([core.flush(timeout) for core in self._own.values()])

    def finish(self, exit_code: int | None = None) -> None:
        """Standalone: drain and close this logger's own trackers (also done at exit)."""
        own, self._own = self._own, {}
        code = exit_code_now() if exit_code is None else int(exit_code)
        for core in own.values():
            core.finish(exit_code=code)

    def __del__(self) -> None:
        # Like Tracking: what this logger's own trackers hold is written when it is collected.
        try:
            if getattr(self, "_own", None):
                from otel_rl.process.lifecycle import exit_code_hint

                self.finish(exit_code=exit_code_hint())
        except Exception:  # never raise from a finalizer
            pass

    # ---- standalone ------------------------------------------------------------------------

    def _log_standalone(
        self,
        names: set[str],
        samples: list[tuple[Any, ...]],
        rows: list[tuple[Any, ...]],
        step: int,
    ) -> None:
        from otel_rl.compat.tracker_tables import submit_table

        for name in sorted(names):
            if name == "tensorboard":
                core = self._own.get(name) or self._own_tracker(name)
                _to_tensorboard(core.fanout, samples, step)
            elif name in OWN_TRACKER_BACKENDS:
                core = self._own.get(name) or self._own_tracker(name)
                submit_table(core.fanout, GENERATIONS_KEY, step, GENERATIONS_COLUMNS, rows)
            elif name in ("wandb", "vemlp_wandb"):
                self._to_process_wandb_run(rows, step)
            elif name == "swanlab":
                self._to_process_swanlab_run(rows, step)
            elif name == "clearml":
                self._to_process_clearml_task(rows, step)
            elif name == "trackio":
                self._warn_once(
                    "trackio",
                    "otel-rl: validation generations not logged to trackio: no live Tracking in "
                    "this process (create a Tracking with the trackio backend)",
                )

    def _own_tracker(self, name: str) -> Any:
        cfg = core_config(self.project_name or "", self.experiment_name or "", [name])
        if name == "tensorboard" and not (self.project_name and self.experiment_name):
            cfg["tensorboard"]["log_dir"] = os.environ.get("TENSORBOARD_DIR") or "tensorboard_log"
        core = self._own[name] = helper_core(cfg)
        return core

    def _to_process_clearml_task(self, rows: list[tuple[Any, ...]], step: int) -> None:
        from otel_rl.exporters.clearml import table_to_process_task

        columns, body = clearml_generations(rows, step)
        table = [list(columns), *[list(row) for row in body]]
        if not table_to_process_task(GENERATIONS_KEY, table, step):
            self._warn_once(
                "clearml",
                "otel-rl: validation generations at step %s not logged to clearml: no live "
                "Tracking and no ClearML task in this process (call Task.init() or create a "
                "Tracking)",
                step,
            )

    def _to_process_wandb_run(self, rows: list[tuple[Any, ...]], step: int) -> None:
        from otel_rl.exporters.wandb import table_to_process_run

        if not table_to_process_run(GENERATIONS_KEY, lambda: self._wide_table(rows, step), step):
            self._warn_once(
                "wandb",
                "otel-rl: validation generations at step %s not logged to wandb: no live "
                "Tracking and no W&B run in this process (call wandb.init() or create a "
                "Tracking)",
                step,
            )

    def _to_process_swanlab_run(self, rows: list[tuple[Any, ...]], step: int) -> None:
        from otel_rl.exporters.swanlab import text_to_process_run
        from otel_rl.exporters.tensorboard_summaries import markdown_table

        if not text_to_process_run(GENERATIONS_KEY, markdown_table(GENERATIONS_COLUMNS, rows),
                                   step):  # fmt: skip
            self._warn_once(
                "swanlab",
                "otel-rl: validation generations at step %s not logged to swanlab: no live "
                "Tracking and no SwanLab run in this process (call swanlab.init() or create a "
                "Tracking)",
                step,
            )

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _log.warning(message, *args)

    def _wide_table(
        self, rows: list[tuple[Any, ...]], step: int
    ) -> tuple[list[str], list[list[Any]]]:
        """verl's W&B layout: one row per step holding every sample; all rows so far."""
        if self._wide_columns is None:
            self._wide_columns = ["step"] + [
                f"{part}_{i + 1}" for i in range(len(rows)) for part in GENERATIONS_COLUMNS
            ]
        width = len(self._wide_columns) - 1
        flat = [value for row in rows for value in row][:width]
        flat += [""] * (width - len(flat))  # a step with fewer samples keeps the table's shape
        self._wide_rows.append([step, *flat])
        return self._wide_columns, [list(r) for r in self._wide_rows]


#: The W&B table of DAPO-filtered reward counts (verl's key).
FILTERED_REWARDS_KEY = "training/filter_groups/filtered_reward_counts"


@dataclasses.dataclass
class DapoFilteredRewardTableLogger:
    """verl's W&B table of the groups DAPO filtered out (no signal), counted per reward value.

    ``log(loggers, reward_counts, step)`` adds one row ``step, reward_counts`` (``"0:3, 1:2"``,
    rewards in order) and logs the table with every row so far under
    ``training/filter_groups/filtered_reward_counts``, when ``loggers`` names ``wandb``; other
    trackers are skipped, as in verl. It goes through ``tracking``, else the live
    :class:`Tracking`; with neither, or no W&B tracker there, one warning says it was not logged.
    """

    project_name: str | None = None
    experiment_name: str | None = None
    tracking: Tracking | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rows: list[tuple[int, str]] = []
        self._warned = False

    def log(
        self, loggers: str | Iterable[str], reward_counts: Mapping[Any, Any], step: int
    ) -> None:
        from otel_rl.compat.tracker_tables import submit_table

        if "wandb" not in backend_names(loggers):
            return
        tracking = self.tracking or active_tracking()
        if tracking is None or "wandb" not in tracking.logger:
            if not self._warned:
                self._warned = True
                _log.warning(
                    "otel-rl: DAPO filtered-reward table at step %s not logged: no live Tracking "
                    "with the wandb backend in this process",
                    step,
                )
            return
        row = {float(value): int(count) for value, count in reward_counts.items()}
        text = ", ".join(f"{value:g}:{row[value]}" for value in sorted(row))
        self._rows.append((int(step), text))
        columns = ("step", "reward_counts")
        submit_table(tracking.core.fanout, FILTERED_REWARDS_KEY, int(step), columns,
                     list(self._rows), only=("wandb",))  # fmt: skip


def clearml_generations(
    rows: Sequence[tuple[Any, ...]], step: int
) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """verl's ClearML table of the generations: columns ``step, input, output, score``."""
    return ("step", *GENERATIONS_COLUMNS), [(step, *row) for row in rows]


def _triple(sample: Sequence[Any]) -> tuple[Any, Any, Any]:
    values = list(sample)[:3]
    values += [""] * (3 - len(values))
    return values[0], values[1], values[2]


#: Longest cell of the summary table above the samples (each sample follows in full).
SUMMARY_CELL = 80


def generations_text(samples: Sequence[Sequence[Any]], step: int) -> str:
    """The generations at ``step`` as verl writes them to TensorBoard's TEXT tab.

    verl's layout: the heading ``**Generation Results - Step N**``, then per sample a section
    ``### Sample i`` with ``**Input:**``, ``**Output:**`` and ``**Score:**`` paragraphs (a
    sample of fewer than three values: ``**Data:**`` and the sample), closed by ``---``. Added
    between the heading and the sections: a Markdown table with one line per sample (text cut
    at :data:`SUMMARY_CELL` characters), to compare the scores without scrolling.
    """
    from otel_rl.compat.tracker_tables import cell
    from otel_rl.exporters.tensorboard_summaries import markdown_table

    summary = [tuple(_cut(cell(v)) for v in _triple(sample)) for sample in samples]
    parts = [f"**Generation Results - Step {step}**\n\n"]
    if samples:
        parts.append(markdown_table(GENERATIONS_COLUMNS, summary) + "\n\n")
    for i, sample in enumerate(samples, start=1):
        parts.append(f"### Sample {i}\n")
        if len(sample) >= 3:
            parts.append(f"**Input:** {sample[0]}\n\n")
            parts.append(f"**Output:** {sample[1]}\n\n")
            parts.append(f"**Score:** {sample[2]}\n\n")
        else:
            parts.append(f"**Data:** {sample}\n\n")
        parts.append("---\n\n")
    return "".join(parts)


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > SUMMARY_CELL:
        return value[: SUMMARY_CELL - 1] + "…"
    return value


def _to_tensorboard(fanout: Any, samples: Sequence[Sequence[Any]], step: int) -> None:
    """verl's text at ``step`` under ``val/generations`` (TensorBoard's text plugin)."""
    from otel_rl.core.records import StepBatch

    text = generations_text(samples, step)
    fanout.send(StepBatch(step=int(step), values={GENERATIONS_KEY: text}), to=("tensorboard",))
