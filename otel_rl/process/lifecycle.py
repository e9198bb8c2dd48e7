"""Process lifecycle: how a run ends (signals, ``sys.exit``, exceptions, interpreter exit) and
what a forked child does with the Loggers of its parent.

**Signals.** Python's default SIGTERM kills the process without running ``atexit``, and its SIGINT
raises ``KeyboardInterrupt`` wherever the main thread is: inside one of our locks (exit then
stalls, a tracker is never closed) or inside a weakref callback or ``__del__`` (the exception is
printed and swallowed: training goes on). While a Logger with ``export.handle_signals`` is live,
SIGTERM and SIGINT (when they still have Python's default handlers) come here instead. The handler
looks at the frame the main thread was interrupted in, and raises ``SystemExit(143)`` (SIGTERM)
or ``KeyboardInterrupt`` (SIGINT) only at a safe point: never while otel-rl or the OTel SDK is on
the stack, never where the exception would be swallowed. Otherwise it records the signal and a
small daemon thread re-sends it to the main thread every few milliseconds until it lands at a
safe point, so it is never lost. While a Logger is finishing it does not raise at all: the
trackers close first, then the signal takes effect as ``finish()`` returns (the process exits
143/130). A ``finish()`` run while the process is already ending (an exception leaving a
``with Logger(...)`` block, ``SystemExit``/``KeyboardInterrupt`` propagating, interpreter exit)
keeps that ending and its code: the signal is not raised again.
A wait inside otel-rl (``flush()``, a full ``block`` queue, a distributed collective) is cut after
:data:`PATIENCE_S` at the waiting call, never in our own code.

**Exit codes.** Python runs ``atexit`` after an uncaught ``SystemExit`` without telling anyone
its code. ``sys.exit`` is wrapped (once, on the first Logger) to remember the code, an uncaught
exception is remembered by ``sys.excepthook`` (1; ``KeyboardInterrupt`` 130; read from
``sys.last_value`` when the application replaced the hook without chaining) and a handled signal
by its handler (128 + signal number), so that the ``atexit`` finish closes the trackers with the
code the process exits with, whether or not the Logger handles signals. A ``finish()`` given no
code while an exception is handled or propagating (``finally:``) takes that exception's
(:func:`exit_code_now`): a crash is a failure whichever idiom ends the run. Not seen:
``raise SystemExit(n)`` outside a ``with Logger(...)`` block, ``sys.exit`` bound before the
first Logger (``from sys import exit``), and ``os._exit`` (no ``atexit`` at all:
``otel-rl replay`` closes such runs with 137).

**Fork.** A child made by ``fork`` (``multiprocessing``'s default on Linux before Python 3.14,
``os.fork``) inherits the parent's Loggers but none of their threads, and possibly locks held by
them. In the child each inherited Logger is disabled: what it is given is ignored with one warning
(create a new Logger in the child), its ``finish()`` and ``atexit`` do nothing, and its trackers'
spool and files are never written by the child. A Logger created in the child works normally.
A fork waits for a line otel-rl's threads are writing to a stream the process shares
(:mod:`otel_rl.process.fork_safe_log`).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import importlib.util
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from otel_rl.process.fork_safe_log import log as _log

#: The exit code a run is closed with when its process died without finishing it (SIGKILL's):
#: trackers that keep a status then mark it killed, never "finished".
KILLED_EXIT_CODE = 128 + signal.SIGKILL

_T = TypeVar("_T")

__all__ = [
    "PATIENCE_S",
    "exit_code_hint",
    "exit_code_now",
    "exit_code_of",
    "register",
    "signal_of",
    "unregister",
]


#: How often a deferred signal is re-sent to the main thread (seconds).
RETRY_S = 0.01
#: How long ``finish()`` waits for the re-send thread to end (it ends within ``RETRY_S``).
RETRY_JOIN_S = 0.5
#: How long a signal waits for a call into otel-rl that is blocked waiting (``flush()``, a full
#: ``block`` queue, a collective) before it is raised at the waiting call.
PATIENCE_S = 3.0

_HANDLED = (signal.SIGTERM, signal.SIGINT)

_lock = threading.Lock()  # register/unregister bookkeeping; never taken by the signal handler
_live: weakref.WeakSet[Any] = weakref.WeakSet()  # every live Logger (the fork hook disables them)
_signal_users: weakref.WeakSet[Any] = weakref.WeakSet()  # live Loggers with handle_signals
_previous: dict[int, Any] = {}  # the handlers ours replaced
# The exit code the process is heading for, when known.
_exit: dict[str, Any] = {"code": None, "last_value_at_start": None}
_hooks_installed: dict[str, Any] = {
    "excepthook": False, "sys.exit": False, "unraisablehook": False, "exit status": None,
}


@dataclass
class _Pending:
    """A signal received at an unsafe point, waiting to be raised at a safe one."""

    signum: int
    since: float
    #: Received while a finish() that already ends the run ran: once it returns, do not raise.
    quiet: bool = False


_pending: _Pending | None = None
_retry: dict[str, Any] = {"thread": None, "wake": None, "pid": None}
_raised: dict[str, Any] = {"exc": None, "signum": 0}  # what the handler raised last
#: Counters of the signal path: ``received``, ``deferred`` (handler calls that found no safe
#: point), ``resent`` (re-sent to the main thread), ``raised``, ``rearmed`` (raised, swallowed,
#: raised again).
stats = {"received": 0, "deferred": 0, "resent": 0, "raised": 0, "rearmed": 0}


# ---- exit codes --------------------------------------------------------------------------------


def exit_code_hint() -> int:
    """The exit code the process is heading for, as far as we can tell (0 if unknown)."""
    code = _exit["code"]
    if code is None:
        code = _uncaught_code()
    return 0 if code is None else int(code)


def exit_code_now() -> int:
    """The exit code of a run finished right now: from the exception being handled or
    propagating (a ``finally:`` or ``except:`` block, an ``__exit__``), else from the process's
    exit path (an uncaught exception, ``sys.exit``, a signal); 0 when all is well."""
    exc_type, exc, _ = sys.exc_info()
    if exc_type is not None:
        return exit_code_of(exc_type, exc)
    return exit_code_hint()


def _uncaught_code() -> int | None:
    """The code of an exception that reached the top of the main thread since a Logger started,
    when our ``sys.excepthook`` did not see it (the application replaced it without chaining).

    Python stores such an exception in ``sys.last_value`` before calling any hook. It is
    believed only at interpreter exit: before that the process did not die of it (an
    interactive session, or pytest, stores every error there and goes on), and an error from
    before the newest Logger started is not that run's.
    """
    if not getattr(threading, "_SHUTTING_DOWN", False):
        return None
    last = getattr(sys, "last_value", None)
    if last is None or last is _exit["last_value_at_start"]:
        return None
    if sys.flags.interactive or hasattr(sys, "ps1") or hasattr(builtins, "get_ipython"):
        return None
    return exit_code_of(type(last), last)


def signal_of(exc: BaseException) -> int | None:
    """The signal whose handler raised ``exc`` (SIGTERM's ``SystemExit(143)``, SIGINT's
    ``KeyboardInterrupt``) at a safe point, else ``None``: a command line tells a stop it was
    asked for from a ``sys.exit`` of its own."""
    return int(_raised["signum"]) if exc is _raised["exc"] else None


def weak_atexit(target: _T, call: Callable[[_T], object]) -> Callable[[], None]:
    """Register ``call(target)`` to run at interpreter exit while ``target`` lives, and only in
    the process that registered it: a fork child's exit must not drain or close the parent's
    work (its threads do not exist in the child). Returns the function, for ``atexit.unregister``.
    """
    ref = weakref.ref(target)
    pid = os.getpid()

    def at_exit() -> None:
        if os.getpid() != pid:
            return
        alive = ref()
        if alive is not None:
            call(alive)

    atexit.register(at_exit)
    return at_exit


def exit_code_of(exc_type: Any, exc: Any) -> int:
    """The exit code a run ending with this exception gets (0 for no exception)."""
    if exc_type is None or issubclass(exc_type, GeneratorExit):
        # GeneratorExit: the consumer of a generator stopped early, the run did not fail.
        return 0
    if issubclass(exc_type, SystemExit):
        code = exc.code if exc is not None else None
        return code if isinstance(code, int) else (0 if code is None else 1)
    if issubclass(exc_type, KeyboardInterrupt):
        return 130
    return 1


def _install_excepthook() -> None:
    if _hooks_installed["excepthook"]:
        return
    _hooks_installed["excepthook"] = True
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        _exit["code"] = exit_code_of(exc_type, exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _wrap_sys_exit() -> None:
    """Remember the code of ``sys.exit(code)`` in the main thread (the only place it ends the
    process), for the ``atexit`` finish. Installed once and never removed: something may have
    wrapped it again since."""
    if _hooks_installed["sys.exit"]:
        return
    _hooks_installed["sys.exit"] = True
    original = sys.exit

    @functools.wraps(original)
    def exit_and_remember(status: Any = None) -> Any:
        if threading.current_thread() is threading.main_thread():
            _exit["code"] = exit_code_of(SystemExit, SystemExit(status))
        return original(status)

    sys.exit = exit_and_remember


def _install_unraisablehook() -> None:
    """The safety net behind the frame check: when an exception the handler raised is swallowed
    anyway (a plain weakref callback or a gc callback, which no frame shows), Python reports it
    through ``sys.unraisablehook``; the signal is then re-armed instead of printed and lost."""
    if _hooks_installed["unraisablehook"]:
        return
    _hooks_installed["unraisablehook"] = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        global _pending
        exc = unraisable.exc_value
        if exc is not None and exc is _raised["exc"]:
            _raised["exc"] = None
            if not getattr(threading, "_SHUTTING_DOWN", False):
                stats["rearmed"] += 1
                _pending = _Pending(_raised["signum"], time.monotonic())
                _wake_retry()
                return
        previous(unraisable)

    sys.unraisablehook = hook


# ---- Loggers -----------------------------------------------------------------------------------


def register(logger: Any, *, handle_signals: bool) -> None:
    """A Logger starts: it is disabled in forked children, and with ``handle_signals`` SIGTERM
    and SIGINT are handled here while it is live (main thread only: Python's rule)."""
    with _lock:
        _live.add(logger)
        _exit["last_value_at_start"] = getattr(sys, "last_value", None)
        # The exit code hooks serve every Logger: how the run ended is not a matter of signals.
        if _pending is None:
            _exit["code"] = None  # a SystemExit caught earlier did not end the process
        _install_excepthook()
        _wrap_sys_exit()
        if not handle_signals:
            return
        _signal_users.add(logger)
        _install_unraisablehook()
        _install_exit_status_hook()
        if threading.current_thread() is not threading.main_thread():
            return
        _compute_roots()
        for signum in _HANDLED:
            current = signal.getsignal(signum)
            default = signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler
            if current is _on_signal or current is not default:
                continue  # already ours, or the application's own: left alone
            signal.signal(signum, _on_signal)
            _previous[signum] = current
        _start_retry_thread()


def _install_exit_status_hook() -> None:
    """Once per process: registered before any Logger's own ``atexit`` drain, so it runs after
    them all (``atexit`` is last-in, first-out)."""
    if _hooks_installed["exit status"] == os.getpid():
        return
    _hooks_installed["exit status"] = os.getpid()
    pid = os.getpid()

    def exit_with_a_signal_held_during_the_drain() -> None:
        # A SIGTERM/SIGINT that arrived while the interpreter's exit drained the trackers was
        # held back so as not to cut the drain; the process still ends as that signal says
        # (143/130), as it would have without otel-rl. The drains are done; only handlers
        # registered before otel-rl's first Logger (logging's among them) are skipped.
        pending = _pending
        if pending is None or os.getpid() != pid:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + pending.signum)

    atexit.register(exit_with_a_signal_held_during_the_drain)


