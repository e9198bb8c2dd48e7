"""Which lock a thread waits on, and which thread holds it: known by the object, never by the
name the code gives it.

A thread blocked taking a ``threading.Lock`` or ``RLock`` has no Python frame for the wait: the
lock is taken in C, from the frame at ``with guard:`` or ``guard.acquire()``. That frame is read:
the instruction it stopped at says whether it enters a ``with`` or calls, the source says which
expression, and the expression is evaluated in the frame's own variables without running any of
the program's code (a name, an attribute stored on an object or its class, an item of a dict,
list or tuple: never a call, a property or a ``__getattr__``). A ``Condition``, a ``Semaphore``,
Python's own ``RLock`` and a ``multiprocessing`` lock are taken in a Python method whose ``self``
is the object.

Who holds it: an ``RLock`` (alone or as a ``Condition``'s lock) records its owner, whichever way
it was taken. A ``Lock``, a ``Semaphore`` and a ``multiprocessing`` lock record none: a thread
holds one when one of its frames runs inside a ``with`` block on the same object. One taken with
``acquire()``, held by a suspended generator or by another process is not seen, and
:func:`holders` says so.
"""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import linecache
import os
import re
import sys
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Holder", "Taken", "holders", "lock_kind", "taken_in", "unread"]

_LOCK = type(threading.Lock())
_RLOCKS: tuple[type, ...] = (type(threading.RLock()), threading._PyRLock)  # type: ignore[attr-defined]
_WITH_OPS = frozenset({"SETUP_WITH", "BEFORE_WITH", "SETUP_ASYNC_WITH", "BEFORE_ASYNC_WITH"})
#: The methods a lock is taken by, as the frame of a Python implementation names them.
_TAKING = frozenset({"acquire", "__enter__"})
_UNKNOWN: Any = object()


def lock_kind(value: Any) -> str | None:
    """``threading.Lock``, ``threading.RLock``, ``threading.Condition``,
    ``threading.Semaphore``, ``threading.BoundedSemaphore``, ``multiprocessing.Lock`` (…) for
    such an object, else ``None``; by its type alone (no attribute of ``value`` is read)."""
    cls = type(value)
    if issubclass(cls, _LOCK):
        return "threading.Lock"
    if issubclass(cls, _RLOCKS):
        return "threading.RLock"
    for known in (threading.Condition, threading.BoundedSemaphore, threading.Semaphore):
        if issubclass(cls, known):
            return f"threading.{known.__name__}"
    synchronize = sys.modules.get("multiprocessing.synchronize")
    if synchronize is not None:
        for known in (synchronize.Condition, synchronize.BoundedSemaphore, synchronize.Semaphore,
                      synchronize.RLock, synchronize.Lock):  # fmt: skip
            if issubclass(cls, known):
                return f"multiprocessing.{known.__name__}"
    return None


def _noun(kind: str) -> str:
    return "a semaphore" if kind.endswith("Semaphore") else "a lock"


_CONDITIONS = ("threading.Condition", "multiprocessing.Condition")


def _underlying(value: Any) -> Any:
    """The lock a ``with`` on ``value`` takes: a condition's own lock, else ``value``."""
    if lock_kind(value) in _CONDITIONS:
        return _static(value, "_lock")
    return value


@dataclass
class Taken:
    """A lock a thread is blocked taking."""

    lock: Any
    kind: str  # threading.Lock, ...
    #: The program's frame that takes it (``with guard:``, ``guard.acquire()``).
    frame: types.FrameType
    #: How that frame names it (``weights_guard``), when the frame's source says.
    expression: str | None

    @property
    def noun(self) -> str:
        return _noun(self.kind)


def taken_in(frame: types.FrameType, innermost: bool) -> Taken | None:
    """The lock ``frame`` is blocked taking, if it is: a Python method of a lock (``self`` the
    lock) or, for the innermost frame, a ``with`` or ``acquire()`` that blocks in C."""
    if frame.f_code.co_name in _TAKING:
        this = _locals(frame).get("self")
        kind = lock_kind(this)
        if kind is not None:
            caller = frame.f_back
            while caller is not None and caller.f_code.co_name in _TAKING \
                    and lock_kind(_locals(caller).get("self")) is not None:  # fmt: skip
                caller = caller.f_back  # a Condition's __enter__ taking its own RLock
            taker = caller or frame
            entered = _entered(taker)
            return Taken(this, kind, taker, entered[1] if entered is not None else None)
    if not innermost:
        return None
    entered = _entered(frame)
    if entered is None:
        return None
    value, expression = entered
    kind = lock_kind(value)
    return None if kind is None else Taken(value, kind, frame, expression)


