"""Helpers both drop-ins share: plain config values (OmegaConf resolved) and the exit code of a run
ending now."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from otel_rl.errors import ConfigError

__all__ = ["exit_code_now", "plain_config"]


def plain_config(value: Any, where: str = "config") -> Any:
    """``value`` as plain dicts and lists: OmegaConf containers (at any depth) through
    ``OmegaConf.to_container(resolve=True)``, so ``${...}`` interpolations are resolved; other
    mappings with string keys, tuples as lists. A ``${...}`` that cannot be resolved is a
    :class:`ConfigError` naming ``where``."""
    omegaconf = sys.modules.get("omegaconf")  # an OmegaConf object means it is imported already
    if omegaconf is not None and isinstance(value, omegaconf.Container):
        try:
            value = omegaconf.OmegaConf.to_container(value, resolve=True)
        except Exception as exc:  # a custom resolver may raise anything, not only omegaconf's
            detail = " ".join(str(exc).split())
            raise ConfigError(f"{where}: cannot resolve the OmegaConf config: {detail}") from None
    if isinstance(value, Mapping):
        return {str(k): plain_config(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(v, where) for v in value]
    return value


def exit_code_now() -> int:
    """The exit code for a run finished right now (:func:`otel_rl.lifecycle.exit_code_now`)."""
    from otel_rl.lifecycle import exit_code_now as now

    return now()
