"""When a run stops moving: the stall watchdog, its report, and everyone who hears of it.

Real parts throughout: a Logger with JSONL, TensorBoard and Prometheus (its page read over HTTP),
a real OTLP/HTTP receiver for the log records, and a local Ray cluster (with its dashboard, for
the state API) whose blocked actor is read with py-spy.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.watch.stalls import StallWatchdog, nccl_flight_recorder, stall_threshold
from testkit.gpu_nodes import render, simulated_node
from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of
from testkit.readers import jsonl_rows, tensorboard_accumulator
from testkit.rollout_pages import PageServer
from testkit.waiting import wait_for


def _gauge(url: str, name: str) -> float:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    line = next(ln for ln in page.splitlines() if ln.split("{")[0].split(" ")[0] == name)
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow
def test_a_run_blocked_inside_a_timer_is_reported_with_the_timer_and_the_line(tmp_path):
    receiver = OtlpHttpReceiver()
    log_dir = tmp_path / "logs"
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "prometheus": {"enabled": True, "port": 0},
        "otlp": {"enabled": True, "endpoint": receiver.endpoint, "interval": 60},
        "stalls": {"after": 2, "factor": 5},
    }
    seen: dict = {}
    try:
        logger = Logger(cfg)
        for step in range(20):
            with logger.timer("step"):
                time.sleep(0.1)
            logger.log_metrics({"loss": step / 10}, step=step)
        url = logger.prometheus_url
        assert _gauge(url, "otel_rl_stalled") == 0

        def block_inside_generation_for_the_stall_test() -> None:
            with logger.timer("generation"):
                began = time.monotonic()
                reports = wait_for(lambda: sorted((log_dir / "stalls").glob("*.txt")), 10,
                                    "a stall report")  # fmt: skip
                seen["after"] = time.monotonic() - began
                seen["report"] = reports[0]
                seen["stalled"] = _gauge(url, "otel_rl_stalled")
                seen["since"] = _gauge(url, "otel_rl_seconds_since_step")

        block_inside_generation_for_the_stall_test()
        logger.log_metrics({"loss": 2.0}, step=20)
        logger.log_metrics({"loss": 2.1}, step=21)
        assert wait_for(lambda: _gauge(url, "otel_rl_stalled") == 0, 5, "the gauge back at 0")
        logger.finish()
    finally:
        receiver.close()

    assert seen["after"] < 5  # the threshold is 2 s: max(after 2, 5 x 0.1 s)
    assert seen["stalled"] == 1 and seen["since"] >= 2
    text = seen["report"].read_text()
    assert "open timers (outermost first):" in text
    assert "MainThread: generation" in text
    assert "block_inside_generation_for_the_stall_test" in text  # the driver's stack, that line
    assert "last step: 19" in text
    assert "TORCH_NCCL" in text or "torch" in text  # why there is no flight recorder dump
    assert "stall ended: steps resumed after" in text  # written once the next step came
    report = json.loads(seen["report"].with_suffix(".json").read_text())
    assert report["last_step"] == 19
    assert report["open_timers"]["MainThread"][0]["name"] == "generation"
    assert report["ended"]["seconds"] >= 2
    assert report["nccl_flight_recorder"]["available"] is False

    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert "stall/seconds" not in rows[19]
    assert rows[20]["stall/seconds"] == pytest.approx(report["ended"]["seconds"], abs=0.01)
    assert rows[20]["stall/seconds"] >= 2
    assert "stall/seconds" not in rows[21]

    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["level"]) for e in events] == [
        ("otel_rl/stall", "warning"), ("otel_rl/stall", "info"),
    ]  # fmt: skip
    assert events[0]["step"] == 19 and str(seen["report"]) in events[0]["text"]
    assert "stall ended" in events[1]["text"]
    texts = tensorboard_accumulator(log_dir / "tensorboard").Tags()["tensors"]
    assert any("otel_rl/stall" in tag for tag in texts)
    logs = [(res, rec) for res, rec in receiver.logs if rec.event_name == "otel_rl/stall"]
    assert len(logs) == 2
    resource, first = logs[0]
    assert resource["otel_rl.run_id"] == logger.run_id
    assert "stalled" in first.body.string_value and first.severity_text == "WARN"
    assert attributes_of(first.attributes)["otel_rl.stall.report"] == str(seen["report"])


def test_a_stall_report_has_the_last_gpu_readings_of_every_node(tmp_path):
    """With the GPU bridge on, the report shows each node's last utilisation and memory per GPU
    (read from an 8 x H100 node's Ray page), next to the stacks: a collective stuck at 100 % or
    a GPU idle at 0 % is visible in the same file."""
    node = simulated_node(3)
    server = PageServer(render(node))
    host, port = server.httpd.server_address[:2]
    log_dir = tmp_path / "logs"
    cfg = {
        "log_dir": str(log_dir),
        "monitor_gpus": True,
        "gpu_monitoring": {"endpoints": [f"{host}:{port}"], "collection_interval": 0.2,
                           "flush_interval": 0.2},
        "stalls": {"after": 1, "factor": 5},
    }  # fmt: skip
    try:
        with Logger(cfg) as logger:
            logger.log_metrics({"loss": 0.5}, step=0)
            wait_for(lambda: logger.gpu_monitor.scraper.latest, 10, "a GPU reading")
            with logger.timer("generation"):
                wait_for(lambda: sorted((log_dir / "stalls").glob("*.json")), 10, "a report")
            logger.log_metrics({"loss": 0.4}, step=1)
    finally:
        server.close()
    report = json.loads(next((log_dir / "stalls").glob("*.json")).read_text())
    assert report["gpus"]["available"] is True
    [(name, reading)] = report["gpus"]["nodes"].items()
    assert reading["host"] == host and reading["seconds_ago"] < 5
    assert reading["gpus"] == {
        str(i): {"util_percent": gpu.utilization, "mem_used_mib": gpu.used_mib,
                 "mem_total_mib": gpu.used_mib + gpu.available_mib}
        for i, gpu in node.gpus.items()
    }  # fmt: skip
    text = next((log_dir / "stalls").glob("*.txt")).read_text()
    assert "GPUs (last readings of the GPU bridge):" in text and name in text


def test_a_stall_is_an_event_of_the_steps_span_and_one_logged_line_with_the_report(
    tmp_path, otel_rl_warnings
):
    """With tracing on, the stall and its end are events of the open step's ``rl.step`` span
    (with the report's path and the seconds), and ``logging`` gets one line naming the report
    when the run stalls and one when it moves again."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "tracing": {"enabled": True},
           "stalls": {"after": 1, "factor": 5}}  # fmt: skip
    with Logger(cfg) as logger:
        spans = InMemorySpanExporter()
        logger.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        logger.log_metrics({"loss": 0.5}, step=0)
        with logger.timer("generation"):
            report = wait_for(lambda: sorted((log_dir / "stalls").glob("*.txt")), 10,
                               "a report")[0]  # fmt: skip
            # The watchdog tells the trackers (queued), then the step's span, once the report
            # is written: the event in events.jsonl means the span has it too.
            wait_for(lambda: (log_dir / "events.jsonl").exists()
                     and "otel_rl/stall" in (log_dir / "events.jsonl").read_text(), 10,
                     "the stall event")  # fmt: skip
        logger.log_metrics({"loss": 0.4}, step=1)
    step_spans = [s for s in spans.get_finished_spans() if s.name == "rl.step"]
    assert [s.attributes.get("rl.step") for s in step_spans] == [0, 1]  # no span without a step
    step_span = step_spans[1]  # the stall happened, and ended, in step 1's work
    events = {e.name: dict(e.attributes) for e in step_span.events}
    assert set(events) == {"otel_rl.stall", "otel_rl.stall.ended"}
    stalled, ended = events["otel_rl.stall"], events["otel_rl.stall.ended"]
    assert stalled["otel_rl.stall.report"] == ended["otel_rl.stall.report"] == str(report)
    assert stalled["otel_rl.run_id"] == logger.run_id
    assert 1 <= stalled["otel_rl.stall.seconds"] <= ended["otel_rl.stall.seconds"]
    assert "stalled: no step for" in stalled["otel_rl.summary"]
    assert ended["otel_rl.summary"].startswith("stall ended: steps resumed after")
    said = [r.getMessage() for r in otel_rl_warnings.records if "stall" in r.getMessage()]
    assert len(said) == 2 and str(report) in said[0] and "stall ended" in said[1]
    assert str(report) in said[1]


def test_the_threshold_follows_the_median_step_time():
    assert stall_threshold(600, 10, []) == 600
    assert stall_threshold(2, 5, [0.0, 1.0, 2.0, 3.0]) == 5.0  # 5 x 1 s beats 2 s
    assert stall_threshold(2, 5, [0.0, 0.1, 0.2, 10.2]) == 2.0  # median 0.1 s: after wins


def test_a_call_during_the_report_ends_the_stall_it_began():
    """The run moves again while the report is gathered (stacks take seconds): the stall ends
    at once instead of waiting for a call that already came."""
    state = {"last": 0.0}
    ended: list[float] = []

    def gather(report):
        state["last"] = time.monotonic()  # a log_metrics call lands meanwhile

    watchdog = StallWatchdog(
        run_id="r", report_dir=Path("/nonexistent/never-written"), after=0.01, factor=1,
        activity=lambda: (state["last"], 3, []), gather=gather,
        on_stall=lambda report: None, on_end=lambda report, length, step: ended.append(length),
    )  # fmt: skip
    time.sleep(0.05)
    assert watchdog.check() is not None
    assert not watchdog.stalled
    watchdog.check()
    assert len(ended) == 1 and ended[0] > 0


def test_without_nccl_the_report_says_why_there_is_no_flight_recorder(tmp_path):
    import torch  # noqa: F401  (imported, never initialised: the path a CPU driver takes)

    info = nccl_flight_recorder(tmp_path, "x")
    assert info == {"available": False,
                    "reason": "torch.distributed is not initialised in this process"}  # fmt: skip


def test_stalls_can_be_turned_off(tmp_path):
    with Logger({"log_dir": str(tmp_path), "stalls": {"enabled": False, "after": 0.05}}) as lg:
        lg.log_metrics({"x": 1.0}, step=0)
        time.sleep(0.3)
        lg.log_metrics({"x": 1.0}, step=1)
    assert not (tmp_path / "stalls").exists()
    assert all("stall/seconds" not in r["metrics"] for r in jsonl_rows(tmp_path / "metrics.jsonl"))


@pytest.mark.slow
def test_a_blocked_ray_actor_appears_with_its_stack(tmp_path, ray_with_dashboard):
    ray = ray_with_dashboard

    @ray.remote(num_cpus=0)
    class Rollout:
        def block_here_for_the_stall_test(self, seconds: float) -> None:
            time.sleep(seconds)

    actor = Rollout.remote()
    ray.get(actor.__ray_ready__.remote())
    log_dir = tmp_path / "logs"
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 2, "stacks_timeout": 20}})
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    ref = actor.block_here_for_the_stall_test.remote(60)
    reports = wait_for(lambda: sorted((log_dir / "stalls").glob("*.json")), 60, "a report")
    report = json.loads(reports[0].read_text())
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=30)
    logger.finish()
    assert report["ray"]["available"] is True, report["ray"]
    found = [a for a in report["ray"]["actors"] if a["actor"].endswith("Rollout")]
    assert len(found) == 1, report["ray"]
    (entry,) = found
    if entry["stack"] is None:  # py-spy needs ptrace rights; the reason must say so
        pytest.fail(f"no stack for the blocked actor: {entry.get('reason')}")
    assert "block_here_for_the_stall_test" in entry["stack"]
    assert "Rollout" in reports[0].with_suffix(".txt").read_text()


