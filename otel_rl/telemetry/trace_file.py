"""Spans on disk: ``<log_dir>/traces.jsonl`` in OpenTelemetry's OTLP JSON file format.

One line per export: an ``ExportTraceServiceRequest`` in the protobuf JSON mapping with the OTLP
rules on top (trace and span ids as hex, enums as integers), as the specification's file
exporter writes it, so that the Collector's ``otlpjsonfile`` receiver can ship a run's spans
later and ``otel-rl timeline`` can draw them with no server at all.

The request is built by the OTLP exporters' own encoder (``opentelemetry-exporter-otlp-proto-
common``, already a dependency) and rendered by protobuf's ``json_format``; only the ids are
re-encoded. OpenTelemetry's own file exporter (``opentelemetry-exporter-otlp-json-file``) pins
another release of the OTLP common package than the SDK exporters in use here, and it neither
rotates nor bounds its file, which a run of days needs.

Bounded: when the next line would take ``traces.jsonl`` past half of ``max_bytes``, it becomes
``traces.1.jsonl`` (replacing the one before) and a new file starts, so both stay within
``max_bytes`` together and the newest spans are always kept. Written by the span processor's
thread, never the training thread. A full disk or a file that cannot be written costs the
batch that met it, is said once, and is tried again at the next batch.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.span_transfer import OPEN

MB = 1 << 20
#: Workers' snapshots of spans waiting to be written (each a list of a worker's spans).
MAX_CARRIED = 10_000

#: Plain spans written in one line at most. Between two lines the writing thread lets go of the
#: GIL: a thread that holds it makes a training thread that wants it wait up to the switch
#: interval (5 ms), which is what a loop's tail in the delivery process mode would show.
LINE_SPANS = 32
#: Seconds between two rounds of the writing thread while a source (a run's clock spans) feeds it.
ROUND_S = 0.5

#: The file under ``log_dir``, and the one it becomes when it is full.
FILE_NAME = "traces.jsonl"
ROTATED_NAME = "traces.1.jsonl"

#: Fields of OTLP's trace messages that hold ids: hex in OTLP JSON, base64 in protobuf's mapping.
_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})


def trace_files(log_dir: str | Path) -> list[Path]:
    """A run's trace files under ``log_dir``, oldest first (those that exist)."""
    root = Path(log_dir)
    return [p for p in (root / ROTATED_NAME, root / FILE_NAME) if p.is_file()]


