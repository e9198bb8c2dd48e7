"""A per-tracker write-ahead log: records reach disk before a tracker sees them.

Layout, for one tracker of one run (folders 0700, files 0600: rows and configs are private)::

    <log_dir>/.otel-rl/spool/<tracker>/<run_id>/
        meta.json                 tracker name, logger config, how to resume the tracker's run
        wal-000000000001.jsonl    records, one JSON object per line: {"seq": n, "kind": ..., ...}
        acked.log                 delivery marks: "upto N" (every seq <= N is done) or "one N"

Sequence numbers start at 1 and grow by one per record. A tracker's worker delivers in order, so
its marks are ``upto`` lines; ``otel-rl replay`` re-sends in step order and leaves ``one`` marks.
Every mark is written to the kernel as soon as the tracker holds the record (so a killed process
never re-sends what its tracker already has) and fsynced every ``export.fsync_interval``.
Segments whose records are all done are deleted by the side that marks them done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.core.records import Record, StepBatch

SPOOL_DIRNAME = ".otel-rl/spool"
_SEGMENT_RECORDS = 20_000
_TAIL_SCAN = 1 << 20  # a torn line is one record: far shorter than this
_DIR_MODE = 0o700
_FILE_MODE = 0o600


def spool_root(log_dir: str | os.PathLike[str]) -> Path:
    return Path(log_dir) / SPOOL_DIRNAME


def handoff_dir(log_dir: str | os.PathLike[str]) -> Path:
    """Where a training process hands frames to its delivery process when the pipe is full
    (``export.delivery: process``); no tracker's spool (``otel-rl replay`` passes it by)."""
    return spool_root(log_dir).absolute() / ".handoff"


def private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents as 0700 (the umask cannot widen it)."""
    missing = []
    path = directory
    while not path.exists():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(path, _DIR_MODE)


def _close_synced(f: Any) -> None:
    if f is not None and not f.closed:
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()


def _open_private(path: Path, mode: str) -> Any:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, _FILE_MODE)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")


# ---- one writer at a time ---------------------------------------------------------------------


class SpoolBusy(RuntimeError):
    """A tracker's spool is held by a live process: the training run or an ``otel-rl replay``."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(f"{directory} is in use by {holder}")
        self.directory = directory
        self.holder = holder


_training_pid: int | None = None


def spool_for(training_pid: int) -> None:
    """This process (the delivery process) holds spools for the training process
    ``training_pid``: their locks name that process, and this one as its delivery process."""
    global _training_pid
    _training_pid = training_pid


