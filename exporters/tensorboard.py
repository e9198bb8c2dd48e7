"""TensorBoard exporter: writes TensorBoard's event files directly, without torch or TensorFlow.

Output goes to ``<log_dir>/tensorboard/`` (or ``tensorboard.log_dir``), as NeMo RL lays it out.
Each step becomes one event holding all its scalars (``simple_value``, float32 as TensorBoard
stores them), histograms, and text (the text plugin's string tensors). Hyperparameters go to the
HPARAMS tab (and as a Markdown table to the TEXT tab), plots to IMAGES, tables to TEXT as Markdown
(see :mod:`otel_rl.exporters.tensorboard_summaries`). Only the protos from the ``tensorboard``
package are used; records are framed here (TFRecord: length, masked CRC32C of the length,
payload, masked CRC32C of the payload).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import Event, HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import ConfigKey, RowRejected, TrackerConfig, TrackerExporter
from otel_rl.exporters.tensorboard_summaries import (
    HPARAMS_START_TAG,
    hparams_end_value,
    hparams_start_value,
    image_value,
    markdown_table,
    text_value,
)

_FILE_COUNTER = iter(range(1 << 30))


class TensorBoardExporter(TrackerExporter):
    name: ClassVar[str] = "tensorboard"
    backwards_policy: ClassVar[str] = (
        "TensorBoard keeps both points at that step (the chart line goes back)"
    )
    max_batch: ClassVar[int] = 256
    requires: ClassVar[tuple[str, ...]] = ("tensorboard",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="TensorBoard event files",
        order=10,
        keys={
            "log_dir": ConfigKey(
                "path", "where the event files go", shown_default="`<log_dir>/tensorboard`"
            ),
        },
    )  # fmt: skip

    def __init__(self, log_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        self.log_dir = Path(log_dir).absolute()  # where it is now, whatever the cwd later
        self._file: Any = None
        self._pb: Any = None
        self._crc: Any = None
        self._hparams: dict[str, Any] = {}
        self._hparams_state = "none"  # "none" -> "pending" -> "written"
        self._started = time.time()
        super().__init__(**kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> TensorBoardExporter:
        log_dir = cfg.tracker_section("tensorboard").log_dir or Path(cfg.log_dir) / "tensorboard"
        return cls(log_dir, **kwargs)

    @property
    def path(self) -> Path | None:
        """The event file being written (``None`` until the first write)."""
        return Path(self._file.name) if self._file is not None else None

    def open(self) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

        self._pb = (event_pb2, summary_pb2, tensor_pb2, types_pb2)
        self._crc = _crc32c()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = (
            f"events.out.tfevents.{_after_every_file_in(self.log_dir)}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_FILE_COUNTER)}"
        )
        self._file = (self.log_dir / name).open("ab")
        self._write_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        # Every event is encoded before the first byte is written: a batch that cannot be
        # encoded (a step beyond int64) writes nothing, so a retry never repeats a part of it.
        data = b"".join(
            self._record(self._event(batch.step, batch.rows, batch.time)) for batch in batches
        )
        # One write of the whole batch (with the hyperparameters due before it), flushed by the
        # delivery right after: on disk it is all there or not at all (see holds_since).
        self._file.write(self._pending_hparams_record() + data)

    def write_position(self) -> Any:
        if self._file is None:
            return None
        self._file.flush()
        return {"file": Path(self._file.name).name, "size": self._file.tell()}

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        # An event per batch (after any hyperparameter records), written in one call that a
        # kill may still cut short: count the whole records after the position.
        tail = self._written_since(position)
        if tail is None:
            return False
        whole, count = _whole_records(tail)
        return whole and count > 0 and (records is None or count >= records)

    def landed_since(self, position: Any, records: int) -> int | None:
        # The whole events after the position, but the hyperparameter record a write may start
        # with; a torn one after them stays in its file, where readers stop (the next write
        # goes to a new file).
        from tensorboard.compat.proto import event_pb2

        tail = self._written_since(position)
        if tail is None:
            return None
        try:
            events = [event_pb2.Event.FromString(payload) for payload in _payloads(tail)]
        except Exception:  # not what this tracker wrote: the all-or-nothing check decides
            return None
        steps = [e for e in events if all(v.tag != HPARAMS_START_TAG for v in e.summary.value)]
        return min(len(steps), records)

    def _written_since(self, position: Any) -> bytes | None:
        """The bytes of the event file ``position`` names after its size there (``None`` when
        it cannot be read)."""
        try:
            with (self.log_dir / str(position["file"])).open("rb") as f:
                f.seek(int(position["size"]))
                return f.read()
        except (KeyError, TypeError, ValueError, OSError):
            return None

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        changed = any(k not in self._hparams or self._hparams[k] != v for k, v in params.items())
        if self._hparams_state == "written" and changed:
            # TensorBoard keeps the first session_start_info of a run directory.
            self._warn_once(
                "late-hparams",
                "%s: hyperparameters logged after the first step appear in the TEXT tab only; "
                "the HPARAMS tab keeps those logged before it",
                self.name,
            )
        self._hparams.update(params)
        if self._hparams_state == "none":
            self._hparams_state = "pending"
        table = markdown_table(["key", "value"], sorted(self._hparams.items()))
        self._write_values(0, [text_value("hyperparams", table)], time.time())

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        try:
            value = image_value(name, png)
        except ValueError as exc:
            raise RowRejected(f"plot {name!r} at step {step}: {exc}") from exc
        self._write_values(step, [value], time.time())

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        self._write_values(step, [text_value(name, markdown_table(columns, rows))], time.time())

    def write_event(self, event: Event) -> None:
        text = f"**{event.title}**\n\n```\n{event.text}\n```"
        self._write_values(event.step, [text_value(event.name, text)], time.time())

    def write_resume(self, resume: Resume) -> None:
        # TensorBoard's own purge step: a SessionLog START at step S hides, for every tag, the
        # events at steps >= S read before it (the superseded attempt's), so each step shows the
        # new attempt's value. Readers go through a folder's files in name order, which puts
        # this file after the earlier launches' (see _after_every_file_in).
        event_pb2 = self._pb[0]
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._write_event(
            event_pb2.Event(wall_time=time.time(), step=resume.step, session_log=start)
        )

    def flush_backend(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, exit_code: int) -> None:
        if self._file is not None:
            self._write_pending_hparams()
            if self._hparams_state == "written":
                self._write_values(0, [hparams_end_value(exit_code)], time.time())
            self._file.close()
            self._file = None

    def _write_pending_hparams(self) -> None:
        self._file.write(self._pending_hparams_record())

    def _pending_hparams_record(self) -> bytes:
        # Written just before the first step, so that every hyperparameter logged at start-up
        # (often in several calls) lands in the one session_start_info TensorBoard reads.
        if self._hparams_state != "pending":
            return b""
        event_pb2, summary_pb2, _, _ = self._pb
        value = hparams_start_value(self._hparams, self._started)
        event = event_pb2.Event(
            wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])
        )
        self._hparams_state = "written"
        return self._record(event)

    def _write_values(self, step: int, values: list[Any], wall_time: float) -> None:
        event_pb2, summary_pb2, _, _ = self._pb
        summary = summary_pb2.Summary(value=values)
        self._write_event(event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def _event(self, step: int, rows: Mapping[str, RowValue], wall_time: float) -> Any:
        event_pb2, summary_pb2, _, _ = self._pb
        values = []
        for tag, value in rows.items():
            if type(value) is float:
                values.append(summary_pb2.Summary.Value(tag=tag, simple_value=value))
            elif isinstance(value, str):
                values.append(text_value(tag, value))
            elif isinstance(value, HistogramValue):
                values.append(summary_pb2.Summary.Value(tag=tag, histo=_histogram_proto(value)))
        summary = summary_pb2.Summary(value=values)
        return event_pb2.Event(wall_time=wall_time, step=step, summary=summary)

    def _write_event(self, event: Any) -> None:
        self._file.write(self._record(event))

    def _record(self, event: Any) -> bytes:
        """One TFRecord: length, its CRC, the serialized event, its CRC."""
        data: bytes = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crc = self._crc
        return header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))


def _histogram_proto(value: HistogramValue) -> Any:
    from tensorboard.compat.proto import summary_pb2

    # TensorBoard's buckets are (previous limit, limit]; the last one is open-ended.
    limits = [*value.bounds, max(value.max, value.bounds[-1] if value.bounds else value.max)]
    return summary_pb2.HistogramProto(
        min=value.min,
        max=value.max,
        num=value.count,
        sum=value.sum,
        sum_squares=0.0,
        bucket_limit=limits,
        bucket=[float(c) for c in value.counts],
    )


def _crc32c() -> Any:
    """Masked CRC32C as TFRecord wants it; C implementation when google-crc32c is installed."""
    try:
        import google_crc32c

        raw: Callable[[bytes], int] = google_crc32c.value
    except ImportError:  # pure Python, ~0.1 µs per byte
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

        raw = crc32c

    def masked(data: bytes) -> int:
        crc = raw(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked


def _payloads(data: bytes) -> list[bytes]:
    """The data of each whole TFRecord frame at the start of ``data``."""
    payloads, position = [], 0
    while position + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, position)
        end = position + 12 + length + 4
        if end > len(data):
            break
        payloads.append(data[position + 12 : position + 12 + length])
        position = end
    return payloads


def _whole_records(data: bytes) -> tuple[bool, int]:
    """Whether ``data`` is a sequence of whole TFRecord frames (length, crc, data, crc), and
    how many."""
    count = position = 0
    while position < len(data):
        if position + 12 > len(data):
            return False, count
        (length,) = struct.unpack_from("<Q", data, position)
        position += 12 + length + 4
        if position > len(data):
            return False, count
        count += 1
    return True, count


def _after_every_file_in(folder: Path) -> int:
    """The seconds that name a new event file: now, or one past the newest file of ``folder``
    when that is later (a relaunch within the second its earlier launch's replay wrote), so that
    the new file sorts last and TensorBoard's purge step in it applies to the earlier ones."""
    now = int(time.time())
    for entry in os.scandir(folder):
        stamp = entry.name.removeprefix("events.out.tfevents.").partition(".")[0]
        if entry.name.startswith("events.out.tfevents.") and stamp.isdigit():
            now = max(now, int(stamp) + 1)
    return now
