"""Frames a delivery process never spooled: kept in files, spooled later, each exactly once.

With ``export.delivery: process`` a record travels as a numbered frame (by the pipe, or by a
handoff file when the delivery process is behind) and reaches disk only when the delivery
process appends it to each tracker's spool, with its frame number (``Record.intake``). Two
kinds of file keep what it has not spooled:

- ``handoff-<pid>-<n>.frames``: frames the pipe could not take in time. The delivery process
  deletes one only once every spool holds its frames.
- ``left-<pid>.frames``: written by the training process when its delivery process is gone
  before the end of the run (killed at ``finish()``'s deadline, or died): the frames the pipe
  took that it had not yet said were spooled, those it never sent, and every record logged
  after.

Both sit in ``<log_dir>/.otel-rl/spool/.handoff/`` beside the launch's manifest
(``launch-<pid>.json``: its token and its trackers' spools) and lock (``launch-<pid>.lock``,
held by the training process while it lives). :func:`complete_spools` (``otel-rl replay``,
before it delivers) appends to each spool the frames of a finished launch that it does not
hold yet: frames are numbered in the order of the stream and a delivery process spools them in
that order, so a spool holds exactly the frames up to the highest number it carries, and a
frame in two places (the pipe's copy kept in the leftover file, and the spool) is spooled once.
A replay killed part-way and run again goes on from each spool's highest number.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.core.errors import ConfigError
from otel_rl.delivery.frames import read_frames, record_from_body
from otel_rl.delivery.spool import Spool, SpoolBusy, private_dirs, segment_paths, spool_root

_APPEND_EVERY = 2_000  # records per spool write: one write call, tens of kilobytes or more
_READ_CHUNK = 256 << 10


#: ``(pid, folder)`` of this process's live launches. A launch's files are named by its pid, so
#: two Loggers of one process cannot share a handoff folder: the second is refused.
_LIVE: set[tuple[int, str]] = set()


def claim_folder(folder: Path, log_dir: str) -> tuple[int, str]:
    """Claim ``folder`` for a launch of this process, before its delivery process starts;
    :class:`ConfigError` when another Logger of this process holds it."""
    key = (os.getpid(), os.path.realpath(folder))
    if key in _LIVE:
        raise ConfigError(
            f"another Logger of this process delivers to {log_dir} with export.delivery "
            "'process': give each Logger its own log_dir, or use export.delivery 'thread'"
        )
    _LIVE.add(key)
    return key


def release_folder(key: tuple[int, str] | None) -> None:
    if key is not None:
        _LIVE.discard(key)


def _manifest(folder: Path, pid: int) -> Path:
    return folder / f"launch-{pid}.json"


def _lock_path(folder: Path, pid: int) -> Path:
    return folder / f"launch-{pid}.lock"


def leftover_path(folder: Path, pid: int) -> Path:
    return folder / f"left-{pid}.frames"


def _frame_files(folder: Path, pid: int) -> list[Path]:
    """The launch's handoff files in the order they were written, then its leftover file."""
    handoffs = sorted(folder.glob(f"handoff-{pid}-*.frames"),
                      key=lambda p: int(p.stem.rsplit("-", 1)[1]))  # fmt: skip
    left = leftover_path(folder, pid)
    return [*handoffs, left] if left.exists() else handoffs


class LaunchFiles:
    """The training process's side: the manifest and the lock of its launch, and its leftover
    file. Created once the delivery process has started (its spools are known)."""

    def __init__(self, folder: Path, token: str, spools: Mapping[str, Path | None]) -> None:
        self.folder = folder
        self.pid = os.getpid()
        private_dirs(folder)
        root = folder.parent  # the spool root: paths are kept relative to it (a moved log dir)
        manifest = {
            "token": token,
            "pid": self.pid,
            "spools": {
                name: os.path.relpath(path, root) for name, path in spools.items() if path
            },
        }
        fd = os.open(_lock_path(folder, self.pid), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new pid's file: nobody else holds it
        self.lock_fd = fd
        tmp = folder / f".launch-{self.pid}.json.tmp"
        tmp.write_bytes(json.dumps(manifest).encode())
        os.chmod(tmp, 0o600)
        tmp.replace(_manifest(folder, self.pid))
        self._left = -1

    def keep(self, frames: Iterable[bytes]) -> bool:
        """Append ``frames`` to the leftover file (whole, or cut back to where it was: a full
        disk); False when they could not be written."""
        data = b"".join(frames)
        if not data:
            return True
        try:
            if self._left < 0:
                self._left = os.open(leftover_path(self.folder, self.pid),
                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # fmt: skip
            size = os.fstat(self._left).st_size
        except OSError:
            return False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._left, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._left, size)
            return False
        return True

    def release(self) -> None:
        """The run is over: the manifest goes when no file of frames is left; the lock is let
        go either way (``otel-rl replay`` may then complete the spools)."""
        if self.lock_fd < 0:
            return
        if self._left >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._left)
                os.close(self._left)
            self._left = -1
        if not _frame_files(self.folder, self.pid):
            for path in (_manifest(self.folder, self.pid), _lock_path(self.folder, self.pid)):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another launch's files may still be there
                self.folder.rmdir()
        os.close(self.lock_fd)
        self.lock_fd = -1

    def open_fds(self) -> list[int]:
        """The descriptors this launch holds (a fork child points them at /dev/null)."""
        return [fd for fd in (self.lock_fd, self._left) if fd >= 0]