@dataclass
class Holder:
    """A thread that holds a lock: its id, and the ``with`` it took it by (when seen)."""

    ident: int
    #: The frame inside the ``with`` block, that statement's first line and its number;
    #: ``None``: not seen.
    frame: types.FrameType | None
    statement: str | None
    line: int | None = None
    #: Known from the lock's own record of its owner (an RLock's).
    owner: bool = False
    #: The thread has ended: nothing will release the lock.
    ended: bool = False

    @property
    def how(self) -> str:
        if self.frame is None or self.statement is None:
            return "the lock's owner"
        code = self.frame.f_code
        return f"{self.statement} at {code.co_name} ({os.path.basename(code.co_filename)}:" \
               f"{self.line})"  # fmt: skip


def holders(lock: Any, frames: Mapping[int, types.FrameType]) -> tuple[list[Holder], str | None]:
    """The threads holding ``lock`` (one of :func:`lock_kind`'s), from the lock's own owner or
    the ``with`` blocks of ``frames`` (each thread's innermost frame); when none is found, why."""
    kind = lock_kind(lock) or type(lock).__name__
    target = _underlying(lock)
    if target is _UNKNOWN:
        return [], f"the lock of this {kind} cannot be read"
    owner = _rlock_owner(target)
    if owner == 0:
        return [], "it was free when the report looked (the wait was ending)"
    if owner == threading.get_ident():
        # This thread reads the lock and never takes a program's lock: the owner ended, and
        # this thread was given its id again.
        return [Holder(owner, None, None, owner=True, ended=True)], None
    if owner is not None:
        seen = list(_with_blocks(target, {owner: frames[owner]} if owner in frames else {}))
        if seen:
            seen[0].owner = True
            return seen[:1], None
        return [Holder(owner, None, None, owner=True, ended=owner not in frames)], None
    found = list(_with_blocks(target, frames))
    if found:
        return found, None
    if _is_free(target):
        return [], "it was free when the report looked (the wait was ending)"
    why = (f"a {kind} records no owner, and no thread of this process is inside a with block "
           "on it (one taken with acquire() is not seen)")  # fmt: skip
    if kind.startswith("multiprocessing."):
        why += "; another process may hold it"
    return [], why


def where(frame: types.FrameType) -> str:
    """``function (file.py:line)``."""
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


def source_line(frame: types.FrameType) -> str:
    """The frame's current line, without its comment."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return line.split("  #")[0].strip()


# ---- the owner a lock records ------------------------------------------------------------------


_RLOCK_OWNER = re.compile(r"\bowner=(\d+)")


def _rlock_owner(lock: Any) -> int | None:
    """An RLock's owning thread id (0: free); ``None`` for a lock that records no owner."""
    cls = type(lock)
    if issubclass(cls, threading._PyRLock):  # type: ignore[attr-defined]
        owner = _static(lock, "_owner")
        return owner if isinstance(owner, int) else 0
    if issubclass(cls, _RLOCKS):  # C's RLock keeps its owner to itself, but says it in repr
        found = _RLOCK_OWNER.search(repr(lock))
        return int(found.group(1)) if found else None
    return None


def _is_free(lock: Any) -> bool:
    cls = type(lock)
    if issubclass(cls, _LOCK):
        return not lock.locked()
    if issubclass(cls, threading.Semaphore):
        value = _static(lock, "_value")
        return isinstance(value, int) and value > 0
    return False


# ---- the frames inside a with block on a lock --------------------------------------------------


def _with_blocks(target: Any, frames: Mapping[int, types.FrameType]) -> Iterator[Holder]:
    """One holder per thread with a frame inside a ``with`` block on ``target``."""
    for ident, innermost in frames.items():
        if _lets_go(innermost, target):
            continue
        frame: types.FrameType | None = innermost
        while frame is not None:
            found = _with_statement_on(frame, target)
            if found is not None:
                yield Holder(ident, frame, *found)
                break
            frame = frame.f_back


