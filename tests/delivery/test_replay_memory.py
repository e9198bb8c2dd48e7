"""``otel-rl replay`` in bounded memory: it streams the spool, and sends what it always sent.

The order, the checkpoints, the losses and the marks are checked against the replay as it was
before it streamed (kept in ``benchmarks/replay_drain.py``: every waiting record in a list,
checkpoints resolved, a stable sort by step) on spools of every shape: steps that go back, other
axes, every record kind, checkpoints, marks of earlier replays, damaged lines, missing segments.
The thresholds that switch replay to its other ways (more runs than it reads in place, entries
sorted on disk, merged in rounds) are lowered here so that small spools take those ways too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.replay_drain import build_backlog, replay_in_a_process, todays_order, todays_scan
from otel_rl.core.records import Event, Hyperparams, Plot, StepBatch, Table
from otel_rl.delivery import replay_plan
from otel_rl.delivery.spool import (
    _STEP_LINE,
    CorruptRecord,
    DoneMarks,
    SeqSet,
    Spool,
    encode_record,
    facts_of,
    parse_facts,
    parse_record,
    pending_count,
    read_acks,
    spool_root,
    undelivered,
    waiting_records,
)
from otel_rl.run.replay import replay
from testkit.readers import jsonl_rows

REPO = Path(__file__).resolve().parents[2]

#: Small enough that a spool of a few hundred records takes every way replay has.
SMALL = {"_MAX_RUNS": 3, "_CHUNK_ENTRIES": 5, "_MERGE_FAN_IN": 2, "_READ_ENTRIES": 3}


@pytest.fixture(params=["defaults", "small"])
def thresholds(request, monkeypatch):
    if request.param == "small":
        for name, value in SMALL.items():
            monkeypatch.setattr(replay_plan, name, value)
    return request.param


def _spool(log_dir: Path, tracker: str = "jsonl") -> Path:
    return spool_root(log_dir) / tracker / "run1"


def _write(directory: Path, records: list) -> list[int | None]:
    """Append ``records`` in a session of their own (a new segment each time)."""
    spool = Spool(directory)
    try:
        return spool.append(records)
    finally:
        spool.close()


def _meta(directory: Path, log_dir: Path, tracker: str = "jsonl") -> None:
    (directory / "meta.json").write_text(json.dumps({
        "tracker": tracker, "run_id": "run1", "log_dir": str(log_dir),
        "config": {"log_dir": str(log_dir), "tensorboard_enabled": tracker == "tensorboard"},
    }))  # fmt: skip


def _step(step: int, **kw) -> StepBatch:
    return StepBatch(step=step, values={"x": float(step), "y": 0.5}, time=1.0e9 + step, **kw)


class Opaque:
    """An object of a third party's own: spooled as an entry that cannot be replayed."""


# ---- the order and the marks are the ones replay always had ------------------------------------


def _random_spool(rng: random.Random, directory: Path) -> None:
    """Sessions of records of every kind, in shapes a backlog takes, then marks of earlier
    deliveries and damage."""
    step, seal = rng.randrange(5), 0
    for _ in range(rng.randint(1, 4)):  # each session a segment of its own
        records: list = []
        for _ in range(rng.randint(1, 60)):
            shape = rng.random()
            if shape < 0.06:
                step = max(0, step - rng.randint(1, 40))  # steps that go back
            elif shape < 0.09:
                step = rng.randrange(200)  # anywhere
            if rng.random() < 0.15:  # checkpoints of the step being logged
                for _ in range(rng.randint(1, 3)):
                    records.append(_step(step, seal=rng.choice([seal, seal, None, seal - 1]),
                                         provisional=True))  # fmt: skip
            kind = rng.random()
            if kind < 0.6:
                records.append(_step(step, seal=seal if rng.random() < 0.9 else None))
                seal += 1
                step += rng.choice([1, 1, 1, 0, 2])
            elif kind < 0.7:
                records.append(_step(rng.randrange(100), axis="ray/ray_step"))
            elif kind < 0.75:
                records.append(Hyperparams({"lr": rng.random()}))
            elif kind < 0.8:
                records.append(Event("otel_rl/stall", step, "stall", "no step for 60 s"))
            elif kind < 0.85:
                records.append(Table("samples", step, ("a",), (("x",),)))
            elif kind < 0.9:
                records.append(Plot("reward", step, b"\x89PNG"))
            else:
                records.append(Opaque())
        _write(directory, records)
    with open(directory / "acked.log", "a") as f:
        if rng.random() < 0.4:
            f.write(f"upto {rng.randint(1, 40)}\n")
        for _ in range(rng.randint(0, 30)):
            f.write(f"one {rng.randint(1, 200)}\n")
        if rng.random() < 0.2:
            first = rng.randint(1, 150)
            f.write(f"gone {first} {first + rng.randint(0, 5)}\n")
        if rng.random() < 0.5:
            first = rng.randint(1, 150)
            f.write(f"tried {first} {first + rng.randint(0, 20)} 3 17\n")
    segments = sorted(directory.glob("wal-*"))
    if rng.random() < 0.5:  # damaged bytes, anywhere
        target = rng.choice(segments)
        data = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            data[at : at + 3] = rng.choice([b"\xff\x00x", b"}\n{", b"9", b'"', b"\n"])
        target.write_bytes(bytes(data))
    if len(segments) > 2 and rng.random() < 0.2:  # a segment deleted from outside
        segments[1].unlink()


