"""The ``export.*`` settings a tracker's delivery follows, and their defaults: the one place
they are declared (the config schema takes its defaults from here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ON_FULL = ("spool", "block", "drop_oldest")
#: ``export.shutdown_timeout``: the deadline of ``finish()`` and exit, in seconds.
SHUTDOWN_TIMEOUT = 30.0


@dataclass(frozen=True)
class ExportOptions:
    """The ``export.*`` settings one tracker's delivery follows."""

    queue_size: int = 10_000
    on_full: str = "spool"
    retry_max_backoff: float = 10.0
    fsync_interval: float = 1.0
    #: The run's ``export.shutdown_timeout``, which the exit message names (a Logger's
    #: ``finish()`` gives a tracker what is left of it; None: the timeout ``shutdown`` is given).
    shutdown_timeout: float | None = None

    @classmethod
    def from_section(cls, export: Mapping[str, Any]) -> ExportOptions:
        """The options of a resolved ``export:`` config section."""
        return cls(
            queue_size=int(export["queue_size"]),
            on_full=str(export["on_full"]),
            retry_max_backoff=float(export["retry_max_backoff"]),
            fsync_interval=float(export["fsync_interval"]),
            shutdown_timeout=float(export["shutdown_timeout"]),
        )

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}, got {self.on_full!r}")
