"""One trace per RL step across Ray actors, end to end: a driver process on a real local Ray
cluster started with ``_tracing_startup_hook="otel_rl.ray.tracing:setup"``, two actors that only
use ``WorkerMetrics`` timers, every process exporting over OTLP/HTTP to a real receiver.

The driver runs in its own process (testkit/ray_tracing_driver.py): the hook installs a global
tracer provider and Ray's tracing switch, which must not leak into other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from testkit.otlp_trace_receiver import OtlpTraceReceiver
from testkit.readers import jsonl_rows, trace_file_spans

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
RANKS = (0, 1)
WORKER_TIMERS = {"generate": "rollout", "forward": "update", "backward": "update"}
METHOD_OF = {"generate": "generate", "forward": "train", "backward": "train"}
# A timer's span lasts exactly the timer's value (nanoseconds; rows keep float seconds).
TOLERANCE_S = 1e-6


def duration(span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9


def span_tree(spans, root) -> str:
    """The tree under ``root`` as indented lines: name, process role/rank, duration."""
    children = defaultdict(list)
    for resource, span in spans:
        children[span.parent_span_id].append((resource, span))
    lines: list[str] = []

    def walk(item, depth: int) -> None:
        resource, span = item
        who = resource.get("otel_rl.role", "?")
        if "otel_rl.rank" in resource and who not in ("driver", "ray-worker"):
            who += f" rank {resource['otel_rl.rank']}"
        attrs = {a.key: a.value.int_value for a in span.attributes if a.key == "rl.step"}
        extra = f" rl.step={attrs['rl.step']}" if attrs else ""
        lines.append(
            f"{'    ' * depth}{span.name}{extra}  [{who}, pid {resource.get('process.pid')}]"
            f"  {duration(span) * 1000:.1f} ms"
        )
        for child in sorted(children[span.span_id], key=lambda c: c[1].start_time_unix_nano):
            walk(child, depth + 1)

    walk(root, 0)
    return "\n".join(lines)


def expected_spans(spans) -> bool:
    """Every span of every step has arrived (worker timers come last, from two processes)."""
    names = [span.name for _, span in spans]
    return names.count("rl.step") == STEPS and all(
        names.count(timer) == STEPS * len(RANKS) for timer in WORKER_TIMERS
    )


@pytest.mark.slow
@pytest.mark.long
def test_worker_timer_spans_join_the_driver_step_trace(log_dir, capsys):
    pytest.importorskip("ray")
    receiver = OtlpTraceReceiver()
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: workers export while the driver waits for them
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=str(ROOT),
    )
    driver = subprocess.Popen(
        [sys.executable, str(ROOT / "testkit" / "ray_tracing_driver.py"), str(log_dir), str(STEPS)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        line = driver.stdout.readline()
        if line.strip() != "STEPS-DONE":
            driver.kill()
            pytest.fail(f"driver failed: {line!r}\n{driver.communicate(timeout=60)[1][-4000:]}")
        with receiver._cond:
            arrived = receiver._cond.wait_for(lambda: expected_spans(receiver.spans), 120)
        spans = list(receiver.spans)
    finally:
        if driver.poll() is None:
            driver.stdin.write("\n")
            driver.stdin.flush()
            try:
                driver.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.communicate()
        receiver.close()
    assert arrived, sorted(span.name for _, span in spans)
    assert driver.returncode == 0

    rows = {row["step"]: row["metrics"] for row in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == list(range(STEPS))
    by_id = {span.span_id: (resource, span) for resource, span in spans}
    step_spans = [(r, s) for r, s in spans if s.name == "rl.step"]
    for step in range(STEPS):
        row = rows[step]
        (root,) = [
            (r, s) for r, s in step_spans
            if {a.key: a.value.int_value for a in s.attributes}.get("rl.step") == step
        ]  # fmt: skip
        resource, step_span = root
        trace_id = step_span.trace_id
        # the row links to its trace; the step span is a root of the driver's run
        assert row["trace_id"] == trace_id.hex()
        assert step_span.parent_span_id == b""
        assert resource["otel_rl.role"] == "driver" and resource["otel_rl.run_id"] == "traced-run"
        in_trace = [(r, s) for r, s in spans if s.trace_id == trace_id]

        driver_timers = {s.name: s for r, s in in_trace if s.parent_span_id == step_span.span_id}
        assert set(driver_timers) == {"rollout", "update"}
        for name, span in driver_timers.items():
            assert duration(span) == pytest.approx(row[f"timing/{name}"], abs=TOLERANCE_S)

        worker_spans = [(r, s) for r, s in in_trace if r.get("otel_rl.role") == "trainer"]
        assert sorted((s.name, r["otel_rl.rank"]) for r, s in worker_spans) == sorted(
            (name, rank) for name in WORKER_TIMERS for rank in RANKS
        )
        for name, driver_timer in WORKER_TIMERS.items():
            durations = {}
            for r, span in worker_spans:
                if span.name != name:
                    continue
                # worker timer -> Ray's span in the actor -> Ray's call span in the driver
                # -> the driver timer that was open when the driver called the actor
                consumer_resource, consumer = by_id[span.parent_span_id]
                assert consumer.name == f"Trainer.{METHOD_OF[name]} ray.remote_worker"
                assert consumer_resource["process.pid"] == r["process.pid"]
                producer_resource, producer = by_id[consumer.parent_span_id]
                assert producer.name == f"Trainer.{METHOD_OF[name]} ray.remote"
                assert producer_resource["otel_rl.role"] == "driver"
                assert producer.parent_span_id == driver_timers[driver_timer].span_id
                assert r["service.name"] == "otel-rl" and r["otel_rl.run_id"] == "traced-run"
                assert r["ray.node_id"] and r["host.name"]
                durations[r["otel_rl.rank"]] = duration(span)
            # the rows hold the slowest and the fastest rank's total for the step
            assert max(durations.values()) == pytest.approx(
                row[f"workers/timing/{name}"], abs=TOLERANCE_S
            )
            assert min(durations.values()) == pytest.approx(
                row[f"workers/timing/{name}/min"], abs=TOLERANCE_S
            )
        if step == STEPS - 1:
            with capsys.disabled():
                print(f"\nspan tree of step {step} (trace {trace_id.hex()}):")
                print(span_tree(in_trace, root))

    _the_trace_file_has_every_span_with_its_parent(log_dir, spans)
    _the_timeline_has_a_lane_per_actor_and_their_spans_line_up(log_dir)


def _the_trace_file_has_every_span_with_its_parent(log_dir: Path, received) -> None:
    """The driver's trace file has every span the collector got, Ray's own included (an actor's
    in its snapshots, the driver's through its Logger), with the same parent, each once: no
    span in it lacks its parent, so a Collector's file receiver ships whole trees. The Ray span
    around each actor's last call, which ended after that call took the actor's last snapshot,
    is there as it stood at that snapshot, marked open."""
    on_disk = {span.span_id: span for _, span in trace_file_spans(log_dir)}
    assert len(on_disk) == len(trace_file_spans(log_dir))
    orphans = [s.name for s in on_disk.values() if s.parent_span_id not in (b"", *on_disk)]
    assert orphans == []
    opened = []
    for _, span in received:
        kept = on_disk[span.span_id]
        assert (kept.name, kept.parent_span_id) == (span.name, span.parent_span_id)
        assert kept.start_time_unix_nano == span.start_time_unix_nano
        if any(a.key == "otel_rl.span.open" and a.value.bool_value for a in kept.attributes):
            opened.append(span.name)
            assert kept.end_time_unix_nano <= span.end_time_unix_nano
        else:
            assert kept.end_time_unix_nano == span.end_time_unix_nano
    assert opened == ["Trainer.train ray.remote_worker"] * len(RANKS)


def _the_timeline_has_a_lane_per_actor_and_their_spans_line_up(log_dir: Path) -> None:
    """The actors' spans reach the driver's trace file in their snapshots (no collector
    needed); ``otel-rl timeline`` draws each actor on its own lane, and a step's spans on the
    driver and on both actors line up in time: each actor's timer lies inside the driver timer
    that called it. The page renders in a real browser with every span counted."""
    import json
    import re

    from testkit import browser

    page = log_dir / "timeline.html"
    done = subprocess.run(
        [sys.executable, "-m", "otel_rl.cli", "timeline", str(log_dir), "--steps", f"0-{STEPS - 1}",
         "-o", str(page)], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(re.search(r"const RUN = (\{.*?\});</script>", page.read_text())[1])
    lanes = data["lanes"]
    actor_lanes = {rank: [i for i, lane in enumerate(lanes) if lane.startswith(f"trainer {rank} ")]
                   for rank in RANKS}  # fmt: skip
    assert all(len(found) == 1 for found in actor_lanes.values()), lanes
    # a lane for the driver's timers, and one per process for Ray's spans (its resource names
    # the process, not a timer's thread)
    assert sorted(lane.split(" · ")[0] for lane in lanes) == [
        "driver", "driver 0", "ray-worker", "ray-worker", "trainer 0", "trainer 1"
    ], lanes  # fmt: skip
    for step in range(STEPS):
        driver = {s["name"]: s for s in data["spans"]
                  if s["step"] == step and lanes[s["row"]].startswith("driver")}  # fmt: skip
        for rank in RANKS:
            (row,) = actor_lanes[rank]
            mine = {s["name"]: s for s in data["spans"] if s["row"] == row and s["step"] == step}
            assert set(mine) == set(WORKER_TIMERS), (step, rank, sorted(mine))
            for name, outer in WORKER_TIMERS.items():
                inner, calling = mine[name], driver[outer]
                assert calling["start"] <= inner["start"] < inner["end"] <= calling["end"]
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    assert int(shown.body["lanes"]) == len(lanes)
    assert int(shown.body["spans"]) == len(data["spans"])
