"""What a replay sends from one spool, and in what order: the backlog in step order in bounded
memory, read back by place, and what landed before a kill.

The backlog is never held in memory, however long: a spool is read once for what to send and in
what order (:class:`ReplayPlan`: a few numbers per run of records in step order, none per
record; beyond :data:`_MAX_RUNS` runs the rest is sorted on disk), then again as the records are
sent, each decoded when its turn comes. ``otel-rl replay`` (:mod:`otel_rl.run.replay`) drives it.
"""

from __future__ import annotations

import heapq
import inspect
import struct
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_rl.core.records import StepBatch
from otel_rl.delivery.spool import (
    OPAQUE,
    STEP,
    Acks,
    Attempt,
    CorruptRecord,
    SeqSet,
    Skipped,
    first_seq,
    parse_facts,
    parse_record,
    read_lines,
    record_at,
    segment_paths,
    walk,
)
from otel_rl.delivery.tracker import Tracker


def landed_before_the_kill(
    attempt: Attempt | None, exporter: Tracker, uncertain: SeqSet
) -> SeqSet:
    """Records of the last write attempted that the tracker holds although they were never
    marked done (the process died between the write and its mark): of ``uncertain``, the
    records of that write still to send, the first ones the tracker counts whole (a write cut
    short by the kill), or all of them when it says it holds the write."""
    if attempt is None or not uncertain:
        return SeqSet()
    if attempt.records is not None and len(uncertain) == attempt.records:
        landed = exporter.landed_since(attempt.position, attempt.records)
        if landed is not None:
            return _first(uncertain, landed)
    # A kill can cut even one write call short: a tracker that counts what it holds is told
    # how many records the write carried (trackers written before ``records`` existed take the
    # position alone).
    if "records" in inspect.signature(exporter.holds_since).parameters:
        holds = exporter.holds_since(attempt.position, records=attempt.records)
    else:
        holds = exporter.holds_since(attempt.position)
    return uncertain if holds else SeqSet()


def _first(seqs: SeqSet, count: int) -> SeqSet:
    """The ``count`` lowest numbers of ``seqs``."""
    ranges = []
    for first, last in seqs.ranges():
        if count <= 0:
            break
        ranges.append((first, min(last, first + count - 1)))
        count -= last - first + 1
    return SeqSet.from_ranges(ranges, presorted=True)


# ---- the backlog in step order, in bounded memory ---------------------------------------------

#: Runs of records in step order that are read back in place (each one a file being read);
#: beyond them, the rest of the backlog is sorted on disk.
_MAX_RUNS = 32
#: Entries of records sorted on disk, sorted in memory at a time (32 bytes each).
_CHUNK_ENTRIES = 1 << 16
#: Sorted temporary files read at once (each through a buffer of _READ_ENTRIES entries).
_MERGE_FAN_IN = 64
_READ_ENTRIES = 2048
#: A record's place in the spool, one integer: segment index * _SEGMENT_SPAN + byte offset.
_SEGMENT_SPAN = 1 << 40

_INF = float("inf")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class SpoolChanged(RuntimeError):
    """The spool changed under the replay (from outside: replay holds its lock): a record read
    before is no longer where it was. Nothing more is sent; replay again to send the rest."""


@dataclass
class _Run:
    """Records that follow one another in the spool and in step order: read back in place."""

    segment: int  # where the first one is: a segment's index, the line's byte offset
    offset: int
    first: int  # its sequence number, and the last one's
    last: int
    last_key: float
    ordinal: int  # the first one's place among the records waiting (ties of equal keys)
    count: int = 1


#: Records read between two looks at whether the replay was told to stop (minus one: a mask).
_STOP_EVERY = 4095


class PlanStopped(Exception):
    """The replay was told to stop (a signal) while its plan was read."""


