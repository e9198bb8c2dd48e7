"""Redact secrets from hyperparameters before they reach any tracker or log line."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***REDACTED***"

_SECRET_KEY = re.compile(r"api[_-]?key|token|secret|password|passwd|credential|auth", re.I)
_SECRET_ENV = ("WANDB_API_KEY", "SWANLAB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_PASSWORD", "OTEL_EXPORTER_OTLP_HEADERS",
               "OTEL_EXPORTER_OTLP_METRICS_HEADERS")


def secret_values(extra: Iterable[str] = ()) -> set[str]:
    """Values that must never be shown: known secret env vars plus ``extra`` (e.g. OTLP headers)."""
    values = {os.environ[name] for name in _SECRET_ENV if os.environ.get(name)}
    for header_list in (os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", ""),):
        for item in header_list.split(","):
            _, _, value = item.partition("=")
            if value.strip():
                values.add(value.strip())
    values.update(v for v in extra if v)
    return {v for v in values if len(v) >= 4}


def redact(params: Mapping[str, Any], secrets: set[str] | None = None) -> dict[str, Any]:
    """Copy of flat ``params`` with secret-looking keys and known secret values replaced."""
    secrets = secret_values() if secrets is None else secrets
    out: dict[str, Any] = {}
    for key, value in params.items():
        if _SECRET_KEY.search(str(key).rsplit(".", 1)[-1]) and value not in (None, "", False):
            out[key] = REDACTED
        elif isinstance(value, str) and any(s in value for s in secrets):
            text = value
            for s in secrets:
                text = text.replace(s, REDACTED)
            out[key] = text
        else:
            out[key] = value
    return out


def flatten_params(params: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists are kept as values."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    for k, v in params.items():
        walk(str(k), v)
    return out


def redact_nested(value: Any, secrets: set[str] | None = None) -> Any:
    """Copy of a nested config with secret-looking keys and known secret values redacted."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if _SECRET_KEY.search(str(key)) and isinstance(item, (str, bytes)) and item:
                out[key] = REDACTED
            else:
                out[key] = redact_nested(item, secrets)
        return out
    if isinstance(value, (list, tuple)):
        return [redact_nested(v, secrets) for v in value]
    if isinstance(value, str) and any(s in value for s in secrets):
        for s in secrets:
            value = value.replace(s, REDACTED)
        return value
    return value