def _lets_go(frame: types.FrameType | None, target: Any) -> bool:
    """Whether the stack waits on a condition whose lock is ``target``: ``wait()`` lets go of
    the lock until it is notified, inside the ``with`` block that took it."""
    while frame is not None:
        if frame.f_code.co_name in ("wait", "wait_for"):
            this = _locals(frame).get("self")
            if lock_kind(this) in _CONDITIONS and _underlying(this) is target:
                return True
        frame = frame.f_back
    return False


def _with_statement_on(frame: types.FrameType, target: Any) -> tuple[str, int] | None:
    """The first line (its text and number) of the ``with`` statement on ``target`` whose block
    ``frame`` runs in."""
    if not _has_with(frame.f_code):
        return None
    tree = _tree(frame.f_code.co_filename)
    if tree is None:
        return None
    line = frame.f_lineno
    entering = _instructions(frame.f_code).get(frame.f_lasti, ("", None))[0] in _WITH_OPS
    for node in _scope_withs(tree, line):
        if not node.body[0].lineno <= line <= (node.end_lineno or line):
            continue
        if entering and line <= _header_end(node):
            continue  # at the with statement itself, not inside its block
        for item in node.items:
            value = evaluate(item.context_expr, frame)
            if value is not _UNKNOWN and _underlying(value) is target:
                first = linecache.getline(frame.f_code.co_filename, node.lineno)
                return first.split("  #")[0].strip(), node.lineno
    return None


def _header_end(node: ast.With | ast.AsyncWith) -> int:
    """The last line of a ``with`` statement's header."""
    ends = [item.context_expr.end_lineno or node.lineno for item in node.items]
    ends += [item.optional_vars.end_lineno or node.lineno
             for item in node.items if item.optional_vars is not None]  # fmt: skip
    return max(ends)


