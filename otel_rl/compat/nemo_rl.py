"""A drop-in for ``nemo_rl.utils.logger`` (and ``nemo_rl.utils.timer``), built on otel-rl.

Change one import line::

    from nemo_rl.utils.logger import Logger, LoggerConfig, print_message_log_samples
    from otel_rl.compat.nemo_rl import Logger, LoggerConfig, print_message_log_samples

Same names, signatures and output names (``train/loss``, ``timing/train/total_step_time``,
``ray/node.0.gpu.0.mem_gb``, TensorBoard under ``<log_dir>/tensorboard``), with every write off the
training thread. A config produces exactly the backends it enables (``Logger.loggers`` is empty
when all are off; otel-rl's JSONL tracker only with ``jsonl_enabled: true``). With an MLflow
tracking URI and no ``artifact_location``, a new experiment keeps its artifacts in
``<log_dir>/mlflow``, as in NeMo RL. What differs on purpose (docs/migrating.md):
``tensorboard.log_dir`` is honoured;
``get_next_experiment_dir`` looks only at ``exp_<N>`` children and is safe between concurrent
jobs; MLflow keeps one plot file per step; a run that crashes is marked failed, not finished;
lists are logged as summary statistics, never one key per index; ``log_batched_dict_as_jsonl``
returns after a snapshot and writes in the background (``flush()``/``finish()`` wait for it);
a relaunch of the same config continues the run (named by the config's run names) in the
``exp_<N>`` folder that holds it, as NeMo RL continues training from its checkpoint.

The rest of NeMo RL's module is here as well: ``LoggerInterface`` and the per-backend classes
(:mod:`otel_rl.compat.nemo_backends`), ``GpuMetricSnapshot`` and ``RayGpuMonitorLogger``
(:mod:`otel_rl.compat.nemo_gpu_monitor`). A ``LoggerInterface`` in ``Logger.loggers`` that is not
one of otel-rl's trackers (a team's own, appended to the list, or a class put in place of
``WandbLogger`` & co.) receives every call NeMo RL's Logger would make on it, on a delivery
thread of its own (:mod:`otel_rl.compat.nemo_channels`). The SDKs NeMo RL's module imports
(``wandb``, ``swanlab``, ``mlflow``, ``ray``, ``requests``, ``plt``, ``SummaryWriter``) are
attributes of this module, imported on first access.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from otel_rl.process.deadline import (
    SHUTDOWN_GRACE,
    Deadline,
    Stopping,
    start_stopping,
    still_stopping,
)
from otel_rl.process.fork_safe_log import log as _log

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:
    from typing_extensions import NotRequired

from otel_rl.compat.common import CoreOutputs, exit_code_now, plain_config
from otel_rl.compat.live import NEMO_RL_LOGGERS
from otel_rl.compat.message_samples import (
    SAMPLE_COLUMNS,
    print_message_log_samples,
    rewards_as_floats,
)
from otel_rl.compat.nemo_backends import (
    LoggerInterface,
    MLflowLogger,
    SwanlabLogger,
    TensorboardLogger,
    WandbLogger,
    merge_generation_logger_workers,
    summarize_list,
)
from otel_rl.compat.nemo_gpu_monitor import GpuMetricSnapshot, RayGpuMonitorLogger
from otel_rl.compat.nemo_sdks import LAZY_SDKS, hold_sdks_on, imported_sdk
from otel_rl.compat.nemo_timer import ThreadSafeTimer, TimeoutChecker, Timer, convert_to_seconds
from otel_rl.compat.nemo_utils import (
    configure_rich_logging,
    flatten_dict,
    get_next_experiment_dir,
    log_container_init_timing,
)
from otel_rl.core.paths import path_inside
from otel_rl.delivery.fanout import Delivery
from otel_rl.delivery.tracker import Tracker

if TYPE_CHECKING:
    from otel_rl.compat.nemo_channels import InterfaceExporter

__all__ = [
    "GPUMonitoringConfig",
    "GpuMetricSnapshot",
    "Logger",
    "LoggerConfig",
    "LoggerInterface",
    "MLflowConfig",
    "MLflowLogger",
    "RayGpuMonitorLogger",
    "SwanlabConfig",
    "SwanlabLogger",
    "TensorboardConfig",
    "TensorboardLogger",
    "ThreadSafeTimer",
    "TimeoutChecker",
    "Timer",
    "WandbConfig",
    "WandbLogger",
    "active_logger",
    "configure_rich_logging",
    "convert_to_seconds",
    "flatten_dict",
    "get_next_experiment_dir",
    "log_container_init_timing",
    "print_message_log_samples",
    "should_log_nemo_gym_full_result_tables",
]

#: NeMo RL's private helpers, under their names there.
_merge_generation_logger_workers = merge_generation_logger_workers
_summarize_list = summarize_list

# threading and time are attributes here as in NeMo RL's module, where code patches them
# (``<module>.threading.Thread``, ``<module>.time``): the GPU monitor reads its clock here.
_THREADING, _TIME = threading, time


def __getattr__(name: str) -> Any:
    """The SDKs NeMo RL's module imports at its top, imported here on first access (``import
    otel_rl.compat.nemo_rl`` stays light): ``nemo_sdks.LAZY_SDKS``."""
    if name not in LAZY_SDKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = imported_sdk(name)
    globals()[name] = value
    return value


# The backend classes and the GPU monitor look their SDKs up here from now on, so that patching
# them here reaches those classes, which never import this module.
hold_sdks_on(sys.modules[__name__])


#: The per-backend classes by config key, in the order NeMo RL's Logger builds them.
_BACKEND_CLASSES = (
    ("wandb", "WandbLogger"),
    ("swanlab", "SwanlabLogger"),
    ("tensorboard", "TensorboardLogger"),
    ("mlflow", "MLflowLogger"),
)
#: otel-rl's own classes under those names (a different object there is someone else's).
_OWN_CLASSES: dict[str, Any] = {
    "WandbLogger": WandbLogger,
    "SwanlabLogger": SwanlabLogger,
    "TensorboardLogger": TensorboardLogger,
    "MLflowLogger": MLflowLogger,
    "RayGpuMonitorLogger": RayGpuMonitorLogger,
}
#: NeMo RL's GPU rows: ``ray/node.<i>...`` on W&B's ``ray/ray_step`` axis.
_GPU_PREFIX = "ray"
_GPU_STEP_METRIC = "ray/ray_step"



# ---- configuration (NeMo RL's TypedDicts; otel-rl's extra keys are accepted too) -------------


class WandbConfig(TypedDict):
    project: NotRequired[str]
    name: NotRequired[str]
    entity: NotRequired[str]
    #: NeMo RL's switch for NeMo Gym result tables; not passed to ``wandb.init``.
    log_nemo_gym_full_result_tables: NotRequired[bool]


class SwanlabConfig(TypedDict):
    project: NotRequired[str]
    name: NotRequired[str]


class TensorboardConfig(TypedDict):
    log_dir: NotRequired[str]


class MLflowConfig(TypedDict):
    experiment_name: NotRequired[str | None]
    run_id: NotRequired[str | None]
    run_name: NotRequired[str | None]
    tracking_uri: NotRequired[str | None]
    artifact_location: NotRequired[str | None]


class GPUMonitoringConfig(TypedDict):
    collection_interval: int | float
    flush_interval: int | float
    #: otel-rl: static ``http://host:port/metrics`` URLs instead of ``ray.nodes()`` discovery.
    endpoints: NotRequired[list[str]]
    timeout: NotRequired[float]


class LoggerConfig(TypedDict):
    log_dir: str
    wandb_enabled: bool
    swanlab_enabled: bool
    tensorboard_enabled: bool
    mlflow_enabled: bool
    wandb: WandbConfig
    tensorboard: NotRequired[TensorboardConfig]
    swanlab: NotRequired[SwanlabConfig]
    mlflow: NotRequired[MLflowConfig]
    monitor_gpus: bool
    gpu_monitoring: GPUMonitoringConfig
    num_val_samples_to_print: NotRequired[int]


def should_log_nemo_gym_full_result_tables(
    *, wandb_enabled: bool, wandb_config: WandbConfig
) -> bool:
    """Whether complete NeMo Gym results should become W&B tables (NeMo RL's switch)."""
    return bool(wandb_enabled) and bool(wandb_config.get("log_nemo_gym_full_result_tables"))


# ---- the live logger (for print_message_log_samples without a logger argument) ---------------


def active_logger() -> Logger | None:
    """The most recently created NeMo RL-compatible Logger that is not finished, if any."""
    return NEMO_RL_LOGGERS.latest()


# ---- the Logger --------------------------------------------------------------------------------


class NemoRLLogger(CoreOutputs):
    """NeMo RL's ``Logger``, delegating to one :class:`otel_rl.Logger` (``self.core``).

    ``cfg`` is a :class:`LoggerConfig` (any otel-rl config key is accepted as well, see
    docs/configuration.md), a mapping such as an OmegaConf ``DictConfig``, or a YAML path.
    ``artifact_queue`` bounds how many JSONL dumps may wait in memory for the disk.

    ``self.core`` is the :class:`otel_rl.Logger` underneath; ``timer``, ``prometheus_url``,
    ``otlp_endpoint``, ``rollout_monitor`` and ``gpu_monitor`` are its own.

    Each enabled backend is otel-rl's tracker for it while ``WandbLogger``, ``SwanlabLogger``,
    ``TensorboardLogger``, ``MLflowLogger`` (and ``RayGpuMonitorLogger``) in this module are
    otel-rl's classes. A different class under one of these names (a subclass assigned there,
    a patch) is built as NeMo RL builds it (``cls(cfg[<backend>], log_dir=<log_dir>/<backend>)``;
    the monitor with NeMo RL's keyword arguments and ``parent_logger=self``) in place of
    otel-rl's tracker, and gets NeMo RL's calls through its own delivery thread.
    """

    def __init__(
        self,
        cfg: LoggerConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        exporters: Sequence[Any] = (),
        artifact_queue: int = 4,
    ) -> None:
        from otel_rl.delivery.artifacts import ArtifactWriter
        from otel_rl.logger import Logger as CoreLogger

        # Set first: __del__ reads them even when construction fails half-way.
        self.finished = False
        self.gpu_monitor: Any = None
        self._channels: dict[int, tuple[Any, InterfaceExporter]] = {}
        self._channels_lock = threading.Lock()
        core_cfg, self.log_nemo_gym_full_result_tables, sections = _core_config(cfg)
        # Backends whose class name was given another class: built here, not by the core.
        replaced = [
            (key, globals()[attr])
            for key, attr in _BACKEND_CLASSES
            if core_cfg.get(f"{key}_enabled") and globals()[attr] is not _OWN_CLASSES[attr]
        ]
        for key, _ in replaced:
            core_cfg[f"{key}_enabled"] = False
        monitor_class = globals()["RayGpuMonitorLogger"]
        own_monitor = monitor_class is _OWN_CLASSES["RayGpuMonitorLogger"]
        monitor_gpus = bool(core_cfg.get("monitor_gpus"))
        if monitor_gpus and not own_monitor:
            core_cfg["monitor_gpus"] = False
        self.core = CoreLogger(core_cfg, exporters=exporters)
        self.cfg = self.core.config
        self.base_log_dir = str(self.cfg.log_dir)
        os.makedirs(self.base_log_dir, exist_ok=True)
        built = {key: self._build_backend(key, cls, sections) for key, cls in replaced}
        #: The backend loggers, in NeMo RL's order: otel-rl's tracker exporters, and the
        #: ``LoggerInterface`` objects built from replaced class names. Append your own.
        self.loggers: list[Any] = []
        for key, _ in _BACKEND_CLASSES:
            backend = built.get(key) or self._tracker(key)
            if backend is not None:
                self.loggers.append(backend)
        self.loggers.extend(
            tracker for tracker in map(_tracker_of, self.core.exporters)
            if tracker not in self.loggers
        )  # fmt: skip
        self.wandb_logger = built.get("wandb") or self._tracker("wandb")
        self.swanlab_logger = built.get("swanlab") or self._tracker("swanlab")
        self.gpu_monitor = self.core.gpu_monitor
        if monitor_gpus and "wandb" in built:
            # Part of building the backend, on this thread as the constructor itself: the GPU
            # rows must be on their axis before the first one arrives.
            try:
                built["wandb"].define_metric(f"{_GPU_PREFIX}/*", step_metric=_GPU_STEP_METRIC)
            except Exception as exc:
                _log.warning("otel-rl: %s.define_metric failed: %s", type(built["wandb"]), exc)
        if monitor_gpus and not own_monitor:
            gpu = self.cfg.gpu_monitoring
            self.gpu_monitor = monitor_class(
                collection_interval=gpu.collection_interval,
                flush_interval=gpu.flush_interval,
                metric_prefix=_GPU_PREFIX,
                step_metric=_GPU_STEP_METRIC,
                parent_logger=self,
            )
            self.gpu_monitor.start()
        self.num_val_samples_to_print = self.cfg.num_val_samples_to_print
        self.artifacts = ArtifactWriter(max_pending=artifact_queue)
        if not self.loggers:
            print("No loggers initialized")  # NeMo RL's notice, on stdout as there
        NEMO_RL_LOGGERS.add(self)

    # ---- NeMo RL's methods ----------------------------------------------------------------------

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log ``metrics`` at ``step`` under ``prefix`` (``step_metric`` keeps its own name)."""
        self.core.log_metrics(
            _merge_worker_lists(metrics), step, prefix or "", step_metric, step_finished
        )
        self._deliver("log_metrics", (metrics, step, prefix, step_metric, step_finished))

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.core.log_hyperparams(params)
        self._deliver("log_hyperparams", (params,))

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """The distribution of ``histogram`` at ``step`` (TensorBoard HISTOGRAMS, W&B, ...)."""
        self.core.log_histogram(rewards_as_floats(histogram), step, name)
        self._deliver("log_histogram", (histogram, step, name))

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """A matplotlib figure (rendered here; trackers store it per step, MLflow included)."""
        self.core.log_plot(figure, step, name)
        self._deliver("log_plot", (figure, step, name))

    def log_plot_per_worker_timeline_metrics(
        self,
        metrics: dict[int, list[Any]],
        step: int,
        prefix: str,
        name: str,
        timeline_interval: float,
    ) -> None:
        """Plots ``<prefix>/per_worker_<name>`` and ``<prefix>/average_<name>``."""
        from otel_rl.compat.nemo_plots import per_worker_timeline_figures

        figures = per_worker_timeline_figures(metrics or {}, name, timeline_interval)
        if not figures:
            _log.info("otel-rl: %s: no per-worker timeline data at step %s; no plot", name, step)
        for suffix, figure in figures:
            self.log_plot(figure, step, f"{prefix}/{suffix}")

    def log_plot_token_mult_prob_error(self, data: dict[str, Any], step: int, name: str) -> None:
        """Plot the tokens of the sample with the highest multiplicative probability error."""
        from otel_rl.compat.nemo_plots import token_mult_prob_error_figure

        result = token_mult_prob_error_figure(data)
        if result is None:
            _log.info("otel-rl: %s: no unmasked generated tokens at step %s; no plot", name, step)
            return
        self.log_plot(result[0], step, name)

    def log_batched_dict_as_jsonl(self, to_log: Mapping[str, Any], filename: str) -> None:
        """Write one JSON line per sample to ``<log_dir>/<filename>``, in the background.

        Returns once the batch is copied (tensors to CPU numpy); the file appears complete
        (written to ``<file>.tmp``, then renamed) by ``flush()``/``finish()``.
        """
        from otel_rl.delivery.artifacts import (
            iter_batch_lines,
            snapshot_batch,
            write_lines_atomically,
        )

        path = self._artifact_path(filename)
        if path is None or self._after_finish(path):
            return
        try:
            columns, size = snapshot_batch(to_log)
        except (TypeError, ValueError) as exc:
            if self.cfg.strict:
                raise
            _log.warning("otel-rl: %s not written: %s", path, exc)
            return
        self.artifacts.submit(
            path, lambda: write_lines_atomically(path, iter_batch_lines(columns, size))
        )

    def log_string_list_as_jsonl(self, to_log: list[str], filename: str) -> None:
        """Append each string as one line to ``<log_dir>/<filename>`` (in the background)."""
        from otel_rl.delivery.artifacts import append_lines

        path = self._artifact_path(filename)
        if path is None or self._after_finish(path):
            return
        lines = [str(line) for line in to_log]
        self.artifacts.submit(path, lambda: append_lines(path, lines))

    def _artifact_path(self, filename: object) -> str | None:
        """``<log_dir>/<filename>`` made safe (no way out of ``log_dir``: ``..`` and absolute
        parts removed, see otel_rl/core/paths.py); ``None`` and a warning (an error in strict mode)
        when nothing usable is left of the name."""
        try:
            return str(path_inside(self.base_log_dir, filename))
        except ValueError as exc:
            if self.cfg.strict:
                raise
            _log.warning("otel-rl: %r not written: %s", filename, exc)
            return None

    def finish(self, exit_code: int | None = None) -> None:
        """Write pending dumps, drain every tracker and close the run.

        ``exit_code`` defaults to what the process is heading for: called while an exception
        propagates (``finally:``/``except:``), the run is marked failed (killed for Ctrl-C and
        SIGTERM), never finished.
        """
        code = exit_code_now() if exit_code is None else int(exit_code)
        dumps: Stopping = []
        # The dumps go to files of their own, not to the trackers: they are written while the
        # run ends, within the same deadline (export.shutdown_timeout, + 1 s).
        deadline = Deadline(self.cfg.export.shutdown_timeout)
        if not self.finished:
            monitor = self.gpu_monitor
            if monitor is not None and monitor is not self.core.gpu_monitor:
                monitor.stop()  # its last rows come in through log_metrics, before the end
            self.finished = True
            channels = [exporter for _, exporter in self._channels.values()]
            dumps = start_stopping(
                [("artifact dumps", lambda: self._close_dumps(deadline))]
                + [(e.name, _stopper(e, deadline, code)) for e in channels]
            )
        # Also for a second caller: the core's finish() waits for the one ending the run.
        self.core.finish(exit_code=code)
        if dumps:
            still_stopping(dumps, deadline.at + SHUTDOWN_GRACE)

    def _close_dumps(self, deadline: Deadline) -> None:
        if not self.artifacts.close(deadline.left()):
            _log.warning(
                "otel-rl: %d artifact dump(s) still being written at finish", self.artifacts.pending
            )

    # ---- otel-rl additions --------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every dump is on disk and every tracker has written what was logged."""
        artifacts_done = self.artifacts.flush(timeout)
        deadline = Deadline(
            self.cfg.export.shutdown_timeout if timeout is None else timeout
        )
        channels_done = [
            exporter.force_flush(deadline.left() * 1000)
            for _, exporter in list(self._channels.values())
        ]
        return self.core.flush(timeout) and artifacts_done and all(channels_done)

    def log_samples_table(
        self, rows: Sequence[Sequence[Any]], step: int, name: str = "validation/samples"
    ) -> list[str]:
        """Log sample rows (``step, rank, index, reward, conversation``) to the trackers;
        returns the trackers reached (see :mod:`otel_rl.compat.tracker_tables`)."""
        from otel_rl.compat.tracker_tables import submit_table

        return submit_table(self.core.fanout, name, step, SAMPLE_COLUMNS, rows)

    def log_validation_samples(
        self,
        message_logs: list[Any],
        rewards: Any,
        step: int,
        num_samples: int | None = None,
        console: Any = None,
    ) -> None:
        """Print the best/worst ``num_samples`` (default ``num_val_samples_to_print``) and log
        them to the trackers."""
        count = self.num_val_samples_to_print if num_samples is None else num_samples
        print_message_log_samples(
            message_logs, rewards, num_samples=count, step=step, logger=self, console=console
        )

    def __enter__(self) -> Logger:
        return self

    def __del__(self) -> None:
        # NeMo RL stops the GPU monitor when its Logger is collected; a Logger dropped without
        # finish() must not leave the scraper thread polling the cluster. The run itself is
        # finished at interpreter exit (or by finish()), as the core Logger arranges.
        try:
            monitor = self.gpu_monitor
            if monitor is not None and not self.finished:
                monitor.stop()
        except Exception:  # never raise from a finalizer
            pass

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from otel_rl.process.lifecycle import exit_code_of

        self.finish(exit_code=exit_code_of(exc_type, exc))

    def _after_finish(self, what: str) -> bool:
        if self.finished:
            _log.warning("otel-rl: %s not written: the Logger is finished", what)
        return self.finished

    def _tracker(self, name: str) -> Any:
        delivery = self.core.fanout.named(name)
        return None if delivery is None else _tracker_of(delivery)

    def _finish_at_exit(self) -> None:
        """A run left open ends at interpreter exit with its own loggers' calls delivered (the
        core Logger's own exit hook knows nothing of their channels)."""
        from otel_rl.process.lifecycle import exit_code_hint, weak_atexit

        weak_atexit(self, lambda logger: logger.finish(exit_code_hint()))

    def _build_backend(self, key: str, cls: Any, sections: Mapping[str, Any]) -> Any:
        """``cls(cfg[key], log_dir=<log_dir>/<key>)``, as NeMo RL's Logger builds a backend."""
        log_dir = os.path.join(self.base_log_dir, key)
        os.makedirs(log_dir, exist_ok=True)
        return cls(sections.get(key) or {}, log_dir=log_dir)

    def _deliver(self, method: str, args: tuple[Any, ...]) -> None:
        """Queue the call for every logger in ``self.loggers`` that is not otel-rl's, each on
        its own channel; returns without waiting for any of them. The arguments are copied
        whole, only when a logger waits: NeMo RL's loggers see a call's values as they were
        when it was made, and a training loop reuses its dicts and tensors for the next step.
        Each logger gets a copy of its own: on threads of their own, what one changes in place
        would reach another at no set moment."""
        if self.finished:
            return
        own = self.core.exporters  # the stand-ins of the delivery process's trackers
        targets = [
            b for b in list(self.loggers)
            if not isinstance(b, Tracker) and all(b is not e for e in own)
        ]  # fmt: skip
        if not targets:
            return
        from otel_rl.compat.nemo_channels import InterfaceCall, InterfaceExporter

        for backend in targets:
            record = InterfaceCall(method, tuple(_snapshot(arg) for arg in args))
            with self._channels_lock:
                known = self._channels.get(id(backend))
                if known is None or known[0] is not backend:
                    if not self._channels:
                        self._finish_at_exit()
                    exporter = InterfaceExporter(
                        backend, shutdown_timeout=self.cfg.export.shutdown_timeout
                    )
                    known = (backend, exporter)
                    self._channels[id(backend)] = known
            known[1].delivery.submit(record)


# ---- helpers ------------------------------------------------------------------------------------


#: NeMo RL's name for it (``nemo_rl.utils.logger.Logger``).
Logger = NemoRLLogger


def _tracker_of(delivery: Delivery) -> Any:
    """A backend logger as NeMo RL's ``loggers`` hold it: the tracker, or, for one that lives
    in the delivery process, its delivery's stand-in."""
    return delivery if delivery.tracker is None else delivery.tracker


def _stopper(exporter: Any, deadline: Deadline, exit_code: int) -> Callable[[], None]:
    """Drain ``exporter`` within what is left of ``deadline``, then close it."""
    return lambda: exporter.shutdown(deadline.left() * 1000, exit_code=exit_code)


def _snapshot(value: Any) -> Any:
    """``value`` copied whole (nested dicts, lists, tensors), a figure as it is (NeMo RL closes
    it after the call); what cannot be deep-copied, one level deep."""
    if type(value).__name__ == "Figure" or isinstance(value, (int, float, str, type(None))):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:
        if isinstance(value, Mapping):
            return dict(value)
        return list(value) if isinstance(value, (list, tuple)) else value


def _core_config(cfg: Any) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """otel-rl's config from a NeMo RL one; NeMo RL's NeMo Gym table switch; and the backend
    sections as given (what NeMo RL hands its backend classes)."""
    from otel_rl.config.loading import load_config

    if isinstance(cfg, (str, os.PathLike, Path)) or cfg is None:
        core = load_config(cfg)
    else:
        # An OmegaConf DictConfig resolved as a whole: its lists become lists (the schema takes
        # no ListConfig) and ${...} interpolations their values.
        core = plain_config(cfg, "logger config")
    # NeMo RL creates exactly the backends a config enables: otel-rl's JSONL tracker (on by
    # default in otel_rl.Logger) only when asked for.
    core.setdefault("jsonl_enabled", False)
    sections = {
        key: dict(core[key]) if isinstance(core.get(key), Mapping) else core.get(key)
        for key, _ in _BACKEND_CLASSES
    }
    wandb = core.get("wandb")
    full_tables = False
    if isinstance(wandb, dict):
        full_tables = bool(wandb.pop("log_nemo_gym_full_result_tables", False))
    _run_identity(core)
    if core.get("mlflow_enabled"):
        _nemo_rl_artifact_location(core)
    return core, full_tables, sections


#: The config sections whose names say which run it is (the ones NeMo RL names its runs with).
_RUN_NAMES = (
    ("wandb", "project"), ("wandb", "name"), ("swanlab", "project"), ("swanlab", "name"),
    ("mlflow", "experiment_name"), ("mlflow", "run_name"),
)  # fmt: skip
#: A folder of ``get_next_experiment_dir``.
_EXP_FOLDER = re.compile(r"exp_(\d+)")


def nemo_rl_run_id(core: Mapping[str, Any]) -> str:
    """The run's id from NeMo RL's logger config: the run names it configures (W&B's, SwanLab's,
    MLflow's), the same at every launch of the same config. Readable (the first name given) and
    distinct (a digest of all of them)."""
    import hashlib
    import json

    names = []
    for section, key in _RUN_NAMES:
        value = core.get(section)
        names.append(value.get(key) if isinstance(value, Mapping) else None)
    digest = hashlib.sha1(json.dumps(names, default=str).encode()).hexdigest()[:8]
    first = next((str(name) for name in names[1::2] + names[0::2] if name), "nemo-rl")
    return f"{first}-{digest}"


def _run_identity(core: dict[str, Any]) -> None:
    """NeMo RL resumes training from its checkpoint at every relaunch of a config; the run's
    history continues with it. The run is named by the config (:func:`nemo_rl_run_id`) unless
    ``run_id`` or ``OTEL_RL_RUN_ID`` names it, and a relaunch writes into the ``exp_<N>`` folder
    of the launch it continues (:func:`_continued_experiment_dir`)."""
    from otel_rl.run.history import RUN_ID_ENV

    if not core.get("run_id") and not os.environ.get(RUN_ID_ENV):
        core["run_id"] = nemo_rl_run_id(core)
    run_id = str(core.get("run_id") or os.environ.get(RUN_ID_ENV))
    log_dir = core.get("log_dir")
    if log_dir and core.get("resume", "auto") != "never":
        core["log_dir"] = _continued_experiment_dir(str(log_dir), run_id)


def _continued_experiment_dir(log_dir: str, run_id: str) -> str:
    """The ``exp_<N>`` folder to log to: ``log_dir`` itself, unless it is a new ``exp_<N>``
    (what NeMo RL's ``get_next_experiment_dir`` gives every launch) beside an earlier one that
    holds ``run_id``'s history: then that one, so the TensorBoard files, the JSONL file and the
    W&B and MLflow stores of the run stay in one place. The new folder, still empty, is removed
    and the change printed (NeMo RL has printed the folder it made)."""
    from otel_rl.core.paths import folder_name
    from otel_rl.run.history import runs_root

    path = Path(log_dir)
    match = _EXP_FOLDER.fullmatch(path.name)
    if match is None:
        return log_dir

    def has_run(folder: Path) -> bool:
        return (runs_root(folder) / folder_name(run_id) / "launches.jsonl").is_file()

    if has_run(path):
        return log_dir
    try:
        siblings = [
            (int(m.group(1)), child)
            for child in path.parent.iterdir()
            if (m := _EXP_FOLDER.fullmatch(child.name)) and child != path and child.is_dir()
        ]
    except OSError:
        return log_dir
    earlier = [folder for _, folder in sorted(siblings, reverse=True) if has_run(folder)]
    if not earlier:
        return log_dir
    with contextlib.suppress(OSError):
        path.rmdir()  # only when empty: nothing of this launch is in it yet
    continued = os.path.join(path.parent, earlier[0].name)
    print(f"📊 Continuing run {run_id} in log directory: {continued} (instead of {log_dir})")
    return continued


def _nemo_rl_artifact_location(core: dict[str, Any]) -> None:
    """NeMo RL creates a new MLflow experiment with ``artifact_location`` from the config, else
    ``<log_dir>/mlflow``. With a tracking URI (config or ``MLFLOW_TRACKING_URI``) the same holds
    here, as an absolute path so that a server started elsewhere resolves it to the same place;
    without one, otel-rl's local store already keeps artifacts under ``<log_dir>/mlflow``."""
    section = core.get("mlflow")
    if section is None:
        section = core["mlflow"] = {}
    if not isinstance(section, dict) or section.get("artifact_location"):
        return
    if not (section.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")):
        return
    log_dir = core.get("log_dir") or "logs"  # NeMo RL requires log_dir; "logs" is otel-rl's default
    location = Path(str(log_dir)).absolute() / "mlflow"
    location.mkdir(parents=True, exist_ok=True)
    section["artifact_location"] = str(location)


def _merge_worker_lists(metrics: Any) -> Any:
    """NeMo RL's ``generation_logger_metrics`` (``{metric: {worker: [values]}}``) as one list
    per metric, so each metric gets one set of summary statistics across the cluster. A metric
    no worker sampled in the step (NeMo RL sends ``{}``: a generation shorter than one polling
    interval, a Dynamo alias without a source) has nothing to summarise and no row."""
    if not isinstance(metrics, Mapping):
        return metrics
    per_metric = metrics.get("generation_logger_metrics")
    if not isinstance(per_metric, Mapping):
        return metrics
    merged: dict[str, Any] = {}
    for metric, by_worker in per_metric.items():
        if isinstance(by_worker, Mapping):
            values: list[Any] = []
            for samples in by_worker.values():
                values.extend(samples if isinstance(samples, (list, tuple)) else [samples])
            if values:
                merged[metric] = values
        else:
            merged[metric] = by_worker
    return {**metrics, "generation_logger_metrics": merged}
