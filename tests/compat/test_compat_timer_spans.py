"""The drop-ins' timers are spans: NeMo RL's ``Timer`` and verl's ``marked_timer``/``simple_timer``
with ``tracing.enabled``, exported over OTLP/HTTP to a real receiver.

A NeMo RL ``grpo_train``-shaped loop and a verl ``RayPPOTrainer.fit``-shaped loop each give one
trace per step whose span tree is the nesting of their timers, under the step's ``rl.step`` span,
and each span lasts the value its timer logged. On a real local Ray cluster, a worker's timers
continue the driver's trace through the W3C carrier, and a worker that timed a warm-up before the
driver's Logger existed labels its later spans with the run.
"""

from __future__ import annotations

import gc
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from otel_rl import Logger
from otel_rl.compat.nemo_rl import Logger as NemoLogger
from otel_rl.compat.nemo_rl import Timer
from otel_rl.compat.verl import Tracking, marked_timer, simple_timer
from otel_rl.telemetry.tracing import trace_carrier
from testkit.otlp_trace_receiver import OtlpTraceReceiver
from testkit.readers import jsonl_rows

# A span ends exactly its timer's value after it starts (nanoseconds; rows keep float seconds).
TOLERANCE_S = 1e-6
WORK_S = 0.002  # each timed block's work: enough for distinct start times, short for the suite


def duration(span: Any) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9


def step_of(span: Any) -> int | None:
    for attribute in span.attributes:
        if attribute.key == "rl.step":
            return int(attribute.value.int_value)
    return None


def children_of(spans: list[tuple[dict, Any]]) -> dict[bytes, list[tuple[dict, Any]]]:
    children: dict[bytes, list[tuple[dict, Any]]] = defaultdict(list)
    for resource, span in spans:
        children[span.parent_span_id].append((resource, span))
    for siblings in children.values():
        siblings.sort(key=lambda item: item[1].start_time_unix_nano)
    return children


def tree(spans: list[tuple[dict, Any]], root: Any) -> tuple:
    """``(name, (child trees in start order))`` under ``root``."""
    children = children_of(spans)

    def walk(span: Any) -> tuple:
        return (span.name, tuple(walk(child) for _, child in children[span.span_id]))

    return walk(root)


def tree_text(spans: list[tuple[dict, Any]], root: Any) -> str:
    """The tree under ``root`` as indented lines: name, duration, and the process of worker
    spans."""
    children = children_of(spans)
    lines: list[str] = []

    def walk(resource: dict, span: Any, depth: int) -> None:
        step = step_of(span)
        label = f"{span.name} rl.step={step}" if step is not None else span.name
        role = resource.get("otel_rl.role")
        where = f"  [{role}, pid {resource.get('process.pid')}]" if role != "driver" else ""
        lines.append(f"{'    ' * depth}{label}{where}  {duration(span) * 1000:.1f} ms")
        for child_resource, child in children[span.span_id]:
            walk(child_resource, child, depth + 1)

    resource = next(r for r, s in spans if s.span_id == root.span_id)
    walk(resource, root, 0)
    return "\n".join(lines)


def leaf(name: str) -> tuple:
    return (name, ())


def size(node: tuple) -> int:
    return 1 + sum(size(child) for child in node[1])


def step_roots(spans: list[tuple[dict, Any]]) -> dict[int, Any]:
    roots = {step_of(s): s for _, s in spans if s.name == "rl.step"}
    assert all(s.parent_span_id == b"" for s in roots.values())
    return roots


def in_trace(spans: list[tuple[dict, Any]], root: Any) -> list[tuple[dict, Any]]:
    return [(r, s) for r, s in spans if s.trace_id == root.trace_id]


@pytest.fixture
def receiver() -> Iterator[OtlpTraceReceiver]:
    server = OtlpTraceReceiver()
    try:
        yield server
    finally:
        server.close()


def work() -> None:
    time.sleep(WORK_S)


# ---- NeMo RL: grpo_train -----------------------------------------------------------------------


