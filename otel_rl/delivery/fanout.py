"""Fanout: the one place records are handed to the trackers' deliveries.

The Logger, the GPU bridge, the pending-step checkpointer and the NeMo RL / verl drop-ins all
send through a :class:`Fanout`, so that which trackers get a record is decided in one place.
``send`` only appends to each delivery's queue (see :mod:`otel_rl.delivery.channel`): it never
blocks on a tracker, except under ``export.on_full: block`` as documented.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from otel_rl.core.failures import Failure
from otel_rl.delivery.tracker import Tracker


class Route(Protocol):
    """Where records for some trackers go: a tracker's own channel, or the pipe to the delivery
    process, which carries one record once for all the trackers it holds."""

    def send(self, record: Any, names: Sequence[str]) -> None: ...


class Delivery(Protocol):
    """One tracker's delivery as a run sees it: a :class:`~otel_rl.delivery.channel.Channel`
    here, or a :class:`~otel_rl.delivery.service_link.ServiceTracker` for a tracker of the
    delivery process. Its counters and state are the delivery's, never the tracker's."""

    name: str

    @property
    def tracker(self) -> Tracker | None:
        """The tracker, here; ``None`` for one that lives in the delivery process."""
    @property
    def tracker_class(self) -> type[Tracker]:
        """The tracker's class, wherever the tracker lives (what it supports)."""
    @property
    def route(self) -> Route: ...
    @property
    def started(self) -> bool: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def lost(self) -> dict[str, int]: ...
    @property
    def pending(self) -> int: ...
    @property
    def failure(self) -> Failure | None: ...
    @property
    def undelivered(self) -> int: ...
    @property
    def spool_dir(self) -> Path | None: ...
    @property
    def resume_config(self) -> Mapping[str, Any]: ...

    def submit(self, record: Any) -> None: ...
    def force_flush(self, timeout_millis: float = 30_000) -> bool: ...
    def apply(self, setup: Callable[[Any], object]) -> None: ...
    def abandon_after_fork(self) -> None: ...


#: Which deliveries get a record: all of them (``None``), those named, or those a test accepts.
Selector = Collection[str] | Callable[[Delivery], bool] | None


class Fanout:
    """The tracker deliveries of one Logger, in the order they were attached (fixed: a run's
    trackers are known when it starts)."""

    def __init__(self, deliveries: Sequence[Delivery] = ()) -> None:
        self.exporters: tuple[Delivery, ...] = tuple(deliveries)
        # Every record of a step goes to all the deliveries: their routes are grouped once, not
        # at each send on the training thread.
        self._to_all = _grouped(self.exporters)

    def __iter__(self) -> Iterator[Delivery]:
        return iter(self.exporters)

    def __len__(self) -> int:
        return len(self.exporters)

    def send(self, record: Any, to: Selector = None) -> list[str]:
        """Queue ``record`` for the selected trackers; returns the names of those reached."""
        groups = self._to_all if to is None else _grouped(self.select(to))
        reached: list[str] = []
        for route, names in groups:
            route.send(record, names)
            reached += names
        return reached

    def select(self, to: Selector = None) -> list[Delivery]:
        if to is None:
            return list(self.exporters)
        if callable(to):
            return [e for e in self.exporters if to(e)]
        return [e for e in self.exporters if e.name in to]

    def named(self, name: str) -> Delivery | None:
        return next((e for e in self.exporters if e.name == name), None)


def _grouped(deliveries: Sequence[Delivery]) -> list[tuple[Route, tuple[str, ...]]]:
    """The deliveries by route, in order: one frame to the delivery process carries a record
    for all the trackers it holds. The names are a tuple: a route may keep them."""
    groups: dict[int, tuple[Route, list[str]]] = {}
    for delivery in deliveries:
        route = delivery.route
        groups.setdefault(id(route), (route, []))[1].append(delivery.name)
    return [(route, tuple(names)) for route, names in groups.values()]