def forget_launch(folder: Path, pid: int) -> None:
    """A delivery process whose training process died, having spooled everything: the launch's
    manifest and lock go, unless the training process still holds the lock (it lives: its
    ``finish()`` decides) or a file of frames is left."""
    try:
        fd = os.open(_lock_path(folder, pid), os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _frame_files(folder, pid):
            for path in (_manifest(folder, pid), _lock_path(folder, pid)):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()
    except BlockingIOError:
        return
    finally:
        os.close(fd)


# ---- otel-rl replay's side ------------------------------------------------------------------


@dataclass
class IntakeResult:
    """What completing one launch's spools did."""

    pid: int
    #: Records appended to each tracker's spool.
    spooled: dict[str, int] = field(default_factory=dict)
    #: Who holds the launch or one of its spools (nothing was done then).
    busy: str | None = None
    error: str | None = None
    #: Record frames that could not be read back (damaged, or of a class this process lacks).
    unreadable: int = 0


def complete_spools(
    log_dir: str | os.PathLike[str], wait: float = 0.0, stop: Callable[[], bool] = lambda: False
) -> list[IntakeResult]:
    """Spool what every finished launch under ``log_dir`` handed to its delivery process and
    that process did not spool; then remove the launch's files. A launch still in use (its
    training or delivery process lives) is waited for up to ``wait`` seconds in all."""
    folder = spool_root(log_dir).absolute() / ".handoff"
    ends = time.monotonic() + wait
    results = []
    try:
        manifests = sorted(folder.glob("launch-*.json"))
    except FileNotFoundError:  # a replay beside this one completed the last launch meanwhile
        manifests = []
    for manifest in manifests:
        pid = int(manifest.stem.split("-", 1)[1])
        while not stop():
            try:
                result = _complete(folder, pid, json.loads(manifest.read_text()), stop)
            except FileNotFoundError:  # its own run ended meanwhile, and left nothing
                result = IntakeResult(pid)
            except Exception as exc:  # one damaged launch must not stop the replay
                result = IntakeResult(pid, error=f"{type(exc).__name__}: {exc}")
            if result.busy is None or time.monotonic() >= ends:
                results.append(result)
                break
            time.sleep(0.1)
    return results


def _complete(
    folder: Path, pid: int, manifest: Mapping[str, Any], stop: Callable[[], bool]
) -> IntakeResult:
    result = IntakeResult(pid)
    fd = os.open(_lock_path(folder, pid), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            result.busy = f"the training run (pid {pid})"
            return result
        files = _frame_files(folder, pid)
        spools: dict[str, Spool] = {}
        try:
            if files:
                root = folder.parent
                for name, relative in manifest["spools"].items():
                    spools[name] = Spool(root / relative)
                _spool_frames(files, str(manifest["token"]), spools, result, stop)
                if result.unreadable:
                    result.error = (f"{result.unreadable} record(s) of the handoff files could "
                                    "not be read back: lost")  # fmt: skip
        except SpoolBusy as busy:
            result.busy = busy.holder
            return result
        finally:
            for spool in spools.values():
                spool.sync()
                spool.close()
        if result.busy is None and not stop():
            for path in (*files, _manifest(folder, pid), _lock_path(folder, pid)):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another launch's files may still be there
                folder.rmdir()
        return result
    finally:
        os.close(fd)


def _spool_frames(
    files: list[Path],
    token: str,
    spools: Mapping[str, Spool],
    result: IntakeResult,
    stop: Callable[[], bool],
) -> None:
    frontier = {name: highest_frame(spool.dir, token) for name, spool in spools.items()}
    pending: dict[str, list[Any]] = {name: [] for name in spools}
    leftover = [f for f in files if f.name.startswith("left-")]
    handoffs = [f for f in files if f not in leftover]
    # Handoff files follow one another in the stream; the leftover file interleaves with them.
    streams = [_records(handoffs), _records(leftover)]
    last = 0
    for number, to, body in heapq.merge(*streams, key=lambda item: item[0]):
        if number <= last:  # the same frame in two files
            continue
        last = number
        record = None
        for name in to if to is not None else spools:
            if name not in spools or number <= frontier[name]:
                continue
            if record is None:
                try:
                    record = record_from_body(body)
                except Exception:  # costs only itself: counted, said by the caller
                    result.unreadable += 1
                    break
                object.__setattr__(record, "intake", (token, number))
            pending[name].append(record)
            if len(pending[name]) >= _APPEND_EVERY:
                _append(spools[name], pending[name], result)
        if stop():
            break
    for name, records in pending.items():
        _append(spools[name], records, result)


def _append(spool: Spool, records: list[Any], result: IntakeResult) -> None:
    if records:
        spool.append(records)
        name = spool.dir.parent.name
        result.spooled[name] = result.spooled.get(name, 0) + len(records)
        records.clear()


def _records(paths: list[Path]) -> Iterator[tuple[int, Any, bytes]]:
    """``(frame number, trackers or None, body)`` of every record frame of ``paths``, in order."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            for message in read_frames(fd, _READ_CHUNK):
                if message[0] == "rec" and len(message) == 4:
                    yield message[3], message[1], message[2]
        finally:
            os.close(fd)


def highest_frame(spool_dir: Path, token: str) -> int:
    """The highest frame number of launch ``token`` a spool holds (0 for none). Segments are
    read from the last: the first that holds one of the launch's records has the highest."""
    pattern = re.compile(rb'"intake":\["' + re.escape(token.encode()) + rb'",(\d+)\]')
    for path in reversed(segment_paths(spool_dir)):
        highest = 0
        with path.open("rb") as f:
            carry = b""
            while chunk := f.read(4 << 20):
                data = carry + chunk
                cut = data.rfind(b"\n") + 1  # matches only within whole lines
                for match in pattern.finditer(data, 0, cut):
                    highest = max(highest, int(match.group(1)))
                carry = data[cut:]
        if highest:
            return highest
    return 0