def _check_against_before(directory: Path, known_end: int = 0) -> list[int]:
    records, skipped, sealed, _ = todays_scan(directory, known_end)
    done_before, sendable = todays_order(records, sealed)
    acks = read_acks(directory)
    plan = replay_plan.ReplayPlan(directory, acks, known_end)
    try:
        sent = list(plan.records(SeqSet()))
    finally:
        plan.close()
    assert [seq for seq, _ in sent] == [seq for seq, _ in sendable]
    assert [encode_record(s, r) for s, r in sent] == [encode_record(s, r) for s, r in sendable]
    assert plan.sendable == len(sendable)
    assert sorted(plan.done) == sorted(done_before)
    assert plan.skipped == skipped
    assert pending_count(directory, known_end) == len(records)  # what an error reports waiting
    if acks.attempt is not None:
        tried = range(acks.attempt.first, acks.attempt.last + 1)
        assert list(plan.in_attempt) == sorted(s for s, _ in sendable if s in tried)
    return [seq for seq, _ in sent]


def test_the_order_checkpoints_and_losses_are_the_ones_replay_always_had(tmp_path, thresholds):
    rng = random.Random(36)
    runs = 0
    for trial in range(80):
        directory = tmp_path / f"t{trial}"
        _random_spool(rng, directory)
        known_end = rng.choice([0, 0, 400])
        try:
            _check_against_before(directory, known_end)
        except AssertionError as exc:
            raise AssertionError(f"trial {trial} ({directory})") from exc
        runs += 1
    assert runs == 80


def test_lines_written_by_hand_are_judged_as_before(tmp_path, thresholds):
    """Lines encode_record never writes (keys in another order, spaces, odd seals, values of
    other types, numbers used twice) are read as decode_record reads them."""
    directory = tmp_path / "spool"
    directory.mkdir()
    lines = [
        '{"seq": 1, "kind": "step", "step": 5, "time": 1, "axis": null, "rows": {"a": 1}}',
        '{"kind":"step","step":3,"time":1.0,"axis":null,"step_metrics":{},"rows":{"a":1},'
        '"seal":"s","provisional":true,"seq":2}',
        '{"kind":"step","step":3,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seal":"s","seq":3}',
        '{"kind":"step","step":4,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seal":7.0,"seq":4}',
        '{"kind":"step","step":4,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seal":7,"provisional":1,"seq":5}',
        '{"kind":"step","step":2.0,"time":1.0,"axis":null,"step_metrics":{},"rows":{},"seq":6}',
        '{"kind":"step","step":2,"time":1.0,"axis":null,"step_metrics":{},"rows":{"a":[1]},'
        '"seq":7}',
        '{"kind":"step","step":2,"step":9,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seq":8}',
        '{"kind":"step","step":1,"time":1.0,"axis":"x","step_metrics":{},"rows":{"é":"ü"},'
        '"seq":9}',
        '{"kind":"step","step":1,"time":1.0,"axis":null,"step_metrics":{},"rows":{},"seq":9}',
        '{"kind":"hyperparams","params":{"kind":"step"},"seq":10}',
        '{"kind":"nope","seq":11}',
        '{"kind":"step","step":0,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seal":99999999999999999999,"seq":12}',
        '{"kind":"step","step":0,"time":1.0,"axis":null,"step_metrics":{},"rows":{},'
        '"seal":99999999999999999999,"provisional":true,"seq":13}',
        '{"kind":"step","step":-1,"time":1.0,"axis":null,"step_metrics":{},"rows":{"a":NaN},'
        '"seq":14}  ',
        '{"kind":"opaque","type":"X","seq":15}',
    ]
    (directory / "wal-000000000001.jsonl").write_text("\n".join(lines) + "\n")
    sent = _check_against_before(directory)
    assert sent  # some of them are sent


