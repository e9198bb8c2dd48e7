"""A per-tracker write-ahead log: records reach disk before a tracker sees them.

Layout, for one tracker of one run (folders 0700 from ``.otel-rl`` down, files 0600: rows and
configs are private; the log dir above them keeps the umask's mode)::

    <log_dir>/.otel-rl/spool/<tracker>/<run_id>/
        meta.json                 tracker name, logger config, how to resume the tracker's run
        wal-000000000001.jsonl    records, one JSON object per line: {"seq": n, "kind": ..., ...}
        acked.log                 delivery marks: "upto N" (every seq <= N is done) or "one N"

Sequence numbers start at 1 and grow by one per record. A tracker's worker delivers in order, so
its marks are ``upto`` lines; ``otel-rl replay`` re-sends in step order and writes ``upto`` while
every earlier record is done, ``one`` marks for the others. The spool thread marks ``one`` the
checkpoints of a pending step that a record it spooled supersedes (the step's sealed batch, or a
newer checkpoint of it), which replay would pass over: what waits is then counted alike by the
run's exit message, :func:`waiting_records` and replay.
Every mark is written to the kernel as soon as the tracker holds the record (so a killed process
never re-sends what its tracker already has) and fsynced every ``export.fsync_interval``.
Segments whose records are all done are deleted by the side that marks them done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import re
import socket
import threading
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.core.records import StepBatch, record_from_fields, record_json

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
    """Create ``directory`` and its missing parents: 0700 from the ``.otel-rl`` folder down
    (the umask cannot widen them), the folders above it with the umask's mode.

    The folders above ``.otel-rl`` are the run's log dir and its parents, which also hold what
    the user shares (``metrics.jsonl``, TensorBoard files): a teammate must be able to enter
    them. A ``directory`` outside any ``.otel-rl`` folder is private with all its missing
    parents, as no part of it is known to be the user's.
    """
    private_top = _private_top(directory)
    missing = []
    path = directory
    while not path.exists():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        if private_top is not None and not path.is_relative_to(private_top):
            path.mkdir(exist_ok=True)
            continue
        try:
            path.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(path, _DIR_MODE)


def _private_top(directory: Path) -> Path | None:
    """The ``.otel-rl`` folder ``directory`` is in (or is), else ``None``."""
    top = SPOOL_DIRNAME.split("/", 1)[0]
    for path in (directory, *directory.parents):
        if path.name == top:
            return path
    return None


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


#: What an ``otel-rl replay`` writes in the lock file of a spool it delivers.
REPLAY_LOCK = "otel-rl replay"


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
    """One line for ``record``: the record's JSON (:func:`~otel_rl.core.records.record_json`,
    encoded once per step for every tracker's spool), ended by its ``seq``."""
    return f'{record_json(record)[:-1]},"seq":{seq}}}\n'


def decode_record(line: str) -> tuple[int, Any]:
    """``(seq, record)``; the record is ``None`` for entries that cannot be replayed.

    Raises :class:`CorruptRecord` for a line that is not a record of this format.
    """
    try:
        body = json.loads(line)
        if not isinstance(body, dict):
            raise TypeError(f"a JSON {type(body).__name__}, not an object")
        seq = body["seq"]
        if type(seq) is not int or seq < 1:
            raise TypeError(f"seq {seq!r} is not a positive integer")
        return seq, record_from_fields(body)
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


