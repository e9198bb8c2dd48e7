"""The frames of ``export.delivery: process``: how a record and a control message travel from
the training process to its delivery process, by the pipe or a file.

A frame is a 4-byte big-endian length and a pickle of a tuple whose first item names it:
``("rec", trackers or None, body, number)`` carries one record (``body`` pickled apart, so that
a record the delivery process cannot read costs only itself; ``number`` counts the run's record
frames in the order of the stream), the others are control messages (``otel_rl/delivery/
service_link.py``).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

from otel_rl.core.records import Record, StepBatch
from otel_rl.process.fork_safe_log import log as _log


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


def record_fields(record: Any) -> tuple[Any, ...]:
    """A step as its rows (computed here, once for every tracker); other kinds as their spool
    encoding, which the child decodes the same way."""
    if type(record) is StepBatch:
        return (
            "step", record.step, record.time, record.axis, dict(record.step_metrics),
            record.rows, record.seal, record.provisional,
        )  # fmt: skip
    if isinstance(record, Record):
        return ("kind", record.kind, record.encode())
    raise TypeError(f"a {type(record).__name__} is no record kind the delivery process knows")


def record_body(record: Any) -> bytes:
    fields = record_fields(record)
    body = pickle.dumps(fields, pickle.HIGHEST_PROTOCOL)
    if b"__main__" in body:  # rare: a class of the training script, which the child lacks
        buffer = io.BytesIO()
        PlainPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(fields)
        body = buffer.getvalue()
    return body


def decode_record(body: bytes) -> Record:
    """The record of a ``("rec", names, body)`` frame (:func:`_record_frame`)."""
    fields = pickle.loads(body)
    if fields[0] == "step":
        _, step, at, axis, step_metrics, rows, seal, provisional = fields
        return StepBatch(step=step, values=rows, time=at, axis=axis, step_metrics=step_metrics,
                         seal=seal, provisional=provisional)  # fmt: skip
    _, kind, encoded = fields
    return Record.kinds[kind].decode(encoded)


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
                _log.warning("otel-rl: a message from the training process cannot be read in "
                             "the delivery process (%s: %s); skipped", type(exc).__name__, exc)
            start += 4 + size
        del buffer[:start]
