"""The library's own log, written so that a ``fork`` never copies a half-written stream.

A thread that writes to a buffered stream holds that stream's internal lock, which Python does
not renew in a fork child: if the process forks while one of otel-rl's background threads is
inside a write to a log handler's stream (or to stderr, for the console tracker), the child's
first write to that stream waits forever on a lock no thread of the child holds. The child need
not use otel-rl at all: ``multiprocessing`` flushes stdout when a child exits, and any log line
through the same handler hangs.

So every such write takes one lock, and ``fork`` takes it too (``os.register_at_fork``): a fork
waits for a write in progress to end, and no write starts while a fork copies the process. The
lock is taken only when a line is actually written (warnings are rare; none is on the hot path).
A fork waits for the write it meets at most :data:`FORK_WAIT_S`: a stream stuck longer than
that is stuck for the child too, whatever otel-rl does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

__all__ = ["fork_safe", "log", "writing_shared_stream"]

#: The longest a ``fork`` waits for a write in progress (seconds); a write stuck longer (a log
#: handler blocked on a full pipe) is left to it.
FORK_WAIT_S = 5.0

_writing = threading.RLock()  # reentrant: a handler may itself log through otel-rl
_forking = threading.local()  # per forking thread: did its fork get the lock (two may fork)


@contextlib.contextmanager
def writing_shared_stream() -> Iterator[None]:
    """Hold off ``fork`` while the calling thread writes to a stream the process shares."""
    with _writing:
        yield


class _ForkSafeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # name the caller, not us
            with _writing:
                try:
                    self.logger.log(level, msg, *args, **kwargs)
                except Exception as exc:  # a handler that raises: never the caller's failure
                    # (a tracker's write retried, a status thread ended, a training step).
                    with contextlib.suppress(Exception):
                        line = str(msg) % args if args else str(msg)
                        sys.stderr.write(
                            f"otel-rl: a handler of the otel_rl logger raised "
                            f"{type(exc).__name__}: {exc}; the line was: {line}\n"
                        )

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs  # a caller's own ``extra`` passes unchanged (the adapter has none)


def fork_safe(logger: logging.Logger) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """``logger``, its lines written under the fork guard."""
    return _ForkSafeLog(logger, {})


#: The ``otel_rl`` logger; configure it as usual with ``logging.getLogger("otel_rl")``.
log = fork_safe(logging.getLogger("otel_rl"))


def _before_fork() -> None:
    _forking.held = _writing.acquire(timeout=FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_forking, "held", False):
        _forking.held = False
        _writing.release()


def _after_fork_in_child() -> None:
    global _writing
    _writing = threading.RLock()  # the parent's is held (by the forking thread)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
