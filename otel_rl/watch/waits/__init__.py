"""What a thread waits on, one module per kind of wait: each has its own wait type, how it
recognises the wait in the thread's frames, and how it follows it beyond the thread.

- :mod:`~otel_rl.watch.waits.ray_task`: ``ray.get``/``ray.wait``, to the task, actor and node
- :mod:`~otel_rl.watch.waits.collective`: a ``torch.distributed`` collective of a group
- :mod:`~otel_rl.watch.waits.http_request`: an HTTP client, to the engines on that host
- :mod:`~otel_rl.watch.waits.child_process`: a subprocess
- :mod:`~otel_rl.watch.waits.sync`: a queue, event, future, thread, asyncio task, or a lock, to
  the thread that holds it

:func:`recognise` tries them in that order; a stack in none of them is a :class:`CodeWait` (the
line the code is on).
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar

from otel_rl.watch import locks
from otel_rl.watch.locks import where as _where
from otel_rl.watch.waits import child_process, collective, http_request, ray_task, sync
from otel_rl.watch.waits.base import Following, Wait, frames_of, training_thread, user_frame

__all__ = ["CodeWait", "Following", "Wait", "frames_of", "recognise", "training_thread",
           "user_frame"]  # fmt: skip


@dataclass
class CodeWait(Wait):
    """No known wait: the thread is at a line of the program's code."""

    kind: ClassVar[str] = "code"


def recognise(frame: FrameType | None, user_locals: bool = True) -> Wait | None:
    """What the thread whose innermost frame is ``frame`` waits on, from its frames' code and
    locals; ``None`` for an empty stack. Without ``user_locals`` only the locals of the libraries'
    own frames are read (which end with the wait), never those of the program's frames: reading
    a frame's locals from another thread leaves a copy of them on the frame, holding what the
    program has since let go (a batch, a tensor) until it reads them again. Locks are then not
    recognised."""
    frames = frames_of(frame)
    if not frames:
        return None
    for find in (ray_task.recognise, collective.recognise, http_request.recognise,
                 child_process.recognise, sync.recognise_loop):  # fmt: skip
        found: Wait | None = find(frames)
        if found is not None:
            return found
    found = sync.recognise(frames, user_locals)
    if found is not None:
        return found
    code = user_frame(frames)
    line = linecache.getline(code.f_code.co_filename, code.f_lineno).split("  #")[0].strip()
    words = f"{_where(code)}" + (f": {line}" if line else "")
    wait = CodeWait(words, "its Python stack (no known wait recognised in it)")
    try:
        unread = locks.unread(frames[0]) if user_locals else None
    except Exception:  # reading the frame's source and bytecode
        unread = None
    if unread is not None:
        wait.unknown = f"whether {unread} is a lock (the verdict does not run the program's code " \
                       "to read it)"  # fmt: skip
    return wait