def test_the_fast_line_reader_agrees_with_decode_record():
    """A step line as encode_record writes it is read without decoding it; whatever that reader
    accepts, decode_record accepts with the same facts (damaged bytes included)."""
    rng = random.Random(7)
    values = [0.5, -1e-05, 1.5e20, float("nan"), float("inf"), -float("inf"), 3.0,
              'text "q" \\ é\n', 7]  # fmt: skip
    from otel_rl.core.records import HistogramValue

    values.append(HistogramValue((1.0, 2.0), (1, 2, 3), 6, 10.0, 0.5, 3.0))
    accepted = 0
    for _ in range(1500):
        rows = {rng.choice(["a/b", "é/ü", 'q"t', "k\\x"]) + str(j): rng.choice(values)
                for j in range(rng.randint(0, 25))}  # fmt: skip
        batch = StepBatch(step=rng.randint(-5, 10**12), values=rows,
                          axis=rng.choice([None, "ray/ray_step"]),
                          step_metrics=rng.choice([{}, {"a/": "b"}]),
                          seal=rng.choice([None, 0, 5]), provisional=rng.random() < 0.3)
        if rng.random() < 0.3:
            batch.intake = ("ab12", rng.randint(0, 100))  # the delivery process's frame number
        line = encode_record(rng.randint(1, 10**9), batch).encode()
        assert _STEP_LINE.fullmatch(line), line  # every line encode_record writes
        for attempt in range(25):
            if attempt:  # damaged copies
                data = bytearray(line)
                at = rng.randrange(len(data) - 1)
                data[at : at + rng.randint(1, 3)] = bytes(
                    rng.choice(b'0123456789.,:"{}[]eE-+aNI\\ux \x00\xff\x7f')
                    for _ in range(rng.randint(0, 3))
                )
                damaged = bytes(data)
            else:
                damaged = line
            if not damaged.endswith(b"\n") or not _STEP_LINE.fullmatch(damaged):
                continue
            try:
                seq, record = parse_record(damaged)
            except (CorruptRecord, UnicodeDecodeError) as exc:
                raise AssertionError(f"accepted a line decode_record refuses: {damaged!r}") from exc
            assert parse_facts(damaged) == (seq, facts_of(record)), damaged
            accepted += 1
    assert accepted > 1500


# ---- what the tracker gets ---------------------------------------------------------------------


def test_steps_that_go_back_and_other_axes_arrive_merged_in_step_order(tmp_path, thresholds):
    """Three runs of steps (each in order, the later ones starting lower) and a GPU axis batch
    every few steps: the tracker gets one step order, the other axis after it."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    records = []
    for first in (100, 0, 50):
        for step in range(first, first + 60):
            records.append(_step(step, seal=len(records)))
            if step % 7 == 0:
                records.append(_step(step, axis="ray/ray_step"))
    _write(directory, records[:100])
    _write(directory, records[100:])
    _meta(directory, log_dir)
    (result,) = replay(log_dir, progress=False)
    assert result.error is None and result.delivered == result.pending == len(records)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    steps = [r["step"] for r in rows if "axis" not in r]
    assert steps == sorted(s for first in (100, 0, 50) for s in range(first, first + 60))
    assert [r["step"] for r in rows if "axis" in r] == [
        s for first in (100, 0, 50) for s in range(first, first + 60) if s % 7 == 0
    ]
    assert all("axis" in r for r in rows[len(steps) :])  # the other axis last
    assert undelivered(directory) == []
    assert replay(log_dir, progress=False)[0].pending == 0


def test_a_backlog_whose_steps_go_back_at_every_record_is_sorted_on_disk(tmp_path, monkeypatch):
    """Past the runs read in place, the rest is sorted on disk in chunks and merged in rounds:
    every record once, in step order, and no temporary file left."""
    monkeypatch.setattr(replay_plan, "_MAX_RUNS", 4)
    monkeypatch.setattr(replay_plan, "_CHUNK_ENTRIES", 50)
    monkeypatch.setattr(replay_plan, "_MERGE_FAN_IN", 3)
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    steps = list(range(2000))
    random.Random(3).shuffle(steps)
    for at in range(0, 2000, 500):
        _write(directory, [_step(s, seal=s) for s in steps[at : at + 500]])
    _meta(directory, log_dir)
    before = sorted(p.name for p in directory.iterdir())
    (result,) = replay(log_dir, progress=False)
    assert result.error is None and result.delivered == 2000
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(2000))
    assert sorted(p.name for p in directory.iterdir()) == before  # unnamed temporary files
    assert waiting_records(directory) == 0
    assert replay(log_dir, progress=False)[0].pending == 0


@pytest.mark.slow
def test_descending_steps_with_the_default_thresholds(tmp_path):
    """Steps that go back at every record, beyond the default runs and one chunk in memory."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    count = replay_plan._CHUNK_ENTRIES + 500
    _write(directory, [_step(s, seal=count - s) for s in reversed(range(count))])
    _meta(directory, log_dir)
    (result,) = replay(log_dir, progress=False)
    assert result.error is None and result.delivered == count
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(count))
    assert replay(log_dir, progress=False)[0].pending == 0


