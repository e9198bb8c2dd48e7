"""Spans on disk (``tracing.file``): ``<log_dir>/traces.jsonl`` in the OTLP JSON file format,
read back with two parsers that know nothing of otel-rl: OpenTelemetry's OTLP JSON messages
(``opentelemetry-proto-json``, which reads hex ids as the specification writes them) and
protobuf's own ``json_format`` into ``opentelemetry-proto``'s message."""

from __future__ import annotations

import base64
import json
import logging
import multiprocessing
import time
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest as ProtoRequest,
)
from opentelemetry.proto_json.collector.trace.v1.trace_service import (
    ExportTraceServiceRequest as JsonRequest,
)

from otel_rl import Logger, WorkerMetrics
from otel_rl.telemetry.trace_file import FILE_NAME, ROTATED_NAME, TraceFile, trace_files
from testkit.readers import trace_file_spans


def _lines(log_dir: Path) -> list[str]:
    return [line for path in trace_files(log_dir) for line in path.read_text().splitlines() if line]


def _proto_with_hex_ids(line: str) -> ProtoRequest:
    """protobuf's mapping wants ids in base64; OTLP JSON has them in hex."""

    def ids(node):
        if isinstance(node, dict):
            return {k: base64.b64encode(bytes.fromhex(v)).decode()
                    if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
                    else ids(v) for k, v in node.items()}  # fmt: skip
        return [ids(v) for v in node] if isinstance(node, list) else node

    return json_format.ParseDict(ids(json.loads(line)), ProtoRequest())


