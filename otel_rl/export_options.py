"""The ``export.*`` settings a tracker's delivery follows, and their defaults: the one place
they are declared (the config schema takes its defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}, got {self.on_full!r}")
