"""One deadline for the end of a run, shared by every part that stops.

``finish()`` stops the monitors, the trackers, the OTel pipeline and the tracer. Each of them
can wait on the network (a rollout endpoint, a GPU node, a tracker's server, the collector), and
one after the other their own timeouts added up to about a minute. Here the parts stop in
parallel, each in a daemon thread, and the caller waits only until the deadline: a part still
stopping then is left behind and named, so that ``finish()`` returns in time whatever hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from otel_rl.process.fork_safe_log import log as _log

#: The longest duration a setting may have: ~116 days. Python's waits overflow beyond ~292 years
#: (``threading.TIMEOUT_MAX``) and deadlines built from them beyond the clock's range; "forever"
#: is better said with a large finite number than crash a thread at the first wait.
MAX_SECONDS = 1e7

#: Seconds after the deadline that ``finish()`` still waits: a tracker that gave up at the
#: deadline counts what it left and closes its client.
SHUTDOWN_GRACE = 1.0


class Deadline:
    """A point in time (``time.monotonic()``) that every part of a shutdown gives up at."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        # ``flush(float("inf"))`` means as long as it takes: MAX_SECONDS; NaN is no time at all.
        self.at = time.monotonic() + max(0.0, min(seconds, MAX_SECONDS))

    def left(self) -> float:
        """Seconds until the deadline (0 once it has passed)."""
        return max(0.0, self.at - time.monotonic())

    def share(self, fraction: float) -> Deadline:
        """An earlier deadline, ``fraction`` of the time left from now: a first stage that
        must leave the rest to the stages after it."""
        early = Deadline(0.0)
        early.at = min(self.at, time.monotonic() + fraction * self.left())
        return early


#: A stopping part: a name for the warning if it is late, and the call that stops it.
Part = tuple[str, Callable[[], object]]


Stopping = list[tuple[str, threading.Thread]]


def start_stopping(parts: Sequence[Part]) -> Stopping:
    """Start every part's stop in its own daemon thread (one that hangs is left behind)."""
    stopping = []
    for name, stop in parts:
        thread = threading.Thread(
            target=_stop_one, args=(name, stop), name=f"otel-rl-stop {name}", daemon=True
        )
        thread.start()
        stopping.append((name, thread))
    return stopping


def still_stopping(stopping: Stopping, until: float) -> list[str]:
    """Wait for the parts until ``until`` (a ``time.monotonic()`` value); the names of those
    still stopping then. A part that raised is named in a warning and counts as stopped."""
    for _name, thread in stopping:
        thread.join(max(0.0, until - time.monotonic()))
    return [name for name, thread in stopping if thread.is_alive()]


def stop_in_parallel(parts: Sequence[Part], until: float) -> list[str]:
    """Stop the parts in parallel, waiting until ``until``; the names of those still stopping."""
    return still_stopping(start_stopping(parts), until)


def _stop_one(name: str, stop: Callable[[], object]) -> None:
    try:
        stop()
    except Exception as exc:  # one part's failure must not keep the others from stopping
        _log.warning("otel-rl: %s: stopping failed: %s: %s", name, type(exc).__name__, exc)
