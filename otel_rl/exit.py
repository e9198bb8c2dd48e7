"""How a run ends: SIGTERM, uncaught exceptions and interpreter exit all finish the Logger.

Python's default SIGTERM kills the process without running ``atexit``; we turn it into
``SystemExit(143)`` in the main thread, so ``with Logger(...)`` blocks and ``atexit`` drain the
trackers and mark the run killed. An uncaught exception is remembered so that the ``atexit``
finish marks the run failed, never finished.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

_state = {"exit_code": None}
_hook_installed = False


def exit_code_hint() -> int:
    """The exit code the process is heading for, as far as we can tell (0 if unknown)."""
    code = _state["exit_code"]
    return 0 if code is None else int(code)


def exit_code_of(exc_type: Any, exc: Any) -> int:
    """The exit code a run ending with this exception gets (0 for no exception)."""
    if exc_type is None:
        return 0
    if issubclass(exc_type, SystemExit):
        code = exc.code if exc is not None else None
        return code if isinstance(code, int) else (0 if code is None else 1)
    if issubclass(exc_type, KeyboardInterrupt):
        return 130
    return 1


def install_excepthook() -> None:
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        _state["exit_code"] = exit_code_of(exc_type, exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def install_sigterm_handler() -> Any | None:
    """Turn SIGTERM into ``SystemExit(143)``; returns the handler to restore, or ``None`` if we
    did not install one (not the main thread, or the application has its own handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGTERM)
    if current is not signal.SIG_DFL:
        return None

    def on_sigterm(signum: int, frame: Any) -> None:
        _state["exit_code"] = 128 + signum
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    return current


def restore_sigterm_handler(previous: Any) -> None:
    if previous is None or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, previous)
