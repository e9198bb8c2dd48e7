"""verl's backend names and environment variables → an otel-rl logger config.

Backends: verl's ``wandb, mlflow, swanlab, vemlp_wandb, tensorboard, console, clearml, trackio,
file, rl_insight`` (``tracking`` is verl's deprecated alias of ``wandb``). ``vemlp_wandb`` is
otel-rl's W&B tracker with verl's settings for it (:data:`TRACKER_OF`); ``rl_insight`` serves the
run's metrics on otel-rl's Prometheus endpoint, which RL-Insight's Prometheus scrapes
(``prometheus.enabled``). Environment variables, read as verl reads them:

==========================  =====================================================================
``TENSORBOARD_DIR``         default ``tensorboard_log/<project>/<experiment>``
``MLFLOW_TRACKING_URI``     MLflow server or store; default: a SQLite store under the log dir
``MLFLOW_RUN_ID``           attach to this MLflow run instead of starting one
``SWANLAB_MODE``            ``cloud``/``online``, ``local``, ``offline`` or ``disabled``
``SWANLAB_LOG_DIR``         SwanLab's directory; default ``swanlog``
``SWANLAB_API_KEY``         read by SwanLab itself
``WANDB_ENTITY``            W&B entity; every other ``WANDB_*`` variable is read by W&B itself
                            (``vemlp_wandb`` too: ``WANDB_BASE_URL``/``WANDB_API_KEY`` of the
                            platform's W&B server)
``CLEARML_*``               read by ClearML itself (``CLEARML_OFFLINE_MODE=1``: offline session)
``VERL_FILE_LOGGER_PATH``   the ``file`` backend's JSONL file
``VERL_FILE_LOGGER_ROOT``   else ``<root>/<project>/<experiment>.jsonl`` (root default ``.``)
``OTEL_RL_LOG_DIR``         otel-rl's own directory (spool, default MLflow store); default
                            ``otel_rl_logs/<project>/<experiment>``
``OTEL_RL_RUN_ID``          the run's id; default ``<project>/<experiment>``
==========================  =====================================================================

A relaunch continues the run as verl continues its training: the run is named by the project and
experiment (:func:`verl_run_id`), and ``trainer.resume_mode`` decides whether it continues
(:data:`RESUME_OF`), so a job that verl resumes from its checkpoint keeps one history in every
tracker (docs/recipes/verl.md).

Every other option of :class:`otel_rl.Logger` (Prometheus, OTLP, rollout and GPU monitoring,
export, more trackers...) comes from ``config["otel_rl"]`` in verl's own config and from the
``OTEL_RL_CONFIG`` file, with the Logger's keys; :func:`tracking_config` gives the precedence.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from otel_rl.config.env import CONFIG_ENV
from otel_rl.core.errors import ConfigError
from otel_rl.process.fork_safe_log import log as _log

#: verl's backends (``Tracking.supported_backend``, in verl's order), all served by otel-rl.
SUPPORTED_BACKENDS = (
    "wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio",
    "file", "rl_insight",
)  # fmt: skip
#: A verl backend → the core Logger's tracker that serves it, where the names differ.
TRACKER_OF = {"vemlp_wandb": "wandb"}
#: verl's backend that is otel-rl's Prometheus endpoint rather than a tracker.
RL_INSIGHT = "rl_insight"
_ALIASES = {"tracking": "wandb"}
#: Where otel-rl's own options live in verl's config.
SECTION = "otel_rl"
#: verl backends served otherwise than by the core Logger's tracker of that name: verl's console
#: lines (otel_rl.compat.verl_exporters).
_NOT_CORE_TRACKERS = frozenset({"console"})
#: verl's ``trainer.resume_mode`` → the logger's ``resume``: verl resumes from its latest
#: checkpoint (``auto``) or a given one (``resume_path``), and the run's history continues with
#: it; ``disable`` trains from scratch, a new run.
RESUME_OF = {"auto": "auto", "resume_path": "auto", "disable": "never"}
_MISSING = object()


def core_trackers() -> list[str]:
    """The core Logger's trackers that are verl backends too (each switched by
    ``<name>_enabled``), in the order the core Logger enables them."""
    from otel_rl.delivery.registry import builtin_trackers

    backends = set(SUPPORTED_BACKENDS) - _NOT_CORE_TRACKERS
    return [name for name in builtin_trackers() if name in backends]


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


def tracker_names(backends: Iterable[str]) -> list[str]:
    """The core Logger's trackers that serve ``backends`` (``vemlp_wandb`` is ``wandb``)."""
    names: list[str] = []
    for backend in backends:
        name = TRACKER_OF.get(backend, backend)
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
    """otel-rl's logger config from verl's settings alone: the backends, the names and verl's
    environment variables (``console`` and ``file`` are not in it: they are verl-format
    exporters the Tracking adds itself). ``config`` is verl's config, read for
    ``trainer.wandb_proxy`` only."""
    env = os.environ if environ is None else environ
    return _layered(project, experiment, backends, config, env, {}, lambda path: "")


