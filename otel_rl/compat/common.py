"""Helpers both drop-ins share: plain config values and the exit code of a run ending now."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["exit_code_now", "plain"]


def plain(value: Any) -> Any:
    """Mappings (OmegaConf containers included) as dicts with string keys, tuples as lists,
    recursively; every other value as it is."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def exit_code_now() -> int:
    """The exit code for a run finished right now (:func:`otel_rl.lifecycle.exit_code_now`)."""
    from otel_rl.lifecycle import exit_code_now as now

    return now()