def test_checkpoints_are_resolved_as_before(tmp_path, thresholds):
    """A provisional batch goes out only when no sealed batch has its seal anywhere in the spool
    (even one delivered long ago), and only the newest per seal; the others are marked done."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    _write(directory, [
        _step(0, seal=0),
        _step(1, seal=1),                     # delivered by the run (marked below)
        _step(1, seal=1, provisional=True),   # its sealed batch is done already: never sent
        _step(2, seal=2, provisional=True),   # superseded by the sealed step 2 below
        _step(2, seal=2),
        _step(3, seal=3, provisional=True),   # older checkpoint of a step never sealed
        _step(3, seal=3, provisional=True),
        _step(3, seal=3, provisional=True),   # the newest: sent, as the step's last state
        _step(4, seal=None, provisional=True),  # no seal: cannot be told apart, never sent
        _step(5, seal=5),
        _step(6, seal=6, provisional=True),   # sealed later, in another segment
    ])  # fmt: skip
    (directory / "acked.log").write_text("upto 2\n")
    _write(directory, [_step(6, seal=6), Opaque()])
    _meta(directory, log_dir)
    (result,) = replay(log_dir, progress=False)
    assert result.error is None and (result.pending, result.delivered) == (4, 4)
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [2, 3, 5, 6]
    acks = read_acks(directory)
    assert acks.upto == 13 and not acks.ones  # everything done, written as one number
    assert undelivered(directory) == []


# ---- the marks ---------------------------------------------------------------------------------


def test_replay_writes_upto_marks_while_every_earlier_record_is_done(tmp_path):
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    _write(directory, [_step(s, seal=s) for s in range(3000)])
    _meta(directory, log_dir)
    assert replay(log_dir, progress=False)[0].delivered == 3000
    lines = (directory / "acked.log").read_text().splitlines()
    assert not [line for line in lines if line.startswith("one ")]
    assert read_acks(directory).upto == 3000

    # An unreadable line stops the upto marks (its record is not done, only set aside): the
    # records after it get one marks, read back as one range.
    log_dir = tmp_path / "damaged"
    directory = _spool(log_dir)
    _write(directory, [_step(s, seal=s) for s in range(3000)])
    _meta(directory, log_dir)
    segment = next(directory.glob("wal-*"))
    data = segment.read_bytes().splitlines(keepends=True)
    data[1000] = b"\xff" + data[1000][1:]
    segment.write_bytes(b"".join(data))
    (result,) = replay(log_dir, progress=False)
    assert result.delivered == 2999 and len(result.skipped) == 1
    acks = read_acks(directory)
    assert acks.upto == 1000 and list(acks.ones.ranges()) == [(1002, 3000)]
    assert replay(log_dir, progress=False)[0].pending == 0


@pytest.mark.parametrize("mark", ["upto 99999999999", "gone 40 99999999999"])
def test_a_mark_far_past_the_spools_end_is_read_a_stretch_at_a_time(tmp_path, mark):
    """A damaged acked.log whose mark lies far past every record (by hand, or a bit flipped):
    replay finishes at once (it looked at each number up to the mark in turn, for hours, and
    no signal stopped it), sends what the marks leave waiting, and says no record missing."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    _write(directory, [_step(s, seal=s) for s in range(50)])
    _meta(directory, log_dir)
    (directory / "acked.log").write_text(mark + "\n")
    began = time.monotonic()
    (result,) = replay(log_dir, progress=False)
    assert time.monotonic() - began < 30
    rows = log_dir / "metrics.jsonl"
    if mark.startswith("upto"):
        assert not rows.exists()
    else:
        assert [r["step"] for r in jsonl_rows(rows)] == list(range(39))  # seqs 1-39
    assert result.error is None and not result.skipped, result


@pytest.mark.parametrize("damage", ["cut", "swapped"])
def test_a_line_cut_out_of_a_segment_or_moved_is_said_missing_never_dropped_unsaid(
    tmp_path, damage
):
    """A segment that skips a number between two readable lines (a line cut out, or two lines
    swapped, so one number comes again after a later one): the record is said missing and
    counted, the others arrive once in step order (replay said 9/9 delivered, exit 0, and the
    step was gone from the tracker)."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    _write(directory, [_step(s, seal=s) for s in range(10)])  # seqs 1-10
    _meta(directory, log_dir)
    segment = next(directory.glob("wal-*"))
    lines = segment.read_bytes().splitlines(keepends=True)
    if damage == "cut":
        del lines[4]  # seq 5, step 4
    else:
        lines[4], lines[5] = lines[5], lines[4]
    segment.write_bytes(b"".join(lines))
    (result,) = replay(log_dir, progress=False)
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [0, 1, 2, 3, *range(5, 10)]
    assert [(s.kind, s.seqs) for s in result.skipped] == [("missing", range(5, 6))]
    assert not result.complete
    (again,) = replay(log_dir, progress=False)  # said once: counted lost, not waiting
    assert again.complete and again.delivered == 0


def test_a_plan_told_to_stop_while_it_reads_the_spool_stops_there(tmp_path):
    """A signal during the read of a large spool's plan stops it within a few thousand
    records (it read on to the end: 9 s for 3 million records, after the Ctrl-C)."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    _write(directory, [_step(s, seal=s) for s in range(10_000)])
    looked: list[int] = []

    def stop() -> bool:
        looked.append(1)
        return len(looked) >= 2

    with pytest.raises(replay_plan.PlanStopped):
        replay_plan.ReplayPlan(directory, read_acks(directory), 0, stop=stop)
    assert len(looked) == 2


def test_old_one_marks_are_read_as_ranges(tmp_path):
    """A spool replayed before replay wrote upto marks: a one line per record, in step order or
    not; read back as a few ranges (and a torn line from a crash is still passed over)."""
    directory = tmp_path / "spool"
    directory.mkdir()
    seqs = [*range(11, 60_011), 70_000, 70_001, 80_000]
    shuffled = seqs[:]
    random.Random(1).shuffle(shuffled)
    for order in (seqs, shuffled):
        (directory / "acked.log").write_text(
            "upto 5\n" + "".join(f"one {s}\n" for s in order) + "one 12x\non"
        )
        acks = read_acks(directory)
        assert list(acks.ones.ranges()) == [(11, 60_010), (70_000, 70_001), (80_000, 80_000)]
        assert acks.upto == 5 and acks.done(3) and not acks.done(8) and acks.done(70_001)
        assert not acks.done(60_011) and 60_010 in acks.ones and 12 in acks.ones


@pytest.mark.parametrize("ahead_ranges", [1 << 16, 4])
def test_done_marks_in_any_order_say_exactly_what_is_done(tmp_path, monkeypatch, ahead_ranges):
    """Marks in step order that is not sequence order (and, past the ranges kept, one lines
    only): the log says done exactly for what was marked, before or now."""
    monkeypatch.setattr(DoneMarks, "AHEAD_RANGES", ahead_ranges)
    rng = random.Random(5)
    directory = tmp_path / "spool"
    directory.mkdir()
    (directory / "acked.log").write_text("upto 10\none 12\none 13\ngone 20 24\n")
    marked = [s for s in range(11, 400) if s not in (12, 13, 77) and not 20 <= s <= 24]
    order = marked[:]
    rng.shuffle(order)
    marks = DoneMarks(directory, read_acks(directory))
    for at in range(0, len(order), 7):
        marks.mark(order[at : at + 7])
        acks = read_acks(directory)
        for seq in range(1, 420):
            expected = seq <= 10 or seq in (12, 13) or 20 <= seq <= 24 or seq in order[: at + 7]
            assert acks.done(seq) == expected, (seq, at)
    marks.close()
    acks = read_acks(directory)
    assert acks.upto == 76 if ahead_ranges > 4 else acks.upto < 76
    marks = DoneMarks(directory, acks)  # the next replay: one marks read back as ranges
    marks.mark([77])
    marks.close()
    assert read_acks(directory).upto == 399 and not read_acks(directory).ones