def tracking_config(
    project: str,
    experiment: str,
    backends: list[str],
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``Tracking``'s logger config: otel-rl's options from the ``OTEL_RL_CONFIG`` file and
    ``config["otel_rl"]``, with verl's settings on top.

    Precedence, lowest first:

    1. verl's defaults (``tensorboard_log/<project>/<experiment>``, ``swanlog``, log dir
       ``otel_rl_logs/<project>/<experiment>``, no JSONL tracker);
    2. the ``OTEL_RL_CONFIG`` file;
    3. ``config["otel_rl"]`` (a plain mapping; OmegaConf resolved by
       :func:`otel_rl.compat.common.plain_config`);
    4. what verl itself is told: the trackers ``default_backend`` names are on, each tracker's
       project and run are ``project_name``/``experiment_name``, and verl's environment
       variables that are set (``TENSORBOARD_DIR``, ``MLFLOW_TRACKING_URI``, ...,
       ``OTEL_RL_LOG_DIR``) and ``trainer.wandb_proxy`` decide what they decide.

    A value of layer 2 or 3 that layer 4 replaces is reported once, naming both. Each of
    layers 2 and 3 is checked on its own first (unknown keys with the nearest valid one, types),
    so an error names where the mistake is; the merged config is checked again by the Logger.
    """
    env = os.environ if environ is None else environ
    from_file = _config_file(env)
    section = otel_rl_section(config)
    user = _merged(from_file, section)

    def origin(path: tuple[str, ...]) -> str:
        if _lookup(section, path) is not _MISSING:
            return f"verl config '{SECTION}'"
        return f"the {CONFIG_ENV} file {env.get(CONFIG_ENV)}"

    cfg = _layered(project, experiment, backends, config, env, user, origin)
    # The run's identity, under otel-rl's own options (a run_id or resume given there wins).
    for key, value in _run_identity(project, experiment, config, env).items():
        if key not in user:
            cfg[key] = value
    return cfg


def _run_identity(
    project: str, experiment: str, config: Mapping[str, Any] | None, env: Mapping[str, str]
) -> dict[str, Any]:
    """A ``Tracking``'s run: the project's experiment (unless ``OTEL_RL_RUN_ID`` names it),
    continued as ``trainer.resume_mode`` says. Only the ``Tracking``'s: verl's standalone
    loggers (``FileLogger``, a ``ValidationGenerationsLogger`` on its own) are no launches of
    the run."""
    from otel_rl.run.history import RUN_ID_ENV

    identity: dict[str, Any] = {"resume": resume_of(_trainer(config).get("resume_mode"))}
    if not env.get(RUN_ID_ENV) and (project or experiment):
        identity["run_id"] = verl_run_id(project, experiment)
    return identity


def otel_rl_section(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config["otel_rl"]`` checked against the logger config's keys (``{}`` when absent).

    ``config`` is plain already (:func:`otel_rl.compat.common.plain_config`). A key mistake is
    the Logger's :class:`ConfigError` (``did you mean ...``), prefixed with where the section is.
    """
    if not isinstance(config, Mapping):
        return {}
    section = config.get(SECTION)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"verl config '{SECTION}' must be a mapping of otel-rl's logger config keys "
            f"(docs/configuration.md), got {type(section).__name__}"
        )
    _check_alone(section, f"verl config '{SECTION}'")
    return dict(section)


def _layered(
    project: str,
    experiment: str,
    backends: list[str],
    config: Mapping[str, Any] | None,
    env: Mapping[str, str],
    user: dict[str, Any],
    origin: Callable[[tuple[str, ...]], str],
) -> dict[str, Any]:
    wanted = tracker_names(backends)
    on = [name for name in core_trackers() if name in wanted or user.get(f"{name}_enabled") is True]
    cfg = _merged(_verl_defaults(project, experiment, on), user)
    for path, value, source in _verl_settings(project, experiment, backends, on, config, env):
        given = _lookup(user, path)
        if given is not _MISSING and given != value:
            _log.warning(
                "otel-rl: %s sets '%s' to %r; %s (%r) is used instead: what verl is told "
                "wins over otel-rl's options (docs/migrating.md)",
                origin(path), ".".join(path), given, source, value,
            )  # fmt: skip
        _put(cfg, path, value)
    return cfg


def _verl_defaults(project: str, experiment: str, trackers: list[str]) -> dict[str, Any]:
    """What verl does when nothing says otherwise (the lowest layer)."""
    cfg: dict[str, Any] = {
        "log_dir": os.path.join("otel_rl_logs", project, experiment),
        "jsonl_enabled": False,
    }
    if project:  # a standalone ValidationGenerationsLogger may have no names
        cfg["experiment"] = project
    if "tensorboard" in trackers:
        cfg["tensorboard"] = {"log_dir": os.path.join("tensorboard_log", project, experiment)}
    if "swanlab" in trackers:
        cfg["swanlab"] = {"log_dir": "swanlog", "config": {"FRAMEWORK": "verl"}}
    if "clearml" in trackers:
        # verl's ClearMLLogger: a rerun continues the task of the same name, no model uploads.
        cfg["clearml"] = {"continue_last_task": True, "output_uri": False}
    return cfg