@pytest.mark.slow
def test_the_demo_makes_a_stall_on_purpose_and_says_where_its_report_is(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "otel_rl.cli", "demo", "--steps", "10", "--stall", "3",
         "--log-dir", str(tmp_path), "--backends", "jsonl"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (report,) = sorted((tmp_path / "exp_001" / "stalls").glob("*.txt"))
    assert f"stall report:     {report}" in done.stdout
    text = report.read_text()
    assert "MainThread: generation" in text
    assert "wait_for_a_rollout_that_hangs" in text  # the line the demo hangs on
    assert "stall ended: steps resumed after" in text
    rows = [r for r in jsonl_rows(tmp_path / "exp_001" / "metrics.jsonl") if "axis" not in r]
    stalled = [(r["step"], r["metrics"]["stall/seconds"]) for r in rows
               if "stall/seconds" in r["metrics"]]  # fmt: skip
    assert len(stalled) == 1 and stalled[0][0] == 5 and stalled[0][1] >= 3


#: Sections a report has only when there is something in them; docs/stalls.md describes each.
CONDITIONAL_SECTIONS = (
    "ranks the run waits for:", "workers (timers open when they last reported):",
)  # fmt: skip


@pytest.mark.slow
def test_the_report_in_the_docs_is_what_the_demo_writes(tmp_path):
    """docs/stalls.md pastes a report of ``otel-rl demo --stall``: its sections and its lines
    about the demo's stall are the ones the demo writes today."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "otel_rl.cli", "demo", "--steps", "20", "--stall",
                    "2.5", "--log-dir", str(tmp_path), "--backends", "jsonl"],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    (report,) = (tmp_path / "exp_001" / "stalls").glob("*.txt")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "stalls.md").read_text()
    pasted = docs.split("otel-rl stall report", 1)[1].split("```", 1)[0]
    real = report.read_text()
    headings = [ln for ln in real.splitlines() if ln and not ln.startswith(" ") and ":" in ln]
    for heading in headings:
        key = " ".join(heading.split(":")[0].split()[:2])  # "stalled at", "open timers", ...
        if heading in CONDITIONAL_SECTIONS:  # the demo's rank 1 may lag on a busy machine
            assert heading.split(" (")[0].rstrip(":") in docs.lower(), heading
            continue
        assert any(ln.startswith(key) for ln in pasted.splitlines()), heading
    for line in ("MainThread: generation", "wait_for_a_rollout_that_hangs(stall)",
                 "reason: torch is not imported in this process",
                 "reason: Ray is not used in this process"):  # fmt: skip
        assert line in real and line in pasted


@pytest.mark.slow
def test_a_stall_with_the_collector_down_adds_no_otlp_line_of_its_own(tmp_path):
    """The stall's OTLP log record fails like the metrics do: the one warning about the
    collector covers both (no SDK line per failed export)."""
    import subprocess
    import sys
    import textwrap

    from testkit.otlp_receiver import closed_port

    script = textwrap.dedent(f"""
        import time
        from otel_rl import Logger
        logger = Logger({{"log_dir": {str(tmp_path)!r}, "jsonl_enabled": True,
                         "otlp": {{"enabled": True, "endpoint": "http://127.0.0.1:{closed_port()}",
                                  "interval": 1, "timeout": 1}},
                         "stalls": {{"after": 1, "factor": 2}}}})
        for step in range(3):
            logger.log_metrics({{"loss": 1.0}}, step=step)
        time.sleep(3)                               # a stall: report, events, a log record
        logger.log_metrics({{"loss": 1.0}}, step=3)
        began = time.monotonic()
        logger.finish()                             # at once: the stall's end is still told
        print(f"finish {{time.monotonic() - began:.2f}}")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    otlp = [ln for ln in lines if "OTLP" in ln or "opentelemetry" in ln or "Traceback" in ln]
    assert len(otlp) == 1, lines
    assert sum("stalled" in ln for ln in lines) == 1
    assert sum("stall ended" in ln for ln in lines) == 1
    assert not any("after shutdown" in ln for ln in lines), lines
    events = jsonl_rows(tmp_path / "events.jsonl")
    assert [(e["step"], e["level"]) for e in events] == [(2, "warning"), (3, "info")]
    assert float(done.stdout.split("finish ")[1]) < 10  # the collector's timeouts are bounded


@pytest.mark.slow
@pytest.mark.serial  # the worker's answer within the report's 20 s; a loaded machine misses it
def test_a_worker_stuck_inside_a_timer_is_named_with_its_open_timers(tmp_path, ray_with_dashboard):
    """A worker that pushes to the metrics aggregator tells it which timers are open in it;
    the driver's stall report names that worker and the timer it never left."""
    ray = ray_with_dashboard
    from otel_rl.ray.aggregator import MetricsAggregator

    aggregator = MetricsAggregator.start()

    @ray.remote(num_cpus=0)
    class Policy:
        def generate_forever(self, seconds: float) -> None:
            from otel_rl.distributed import WorkerMetrics
            from otel_rl.ray.aggregator import MetricsAggregator

            worker = WorkerMetrics(rank=2, role="policy")
            MetricsAggregator.connect().push(worker.snapshot(step=0))
            with worker.timer("generate"):
                time.sleep(seconds)

    actor = Policy.remote()
    ray.get(actor.__ray_ready__.remote())
    log_dir = tmp_path / "logs"
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 5, "stacks_timeout": 20}})
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    ref = actor.generate_forever.remote(60)
    reports = wait_for(lambda: sorted((log_dir / "stalls").glob("*.json")), 60, "a report")
    report = json.loads(reports[0].read_text())
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=30)
    logger.finish()
    aggregator.kill()
    (worker,) = [name for name in report["workers"] if name.startswith("policy rank 2")]
    timers = report["workers"][worker]["timers"]
    assert [name for stack in timers.values() for name, _ in stack] == ["generate"]
    assert any(s.startswith("policy rank 2") and "still inside generate" in s
               for s in report["stragglers"])  # fmt: skip
    assert "still inside generate" in reports[0].with_suffix(".txt").read_text()


