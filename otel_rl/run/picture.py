"""The run's timeline in its trackers: every ``tracing.picture_every`` seconds, and once at the
run's end, the last ``tracing.picture_steps`` steps drawn as the timeline page (an HTML artifact
in MLflow and W&B) with its image (TensorBoard, SwanLab), at the last step sealed. At the end,
also where the run's time went, as the table ``otel_rl/run_time`` at the last step (a table,
not metric rows: a row at the last step would stand beside that step's own row).

Drawing reads the trace file and takes seconds of CPU: it runs in a process of its own
(``python -m otel_rl.cli.timeline_snapshot``, at a lower priority where ``nice`` exists), started
and waited for on this sender's thread, so the training process's threads never share a GIL
with it. A picture that fails or overruns its time costs only itself, said once.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_rl.core.records import Page, Record, Table
from otel_rl.process.fork_safe_log import log as _log

#: The name the page and its image carry in every tracker.
PAGE_NAME = "otel_rl/timeline"
#: The name of the table of where the run's time went, sent at the end.
TIME_TABLE = "otel_rl/run_time"
#: Longest a picture between two steps may take before it is given up.
DRAW_TIMEOUT_S = 120.0
#: The module run as the drawing process (``python -m``).
DRAWING_MODULE = "otel_rl.cli.timeline_snapshot"


class TimelineSender:
    """Sends the run's timeline to the trackers from a thread of its own (``every`` > 0) and
    at :meth:`stop`; a picture is drawn only when a step was sealed since the last one."""

    def __init__(
        self,
        log_dir: Path,
        *,
        every: float,
        steps: int,
        send: Callable[[Record], object],
        last_step: Callable[[], int | None],
        flush_spans: Callable[[int], bool],
        flush_trackers: Callable[[float], bool],
    ) -> None:
        self._log_dir, self._every, self._steps = log_dir, every, steps
        self._send, self._last_step, self._flush_spans = send, last_step, flush_spans
        self._flush_trackers = flush_trackers
        self._stopping = threading.Event()
        self._drawing = threading.Lock()  # the loop's picture and the last one never overlap
        self._drawn_at: int | None = None
        self._said: set[str] = set()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[str] | None = None  # the drawing under way
        #: Pictures sent, and pictures given up (failed or over their time).
        self.sent = 0
        self.failed = 0

    def start(self) -> None:
        if self._every > 0:
            self._thread = threading.Thread(target=self._loop, name="otel-rl-timeline",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def stop(self, timeout: float) -> None:
        """The run ends: the last picture and the time table, within ``timeout`` seconds. A
        picture the loop is drawing is ended (the last one replaces it), and the trackers
        write what they hold first (within a quarter of the time), so that the files the last
        picture is drawn from have the last steps."""
        deadline = time.monotonic() + max(timeout, 0.0)
        self._stopping.set()
        drawing = self._process
        if drawing is not None:
            with contextlib.suppress(OSError):
                drawing.kill()
        if not self._drawing.acquire(timeout=max(timeout, 0.0)):
            self._gave_up("end", f"at the end was not drawn within {timeout:.3g} s (the picture "
                          "before it was still being drawn)")  # fmt: skip
            return
        try:
            self._flush_trackers(max(deadline - time.monotonic(), 0.0) / 4)
            self._picture(max(deadline - time.monotonic(), 0.0), last=True)
        finally:
            self._drawing.release()

    def _loop(self) -> None:
        while not self._stopping.wait(self._every):
            with self._drawing:
                if not self._stopping.is_set():
                    self._picture(DRAW_TIMEOUT_S)

    def _picture(self, timeout: float, last: bool = False) -> None:
        try:
            self._picture_or_raise(timeout, last)
        except Exception as exc:  # an answer not understood, a page not read: this picture only
            self._gave_up("error", f"could not be sent ({type(exc).__name__}: {exc})")

    def _picture_or_raise(self, timeout: float, last: bool) -> None:
        step = self._last_step()
        if step is None or (step == self._drawn_at and not last):
            return
        if not self._flush_spans(int(timeout * 1000 / 4)):  # the last step's spans on disk
            return  # first; none at all: no picture
        with tempfile.TemporaryDirectory(prefix="otel-rl-timeline-") as folder:
            html, png = Path(folder) / "page.html", Path(folder) / "page.png"
            result = self._draw([str(self._log_dir), str(self._steps), str(html), str(png)],
                                timeout, during_the_run=not last)  # fmt: skip
            if result is None:
                return
            if result.get("image") != "drawn":
                self._say_once("image", "otel-rl: the run's timeline goes to the trackers "
                               "without its image: %s", result.get("image"))  # fmt: skip
            # The drawing process read the files later than the step was asked: the page is at
            # the last step it shows.
            step = max(step, int(result["steps"][1]))
            page = Page(PAGE_NAME, step, html.read_text(encoding="utf-8"),
                        png.read_bytes() if png.exists() else b"")  # fmt: skip
        self._send(page)
        self._drawn_at = step
        self.sent += 1
        rows = result.get("time_table") or []
        if last and rows:
            self._send(Table(TIME_TABLE, step, ("part", "value"), tuple(map(tuple, rows))))

    def _draw(self, args: list[str], timeout: float, during_the_run: bool) -> dict[str, Any] | None:
        """The drawing process's answer; ``None`` when it drew nothing (said where it failed)."""
        command = [sys.executable, "-m", DRAWING_MODULE, *args]
        if during_the_run and shutil.which("nice"):  # the training process comes first
            command = ["nice", "-n", "10", *command]
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip
        except OSError as exc:
            self._gave_up("start", f"could not start its drawing process ({exc})")
            return None
        self._process = process
        if during_the_run and self._stopping.is_set():  # stop() looked before it was started
            with contextlib.suppress(OSError):
                process.kill()
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            self._gave_up("slow", f"was not drawn within {timeout:.3g} s")
            return None
        finally:
            self._process = None
        if process.returncode == 2:  # no step on disk yet
            return None
        if process.returncode != 0:
            if not (during_the_run and self._stopping.is_set()):  # not the one stop() ended
                last_line = (err.strip().splitlines() or ["no output"])[-1]
                self._gave_up("failed", f"failed to draw ({last_line})")
            return None
        return dict(json.loads(out.strip().splitlines()[-1]))

    def _gave_up(self, kind: str, why: str) -> None:
        self.failed += 1
        self._say_once(kind, "otel-rl: the run's timeline %s; the trackers miss this picture "
                       "(otel-rl timeline %s draws it by hand)", why,
                       self._log_dir)  # fmt: skip

    def _say_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._said:
            self._said.add(kind)
            _log.warning(message, *args)
