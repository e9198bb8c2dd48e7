"""The frames of ``export.delivery: process``: how a record and a control message travel from
the training process to its delivery process, by the pipe or a file.

A frame is a 4-byte big-endian length and a pickle of a tuple whose first item names it:
``("rec", trackers or None, body, number)`` carries one record, the others are control messages
(``otel_rl/delivery/service_link.py``). A record's ``body`` is its one encoding
(:func:`~otel_rl.core.records.record_fields`, which the spool writes as JSON) pickled apart from
the frame, so that a record the delivery process cannot read costs only itself; ``number``
counts the run's record frames in the order of the stream.

Pickle, not the spool's JSON, carries the fields: the body is made on the training thread, and
for a step of 100 keys pickling its fields takes ~5 µs where JSON takes ~40 µs (a float's
``repr`` is the cost), while the delivery process encodes the JSON for its spools off the
training process anyway (docs/architecture.md, the delivery process).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

from otel_rl.core.records import Record, StepBatch, record_fields, record_from_fields
from otel_rl.delivery.link_messages import say_message_unreadable


class PlainPickler(pickle.Pickler):
    """Pickles values of the caller's own classes as the built-in values they are (a ``str``
    enum as its text, an ``int`` subclass as an int), and other objects of the training script
    as their ``str()``: the delivery process cannot import the script's classes."""

    def reducer_override(self, obj: Any) -> Any:
        for base in (int, float, str, bytes):
            if isinstance(obj, base) and type(obj) is not base:
                value: Any = obj
                return base, (str.__str__(value) if base is str else base(value),)
        if type(obj).__module__ == "__main__" and not isinstance(obj, type):
            return str, (str(obj),)
        return NotImplemented


def record_body(record: Any) -> bytes:
    """The body of a record frame: the record's fields, pickled."""
    if not isinstance(record, Record):
        raise TypeError(f"a {type(record).__name__} is no record kind the delivery process knows")
    fields = record_fields(record)
    body = pickle.dumps(fields, pickle.HIGHEST_PROTOCOL)
    if b"__main__" in body:  # rare: a class of the training script, which the child lacks
        buffer = io.BytesIO()
        PlainPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(fields)
        body = buffer.getvalue()
    return body


def record_from_body(body: bytes) -> Record:
    """The record of a record frame's body (:func:`record_body`). Raises for a body that is
    not a record's (damaged, or a value of a class this process cannot import)."""
    fields = pickle.loads(body)
    if isinstance(fields, tuple):  # a handoff file an earlier otel-rl left for replay
        return _earlier_record(fields)
    if not isinstance(fields, dict):
        raise TypeError(f"a pickled {type(fields).__name__}, not a record's fields")
    record = record_from_fields(fields)
    if record is None:
        raise TypeError(f"a {fields.get('type')} is no record kind the delivery process knows")
    return record


def _earlier_record(fields: tuple[Any, ...]) -> Record:
    """A record in the body the frames had before the one codec: a step as its rows, another
    record as its spool encoding (``otel-rl replay`` after an upgrade reads such files)."""
    if fields[:1] == ("step",) and len(fields) == 8:
        _, step, at, axis, step_metrics, rows, seal, provisional = fields
        return StepBatch(step=step, values=rows, time=at, axis=axis, step_metrics=step_metrics,
                         seal=seal, provisional=provisional)  # fmt: skip
    if fields[:1] == ("kind",) and len(fields) == 3:
        return Record.kinds[fields[1]].decode(fields[2])
    raise TypeError(f"a pickled tuple of {len(fields)}, not a record's fields")


def encode_frame(*message: Any) -> bytes:
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(4, "big") + payload


def read_frames(fd: int, chunk: int = 1 << 20) -> Iterator[tuple[Any, ...]]:
    """The messages of a frame stream (the records pipe, a handoff file) until it ends; a frame
    cut short at the end (by a kill) is not read."""
    buffer = bytearray()
    while True:
        data = os.read(fd, chunk)
        if not data:
            return
        buffer += data
        start = 0
        while len(buffer) - start >= 4:
            size = int.from_bytes(buffer[start : start + 4], "big")
            if len(buffer) - start - 4 < size:
                break
            try:
                yield pickle.loads(buffer[start + 4 : start + 4 + size])
            except Exception as exc:  # e.g. a setup function this process cannot import
                say_message_unreadable(exc)
            start += 4 + size
        del buffer[:start]