@pytest.mark.slow
def test_a_stall_reaches_every_tracker_with_text_as_text(offline_trackers, tmp_path):
    """W&B (offline files, read with W&B's own decoder), SwanLab (offline, its own reader),
    MLflow (a local store, read with its client) and TensorBoard each hold the stall's summary
    at the last step before it, and the end of the stall after it."""
    import uuid

    from testkit.tracker_readers import read_swanlab, read_wandb, swanlab_run_dirs, wandb_run_dirs

    log_dir = tmp_path / "logs"
    project = f"otel-rl-tests-{uuid.uuid4().hex[:8]}"
    cfg = {
        "log_dir": str(log_dir), "tensorboard_enabled": True,
        "wandb_enabled": True, "wandb": {"project": project, "name": "stall", "mode": "offline"},
        "swanlab_enabled": True, "swanlab": {"project": project, "mode": "offline"},
        "mlflow_enabled": True, "mlflow": {"experiment_name": project},
        "stalls": {"after": 1, "factor": 2},
    }  # fmt: skip
    with Logger(cfg) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
        (report,) = wait_for(lambda: list((log_dir / "stalls").glob("*.txt")), 20, "a report")
        logger.log_metrics({"loss": 3.0}, step=3)
        wait_for(lambda: "stall ended" in report.read_text(), 20, "the stall's end")
        exporters = {e.name: e for e in logger.exporters}
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["step"], e["level"]) for e in events] == [(2, "warning"), (3, "info")]
    wb = read_wandb(wandb_run_dirs(log_dir)[0])
    panels = [row for row in wb.history if "otel_rl/stall._type" in row]  # W&B flattens media
    assert [(row["global_step"], row["otel_rl/stall._type"]) for row in panels] == [
        (2, "html-file"), (3, "html-file"),
    ]  # fmt: skip
    sl = read_swanlab(swanlab_run_dirs(log_dir / "swanlab")[0])
    assert [(step, kind) for step, kind, _ in sl.media["otel_rl/stall"]] == [
        (2, "COLUMN_TYPE_TEXT"), (3, "COLUMN_TYPE_TEXT"),
    ]  # fmt: skip
    from mlflow.tracking import MlflowClient

    mlflow = exporters["mlflow"].tracker
    client = MlflowClient(mlflow.tracking_uri)
    folder = "events/otel_rl/stall"
    names = sorted(Path(f.path).name for f in client.list_artifacts(mlflow.run_id, folder))
    assert names == ["step_2.txt", "step_3.txt"]
    first = client.download_artifacts(mlflow.run_id, f"{folder}/step_2.txt", str(tmp_path))
    assert "stalled: no step for" in Path(first).read_text()
    tags = tensorboard_accumulator(log_dir / "tensorboard").Tags()["tensors"]
    assert any("otel_rl/stall" in tag for tag in tags)