def test_a_seqset_holds_numbers_as_ranges():
    s = SeqSet()
    for seq in (5, 7, 6, 1, 3, 10, 2, 20, 11):
        s.add(seq)
    assert list(s.ranges()) == [(1, 3), (5, 7), (10, 11), (20, 20)]
    assert len(s) == 9 and list(s) == [1, 2, 3, 5, 6, 7, 10, 11, 20]
    s.add_range(4, 9)
    assert list(s.ranges()) == [(1, 11), (20, 20)]
    assert s.end_of(4) == 11 and s.end_of(12) is None and 20 in s and 19 not in s
    s.discard_upto(10)
    assert list(s.ranges()) == [(11, 11), (20, 20)]
    assert list(SeqSet.from_ranges([(8, 9), (1, 2), (3, 4), (9, 12)]).ranges()) == [(1, 4), (8, 12)]


# ---- killed part-way, run again ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_a_replay_killed_part_way_through_a_merge_converges_to_exactly_once(tmp_path):
    """Runs merged with records sorted on disk, the replay SIGKILLed while it writes, then run
    again (with the same thresholds): every step once, in step order."""
    log_dir = tmp_path / "logs"
    directory = _spool(log_dir)
    steps = [s for block in range(40) for s in range(block, 20_000, 40)]  # 40 runs of steps
    for at in range(0, len(steps), 5000):
        _write(directory, [_step(s, seal=s) for s in steps[at : at + 5000]])
    _meta(directory, log_dir)
    child = textwrap.dedent(f"""
        import sys
        from otel_rl.cli import replay
        from otel_rl.delivery import replay_plan
        replay_plan._MAX_RUNS, replay_plan._CHUNK_ENTRIES, replay_plan._MERGE_FAN_IN = 8, 1000, 4
        sys.exit(replay.run({str(log_dir)!r}, progress=False))
    """)
    jsonl = log_dir / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (jsonl.exists() and jsonl.stat().st_size > 300_000):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    first = len(jsonl_rows(jsonl))
    assert 0 < first < 20_000
    again = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r["step"] for r in jsonl_rows(jsonl)] == list(range(20_000))


# ---- memory ------------------------------------------------------------------------------------


def _steps_once_in_order(path: Path, count: int) -> None:
    """Every step of 0..count-1 exactly once and in order, read line by line."""
    expected = 0
    with open(path, "rb") as f:
        for line in f:
            step = json.loads(line)["step"]
            assert step == expected, f"step {step} where {expected} was expected"
            expected += 1
    assert expected == count


@pytest.mark.slow
@pytest.mark.parametrize("records", [
    300_000,
    pytest.param(2_000_000, marks=pytest.mark.skipif(
        not os.environ.get("OTEL_RL_REPLAY_MEMORY_FULL"),
        reason="7 minutes: set OTEL_RL_REPLAY_MEMORY_FULL=1 (benchmarks/replay_drain.py "
               "measures it too)")),
])  # fmt: skip
@pytest.mark.long
def test_replay_memory_does_not_grow_with_the_backlog(tmp_path, records):
    """A backlog of 20-key step records for JSONL and TensorBoard: the replay process peaks
    far below what holding it would take (3.9 KB a record: 1.1 GB at 300,000), and each step
    reaches the JSONL file once, in order."""
    log_dir = tmp_path / "logs"
    build_backlog(log_dir, records)
    report = replay_in_a_process("ours", log_dir)
    assert report["peak_mib"] <= 300, report
    assert {r["tracker"]: (r["pending"], r["delivered"], r["error"])
            for r in report["results"]} == {
        "jsonl": (records, records, None), "tensorboard": (records, records, None)
    }  # fmt: skip
    _steps_once_in_order(log_dir / "metrics.jsonl", records)


@pytest.mark.slow
@pytest.mark.long
def test_a_backlog_in_the_worst_order_stays_bounded_too(tmp_path):
    """The last step written first: every record past the first runs is sorted on disk (300,000
    entries, five chunks) and read back from its place in the spool."""
    log_dir = tmp_path / "logs"
    build_backlog(log_dir, 300_000, trackers=("jsonl",), backwards=True)
    report = replay_in_a_process("ours", log_dir)
    assert report["peak_mib"] <= 300, report
    assert [(r["pending"], r["delivered"], r["error"]) for r in report["results"]] == [
        (300_000, 300_000, None)
    ]
    _steps_once_in_order(log_dir / "metrics.jsonl", 300_000)