def read_requests(log_dir: str | Path, tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Each export request written under ``log_dir``, oldest first, as OTLP JSON dicts; a line
    cut short by a crash is skipped. ``tail_bytes``: only the requests in about the last that
    many bytes (the newest spans, without reading files of up to twice ``file_max_mb``)."""
    for line in tail_lines(trace_files(log_dir), tail_bytes):
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if isinstance(request, dict):
            yield request


def tail_lines(paths: Sequence[Path], tail_bytes: int | None = None) -> Iterator[str]:
    """The lines of ``paths`` (oldest first), or of about their last ``tail_bytes`` bytes: from
    the first whole line within them, the files before that one left unread."""
    left = tail_bytes
    start: dict[Path, int] = {}
    for path in reversed(paths):
        if left is not None and left <= 0:
            break
        size = path.stat().st_size
        start[path] = 0 if left is None or size <= left else size - left
        left = None if left is None else left - size
    for path in paths:
        if path not in start:
            continue
        with open(path, "rb") as handle:
            if start[path]:
                handle.seek(start[path] - 1)
                handle.readline()  # the rest of a line begun before the tail
            for raw in handle:
                yield raw.decode("utf-8", errors="replace")


def otlp_json_line(spans: Sequence[Any]) -> str:
    """One OTLP JSON line (no newline) for these SDK spans."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    message = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    # ASCII only: a span named with U+2028 stays on its line for any reader's idea of a line.
    return json.dumps(_hex_ids(message), separators=(",", ":"))


def plain_json_line(spans: Sequence[Any]) -> str:
    """One OTLP JSON line (no newline) for plain spans
    (:data:`~otel_rl.telemetry.span_transfer.PlainSpan`: a worker's, a step's from the phase
    clock), as :func:`otlp_json_line` writes SDK spans, without building them: the text is put
    together directly, each resource, scope, name and attributes object encoded once per line.
    Raises ``ValueError`` or ``TypeError`` for a span that is not one (an id out of range, a
    field missing)."""
    encoded: dict[int, str] = {}  # id of an attributes object or a name -> its JSON

    def once(value: Any, encode: Callable[[Any], str]) -> str:
        text = encoded.get(id(value))
        if text is None:
            text = encoded[id(value)] = encode(value)
        return text

    resources: dict[int, tuple[Any, dict[str, list[str]]]] = {}
    for name, trace_id, span_id, parent_id, start, end, attributes, resource, scope in spans:
        if not (0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64 and 0 <= parent_id < 1 << 64):
            raise ValueError(f"span {name!r}: an id out of range")
        parent = f'"parentSpanId":"{parent_id:016x}",' if parent_id else ""
        span = (
            f'{{"traceId":"{trace_id:032x}","spanId":"{span_id:016x}",{parent}'
            f'"name":{once(name, _json_text)},"kind":1,"startTimeUnixNano":"{int(start)}",'
            f'"endTimeUnixNano":"{int(end)}","attributes":{once(attributes, _attributes_json)},'
            f'"status":{{}},"flags":{768 if parent_id else 256}}}'
        )
        held = resources.setdefault(id(resource), (resource, {}))
        held[1].setdefault(str(scope), []).append(span)
    parts = []
    for resource, scopes in resources.values():
        scope_spans = ",".join(
            f'{{"scope":{{"name":{json.dumps(scope)}}},"spans":[{",".join(items)}]}}'
            for scope, items in scopes.items()
        )
        parts.append(f'{{"resource":{{"attributes":{_attributes_json(resource)}}},'
                     f'"scopeSpans":[{scope_spans}]}}')  # fmt: skip
    return f'{{"resourceSpans":[{",".join(parts)}]}}'


def _json_text(value: Any) -> str:
    return json.dumps(str(value))


def _attributes_json(attributes: Any) -> str:
    return json.dumps(_key_values(attributes), separators=(",", ":"))


def _key_values(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": str(key), "value": _any_value(value)} for key, value in attributes.items()]


def _any_value(value: Any) -> dict[str, Any]:
    """OTLP JSON's ``AnyValue`` (int64 as a string, as protobuf's JSON mapping has it)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(item) for item in value]}}
    return {"stringValue": str(value)}


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: base64.b64decode(value).hex()
            if key in _ID_FIELDS and isinstance(value, str)
            else _hex_ids(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(item) for item in node]
    return node


class TraceFile:
    """A span exporter (``export``/``force_flush``/``shutdown``) that appends OTLP JSON lines to
    ``<log_dir>/traces.jsonl``, within ``max_bytes`` on disk with its rotated file.

    Duck-typed rather than a ``SpanExporter`` subclass, so that this module does not import the
    tracing SDK when tracing is off. In a fork child it writes nothing: the SDK starts the span
    processor's thread again there, holding the parent's spans, which are the parent's to write.
    """

    def __init__(self, log_dir: str | Path, max_bytes: int) -> None:
        self.path = Path(log_dir) / FILE_NAME
        self.max_bytes = int(max_bytes)
        #: Spans written, and spans lost on the way to the file (a full disk, a span larger than
        #: the file's share or that cannot be encoded); both counted by the writing thread.
        self.written = 0
        self.lost = 0
        # Workers' spans that never reached the writing thread (dropped in the worker, or
        # beyond the queue): counted by the caller's thread, apart, so no count is shared.
        self._not_carried = 0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._file: Any = None
        self._size = 0
        self._failing = False
        self._closed = False
        # Workers' spans (plain tuples from their snapshots), written on a thread of this file.
        self._carried: deque[list[Any]] = deque()
        self._carry_lock = threading.Lock()
        self._writing = threading.Lock()  # one writer of carried spans at a time
        # Carried spans still running at their snapshot, by span id, until they come whole.
        self._running: dict[int, Any] = {}
        self._wake = threading.Event()
        self._carrier: threading.Thread | None = None
        #: Functions that hand over spans at each round of the writing thread (a run's
        #: :class:`~otel_rl.telemetry.clock_spans.ClockSpans`): rounds come every
        #: :data:`ROUND_S` then, or sooner when a source calls :meth:`wake`.
        self._sources: list[Callable[[], Iterable[Any]]] = []

    def carry(self, plain: list[Any], dropped: int = 0) -> None:
        """Write spans (:data:`~otel_rl.telemetry.span_transfer.PlainSpan`: a worker's) on
        this file's own thread: the caller (``log_worker_metrics``) only queues them. At most
        :data:`MAX_CARRIED` batches wait; beyond that the oldest are lost (and counted, with
        the ``dropped`` spans a worker had no room for)."""
        if os.getpid() != self._pid or self._closed:
            return
        with self._carry_lock:
            self._not_carried += dropped
            if not plain:
                return
            if len(self._carried) >= MAX_CARRIED:
                lost = self._carried.popleft()
                self._not_carried += len(lost)
            self._carried.append(plain)
            self._start_carrier()
        self._wake.set()

    def add_source(self, source: Callable[[], Iterable[Any]]) -> None:
        """Write what ``source()`` returns (plain spans) at each round of this file's thread,
        and at the end."""
        if os.getpid() != self._pid or self._closed:
            return
        with self._carry_lock:
            self._sources.append(source)
            self._start_carrier()

    def wake(self) -> None:
        """A round of the writing thread now."""
        self._wake.set()

    def _start_carrier(self) -> None:
        if self._carrier is None:
            self._carrier = threading.Thread(
                target=self._carry_loop, name="otel-rl-trace-file", daemon=True
            )
            self._carrier.start()

    def _carry_loop(self) -> None:
        while not self._closed:
            self._wake.wait(ROUND_S if self._sources else None)
            self._wake.clear()
            try:
                self.write_carried()
            except Exception as exc:  # never end the thread: the next snapshots still come
                _log.warning("otel-rl: workers' spans not written to %s: %r", self.path, exc)

    def write_carried(self, final: bool = False) -> None:
        """Write the carried spans and the sources', a line of :data:`LINE_SPANS` at a time.
        One still running at its snapshot waits for the snapshot that has it whole; ``final``
        (the run's end) writes those that never came as they stood
        (:data:`~otel_rl.telemetry.span_transfer.OPEN`)."""
        with self._writing:
            with self._carry_lock:
                sources = list(self._sources)
            batches: list[Iterable[Any]] = [source() for source in sources]
            while True:
                with self._carry_lock:
                    batches += self._carried
                    self._carried.clear()
                if not batches:
                    break
                line: list[Any] = []
                for batch in batches:
                    for span in batch:
                        span_id, attributes = _fields(span)
                        self._running.pop(span_id, None)
                        if isinstance(attributes, dict) and attributes.get(OPEN):
                            self._running[span_id] = span
                            continue
                        line.append(span)
                        if len(line) == LINE_SPANS:
                            self._export(line, plain_json_line)
                            line = []
                            time.sleep(0)  # the GIL to the training thread between two lines
                batches = []
                while len(self._running) > MAX_CARRIED:
                    line.append(self._running.pop(next(iter(self._running))))
                self._export(line, plain_json_line)
            if final:
                self._export(list(self._running.values()), plain_json_line)
                self._running.clear()

    def _take_process_spans(self) -> None:
        """Carry the spans the Ray hook keeps in this process (in a driver: Ray's own)."""
        from otel_rl.telemetry.tracing import hook_spans

        kept = hook_spans()
        if kept is not None and os.getpid() == self._pid:  # a fork child's are not this file's
            self.carry(*kept.take())

    def export(self, spans: Sequence[Any]) -> Any:
        """Write SDK spans (the span processor's)."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        ok = self._export(spans, otlp_json_line)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def _export(self, spans: Sequence[Any], encode: Callable[[Sequence[Any]], str]) -> bool:
        """Write spans, SDK or plain (``encode``: their encoder). Plain spans need no import of
        the tracing SDK, which must not happen at interpreter exit: an import there makes an
        uncaught ^C exit with 1 instead of by SIGINT."""
        self._take_process_spans()
        if os.getpid() != self._pid or not spans:
            return True
        with self._lock:
            if self._closed:
                return False
            return all(self._write(part) for part in self._lines(list(spans), encode))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # each line is written (to the OS) when it is exported

    def shutdown(self) -> None:
        if os.getpid() == self._pid:
            with contextlib.suppress(Exception):  # a malformed snapshot costs only itself
                self._take_process_spans()
                self.write_carried(final=True)  # what workers sent before the end is on disk
            missing = self.lost + self._not_carried
            if missing:
                _log.warning(
                    "otel-rl: %d span(s) are not in %s (%d written): a full disk or a file that "
                    "could not be written, a span larger than half of tracing.file_max_mb or one "
                    "that could not be encoded, or more spans than a worker keeps between two "
                    "snapshots (2,000) or the driver queues (10,000 batches)",
                    missing, self.path, self.written,
                )  # fmt: skip
        with self._lock:
            self._closed = True
            if self._file is not None and os.getpid() == self._pid:
                try:
                    self._file.close()
                except OSError as exc:
                    self._said(exc)
            self._file = None
        self._wake.set()  # the carrier thread ends

    def _lines(
        self, spans: list[Any], encode: Callable[[Sequence[Any]], str]
    ) -> Iterator[tuple[str, int]]:
        """(line, spans in it): halves a batch whose line exceeds the file's share, or that
        cannot be encoded (a span with an id out of range), down to the span at fault."""
        try:
            line: str | None = encode(spans) + "\n"
        except Exception as exc:
            line, problem = None, exc
        if line is not None and len(line) <= self.max_bytes // 2:
            yield line, len(spans)
        elif len(spans) > 1:
            middle = len(spans) // 2
            yield from self._lines(spans[:middle], encode)
            yield from self._lines(spans[middle:], encode)
        elif line is None:
            self.lost += 1
            _log.warning("otel-rl: span %r not written to %s: %r",
                         _name(spans[0]), self.path, problem)  # fmt: skip
        else:
            self.lost += 1
            _log.warning(
                "otel-rl: a span of %d bytes (%s) is larger than half of tracing.file_max_mb: "
                "not written to %s; raise tracing.file_max_mb to keep such spans",
                len(line), _name(spans[0]), self.path,
            )  # fmt: skip

    def _write(self, item: tuple[str, int]) -> bool:
        line, count = item
        data = line.encode("utf-8")
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._open()
                self._size = self._file.tell()
            if self._size and self._size + len(data) > self.max_bytes // 2:
                self._file.close()
                self._file = None
                os.replace(self.path, self.path.with_name(ROTATED_NAME))
                self._file = self._open()
                self._size = 0
            view = memoryview(data)
            while view:  # unbuffered: what failed is not written later by a flush
                view = view[self._file.write(view) :]
        except OSError as exc:
            self.lost += count
            self._said(exc)
            self._drop_partial()
            return False
        self._size += len(data)
        self.written += count
        if self._failing:
            self._failing = False
            _log.warning("otel-rl: spans are written to %s again", self.path)
        return True

    def _open(self) -> Any:
        """The file, for appending; one that ends in part of a line (a crash, a disk that was
        full) gets its line ended first, so that the next line is whole."""
        file = open(self.path, "ab", buffering=0)  # noqa: SIM115  # held open for the run
        try:
            size = file.tell()
            if size:
                with open(self.path, "rb") as tail:
                    tail.seek(size - 1)
                    if tail.read(1) != b"\n":
                        file.write(b"\n")
        except OSError:
            file.close()
            raise
        return file

    def _drop_partial(self) -> None:
        """After a failed write the file may end in part of a line: start the next line on a
        line of its own (a reader skips the fragment), or reopen at the next batch."""
        if self._file is None:
            return
        try:
            self._file.write(b"\n")
            self._size = self._file.tell()
        except OSError:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _said(self, exc: OSError) -> None:
        if self._failing:
            return
        self._failing = True
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        _log.warning(
            "otel-rl: cannot write spans to %s: %s%s. Training goes on; the spans of each batch "
            "that fails are lost, and each next batch is tried",
            self.path, exc, " (the disk is full)" if full else "",
        )  # fmt: skip


def _fields(span: Any) -> tuple[Any, Any]:
    """A plain span's id and attributes (``(None, None)`` for a malformed entry, which its
    encoding then refuses)."""
    try:
        return span[2], span[6]
    except (TypeError, IndexError, KeyError):
        return None, None


def _name(span: Any) -> str:
    """A span's name, SDK or plain, for a message."""
    if isinstance(span, tuple) and span:
        return str(span[0])
    return str(getattr(span, "name", "?"))
