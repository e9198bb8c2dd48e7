"""Timers as OTel spans (opt-in): nesting, attributes, zero spans when off, OTLP export."""

from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_rl import Logger, WorkerMetrics
from otel_rl.telemetry.timing import PhaseTimer
from testkit.otlp_trace_receiver import OtlpTraceReceiver
from testkit.readers import jsonl_rows


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
    # the outermost timers hang under the rl.step span of the step their values land in
    (root,) = [s for s in spans.get_finished_spans() if s.name == "rl.step"]
    assert root.attributes["rl.step"] == 0
    assert set(by_name) - {"rl.step"} == {"step", "generation", "reward", "failing"}
    step = by_name["step"]
    assert step.parent.span_id == root.context.span_id
    assert by_name["failing"].parent.span_id == root.context.span_id
    for child in ("generation", "reward"):
        assert by_name[child].parent.span_id == step.context.span_id
        assert by_name[child].context.trace_id == step.context.trace_id
    assert by_name["generation"].end_time - by_name["generation"].start_time >= 5_000_000
    assert step.resource.attributes["otel_rl.run_id"] == "run-7"
    assert by_name["failing"].status.status_code.name == "ERROR"
    assert by_name["failing"].events[0].name == "exception"

    (forward,) = capture_worker.get_finished_spans()
    assert forward.parent.span_id == step.context.span_id
    assert dict(forward.attributes) == {
        "otel_rl.role": "actor", "otel_rl.rank": 3,
        # the thread it ran on: the timeline's lane (docs/timeline.md)
        "thread.id": threading.get_ident(), "thread.name": threading.current_thread().name,
    }  # fmt: skip
    assert forward.resource.attributes["otel_rl.rank"] == 3
    # the timers still feed their histograms, on the step they ran in
    row = jsonl_rows(log_dir / "metrics.jsonl")[0]["metrics"]
    assert row["timing/generation"] >= 0.005 and "timing/step" in row and "timing/failing" in row
    # and the row names its step's trace
    assert row["trace_id"] == format(root.context.trace_id, "032x")


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
        assert set(spans) - {"rl.step"} == {"step", "generation"}
        (resource, step), (_, generation) = spans["step"], spans["generation"]
        assert generation.parent_span_id == step.span_id and generation.trace_id == step.trace_id
        assert resource["otel_rl.role"] == "driver" and resource["service.name"] == "otel-rl"
    finally:
        receiver.close()


# ---- rl.step spans: the Logger's calls (take at each log_metrics, seal with the row) ----------


def step_spans_setup():
    from opentelemetry.sdk.trace import TracerProvider

    from otel_rl.telemetry.tracing import StepSpans

    provider = TracerProvider()
    spans = capture(provider)
    steps = StepSpans(provider, run_id="run-9")
    timer = PhaseTimer(lambda timing: None, "timing/gen", "gen", steps.tracer)
    return steps, spans, timer


def step_of(span):
    return span.attributes.get("rl.step")


def test_timers_between_log_calls_are_children_of_the_step_their_value_lands_in():
    """The README loop (timers, then log_metrics, no step_finished): the row of step N is sealed
    by the call for N+1, after N+1's timers ran; those timers belong to N+1, and so do spans."""
    steps, spans, timer = step_spans_setup()
    trace_ids = {}
    for step in range(3):
        with timer, timer:  # nested: the inner one stays under the outer one
            pass
        if step > 0:  # log_metrics(step) seals the previous step first, then takes
            trace_ids[step - 1] = steps.seal(step - 1)
        steps.take(step)
    trace_ids[2] = steps.seal(2, final=True)  # finish()

    finished = spans.get_finished_spans()
    roots = {step_of(s): s for s in finished if s.name == "rl.step"}
    assert sorted(roots) == [0, 1, 2]
    for step, root in roots.items():
        assert root.parent is None
        assert format(root.context.trace_id, "032x") == trace_ids[step]
        in_trace = [s for s in finished if s.context.trace_id == root.context.trace_id]
        outer, inner = sorted((s for s in in_trace if s.name == "gen"), key=lambda s: s.start_time)
        assert outer.parent.span_id == root.context.span_id
        assert inner.parent.span_id == outer.context.span_id
    # consecutive steps tile the timeline: a step starts when the previous one's call returned
    assert roots[1].start_time == roots[0].end_time and roots[2].start_time == roots[1].end_time