def unregister(logger: Any) -> None:
    """A Logger finished (called last in ``finish()``). The last one with ``handle_signals``
    gives the signals back to the handlers it replaced, unless the application installed its own
    since (left alone) or a signal is still waiting to be raised: that one takes effect now, at
    the exit of ``finish()``, once the trackers are closed."""
    with _lock:
        _live.discard(logger)
        _signal_users.discard(logger)
        restore = not _signal_users and _pending is None
        if restore and threading.current_thread() is threading.main_thread():
            _restore_handlers()
            _stop_retry_thread()  # no signal of ours can wait any more: nothing left behind
    _raise_pending(sys._getframe(1))


def _raise_pending(frame: FrameType | None) -> None:
    pending = _pending
    if pending is None or threading.current_thread() is not threading.main_thread():
        return
    where = _where(frame)
    ending = isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt))
    if where.quiet or pending.quiet or ending or getattr(threading, "_SHUTTING_DOWN", False):
        pending.quiet = True  # that finish ended the run with its own code: the retry drops it
        return
    if where.swallow:
        return  # finish() called from a finalizer: the retry raises it after
    _raise_now(pending)


def _raise_now(pending: _Pending) -> None:
    global _pending
    _pending = None
    stats["raised"] += 1
    exc = _exception_for(pending.signum)
    _raised.update(exc=exc, signum=pending.signum)
    raise exc


