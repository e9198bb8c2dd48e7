"""The delivery process's own end (``export.delivery: process``): the run's trackers, away from
training. The training process's end is :class:`~otel_rl.delivery.service_link.ServiceLink`.

Started as ``python -m otel_rl.run.service <records fd> <status fd>``, which hands :func:`main`
the way to build the trackers the run's config enables (``RunTrackers``, each with its channel
and spool as a training process would). Here the records are read from the pipe and the handoff
files it names, handed to the trackers, their counters reported, and the run ended when told
(or, when the training process died without telling, once the pipe is empty: closed as killed,
exit code 137).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import count_loss
from otel_rl.delivery import link_messages as say
from otel_rl.delivery.fanout import Fanout
from otel_rl.delivery.frames import read_frames, record_from_body
from otel_rl.delivery.handoff import forget_launch
from otel_rl.delivery.link_handle import DELIVERY_GRACE
from otel_rl.delivery.spool import spool_for
from otel_rl.process.cores import keep_process_to
from otel_rl.process.deadline import Deadline, Part, stop_in_parallel
from otel_rl.process.lifecycle import KILLED_EXIT_CODE

__all__ = [
    "BuildTrackers", "HandoffProgress", "Status", "Trackers", "main", "messages", "run_deadline",
    "serve",
]

_STATS_EVERY = 0.25
_NICENESS = 10


class Trackers(Protocol):
    """The run's trackers as this process drives them (``otel_rl.run.trackers.RunTrackers``)."""

    @property
    def exporters(self) -> Sequence[Any]:
        """Each tracker's delivery (its channel), in the order the config enables them."""

    def start(self) -> None: ...
    def stopping(self, deadline: Deadline, exit_code: int) -> list[Part]: ...


#: Builds the run's trackers (not started) from the training process's settings: its ``cfg``
#: and ``run_id``. A :class:`ConfigError` it raises is raised in the training process as it is.
BuildTrackers = Callable[[Mapping[str, Any]], Trackers]


def messages(records_fd: int) -> Iterator[tuple[Any, ...]]:
    """The messages of the records pipe, with the handoff files it names read in their place,
    and, once the pipe ends, the training process's files it never named (it was killed while
    the pipe was full): nothing it handed over is left unread. After a file's frames comes
    ``("read", path)``: the file may go once every spool holds them (:class:`HandoffProgress`)."""
    incoming = read_frames(records_fd)
    hello = next(incoming, None)
    if hello is None or hello[0] != "hello":
        return
    yield hello
    read: set[str] = set()
    for message in incoming:
        if message[0] == "handoff":
            read.add(message[1])
            yield from _handoff(Path(message[1]))
        else:
            yield message
    folder, pid = hello[1].get("handoff_dir"), hello[1].get("pid")
    if folder is not None:
        left = [p for p in Path(folder).glob(f"handoff-{pid}-*.frames") if str(p) not in read]
        for path in sorted(left, key=lambda p: int(p.stem.rsplit("-", 1)[1])):
            yield from _handoff(path)


def _handoff(path: Path) -> Iterator[tuple[Any, ...]]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        say.say_handoff_unreadable(path, exc)
        return
    try:
        yield from read_frames(fd)  # a frame cut short by a kill, at its end, is not read
    finally:
        os.close(fd)
    yield ("read", path)


class HandoffProgress:
    """How far every spool has got with the frames read: the training process keeps the frames
    the pipe gave until then, and a handoff file stays until then (otel_rl/delivery/handoff.py).
    """

    def __init__(self, exporters: Sequence[Any]) -> None:
        self._exporters = exporters
        self.handed = 0  # the number of the last record frame handed to the trackers
        self._files: list[tuple[int, Path]] = []  # read whole: (its last frame, path)
        self._lock = threading.Lock()

    def read(self, path: Path) -> None:
        with self._lock:
            self._files.append((self.handed, path))

    def spooled_through(self) -> int:
        """Every frame up to this number is in every spool it was sent to. Deletes the handoff
        files read whole up to there."""
        handed = self.handed  # first: a frame handed on meanwhile is in a channel, or spooled
        through = min((e.intake_spooled(handed) for e in self._exporters), default=handed)
        with self._lock:
            done = [path for last, path in self._files if last <= through]
            self._files = [(last, path) for last, path in self._files if last > through]
        for path in done:
            path.unlink(missing_ok=True)
        return through


