"""A wait on the standard library's means of waiting for another thread or process: a queue, a
thread's end, an event, condition, barrier or semaphore, a future, a ``multiprocessing`` queue or
pipe, an asyncio loop's tasks; and a wait to take a lock, followed to the thread that holds it,
what that one waits on in turn, and so on to a thread that waits on something else or a
deadlock."""

from __future__ import annotations

import linecache
import queue
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

from otel_rl.watch import locks
from otel_rl.watch.chain import Link
from otel_rl.watch.locks import where as _where
from otel_rl.watch.stalls import seconds
from otel_rl.watch.waits.base import Following, Wait
from otel_rl.watch.waits.base import in_module as _in
from otel_rl.watch.waits.base import local_vars as _locals
from otel_rl.watch.waits.child_process import recognise as _subprocess_wait
from otel_rl.watch.waits.http_request import recognise as _http_wait
from otel_rl.watch.waits.ray_task import recognise as _ray_wait

__all__ = ["LockWait", "SyncWait", "recognise", "recognise_loop"]

_SYNC_MODULES = ("/queue.py", "/threading.py", "/concurrent/futures/", "/multiprocessing/")
_STDLIB_QSIZE = (queue.Queue.qsize, queue.SimpleQueue.qsize)
#: The most holders followed from lock to lock.
_HOLDERS = 4


@dataclass
class SyncWait(Wait):
    kind: ClassVar[str] = "sync"


@dataclass
class LockWait(Wait):
    kind: ClassVar[str] = "lock"
    lock: locks.Taken | None = None  # the lock being taken

    def follow(self, following: Following) -> None:
        _holder_links(self, following)


def recognise_loop(frames: list[FrameType]) -> Wait | None:
    """A thread running an asyncio loop: what its tasks await (a suspended coroutine is on no
    thread's stack; its frames are followed through ``cr_await``)."""
    loop = next((_locals(f).get("self") for f in frames
                 if _in(f, "/asyncio/base_events.py")
                 and f.f_code.co_name in ("run_until_complete", "run_forever")), None)  # fmt: skip
    if loop is None:
        return None
    import asyncio

    try:
        tasks = list(asyncio.all_tasks(loop))
    except Exception:  # the loop closed meanwhile
        return None
    pending = [(task, _awaited_frames(task.get_coro())) for task in tasks if not task.done()]
    for task, chain in pending:
        for find in (_ray_wait, _http_wait, _subprocess_wait):
            found: Wait | None = find(chain) if chain else None
            if found is not None:
                found.words += f" (asyncio task {task.get_name()!r})"
                return found
    for task, chain in pending:  # none of those: what the first task awaits, and where
        user = next((frame for frame in chain if not _in(frame, "/asyncio/")), None)
        if user is None:
            continue
        line = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
        code = chain[0].f_code  # co_qualname: Python 3.11 and later
        awaited = getattr(code, "co_qualname", code.co_name) if chain[0] is not user else None
        words = f"asyncio task {task.get_name()!r} at {_where(user)}"
        words += f": {line}" if line else ""
        if awaited is not None:
            words = f"{awaited} in {words}"
        return SyncWait(words, "its asyncio tasks' suspended coroutines (cr_await)")
    return None