def _restore_handlers() -> None:
    for signum, previous in list(_previous.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous)
        del _previous[signum]


# ---- the signal handler ------------------------------------------------------------------------

_roots: dict[str, tuple[str, ...]] = {"ours": (), "sdk": (), "swallow": (), "transparent": ()}
_kinds: dict[str, str] = {}  # filename -> kind, filled lazily by the handler (no locks)
#: Functions of ours that only call the program's own code around a measurement.
_TRANSPARENT_FUNCS = frozenset({"timed", "traced"})


def _compute_roots() -> None:
    """Where our code, the OTel SDK's, and weakref callbacks live (at register time: the
    handler must not import anything)."""
    if _roots["ours"]:
        return
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # otel_rl/
    ours = [package]
    spec = importlib.util.find_spec("otel_rl.exporters")
    if spec is not None and spec.submodule_search_locations:
        ours.extend(spec.submodule_search_locations)
    sdk: list[str] = []
    try:
        import opentelemetry

        sdk = list(opentelemetry.__path__)
    except ImportError:  # pragma: no cover - a dependency
        pass
    import _weakrefset

    _roots["ours"] = tuple(os.path.join(os.path.abspath(p), "") for p in ours)
    _roots["sdk"] = tuple(os.path.join(os.path.abspath(p), "") for p in sdk)
    _roots["swallow"] = tuple(os.path.abspath(m.__file__ or "") for m in (weakref, _weakrefset))
    # The command line's own loops (demo) are the program, not a critical section of ours.
    _roots["transparent"] = tuple(
        os.path.join(package, "cli", name) for name in ("main.py", "demo.py", "__main__.py")
    )


