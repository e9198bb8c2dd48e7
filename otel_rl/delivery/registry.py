"""Find tracker exporters by name.

Trackers are registered under the ``otel_rl.exporters`` entry-point group, so a third-party
package can add one (``[project.entry-points."otel_rl.exporters"] mytracker = "pkg:MyExporter"``).
Built-in ones are also listed here so a source checkout works without installed metadata.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import install_hint

ENTRY_POINT_GROUP = "otel_rl.exporters"

#: The config flag that enables each built-in tracker.
BACKEND_FLAGS = {
    "tensorboard": "tensorboard_enabled",
    "jsonl": "jsonl_enabled",
    "console": "console_enabled",
    "wandb": "wandb_enabled",
    "mlflow": "mlflow_enabled",
    "swanlab": "swanlab_enabled",
    "trackio": "trackio_enabled",
    "clearml": "clearml_enabled",
}

_BUILTIN = {
    "console": "otel_rl.exporters.console:ConsoleExporter",
    "jsonl": "otel_rl.exporters.jsonl:JsonlExporter",
    "tensorboard": "otel_rl.exporters.tensorboard:TensorBoardExporter",
    "mlflow": "otel_rl.exporters.mlflow:MlflowExporter",
    "wandb": "otel_rl.exporters.wandb:WandbExporter",
    "swanlab": "otel_rl.exporters.swanlab:SwanLabExporter",
    "trackio": "otel_rl.exporters.trackio:TrackioExporter",
    "clearml": "otel_rl.exporters.clearml:ClearMLExporter",
}


def available_exporters() -> dict[str, str]:
    """``{name: "module:Class"}`` for every installed tracker exporter."""
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def exporter_class(name: str) -> type[Any]:
    """Import and return the exporter class registered as ``name``."""
    target = available_exporters().get(name)
    if target is None:
        raise ConfigError(
            f"no tracker exporter named '{name}' (available: "
            f"{', '.join(sorted(available_exporters()))})"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"the '{name}' backend needs an optional dependency: {exc}; "
            f"{install_hint(name, exc.name)}"
        ) from exc
    cls: type[Any] = getattr(module, attr)
    for requirement in getattr(cls, "requires", ()):
        if importlib.util.find_spec(requirement) is None:
            raise ConfigError(
                f"the '{name}' backend needs the '{requirement}' package; "
                f"{install_hint(name, requirement)}"
            )
    return cls


def enabled_backends(cfg: Mapping[str, Any]) -> list[str]:
    """Names of the tracker backends a resolved config enables, in a stable order."""
    names = [name for name, flag in BACKEND_FLAGS.items() if cfg.get(flag)]
    names.extend(name for name in cfg.get("trackers") or {} if name not in names)
    return names
