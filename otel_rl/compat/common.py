"""Helpers both drop-ins share: plain config values and the exit code of a run ending now."""

from __future__ import annotations

import sys
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
    """The exit code for a run finished right now: from the exception being handled or
    propagating, else from the process's exit path (0 when all is well)."""
    from otel_rl.exit import exit_code_hint, exit_code_of

    exc_type, exc, _ = sys.exc_info()
    if exc_type is not None:
        return exit_code_of(exc_type, exc)
    return exit_code_hint()