def test_the_stall_length_is_one_clock_and_its_end_is_told_at_the_step_that_moved(tmp_path):
    """``stall/seconds`` runs from the recorded stamp of the last call before the stall to the
    call that moved again (never a second clock read), and the "stall ended" event names the
    step whose row carries it, however fast the steps after it come."""
    log_dir = tmp_path / "logs"
    with Logger({"log_dir": str(log_dir), "stalls": {"after": 0.3, "factor": 1}}) as logger:
        logger.log_metrics({"x": 0.0}, step=0)
        logger.log_metrics({"x": 1.0}, step=1)
        quiet_from = time.monotonic()
        wait_for(lambda: sorted((log_dir / "stalls").glob("*.json")), 10, "a report")
        time.sleep(0.2)
        quiet_until = time.monotonic()
        for step in range(2, 40):  # the run moves again, fast
            logger.log_metrics({"x": float(step)}, step=step)
    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    seconds = rows[2]["stall/seconds"]
    assert seconds >= quiet_until - quiet_from  # from the last call's own stamp
    (report,) = [json.loads(p.read_text()) for p in (log_dir / "stalls").glob("*.json")]
    assert report["ended"]["seconds"] == round(seconds, 3)
    ended = [e for e in jsonl_rows(log_dir / "events.jsonl") if e["level"] == "info"]
    assert [e["step"] for e in ended] == [2]
    assert all("stall/seconds" not in rows[s] for s in rows if s != 2)