class Status:
    """JSON lines to the training process, from any thread."""

    def __init__(self, fd: int) -> None:
        self._file: IO[str] = os.fdopen(fd, "w", encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, **message: Any) -> bool:
        """False when the training process is gone (this one delivers all the same)."""
        with self._lock:
            try:
                self._file.write(json.dumps(message) + "\n")
                self._file.flush()
            except (OSError, ValueError):
                return False
            return True


class LogToTrainingProcess(logging.Handler):
    """otel-rl's own log lines, said in the training process through its ``otel_rl`` logger (the
    user's handlers, format and levels apply as in thread mode); on stderr once it is gone."""

    def __init__(self, status: Status) -> None:
        super().__init__()
        self._status = status

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if not self._status.send(log=[record.levelno, text]):
                sys.stderr.write(text + "\n")
        except Exception:
            self.handleError(record)


def status_of(exporters: Sequence[Any], intake: HandoffProgress) -> dict[str, Any]:
    """Each tracker's counters, its run as ``resume_config`` names it (e.g. MLflow's run id,
    known once the tracker has opened it), and how far the spools have got."""
    return {
        "stats": {e.name: {**e.stats, "pending": e.pending} for e in exporters},
        "runs": {e.name: e.resume_config for e in exporters if getattr(e, "resume_config", None)},
        "intake": intake.spooled_through(),
    }


def unreadable(exporters: Sequence[Any], exc: Exception, warned: set[str]) -> None:
    """A record the training process sent that cannot be read here: counted as refused."""
    for exporter in exporters:
        exporter.stats["submitted"] = exporter.stats.get("submitted", 0) + 1
        count_loss(exporter.stats, "refused")
        if exporter.name not in warned:
            warned.add(exporter.name)
            say.say_record_unreadable(exporter.name, exc)


def run_deadline(end: tuple[Any, ...]) -> Deadline:
    """The run's deadline, from the end message ``("end", exit_code, seconds, at)``: the
    training process's own (``at``, on the monotonic clock both processes share). Read behind a
    backlog, the end message is seconds old: a deadline counted from the reading would run past
    the training process's, which kills this process there, before its trackers were closed
    and said what they left."""
    deadline = Deadline(float(end[2]))  # never later than the time left when it was sent
    if len(end) > 3:  # (an end message of an earlier otel-rl has the seconds alone)
        deadline.at = min(deadline.at, float(end[3]))
    return deadline


def _settle(settings: Mapping[str, Any], status: Status) -> None:
    """This process as the training process is: off its training thread's core, its log lines
    said there at its level, in its working directory, importing what it imports."""
    keep_process_to(settings.get("cores"))
    own_log = logging.getLogger("otel_rl")
    own_log.addHandler(LogToTrainingProcess(status))
    own_log.setLevel(settings["log_level"])  # the training process's: it says the lines
    own_log.propagate = False
    os.chdir(settings["cwd"])
    spool_for(int(settings["pid"]))
    here = set(settings["sys_path"])
    sys.path[:] = [*settings["sys_path"], *(p for p in sys.path if p not in here)]
    importlib.invalidate_caches()


class _Feed:
    """The records and control messages of the stream, handed to the trackers in order."""

    def __init__(self, exporters: Sequence[Any], status: Status, launch: str) -> None:
        self.exporters = exporters
        self.fanout = Fanout(exporters)
        self.intake = HandoffProgress(exporters)
        self._status = status
        self._launch = launch
        self._warned: set[str] = set()

    def until_end(self, incoming: Iterator[tuple[Any, ...]]) -> tuple[int, Deadline] | None:
        """Hand on every message; the exit code and the deadline of the end message, or None
        when the stream ended without one (the training process died)."""
        for message in incoming:
            kind = message[0]
            if kind == "rec":
                self._record(message[1], message[2], message[3])
            elif kind == "read":
                self.intake.read(message[1])
            elif kind == "setup":  # e.g. verl's MLflow metric names (compat/verl.py)
                self._setup(message[1], message[2])
            elif kind == "flush":
                deadline = Deadline(float(message[2]))
                ok = all(
                    e.force_flush(timeout_millis=deadline.left() * 1000) for e in self.exporters
                )
                self._status.send(flushed=message[1], ok=ok, **self.status())
            elif kind == "end":
                return int(message[1]), run_deadline(message)
        return None

    def _record(self, to: Sequence[str] | None, body: bytes, number: int) -> None:
        try:
            record = record_from_body(body)
        except Exception as exc:  # an object this process cannot rebuild: costs only itself
            unreadable(self.fanout.select(to), exc, self._warned)
            self.intake.handed = number
            return
        # Spooled with the record: a frame also kept in a file is spooled once.
        object.__setattr__(record, "intake", (self._launch, number))
        self.fanout.send(record, to=to)
        self.intake.handed = number

    def _setup(self, name: str, setup: Callable[[Any], object]) -> None:
        delivery = self.fanout.named(name)
        try:
            if delivery is not None:
                delivery.apply(setup)
        except Exception as exc:
            say.say_setup_failed(name, exc)

    def status(self) -> dict[str, Any]:
        return status_of(self.exporters, self.intake)


def serve(records_fd: int, status: Status, build: BuildTrackers) -> int:
    """Deliver the run whose records come by ``records_fd`` to the trackers ``build`` makes;
    the exit code of this process."""
    incoming = messages(records_fd)
    hello = next(incoming, None)
    if hello is None or hello[0] != "hello":
        return 2
    settings = hello[1]
    _settle(settings, status)
    try:
        trackers = build(settings)
        trackers.start()
    except Exception as exc:  # a ConfigError is raised as it is in the training process
        status.send(error=str(exc), config_error=isinstance(exc, ConfigError))
        return 1
    exporters = trackers.exporters
    feed = _Feed(exporters, status, str(settings["launch"]))
    status.send(started=True, spools={
        e.name: None if e.spool_dir is None else str(e.spool_dir) for e in exporters
    })  # fmt: skip
    done = threading.Event()

    def report() -> None:
        while not done.wait(_STATS_EVERY):
            status.send(**feed.status())

    threading.Thread(target=report, name="otel-rl-delivery-stats", daemon=True).start()
    # Without the end message, its training process died: closed as killed, in the run's time.
    end = feed.until_end(incoming)
    if end is None:
        exit_code, deadline = KILLED_EXIT_CODE, Deadline(float(settings["shutdown_timeout"]))
    else:
        exit_code, deadline = end
    stop_in_parallel(trackers.stopping(deadline, exit_code), deadline.at + DELIVERY_GRACE)
    done.set()
    status.send(**feed.status(), finished={e.name: int(e.undelivered) for e in exporters})
    if exit_code == KILLED_EXIT_CODE and settings.get("handoff_dir"):  # its training process died
        forget_launch(Path(settings["handoff_dir"]), int(settings["pid"]))
    return 0


def main(build: BuildTrackers, argv: Sequence[str] | None = None) -> NoReturn:
    """The delivery process: ``argv`` (``sys.argv[1:]``) names the records pipe's read end and
    the status pipe's write end; the trackers are ``build``'s."""
    args = sys.argv[1:] if argv is None else argv
    # The training process ends the run: a terminal's Ctrl-C or a scheduler's SIGTERM to every
    # process of the job must not cut the delivery short (SIGKILL still does; the spool keeps it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Background work: on a machine whose cores are all busy, the scheduler lets the training
    # process go first (the delivery catches up whenever training waits on anything).
    with contextlib.suppress(OSError):
        os.nice(_NICENESS)
    # This process leads a session of its own: where the kernel groups the tasks of a session
    # (autogroup), a task's nice value counts only inside its group, and the group's does
    # between groups: the group's is lowered too.
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(_NICENESS))
    code = serve(int(args[0]), Status(int(args[1])), build)
    sys.stdout.flush()
    sys.stderr.flush()
    # Tracker SDKs may leave non-daemon threads: the run is closed, nothing is left to wait for.
    os._exit(code)
