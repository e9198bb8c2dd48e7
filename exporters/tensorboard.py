"""TensorBoard exporter: writes TensorBoard's event files directly, without torch or TensorFlow.

Output goes to ``<log_dir>/tensorboard/`` (or ``tensorboard.log_dir``), as NeMo RL lays it out.
Each step becomes one event holding all its scalars (``simple_value``, float32 as TensorBoard
stores them), histograms, and text (the text plugin's string tensors). Only the event protos
from the ``tensorboard`` package are used; records are framed here (TFRecord: length, masked
CRC32C of the length, payload, masked CRC32C of the payload).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.exporters.base import TrackerExporter

from otel_rl.records import HistogramValue, RowValue, StepBatch

_FILE_COUNTER = iter(range(1 << 30))


class TensorBoardExporter(TrackerExporter):
    name: ClassVar[str] = "tensorboard"
    max_batch: ClassVar[int] = 256
    requires: ClassVar[tuple[str, ...]] = ("tensorboard",)

    def __init__(self, log_dir: str | os.PathLike, **kwargs: Any) -> None:
        self.log_dir = Path(log_dir)
        self._file: Any = None
        self._pb: Any = None
        self._crc: Any = None
        super().__init__(**kwargs)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **kwargs: Any) -> TensorBoardExporter:
        log_dir = cfg["tensorboard"].get("log_dir") or Path(cfg["log_dir"]) / "tensorboard"
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
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_FILE_COUNTER)}"
        )
        self._file = (self.log_dir / name).open("ab")
        self._write_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self._write_event(self._event(step, rows, batch.time))

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        for batch in batches:
            self._write_event(self._event(batch.step, batch.rows, batch.time))

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        text = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        rows = {"hyperparams": "| key | value |\n|---|---|\n" + text}
        self._write_event(self._event(0, rows, time.time()))

    def flush_backend(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, exit_code: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _event(self, step: int, rows: Mapping[str, RowValue], wall_time: float) -> Any:
        event_pb2, summary_pb2, tensor_pb2, types_pb2 = self._pb
        values = []
        for tag, value in rows.items():
            if type(value) is float:
                values.append(summary_pb2.Summary.Value(tag=tag, simple_value=value))
            elif isinstance(value, str):
                values.append(
                    summary_pb2.Summary.Value(
                        tag=tag,
                        metadata=summary_pb2.SummaryMetadata(
                            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
                        ),
                        tensor=tensor_pb2.TensorProto(
                            dtype=types_pb2.DT_STRING, string_val=[value.encode("utf-8")]
                        ),
                    )
                )
            elif isinstance(value, HistogramValue):
                values.append(summary_pb2.Summary.Value(tag=tag, histo=_histogram_proto(value)))
        summary = summary_pb2.Summary(value=values)
        return event_pb2.Event(wall_time=wall_time, step=step, summary=summary)

    def _write_event(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crc = self._crc
        self._file.write(
            header
            + struct.pack("<I", crc(header))
            + data
            + struct.pack("<I", crc(data))
        )


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

        def raw(data: bytes) -> int:
            return google_crc32c.value(data)
    except ImportError:  # pure Python, ~0.1 µs per byte
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as raw

    def masked(data: bytes) -> int:
        crc = raw(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked
