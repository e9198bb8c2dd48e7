"""The cores background work may use: every core the training thread may use, but its own.

When every core is busy, the kernel gives each runnable thread a slice of a millisecond or more
in turn, whatever its nice value, and it wakes a thread on the core of the thread that woke it.
So a delivery thread or the delivery process, woken by a record, takes the training thread's
core for a slice, and ``log_metrics`` waits it out: 1.5-6 ms at a time on 2 cores, the tail's
max (docs/performance.md, "The tail"). Kept off that core, the delivery shares the others and
the training thread keeps its own. The scheduler leaves a thread where it runs while nothing
else wants that core, so the training thread stays there.

The training process's own background threads keep off it too, but only where that leaves
them two cores or more: kept to the one core left, a thread holding the GIL waits there behind
whatever else runs on it (the delivery process, a local tracker server), and the training thread
waits for the GIL (measured on 2 cores: ``training_thread``'s p99 went from ~0.1 to ~0.45 ms).

Linux only (elsewhere nothing changes), and only where the training thread may use two cores
or more: with one, background work shares it as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["current_core", "keep_process_to", "keep_to", "spare_cores", "thread_cores"]

_PROCESSOR_FIELD = 36  # /proc/<pid>/stat's field 39, counted after the command's closing ")"


def current_core() -> int | None:
    """The core the calling thread runs on now (None where the kernel does not say)."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[_PROCESSOR_FIELD])
    except (OSError, IndexError, ValueError):
        return None


def spare_cores() -> frozenset[int] | None:
    """The cores the calling thread may use but the one it runs on; None when that leaves none
    (one core allowed) or the platform cannot say or set which cores a thread uses."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    core = current_core()
    allowed = os.sched_getaffinity(0)
    if core is None or core not in allowed or len(allowed) < 2:
        return None
    return frozenset(allowed - {core})


def thread_cores(spare: frozenset[int] | None) -> frozenset[int] | None:
    """The cores for background threads of the training process, given its ``spare`` ones:
    None (wherever the kernel puts them) when fewer than two are spare."""
    return spare if spare is not None and len(spare) >= 2 else None


def keep_to(cores: Iterable[int] | None) -> None:
    """Keep the calling thread (and the threads it starts from now on) to ``cores``."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):  # e.g. a core taken away since: stays as it was
            os.sched_setaffinity(0, set(cores))


def keep_process_to(cores: Iterable[int] | None) -> None:
    """Keep every thread of this process to ``cores``, those running now and those to come."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        return
    wanted = set(cores)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, wanted)
