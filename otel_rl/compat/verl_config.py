"""verl's backend names and environment variables → an otel-rl logger config.

Backends: ``console, wandb, mlflow, swanlab, tensorboard, trackio, file`` (``tracking`` is verl's
deprecated alias of ``wandb``). Environment variables, read as verl reads them:

==========================  =====================================================================
``TENSORBOARD_DIR``         default ``tensorboard_log/<project>/<experiment>``
``MLFLOW_TRACKING_URI``     MLflow server or store; default: a SQLite store under the log dir
``MLFLOW_RUN_ID``           attach to this MLflow run instead of starting one
``SWANLAB_MODE``            ``cloud``/``online``, ``local``, ``offline`` or ``disabled``
``SWANLAB_LOG_DIR``         SwanLab's directory; default ``swanlog``
``SWANLAB_API_KEY``         read by SwanLab itself
``WANDB_ENTITY``            W&B entity; every other ``WANDB_*`` variable is read by W&B itself
``VERL_FILE_LOGGER_PATH``   the ``file`` backend's JSONL file
``VERL_FILE_LOGGER_ROOT``   else ``<root>/<project>/<experiment>.jsonl`` (root default ``.``)
``OTEL_RL_LOG_DIR``         otel-rl's own directory (spool, default MLflow store); default
                            ``otel_rl_logs/<project>/<experiment>``
==========================  =====================================================================
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from otel_rl.errors import ConfigError

#: verl's backends that otel-rl serves.
SUPPORTED_BACKENDS = ("wandb", "mlflow", "swanlab", "tensorboard", "console", "trackio", "file")
#: verl's backends that otel-rl does not serve, with the reason.
UNSUPPORTED_BACKENDS = {
    "vemlp_wandb": "Volcengine ML Platform's W&B needs the private volcengine_ml_platform SDK and "
    "cloud credentials; otel-rl has no exporter for it (use 'wandb', or 'tensorboard' which that "
    "platform syncs)",
    "clearml": "otel-rl has no ClearML exporter; a third-party one can be registered under the "
    "'otel_rl.exporters' entry-point group and enabled with Logger's 'trackers' config",
}
_ALIASES = {"tracking": "wandb"}


def backend_names(default_backend: str | Iterable[str] | None) -> list[str]:
    """The backend names as a list (a str is one name), validated, aliases resolved."""
    if default_backend is None:
        return []
    raw = [default_backend] if isinstance(default_backend, str) else list(default_backend)
    names: list[str] = []
    for item in raw:
        name = str(item)
        if name in _ALIASES:
            warnings.warn(
                f"the '{name}' backend is deprecated in verl; use '{_ALIASES[name]}'",
                DeprecationWarning,
                stacklevel=3,
            )
            name = _ALIASES[name]
        if name in UNSUPPORTED_BACKENDS:
            raise ConfigError(
                f"verl backend '{name}' is not supported by otel-rl: "
                f"{UNSUPPORTED_BACKENDS[name]}. Supported: {', '.join(SUPPORTED_BACKENDS)}"
            )
        if name not in SUPPORTED_BACKENDS:
            near = difflib.get_close_matches(name, SUPPORTED_BACKENDS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(
                f"unknown verl backend {name!r}{hint} (supported: "
                f"{', '.join(SUPPORTED_BACKENDS)})"
            )
        if name not in names:
            names.append(name)
    return names


def core_config(
    project: str,
    experiment: str,
    backends: list[str],
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """otel-rl's logger config for these backends (``console`` and ``file`` are not in it:
    they are verl-format exporters the Tracking adds itself)."""
    env = os.environ if environ is None else environ
    log_dir = env.get("OTEL_RL_LOG_DIR") or os.path.join("otel_rl_logs", project, experiment)
    cfg: dict[str, Any] = {"log_dir": log_dir, "jsonl_enabled": False}
    if project:  # a standalone ValidationGenerationsLogger may have no names
        cfg["experiment"] = project
    if "tensorboard" in backends:
        cfg["tensorboard_enabled"] = True
        cfg["tensorboard"] = {
            "log_dir": env.get("TENSORBOARD_DIR")
            or os.path.join("tensorboard_log", project, experiment)
        }
    if "wandb" in backends:
        wandb: dict[str, Any] = {"project": project, "name": experiment}
        if env.get("WANDB_ENTITY"):
            wandb["entity"] = env["WANDB_ENTITY"]
        if env.get("WANDB_DIR"):
            wandb["dir"] = env["WANDB_DIR"]
        proxy = _trainer(config).get("wandb_proxy")
        if proxy:
            wandb["settings"] = {"https_proxy": proxy}
        cfg["wandb_enabled"], cfg["wandb"] = True, wandb
    if "mlflow" in backends:
        # verl: the MLflow experiment is the project, the run name the experiment.
        mlflow: dict[str, Any] = {}
        if project:
            mlflow["experiment_name"] = project
        if experiment:
            mlflow["run_name"] = experiment
        if env.get("MLFLOW_TRACKING_URI"):
            mlflow["tracking_uri"] = env["MLFLOW_TRACKING_URI"]
        if env.get("MLFLOW_RUN_ID"):
            mlflow["run_id"] = env["MLFLOW_RUN_ID"]
        cfg["mlflow_enabled"], cfg["mlflow"] = True, mlflow
    if "swanlab" in backends:
        swanlab: dict[str, Any] = {
            "project": project,
            "experiment_name": experiment,
            "log_dir": env.get("SWANLAB_LOG_DIR") or "swanlog",
            "config": {"FRAMEWORK": "verl"},
        }
        if env.get("SWANLAB_MODE"):
            swanlab["mode"] = env["SWANLAB_MODE"]
        cfg["swanlab_enabled"], cfg["swanlab"] = True, swanlab
    if "trackio" in backends:
        cfg["trackio_enabled"], cfg["trackio"] = True, {"project": project, "name": experiment}
    return cfg


def file_logger_path(
    project: str, experiment: str, environ: Mapping[str, str] | None = None
) -> str:
    """Where the ``file`` backend writes: ``VERL_FILE_LOGGER_PATH``, else
    ``<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl``."""
    env = os.environ if environ is None else environ
    if env.get("VERL_FILE_LOGGER_PATH"):
        return env["VERL_FILE_LOGGER_PATH"]
    root = os.path.expanduser(env.get("VERL_FILE_LOGGER_ROOT") or ".")
    return os.path.join(root, project, f"{experiment}.jsonl")


def _trainer(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    trainer = (config or {}).get("trainer") if isinstance(config, Mapping) else None
    return trainer if isinstance(trainer, Mapping) else {}
