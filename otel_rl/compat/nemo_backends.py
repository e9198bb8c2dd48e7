"""NeMo RL's ``LoggerInterface`` and its per-backend classes: ``TensorboardLogger``,
``WandbLogger``, ``SwanlabLogger``, ``MLflowLogger``.

Used on their own, they write as NeMo RL's do: the same constructor arguments, the same methods,
the same SDK calls, on the caller's thread. Inside the drop-in ``Logger`` every call a
``LoggerInterface`` receives is made on that logger's own delivery thread instead
(:mod:`otel_rl.compat.nemo_channels`).

The SDKs (``wandb``, ``swanlab``, ``mlflow``, ``SummaryWriter``) are looked up with
:func:`~otel_rl.compat.nemo_sdks.sdk` at each use, as attributes of
:mod:`otel_rl.compat.nemo_rl` once it is imported, where they are imported on first access: code
that patches ``otel_rl.compat.nemo_rl.wandb`` (as NeMo RL's tests patch
``nemo_rl.utils.logger.wandb``) reaches these classes, and importing the drop-in stays light.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from otel_rl.compat.nemo_sdks import sdk
from otel_rl.compat.nemo_utils import flatten_dict
from otel_rl.process.fork_safe_log import log as _log

__all__ = [
    "LoggerInterface",
    "MLflowLogger",
    "SwanlabLogger",
    "TensorboardLogger",
    "WandbLogger",
    "merge_generation_logger_workers",
    "summarize_list",
]


class LoggerInterface(ABC):
    """A logging backend: what the drop-in ``Logger`` calls for every record.

    Subclass it for a tracker of your own and append an instance to ``logger.loggers``: it gets
    every ``log_metrics``/``log_hyperparams``/``log_histogram``/``log_plot`` call with the
    arguments NeMo RL's Logger passes, on a delivery thread of its own (a slow or raising one
    never holds up or breaks the training loop). A ``finish()`` method, if it has one, is called
    when the Logger finishes.
    """

    @abstractmethod
    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log a dictionary of metrics."""

    @abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log a dictionary of hyperparameters."""

    @abstractmethod
    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """Log the values of a histogram."""

    @abstractmethod
    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Log a matplotlib figure."""


def _prefixed(metrics: Mapping[str, Any], prefix: str | None, keep: str | None) -> dict[str, Any]:
    """``prefix/<key>`` for every key but ``keep`` (the step metric keeps its own name)."""
    if not prefix:
        return dict(metrics)
    return {(k if k == keep else f"{prefix}/{k}"): v for k, v in metrics.items()}


class TensorboardLogger(LoggerInterface):
    """TensorBoard through ``SummaryWriter(log_dir=log_dir)``: scalars, hyperparameters and
    figures; values that are not one number are skipped with a printed warning, histograms are
    not written (as in NeMo RL)."""

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        self.writer = sdk("SummaryWriter")(log_dir=log_dir)
        print(f"Initialized TensorboardLogger at {log_dir}")

    @staticmethod
    def _coerce_to_scalar(value: Any) -> int | float | bool | str | None:
        """``value`` as a Python scalar, or ``None`` when it is not one value."""
        if isinstance(value, (int, float, bool, str)):
            return value
        item = getattr(value, "item", None)
        if item is None or isinstance(value, (dict, list, tuple)):
            return None
        # numpy scalars and arrays, torch tensors: one element, whatever the shape
        count = value.numel() if callable(getattr(value, "numel", None)) else getattr(
            value, "size", None
        )
        if count != 1:
            return None
        result = item()
        return result if isinstance(result, (int, float, bool, str)) else None

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        for key, value in metrics.items():
            name = f"{prefix}/{key}" if prefix else key
            scalar = self._coerce_to_scalar(value)
            if scalar is None:
                print(
                    f"Warning: Skipping metric '{name}' for TensorBoard logging "
                    f"(unsupported type: {type(value).__name__})"
                )
                continue
            try:
                self.writer.add_scalar(name, scalar, step)
            except Exception as exc:  # one bad value must not lose the others
                print(f"Warning: Failed to log metric '{name}' to TensorBoard: {exc}")

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        return None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # add_hparams takes no nested values
        self.writer.add_hparams(flatten_dict(params), {})

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        self.writer.add_figure(name, figure, step)

    def finish(self) -> None:
        """Write what the SummaryWriter buffers and close its files."""
        self.writer.close()