def test_one_step_logged_in_several_calls():
    steps, spans, timer = step_spans_setup()
    with timer:
        pass
    steps.take(5)
    steps.take(5)  # a second call with nothing timed between: the same span, extended
    with timer:  # a timer between two calls of one step: a second span, linked to the first
        pass
    steps.take(5)
    trace_id = steps.seal(5)
    roots = [s for s in spans.get_finished_spans() if s.name == "rl.step"]
    assert [step_of(s) for s in roots] == [5, 5]
    first, second = sorted(roots, key=lambda s: s.start_time)
    assert format(first.context.trace_id, "032x") == trace_id
    assert [link.context.span_id for link in second.links] == [first.context.span_id]


def test_a_step_without_timers_still_has_its_span_and_an_application_span_keeps_its_children():
    from opentelemetry.sdk.trace import TracerProvider

    steps, spans, timer = step_spans_setup()
    steps.take(0)
    assert steps.seal(0) is not None
    app = TracerProvider().get_tracer("app")
    with app.start_as_current_span("app-span") as outer, timer:
        pass
    steps.take(1)
    steps.seal(1)
    (gen,) = [s for s in spans.get_finished_spans() if s.name == "gen"]
    assert gen.parent.span_id == outer.get_span_context().span_id
    assert [step_of(s) for s in spans.get_finished_spans() if s.name == "rl.step"] == [0, 1]
    assert steps.seal(2) is None  # nothing opened a span for it


def test_the_run_id_travels_as_baggage_and_builds_the_worker_resource():
    """In a worker where the Ray hook ran, WorkerMetrics traces with no argument and learns the
    run id from the driver's baggage (in one process here; across Ray in test_ray_tracing)."""
    from otel_rl.telemetry import tracing

    _, spans, timer = step_spans_setup()
    forwarded = InMemorySpanExporter()
    tracing.install_hook(SimpleSpanProcessor(forwarded), None)
    try:
        worker = WorkerMetrics(rank=1, role="rollout")
        with timer:
            carrier = tracing.trace_carrier()
        with tracing.use_trace_carrier(carrier), worker.timer("decode"):
            time.sleep(0.001)
        worker.close()
    finally:
        tracing._hook.clear()
    assert carrier["traceparent"].startswith("00-") and "otel_rl.run_id=run-9" in carrier["baggage"]
    (decode,) = forwarded.get_finished_spans()
    (gen,) = [s for s in spans.get_finished_spans() if s.name == "gen"]
    assert decode.parent.span_id == gen.context.span_id
    assert decode.resource.attributes["otel_rl.run_id"] == "run-9"
    assert decode.resource.attributes["otel_rl.role"] == "rollout"
    assert decode.resource.attributes["service.name"] == "otel-rl"
    snap = worker.snapshot()
    assert snap["timings"]["timing/decode"][0] * 1e9 == pytest.approx(
        decode.end_time - decode.start_time, abs=1
    )  # the span lasts exactly the timer's value


def test_bad_carriers_and_a_bad_exporter_setting_are_refused_or_documented(monkeypatch):
    from otel_rl.core.errors import ConfigError
    from otel_rl.ray.tracing import setup
    from otel_rl.telemetry import tracing

    with pytest.raises(TypeError, match="mapping of W3C headers"), tracing.use_trace_carrier("0"):
        pass
    worker = WorkerMetrics(tracing=True)
    spans = capture(worker.tracer_provider)
    with tracing.use_trace_carrier({"traceparent": "garbage"}), worker.timer("x"):
        pass  # documented: no valid parent, the span starts its own trace
    assert spans.get_finished_spans()[0].parent is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        setup()
    assert not tracing.hook_active()


def test_an_application_key_named_trace_id_is_kept_and_said_once(log_dir, caplog):
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True}}
    with caplog.at_level("WARNING", logger="otel_rl"), Logger(cfg) as logger:
        for step in range(3):
            with logger.timer("gen"):
                pass
            logger.log_metrics({"trace_id": f"app-{step}", "x": 1.0}, step=step)
        logger.log_metrics({"x": 2.0}, step=3)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["metrics"]["trace_id"] for r in rows[:3]] == ["app-0", "app-1", "app-2"]
    assert len(rows[3]["metrics"]["trace_id"]) == 32  # the step's own trace id where free
    warnings = [r.getMessage() for r in caplog.records if "'trace_id'" in r.getMessage()]
    assert len(warnings) == 1
