"""Each enabled tracker's own settings checked against what that tracker accepts.

The ``wandb:``, ``swanlab:`` and ``trackio:`` sections go to the SDK's ``init`` as keyword
arguments (``clearml:`` to ``clearml.Task.init``), and the ``mlflow:`` section is read by otel-rl's
MLflow exporter. A typo there (``wandb: {projcet: x}``) would otherwise pass construction and fail
later on the tracker's own thread, or, for SwanLab, whose ``init`` swallows unknown keywords, be
ignored. This check runs in :func:`otel_rl.config.loading.resolve_settings`, so ``Logger()`` raises
at once with the nearest valid name.

What an SDK's ``init`` accepts is read from the installed SDK without importing it (importing
W&B, SwanLab, Trackio or ClearML takes seconds; their exporters import them later on their own
thread): its signature when the SDK is already imported, else the ``def init`` in its source
(``Task``'s method for ClearML), parsed with :mod:`ast`; when neither is found (SDK not
installed, or its files moved), a declared list of the parameters of the versions otel-rl
supports. Each tracker's exporter class declares its SDK's ``init`` (``config.sdk_init``) or the
names it reads itself (``config.accepted``).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from otel_rl.core.errors import ConfigError

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings
    from otel_rl.exporters.base import SdkInit, TrackerConfig


def sdk_init(name: str) -> SdkInit | None:
    """Where built-in tracker ``name``'s section goes, as its exporter class declares it
    (``None``: the section is read by otel-rl's exporter, or there is none)."""
    from otel_rl.delivery.registry import builtin_tracker_classes

    cls = builtin_tracker_classes().get(name)
    return None if cls is None or cls.config is None else cls.config.sdk_init


def check_tracker_settings(cfg: LoggerSettings) -> None:
    """Raise :class:`ConfigError` for a setting an enabled tracker does not take.

    ``cfg`` is a resolved config. Disabled trackers are not checked: NeMo RL configs keep a
    ``wandb:`` section while ``wandb_enabled: false``, and the SDK may be absent.
    """
    from otel_rl.delivery.registry import builtin_tracker_classes, enabled_backends

    builtin = builtin_tracker_classes()
    for name, options in cfg.trackers.items():
        if name in builtin and options:
            raise ConfigError(
                f"logger config 'trackers.{name}': the built-in {name} tracker reads its "
                f"settings from '{name}:', not from 'trackers:'; move them there"
            )
    problems = []
    for name in enabled_backends(cfg):
        cls = builtin.get(name)
        declared = cls.config if cls is not None else None
        section = cfg.tracker_section(name) if declared is not None else None
        if declared is None or declared.keys or not isinstance(section, Mapping):
            continue  # typed keys are the schema's to check
        accepted = accepted_settings(name)
        if accepted is None:
            continue
        for key in section:
            if key not in accepted:
                problems.append(_unknown(name, key, accepted, declared.sdk_init))
    if problems:
        raise ConfigError("\n".join(problems))


def accepted_settings(name: str) -> frozenset[str] | None:
    """The setting names built-in tracker ``name`` accepts in its config section (``None``: it
    declares no list to check them against)."""
    from otel_rl.delivery.registry import builtin_tracker_classes

    declared: TrackerConfig | None = builtin_tracker_classes()[name].config
    if declared is not None and declared.accepted is not None:
        return frozenset(declared.accepted)
    spec = declared.sdk_init if declared is not None else None
    if spec is None:
        return None
    return _init_parameters(spec) | spec.also


def _described(spec: SdkInit | None) -> str:
    if spec is None:
        return "the otel-rl exporter"
    owner = f"{spec.package}.{spec.init_class}" if spec.init_class else spec.package
    return f"{owner}.init"


def _unknown(name: str, key: object, accepted: frozenset[str], spec: SdkInit | None) -> str:
    near = difflib.get_close_matches(str(key), sorted(accepted), n=1, cutoff=0.6)
    where = f"(logger config '{name}.{key}'; the settings are those of {_described(spec)})"
    if near:
        return f"unknown {name} setting '{key}'; did you mean '{near[0]}'? {where}"
    return f"unknown {name} setting '{key}' {where}; valid: {', '.join(sorted(accepted))}"


@cache
def _init_parameters(spec: SdkInit) -> frozenset[str]:
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


def _parameters_in_source(spec: SdkInit) -> frozenset[str] | None:
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