class WandbLogger(LoggerInterface):
    """A W&B run from ``wandb.init(**cfg, dir=log_dir)`` (NeMo RL's own key
    ``log_nemo_gym_full_result_tables`` is not passed), with the git-tracked code and the git
    diffs saved as artifacts, as NeMo RL does."""

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        wandb = sdk("wandb")
        init_args = {k: v for k, v in cfg.items() if k != "log_nemo_gym_full_result_tables"}
        self.run = wandb.init(**init_args, dir=log_dir)
        #: W&B's step for the next ``log`` (``run.step``, followed here as W&B moves it, so
        #: that no call waits on W&B's service): a value logged below it never reaches W&B.
        self._next_step = 0
        with contextlib.suppress(Exception):  # a shared-mode run refuses to say its step
            self._next_step = _int_or_zero(self.run.step)
        #: Values W&B could not store because their step was already behind it, by key.
        self.late_values: dict[str, int] = {}
        if os.environ.get("RAY_BACKEND_LOG_LEVEL", "").lower() == "debug":
            print("Uploading raylet.out and raylet.err to W&B (RAY_BACKEND_LOG_LEVEL=debug)")
            wandb.save("/tmp/ray/session_latest/logs/raylet.out", policy="live")
            wandb.save("/tmp/ray/session_latest/logs/raylet.err", policy="live")
        self._log_code()
        self._log_diffs()
        print(
            f"Initialized WandbLogger for project {cfg.get('project')}, run {cfg.get('name')} "
            f"at {log_dir}"
        )

    def _log_code(self) -> None:
        """The files git tracks in the working directory, as a ``code`` artifact."""
        wandb = sdk("wandb")
        try:
            listed = _git("ls-files").strip().split("\n")
            files = [path for path in listed if path and os.path.isfile(path)]
            if not files:
                print("Warning: no git-tracked files; W&B will not keep the code of this run")
                return
            artifact = wandb.Artifact(name=f"source-code-{self.run.project}", type="code")
            for path in files:
                artifact.add_file(path, name=path)
            self.run.log_artifact(artifact)
            print(f"Logged {len(files)} git-tracked files to wandb")
        except Exception as exc:  # no git, no repository: the run goes on without its code
            print(f"Could not log the git-tracked code to wandb: {exc}")

    def _log_diffs(self) -> None:
        """Uncommitted changes, and the diff against ``main`` off that branch, as an artifact."""
        wandb = sdk("wandb")
        try:
            branch = _git("rev-parse", "--abbrev-ref", "HEAD").strip()
            artifact = wandb.Artifact(
                name=f"git-diffs-{self.run.project}-{self.run.id}", type="git-diffs"
            )
            folder = getattr(getattr(wandb, "run", None), "dir", None) or "."
            diffs = [("uncommitted_changes_diff.txt", _git("diff", "HEAD"))]
            if branch != "main":
                diffs.append(("main_diff.txt", _git("diff", "main")))
            for name, text in diffs:
                if text:
                    path = os.path.join(folder, name)
                    with open(path, "w", encoding="utf-8") as handle:
                        handle.write(text)
                    artifact.add_file(path, name=name)
            self.run.log_artifact(artifact)
        except Exception as exc:
            print(f"Could not log the git diffs to wandb: {exc}")

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        """Plot ``name`` (a key or a pattern such as ``ray/*``) against ``step_metric``."""
        self.run.define_metric(name, step_metric=step_metric)

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """With ``step_metric`` among the metrics, W&B's own step is left alone (the metrics
        carry their x value); ``step_finished`` commits the step."""
        metrics = _prefixed(metrics, prefix, step_metric)
        if step_metric and step_metric in metrics:
            self.run.log(metrics, commit=False)
        elif step_finished:
            self._log_at(metrics, step, commit=True)
        else:
            self._log_at(metrics, step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        self._log_at({name: figure}, step)

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """A ``wandb.Histogram``; values that are all equal (no finite bins) as one scalar."""
        wandb = sdk("wandb")
        try:
            self._log_at({name: wandb.Histogram(histogram)}, step)
        except ValueError:
            self._log_at({name: histogram[0] if len(histogram) > 0 else 0}, step)

    def _log_at(self, data: dict[str, Any], step: int, commit: bool | None = None) -> None:
        """``run.log(data, step=step)``, unless W&B is already past ``step``: W&B would then
        drop the values with no error (a validation logged at the step that
        ``step_finished=True`` committed, a step that goes backwards after a resume). Those
        are reported by name instead, and counted in :attr:`late_values`."""
        if step < self._next_step:
            self._report_late(data, step)
            return
        self.run.log(data, step=step, commit=commit)
        # As W&B itself moves its step (wandb_run.Run._log).
        self._next_step = max(self._next_step, step)
        if commit:
            self._next_step += 1

    def _report_late(self, data: Mapping[str, Any], step: int) -> None:
        new = [key for key in data if key not in self.late_values]
        for key in data:
            self.late_values[key] = self.late_values.get(key, 0) + 1
        if not new:
            return  # these keys were reported already; late_values counts them
        _log.warning(
            "otel-rl: WandbLogger: W&B cannot store %s at step %d: the run is already at step "
            "%d (a step is committed by step_finished=True or by logging a later step), and W&B "
            "drops values logged below its step without an error. Log them before the step is "
            "finished, or at a later step; further late values of these keys are counted in "
            "late_values",
            ", ".join(repr(key) for key in new), step, self._next_step,
        )  # fmt: skip

    def finish(self) -> None:
        """Finish the run (W&B drains its queue to the service)."""
        if self.run is not None:
            self.run.finish()
            self.run = None


class SwanlabLogger(LoggerInterface):
    """A SwanLab run from ``swanlab.init(**cfg, logdir=log_dir)``."""

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        from otel_rl.exporters.swanlab import StepsHeld

        self.run = sdk("swanlab").init(**cfg, logdir=log_dir)
        #: Values not sent because their key already has a value at that step, by key.
        self.late_values: dict[str, int] = {}
        self._held = StepsHeld(self.late_values, follow=True)
        print(
            f"Initialized SwanlabLogger for project {cfg.get('project')}, run {cfg.get('name')} "
            f"(with offline logdir={log_dir})"
        )

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        self._log_at(_prefixed(metrics, prefix, step_metric), step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        self._log_at({name: sdk("swanlab").Image(figure)}, step)

    def _log_at(self, data: dict[str, Any], step: int) -> None:
        """``run.log(data, step=step)`` without the values SwanLab would discard (their key has
        a value at ``step`` already): those are reported by name and counted in
        :attr:`late_values`."""
        data, new = self._held.split(data, step)
        if new:
            _log.warning(
                "otel-rl: SwanlabLogger: %s at step %d not logged: SwanLab keeps the first value "
                "of a key at a step and would discard it without an error; further repeats of "
                "these keys are counted in late_values",
                ", ".join(repr(key) for key in new), step,
            )  # fmt: skip
        if not data:
            return
        self.run.log(data, step=step)
        self._held.add(data, step)

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        return None

    def finish(self) -> None:
        """Finish the SwanLab run."""
        finish = getattr(self.run, "finish", None)
        if callable(finish):
            finish()


def merge_generation_logger_workers(metrics: dict[str, Any]) -> dict[str, Any]:
    """``generation_logger_metrics`` (``{metric: {worker: [values]}}``) as one list per metric;
    a shallow copy, the input is left as it is."""
    per_metric = metrics.get("generation_logger_metrics")
    if not isinstance(per_metric, dict):
        return metrics
    merged: dict[str, Any] = {}
    for metric, by_worker in per_metric.items():
        if isinstance(by_worker, dict):
            values: list[Any] = []
            for samples in by_worker.values():
                values.extend(samples if isinstance(samples, list) else [samples])
            merged[metric] = values
        else:
            merged[metric] = by_worker
    return {**metrics, "generation_logger_metrics": merged}


def summarize_list(values: list[Any]) -> dict[str, float]:
    """``mean``, ``p50``, ``p90``, ``max`` of the numbers in ``values`` (bools and other values
    left out); ``{}`` when there are none. Percentiles interpolate linearly, as numpy's do."""
    numbers = sorted(float(v) for v in values if _is_number(v))
    if not numbers:
        return {}
    return {
        "mean": math.fsum(numbers) / len(numbers),
        "p50": _percentile(numbers, 50),
        "p90": _percentile(numbers, 90),
        "max": numbers[-1],
    }


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    # numpy integer and floating scalars (not numpy's bool), without importing numpy
    dtype = getattr(value, "dtype", None)
    return (
        type(value).__module__ == "numpy"
        and getattr(value, "ndim", None) == 0
        and getattr(dtype, "kind", "") in ("i", "u", "f")
    )


def _percentile(ordered: list[float], q: float) -> float:
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class MLflowLogger(LoggerInterface):
    """An MLflow run: ``run_id`` (config or ``MLFLOW_RUN_ID``) resumes one; otherwise a new run
    in ``experiment_name`` (created with ``artifact_location``, else ``log_dir``, when it does
    not exist). Lists are logged as ``/mean``, ``/p50``, ``/p90``, ``/max``."""

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        mlflow = sdk("mlflow")
        tracking_uri = cfg.get("tracking_uri") or os.getenv("MLFLOW_TRACKING_URI")
        if tracking_uri and not mlflow.is_tracking_uri_set():
            mlflow.set_tracking_uri(tracking_uri)
        run_id = cfg.get("run_id") or os.getenv("MLFLOW_RUN_ID")
        experiment_name = cfg.get("experiment_name") or os.getenv("MLFLOW_EXPERIMENT_NAME")
        run_name = cfg.get("run_name") or os.getenv("MLFLOW_RUN_NAME")
        run = mlflow.active_run()
        if run_id:
            if run is not None and run.info.run_id != run_id:
                mlflow.end_run()
                run = None
            if run is None:
                run = mlflow.start_run(run_id=run_id)
        else:
            if run is not None:
                mlflow.end_run()
            if experiment_name is not None:
                if mlflow.get_experiment_by_name(experiment_name) is None:
                    mlflow.create_experiment(
                        name=experiment_name,
                        artifact_location=cfg.get("artifact_location") or log_dir,
                    )
                mlflow.set_experiment(experiment_name)
            run = mlflow.start_run(run_name=run_name)
        self.run = run
        self.run_id = run.info.run_id
        print(f"Initialized MLflowLogger for experiment {experiment_name}, run {run_name}")

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        rows: dict[str, Any] = {}
        flat = flatten_dict(merge_generation_logger_workers(metrics), sep="/", expand_lists=False)
        for key, value in flat.items():
            name = f"{prefix}/{key}" if prefix else key
            if isinstance(value, list):
                for suffix, stat in summarize_list(value).items():
                    rows[f"{name}/{suffix}"] = stat
            else:
                rows[name] = value
        if rows:
            sdk("mlflow").log_metrics(rows, step=step, run_id=self.run_id)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        sdk("mlflow").log_params(flatten_dict(params), run_id=self.run_id)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """``plots/<name>.png`` in the run's artifacts (each step replaces the last)."""
        sdk("mlflow").log_figure(
            figure, f"plots/{name}.png", save_kwargs={"bbox_inches": "tight"}
        )

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        return None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finalizer
            sdk("mlflow").end_run()


def _int_or_zero(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout
