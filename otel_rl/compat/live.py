"""The most recent live (not finished) instance of a class, found without passing it around.

NeMo RL's ``print_message_log_samples`` and verl's ``ValidationGenerationsLogger`` are called
without a logger; they reach the trackers of the logger the training script created.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LiveRegistry(Generic[T]):
    """Weak references to instances, newest last; instances say ``finished`` when done."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[T]] = []
        self._lock = threading.Lock()

    def add(self, obj: T) -> None:
        with self._lock:
            self._refs = [r for r in self._refs if r() is not None]
            self._refs.append(weakref.ref(obj))

    def latest(self) -> T | None:
        with self._lock:
            for ref in reversed(self._refs):
                obj = ref()
                if obj is not None and not getattr(obj, "finished", False):
                    return obj
        return None


#: Live NeMo RL-compatible Loggers (``print_message_log_samples`` logs to the newest). Kept here,
#: not in ``nemo_rl``, so that the samples module needs nothing from the Logger's module.
NEMO_RL_LOGGERS: LiveRegistry[Any] = LiveRegistry()
#: Live verl-compatible ``Tracking`` objects (``ValidationGenerationsLogger`` writes through the
#: newest).
VERL_TRACKINGS: LiveRegistry[Any] = LiveRegistry()