class SpoolLock:
    """An exclusive ``flock`` on ``<spool>/lock``, held by whoever writes the spool: the training
    process for its whole run, an ``otel-rl replay`` while it delivers. The kernel releases it
    when the holder dies, however it dies, so a killed holder never leaves it stale. The file
    says who holds it (pid, host, what, since when) for the message of the one who waits.
    """

    def __init__(self, directory: Path, what: str) -> None:
        self.path = directory / "lock"
        self.what = what
        self._file: Any = None

    def acquire(self, wait: float = 0.0, stop: Callable[[], bool] | None = None) -> None:
        """Take the lock, waiting up to ``wait`` seconds (less if ``stop()`` turns true: a
        signal); :class:`SpoolBusy` names the holder.

        ``OSError`` (a read-only folder, another owner) propagates: the caller says how to fix it.
        """
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, _FILE_MODE)
        f = os.fdopen(fd, "r+b", buffering=0)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline or (stop is not None and stop()):
                    holder = self.holder()
                    f.close()
                    raise SpoolBusy(self.path.parent, holder) from None
                time.sleep(0.1)
        self._file = f
        info = {"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        if _training_pid is not None:  # the operator looks for the training process
            info.update(pid=_training_pid, delivery_pid=os.getpid())
        f.truncate(0)
        f.write(json.dumps(info).encode())

    def holder(self) -> str:
        """Who holds the lock, as the holder wrote it (best effort: it may be mid-write)."""
        try:
            info = json.loads(self.path.read_bytes() or b"{}")
            pid = f"pid {info['pid']}"
            if "delivery_pid" in info:
                pid += f", its delivery process pid {info['delivery_pid']}"
            return f"{info['what']} ({pid} on {info['host']}, since {info['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    @property
    def file(self) -> Any:
        """The open lock file while held, else ``None``."""
        return self._file

    def release(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()  # closing the last descriptor releases the flock
        self._file = None


# ---- record encoding --------------------------------------------------------------------------


class CorruptRecord(ValueError):
    """A spool line that cannot be turned back into a record."""


def encode_record(seq: int, record: Any) -> str:
    """One JSON line for ``record``. A step's body is encoded once and kept on the batch: every
    tracker's spool writes the same line but for its ``seq``, which ends it."""
    body = getattr(record, "spool_body", None)
    if body is None:
        if isinstance(record, Record):
            fields = {"kind": record.kind, **record.encode()}
        else:  # an object of a third party's own: delivered live, not replayable
            fields = {"kind": "opaque", "type": type(record).__name__}
        body = json.dumps(fields, separators=(",", ":"), default=str)
        if isinstance(record, StepBatch):
            record.spool_body = body
    return f'{body[:-1]},"seq":{seq}}}\n'


def decode_record(line: str) -> tuple[int, Any]:
    """``(seq, record)``; the record is ``None`` for entries that cannot be replayed.

    Raises :class:`CorruptRecord` for a line that is not a record of this format.
    """
    try:
        body = json.loads(line)
        if not isinstance(body, dict):
            raise TypeError(f"a JSON {type(body).__name__}, not an object")
        seq, kind = body["seq"], body["kind"]
        if type(seq) is not int or seq < 1:
            raise TypeError(f"seq {seq!r} is not a positive integer")
        if kind == "opaque":
            return seq, None
        if kind not in Record.kinds:
            raise TypeError(f"unknown record kind {kind!r}")
        return seq, Record.kinds[kind].decode(body)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        if isinstance(exc, CorruptRecord):
            raise
        raise CorruptRecord(f"{type(exc).__name__}: {exc}") from exc


# ---- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    """A line of a segment that could not be read back."""

    path: Path
    offset: int
    reason: str
    #: The sequence numbers the line held, when the readable lines around it tell (``None``: at
    #: the end of the log, where nothing follows to tell).
    seqs: range | None = None
    #: ``"unreadable"``: a line that cannot be decoded; ``"missing"``: records the numbering
    #: says were written but no segment holds (``path`` is the spool, ``offset`` -1).
    kind: str = "unreadable"


@dataclass(frozen=True)
class Attempt:
    """A write a tracker was given: records ``first..last`` (``records`` of them, when noted)
    and where the tracker's output stood before it (``TrackerExporter.write_position``)."""

    first: int
    last: int
    position: Any
    records: int | None = None


@dataclass
class Acks:
    """Which sequence numbers are done, and the last write attempted."""

    upto: int = 0
    ones: set[int] = field(default_factory=set)
    attempt: Attempt | None = None
    #: Unreadable lines an earlier replay reported and set aside: ``(segment name, offset)``.
    set_aside: set[tuple[str, int]] = field(default_factory=set)
    #: Ranges of missing records an earlier replay reported: lost, not waiting.
    gone: list[range] = field(default_factory=list)

    def done(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.ones or any(seq in r for r in self.gone)


def segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("wal-*.jsonl"))


def _first_seq(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def read_segment(
    path: Path,
    offset: int = 0,
    skipped: list[Skipped] | None = None,
    *,
    final: bool = False,
) -> Iterator[tuple[int, Any, int]]:
    """``(seq, record, end_offset)`` for each complete line of a segment from byte ``offset``.

    The file is read as bytes and each line decoded alone, so damaged bytes cost only the lines
    they touch. A last line without its newline is a write cut short (by a crash, or still being
    written): it ends the iteration, and with ``final`` (nobody writes this log any more) it is
    reported in ``skipped`` too. Lines that cannot be decoded are appended to ``skipped`` (when
    given) and passed over.
    """
    with path.open("rb") as f:
        f.seek(offset)
        position = offset
        for raw in f:
            start, position = position, position + len(raw)
            if not raw.endswith(b"\n"):
                if final and skipped is not None:
                    skipped.append(Skipped(
                        path, start, f"incomplete last line ({len(raw)} bytes without a newline: "
                        "a write cut short by a crash, or damaged)",
                    ))  # fmt: skip
                return
            try:
                seq, record = decode_record(raw.decode("utf-8"))
            except (CorruptRecord, UnicodeDecodeError) as exc:
                if skipped is not None:
                    skipped.append(Skipped(path, start, _reason(exc, raw)))
                whole = _whole_record_after_damage(raw)
                if whole is not None:
                    yield (*whole, position)
                continue
            yield seq, record, position


#: How every record line starts (``encode_record``). A nested object can start alike (a
#: hyperparameter named ``kind``), but what follows it never parses as one whole line.
_LINE_START = b'{"kind":"'


def _whole_record_after_damage(raw: bytes) -> tuple[int, Any] | None:
    """A whole record at the end of a damaged line: damage over a line's newline joins it to
    the next line, whose bytes are intact and must not be lost with it."""
    at = raw.find(_LINE_START, 1)
    while at > 0:
        try:
            return decode_record(raw[at:].decode("utf-8"))
        except (CorruptRecord, UnicodeDecodeError):
            at = raw.find(_LINE_START, at + 1)
    return None


def _reason(exc: Exception, raw: bytes) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start})"
    nul = raw.find(0)
    if nul >= 0:
        return f"NUL byte at column {nul}; {exc}"
    return str(exc)


def read_acks(directory: Path) -> Acks:
    acks = Acks()
    path = directory / "acked.log"
    if not path.exists():
        return acks
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        kind, _, number = line.partition(" ")
        if kind in ("try", "tried"):  # "try": without the record count (older spools)
            acks.attempt = _parse_attempt(number, counted=kind == "tried") or acks.attempt
            continue
        if kind == "bad":
            segment, _, offset = number.partition(" ")
            if offset.isdigit():
                acks.set_aside.add((segment, int(offset)))
            continue
        if kind == "gone":
            first, _, last = number.partition(" ")
            if first.isdigit() and last.isdigit():
                acks.gone.append(range(int(first), int(last) + 1))
            continue
        if not number.isdigit():
            continue  # a torn line from a crash
        if kind == "upto":
            acks.upto = max(acks.upto, int(number))
        elif kind == "one":
            acks.ones.add(int(number))
    return acks


def _parse_attempt(text: str, counted: bool) -> Attempt | None:
    first, _, rest = text.partition(" ")
    last, _, rest = rest.partition(" ")
    records = None
    if counted:
        count, _, rest = rest.partition(" ")
        if not count.isdigit():
            return None
        records = int(count)
    if not (first.isdigit() and last.isdigit()):
        return None  # a torn line from a crash
    try:
        return Attempt(int(first), int(last), json.loads(rest) if rest else None, records)
    except ValueError:
        return None


def attempt_line(first: int, last: int, records: int, position: Any) -> str:
    """The ``acked.log`` line noted before a write of ``records`` records, seqs ``first..last``,
    with the tracker's output at ``position``: replay asks the tracker whether it holds them."""
    text = json.dumps(position, separators=(",", ":"), default=str)
    return f"tried {first} {last} {records} {text}\n"


def scan(
    directory: Path, known_end: int = 0
) -> tuple[list[tuple[int, Any]], list[Skipped], set[int]]:
    """Every record not yet done (in sequence order), the unreadable lines and missing records
    that may hold records not yet done, and the ``seal`` numbers of every sealed step batch in
    the spool (done or not).

    The readable lines around an unreadable one tell which sequence numbers it held (numbers
    grow by one per line); an unreadable line whose records are all done already is passed over:
    the tracker has them. Numbers that no segment holds (a segment deleted or cut from outside)
    are reported as missing, up to ``known_end`` (the last number the run wrote, when its
    metadata says) or the last one marked or attempted.
    """
    acks = read_acks(directory)
    records: list[tuple[int, Any]] = []
    skipped: list[Skipped] = []
    sealed: set[int] = set()
    segments = segment_paths(directory)
    expected: int | None = None  # the number the next record carries
    end = max(known_end, acks.upto, acks.attempt.last if acks.attempt else 0)
    for index, path in enumerate(segments):
        last = index == len(segments) - 1
        first = _first_seq(path)
        if expected is not None and first > expected:
            skipped += _missing(directory, range(expected, first), acks)
        previous = first - 1
        here: list[Skipped] = []
        line_start = 0
        for seq, record, line_end in read_segment(path, skipped=here, final=True):
            start, line_start = line_start, line_end
            if seq <= previous:  # a line copied over another: a number that was used already
                here.append(Skipped(path, start, f"sequence number {seq} comes again after "
                                    f"{previous} (a line written over another)"))  # fmt: skip
                continue
            if here:  # the generator appends to this very list: empty it in place
                skipped.extend(_placed(here, range(previous + 1, seq), acks))
                here.clear()
            previous = seq
            if isinstance(record, StepBatch) and record.seal is not None and not record.provisional:
                sealed.add(record.seal)
            if not acks.done(seq):
                records.append((seq, record))
        expected = previous + 1
        if here:  # at the end of a segment: the next number known bounds it
            bound = _first_seq(segments[index + 1]) if not last else end + 1
            following = range(previous + 1, bound) if bound > previous + 1 or not last else None
            skipped.extend(_placed(here, following, acks))
            expected = max(expected, bound)
    if expected is None:
        expected = acks.upto + 1
    if end >= expected:
        skipped += _missing(directory, range(expected, end + 1), acks)
    return records, skipped, sealed


def _missing(directory: Path, seqs: range, acks: Acks) -> list[Skipped]:
    waiting = [seq for seq in seqs if not acks.done(seq)]
    if not waiting:
        return []
    span = range(waiting[0], waiting[-1] + 1)
    reason = "no segment holds them: a segment was deleted or cut from outside"
    return [Skipped(directory, -1, reason, span, kind="missing")]


def _placed(lines: list[Skipped], seqs: range | None, acks: Acks) -> list[Skipped]:
    """The unreadable ``lines`` between two readable ones, which held ``seqs`` between them;
    none when every one of those records is done, nor those an earlier replay set aside."""
    if seqs is not None and all(acks.done(seq) for seq in seqs):
        return []
    return [
        dataclasses.replace(line, seqs=seqs)
        for line in lines
        if (line.path.name, line.offset) not in acks.set_aside
    ]


def last_seq(directory: Path, acks: Acks | None = None) -> int:
    """The sequence number of the last whole record a spool holds or held (0 for none), read
    from the marks and the end of the last segment only (a segment holds up to 20,000 records:
    tens of megabytes, too many to read back on a deadline)."""
    last = (acks or read_acks(directory)).upto
    segments = segment_paths(directory)
    if segments:
        last = max(last, _first_seq(segments[-1]) - 1, _last_seq_in(segments[-1]))
    return last


def _last_seq_in(path: Path) -> int:
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_SCAN))
        lines = f.read().split(b"\n")[:-1]  # what follows the last newline is no whole line
    for raw in reversed(lines[1:] if size > _TAIL_SCAN else lines):
        try:
            return decode_record(raw.decode("utf-8"))[0]
        except (CorruptRecord, UnicodeDecodeError):
            continue
    # A damaged tail (or records larger than the scan): the whole segment, as replay reads it.
    return max((seq for seq, _, _ in read_segment(path)), default=0)