def _kind_of(filename: str) -> str:
    kind = _kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if filename and filename[0] != "<" else filename
        if path in _roots["swallow"]:
            kind = "swallow"
        elif path in _roots["transparent"]:
            kind = "program"
        elif path.startswith(_roots["ours"]):
            kind = "ours"
        elif path.startswith(_roots["sdk"]):
            kind = "sdk"
        else:
            kind = "program"
        _kinds[filename] = kind
    return kind


@dataclass
class _Where:
    ours: bool = False  # otel-rl or the OTel SDK is on the stack
    ours_on_top: bool = False  # ... and the interrupted frame itself is theirs
    swallow: bool = False  # an exception raised here would be printed and swallowed
    closing: bool = False  # a finish() is on the stack
    quiet: bool = False  # ... while the run already ends (an exception, interpreter exit)


def _where(frame: FrameType | None) -> _Where:
    where = _Where()
    top = True
    while frame is not None:
        code = frame.f_code
        kind = _kind_of(code.co_filename)
        if code.co_name == "__del__" or kind == "swallow":
            where.swallow = True
        elif kind in ("ours", "sdk") and code.co_name not in _TRANSPARENT_FUNCS:
            where.ours = True
            where.ours_on_top = where.ours_on_top or top
            if kind == "ours" and code.co_name == "finish":
                where.closing = True
            elif kind == "ours" and code.co_name == "__exit__":
                # Leaving a ``with Logger(...)`` block on an exception: that one ends the run.
                where.quiet = where.quiet or frame.f_locals.get("exc_type") is not None
            elif kind == "ours" and code.co_name == "at_exit":
                where.quiet = True
        top = False
        frame = frame.f_back
    if where.closing and getattr(threading, "_SHUTTING_DOWN", False):
        where.quiet = True  # finishing at interpreter exit: the exit code is already decided
    return where


