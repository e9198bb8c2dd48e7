"""Fanout: the one place records are handed to tracker exporters.

The Logger, the GPU bridge, the pending-step checkpointer and the NeMo RL / verl drop-ins all
send through a :class:`Fanout`, so that which trackers get a record is decided in one place.
``send`` only appends to each exporter's queue (see :mod:`otel_rl.delivery.channel`): it never
blocks on a tracker, except under ``export.on_full: block`` as documented.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from otel_rl.delivery.service_link import ServiceTracker

if TYPE_CHECKING:
    from otel_rl.core.records import Record

#: An ``otel_rl.exporters.TrackerExporter``: the exporters are a layer above delivery, so the
#: fan-out names them without importing them (it only calls ``submit`` and reads ``name``).
TrackerExporter = Any

#: Which exporters get a record: all of them (``None``), those named, or those a test accepts.
Selector = Collection[str] | Callable[[TrackerExporter], bool] | None


class Fanout:
    """The tracker exporters of one Logger, in the order they were attached."""

    def __init__(self, exporters: Sequence[TrackerExporter] = ()) -> None:
        self.exporters: list[TrackerExporter] = list(exporters)

    def __iter__(self) -> Iterator[TrackerExporter]:
        return iter(self.exporters)

    def __len__(self) -> int:
        return len(self.exporters)

    def send(self, record: Record | Any, to: Selector = None) -> list[str]:
        """Queue ``record`` for the selected exporters; returns the names of those reached."""
        reached = []
        remote: list[ServiceTracker] = []
        for exporter in self.select(to):
            if type(exporter) is ServiceTracker:
                remote.append(exporter)  # one frame for all the trackers of a process
            else:
                exporter.submit(record)
            reached.append(exporter.name)
        if remote:
            remote[0].link.send(record, [e.name for e in remote])
        return reached

    def select(self, to: Selector = None) -> list[TrackerExporter]:
        if to is None:
            return list(self.exporters)
        if callable(to):
            return [e for e in self.exporters if to(e)]
        return [e for e in self.exporters if e.name in to]

    def named(self, name: str) -> TrackerExporter | None:
        return next((e for e in self.exporters if e.name == name), None)