def waiting_records(directory: Path) -> int:
    """How many records of a spool are not marked done (0 for a folder that is no spool), read
    from the marks and the last segment only: cheap enough for a Logger's start."""
    if not (directory / "meta.json").exists() and not segment_paths(directory):
        return 0
    acks = read_acks(directory)
    last = last_seq(directory, acks)
    return sum(1 for seq in range(acks.upto + 1, last + 1) if seq not in acks.ones)


def holder_of(directory: Path) -> str | None:
    """Who holds the spool's lock right now, or ``None`` when nobody does."""
    lock = SpoolLock(directory, "a check")
    try:
        lock.acquire()
    except SpoolBusy as busy:
        return busy.holder
    except OSError:
        return None
    lock.release()
    return None


def undelivered(directory: Path) -> list[tuple[int, Any]]:
    """Every record not yet done, in sequence order."""
    return scan(directory)[0]


def write_meta(directory: Path, meta: Mapping[str, Any]) -> None:
    """Replace ``meta.json`` atomically (0600)."""
    tmp = directory / "meta.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2, sort_keys=True, default=str))
    tmp.replace(directory / "meta.json")


class DoneMarks:
    """Appends ``one N`` marks for ``otel-rl replay``: each call reaches the kernel before it
    returns, so a replay killed at any moment and run again never re-sends a marked record."""

    def __init__(self, directory: Path) -> None:
        self._file = _open_private(directory / "acked.log", "a")

    def note_attempt(self, first: int, last: int, records: int, position: Any) -> None:
        self._file.write(attempt_line(first, last, records, position))
        self._file.flush()

    def mark(self, seqs: list[int]) -> None:
        if seqs:
            self._file.write("".join(f"one {s}\n" for s in seqs))
            self._file.flush()

    def set_aside(self, lines: list[Skipped]) -> None:
        """Unreadable lines and missing records reported once: later replays pass over them
        (and exit 0)."""
        marks = [
            f"gone {s.seqs[0]} {s.seqs[-1]}\n" if s.kind == "missing" and s.seqs
            else f"bad {s.path.name} {s.offset}\n"
            for s in lines
        ]  # fmt: skip
        if marks:
            self._file.write("".join(marks))
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


# ---- the log ----------------------------------------------------------------------------------


class Spool:
    """The write-ahead log of one tracker for one run (not thread-safe: see the owners).

    The writer side (``append``/``sync``) belongs to the exporter's spool thread, the ack side
    (``ack``/``sync_acks``/``delete_done_segments``) and ``SegmentCursor`` reads to its worker
    thread.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        private_dirs(self.dir)
        # Held until close(): no replay delivers this spool while the run may still write it.
        self._lock = SpoolLock(self.dir, "the training run")
        self._lock.acquire()
        acks = read_acks(self.dir)
        self.last_seq = last_seq(self.dir, acks)
        self._segment: Any = None
        self._segment_path: Path | None = None
        self._in_segment = 0
        #: Records that JSON could not hold (delivered from memory only) and the last reason.
        self.encode_errors = 0
        self.last_encode_error = ""
        self._acks = _open_private(self.dir / "acked.log", "a")
        self._acked_upto = acks.upto

    # writer side
    def append(self, records: list[Any]) -> list[int | None]:
        """Write ``records`` (one write call); returns their sequence numbers.

        A record that cannot be encoded gets ``None`` (it is delivered from memory only). If the
        write fails (a full disk), the segment is cut back to where it was, so it never holds a
        torn line and no sequence number is used twice, and the error is raised.
        """
        if (
            self._segment is None
            or self._in_segment >= _SEGMENT_RECORDS
            or os.fstat(self._segment.fileno()).st_nlink == 0  # deleted from outside: lines
        ):  # written there could never be read back
            self._rotate()
        seqs: list[int | None] = []
        lines: list[str] = []
        seq = self.last_seq
        for record in records:
            try:
                line = encode_record(seq + 1, record)
            except (TypeError, ValueError, OverflowError) as exc:  # rows that JSON cannot hold
                seqs.append(None)
                self.encode_errors += 1
                self.last_encode_error = f"{type(exc).__name__}: {exc}"
                continue
            seq += 1
            seqs.append(seq)
            lines.append(line)
        if not lines:
            return seqs
        position = self._segment.tell()
        try:
            self._segment.write("".join(lines))
            self._segment.flush()  # into the kernel: a killed process keeps it; fsync: the OS
        except OSError:
            self._cut_back(position)
            raise
        self.last_seq = seq
        self._in_segment += len(lines)
        return seqs

    def sync(self) -> None:
        if self._segment is not None:
            self._segment.flush()
            os.fsync(self._segment.fileno())

    # ack side
    def ack(self, upto: int) -> None:
        """Mark every record up to ``upto`` done (in the kernel at once, on disk at the next
        ``sync_acks``)."""
        if upto > self._acked_upto:
            self._acks.write(f"upto {upto}\n")
            self._acks.flush()
            self._acked_upto = upto

    def note_attempt(self, first: int, last: int, records: int, position: Any) -> None:
        """Before a write of records ``first..last``: where the tracker's output stood, so that
        ``otel-rl replay`` can tell whether a write cut short by a kill reached the tracker."""
        self._acks.write(attempt_line(first, last, records, position))
        self._acks.flush()

    def sync_acks(self) -> None:
        self._acks.flush()
        os.fsync(self._acks.fileno())

    def delete_done_segments(self) -> None:
        """Delete segments whose records are all done (never the one being written)."""
        segments = segment_paths(self.dir)
        for path, next_path in itertools.pairwise(segments):
            if _first_seq(next_path) - 1 <= self._acked_upto:
                path.unlink(missing_ok=True)

    @property
    def acked_upto(self) -> int:
        return self._acked_upto

    def close_writer(self) -> None:
        try:
            _close_synced(self._segment)
        finally:
            self._release_when_closed()

    def close_acks(self) -> None:
        try:
            _close_synced(self._acks)
            self.delete_done_segments()
        finally:
            self._release_when_closed()

    def _release_when_closed(self) -> None:
        # The run holds its spool until both sides are done with it: a tracker stopped by a
        # permanent error still has its records written here until the run ends.
        if (self._segment is None or self._segment.closed) and self._acks.closed:
            self._lock.release()

    def close(self) -> None:
        self.close_writer()
        self.close_acks()

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        write_meta(self.dir, meta)

    def open_files(self) -> list[Any]:
        """The file objects this spool holds open (the fork hook points them at /dev/null)."""
        held = (self._segment, self._acks, self._lock.file)
        return [f for f in held if f is not None and not f.closed]

    def _rotate(self) -> None:
        if self._segment is not None:
            self._segment.flush()
            os.fsync(self._segment.fileno())
            self._segment.close()
        self._segment_path = self.dir / f"wal-{self.last_seq + 1:012d}.jsonl"
        _cut_incomplete_line(self._segment_path)  # an earlier run's torn write: never glue to it
        self._segment = _open_private(self._segment_path, "a")
        self._in_segment = 0

    def _cut_back(self, position: int) -> None:
        # The buffered tail may fail to write again on close; the truncate below decides.
        with contextlib.suppress(OSError):
            self._segment.close()
        assert self._segment_path is not None
        with open(self._segment_path, "r+b") as f:
            f.truncate(position)
        self._segment = _open_private(self._segment_path, "a")


def _cut_incomplete_line(path: Path) -> None:
    """Drop a last line without its newline, so that the next append starts a line of its own."""
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(max(0, size - _TAIL_SCAN))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n")
            f.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))
    except FileNotFoundError:
        return


class SegmentCursor:
    """Reads records back from a spool in sequence order, resuming where the last read ended,
    so that draining a backlog of N records reads each line once (linear in N)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._path: Path | None = None
        self._offset = 0
        self._next_seq = 0  # the seq the saved position points at

    def read(self, start: int, upto: int, limit: int) -> list[tuple[int, Any]]:
        """Up to ``limit`` records with ``start <= seq <= upto``."""
        out: list[tuple[int, Any]] = []
        segments = segment_paths(self._dir)
        for path, following in itertools.zip_longest(segments, segments[1:]):
            if following is not None and _first_seq(following) <= start:
                continue  # every record of this segment comes before start
            resume = path == self._path and self._next_seq == start
            for seq, record, end in read_segment(path, self._offset if resume else 0):
                if seq < start:
                    continue
                if seq > upto:
                    return out
                out.append((seq, record))
                start = seq + 1
                self._path, self._offset, self._next_seq = path, end, start
                if len(out) >= limit:
                    return out
        return out
