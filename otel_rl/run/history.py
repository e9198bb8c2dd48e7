"""One history per run: the launches of a ``run_id`` in a log dir, and the tracker runs they opened.

A relaunched job (a node died at step 530, the framework reloads the checkpoint of step 500) is
the same experiment. When a launch names a ``run_id`` that a launch before it used in the same
``log_dir``, ``resume: auto`` makes it the next *attempt* of that run:

- every tracker reopens the run the latest launch that opened one opened (MLflow's run id,
  W&B's run id, ...), read from the spools' metadata (``meta.json``'s ``resume``, written as
  soon as the tracker opened its run, and kept by a launch whose tracker never did), so a launch
  killed at any moment has left it;
- the spools the previous launch left undelivered are delivered first
  (:class:`PreviousLaunch`), then the first step this launch logs is announced to every tracker
  (:class:`~otel_rl.core.records.Resume`): the steps from there on belong to this attempt.

Layout: ``<log_dir>/.otel-rl/runs/<run id>/launches.jsonl``, one line per launch (private, as
the rest of ``.otel-rl``). A launch killed while appending may tear its line: the next starts a
line of its own, and attempt numbers are also read from the spools' metadata, so they never
repeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_rl.core.errors import ConfigError
from otel_rl.core.paths import folder_name
from otel_rl.delivery.spool import attempts_of, private_dirs, tracker_runs_of
from otel_rl.process.deadline import Deadline
from otel_rl.process.fork_safe_log import log as _log

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings

RESUME_MODES = ("auto", "never", "must")
RUNS_DIRNAME = ".otel-rl/runs"
#: The environment variable naming the run when the config does not.
RUN_ID_ENV = "OTEL_RL_RUN_ID"
#: Keys the Logger adds to its resolved config (never given by the user): this launch's attempt
#: and id, for the exporters that record them and for the spool's metadata.
ATTEMPT_KEY, LAUNCH_KEY = "attempt", "launch"
#: Seconds per tracker to deliver what an earlier launch left: ``otel-rl replay``'s default.
PREVIOUS_LAUNCH_TIMEOUT = 300.0


def runs_root(log_dir: str | os.PathLike[str]) -> Path:
    return Path(log_dir) / RUNS_DIRNAME


@dataclass(frozen=True)
class Launch:
    """One start of a run: its attempt number and where it ran."""

    attempt: int
    launch: str
    started: float
    pid: int
    host: str


class RunHistory:
    """The launches of one run in one log dir, this one included (``attempt``)."""

    def __init__(
        self, log_dir: Path, run_id: str, launches: list[Launch], mode: str, earlier: int
    ) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self.mode = mode
        #: The launches before this one that the history recorded, oldest first.
        self.previous = launches
        #: This launch's number: one past the highest any earlier launch of the run took.
        self.attempt = earlier + 1
        #: Whether this launch continues the run a launch before it started.
        self.resumed = mode != "never" and earlier > 0
        #: This launch's id, kept in every spool's metadata it writes.
        self.launch = uuid.uuid4().hex[:12]

    @classmethod
    def begin(cls, log_dir: str | os.PathLike[str], run_id: str, mode: str) -> RunHistory:
        """The history of ``run_id`` in ``log_dir``, this launch included (not yet recorded:
        :meth:`record`).

        ``mode``: ``auto`` continues the run when launches of it are found, ``must`` raises
        :class:`ConfigError` when none is, ``never`` makes this launch a new run under the same
        id (said when launches of it are found: their outputs share the folder). Earlier
        launches are the history's lines and, should those be lost (an unwritable folder), the
        attempts the run's spools name.
        """
        if mode not in RESUME_MODES:
            raise ConfigError(f"logger config 'resume': {mode!r} is not one of {RESUME_MODES}")
        absolute = Path(log_dir).absolute()
        folder = runs_root(absolute) / folder_name(run_id)
        launches = _read_launches(folder / "launches.jsonl")
        earlier = max(launches[-1].attempt if launches else 0, attempts_of(absolute, run_id))
        if mode == "must" and not earlier:
            raise ConfigError(
                f"logger config 'resume': 'must', but no run with run_id {run_id!r} was launched "
                f"in {log_dir} before (looked in {folder}); give the run_id and log_dir of the "
                "run to continue, or set resume: auto to start it when it is new"
            )
        if mode == "never" and earlier:
            _log.warning(
                "otel-rl: resume: never, but run_id %r was launched %d time(s) in %s before: "
                "this launch is a new run under the same id, its TensorBoard and JSONL rows in "
                "the same folder and file as theirs (JSONL tells them apart by attempt %d); give "
                "a new run_id or log_dir to keep the runs apart", run_id, earlier, log_dir,
                earlier + 1,
            )  # fmt: skip
        return cls(absolute, run_id, launches, mode, earlier)

    @classmethod
    def of_launch(cls, cfg: LoggerSettings) -> RunHistory:
        """The history as the launch whose resolved config is ``cfg`` began it (in the delivery
        process too, which has only the config)."""
        log_dir = Path(cfg.log_dir).absolute()
        run_id, attempt = str(cfg.run_id), cfg.attempt
        launches = _read_launches(runs_root(log_dir) / folder_name(run_id) / "launches.jsonl")
        earlier = [x for x in launches if x.attempt < attempt]
        history = cls(log_dir, run_id, earlier, "auto", attempt - 1)
        history.launch = str(cfg.launch)
        return history

    def record(self) -> None:
        """Add this launch to the run's history, once it has started (a launch refused at start
        is no attempt). One write of one line, after a newline if the last line was torn."""
        folder = runs_root(self.log_dir) / folder_name(self.run_id)
        line = {"attempt": self.attempt, "launch": self.launch, "started": time.time(),
                "pid": os.getpid(), "host": socket.gethostname(), "resume": self.mode}  # fmt: skip
        data = (json.dumps(line) + "\n").encode()
        try:
            private_dirs(folder)
            fd = os.open(folder / "launches.jsonl", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # never glued to a line a killed launch tore
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:  # the spools' own check names an unusable log_dir
            _log.warning("otel-rl: cannot record this launch of run %s in %s: %s; the next "
                         "launch takes its attempt from the run's spools", self.run_id, folder,
                         exc)  # fmt: skip

    def tracker_runs(self) -> dict[str, dict[str, Any]]:
        """How to reopen each tracker's run, as config sections merged under the user's own:
        ``{"mlflow": {"run_id": ...}, "wandb": {"id": ..., "resume": "allow"}, ...}``."""
        sections: dict[str, dict[str, Any]] = {}
        for resume in self.runs_by_tracker().values():
            for section, settings in resume.items():
                if isinstance(settings, dict):
                    sections.setdefault(section, {}).update(settings)
        return sections

    def runs_by_tracker(self) -> dict[str, dict[str, Any]]:
        """Each tracker's run as the latest launch that opened it recorded it (its spool
        metadata's ``resume``), by tracker name; none for a launch that does not resume."""
        return tracker_runs_of(self.log_dir, self.run_id) if self.resumed else {}