def _exception_for(signum: int) -> BaseException:
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGINT: raise at a safe point, else record and have it re-sent (module doc)."""
    global _pending
    pending = _pending
    if pending is None:
        stats["received"] += 1
        pending = _pending = _Pending(signum, time.monotonic())
        _exit["code"] = 128 + signum
    stats["deferred"] += 1  # until proven otherwise below
    if frame is None:  # no Python code running (interpreter teardown): nothing safe to raise into
        _wake_retry()
        return
    where = _where(frame)
    if where.closing:
        pending.quiet = pending.quiet or where.quiet
        _wake_retry()
        return
    waited = time.monotonic() - pending.since
    if where.swallow or (where.ours and (where.ours_on_top or waited < PATIENCE_S)):
        _wake_retry()
        return
    stats["deferred"] -= 1
    if pending.quiet:
        _pending = None
        return  # the finish it arrived during ended the run already, with its own code
    _raise_now(pending)


# ---- the re-send thread ------------------------------------------------------------------------


def _start_retry_thread() -> None:
    """One daemon thread, started in normal context (never from the handler, which may run
    while the main thread holds threading's own locks). It sleeps on a pipe that the handler
    writes one byte to: no Python lock is ever taken by the handler."""
    thread = _retry["thread"]
    if thread is not None and thread.is_alive() and _retry["pid"] == os.getpid():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    main = threading.main_thread().ident
    thread = threading.Thread(
        target=_retry_loop, args=(read_fd, main), name="otel-rl-signals", daemon=True
    )
    _retry.update(thread=thread, wake=write_fd, pid=os.getpid())
    thread.start()


def _stop_retry_thread() -> None:
    """Close the pipe's write end: the thread reads its end of file, closes the read end and
    ends. The handler finds no pipe from here on (it is no longer installed either)."""
    fd = _retry["wake"]
    if fd is None or _retry["pid"] != os.getpid():
        return
    thread = _retry["thread"]
    _retry.update(thread=None, wake=None, pid=None)
    with contextlib.suppress(OSError):
        os.close(fd)
    if thread is not None and thread is not threading.current_thread():
        thread.join(RETRY_JOIN_S)  # it reads the end of the pipe at once, or ends its re-send


def _wake_retry() -> None:
    fd = _retry["wake"]
    if fd is None:
        return
    with contextlib.suppress(OSError):  # a full pipe: the thread is awake already
        os.write(fd, b"\0")


def _retry_loop(read_fd: int, main: int | None) -> None:
    global _pending
    while True:
        try:
            woken = os.read(read_fd, 4096)
        except OSError:
            woken = b""
        if not woken:  # the write end closed: the last Logger handling signals finished
            with contextlib.suppress(OSError):
                os.close(read_fd)
            return
        while True:
            time.sleep(RETRY_S)
            pending = _pending
            if pending is None or main is None:
                break
            try:
                # To the main thread itself, so that a blocking wait there is interrupted and the
                # handler runs at once (a signal sent to the process may wake another thread).
                signal.pthread_kill(main, pending.signum)
                stats["resent"] += 1
            except (OSError, ValueError):
                return
            if signal.getsignal(pending.signum) is not _on_signal:
                _pending = None  # the application took the signal over since: it has it now
                break


# ---- fork --------------------------------------------------------------------------------------

_FORK_MESSAGE = (
    "otel-rl: this process (pid %d) was forked from pid %d, which owns Logger run %r: in the "
    "child that Logger is disabled and ignores what it is given (its trackers, spool and threads "
    "belong to the parent). Create a new Logger in the child (with its own log_dir)."
)


def _after_fork_in_child() -> None:
    """Runs in every fork child (``os.register_at_fork``): nothing here may block or raise."""
    global _lock, _pending
    _lock = threading.Lock()  # may have been held by a parent thread at fork
    _pending = None
    _exit["code"] = None
    fd = _retry["wake"]
    if fd is not None:
        with contextlib.suppress(OSError):  # the child's copy; the parent's stays open
            os.close(fd)
    _retry.update(thread=None, wake=None, pid=None)
    loggers = list(_live)
    _live.clear()
    _signal_users.clear()
    routing = sys.modules.get("otel_rl.telemetry.routing")
    if routing is not None:
        routing.reset_after_fork()
    for logger in loggers:
        try:
            _disable_in_child(logger)
        except Exception as exc:  # never break the child's start
            _log.warning("otel-rl: cannot disable an inherited Logger after fork: %s", exc)
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(OSError, ValueError):
            _restore_handlers()  # no live Logger in the child: the signals are the program's


def _disable_in_child(logger: Any) -> None:
    parent = os.getppid()
    logger.abandon_after_fork()
    warned: list[bool] = []

    def disabled(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name != "finish" and not warned:
                warned.append(True)
                _log.warning(_FORK_MESSAGE, os.getpid(), parent, getattr(logger, "run_id", "?"))
            return False if name == "flush" else None

        return call

    # Instance attributes shadow the methods, for these objects in this process only: the run
    # and the objects it is used through (a Logger), which it names in ``facades``.
    facades = [ref() for ref in getattr(logger, "facades", ())]
    for target in [logger, *(f for f in facades if f is not None)]:
        for name in dir(type(target)):
            if name.startswith("log_") or name in ("flush", "finish"):
                setattr(target, name, disabled(name))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
