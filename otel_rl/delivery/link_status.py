"""The reader of the delivery process's status pipe: JSON lines, ``started`` or ``error`` once,
then ``stats`` every quarter second (each tracker's counters, ``intake``: up to which record
frame every spool holds what it was sent, each tracker's run), ``flushed`` for each flush,
``finished`` (what each tracker left for replay) and the child's own log lines, said through
the ``otel_rl`` logger by a thread of their own."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from otel_rl.delivery.link_messages import say_lines_unsaid
from otel_rl.delivery.link_state import LinkState
from otel_rl.process.cores import keep_to
from otel_rl.process.fork_safe_log import log as _log

__all__ = ["StatusReader"]


class StatusReader:
    """What the child has said, as last said: its trackers' counters, runs and spools, its
    flushes, whether it started (and if not, why) and whether it finished."""

    def __init__(self, state: LinkState, *, on_intake: Callable[[int], None]) -> None:
        self._state = state
        self._on_intake = on_intake  # the frames up to that number are spooled
        self._file: IO[bytes] | None = None
        self.started = threading.Event()  # the child started its trackers, or said why not
        self.finished = threading.Event()  # the child closed them, or is gone
        #: Why the child did not start, and whether it was the config (a ConfigError here).
        self.start_error: str | None = None
        self.config_error = False
        self.flushed: dict[int, bool] = {}  # each flush the child answered: whether it held all
        self.remote_stats: dict[str, dict[str, int]] = {name: {} for name in state.names}
        self.remote_undelivered: dict[str, int] = {}
        self.remote_runs: dict[str, dict[str, Any]] = {}  # each tracker's resume_config
        #: Each tracker's spool folder in the child (None: no spool), known once it started.
        self.spool_dirs: dict[str, Path | None] = {}
        # The child's log lines, heard by the status thread and said by a thread of their own.
        self._lines: queue.SimpleQueue[tuple[int, str] | None] = queue.SimpleQueue()
        self._lines_heard = self._lines_said = 0
        self._saying: threading.Thread | None = None
        self._reading: threading.Thread | None = None
        self._cores: frozenset[int] | None = None

    def fileno(self) -> int:
        """The status pipe's read end; -1 once it is closed (its end was read)."""
        file = self._file
        return -1 if file is None or file.closed else file.fileno()

    def start(self, fd: int, cores: frozenset[int] | None, on_end: Callable[[], None]) -> None:
        """Read the status pipe's read end ``fd`` on a thread of its own (on ``cores``); at its
        end (the child is gone), ``on_end()``, then ``finished`` is set."""
        self._cores = cores
        self._file = os.fdopen(fd, "rb")
        self._reading = threading.Thread(target=self._read, args=(on_end,),
                                         name="otel-rl-delivery-status", daemon=True)
        self._reading.start()

    def _read(self, on_end: Callable[[], None]) -> None:
        keep_to(self._cores)
        assert self._file is not None
        for line in self._file:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            self._on_status(message)
        on_end()
        self._file.close()  # its end was read: nothing more can come
        self._lines.put(None)  # the lines' thread ends once it said the lines before this
        self.finished.set()
        with self._state.cond:
            self._state.cond.notify_all()

    def _on_status(self, message: Mapping[str, Any]) -> None:
        if "log" in message:  # the delivery process's own log line, said here by its own thread
            level, text = message["log"]
            self._lines.put((int(level), str(text)))
            self._lines_heard += 1
            if self._saying is None:
                self._saying = threading.Thread(target=self._say_lines, name="otel-rl-delivery-log",
                                                daemon=True)  # fmt: skip
                self._saying.start()
        if "error" in message:
            self.start_error = str(message["error"])
            self.config_error = bool(message.get("config_error"))
            self.started.set()
        if message.get("started"):
            self.spool_dirs = {
                str(name): None if folder is None else Path(folder)
                for name, folder in (message.get("spools") or {}).items()
            }
            self.started.set()
        for name, stats in (message.get("stats") or {}).items():
            if name in self.remote_stats:
                self.remote_stats[name] = {str(k): int(v) for k, v in stats.items()}
        if "intake" in message:
            self._on_intake(int(message["intake"]))
        self.remote_runs.update(message.get("runs") or {})
        if "flushed" in message:
            with self._state.cond:
                self.flushed[int(message["flushed"])] = bool(message.get("ok"))
                self._state.cond.notify_all()
        if "finished" in message:
            self.remote_undelivered = {str(k): int(v) for k, v in message["finished"].items()}
            self.finished.set()

    def _say_lines(self) -> None:
        """The child's log lines through the ``otel_rl`` logger, on a thread of their own: a
        slow handler of the user's delays the lines, never the counters or the end of the run."""
        keep_to(self._cores)
        while True:
            line = self._lines.get()
            if line is None:  # the status pipe ended: no line can come any more
                return
            level, text = line
            _log.log(level, "%s", text)
            self._lines_said += 1

    def join(self, until: float) -> None:
        """Wait until the status pipe has ended (the child exited) and its threads with it, or
        the monotonic ``until``: a child slow to exit is left to end on its own."""
        for thread in (self._reading, self._saying):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, until - time.monotonic()))

    def wait_said(self, until: float) -> None:
        """Wait until the child's log lines heard so far are said, or the monotonic ``until``."""
        while self._lines_said < self._lines_heard and time.monotonic() < until:
            time.sleep(0.01)
        left = self._lines_heard - self._lines_said
        if left:
            say_lines_unsaid(left)