def continue_tracker_runs(
    cfg: LoggerSettings, runs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Merge the previous launch's tracker runs into ``cfg``; what the user set wins (a run id
    given by hand names the run to continue)."""
    for section, settings in runs.items():
        if section not in type(cfg).model_fields:
            continue  # not an otel-rl tracker's section
        own = cfg.tracker_section(section)
        if isinstance(own, dict):  # a section handed to the tracker as given (wandb:, mlflow:)
            setattr(cfg, section, {**settings, **own})


class PreviousLaunch:
    """Delivers what the earlier launches of a run left in their spools, before this launch's
    trackers write anything: ``otel-rl replay`` limited to this run's earlier attempts, in a
    process of its own (it reopens the trackers' runs and may change its working directory, as
    replay does), under replay's own deadline (``timeout`` seconds per tracker).

    Every tracker of this launch waits for it (:meth:`wait`) before its first write; this
    launch's records wait in its spool meanwhile. :meth:`start` once this launch's spools are
    set up (their metadata names the attempt the replay leaves alone). What could not be
    delivered stays replayable, and is said.
    """

    def __init__(self, history: RunHistory, waiting: int, timeout: float) -> None:
        self._done = threading.Event()
        self._history, self._waiting = history, waiting
        self._log_dir, self._run_id = history.log_dir, history.run_id
        self._known = history.runs_by_tracker()  # the runs this launch's trackers start with
        self._opened: dict[str, dict[str, Any]] = {}
        self._command = [
            sys.executable, "-m", "otel_rl.cli", "replay", str(self._log_dir), "--run",
            self._run_id, "--before-attempt", str(history.attempt), "--no-progress",
            # --wait: a spool that an operator's own replay (or a killed launch's delivery
            # process, still spooling) holds is waited for, not skipped.
            "--timeout", str(timeout), "--wait", str(timeout),
        ]  # fmt: skip
        self.started = 0.0
        self.returncode: int | None = None
        self.output = ""
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        try:
            process = subprocess.Popen(
                self._command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.output = f"cannot start otel-rl replay: {exc}"
            self._done.set()
            self._say()
            return
        self._process = process
        threading.Thread(
            target=self._reap, args=(process,), name="otel-rl-previous-launch", daemon=True
        ).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the earlier launches' records are all handled (delivered, or left for
        replay and said) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def stop(self, deadline: Deadline) -> None:
        """This launch ends: the delivery gets the first half of what is left of ``deadline``
        to finish, then stops between two writes (SIGTERM: what is left stays in the spools,
        said) and closes the runs it reopened, leaving this launch's trackers the rest."""
        process = self._process
        if process is None or self._done.wait(deadline.left() / 2):
            return
        with contextlib.suppress(OSError):
            process.terminate()
        if not self._done.wait(deadline.left()):
            with contextlib.suppress(OSError):
                process.kill()

    def tracker_run(self, tracker: str) -> dict[str, Any] | None:
        """The run the delivery opened for ``tracker`` when the earlier launch had not (it was
        killed first): this launch continues it rather than starting another."""
        return self._opened.get(tracker)

    def _reap(self, process: subprocess.Popen[str]) -> None:
        try:
            self.output, _ = process.communicate()
            self.returncode = process.returncode
            runs = self._history.runs_by_tracker()
            self._opened = {t: r for t, r in runs.items() if t not in self._known}
        finally:
            self._done.set()
        self._say()

    def _say(self) -> None:
        took = time.monotonic() - self.started
        if self.returncode == 0:
            _log.info("otel-rl: run %s: the earlier launch's %d record(s) delivered first in "
                      "%.1f s", self._run_id, self._waiting, took)  # fmt: skip
            return
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        _log.warning(
            "otel-rl: run %s: the earlier launch's records were not all delivered (replay exit "
            "%s after %.1f s): %s. What is left stays in its spool; deliver it with: otel-rl "
            "replay %s", self._run_id, self.returncode, took, "; ".join(lines[-6:]) or "no output",
            self._log_dir,
        )  # fmt: skip


def _read_launches(path: Path) -> list[Launch]:
    launches: list[Launch] = []
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return launches
    except OSError as exc:
        _log.warning("otel-rl: cannot read the run's launches (%s): %s", path, exc)
        return launches
    unreadable = 0
    for line in text.splitlines():
        try:
            raw = json.loads(line)
            launches.append(Launch(int(raw["attempt"]), str(raw["launch"]), float(raw["started"]),
                                   int(raw["pid"]), str(raw["host"])))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            unreadable += line.strip() != ""
    if unreadable:  # a torn line of a launch killed while it started, or damage from outside
        _log.warning("otel-rl: %d line(s) of %s are not launches and are passed over (the "
                     "run's spools still say its attempts)", unreadable, path)  # fmt: skip
    launches.sort(key=lambda launch: launch.attempt)
    return launches