def verl_run_id(project: str, experiment: str) -> str:
    """The run's id: ``<project>/<experiment>``, verl's name of the run (the same at every
    launch, so a relaunch finds the run it continues)."""
    return f"{project}/{experiment}"


def resume_of(resume_mode: Any) -> str:
    """The logger's ``resume`` for verl's ``trainer.resume_mode`` (``auto`` when unset, verl's
    default); a value verl does not know is a :class:`ConfigError`."""
    if resume_mode is None:
        return "auto"
    mode = str(resume_mode)
    if mode not in RESUME_OF:
        raise ConfigError(
            f"verl config 'trainer.resume_mode': {mode!r} is not one of "
            f"{', '.join(RESUME_OF)}"
        )
    return RESUME_OF[mode]


def _verl_settings(
    project: str,
    experiment: str,
    backends: list[str],
    trackers: list[str],
    config: Mapping[str, Any] | None,
    env: Mapping[str, str],
) -> list[tuple[tuple[str, ...], Any, str]]:
    """``(key path, value, where it comes from)`` for what verl itself is told (the top
    layer): the backends, the run's names and verl's environment variables that are set."""
    out: list[tuple[tuple[str, ...], Any, str]] = []

    def put(path: str, value: Any, source: str) -> None:
        out.append((tuple(path.split(".")), value, source))

    def from_env(path: str, name: str) -> None:
        if env.get(name):
            put(path, env[name], name)

    from_env("log_dir", "OTEL_RL_LOG_DIR")
    wanted = tracker_names(backends)
    for name in core_trackers():
        if name in wanted:
            put(f"{name}_enabled", True, "Tracking's default_backend")
    if RL_INSIGHT in backends:
        put("prometheus.enabled", True, "Tracking's default_backend 'rl_insight'")
    if "tensorboard" in trackers:
        from_env("tensorboard.log_dir", "TENSORBOARD_DIR")
    if "wandb" in trackers:
        put("wandb.project", project, "Tracking's project_name")
        put("wandb.name", experiment, "Tracking's experiment_name")
        from_env("wandb.entity", "WANDB_ENTITY")
        from_env("wandb.dir", "WANDB_DIR")
        proxy = _trainer(config).get("wandb_proxy")
        if proxy:
            put("wandb.settings.https_proxy", proxy, "verl config 'trainer.wandb_proxy'")
    if "mlflow" in trackers:
        # verl: the MLflow experiment is the project, the run name the experiment.
        if project:
            put("mlflow.experiment_name", project, "Tracking's project_name")
        if experiment:
            put("mlflow.run_name", experiment, "Tracking's experiment_name")
        from_env("mlflow.tracking_uri", "MLFLOW_TRACKING_URI")
        from_env("mlflow.run_id", "MLFLOW_RUN_ID")
    if "swanlab" in trackers:
        put("swanlab.project", project, "Tracking's project_name")
        put("swanlab.experiment_name", experiment, "Tracking's experiment_name")
        from_env("swanlab.log_dir", "SWANLAB_LOG_DIR")
        from_env("swanlab.mode", "SWANLAB_MODE")
    if "trackio" in trackers:
        put("trackio.project", project, "Tracking's project_name")
        put("trackio.name", experiment, "Tracking's experiment_name")
    if "clearml" in trackers:
        # verl: Task.init(project_name=project_name, task_name=experiment_name); every other
        # CLEARML_* variable (CLEARML_OFFLINE_MODE, the server and keys) is read by ClearML.
        put("clearml.project_name", project, "Tracking's project_name")
        put("clearml.task_name", experiment, "Tracking's experiment_name")
    return out


def _config_file(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``OTEL_RL_CONFIG`` file's logger config (``{}`` when the variable is unset)."""
    from otel_rl.config.loading import load_config

    path = env.get(CONFIG_ENV)
    if not path:
        return {}
    loaded = load_config(path)
    _check_alone(loaded, f"{CONFIG_ENV} file {path}")
    return loaded


def _check_alone(section: Mapping[str, Any], where: str) -> None:
    from otel_rl.config.schema import validate

    try:
        validate(section)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _merged(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers merged key by key, later ones winning; nested mappings are merged too."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            below = out.get(key)
            if isinstance(value, Mapping) and isinstance(below, Mapping):
                out[key] = _merged(below, value)
            elif isinstance(value, Mapping):
                out[key] = _merged(value)
            else:
                out[key] = value
    return out


def _lookup(cfg: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = cfg
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _put(cfg: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = cfg
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            # Unset or null (a section's default), or a value that is no mapping (such as a
            # ``wandb.Settings`` object): verl's setting starts a section of its own.
            child = node[key] = {}
        node = child
    node[path[-1]] = value


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