class SeqSet:
    """A set of sequence numbers kept as sorted, disjoint ranges in two arrays: 16 bytes per
    range however many numbers it holds, so that the marks of a long replay (numbers that follow
    one another) cost a few bytes, not a Python object each. Adding at the end is O(1); adding
    elsewhere moves the ranges after it (a C ``memmove``)."""

    __slots__ = ("_hi", "_lo")

    def __init__(self, seqs: Iterable[int] = ()) -> None:
        self._lo = array("q")
        self._hi = array("q")
        for seq in seqs:
            self.add(seq)

    @classmethod
    def from_ranges(cls, ranges: Iterable[tuple[int, int]], presorted: bool = False) -> SeqSet:
        """The union of ``(first, last)`` ranges, given in any order (sorted here), or sorted by
        ``first`` already (``presorted``: read as they come, never held as a list)."""
        out = cls()
        lo, hi = out._lo, out._hi
        for first, last in ranges if presorted else sorted(ranges):
            if lo and first <= hi[-1] + 1:
                hi[-1] = max(hi[-1], last)
            else:
                lo.append(first)
                hi.append(last)
        return out

    def add(self, seq: int) -> None:
        self.add_range(seq, seq)

    def add_range(self, first: int, last: int) -> None:
        lo, hi = self._lo, self._hi
        if not lo or first > hi[-1] + 1:  # the usual case: after every range held
            lo.append(first)
            hi.append(last)
            return
        if first == hi[-1] + 1:  # right after the last range (numbers that follow one another)
            hi[-1] = last
            return
        i = bisect_right(lo, first)
        if i and hi[i - 1] >= first - 1:  # touches the range before it: grow that one
            i -= 1
            if last <= hi[i]:
                return
            hi[i] = last
        else:
            lo.insert(i, first)
            hi.insert(i, last)
        j = i + 1
        while j < len(lo) and lo[j] <= hi[i] + 1:  # ranges it now reaches merge into it
            hi[i] = max(hi[i], hi[j])
            j += 1
        del lo[i + 1 : j], hi[i + 1 : j]

    def end_of(self, seq: int) -> int | None:
        """The last number of the range holding ``seq`` (``None`` when ``seq`` is not held)."""
        i = bisect_right(self._lo, seq) - 1
        return self._hi[i] if i >= 0 and self._hi[i] >= seq else None

    def start_of(self, seq: int) -> int | None:
        """The first number of the range holding ``seq`` (``None`` when ``seq`` is not held)."""
        i = bisect_right(self._lo, seq) - 1
        return self._lo[i] if i >= 0 and self._hi[i] >= seq else None

    def __contains__(self, seq: object) -> bool:
        if isinstance(seq, float) and seq.is_integer():  # equal to an int, as in a set
            seq = int(seq)
        return isinstance(seq, int) and self.end_of(seq) is not None

    def discard_upto(self, seq: int) -> None:
        """Forget every number ``<= seq``."""
        i = bisect_right(self._hi, seq)
        del self._lo[:i], self._hi[:i]
        if self._lo and self._lo[0] <= seq:
            self._lo[0] = seq + 1

    def ranges(self) -> Iterator[tuple[int, int]]:
        return zip(self._lo, self._hi, strict=True)

    def __iter__(self) -> Iterator[int]:
        for first, last in zip(self._lo, self._hi, strict=True):
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return sum(self._hi) - sum(self._lo) + len(self._lo)

    def __bool__(self) -> bool:
        return bool(self._lo)

    @property
    def range_count(self) -> int:
        return len(self._lo)

    def __repr__(self) -> str:
        return f"SeqSet({list(self.ranges())})"


@dataclass
class Acks:
    """Which sequence numbers are done, and the last write attempted."""

    upto: int = 0
    ones: SeqSet = field(default_factory=SeqSet)
    attempt: Attempt | None = None
    #: Unreadable lines an earlier replay reported and set aside: ``(segment name, offset)``.
    set_aside: set[tuple[str, int]] = field(default_factory=set)
    #: Ranges of missing records an earlier replay reported: lost, not waiting.
    gone: list[range] = field(default_factory=list)

    def done(self, seq: int) -> bool:
        return (
            seq <= self.upto
            or (bool(self.ones) and seq in self.ones)
            or (bool(self.gone) and any(seq in r for r in self.gone))
        )

    def done_through(self, seq: int) -> int | None:
        """When ``seq`` is done, the last number of the stretch of done numbers one of the marks
        gives from it (``upto``, a range of ``one`` marks, a ``gone`` range); else ``None``."""
        if seq <= self.upto:
            return self.upto
        end = self.ones.end_of(seq) if self.ones else None
        for r in self.gone:
            if seq in r:
                end = max(end or seq, r[-1])
        return end

    def done_from(self, seq: int) -> int | None:
        """When ``seq`` is done, the first number of the stretch of done numbers one of the
        marks gives up to it; else ``None``."""
        if seq <= self.upto:
            return 0
        start = self.ones.start_of(seq) if self.ones else None
        for r in self.gone:
            if seq in r:
                start = min(seq if start is None else start, r[0])
        return start


def segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("wal-*.jsonl"))


def _first_seq(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def first_seq(path: Path) -> int:
    """The sequence number a segment's first record has (its name says)."""
    return _first_seq(path)


#: ``parse(line bytes) -> (seq, value)``: what a reader keeps of each line (a record, or the few
#: facts of one); raises :class:`CorruptRecord` or ``UnicodeDecodeError`` for a bad line.
LineParser = Callable[[bytes], tuple[int, Any]]


def parse_record(raw: bytes) -> tuple[int, Any]:
    """``(seq, record)`` of one line's bytes (:func:`decode_record`)."""
    return decode_record(raw.decode("utf-8"))


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
    for seq, record, _, end in read_lines(path, offset, skipped, final=final):
        yield seq, record, end


def read_lines(
    path: Path,
    offset: int = 0,
    skipped: list[Skipped] | None = None,
    *,
    final: bool = False,
    parse: LineParser = parse_record,
) -> Iterator[tuple[int, Any, int, int]]:
    """:func:`read_segment` with the line's start offset too, ``(seq, value, start, end)``, each
    line turned into ``value`` by ``parse``. A record read whole at the end of a damaged line
    starts where that line starts: reading from ``start`` finds it again."""
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
                seq, value = parse(raw)
            except (CorruptRecord, UnicodeDecodeError) as exc:
                if skipped is not None:
                    skipped.append(Skipped(path, start, _reason(exc, raw)))
                whole = _whole_record_after_damage(raw, parse)
                if whole is not None:
                    yield (*whole, start, position)
                continue
            yield seq, value, start, position


def record_at(f: Any, offset: int) -> tuple[int, Any]:
    """``(seq, record)`` of the line starting at byte ``offset`` of an open segment (``"rb"``),
    read as :func:`read_lines` reads it (a record whole at the end of a damaged line too);
    :class:`CorruptRecord` when none is there."""
    f.seek(offset)
    raw = f.readline()
    if not raw.endswith(b"\n"):
        raise CorruptRecord(f"no whole line at byte {offset}")
    try:
        return parse_record(raw)
    except (CorruptRecord, UnicodeDecodeError) as exc:
        whole = _whole_record_after_damage(raw)
        if whole is None:
            raise CorruptRecord(f"no record at byte {offset}: {exc}") from exc
        return whole


#: How every record line starts (``encode_record``). A nested object can start alike (a
#: hyperparameter named ``kind``), but what follows it never parses as one whole line.
_LINE_START = b'{"kind":"'


def _whole_record_after_damage(
    raw: bytes, parse: LineParser = parse_record
) -> tuple[int, Any] | None:
    """A whole record at the end of a damaged line: damage over a line's newline joins it to
    the next line, whose bytes are intact and must not be lost with it."""
    at = raw.find(_LINE_START, 1)
    while at > 0:
        try:
            return parse(raw[at:])
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


# What otel-rl replay needs of a line before it decodes it for a tracker. A step line as
# encode_record writes it is recognised by one regular expression over its bytes (about a
# quarter of decode_record's time). It is strict: printable ASCII strings (encode_record's JSON
# escapes everything else), JSON numbers, rows of numbers, strings and histograms, the keys in
# encode_record's order. Whatever it matches, json.loads and StepBatch.decode accept with the
# same values; whatever it does not (other kinds, damaged lines, hand-written ones) goes through
# decode_record, so a line is judged exactly as replay always judged it.
_STR = rb'"[\x20\x21\x23-\x5b\x5d-\x7e]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[\x20\x21\x23-\x5b\x5d-\x7e]*+)*+"'  # noqa: E501
_NUM = rb"(?:-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+|NaN|-?Infinity)"
_INT = rb"-?+(?:0|[1-9][0-9]*+)"
_NUMS = rb"\[(?:" + _NUM + rb"(?:," + _NUM + rb")*+)?+\]"
_HISTOGRAM = rb'\{"__histogram__":\[' + _NUMS + rb"," + _NUMS + (rb"," + _NUM) * 4 + rb"\]\}"
_VALUE = rb"(?:" + _NUM + rb"|" + _STR + rb"|" + _HISTOGRAM + rb")"
_STEP_LINE = re.compile(
    rb'\{"kind":"step","step":(' + _INT + rb'),"time":' + _NUM
    + rb',"axis":(null|' + _STR + rb')'
    + rb',"step_metrics":\{(?:' + _STR + rb":" + _STR + rb"(?:," + _STR + rb":" + _STR
    + rb")*+)?+\}"
    + rb',"rows":\{(?:' + _STR + rb":" + _VALUE + rb"(?:," + _STR + rb":" + _VALUE + rb")*+)?+\}"
    + rb'(?:,"seal":(' + _INT + rb"))?+"
    + rb'(?:,"provisional":(true))?+'
    + rb'(?:,"intake":\[' + _STR + rb"," + _INT + rb"\])?+"
    + rb',"seq":([1-9][0-9]*+)\}\n'
)  # fmt: skip

#: :data:`LineFacts`' first field: an entry that cannot be replayed (an object of a third
#: party's own), a step batch, or another record (hyperparameters, a plot, a table, an event).
OPAQUE, STEP, OTHER = 0, 1, 2

#: ``(kind, step, axis, seal, provisional)``: ``kind`` one of OPAQUE, STEP, OTHER; ``step`` the
#: record's step (-1 for records without one); ``axis`` whether a step batch is on another axis
#: than the training step; ``seal`` and ``provisional`` a step batch's.
LineFacts = tuple[int, Any, bool, Any, bool]


def parse_facts(raw: bytes) -> tuple[int, LineFacts]:
    """``(seq, facts)`` of one line's bytes, without building its record when the line is a
    step as :func:`encode_record` writes it; raises as :func:`parse_record` does."""
    match = _STEP_LINE.fullmatch(raw)
    if match is not None:
        step, axis, seal, provisional, seq = match.groups()
        return int(seq), (
            STEP, int(step), axis != b"null", None if seal is None else int(seal),
            provisional is not None,
        )  # fmt: skip
    seq, record = parse_record(raw)
    return seq, facts_of(record)


def facts_of(record: Any) -> LineFacts:
    if record is None:
        return (OPAQUE, -1, False, None, False)
    if isinstance(record, StepBatch):
        return (STEP, record.step, record.axis is not None, record.seal, record.provisional)
    return (OTHER, getattr(record, "step", -1), False, None, False)


def read_acks(directory: Path) -> Acks:
    """The marks of ``acked.log``, read line by line: ``one`` marks are kept as ranges
    (:class:`SeqSet`), so that a log of millions of them costs a few ranges, not a set."""
    acks = Acks()
    path = directory / "acked.log"
    if not path.exists():
        return acks
    # one marks, as ranges of numbers that follow one another, in the order they come
    firsts, lasts = array("q"), array("q")
    in_order = True
    # newline="": lines end where splitlines() would end them too (each piece is split again)
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        for text in f:
            for line in text.splitlines():
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
                    seq = int(number)
                    if firsts and firsts[-1] <= seq <= lasts[-1] + 1:
                        lasts[-1] = max(lasts[-1], seq)
                        continue
                    if firsts and seq < firsts[-1]:
                        in_order = False
                    firsts.append(seq)
                    lasts.append(seq)
    acks.ones = _ranges_above(firsts, lasts, acks.upto, in_order)
    return acks


#: Ranges sorted at a time when ``one`` marks came out of order (a replay far out of sequence
#: order): a sort of tuples for this many only, the rest stays in arrays.
_SORT_CHUNK = 1 << 16


def _ranges_above(firsts: array[int], lasts: array[int], upto: int, in_order: bool) -> SeqSet:
    """The ranges as a :class:`SeqSet`, without what ``upto`` already covers."""
    if in_order:
        kept = ((a, b) for a, b in zip(firsts, lasts, strict=True) if b > upto)
        return SeqSet.from_ranges(kept, presorted=True)
    chunks = []
    for at in range(0, len(firsts), _SORT_CHUNK):
        ends = lasts[at : at + _SORT_CHUNK]
        part = sorted((a, b) for a, b in zip(firsts[at : at + _SORT_CHUNK], ends, strict=True)
                      if b > upto)  # fmt: skip
        chunks.append((array("q", (a for a, _ in part)), array("q", (b for _, b in part))))
    del firsts[:], lasts[:]
    merged = heapq.merge(*(zip(a, b, strict=True) for a, b in chunks))
    return SeqSet.from_ranges(merged, presorted=True)


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
    the spool (done or not). All in memory: ``otel-rl replay`` streams the spool with
    :func:`walk` instead.
    """
    acks = read_acks(directory)
    records: list[tuple[int, Any]] = []
    skipped: list[Skipped] = []
    sealed: set[int] = set()
    for seq, record, _, _ in walk(directory, acks, skipped, known_end=known_end):
        if isinstance(record, StepBatch) and record.seal is not None and not record.provisional:
            sealed.add(record.seal)
        if not acks.done(seq):
            records.append((seq, record))
    return records, skipped, sealed


def walk(
    directory: Path,
    acks: Acks,
    skipped: list[Skipped],
    *,
    segments: list[Path] | None = None,
    known_end: int = 0,
    parse: LineParser = parse_record,
) -> Iterator[tuple[int, Any, int, int]]:
    """``(seq, value, segment, start)`` of every line of the spool read back whole, done or not,
    in the order of the segments (``segments``, an index into them) and of their lines
    (``start``, the line's byte offset); unreadable lines and missing records that may hold
    records not yet done are appended to ``skipped`` as they are found.

    The readable lines around an unreadable one tell which sequence numbers it held (numbers
    grow by one per line); an unreadable line whose records are all done already is passed over:
    the tracker has them. Numbers that no segment holds (a segment deleted or cut from outside)
    are reported as missing, up to ``known_end`` (the last number the run wrote, when its
    metadata says) or the last one marked or attempted, and so are numbers a segment skips
    between two readable lines (a line cut out of it). A line whose number was used already in
    its segment (written over another) is unreadable too.
    """
    if segments is None:
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
        shown = 0  # where a line written over another is said to start (the last line's end)
        for seq, value, start, line_end in read_lines(path, 0, here, final=True, parse=parse):
            at, shown = shown, line_end
            if seq <= previous:  # a line copied over another: a number that was used already
                here.append(Skipped(path, at, f"sequence number {seq} comes again after "
                                    f"{previous} (a line written over another)"))  # fmt: skip
                continue
            if here:  # the generator appends to this very list: empty it in place
                skipped.extend(_placed(here, range(previous + 1, seq), acks))
                here.clear()
            elif seq > previous + 1:  # numbers no line holds: a line cut out of the segment
                skipped += _missing(directory, range(previous + 1, seq), acks)
            previous = seq
            yield seq, value, index, start
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


def pending_count(directory: Path, known_end: int = 0) -> int:
    """How many records of a spool are not done, read line by line (what :func:`scan` would
    return, counted without holding them)."""
    acks = read_acks(directory)
    return sum(
        1
        for seq, _, _, _ in walk(directory, acks, [], known_end=known_end, parse=parse_facts)
        if not acks.done(seq)
    )


def _missing(directory: Path, seqs: range, acks: Acks) -> list[Skipped]:
    # The first and last numbers not done, found a stretch of marks at a time, never a number
    # at a time: the range may be long (a mark far past the end, in a damaged acked.log).
    first = seqs.start
    while first < seqs.stop and (through := acks.done_through(first)) is not None:
        first = through + 1
    if first >= seqs.stop:
        return []
    last = seqs.stop - 1
    while (start := acks.done_from(last)) is not None:
        last = start - 1  # (it stops at ``first``, which is not done)
    span = range(first, last + 1)
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
    for seq, _ in _tail_records(path):
        return seq
    # A damaged tail (or records larger than the scan): the whole segment, as replay reads it.
    return max((seq for seq, _, _ in read_segment(path)), default=0)


def held_by_a_live_run(directory: Path) -> bool:
    """Whether a training run that is alive holds the spool: not a replay, and not the delivery
    process of a training process that died (it lets go once it has spooled what it was
    handed)."""
    holder = holder_of(directory)
    if holder is None or holder.startswith(REPLAY_LOCK):
        return False
    try:
        info = json.loads((directory / "lock").read_bytes())
        if "delivery_pid" not in info or info["host"] != socket.gethostname():
            return True
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return True


def waiting_records(directory: Path) -> int:
    """How many records of a spool are not marked done (0 for a folder that is no spool), read
    from the marks and the last segment only: cheap enough for a Logger's start."""
    if not (directory / "meta.json").exists() and not segment_paths(directory):
        return 0
    acks = read_acks(directory)
    last = last_seq(directory, acks)
    return sum(1 for seq in range(acks.upto + 1, last + 1) if seq not in acks.ones)


@dataclass(frozen=True)
class SpoolEnd:
    """Where a spool stands, read from its marks and the end of its last segment only."""

    #: The last record's sequence number (0 for none), and how many are not marked done.
    last_seq: int
    waiting: int
    #: The last record's ``(launch, frame number)``, when a delivery process spooled it.
    last_intake: tuple[str, int] | None
    #: Checkpoints not marked done after the spool's last sealed step batch: those of a step
    #: still being logged when its writer stopped (replay delivers one if the step is never
    #: sealed; a sealed batch spooled later supersedes them).
    open_checkpoints: int


def spool_end(directory: Path) -> SpoolEnd:
    """The spool's :class:`SpoolEnd`: cheap enough for the end of a run (the marks, and the
    lines after the last sealed step of the last segment's tail)."""
    acks = read_acks(directory)
    last = last_seq(directory, acks)
    waiting = sum(1 for seq in range(acks.upto + 1, last + 1) if seq not in acks.ones)
    intake: tuple[str, int] | None = None
    checkpoints = 0
    segments = segment_paths(directory)
    if segments:
        for index, (seq, record) in enumerate(_tail_records(segments[-1])):
            if index == 0 and record is not None:
                intake = record.intake
            if not isinstance(record, StepBatch) or record.axis is not None:
                continue
            if not record.provisional or seq <= acks.upto:  # done from here back
                break
            checkpoints += not acks.done(seq)
    return SpoolEnd(last, waiting, intake, checkpoints)


def _tail_records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(seq, record)`` of the whole lines at the end of a segment (its last ``_TAIL_SCAN``
    bytes), the last first; damaged lines are passed over."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_SCAN))
        lines = f.read().split(b"\n")[:-1]  # what follows the last newline is no whole line
    for raw in reversed(lines[1:] if size > _TAIL_SCAN else lines):
        try:
            yield decode_record(raw.decode("utf-8"))
        except (CorruptRecord, UnicodeDecodeError):
            continue


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


def read_meta(directory: Path) -> dict[str, Any]:
    """A spool's ``meta.json``; ``{}`` when it is missing or unreadable."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def spool_dirs(log_dir: str | os.PathLike[str]) -> list[Path]:
    """Every spool folder (``<tracker>/<run>``) under ``log_dir`` that holds a ``meta.json`` or
    segments. Hidden folders (the delivery process's ``.handoff``) are passed by, and so is a
    folder removed while it is listed (a delivery process ending beside the caller)."""
    found = []
    for tracker in _subdirs(spool_root(log_dir)):
        for spool in _subdirs(tracker):
            try:
                names = os.listdir(spool)
            except OSError:
                continue
            if any(n == "meta.json" or (n.startswith("wal-") and n.endswith(".jsonl"))
                   for n in names):
                found.append(spool)
    return sorted(found)


def _subdirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as entries:
            return [Path(e.path) for e in entries
                    if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def spools_of_run(log_dir: str | os.PathLike[str], run_id: str) -> list[Path]:
    """The spool folders every launch of ``run_id`` wrote under ``log_dir`` (by their
    metadata: a run id names a folder whatever characters it holds)."""
    return [d for d in spool_dirs(log_dir) if read_meta(d).get("run_id") == run_id]


def tracker_runs_of(log_dir: str | os.PathLike[str], run_id: str) -> dict[str, dict[str, Any]]:
    """Each tracker's run as the latest launch of ``run_id`` that opened one recorded it (its
    spool metadata's ``resume``, e.g. ``{"mlflow": {"run_id": ...}}``), by tracker name."""
    newest: dict[str, tuple[tuple[int, float], dict[str, Any]]] = {}
    for spool in spools_of_run(log_dir, run_id):
        meta = read_meta(spool)
        resume, tracker, attempt = meta.get("resume"), meta.get("tracker"), meta.get("attempt")
        if not isinstance(resume, dict) or not resume or not isinstance(tracker, str):
            continue
        try:
            order = (attempt if type(attempt) is int else 1, (spool / "meta.json").stat().st_mtime)
        except OSError:
            continue
        if tracker not in newest or order > newest[tracker][0]:
            newest[tracker] = (order, resume)
    return {tracker: resume for tracker, (_, resume) in newest.items()}


def attempts_of(log_dir: str | os.PathLike[str], run_id: str) -> int:
    """The highest attempt the spools of ``run_id`` name (0: none)."""
    found = (read_meta(spool).get("attempt") for spool in spools_of_run(log_dir, run_id))
    return max((a for a in found if type(a) is int), default=0)


def write_meta(directory: Path, meta: Mapping[str, Any]) -> None:
    """Replace ``meta.json`` atomically (0600)."""
    tmp = directory / "meta.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2, sort_keys=True, default=str))
    tmp.replace(directory / "meta.json")


class DoneMarks:
    """Appends delivery marks for ``otel-rl replay``: each call reaches the kernel before it
    returns, so a replay killed at any moment and run again never re-sends a marked record.

    Given the spool's marks as they were read before the replay (``acks``; nobody else marks the
    spool while its lock is held), a mark that leaves every number up to N done (marked before,
    or by this replay) is written ``upto N``: a replay in sequence order (steps that grow, the
    usual backlog) writes one line per write, not one per record, and the next read of the log
    is a number, not a set. Other records get ``one N`` lines; the ranges of those kept to move
    ``N`` on are bounded (:attr:`AHEAD_RANGES`: beyond them, far out of sequence order, the
    marks are ``one`` lines only).
    """

    #: Ranges of marks above the highest ``upto`` kept in memory.
    AHEAD_RANGES = 1 << 16

    def __init__(self, directory: Path, acks: Acks | None = None) -> None:
        self._file = _open_private(directory / "acked.log", "a")
        self._acks = acks
        self._upto = acks.upto if acks is not None else 0
        self._ahead = SeqSet()  # marked by this replay above self._upto

    def note_attempt(self, first: int, last: int, records: int, position: Any) -> None:
        self._file.write(attempt_line(first, last, records, position))
        self._file.flush()

    def mark(self, seqs: Iterable[int]) -> None:
        batch: list[int] = []
        for seq in seqs:
            batch.append(seq)
            if len(batch) == 4096:  # one write call each, of tens of kilobytes at most
                self._write(batch)
                batch = []
        if batch:
            self._write(batch)

    @property
    def upto(self) -> int:
        """Every number up to this one is done (as far as these marks tell)."""
        return self._upto

    def _write(self, seqs: list[int]) -> None:
        upto = self._upto
        if self._acks is not None:
            first, last = seqs[0], seqs[-1]
            if first == upto + 1 and last - first == len(seqs) - 1 and seqs == [
                *range(first, last + 1)
            ]:  # the usual write: the records right after the last mark, in order
                upto = last
            else:
                ahead = self._ahead
                for seq in seqs:
                    if seq > upto and (
                        ahead.range_count < self.AHEAD_RANGES or ahead.end_of(seq - 1) is not None
                    ):
                        ahead.add(seq)
            upto = self._advance(upto)
        lines = [f"upto {upto}\n"] if upto > self._upto else []
        lines += [f"one {seq}\n" for seq in seqs if seq > upto]
        self._upto = upto
        if lines:
            self._file.write("".join(lines))
            self._file.flush()

    def _advance(self, upto: int) -> int:
        """The highest N from ``upto`` on such that every number up to N is done (every number
        up to ``upto`` is)."""
        assert self._acks is not None
        while True:
            end = self._ahead.end_of(upto + 1)
            if end is None:
                end = self._acks.done_through(upto + 1)
            if end is None:
                break
            upto = end
        self._ahead.discard_upto(upto)
        return upto

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
        # The acks file has two writers: the worker (deliveries, attempts) and the spool thread
        # (superseded checkpoints).
        self._acks_lock = threading.Lock()
        self._superseded: list[int] = []  # marked by the spool thread, above _acked_upto

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
            with self._acks_lock:
                self._acks.write(f"upto {upto}\n")
                self._acks.flush()
                self._acked_upto = upto
                if self._superseded:
                    self._superseded = [seq for seq in self._superseded if seq > upto]

    def mark_superseded(self, seqs: list[int]) -> None:
        """Mark done the checkpoints ``seqs``, which a record already in the spool supersedes
        (their step's sealed batch, or a newer checkpoint of that step): replay passes them over
        in any case (done in effect), and marked, no count of what waits takes them for records
        still to deliver. Spool thread: the superseding record is in the kernel already."""
        lines = "".join(f"one {seq}\n" for seq in seqs)
        with self._acks_lock:
            if not lines or self._acks.closed:
                return
            self._acks.write(lines)
            self._acks.flush()
            self._superseded += [seq for seq in seqs if seq > self._acked_upto]

    def superseded_upto(self, seq: int) -> int:
        """How many records above ``acked_upto`` and up to ``seq`` are marked done as
        superseded checkpoints."""
        with self._acks_lock:
            return sum(1 for marked in self._superseded if marked <= seq)

    def note_attempt(self, first: int, last: int, records: int, position: Any) -> None:
        """Before a write of records ``first..last``: where the tracker's output stood, so that
        ``otel-rl replay`` can tell whether a write cut short by a kill reached the tracker."""
        with self._acks_lock:
            self._acks.write(attempt_line(first, last, records, position))
            self._acks.flush()

    def sync_acks(self) -> None:
        with self._acks_lock:
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
            with self._acks_lock:
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