def grpo_step(timer: Timer, logger: NemoLogger, step: int, save: bool) -> None:
    """One step of NeMo RL's ``grpo_train``, its timers where grpo.py has them."""
    with timer.time("total_step_time"):
        with timer.time("data_processing"):
            work()
        # refit_policy_generation(..., timer=timer) times moving the weights to the generation
        # workers inside the preparation
        with (
            timer.time("prepare_for_generation/total"),
            timer.time("prepare_for_generation/transfer_and_update_weights"),
        ):
            work()
        with timer.time("generation"):
            work()
            logger.log_metrics({"mean_gen_tokens_per_sample": 64.0 + step}, step, prefix="train")
        with timer.time("reward_calculation"):
            work()
        with timer.time("logprob_inference_prep"):
            work()
        with timer.time("policy_and_reference_logprobs"):
            work()
        with timer.time("advantage_calculation"):
            work()
        with timer.time("training_prep"):
            work()
        with timer.time("policy_training"):
            work()
        if save:
            with timer.time("checkpointing"):
                work()


def grpo_tree(save: bool) -> tuple:
    work_timers = (
        leaf("data_processing"),
        ("prepare_for_generation/total", (
            leaf("prepare_for_generation/transfer_and_update_weights"),
        )),
        leaf("generation"),
        leaf("reward_calculation"),
        leaf("logprob_inference_prep"),
        leaf("policy_and_reference_logprobs"),
        leaf("advantage_calculation"),
        leaf("training_prep"),
        leaf("policy_training"),
    ) + ((leaf("checkpointing"),) if save else ())  # fmt: skip
    return ("rl.step", (("total_step_time", work_timers),))