def _scope_withs(tree: ast.Module, line: int) -> list[ast.With | ast.AsyncWith]:
    """The ``with`` statements around ``line`` in the innermost function (or class, or module)
    holding it: a ``with`` outside a nested function is not that function's."""
    found: list[ast.With | ast.AsyncWith] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            start = getattr(child, "lineno", None)
            end = getattr(child, "end_lineno", None)
            if start is not None and end is not None and not start <= line <= end:
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                  ast.ClassDef)):  # fmt: skip
                found.clear()
            elif isinstance(child, (ast.With, ast.AsyncWith)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


# ---- the object a frame blocked in C is taking -------------------------------------------------


def unread(frame: types.FrameType) -> str | None:
    """The expression ``frame`` is blocked entering or calling ``acquire`` on, when reading it
    would run the program's code (a call, a property): the lock it may be is not known."""
    candidates = _candidates(frame)
    if not candidates:
        return None
    if any(evaluate(expression, frame) is not _UNKNOWN for expression in candidates):
        return None
    return ast.unparse(candidates[0])


def _entered(frame: types.FrameType) -> tuple[Any, str] | None:
    """What the frame is entering with ``with`` or calling ``acquire``/``__enter__`` on, from the
    instruction it stopped at and the source of that statement: ``(object, expression)``."""
    for expression in _candidates(frame):
        value = evaluate(expression, frame)
        if value is not _UNKNOWN and lock_kind(value) is not None:
            return value, ast.unparse(expression)
    return None


def _candidates(frame: types.FrameType) -> list[ast.expr]:
    """The expressions the instruction ``frame`` stopped at may be taking a lock from: the
    ``with`` item it enters, or the receiver of an ``acquire``/``__enter__`` call."""
    op = _instructions(frame.f_code).get(frame.f_lasti)
    if op is None:
        return []
    name, position = op
    tree = _tree(frame.f_code.co_filename)
    if tree is None:
        return []
    line = frame.f_lineno
    if name in _WITH_OPS:
        statement = next((n for n in ast.walk(tree) if isinstance(n, (ast.With, ast.AsyncWith))
                          and n.lineno <= line <= _header_end(n)), None)  # fmt: skip
        if statement is None:
            return []
        items = [item.context_expr for item in statement.items]
        entered = _with_item_index(frame, statement)
        return [items[entered]] if entered is not None else items
    if name.startswith(("CALL", "PRECALL")):
        calls = [
            call for call in ast.walk(tree)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in _TAKING and call.lineno <= line <= (call.end_lineno or line)
        ]  # fmt: skip
        exact = [call for call in calls if position is not None and _spans(call, position)]
        return [call.func.value for call in exact or calls
                if isinstance(call.func, ast.Attribute)]  # fmt: skip
    return []


def _with_item_index(frame: types.FrameType, statement: ast.With | ast.AsyncWith) -> int | None:
    """Which item of a ``with a, b:`` the frame is entering: the count of the statement's
    entering instructions up to where it stopped (a ``finally`` copy counts round again)."""
    if len(statement.items) == 1:
        return 0
    header = range(statement.lineno, _header_end(statement) + 1)
    lines = _instruction_lines(frame.f_code)
    count = sum(1 for offset, (name, line) in lines.items()
                if offset <= frame.f_lasti and name in _WITH_OPS and line in header)  # fmt: skip
    return (count - 1) % len(statement.items) if count else None


def _spans(node: ast.expr, position: Sequence[int | None]) -> bool:
    return (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset) == tuple(position)


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> dict[int, tuple[str, tuple[int | None, ...] | None]]:
    """Each instruction's offset: its name and, from Python 3.11, its source position."""
    out: dict[int, tuple[str, tuple[int | None, ...] | None]] = {}
    for ins in dis.get_instructions(code):
        positions = getattr(ins, "positions", None)
        out[ins.offset] = (ins.opname, tuple(positions) if positions is not None else None)
    return out


@functools.lru_cache(maxsize=256)
def _instruction_lines(code: types.CodeType) -> dict[int, tuple[str, int | None]]:
    out: dict[int, tuple[str, int | None]] = {}
    line: int | None = None
    for ins in dis.get_instructions(code):
        positions = getattr(ins, "positions", None)
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif ins.starts_line is not None and not isinstance(ins.starts_line, bool):
            line = ins.starts_line
        out[ins.offset] = (ins.opname, line)
    return out


@functools.lru_cache(maxsize=1024)
def _has_with(code: types.CodeType) -> bool:
    return any(ins.opname in _WITH_OPS for ins in dis.get_instructions(code))


def _tree(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    return _parse(source) if source else None


@functools.lru_cache(maxsize=16)
def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


# ---- evaluating an expression without running the program's code ------------------------------


def evaluate(node: ast.expr, frame: types.FrameType) -> Any:
    """The value of ``node`` in ``frame``, or ``_UNKNOWN``: only names, attributes found in an
    object's or its class's ``__dict__`` (or a slot), and items of a plain dict, list or tuple
    are evaluated; nothing that could run the program's code (a call, a property,
    ``__getattr__``, an operator)."""
    if isinstance(node, ast.Name):
        for space in (_locals(frame), frame.f_globals, frame.f_builtins):
            try:
                return space[node.id]
            except (KeyError, TypeError):
                continue
        return _UNKNOWN
    if isinstance(node, ast.Attribute):
        base = evaluate(node.value, frame)
        return _UNKNOWN if base is _UNKNOWN else _static(base, node.attr)
    if isinstance(node, ast.Subscript):
        base = evaluate(node.value, frame)
        key = node.slice.value if isinstance(node.slice, ast.Constant) else \
            evaluate(node.slice, frame)  # fmt: skip
        if type(base) in (dict, list, tuple) and type(key) in (int, str):
            try:
                return base[key]
            except (KeyError, IndexError, TypeError):
                return _UNKNOWN
    return _UNKNOWN


def _static(value: Any, attribute: str) -> Any:
    """``value.attribute`` when it is stored data (no descriptor runs but a slot's), else
    ``_UNKNOWN``."""
    try:
        found = inspect.getattr_static(value, attribute)
    except AttributeError:
        return _UNKNOWN
    if isinstance(found, types.MemberDescriptorType) and not isinstance(value, type):
        try:
            return found.__get__(value, type(value))
        except AttributeError:
            return _UNKNOWN
    if any("__get__" in vars(cls) for cls in type(found).__mro__):
        return _UNKNOWN  # a function, a property: binding or calling it is the program's code
    return found


def _locals(frame: types.FrameType) -> Mapping[str, Any]:
    try:
        return frame.f_locals
    except Exception:  # a frame torn down meanwhile
        return {}