def _awaited_frames(coro: Any) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, innermost first."""
    frames: list[FrameType] = []
    while coro is not None and len(frames) < 200:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames[::-1]


def recognise(frames: list[FrameType], user_locals: bool = True) -> Wait | None:
    outer: Wait | None = None
    for frame in frames:  # the outermost recognised wait names what the code called
        name = frame.f_code.co_name
        library = _in(frame, *_SYNC_MODULES)
        if not (library or user_locals):
            continue
        this = _locals(frame).get("self") if library else None
        kind = type(this).__name__
        if _in(frame, "/queue.py") and name in ("get", "put", "join"):
            # the standard library's own qsize only: a subclass's may do anything, even block
            stdlib = getattr(type(this), "qsize", None) in _STDLIB_QSIZE
            size = _call(this, "qsize") if stdlib else None
            words = f"{kind}.{name}" + (f" ({size} items queued)" if size is not None else "")
        elif _in(frame, "/threading.py") and name == "join" and isinstance(this, threading.Thread):
            words = f"Thread.join of thread {this.name!r}"
        elif _in(frame, "/threading.py") and name in ("wait", "wait_for") and kind in (
            "Event", "Condition", "Barrier", "Semaphore",
        ):  # fmt: skip
            words = f"{kind}.{name}"
        elif _in(frame, "/concurrent/futures/") and name in ("result", "exception", "wait"):
            words = f"concurrent.futures {'Future.' if kind == 'Future' else ''}{name}"
        elif _in(frame, "/multiprocessing/") and name in ("get", "recv", "join", "wait", "poll"):
            words = f"multiprocessing {kind}.{name}"
        elif (taken := _taken(frame, innermost=frame is frames[0])) is not None:
            outer = _lock_wait(frame, taken)
            continue
        else:
            continue
        outer = SyncWait(words, f"its stack, frame {_where(frame)}")
    return outer


def _taken(frame: FrameType, innermost: bool) -> locks.Taken | None:
    try:
        return locks.taken_in(frame, innermost)
    except Exception:  # reading a frame's source and bytecode: the wait is then named by its line
        return None


def _lock_wait(frame: FrameType, taken: locks.Taken) -> LockWait:
    """A wait to take a lock, named where the program takes it."""
    line = locks.source_line(taken.frame)
    words = f"{taken.noun} at {_where(taken.frame)}" + (f": {line}" if line else "")
    what = f"{taken.expression} is a {taken.kind}" if taken.expression else f"a {taken.kind}"
    return LockWait(words, f"its stack, frame {_where(frame)}: {what}", lock=taken)


def _call(obj: Any, method: str) -> Any:
    try:
        return getattr(obj, method)()
    except Exception:
        return None


def _holder_links(first: LockWait, following: Following) -> None:
    """The thread holding the lock ``first`` is on and what it waits on in turn; when that is a
    lock again, its holder, until a thread waits on something else, or on a lock held by a
    thread already in the chain: a deadlock."""
    verdict, training, phases, now = (following.verdict, following.training, following.phases,
                                      following.now)  # fmt: skip
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    chain = [training]
    wait: Wait = first
    try:
        while isinstance(wait, LockWait) and wait.lock is not None and len(chain) <= _HOLDERS:
            that = "it" if len(chain) == 1 else "that one"
            try:
                found, why = locks.holders(wait.lock.lock, frames)
            except Exception as exc:  # the threads' stacks and sources: the rest stands
                found, why = [], f"reading the threads' stacks failed ({type(exc).__name__}: {exc})"
            if not found:
                verdict.missing.append(f"which thread holds {that}: {why}")
                return
            if len(found) > 1:  # a semaphore's
                who = ", ".join(_thread_words(h, training, names) for h in found)
                places = "; ".join(h.how for h in found)
                evidence = "; ".join(_holder_evidence(h, wait.lock) for h in found)
                verdict.chain.append(Link(who, None, None, None, evidence,
                                          text=f"{who} hold {that} ({places})"))  # fmt: skip
                return
            holder = found[0]
            who = _thread_words(holder, training, names)
            evidence = _holder_evidence(holder, wait.lock)
            frame = None if holder.ended else frames.get(holder.ident)
            ending = None
            if holder.ident in chain and not holder.ended:
                ending = "it waits on itself, a deadlock" if holder.ident == chain[-1] else \
                    "a deadlock"  # fmt: skip
            elif frame is None:
                ending = "it is never released"
            if ending is not None:
                text = f"{who} holds {that} ({holder.how}): {ending}"
                verdict.chain.append(Link(who, None, None, None, evidence, text=text))
                return
            inner = following.recognise(frame)
            if inner is None:
                return
            stack = phases.get(holder.ident) or []
            path, age, place = None, None, ""
            if stack:
                path, began = stack[-1]
                age = now - began
                place = f" in {' > '.join(path.split('/'))} ({seconds(age)})"
                evidence += f"; open timer {path!r} since {seconds(age)} ago"
            verb = "is" if inner.kind == "code" else "waits"
            text = (f"{who} holds {that} ({holder.how}) and {verb}{place} "
                    f"{'at' if verb == 'is' else 'on'} {inner.words}")  # fmt: skip
            verdict.chain.append(Link(who, path, inner.words, age,
                                      f"{evidence}; {inner.evidence}", text=text))  # fmt: skip
            chain.append(holder.ident)
            wait = inner
    finally:
        del frames  # each frame holds every local of its stack


def _thread_words(holder: locks.Holder, training: int | None, names: Mapping[int, str]) -> str:
    ident = holder.ident
    if holder.ended:
        return f"thread {ident} (ended)"
    if ident == training:
        return "the training thread"
    return f"thread {names[ident]!r}" if ident in names else f"thread {ident}"


def _holder_evidence(holder: locks.Holder, taken: locks.Taken) -> str:
    if holder.frame is None:
        said = f"the {taken.kind}'s record of its owner (thread id {holder.ident}"
        if holder.ended:
            return said + ", a thread that has ended)"
        # Taken with acquire(); or its owner ended and the id was given to a later thread.
        return said + ": no with block on it in that thread's stack)"
    said = f"its frame {_where(holder.frame)} is inside {holder.statement}, on that {taken.kind}"
    return f"the lock's record of its owner; {said}" if holder.owner else said