def test_nemo_rl_grpo_steps_are_one_trace_each_shaped_like_their_timers(tmp_path, receiver, capsys):
    cfg = {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": True,
        "run_id": "grpo-run",
        "tracing": {"enabled": True},
        "otlp": {"enabled": True, "endpoint": receiver.endpoint},
    }
    logger = NemoLogger(cfg)
    timer = Timer(context={"worker": "driver"})
    steps = {1: False, 2: True}  # checkpoint at step 2 (save_period 2)
    for step, save in steps.items():
        grpo_step(timer, logger, step, save)
        logger.log_metrics({"loss": 1.0 / step}, step, prefix="train")
        logger.log_metrics(
            timer.get_timing_metrics(reduction_op="sum"), step, prefix="timing/train",
            step_finished=True,
        )  # fmt: skip
        timer.reset()
    logger.finish()  # the batch span processor exports what it holds

    n_spans = sum(size(grpo_tree(save)) for save in steps.values())
    assert receiver.wait_for(n_spans, timeout=10), [s.name for _, s in receiver.spans]
    spans = list(receiver.spans)
    rows = {row["step"]: row["metrics"] for row in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")}
    roots = step_roots(spans)
    assert sorted(roots) == [1, 2]
    for step, save in steps.items():
        root, row = roots[step], rows[step]
        trace = in_trace(spans, root)
        assert tree(trace, root) == grpo_tree(save)
        assert row["trace_id"] == root.trace_id.hex()  # the row leads to its trace
        timed = [s for _, s in trace if s.name != "rl.step"]
        # every timer's span lasts the value logged for it (each label ran once per step)
        assert {s.name: duration(s) for s in timed} == pytest.approx(
            {s.name: row[f"timing/train/{s.name}"] for s in timed}, abs=TOLERANCE_S
        )
        assert all(r["otel_rl.run_id"] == "grpo-run" for r, _ in trace)
        if save:
            with capsys.disabled():
                print(f"\nNeMo RL GRPO step {step} (trace {root.trace_id.hex()}):")
                print(tree_text(trace, root))
    # spans never leak into the values: the timing row is NeMo RL's, and nothing else
    assert sorted(k for k in rows[1] if k.startswith("timing/")) == sorted(
        f"timing/train/{name}" for name in grpo_labels(False)
    )


def grpo_labels(save: bool) -> list[str]:
    names: list[str] = []

    def walk(node: tuple) -> None:
        if node[0] != "rl.step":
            names.append(node[0])
        for child in node[1]:
            walk(child)

    walk(grpo_tree(save))
    return names


def test_nemo_rl_timer_start_stop_nests_and_records_failures(tmp_path):
    """``start``/``stop`` intervals nest as they overlap, even stopped out of order; a block
    that raises is recorded and its span marked failed; ``record`` adds no span; a label reset
    while running leaves no span and no context behind."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    with Logger({"log_dir": str(tmp_path), "tracing": {"enabled": True}}) as logger:
        spans = InMemorySpanExporter()
        logger.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        timer = Timer()
        timer.start("idle/refit_bubble")
        timer.start("weight_sync")
        with timer.time("exposed_generation"):
            work()
        timer.stop("idle/refit_bubble")  # out of order: weight_sync still runs
        with timer.time("after"):
            pass
        timer.stop("weight_sync")
        with pytest.raises(RuntimeError), timer.time("failing"):
            raise RuntimeError("boom")
        timer.record("measured_elsewhere", 0.5)
        timer.start("abandoned")
        timer.reset("abandoned")
        assert not trace.get_current_span().get_span_context().is_valid
        logger.log_metrics({"x": 1.0}, step=0)
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {
        "rl.step", "idle/refit_bubble", "weight_sync", "exposed_generation", "after", "failing",
    }  # fmt: skip

    def parent(name: str) -> str:
        parent_id = finished[name].parent.span_id
        return next(n for n, s in finished.items() if s.context.span_id == parent_id)

    assert parent("idle/refit_bubble") == "rl.step" and parent("failing") == "rl.step"
    assert parent("weight_sync") == "idle/refit_bubble"
    assert parent("exposed_generation") == "weight_sync"
    assert parent("after") == "weight_sync"
    assert finished["failing"].status.status_code.name == "ERROR"
    assert finished["failing"].events[0].name == "exception"
    for name in ("idle/refit_bubble", "weight_sync", "exposed_generation", "failing"):
        span = finished[name]
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(
            timer.get_latest_elapsed(name), abs=TOLERANCE_S
        )


def test_nemo_rl_thread_safe_timer_spans_nest_per_thread(tmp_path):
    """NeMo RL's ``ThreadSafeTimer``, shared by the training thread and a rollout thread (its
    async GRPO's shape): each thread's blocks nest in that thread's own spans, both under the
    step's ``rl.step``, and every span lasts what the timer logged for its label."""
    import threading

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_rl.compat.nemo_rl import ThreadSafeTimer

    with Logger({"log_dir": str(tmp_path), "tracing": {"enabled": True}}) as logger:
        spans = InMemorySpanExporter()
        logger.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        timer = ThreadSafeTimer()

        def rollout() -> None:
            with timer.time("async_rollout"), timer.time("async_rollout/generate"):
                work()

        with timer.time("train_step"):
            thread = threading.Thread(target=rollout)
            thread.start()
            with timer.time("policy_training"):
                work()
            thread.join()
        logger.log_metrics({"x": 1.0}, step=0)
    finished = {s.name: s for s in spans.get_finished_spans()}

    def parent(name: str) -> str:
        parent_id = finished[name].parent.span_id
        return next(n for n, s in finished.items() if s.context.span_id == parent_id)

    assert set(finished) == {
        "rl.step", "train_step", "policy_training", "async_rollout", "async_rollout/generate",
    }  # fmt: skip
    assert parent("train_step") == "rl.step" and parent("async_rollout") == "rl.step"
    assert parent("policy_training") == "train_step"
    assert parent("async_rollout/generate") == "async_rollout"
    for name in set(finished) - {"rl.step"}:
        span = finished[name]
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(
            timer.get_latest_elapsed(name), abs=TOLERANCE_S
        )


def test_timers_without_a_traced_logger_make_no_spans(tmp_path):
    from opentelemetry import trace

    from otel_rl.telemetry import timing

    gc.collect()  # Loggers of earlier tests, dropped unfinished, are gone
    assert timing.ambient_tracer() is None
    timer, timing_raw = Timer(), {}
    with Logger({"log_dir": str(tmp_path)}):  # tracing off
        assert timing.ambient_tracer() is None
        with timer.time("generation"), marked_timer("gen", timing_raw):
            assert not trace.get_current_span().get_span_context().is_valid
    assert timer._spans == {} and timing_raw["gen"] > 0
    with Logger({"log_dir": str(tmp_path), "tracing": {"enabled": True}}) as traced:
        assert timing.ambient_tracer() is traced._run.step_spans.tracer
    assert timing.ambient_tracer() is None  # a finished Logger takes no more spans


# ---- verl: RayPPOTrainer.fit -------------------------------------------------------------------


def timing_metrics(timing_raw: dict[str, float]) -> dict[str, float]:
    """The seconds part of verl's ``compute_timing_metrics``: one ``timing_s/<name>`` per entry."""
    return {f"timing_s/{name}": value for name, value in timing_raw.items()}


def ppo_step(timing_raw: dict[str, float], test_step: bool) -> None:
    """One step of verl's ``fit()`` (GRPO: no critic, no reference worker), its timers where
    ray_trainer.py has them."""
    with marked_timer("start_profile", timing_raw):
        pass
    with marked_timer("step", timing_raw):
        with marked_timer("gen", timing_raw, color="red"):
            work()
        with marked_timer("reward", timing_raw, color="yellow"):
            work()
        with marked_timer("old_log_prob", timing_raw, color="blue"):
            work()
        with marked_timer("adv", timing_raw, color="brown"):
            work()
        with marked_timer("update_actor", timing_raw, color="red"):
            work()
    if test_step:
        with marked_timer("testing", timing_raw, color="green"):
            work()
    with marked_timer("stop_profile", timing_raw):
        pass


def ppo_tree(test_step: bool) -> tuple:
    phases = ("gen", "reward", "old_log_prob", "adv", "update_actor")
    update = ("step", tuple(leaf(name) for name in phases))
    return ("rl.step", (
        leaf("start_profile"), update, *((leaf("testing"),) if test_step else ()),
        leaf("stop_profile"),
    ))  # fmt: skip


def test_verl_ppo_steps_are_one_trace_each_shaped_like_their_timers(tmp_path, receiver, capsys,
                                                                    monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl.jsonl"))
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(tmp_path / "otel"))
    config = {
        "trainer": {"project_name": "gsm8k", "experiment_name": "grpo", "test_freq": 2},
        "otel_rl": {
            "run_id": "ppo-run",
            "tracing": {"enabled": True},
            "otlp": {"enabled": True, "endpoint": receiver.endpoint},
        },
    }
    tracking = Tracking(project_name="gsm8k", experiment_name="grpo", default_backend=["file"],
                        config=config)  # fmt: skip
    logged: dict[int, dict[str, float]] = {}
    for global_steps in (1, 2):
        metrics: dict[str, float] = {}
        timing_raw: dict[str, float] = {}
        ppo_step(timing_raw, test_step=global_steps % 2 == 0)
        metrics.update({"training/global_step": global_steps, "actor/pg_loss": 0.1})
        metrics.update(timing_metrics(timing_raw))
        tracking.log(data=metrics, step=global_steps)
        logged[global_steps] = timing_raw
    tracking.finish()

    expected = {step: ppo_tree(step % 2 == 0) for step in logged}
    n_spans = sum(1 + len(timing) for timing in logged.values())  # rl.step + one per timer
    assert receiver.wait_for(n_spans, timeout=10), [s.name for _, s in receiver.spans]
    spans = list(receiver.spans)
    roots = step_roots(spans)
    assert sorted(roots) == [1, 2]
    lines = {row["step"]: row["data"] for row in jsonl_rows(tmp_path / "verl.jsonl")}
    for step, root in roots.items():
        trace = in_trace(spans, root)
        assert tree(trace, root) == expected[step]
        timed = [s for _, s in trace if s.name != "rl.step"]
        # a span lasts what its block added to timing_raw, which verl logs as timing_s/<name>
        assert {s.name: duration(s) for s in timed} == pytest.approx(logged[step], abs=TOLERANCE_S)
        assert {s.name: duration(s) for s in timed} == pytest.approx(
            {s.name: lines[step][f"timing_s/{s.name}"] for s in timed}, abs=TOLERANCE_S
        )
        assert all(r["otel_rl.run_id"] == "ppo-run" for r, _ in trace)
        if step == 2:
            with capsys.disabled():
                print(f"\nverl PPO step {step} (trace {root.trace_id.hex()}):")
                print(tree_text(trace, root))


def test_verl_helpers_keep_verls_values():
    """``simple_timer``/``marked_timer`` add into ``timing_raw`` like verl's, with or without a
    Logger: repeated names add up, a block that raises adds nothing, verl's marker arguments
    are accepted."""
    timing_raw: dict[str, float] = {"gen": 1.0}
    with simple_timer("gen", timing_raw):
        work()
    with marked_timer("adv", timing_raw, color="brown", domain="verl", category="ppo"):
        work()
    with marked_timer("adv", timing_raw):
        work()
    with pytest.raises(ValueError), marked_timer("failing", timing_raw):
        raise ValueError("boom")
    assert set(timing_raw) == {"gen", "adv"}
    assert timing_raw["gen"] >= 1.0 + WORK_S and timing_raw["adv"] >= 2 * WORK_S


# ---- Ray actors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def make_worker_class(ray):
    # Defined inside a function so that Ray ships the class by value to its workers.
    class PolicyWorker:
        """A NeMo RL policy worker: its own ``Timer`` and ``WorkerMetrics`` timers.

        ``hook`` runs ``otel_rl.ray.tracing.setup`` in this worker process, as Ray does in every
        worker of a cluster started with ``_tracing_startup_hook="otel_rl.ray.tracing:setup"``
        (called here, in the worker only: in the test process it would install a global tracer
        provider for every later test). Without it, the worker exports with its own ``otlp``.
        """

        def __init__(self, endpoint: str, hook: bool, rank: int) -> None:
            from otel_rl import WorkerMetrics
            from otel_rl.compat.nemo_rl import Timer

            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
            if hook:
                from otel_rl.ray.tracing import setup

                setup()
                self.metrics = WorkerMetrics(rank=rank, role="policy")
            else:
                self.metrics = WorkerMetrics(
                    rank=rank, role="policy", tracing=True, otlp={"endpoint": endpoint}
                )
            self.timer = Timer(context={"worker": "policy", "rank": rank})

        def warm_up(self) -> float:
            with self.metrics.timer("warm_up"):
                time.sleep(WORK_S)
            return self.metrics.snapshot()["timings"]["timing/warm_up"][0]

        def train(self, carrier: dict[str, str]) -> dict[str, Any]:
            from otel_rl.telemetry.tracing import use_trace_carrier

            with (
                use_trace_carrier(carrier),
                self.timer.time("train_step"),
                self.metrics.timer("forward_backward"),
            ):
                time.sleep(WORK_S)
            timing = self.timer.get_timing_metrics(reduction_op="sum")
            self.timer.reset()
            return {"timing": timing, "metrics": self.metrics.snapshot()}

        def update_actor(self, carrier: dict[str, str]) -> dict[str, float]:
            """verl's worker side: ``marked_timer``/``simple_timer`` into a ``timing_raw``."""
            from otel_rl import use_trace_carrier
            from otel_rl.compat.verl import marked_timer, simple_timer

            timing_raw: dict[str, float] = {}
            with (
                use_trace_carrier(carrier),
                marked_timer("update_policy", timing_raw),
                simple_timer("forward_backward", timing_raw),
            ):
                time.sleep(WORK_S)
            return timing_raw

        def heartbeat(self) -> None:
            with self.metrics.timer("heartbeat"):  # called outside any driver timer: no context
                pass

        def flush(self) -> bool:
            return bool(self.metrics.tracer_provider.force_flush())

    return ray.remote(num_cpus=0)(PolicyWorker)


@pytest.mark.slow
def test_a_worker_timer_in_a_ray_actor_is_a_child_of_the_drivers_compat_timer(
    ray_cluster, tmp_path, receiver, capsys
):
    ray = ray_cluster
    worker = make_worker_class(ray).remote(receiver.endpoint, True, 0)
    cfg = {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": True,
        "run_id": "ray-grpo",
        "tracing": {"enabled": True},
        "otlp": {"enabled": True, "endpoint": receiver.endpoint},
    }
    logger = NemoLogger(cfg)
    timer = Timer(context={"worker": "driver"})
    try:
        for step in (1, 2):
            with timer.time("total_step_time"), timer.time("policy_training"):
                result = ray.get(worker.train.remote(trace_carrier()))
            logger.log_metrics(result["timing"], step, prefix="timing/policy")
            logger.core.log_worker_metrics([result["metrics"]], step, prefix="policy")
            logger.log_metrics(
                timer.get_timing_metrics(reduction_op="sum"), step, prefix="timing/train",
                step_finished=True,
            )  # fmt: skip
            timer.reset()
        logger.finish()
        assert ray.get(worker.flush.remote())
        # per step: rl.step, 2 driver timers, 2 worker timers
        assert receiver.wait_for(10, timeout=30), [s.name for _, s in receiver.spans]
    finally:
        ray.kill(worker)
    spans = list(receiver.spans)
    rows = {row["step"]: row["metrics"] for row in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")}
    roots = step_roots(spans)
    assert sorted(roots) == [1, 2]
    for step, root in roots.items():
        trace = in_trace(spans, root)
        assert tree(trace, root) == (
            "rl.step", (("total_step_time", (("policy_training", (
                ("train_step", (leaf("forward_backward"),)),
            )),)),),
        )  # fmt: skip
        by_name = {s.name: (r, s) for r, s in trace}
        driver_pid = by_name["policy_training"][0]["process.pid"]
        for name in ("train_step", "forward_backward"):
            resource, _ = by_name[name]
            assert resource["process.pid"] != driver_pid  # made in the actor
            assert resource["otel_rl.run_id"] == "ray-grpo"  # the driver's run, from baggage
        # the Timer's span names the worker process; the WorkerMetrics one also its role and rank
        assert by_name["train_step"][0]["otel_rl.role"] == "ray-worker"
        assert by_name["forward_backward"][0]["otel_rl.role"] == "policy"
        assert by_name["forward_backward"][0]["otel_rl.rank"] == 0
        row = rows[step]
        assert duration(by_name["train_step"][1]) == pytest.approx(
            row["timing/policy/train_step"], abs=TOLERANCE_S
        )
        assert duration(by_name["forward_backward"][1]) == pytest.approx(
            row["policy/timing/forward_backward"], abs=TOLERANCE_S
        )
        assert duration(by_name["policy_training"][1]) == pytest.approx(
            row["timing/train/policy_training"], abs=TOLERANCE_S
        )
        if step == 2:
            with capsys.disabled():
                print(f"\nNeMo RL step {step} across a Ray actor (trace {root.trace_id.hex()}):")
                print(tree_text(trace, root))


@pytest.mark.slow
def test_verl_timers_in_a_ray_actor_continue_the_drivers_marked_timer(
    ray_cluster, tmp_path, receiver, monkeypatch
):
    """verl's ``marked_timer``/``simple_timer`` inside a Ray actor, given the driver's carrier:
    their spans are children of the driver's ``marked_timer("update_actor")`` span in the step's
    trace, made in the actor's process, and last what the actor's ``timing_raw`` holds."""
    ray = ray_cluster
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(tmp_path / "otel"))
    worker = make_worker_class(ray).remote(receiver.endpoint, True, 0)
    config = {"trainer": {"project_name": "gsm8k", "experiment_name": "ppo"},
              "otel_rl": {"run_id": "verl-ray", "tracing": {"enabled": True},
                          "otlp": {"enabled": True, "endpoint": receiver.endpoint}}}  # fmt: skip
    tracking = Tracking("gsm8k", "ppo", default_backend=["console"], config=config)
    worker_timing: dict[int, dict[str, float]] = {}
    try:
        for step in (1, 2):
            timing_raw: dict[str, float] = {}
            with marked_timer("step", timing_raw), marked_timer("update_actor", timing_raw):
                worker_timing[step] = ray.get(worker.update_actor.remote(trace_carrier()))
            tracking.log(data={f"timing_s/{k}": v for k, v in timing_raw.items()}, step=step)
        tracking.finish()
        assert ray.get(worker.flush.remote())
        # per step: rl.step, 2 driver timers, 2 worker timers
        assert receiver.wait_for(10, timeout=30), [s.name for _, s in receiver.spans]
    finally:
        ray.kill(worker)
    spans = list(receiver.spans)
    roots = step_roots(spans)
    assert sorted(roots) == [1, 2]
    for step, root in roots.items():
        trace = in_trace(spans, root)
        assert tree(trace, root) == (
            "rl.step", (("step", (("update_actor", (
                ("update_policy", (leaf("forward_backward"),)),
            )),)),),
        )  # fmt: skip
        by_name = {s.name: (r, s) for r, s in trace}
        driver_pid = by_name["update_actor"][0]["process.pid"]
        for name in ("update_policy", "forward_backward"):
            resource, span = by_name[name]
            assert resource["process.pid"] != driver_pid  # made in the actor
            assert resource["otel_rl.run_id"] == "verl-ray"
            assert duration(span) == pytest.approx(worker_timing[step][name], abs=TOLERANCE_S)


@pytest.mark.slow
def test_a_worker_warmed_up_before_the_run_labels_its_later_spans_with_the_run(
    ray_cluster, tmp_path, receiver
):
    """Two actors time a warm-up before the driver's Logger exists: one traced by the Ray hook,
    one by its own ``otlp``. Their spans of the run's calls, and later ones outside any call,
    carry the run id; the warm-up's, made before the run existed, carry none."""
    ray = ray_cluster
    worker_class = make_worker_class(ray)
    workers = {
        "hook": worker_class.remote(receiver.endpoint, True, 0),
        "otlp": worker_class.remote(receiver.endpoint, False, 1),
    }
    try:
        warm = ray.get([w.warm_up.remote() for w in workers.values()])
        assert all(seconds >= WORK_S for seconds in warm)
        cfg = {
            "log_dir": str(tmp_path / "logs"),
            "run_id": "run-after-warmup",
            "tracing": {"enabled": True},
            "otlp": {"enabled": True, "endpoint": receiver.endpoint},
        }
        with Logger(cfg) as logger:
            with logger.timer("train"):
                carrier = trace_carrier()
                ray.get([w.train.remote(carrier) for w in workers.values()])
            ray.get([w.heartbeat.remote() for w in workers.values()])
            logger.log_metrics({"loss": 0.5}, step=0)
        assert all(ray.get([w.flush.remote() for w in workers.values()]))
        # driver: rl.step, train; each worker: warm_up, forward_backward, heartbeat, and the
        # hook's worker the span of its Timer's train_step (without the hook, no Logger in the
        # process: that Timer makes no span)
        assert receiver.wait_for(2 + 3 * len(workers) + 1, timeout=30)
    finally:
        for w in workers.values():
            ray.kill(w)
    spans = list(receiver.spans)
    by_id = {s.span_id: (r, s) for r, s in spans}
    (driver_train,) = [s for r, s in spans if s.name == "train" and r["otel_rl.role"] == "driver"]
    for rank in (0, 1):
        mine = {
            s.name: (r, s)
            for r, s in spans
            if r.get("otel_rl.role") == "policy" and r["otel_rl.rank"] == rank
        }
        assert set(mine) == {"warm_up", "forward_backward", "heartbeat"}
        assert "otel_rl.run_id" not in mine["warm_up"][0]  # no run existed yet
        for name in ("forward_backward", "heartbeat"):
            assert mine[name][0]["otel_rl.run_id"] == "run-after-warmup", (rank, name)
        # the run's call continues the driver's trace, under the driver's timer
        _, forward = mine["forward_backward"]
        assert forward.trace_id == driver_train.trace_id
        parent_resource, parent = by_id[forward.parent_span_id]
        if rank == 0:
            assert parent.name == "train_step"
            assert parent_resource["otel_rl.run_id"] == "run-after-warmup"
            assert parent.parent_span_id == driver_train.span_id
        else:
            assert parent is driver_train
