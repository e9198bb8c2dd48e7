"""Logger configuration: NeMo RL's logger keys plus otel-rl's own, validated up front.

A config is a plain mapping (or a YAML file). ``resolve_config`` merges it over the defaults,
rejects unknown keys with the nearest valid one, and checks types, so a typo fails at start-up
instead of silently disabling a tracker.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otel_rl.errors import ConfigError

#: Sub-dicts that are handed to a tracker's SDK as they are (any key allowed).
PASSTHROUGH_SECTIONS = ("wandb", "mlflow", "swanlab", "trackio", "trackers")

#: Tracker backends and the config flag that enables each.
BACKEND_FLAGS = {
    "tensorboard": "tensorboard_enabled",
    "jsonl": "jsonl_enabled",
    "console": "console_enabled",
    "wandb": "wandb_enabled",
    "mlflow": "mlflow_enabled",
    "swanlab": "swanlab_enabled",
    "trackio": "trackio_enabled",
}

DEFAULTS: dict[str, Any] = {
    "log_dir": "logs",
    # NeMo RL's keys
    "wandb_enabled": False,
    "tensorboard_enabled": False,
    "mlflow_enabled": False,
    "swanlab_enabled": False,
    "monitor_gpus": False,
    "num_val_samples_to_print": 0,
    # endpoints: static "http://host:port/metrics" list instead of ray.nodes() discovery;
    # timeout: seconds for one node's whole request (see docs/gpu-monitoring.md)
    "gpu_monitoring": {
        "collection_interval": 10.0,
        "flush_interval": 10.0,
        "endpoints": [],
        "timeout": 5.0,
    },
    "wandb": {},
    "mlflow": {},
    "swanlab": {},
    "tensorboard": {"log_dir": None},
    # otel-rl's keys
    "console_enabled": False,
    "jsonl_enabled": True,
    "trackio_enabled": False,
    "trackio": {},
    "jsonl": {"path": None},
    "console": {"every": 1},
    "otlp": {
        "enabled": False,
        "endpoint": None,
        "protocol": None,
        # null: the OTEL_* env var, then otel-rl's default (see otel_rl/otlp.py)
        "interval": None,
        "timeout": None,
        "headers": {},
        "insecure": None,
        "histogram": None,
    },
    "prometheus": {"enabled": False, "host": "127.0.0.1", "port": 9464},
    "export": {
        "queue_size": 10_000,
        "on_full": "spool",
        "shutdown_timeout": 30.0,
        "retry_max_backoff": 10.0,
        "spool": True,
        "fsync_interval": 1.0,
        "handle_signals": True,
    },
    "strict": False,
    "capture_global_meters": True,
    "service_name": None,
    "run_id": None,
    "experiment": None,
    "role": "driver",
    "rank": 0,
    # how worker metrics combine across ranks, by key or glob pattern (docs/distributed.md)
    "reductions": {},
    "tracing": {"enabled": False},
    # more trackers by registry name, each with its options: {"mytracker": {...}}; built-in
    # and third-party ones (the otel_rl.exporters entry-point group), see docs/backends/
    "trackers": {},
}

_ON_FULL = ("spool", "block", "drop_oldest")


def load_config(source: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """Return the user's raw config from a mapping, a YAML file path, or ``None``.

    A YAML file may hold the logger config at its top level or under a ``logger:`` key (as in
    NeMo RL's experiment files).
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
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


def resolve_config(source: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """Merge ``source`` over :data:`DEFAULTS` and validate it; returns a new dict."""
    user = load_config(source)
    cfg = copy.deepcopy(DEFAULTS)
    _merge(cfg, user, path="")
    _check(cfg)
    return cfg


def enabled_backends(cfg: Mapping[str, Any]) -> list[str]:
    """Names of the tracker backends a resolved config enables, in a stable order."""
    names = [name for name, flag in BACKEND_FLAGS.items() if cfg.get(flag)]
    names.extend(name for name in cfg.get("trackers") or {} if name not in names)
    return names


def _merge(into: dict[str, Any], user: Mapping[str, Any], path: str) -> None:
    for key, value in user.items():
        where = f"{path}{key}"
        if not isinstance(key, str) or key not in into:
            raise ConfigError(_unknown_key_message(key, into, where))
        default = into[key]
        if key in PASSTHROUGH_SECTIONS and not path:
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"logger config '{where}' must be a mapping, got {value!r}")
            into[key] = dict(value)
        elif isinstance(default, dict) and key not in ("headers", "reductions"):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"logger config '{where}' must be a mapping, got {value!r}")
            _merge(default, value, path=f"{where}.")
        else:
            into[key] = value


def _unknown_key_message(key: object, known: Mapping[str, Any], where: str) -> str:
    near = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(sorted(known))}"
    return f"unknown logger config key '{where}'{hint}"


def _check(cfg: dict[str, Any]) -> None:
    for flag in [*BACKEND_FLAGS.values(), "monitor_gpus", "strict", "capture_global_meters"]:
        _expect(cfg, flag, bool)
    _expect(cfg, "log_dir", (str, os.PathLike))
    _expect(cfg, "num_val_samples_to_print", int)
    for name, options in list(cfg["trackers"].items()):
        if options is None:
            cfg["trackers"][name] = {}
        elif not isinstance(name, str) or not isinstance(options, Mapping):
            raise ConfigError(
                f"logger config 'trackers.{name}' must map a tracker name to its options"
            )
    gpu = cfg["gpu_monitoring"]
    for key in ("collection_interval", "flush_interval", "timeout"):
        if not isinstance(gpu[key], (int, float)) or gpu[key] <= 0:
            raise ConfigError(f"logger config 'gpu_monitoring.{key}' must be a positive number")
    endpoints = gpu["endpoints"]
    if endpoints is None:
        gpu["endpoints"] = []
    elif isinstance(endpoints, str) or not all(isinstance(e, str) for e in endpoints):
        raise ConfigError("logger config 'gpu_monitoring.endpoints' must be a list of URLs")
    _check_gpu_sources(cfg)
    export = cfg["export"]
    if export["on_full"] not in _ON_FULL:
        raise ConfigError(
            f"logger config 'export.on_full' must be one of {', '.join(_ON_FULL)}, "
            f"got {export['on_full']!r}"
        )
    if not isinstance(export["queue_size"], int) or export["queue_size"] < 1:
        raise ConfigError("logger config 'export.queue_size' must be a positive integer")
    if export["on_full"] == "spool" and not export["spool"]:
        raise ConfigError(
            "logger config 'export.on_full: spool' needs 'export.spool: true'; "
            "choose 'block' or 'drop_oldest' without a spool"
        )
    if not isinstance(export["fsync_interval"], (int, float)) or export["fsync_interval"] <= 0:
        raise ConfigError("logger config 'export.fsync_interval' must be a positive number")
    if cfg["console"]["every"] < 1:
        raise ConfigError("logger config 'console.every' must be >= 1")
    if not isinstance(cfg["tracing"]["enabled"], bool):
        raise ConfigError("logger config 'tracing.enabled' must be bool")
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


def _expect(cfg: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> None:
    value = cfg[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"logger config '{key}' must be {names}, got {value!r}")