class ReplayPlan:
    """What replay sends of one spool and in what order, learned by reading it once without
    decoding its step records (:func:`~otel_rl.delivery.spool.parse_facts`); :meth:`records`
    then reads them again, each when its turn comes.

    The order is the one replay always had, exactly: a stable sort of the records waiting by
    step (batches of another axis last, records without a step first), ties by sequence number.
    A backlog is written in step order, so it is held as *runs*: records that follow one
    another, in the spool and in step order, kept as where the run starts and how many records
    it has. Records of another axis (which sort last) and, past :data:`_MAX_RUNS` runs (steps
    that went back many times), all later records are *spilled*: 32 bytes each (step, sequence
    number, place among the records waiting, place in the spool), sorted :data:`_CHUNK_ENTRIES`
    at a time into unnamed temporary files beside the spool and merged back from there (in
    rounds of :data:`_MERGE_FAN_IN` files when there are more); a spilled record is read back
    from its place when its turn comes. :meth:`records` merges the runs, the spilled entries and
    the checkpoints to send (``heapq.merge``).

    Checkpoints are resolved as they always were: a provisional batch is sent only when no
    sealed batch with its ``seal`` is anywhere in the spool, and only the newest one per seal;
    the others, and entries that cannot be replayed, are done in effect (:attr:`done`).

    Memory: a few numbers per run, per checkpoint of a step never sealed and per range of
    records done in effect or sealed; the spill's chunk in memory (2 MB, about 10 MB while it is
    sorted) and a 64 KB buffer per file merged; the unreadable lines found. Nothing per record
    of the backlog.
    """

    def __init__(
        self, directory: Path, acks: Acks, known_end: int,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:  # fmt: skip
        """Raises :class:`PlanStopped` when ``stop()`` says so while the spool is read (a
        signal: reading a large spool takes seconds)."""
        self.directory = directory
        self.acks = acks
        self.segments = segment_paths(directory)
        self.skipped: list[Skipped] = []
        #: Records waiting that are done in effect: marked done, never sent.
        self.done = SeqSet()
        #: How many records are to be sent.
        self.sendable = 0
        #: Those of them that the last write attempted (``acks.attempt``) carried.
        self.in_attempt = SeqSet()
        self.runs: list[_Run] = []
        self.spill = _Spill(directory)
        #: Checkpoints to send, as spilled entries (few: one per step never sealed).
        self.checkpoints: list[tuple[float, int, int, int]] = []
        try:
            self._read(known_end, stop)
        except BaseException:
            self.close()
            raise

    def _read(self, known_end: int, stop: Callable[[], bool]) -> None:
        acks, done, runs, spill = self.acks, self.done, self.runs, self.spill
        attempt = acks.attempt
        tried = range(attempt.first, attempt.last + 1) if attempt is not None else range(0)
        sealed = SeqSet()
        # seals a SeqSet cannot hold: not integers, or beyond int64 (lines written by hand)
        odd_sealed: set[Any] = set()
        # seal -> (key, seq, ordinal, place) of the newest checkpoint waiting, never sealed yet
        open_checkpoints: dict[Any, tuple[float, int, int, int]] = {}
        ordinal = 0  # the place of a record among those waiting (the order of today's list)
        # The last run's end, kept in locals while it grows (written to it when it ends)
        last_seq, last_key, count = 0, -_INF, 0
        spilling = False  # past _MAX_RUNS runs: every later record is spilled
        upto, marked = acks.upto, bool(acks.ones or acks.gone)  # acks.done(), inlined
        for seq, facts, segment, start in walk(
            self.directory, acks, self.skipped, segments=self.segments, known_end=known_end,
            parse=parse_facts,
        ):  # fmt: skip
            kind, step, axis, seal, provisional = facts
            if not seq & _STOP_EVERY and stop():
                raise PlanStopped
            if seal is not None and kind == STEP and not provisional:
                if type(seal) is int and _INT64_MIN <= seal <= _INT64_MAX:
                    sealed.add(seal)
                else:
                    odd_sealed.add(seal)
                superseded = open_checkpoints.pop(seal, None)
                if superseded is not None:
                    done.add(superseded[1])
            if seq <= upto or (marked and acks.done(seq)):
                continue
            here = ordinal
            ordinal += 1
            if kind == OPAQUE:  # an object of a third party's own: delivered live only
                done.add(seq)
                continue
            key = _INF if axis else float(step)
            if provisional:
                is_sealed = seal in sealed or seal in odd_sealed
                if seal is None or is_sealed:
                    done.add(seq)
                    continue
                older = open_checkpoints.get(seal)
                if older is not None:
                    done.add(older[1])
                open_checkpoints[seal] = (key, seq, here, segment * _SEGMENT_SPAN + start)
                continue
            self.sendable += 1
            if seq in tried:
                self.in_attempt.add(seq)
            if key == _INF or spilling:
                spill.add(key, seq, here, segment * _SEGMENT_SPAN + start)
            elif runs and (key > last_key or (key == last_key and seq >= last_seq)):
                last_seq, last_key, count = seq, key, count + 1  # the run goes on
            elif len(runs) < _MAX_RUNS:
                if runs:
                    runs[-1].last, runs[-1].last_key, runs[-1].count = last_seq, last_key, count
                runs.append(_Run(segment, start, seq, seq, key, here))
                last_seq, last_key, count = seq, key, 1
            else:
                spilling = True
                spill.add(key, seq, here, segment * _SEGMENT_SPAN + start)
        if runs:
            runs[-1].last, runs[-1].last_key, runs[-1].count = last_seq, last_key, count
        self.checkpoints = sorted(open_checkpoints.values())
        self.sendable += len(self.checkpoints)
        for _, seq, _, _ in self.checkpoints:
            if seq in tried:
                self.in_attempt.add(seq)

    def records(self, landed: SeqSet) -> Iterator[tuple[int, Any]]:
        """``(seq, record)`` of every record to send, in order, but those ``landed``; raises
        :class:`SpoolChanged` when a record is no longer where it was read."""
        sources: list[Iterator[tuple[float, int, int, Any]]] = [
            self._run_records(run) for run in self.runs
        ]
        if self.spill.count:
            sources.append(self.spill.entries())
        if self.checkpoints:
            sources.append(iter(self.checkpoints))
        if len(sources) == 1 and self.runs and not landed:  # the usual backlog: one run
            for _, seq, _, record in sources[0]:
                yield seq, record
            return
        reader = RecordsAt(self.segments)
        try:
            for _, seq, _, found in heapq.merge(*sources):
                if landed and seq in landed:
                    continue
                yield seq, reader.read(found, seq) if type(found) is int else found
        finally:
            reader.close()

    def _run_records(self, run: _Run) -> Iterator[tuple[float, int, int, Any]]:
        """``(key, seq, ordinal, record)`` of a run's records, read in place: the lines from its
        first record on, judged as :meth:`_read` judged them, until it has them all."""
        acks = self.acks
        upto, marked = acks.upto, bool(acks.ones or acks.gone)  # acks.done(), inlined
        left = run.count
        ordinal = run.ordinal
        for index in range(run.segment, len(self.segments)):
            path = self.segments[index]
            previous = first_seq(path) - 1
            offset = run.offset if index == run.segment else 0
            for seq, record, _, _ in read_lines(path, offset, parse=_parse_in_run):
                if seq <= previous:  # a line written over another (reported by _read)
                    continue
                previous = seq
                if seq <= upto or (marked and acks.done(seq)):
                    continue
                here = ordinal
                ordinal += 1
                if record is None or type(record) is tuple:  # facts: never in a run
                    continue
                if isinstance(record, StepBatch):
                    if record.provisional:
                        continue
                    key = float(record.step) if record.axis is None else _INF
                else:
                    key = float(getattr(record, "step", -1))
                if key == _INF:  # spilled
                    continue
                if left == run.count and seq != run.first:
                    break
                yield key, seq, here, record
                left -= 1
                if not left:
                    return
        raise SpoolChanged(
            f"{self.directory}: record {run.first}..{run.last} not found where the spool was "
            "read: it changed during the replay"
        )

    def close(self) -> None:
        self.spill.close()


def _parse_in_run(raw: bytes) -> tuple[int, Any]:
    """A line read by a run: its record, or only its facts (a tuple) when it is a batch of
    another axis or a checkpoint, which no run holds (GPU batches between the steps are decoded
    once, when their turn comes, not also here). Which lines to look at first is guessed from
    their bytes; the facts decide."""
    if raw.startswith(_STEP_START) and (
        raw.find(b',"axis":null,', 0, 200) < 0 or raw.find(b',"provisional":true', -300) >= 0
    ):
        seq, facts = parse_facts(raw)
        if facts[2] or facts[4]:  # axis, provisional
            return seq, facts
    return parse_record(raw)


_STEP_START = b'{"kind":"step","step":'


class _Spill:
    """Entries ``(key, seq, ordinal, place)`` of records sent out of their place in the spool,
    sorted :data:`_CHUNK_ENTRIES` at a time into unnamed temporary files (nothing is left
    behind, however the replay ends)."""

    _ENTRY = struct.Struct("<dqqq")

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._keys = array("d")
        self._seqs = array("q")
        self._ordinals = array("q")
        self._places = array("q")
        self._files: list[Any] = []
        self.count = 0

    def add(self, key: float, seq: int, ordinal: int, place: int) -> None:
        self._keys.append(key)
        self._seqs.append(seq)
        self._ordinals.append(ordinal)
        self._places.append(place)
        self.count += 1
        if len(self._keys) >= _CHUNK_ENTRIES:
            self._files.append(self._write(self._sorted_chunk()))

    def entries(self) -> Iterator[tuple[float, int, int, int]]:
        """Every entry, sorted."""
        if not self._files:
            return self._sorted_chunk()
        if self._keys:
            self._files.append(self._write(self._sorted_chunk()))
        while len(self._files) > _MERGE_FAN_IN:  # merge rounds: a buffer per file read at once
            files, self._files = self._files, []
            for at in range(0, len(files), _MERGE_FAN_IN):
                group = files[at : at + _MERGE_FAN_IN]
                self._files.append(self._write(heapq.merge(*map(self._read, group))))
                for f in group:
                    f.close()
        return heapq.merge(*map(self._read, self._files))

    def _sorted_chunk(self) -> Iterator[tuple[float, int, int, int]]:
        keys, seqs, ordinals, places = self._keys, self._seqs, self._ordinals, self._places
        order = sorted(range(len(keys)), key=lambda i: (keys[i], seqs[i], ordinals[i]))
        chunk = [(keys[i], seqs[i], ordinals[i], places[i]) for i in order]
        del order, keys[:], seqs[:], ordinals[:], places[:]
        return iter(chunk)

    def _write(self, entries: Iterable[tuple[float, int, int, int]]) -> Any:
        # Open until merged (closed by entries() or close()).
        try:
            f = tempfile.TemporaryFile(dir=self._directory, prefix=".replay-sort-")  # noqa: SIM115
        except OSError:  # a spool folder we may mark but not create files in
            f = tempfile.TemporaryFile(prefix="otel-rl-replay-sort-")  # noqa: SIM115
        pack = self._ENTRY.pack
        block: list[bytes] = []
        for entry in entries:
            block.append(pack(*entry))
            if len(block) == _READ_ENTRIES:
                f.write(b"".join(block))
                block = []
        f.write(b"".join(block))
        return f

    def _read(self, f: Any) -> Iterator[tuple[float, int, int, int]]:
        f.seek(0)
        size = self._ENTRY.size * _READ_ENTRIES
        while block := f.read(size):
            yield from self._ENTRY.iter_unpack(block)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


class RecordsAt:
    """Reads records at their place in the spool, keeping a few segments open."""

    _OPEN = 8

    def __init__(self, segments: list[Path]) -> None:
        self._segments = segments
        self._open: dict[int, Any] = {}

    def read(self, place: int, seq: int) -> Any:
        segment, offset = divmod(place, _SEGMENT_SPAN)
        f = self._open.pop(segment, None)  # put back last: the most recently read
        if f is None:
            if len(self._open) >= self._OPEN:
                self._open.pop(next(iter(self._open))).close()
            try:
                f = self._segments[segment].open("rb")
            except OSError as exc:
                raise SpoolChanged(f"{self._segments[segment]}: {exc}") from exc
        self._open[segment] = f
        try:
            found, record = record_at(f, offset)
        except CorruptRecord as exc:
            found, record = -1, exc
        if found != seq:
            raise SpoolChanged(
                f"{self._segments[segment]}: record {seq} is no longer at byte {offset}: the "
                "spool changed during the replay"
            )
        return record

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open = {}




class Waiting:
    """The records still to send: pulled from the stream as the writes need them, at most one
    write ahead (a write that fails is tried again with the same records)."""

    def __init__(self, records: Iterator[tuple[int, Any]]) -> None:
        self._records = records
        self._head: list[tuple[int, Any]] = []

    def chunk(self, max_batch: int) -> list[tuple[int, Any]]:
        """The next write: step batches of consecutive sequence numbers, up to ``max_batch``
        (a write attempt is noted as a range), or one other record."""
        head = self._head
        if not head and not self._pull():
            return []
        first = head[0]
        chunk = [first]
        if isinstance(first[1], StepBatch):
            limit = max(1, max_batch)
            while len(chunk) < limit and (len(head) > len(chunk) or self._pull()):
                item = head[len(chunk)]
                if not isinstance(item[1], StepBatch) or item[0] != chunk[-1][0] + 1:
                    break
                chunk.append(item)
        return chunk

    def drop(self, done: int) -> None:
        del self._head[:done]

    def _pull(self) -> bool:
        item = next(self._records, None)
        if item is None:
            return False
        self._head.append(item)
        return True


