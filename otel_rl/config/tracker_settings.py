"""Each enabled tracker's own settings checked against what that tracker accepts.

The ``wandb:``, ``swanlab:`` and ``trackio:`` sections go to the SDK's ``init`` as keyword
arguments (``clearml:`` to ``clearml.Task.init``), and the ``mlflow:`` section is read by otel-rl's
MLflow exporter. A typo there (``wandb: {projcet: x}``) would otherwise pass construction and fail
later on the tracker's own thread, or, for SwanLab, whose ``init`` swallows unknown keywords, be
ignored. This check runs in :func:`otel_rl.config.loading.resolve_config`, so ``Logger()`` raises
at once with the nearest valid name.

What an SDK's ``init`` accepts is read from the installed SDK without importing it (importing
W&B, SwanLab, Trackio or ClearML takes seconds; their exporters import them later on their own
thread): its signature when the SDK is already imported, else the ``def init`` in its source
(``Task``'s method for ClearML), parsed with :mod:`ast`; when neither is found (SDK not
installed, or its files moved), a declared list of the parameters of the versions otel-rl
supports.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from otel_rl.core.errors import ConfigError


@dataclass(frozen=True)
class TrackerSettings:
    """Where a tracker's settings go and how to learn which names it takes."""

    #: The package whose ``init`` receives the section (``None``: read by otel-rl itself).
    package: str | None
    #: Files of the package, relative to it, that may define ``init`` (newest layout first).
    init_files: tuple[str, ...] = ()
    #: The parameters when the SDK's own cannot be read (recent versions, as documented).
    declared: frozenset[str] = frozenset()
    #: Names accepted on top of ``init``'s parameters (aliases the SDK or the exporter maps).
    also: frozenset[str] = field(default_factory=frozenset)
    #: The class whose ``init`` method takes the section (``None``: a module-level ``init``).
    init_class: str | None = None

    @property
    def described(self) -> str:
        if not self.package:
            return "the otel-rl exporter"
        owner = f"{self.package}.{self.init_class}" if self.init_class else self.package
        return f"{owner}.init"


TRACKERS: dict[str, TrackerSettings] = {
    "wandb": TrackerSettings(
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
    "swanlab": TrackerSettings(
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
    "trackio": TrackerSettings(
        package="trackio",
        init_files=("__init__.py",),
        declared=frozenset({
            "project", "name", "group", "space_id", "server_url", "dataset_id", "bucket_id",
            "config", "resume", "settings", "private", "embed", "auto_log_gpu",
            "gpu_log_interval", "auto_log_cpu", "cpu_log_interval", "webhook_url",
            "webhook_min_level",
        }),
    ),
    "clearml": TrackerSettings(
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
    "mlflow": TrackerSettings(package=None),
}


def check_tracker_settings(cfg: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for a setting an enabled tracker does not take.

    ``cfg`` is a resolved config (every key present). Disabled trackers are not checked: NeMo RL
    configs keep a ``wandb:`` section while ``wandb_enabled: false``, and the SDK may be absent.
    """
    from otel_rl.delivery.registry import BACKEND_FLAGS, enabled_backends

    for name, options in (cfg.get("trackers") or {}).items():
        if name in BACKEND_FLAGS and options:
            raise ConfigError(
                f"logger config 'trackers.{name}': the built-in {name} tracker reads its "
                f"settings from '{name}:', not from 'trackers:'; move them there"
            )
    problems = []
    for name in enabled_backends(cfg):
        spec = TRACKERS.get(name)
        section = cfg.get(name)
        if spec is None or not isinstance(section, Mapping):
            continue
        accepted = accepted_settings(name)
        for key in section:
            if key not in accepted:
                problems.append(_unknown(name, key, accepted, spec))
    if problems:
        raise ConfigError("\n".join(problems))


def accepted_settings(name: str) -> frozenset[str]:
    """The setting names tracker ``name`` accepts in its config section."""
    spec = TRACKERS[name]
    if spec.package is None:
        return _exporter_keys(name)
    return _init_parameters(spec) | spec.also


def _unknown(name: str, key: object, accepted: frozenset[str], spec: TrackerSettings) -> str:
    near = difflib.get_close_matches(str(key), sorted(accepted), n=1, cutoff=0.6)
    where = f"(logger config '{name}.{key}'; the settings are those of {spec.described})"
    if near:
        return f"unknown {name} setting '{key}'; did you mean '{near[0]}'? {where}"
    return f"unknown {name} setting '{key}' {where}; valid: {', '.join(sorted(accepted))}"


def _exporter_keys(name: str) -> frozenset[str]:
    if name == "mlflow":
        from otel_rl.exporters.mlflow import CONFIG_KEYS

        return frozenset(CONFIG_KEYS)
    raise KeyError(name)


@cache
def _init_parameters(spec: TrackerSettings) -> frozenset[str]:
    module = sys.modules.get(spec.package or "")
    owner = getattr(module, spec.init_class, None) if spec.init_class else module
    init = getattr(owner, "init", None)
    if init is not None:
        try:
            return _named_parameters(inspect.signature(init))
        except (TypeError, ValueError):  # a C function or an odd wrapper: read the source
            pass
    return _parameters_in_source(spec) or spec.declared


def _named_parameters(signature: inspect.Signature) -> frozenset[str]:
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in signature.parameters.values() if p.kind in named)


def _parameters_in_source(spec: TrackerSettings) -> frozenset[str] | None:
    """The parameters of the module-level ``def init`` in the installed package's files."""
    try:
        found = importlib.util.find_spec(spec.package or "")
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        for relative in spec.init_files:
            path = Path(location) / relative
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
            init = _init_in(tree.body, spec.init_class)
            if init is not None:
                args = init.args
                names = [a.arg for a in (*args.args, *args.kwonlyargs)]  # keywords only
                return frozenset(names) - {"self", "cls"}
    return None


def _init_in(body: list[ast.stmt], init_class: str | None) -> ast.FunctionDef | None:
    """The ``def init`` at module level, or in the module's class ``init_class``."""
    if init_class is not None:
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name == init_class:
                return _init_in(node.body, None)
        return None
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == "init":
            return node
    return None