def test_a_stall_the_run_ends_in_is_ended_by_its_finish(log_dir):
    """A loop that stops stepping and then finishes (a hang given up on, an ``except:`` around
    the loop): the report says the stall ended with the run, after how long, and so do the
    "stall ended" event (at the last step) and ``otel-rl why`` (it told it as never ended, as
    of a run killed in it)."""
    from otel_rl.analysis.why import explain

    cfg = {"log_dir": str(log_dir), "stalls": {"after": 0.3, "factor": 1.0}}
    with Logger(cfg) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
        assert wait_for(lambda: list((log_dir / "stalls").glob("*.json")), 10, "a stall report")
        time.sleep(0.3)
        began = time.monotonic()
    lasted = time.monotonic() - began
    (path,) = (log_dir / "stalls").glob("*.json")
    report = json.loads(path.read_text())
    assert report["last_step"] == 2
    ended = report["ended"]
    assert ended["summary"].startswith("stall ended: the run ended after")
    assert 0.6 <= ended["seconds"] <= 0.6 + lasted + 5
    assert "stall ended: the run ended after" in path.with_suffix(".txt").read_text()
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["level"], e["step"]) for e in events] == [
        ("otel_rl/stall", "warning", 2), ("otel_rl/stall", "info", 2),
    ]  # fmt: skip
    (stall,) = explain(log_dir).stalls
    assert stall.over and stall.seconds == ended["seconds"]
