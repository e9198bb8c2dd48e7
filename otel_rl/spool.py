"""A per-tracker write-ahead log: records reach disk before a tracker sees them.

Layout, for one tracker of one run::

    <log_dir>/.otel-rl/spool/<tracker>/<run_id>/
        meta.json                 tracker name, logger config, how to resume the tracker's run
        wal-000000000001.jsonl    records, one JSON object per line: {"seq": n, "kind": ..., ...}
        acked.log                 delivery marks: "upto N" (every seq <= N is done) or "one N"

Sequence numbers start at 1 and grow by one per record. A tracker's worker delivers in order, so
its marks are ``upto`` lines; ``otel-rl replay`` re-sends in step order and may leave ``one`` marks.
Segments whose records are all done are deleted when a new one starts.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.records import HistogramValue, Hyperparams, Plot, StepBatch, Table

SPOOL_DIRNAME = ".otel-rl/spool"
_SEGMENT_RECORDS = 20_000


def spool_root(log_dir: str | os.PathLike) -> Path:
    return Path(log_dir) / SPOOL_DIRNAME


# ---- record encoding --------------------------------------------------------------------------


def encode_record(seq: int, record: Any) -> str:
    """One JSON line for ``record`` (rows of a StepBatch are computed here, off the caller)."""
    if isinstance(record, StepBatch):
        body: dict[str, Any] = {
            "kind": "step",
            "step": record.step,
            "time": record.time,
            "axis": record.axis,
            "step_metrics": dict(record.step_metrics),
            "rows": {k: _encode_value(v) for k, v in record.rows.items()},
        }
    elif isinstance(record, Hyperparams):
        body = {"kind": "hyperparams", "params": {k: _plain(v) for k, v in record.params.items()}}
    elif isinstance(record, Plot):
        body = {
            "kind": "plot",
            "name": record.name,
            "step": record.step,
            "png": base64.b64encode(record.png).decode("ascii"),
        }
    elif isinstance(record, Table):
        body = {
            "kind": "table",
            "name": record.name,
            "step": record.step,
            "columns": list(record.columns),
            "rows": [[_plain(c) for c in row] for row in record.rows],
        }
    else:  # a record type this spool does not know: delivered live, not replayable
        body = {"kind": "opaque", "type": type(record).__name__}
    body["seq"] = seq
    return json.dumps(body, separators=(",", ":"), default=str) + "\n"


def decode_record(line: str) -> tuple[int, Any]:
    """``(seq, record)``; the record is ``None`` for entries that cannot be replayed."""
    body = json.loads(line)
    kind = body["kind"]
    record: Any = None
    if kind == "step":
        record = StepBatch(
            step=body["step"],
            values={k: _decode_value(v) for k, v in body["rows"].items()},
            time=body["time"],
            axis=body["axis"],
            step_metrics=body.get("step_metrics") or {},
        )
    elif kind == "hyperparams":
        record = Hyperparams(body["params"])
    elif kind == "plot":
        record = Plot(body["name"], body["step"], base64.b64decode(body["png"]))
    elif kind == "table":
        record = Table(
            body["name"], body["step"], tuple(body["columns"]), tuple(map(tuple, body["rows"]))
        )
    return body["seq"], record


def _encode_value(value: Any) -> Any:
    if isinstance(value, HistogramValue):
        return {
            "__histogram__": [
                list(value.bounds), list(value.counts), value.count, value.sum, value.min, value.max
            ]
        }
    return value  # float (NaN/inf as JSON's NaN/Infinity tokens, which json reads back) or str


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and "__histogram__" in value:
        bounds, counts, count, total, lo, hi = value["__histogram__"]
        return HistogramValue(tuple(bounds), tuple(counts), count, total, lo, hi)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


# ---- the log ----------------------------------------------------------------------------------


@dataclass
class Acks:
    """Which sequence numbers are done."""

    upto: int = 0
    ones: set[int] = field(default_factory=set)

    def done(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.ones


class Spool:
    """The write-ahead log of one tracker for one run (not thread-safe: see the owners).

    The writer side (``append``/``sync``) belongs to the exporter's spool thread, the ack side
    (``ack``/``sync_acks``) to its worker thread; ``read`` opens its own file handles.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        acks = read_acks(self.dir)
        self.last_seq = max(acks.upto, self._last_seq_on_disk())
        self._segment: Any = None
        self._segment_first = 0
        self._in_segment = 0
        self._acks = (self.dir / "acked.log").open("a", encoding="utf-8")
        self._acked_upto = acks.upto

    # writer side
    def append(self, records: list[Any]) -> list[int]:
        """Write ``records`` (one write call); returns their sequence numbers."""
        if self._segment is None or self._in_segment >= _SEGMENT_RECORDS:
            self._rotate()
        seqs = list(range(self.last_seq + 1, self.last_seq + 1 + len(records)))
        lines = [encode_record(s, r) for s, r in zip(seqs, records, strict=True)]
        self._segment.write("".join(lines))
        self._segment.flush()  # readers in this process see it; fsync makes it durable
        self.last_seq = seqs[-1] if seqs else self.last_seq
        self._in_segment += len(records)
        return seqs

    def sync(self) -> None:
        if self._segment is not None:
            self._segment.flush()
            os.fsync(self._segment.fileno())

    # ack side
    def ack(self, upto: int) -> None:
        if upto > self._acked_upto:
            self._acks.write(f"upto {upto}\n")
            self._acked_upto = upto

    def sync_acks(self) -> None:
        self._acks.flush()
        os.fsync(self._acks.fileno())

    @property
    def acked_upto(self) -> int:
        return self._acked_upto

    def close(self) -> None:
        for f in (self._segment, self._acks):
            if f is not None and not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        tmp.replace(self.dir / "meta.json")

    def _rotate(self) -> None:
        if self._segment is not None:
            self._segment.flush()
            os.fsync(self._segment.fileno())
            self._segment.close()
        self._delete_done_segments()
        self._segment_first = self.last_seq + 1
        path = self.dir / f"wal-{self._segment_first:012d}.jsonl"
        self._segment = path.open("a", encoding="utf-8")
        self._in_segment = 0

    def _delete_done_segments(self) -> None:
        segments = segment_paths(self.dir)
        for path, next_path in itertools.pairwise(segments):
            if _first_seq(next_path) - 1 <= self._acked_upto:
                path.unlink(missing_ok=True)

    def _last_seq_on_disk(self) -> int:
        segments = segment_paths(self.dir)
        if not segments:
            return 0
        last = _first_seq(segments[-1]) - 1
        for seq, _ in iter_records(segments[-1]):
            last = seq
        return last


def segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("wal-*.jsonl"))


def _first_seq(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def iter_records(path: Path, offset: int = 0) -> Iterator[tuple[int, Any]]:
    """Records of one segment from byte ``offset``; a torn last line (crash) is ignored."""
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                yield decode_record(raw.decode("utf-8"))
            except (ValueError, KeyError):
                continue


def read_acks(directory: Path) -> Acks:
    acks = Acks()
    path = directory / "acked.log"
    if not path.exists():
        return acks
    for line in path.read_text(encoding="utf-8").splitlines():
        kind, _, number = line.partition(" ")
        if not number.isdigit():
            continue  # a torn line from a crash
        if kind == "upto":
            acks.upto = max(acks.upto, int(number))
        elif kind == "one":
            acks.ones.add(int(number))
    return acks


def undelivered(directory: Path) -> list[tuple[int, Any]]:
    """Every record not yet done, in sequence order."""
    acks = read_acks(directory)
    out = []
    for path in segment_paths(directory):
        for seq, record in iter_records(path):
            if not acks.done(seq):
                out.append((seq, record))
    return out


def mark_done(directory: Path, seqs: list[int]) -> None:
    with (directory / "acked.log").open("a", encoding="utf-8") as f:
        f.write("".join(f"one {s}\n" for s in seqs))
        f.flush()
        os.fsync(f.fileno())
