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
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.records import Record, StepBatch

SPOOL_DIRNAME = ".otel-rl/spool"
_SEGMENT_RECORDS = 20_000
_DIR_MODE = 0o700
_FILE_MODE = 0o600


def spool_root(log_dir: str | os.PathLike[str]) -> Path:
    return Path(log_dir) / SPOOL_DIRNAME


def _private_dirs(directory: Path) -> None:
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


# ---- record encoding --------------------------------------------------------------------------


class CorruptRecord(ValueError):
    """A spool line that cannot be turned back into a record."""


def encode_record(seq: int, record: Any) -> str:
    """One JSON line for ``record``."""
    if isinstance(record, Record):
        body = {"kind": record.kind, **record.encode()}
    else:  # an object of a third party's own: delivered live, not replayable
        body = {"kind": "opaque", "type": type(record).__name__}
    body["seq"] = seq
    return json.dumps(body, separators=(",", ":"), default=str) + "\n"


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


@dataclass(frozen=True)
class Attempt:
    """A write a tracker was given: records ``first..last`` and where the tracker's output stood
    before it (``TrackerExporter.write_position``)."""

    first: int
    last: int
    position: Any


@dataclass
class Acks:
    """Which sequence numbers are done, and the last write attempted."""

    upto: int = 0
    ones: set[int] = field(default_factory=set)
    attempt: Attempt | None = None

    def done(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.ones


def segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("wal-*.jsonl"))


def _first_seq(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def read_segment(
    path: Path, offset: int = 0, skipped: list[Skipped] | None = None
) -> Iterator[tuple[int, Any, int]]:
    """``(seq, record, end_offset)`` for each complete line of a segment from byte ``offset``.

    A last line without its newline is a write cut short by a crash (or still being written):
    it ends the iteration. Lines that cannot be decoded are appended to ``skipped`` (when given)
    and passed over.
    """
    with path.open("rb") as f:
        f.seek(offset)
        position = offset
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            start, position = position, position + len(raw)
            try:
                seq, record = decode_record(raw.decode("utf-8"))
            except (CorruptRecord, UnicodeDecodeError) as exc:
                if skipped is not None:
                    skipped.append(Skipped(path, start, str(exc)))
                continue
            yield seq, record, position


def read_acks(directory: Path) -> Acks:
    acks = Acks()
    path = directory / "acked.log"
    if not path.exists():
        return acks
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        kind, _, number = line.partition(" ")
        if kind == "try":
            acks.attempt = _parse_attempt(number) or acks.attempt
            continue
        if not number.isdigit():
            continue  # a torn line from a crash
        if kind == "upto":
            acks.upto = max(acks.upto, int(number))
        elif kind == "one":
            acks.ones.add(int(number))
    return acks


def _parse_attempt(text: str) -> Attempt | None:
    first, _, rest = text.partition(" ")
    last, _, position = rest.partition(" ")
    if not (first.isdigit() and last.isdigit()):
        return None  # a torn line from a crash
    try:
        return Attempt(int(first), int(last), json.loads(position) if position else None)
    except ValueError:
        return None


def scan(directory: Path) -> tuple[list[tuple[int, Any]], list[Skipped], set[int]]:
    """Every record not yet done (in sequence order), the lines that could not be read, and the
    ``seal`` numbers of every sealed step batch in the spool (done or not)."""
    acks = read_acks(directory)
    records: list[tuple[int, Any]] = []
    skipped: list[Skipped] = []
    sealed: set[int] = set()
    for path in segment_paths(directory):
        for seq, record, _ in read_segment(path, skipped=skipped):
            if isinstance(record, StepBatch) and record.seal is not None and not record.provisional:
                sealed.add(record.seal)
            if not acks.done(seq):
                records.append((seq, record))
    return records, skipped, sealed


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

    def note_attempt(self, first: int, last: int, position: Any) -> None:
        text = json.dumps(position, separators=(",", ":"), default=str)
        self._file.write(f"try {first} {last} {text}\n")
        self._file.flush()

    def mark(self, seqs: list[int]) -> None:
        if seqs:
            self._file.write("".join(f"one {s}\n" for s in seqs))
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def mark_done(directory: Path, seqs: list[int]) -> None:
    marks = DoneMarks(directory)
    try:
        marks.mark(seqs)
    finally:
        marks.close()


# ---- the log ----------------------------------------------------------------------------------


class Spool:
    """The write-ahead log of one tracker for one run (not thread-safe: see the owners).

    The writer side (``append``/``sync``) belongs to the exporter's spool thread, the ack side
    (``ack``/``sync_acks``/``delete_done_segments``) and ``SegmentCursor`` reads to its worker
    thread.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        _private_dirs(self.dir)
        acks = read_acks(self.dir)
        self.last_seq = max(acks.upto, self._last_seq_on_disk())
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

    def note_attempt(self, first: int, last: int, position: Any) -> None:
        """Before a write of records ``first..last``: where the tracker's output stood, so that
        ``otel-rl replay`` can tell whether a write cut short by a kill reached the tracker."""
        text = json.dumps(position, separators=(",", ":"), default=str)
        self._acks.write(f"try {first} {last} {text}\n")
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
        _close_synced(self._segment)

    def close_acks(self) -> None:
        _close_synced(self._acks)
        self.delete_done_segments()

    def close(self) -> None:
        self.close_writer()
        self.close_acks()

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        write_meta(self.dir, meta)

    def _rotate(self) -> None:
        if self._segment is not None:
            self._segment.flush()
            os.fsync(self._segment.fileno())
            self._segment.close()
        self._segment_path = self.dir / f"wal-{self.last_seq + 1:012d}.jsonl"
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

    def _last_seq_on_disk(self) -> int:
        segments = segment_paths(self.dir)
        if not segments:
            return 0
        last = _first_seq(segments[-1]) - 1
        for seq, _, _ in read_segment(segments[-1]):
            last = seq
        return last


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
