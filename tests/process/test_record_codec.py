"""One codec for a record: its fields (``otel_rl.core.records.record_fields``), written to a
spool line as JSON and to a frame for the delivery process pickled, read back by the same
``record_from_fields``. Every kind of record, with the values that are hard to carry (NaN and
infinities, a histogram, text outside ASCII, a ``str`` enum, a step's seal, provisional flag and
intake), comes back from either way as the same record."""

from __future__ import annotations

import enum
import json
import math
import pickle

import pytest

from otel_rl.core.records import (
    Event,
    HistogramValue,
    Hyperparams,
    Page,
    Plot,
    Record,
    Resume,
    StepBatch,
    Table,
    fields_json,
    record_fields,
    record_from_fields,
    record_json,
)
from otel_rl.delivery.frames import record_body, record_from_body
from otel_rl.delivery.spool import CorruptRecord, decode_record, encode_record


class Phase(str, enum.Enum):
    TRAIN = "train"


def _with_intake(record: Record, launch: str, frame: int) -> Record:
    object.__setattr__(record, "intake", (launch, frame))
    return record


HISTOGRAM = HistogramValue((0.0, 1.5, 3.0), (1, 4, 0, 2), 7, 9.25, -0.5, 4.0)

PARAMS = {
    "lr": 1e-6,
    "steps": 3,
    "model.name": "tiny ☃",
    "layers": [1, [2, 3]],
    "none": None,
    "phase": Phase.TRAIN,
    "scheduler": {"warmup": 10},
}
ROWS = {
    "loss": float("nan"),
    "grad/max": float("inf"),
    "grad/min": float("-inf"),
    "note": 'naïve ☃\n"q"',
    "phase": Phase.TRAIN,
    "lat": HISTOGRAM,
    "zero": 0.0,
    "tiny": 5e-324,
}
STEP = StepBatch(
    step=7,
    values=ROWS,
    time=1_700_000_000.123456,
    step_metrics={"gpu": "ray/ray_step"},
    seal=7,
    provisional=True,
)
EXAMPLES: dict[str, Record] = {
    "hyperparams": Hyperparams(PARAMS),
    "plot": Plot("loss curve", 4, b"\x89PNG\r\n\x1a\n\x00\xff"),
    "page": Page("otel_rl/timeline", 4, "<html>étape ☃ </script></html>", b"\x89PNG\r\n"),
    "table": Table("samples", 5, ("prompt", "reward"), (("2+2?", 1.0), ("é", float("nan")))),
    "event": Event("otel_rl/stall", 6, "Stall", "no step for 60 s", level="info"),
    "resume": Resume(attempt=2, step=10),
    "step": _with_intake(STEP, "9f2c4e", 42),
    "step on another axis": StepBatch(step=3, values={"gpu/util": 0.5}, axis="ray/ray_step"),
}


def test_every_record_kind_has_an_example():
    kinds = {cls for cls in Record.kinds.values() if cls.__module__ == "otel_rl.core.records"}
    assert kinds == {type(record) for record in EXAMPLES.values()}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_record_comes_back_the_same_from_the_spool_and_from_the_pipe(name):
    record = EXAMPLES[name]
    text = record_json(record)
    fields = json.loads(text)
    assert fields["kind"] == record.kind
    line = encode_record(12, record)
    assert line == text[:-1] + ',"seq":12}\n'
    seq, spooled = decode_record(line)
    piped = record_from_body(record_body(record))
    assert seq == 12
    for back in (spooled, piped):
        assert type(back) is type(record)
        assert back.intake == record.intake
        # The same fields, by the same encoding (NaN compares equal as JSON's NaN token).
        assert record_json(back) == text
    if isinstance(record, StepBatch):
        for back in (spooled, piped):
            assert isinstance(back, StepBatch)
            assert (back.step, back.time, back.axis, back.seal, back.provisional) == (
                record.step, record.time, record.axis, record.seal, record.provisional
            )  # fmt: skip
            assert back.step_metrics == record.step_metrics
            assert list(back.rows) == list(record.rows)


def test_a_steps_rows_arrive_with_their_values_by_either_way():
    record = EXAMPLES["step"]
    for back in (decode_record(encode_record(1, record))[1], record_from_body(record_body(record))):
        assert isinstance(back, StepBatch)
        rows = back.rows
        assert math.isnan(rows["loss"]) and rows["grad/max"] == math.inf
        assert rows["grad/min"] == -math.inf and rows["tiny"] == 5e-324
        assert rows["note"] == ROWS["note"] and rows["phase"] == "train"
        assert rows["lat"] == HISTOGRAM and rows["lat"].mean == pytest.approx(9.25 / 7)


def test_the_pipe_carries_a_records_fields_pickled():
    """The frame's body is the spool line's object as Python data: one codec, two transports."""
    for record in EXAMPLES.values():
        assert fields_json(pickle.loads(record_body(record))) == record_json(record)


def test_an_object_that_is_no_record_is_spooled_opaque_and_never_piped():
    """A third party's own object is delivered live: the spool notes it (replay passes it by),
    the pipe refuses it (the delivery process would not know what to call)."""

    class Custom:
        pass

    assert record_fields(Custom()) == {"kind": "opaque", "type": "Custom"}
    assert decode_record(encode_record(3, Custom())) == (3, None)
    with pytest.raises(TypeError, match="no record kind the delivery process knows"):
        record_body(Custom())


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "nonesuch"},
        {"kind": "step", "step": "7", "rows": {}, "time": 0.0, "axis": None},
        {"kind": "step", "step": 7, "rows": {"x": [1.0]}, "time": 0.0, "axis": None},
        {"kind": "resume", "attempt": 1},
        {"kind": "resume", "attempt": 1, "step": 2, "intake": ["abc", "12"]},
        {"step": 1},
    ],
    ids=["unknown-kind", "step-as-text", "row-of-a-list", "field-missing", "intake-mistyped",
         "no-kind"],
)  # fmt: skip
def test_fields_that_are_no_records_are_refused_alike_by_the_spool_and_the_pipe(fields):
    with pytest.raises((KeyError, TypeError, ValueError)):
        record_from_fields(fields)
    line = json.dumps({**fields, "seq": 4}) + "\n"
    with pytest.raises(CorruptRecord):
        decode_record(line)
    with pytest.raises((KeyError, TypeError, ValueError)):
        record_from_body(pickle.dumps(fields))


def test_a_body_that_is_no_pickle_of_fields_is_refused():
    with pytest.raises(pickle.UnpicklingError):
        record_from_body(b"not a pickled record")
    with pytest.raises(TypeError, match="not a record's fields"):
        record_from_body(pickle.dumps(("step", 1, 0.0)))


def test_a_steps_json_is_encoded_once_for_every_spool():
    batch = StepBatch(step=1, values={"x": 1.0})
    first = encode_record(1, batch)
    assert batch.encoded is not None
    assert encode_record(2, batch) == first.replace('"seq":1}', '"seq":2}')
    assert record_json(batch) is batch.encoded


def test_a_body_an_earlier_version_left_in_a_handoff_file_is_still_read():
    """``otel-rl replay`` after an upgrade reads the handoff files a killed training process of
    the earlier version left: its frames carried a step as its rows and other records as their
    spool encoding, in tuples."""
    rows = {"loss": 0.5, "note": "naïve", "lat": HISTOGRAM}
    earlier = ("step", 7, 1_700_000_000.5, None, {"gpu": "ray/ray_step"}, rows, 7, False)
    batch = record_from_body(pickle.dumps(earlier))
    assert isinstance(batch, StepBatch)
    assert (batch.step, batch.time, batch.seal, batch.provisional) == (7, 1_700_000_000.5, 7, False)
    assert batch.rows == rows and dict(batch.step_metrics) == {"gpu": "ray/ray_step"}
    params = Hyperparams({"lr": 1e-6, "model.name": "tiny"})
    back = record_from_body(pickle.dumps(("kind", "hyperparams", params.encode())))
    assert isinstance(back, Hyperparams) and dict(back.params) == dict(params.params)
