"""Timers as OTel spans (opt-in): nesting, attributes, zero spans when off, OTLP export."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_rl import Logger, WorkerMetrics
from tests.otlp_trace_receiver import OtlpTraceReceiver
from tests.readers import jsonl_rows


def capture(provider) -> InMemorySpanExporter:
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return spans


def test_tracing_is_off_by_default_and_timers_still_record(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        assert logger.tracer_provider is None
        timer = logger.timer("gen")
        assert timer._spans is None  # no span machinery at all
        with timer:
            time.sleep(0.002)
        logger.log_metrics({"x": 1.0}, step=0)
    assert jsonl_rows(log_dir / "metrics.jsonl")[0]["metrics"]["timing/gen"] >= 0.002
    assert WorkerMetrics().tracer_provider is None


def test_nested_timers_become_child_spans_with_worker_attributes(log_dir):
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True}, "run_id": "run-7"}
    with Logger(cfg) as logger:
        spans = capture(logger.tracer_provider)
        worker = WorkerMetrics(rank=3, role="actor", tracing=True)
        capture_worker = capture(worker.tracer_provider)

        @logger.timer("reward")
        def score() -> float:
            return 1.0

        with logger.timer("step"):
            with logger.timer("generation"):
                time.sleep(0.005)
            score()
            with worker.timer("forward"):  # another provider, same context: still a child
                pass
        with pytest.raises(RuntimeError), logger.timer("failing"):
            raise RuntimeError("boom")
        logger.log_metrics({"x": 1.0}, step=0)

    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"step", "generation", "reward", "failing"}
    step = by_name["step"]
    assert step.parent is None
    for child in ("generation", "reward"):
        assert by_name[child].parent.span_id == step.context.span_id
        assert by_name[child].context.trace_id == step.context.trace_id
    assert by_name["generation"].end_time - by_name["generation"].start_time >= 5_000_000
    assert step.resource.attributes["otel_rl.run_id"] == "run-7"
    assert by_name["failing"].status.status_code.name == "ERROR"
    assert by_name["failing"].events[0].name == "exception"

    (forward,) = capture_worker.get_finished_spans()
    assert forward.parent.span_id == step.context.span_id
    assert dict(forward.attributes) == {"otel_rl.role": "actor", "otel_rl.rank": 3}
    assert forward.resource.attributes["otel_rl.rank"] == 3
    # the timers still feed their histograms, on the step they ran in
    row = jsonl_rows(log_dir / "metrics.jsonl")[0]["metrics"]
    assert row["timing/generation"] >= 0.005 and "timing/step" in row and "timing/failing" in row


@pytest.mark.slow
def test_spans_reach_an_otlp_http_receiver(log_dir):
    receiver = OtlpTraceReceiver()
    try:
        cfg = {
            "log_dir": str(log_dir),
            "tracing": {"enabled": True},
            "otlp": {"enabled": True, "endpoint": receiver.endpoint},
        }
        with Logger(cfg) as logger:
            with logger.timer("step"), logger.timer("generation"):
                pass
            logger.log_metrics({"x": 1.0}, step=0)
        # finish() shut the BatchSpanProcessor down, which exports what it holds
        assert receiver.wait_for(2, timeout=10)
        spans = {span.name: (resource, span) for resource, span in receiver.spans}
        assert set(spans) == {"step", "generation"}
        (resource, step), (_, generation) = spans["step"], spans["generation"]
        assert generation.parent_span_id == step.span_id and generation.trace_id == step.trace_id
        assert resource["otel_rl.role"] == "driver" and resource["service.name"] == "otel-rl"
    finally:
        receiver.close()
