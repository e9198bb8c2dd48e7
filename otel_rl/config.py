"""Logger configuration: NeMo RL's logger keys plus otel-rl's own, validated up front.

A config is a plain mapping (or a YAML file). ``resolve_config`` merges it over the defaults and
checks every key against the one declaration in :mod:`otel_rl.config_schema` (types, bounds,
choices; unknown keys get the nearest valid one), then the settings of each enabled tracker
(:mod:`otel_rl.tracker_settings`), so a mistake fails when the Logger is built instead of
silently switching a feature on or failing later on a tracker's thread.

The schema needs pydantic, so it is imported on the first ``resolve_config`` (or ``DEFAULTS``)
and ``import otel_rl`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otel_rl.errors import ConfigError

#: Sub-dicts that are handed to a tracker's SDK as they are; the keys of an enabled tracker's
#: section are checked against what that tracker accepts (otel_rl.tracker_settings).
PASSTHROUGH_SECTIONS = ("wandb", "mlflow", "swanlab", "trackio", "trackers")

#: Tracker backends and the config flag that enables each.


def load_config(source: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """Return the user's raw config from a mapping, a YAML file path, or ``None``.

    A YAML file may hold the logger config at its top level or under a ``logger:`` key (as in
    NeMo RL's experiment files).
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            "the logger config must be a mapping or the path of a YAML file, got "
            f"{type(source).__name__}"
        )
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"logger config file not found: {path}")
    import yaml

    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    if "logger" in data and isinstance(data["logger"], Mapping):
        data = data["logger"]
    return dict(data)


def resolve_config(source: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """Merge ``source`` over the defaults and validate it; returns a new plain nested dict.

    Raises :class:`ConfigError` naming each wrong key, its value and what it takes.
    """
    from otel_rl.config_schema import validate
    from otel_rl.tracker_settings import check_tracker_settings

    cfg = validate(load_config(source))
    _check(cfg)
    check_tracker_settings(cfg)
    return cfg


def __getattr__(name: str) -> Any:
    # DEFAULTS comes from the schema, which imports pydantic: built on first use only.
    if name == "DEFAULTS":
        from otel_rl.config_schema import defaults

        value = defaults()
        globals()["DEFAULTS"] = value
        return value
    raise AttributeError(f"module 'otel_rl.config' has no attribute {name!r}")


#: Every key with its default (a plain nested dict, from :mod:`otel_rl.config_schema`).
DEFAULTS: dict[str, Any]


def _check(cfg: dict[str, Any]) -> None:
    """What involves several keys or another module's rules (the schema checked each key)."""
    export = cfg["export"]
    if export["on_full"] == "spool" and not export["spool"]:
        raise ConfigError(
            "logger config 'export.on_full: spool' needs 'export.spool: true'; "
            "choose 'block' or 'drop_oldest' without a spool"
        )
    _check_gpu_sources(cfg)
    from otel_rl.distributed.reductions import check_reductions

    check_reductions(cfg["reductions"])
    from otel_rl.otlp import check_otlp_config

    check_otlp_config(cfg["otlp"])


def _check_gpu_sources(cfg: Mapping[str, Any]) -> None:
    import importlib.util

    from otel_rl.ray.discovery import endpoint_targets

    endpoints = cfg["gpu_monitoring"]["endpoints"]
    try:
        endpoint_targets(endpoints)
    except ValueError as exc:
        raise ConfigError(f"logger config 'gpu_monitoring.endpoints': {exc}") from exc
    if cfg["monitor_gpus"] and not endpoints and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "monitor_gpus needs Ray to find the nodes (pip install 'otel-rl[ray]') or a "
            "list of metrics endpoints in gpu_monitoring.endpoints"
        )
