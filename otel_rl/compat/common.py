"""Helpers both drop-ins share: plain config values (OmegaConf resolved) and the exit code of a run
ending now."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from otel_rl.core.errors import ConfigError

if TYPE_CHECKING:
    from otel_rl.logger import Logger
    from otel_rl.telemetry.timing import PhaseTimer

__all__ = ["CoreOutputs", "exit_code_now", "plain_config"]


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
    """The exit code for a run finished right now
    (:func:`otel_rl.process.lifecycle.exit_code_now`)."""
    from otel_rl.process.lifecycle import exit_code_now as now

    return now()


class CoreOutputs:
    """What both drop-ins expose of the core :class:`otel_rl.Logger` they wrap (``self.core``):
    the operator outputs, the monitors and ``timer``, as the core Logger has them."""

    core: Logger

    @property
    def prometheus_url(self) -> str | None:
        """The ``/metrics`` URL this run serves (``prometheus.enabled``), else ``None``."""
        return self.core.prometheus_url

    @property
    def otlp_endpoint(self) -> str | None:
        """Where OTLP metrics are pushed (``otlp.enabled``), else ``None``."""
        return self.core.otlp_endpoint

    @property
    def rollout_monitor(self) -> Any:
        """The inference-engine monitor (``rollout_monitoring``), else ``None``."""
        return self.core.rollout_monitor

    def timer(self, name: str) -> PhaseTimer:
        """Time a block into ``timing/<name>`` (seconds), in the row of the run's next step."""
        return self.core.timer(name)


def finish_when_collected(owner: Any) -> None:
    """``owner.finish()`` from its finalizer, unless it finished (verl finishes its backends
    when they are collected); never raises."""
    try:
        if not getattr(owner, "finished", True):
            from otel_rl.process.lifecycle import exit_code_hint

            owner.finish(exit_code=exit_code_hint())
    except Exception:  # never raise from a finalizer
        pass