def test_every_timer_of_a_run_is_a_span_on_disk_that_otlp_json_parsers_read(tmp_path):
    log_dir = tmp_path / "run"
    with Logger({"log_dir": str(log_dir), "tracing": {"enabled": True}}) as logger:
        for step in range(3):
            with logger.timer("generation"), logger.timer("generation/reward"):
                time.sleep(0.01)
            with logger.timer("training"):
                pass
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        run_id = logger.run_id
    spans = trace_file_spans(log_dir)
    by_name: dict[str, list] = {}
    for _, span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert len(by_name["rl.step"]) == 3
    assert len(by_name["generation"]) == len(by_name["training"]) == 3
    assert len(by_name["generation/reward"]) == 3
    # The OTLP JSON rules: hex ids, which link a child to its parent and a step to its timers.
    ids = {span.span_id: span for _, span in spans}
    for reward in by_name["generation/reward"]:
        parent = ids[reward.parent_span_id]
        assert parent.name == "generation" and parent.trace_id == reward.trace_id
        assert reward.end_time_unix_nano - reward.start_time_unix_nano >= 10_000_000
        assert ids[parent.parent_span_id].name == "rl.step"
    steps = sorted(
        next(a.value.int_value for a in s.attributes if a.key == "rl.step")
        for s in by_name["rl.step"]
    )
    assert steps == [0, 1, 2]
    assert {resource.get("otel_rl.run_id") for resource, _ in spans} == {run_id}
    raw = json.loads(_lines(log_dir)[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(raw["traceId"]) == 32 and int(raw["traceId"], 16) and len(raw["spanId"]) == 16
    assert isinstance(raw["kind"], int)  # enums as integers
    # Every line is an ExportTraceServiceRequest for protobuf too, with the same ids.
    for line in _lines(log_dir):
        request = _proto_with_hex_ids(line)
        for rs in request.resource_spans:
            for span in rs.scope_spans[0].spans:
                assert span.span_id in ids  # the same 8 bytes as the hex said


def test_tracing_file_off_or_tracing_off_writes_no_file(tmp_path):
    for cfg in ({"tracing": {"enabled": True, "file": False}}, {"tracing": {"file": False}},
                {"tracing": {"enabled": False}}):
        log_dir = tmp_path / str(len(str(cfg)))
        with Logger({"log_dir": str(log_dir), **cfg}) as logger:
            with logger.timer("generation"):
                pass
            logger.log_metrics({"x": 1.0}, step=0)
        assert not (log_dir / FILE_NAME).exists()


def _span(name: str, size: int = 0):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    span = tracer.start_span(name, attributes={"blob": "x" * size} if size else None)
    span.end()
    return span


def test_the_files_stay_within_their_cap_and_keep_the_newest_spans(tmp_path):
    cap = 64 * 1024
    trace_file = TraceFile(tmp_path, cap)
    names = [f"span-{i}" for i in range(2000)]
    for start in range(0, len(names), 7):  # batches of 7, as a span processor hands them
        trace_file.export([_span(n) for n in names[start : start + 7]])
        on_disk = sum(p.stat().st_size for p in trace_files(tmp_path))
        assert on_disk <= cap
    trace_file.shutdown()
    assert (tmp_path / ROTATED_NAME).exists()
    kept = [s.name for _, s in trace_file_spans(tmp_path)]
    assert kept == names[-len(kept) :]  # the newest, in order, none twice
    assert len(kept) > 100 and trace_file.written == len(names)


@pytest.mark.slow
def test_a_10_000_step_run_stays_within_its_cap_and_every_line_parses(tmp_path):
    """A real run: 10,000 steps of two timers each (30,000 spans with the steps' own) against a
    cap of 1 MB. Both files together stay within it, every line of both is an
    ``ExportTraceServiceRequest`` to both parsers, and the last step's spans are the ones kept."""
    log_dir = tmp_path / "long"
    cfg = {"log_dir": str(log_dir), "jsonl_enabled": False,
           "tracing": {"enabled": True, "file_max_mb": 1, "picture": False}}  # fmt: skip
    with Logger(cfg) as logger:
        for step in range(10_000):
            with logger.timer("generation"):
                pass
            with logger.timer("train"):
                pass
            logger.log_metrics({"loss": 1.0}, step=step)
    sizes = [p.stat().st_size for p in trace_files(log_dir)]
    assert len(sizes) == 2 and sum(sizes) <= 1 << 20
    lines = _lines(log_dir)
    for line in lines:
        json_format.Parse(line, ProtoRequest())
    steps = [next((a.value.int_value for a in s.attributes if a.key == "rl.step"), None)
             for _, s in trace_file_spans(log_dir)]  # fmt: skip
    kept = sorted({step for step in steps if step is not None})
    assert kept[-1] == 9_999 and len(kept) == kept[-1] - kept[0] + 1  # the newest, no gap


def test_the_tail_of_the_files_is_whole_lines_of_the_newest_across_the_rotation(tmp_path):
    """``tail_lines`` (what a picture of the last steps reads): for every tail size, a suffix of
    all the lines, each whole, holding every line that lies entirely within the tail."""
    from otel_rl.telemetry.trace_file import tail_lines

    older = [f"older-{i}-" + "x" * (i % 7) + "\n" for i in range(40)]
    newer = [f"newer-{i}-" + "y" * (i % 5) + "\n" for i in range(30)]
    (tmp_path / ROTATED_NAME).write_text("".join(older))
    (tmp_path / FILE_NAME).write_text("".join(newer))
    every = older + newer
    total = sum(len(line) for line in every)
    for tail in [*range(0, total + 20, 3), None]:
        got = list(tail_lines(trace_files(tmp_path), tail))
        assert got == every[len(every) - len(got) :], tail
        within = 0 if tail is None else tail
        whole = [line for i, line in enumerate(every)
                 if tail is None or sum(len(x) for x in every[i:]) <= within]  # fmt: skip
        assert len(got) >= len(whole), tail


def test_a_batch_larger_than_the_share_is_split_and_a_span_too_large_is_said(tmp_path, caplog):
    trace_file = TraceFile(tmp_path, 40 * 1024)  # 20 KB a file
    batch = [_span(f"s{i}", size=3000) for i in range(12)]  # ~40 KB as one line
    giant = _span("giant", size=50_000)
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        trace_file.export(batch)
        trace_file.export([giant])
    assert [s.name for _, s in trace_file_spans(tmp_path)] == [f"s{i}" for i in range(12)]
    assert len(_lines(tmp_path)) > 1  # the batch went in parts
    assert trace_file.written == 12 and trace_file.lost == 1
    assert "a span of" in caplog.text and "giant" in caplog.text
    assert "tracing.file_max_mb" in caplog.text


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_costs_the_batch_is_said_once_and_writing_resumes(tmp_path, caplog):
    (tmp_path / FILE_NAME).symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    trace_file = TraceFile(tmp_path, 1 << 20)
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        for i in range(5):
            trace_file.export([_span(f"lost-{i}")])
        (tmp_path / FILE_NAME).unlink()  # space again
        trace_file.export([_span("after")])
    trace_file.shutdown()
    assert [s.name for _, s in trace_file_spans(tmp_path)] == ["after"]
    assert (trace_file.lost, trace_file.written) == (5, 1)
    said = [r.getMessage() for r in caplog.records if "cannot write spans" in r.getMessage()]
    assert len(said) == 1 and "disk is full" in said[0]
    assert any("written to" in r.getMessage() and "again" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def _fork_child_times(logger: Logger, seconds: float) -> None:
    with logger.timer("in-the-child"):  # a timer of the inherited Logger, on its provider
        pass
    time.sleep(seconds)  # the span processor's thread, started again in the child, exports


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_a_fork_child_writes_nothing_to_the_parent_s_trace_file(tmp_path):
    log_dir = tmp_path / "run"
    logger = Logger({"log_dir": str(log_dir), "tracing": {"enabled": True}})
    with logger.timer("generation"):
        pass
    logger.log_metrics({"x": 1.0}, step=0)
    child = multiprocessing.get_context("fork").Process(
        target=_fork_child_times, args=(logger, 6.0)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    logger.finish()
    assert sorted(s.name for _, s in trace_file_spans(log_dir)) == ["generation", "rl.step"]


def test_a_file_that_ends_in_part_of_a_line_is_mended_before_the_next_line(tmp_path):
    """A crash (or a disk that was full) left half a line: the next launch's first line starts
    on a line of its own, so it is read, and the half line alone is skipped."""
    first = TraceFile(tmp_path, 1 << 20)
    first.export([_span("before")])
    first.shutdown()
    whole = (tmp_path / FILE_NAME).read_bytes()
    (tmp_path / FILE_NAME).write_bytes(whole + whole[: len(whole) // 2])  # a torn second line
    again = TraceFile(tmp_path, 1 << 20)
    again.export([_span("after")])
    again.shutdown()
    lines = (tmp_path / FILE_NAME).read_bytes().split(b"\n")
    assert len(lines) == 4 and lines[-1] == b""  # whole, torn, whole
    parsed = []
    for line in lines[:-1]:
        try:
            parsed.append(JsonRequest.from_json(line))
        except ValueError:
            parsed.append(None)
    assert parsed[1] is None and [
        r.resource_spans[0].scope_spans[0].spans[0].name for r in (parsed[0], parsed[2])
    ] == ["before", "after"]


def test_a_worker_snapshot_s_bad_span_costs_only_itself_and_losses_are_said(tmp_path, caplog):
    """A snapshot whose span has an id out of range, one with a negative start, and a count of
    spans the worker dropped: the good spans are written, the thread that writes them lives on,
    and ``finish()`` says how many spans the file is missing."""
    log_dir = tmp_path / "run"
    logger = Logger({"log_dir": str(log_dir), "tracing": {"enabled": True}})
    worker = WorkerMetrics(rank=1, role="trainer", tracing=True)
    with worker.timer("good"):
        pass
    snapshot = worker.snapshot(step=0)
    (good,) = snapshot["spans"]
    snapshot["spans"] = [good, ("bad", 2**200, 1, 0, 1, 2, {}, {}, ""), ("worse", 1, -5, 0, 1, 2,
                                                                       {}, {}, "")]  # fmt: skip
    snapshot["spans_dropped"] = 5
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        logger.log_worker_metrics([snapshot], step=0)
        with worker.timer("later"):
            pass
        logger.log_worker_metrics([worker.snapshot(step=1)], step=1)
        logger.finish()
    names = sorted(s.name for _, s in trace_file_spans(log_dir) if s.name in ("good", "later"))
    assert names == ["good", "later"]
    said = [r.getMessage() for r in caplog.records if "span(s) are not in" in r.getMessage()]
    # the 5 the worker dropped and the 2 that could not be encoded
    assert len(said) == 1 and said[0].startswith("otel-rl: 7 span(s) are not in")


def test_a_span_running_at_its_snapshot_is_written_once_whole_or_as_it_stood(tmp_path):
    """A worker's span still running when a snapshot is taken (Ray's span around the call that
    returns it) travels in that snapshot as it stands, marked open: the file writes it once,
    whole when a later snapshot brings it, else, at the run's end, as it stood then."""
    log_dir = tmp_path / "run"
    worker = WorkerMetrics(rank=0, role="trainer", tracing=True)
    with Logger({"log_dir": str(log_dir), "tracing": {"enabled": True}}) as logger:
        with worker.timer("call"):
            logger.log_worker_metrics([worker.snapshot(step=0)], step=0)
        with worker.timer("last"):
            logger.log_worker_metrics([worker.snapshot(step=1)], step=1)
            taken = time.time_ns()
    written = [s for _, s in trace_file_spans(log_dir) if s.name in ("call", "last")]
    assert sorted(s.name for s in written) == ["call", "last"]
    for span in written:
        marks = {a.key: a.value.bool_value for a in span.attributes if a.key == "otel_rl.span.open"}
        assert marks == ({"otel_rl.span.open": True} if span.name == "last" else {})
        assert span.start_time_unix_nano < span.end_time_unix_nano <= taken
