"""``otel-rl timeline``: the demo's run drawn as a page that a real browser renders offline, and as
a Perfetto trace; what is drawn is counted against the trace file, parsed here on its own."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from opentelemetry.proto_json.collector.trace.v1.trace_service import (
    ExportTraceServiceRequest,
)

from otel_rl import Logger, WorkerMetrics
from testkit import browser
from testkit.readers import jsonl_rows

pytestmark = pytest.mark.skipif(browser.chromium() is None, reason="needs Chromium")

#: The page of 100 demo steps stays under this (docs/timeline.md says so).
PAGE_LIMIT = 1_500_000


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_rl.cli", *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """100 demo steps, one of which stalls 3 s in its generation."""
    root = tmp_path_factory.mktemp("timeline")
    done = _cli("demo", "--steps", "100", "--log-dir", str(root), "--stall", "3",
                "--backends", "jsonl")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "exp_001"


def _spans(log_dir: Path) -> list[tuple[dict, object]]:
    out = []
    for line in (log_dir / "traces.jsonl").read_text().splitlines():
        for rs in ExportTraceServiceRequest.from_json(line).resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            out.extend((resource, s) for ss in rs.scope_spans for s in ss.spans)
    return out


def _value(any_value):
    return next((v for v in (any_value.int_value, any_value.string_value) if v is not None), None)


def _attribute(span, key):
    return next((_value(a.value) for a in span.attributes if a.key == key), None)


def _expected(log_dir: Path, first: int, last: int) -> tuple[int, set[tuple]]:
    """The spans of steps first..last and their lanes, from the trace file alone: a span's step
    is its trace's ``rl.step`` span's (or its own ``rl.step`` attribute), counted at the step's
    latest launch only; a span of no step counts where it lies in one of those ``rl.step``
    spans' time."""
    spans = _spans(log_dir)
    roots = {s.trace_id: (r, s) for r, s in spans if s.name == "rl.step"}

    def step_and_launch(resource, span) -> tuple[int | None, int]:
        if span.trace_id in roots:
            resource, span = roots[span.trace_id]
        return _attribute(span, "rl.step"), resource.get("otel_rl.attempt") or 1

    latest: dict[int, int] = {}
    for r, s in roots.values():
        step, launch = step_and_launch(r, s)
        latest[step] = max(latest.get(step, 0), launch)

    def shown(r, s) -> bool:
        step, launch = step_and_launch(r, s)
        return step is not None and first <= step <= last and launch == latest[step]

    times = [(s.start_time_unix_nano, s.end_time_unix_nano) for r, s in roots.values()
             if shown(r, s)]  # fmt: skip
    inside = [(r, s) for r, s in spans if shown(r, s) or (step_and_launch(r, s)[0] is None
              and any(a < s.end_time_unix_nano and s.start_time_unix_nano < b
                      for a, b in times))]  # fmt: skip
    lanes = {(r.get("process.pid"), r.get("otel_rl.role"), r.get("otel_rl.rank"),
              _attribute(s, "thread.id")) for r, s in inside}  # fmt: skip
    return len(inside), lanes


def _page_data(page: Path) -> dict:
    return json.loads(re.search(r"const RUN = (\{.*?\});</script>", page.read_text())[1])


def test_the_page_of_a_run_renders_offline_every_span_and_lane_of_its_steps(demo_run, tmp_path):
    page = tmp_path / "steps.html"
    done = _cli("timeline", str(demo_run), "--steps", "20-24", "-o", str(page))
    assert done.returncode == 0, done.stderr
    count, lanes = _expected(demo_run, 20, 24)
    assert len(lanes) == 3  # the driver and the demo's two trainer ranks
    text = page.read_text()
    # Self-contained: no script, style or image from anywhere else.
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=["']?(https?:)?//""", text)
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    assert int(shown.body["lanes"]) == len(lanes)
    assert int(shown.body["spans"]) == count  # every span of those steps drawn, none twice
    assert shown.body["steps"] == "5" and shown.body["stalls"] == "0"
    assert f"steps 20-24, {count} spans on 3 lanes" in done.stdout


def test_by_default_the_page_shows_the_slowest_step_its_stall_and_verdict(demo_run, tmp_path):
    page = tmp_path / "slowest.html"
    done = _cli("timeline", str(demo_run), "-o", str(page))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    walls = {r["step"]: r["metrics"]["anatomy/wall/seconds"] for r in rows
             if "anatomy/wall/seconds" in r.get("metrics", {})}  # fmt: skip
    slowest = max(walls, key=walls.get)
    assert walls[slowest] > 3.0  # the demo's stall
    assert f"steps {slowest - 2}-{slowest + 2}," in done.stdout and "1 stall(s)" in done.stdout
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    assert shown.body["stalls"] == "1" and shown.body["steps"] == "5"
    data = _page_data(page)
    (stall,) = data["stalls"]
    assert "wait_for_a_rollout_that_hangs" in stall["verdict"]
    assert stall["end"] - stall["start"] == pytest.approx(3.0, abs=0.5)
    generation = max((s for s in data["spans"] if s["name"] == "generation"),
                     key=lambda s: s["end"] - s["start"])  # fmt: skip
    assert generation["step"] == slowest  # the long generation is in the slowest step's trace
    assert stall["start"] <= generation["end"] and generation["start"] <= stall["end"]
    assert {"generation", "train/worker_step"} <= set(data["phases"])
    (row,) = [r for r in data["overview"] if r[0] == slowest]
    assert row[6 + data["phases"].index("generation")] > 3.0  # its anatomy, stacked above
    # The whole run's time, as `otel-rl why` tells it, under the charts.
    why = _cli("why", str(demo_run)).stdout.splitlines()
    table = why[why.index(next(line for line in why if line.startswith("where the run's"))):]
    table = table[: table.index("")]
    shown_table = re.search(r'<pre id="time-spent">(.*?)</pre>', page.read_text(), re.S)[1]
    assert html.unescape(shown_table).splitlines() == table
    assert any(line.startswith("  lost to 1 stall(s): ") for line in table)


def test_the_page_of_a_hundred_steps_stays_under_its_stated_size(demo_run, tmp_path):
    page = tmp_path / "all.html"
    assert _cli("timeline", str(demo_run), "--steps", "0-99", "-o", str(page)).returncode == 0
    assert page.stat().st_size < PAGE_LIMIT
    count, _ = _expected(demo_run, 0, 99)
    assert int(browser.render(page).body["spans"]) == count


#: Chrome's trace-event format (the "JSON Object Format"), for the events written here.
TRACE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "ph", "pid"],
            "properties": {
                "name": {"type": "string"}, "cat": {"type": "string"},
                "ph": {"enum": ["X", "i", "C", "M"]},
                "ts": {"type": "number", "minimum": 0}, "dur": {"type": "number", "minimum": 0},
                "pid": {"type": "integer"}, "tid": {"type": "integer"},
                "s": {"enum": ["g", "p", "t"]}, "args": {"type": "object"},
            },
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}},
                 "then": {"required": ["ts", "dur", "tid"]}},
                {"if": {"properties": {"ph": {"enum": ["i", "C"]}}},
                 "then": {"required": ["ts"]}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"properties": {"name": {"enum": ["process_name", "thread_name"]}},
                          "required": ["args"]}},
            ],
        }},
    },
}  # fmt: skip


def test_perfetto_format_is_trace_event_json_with_each_span_on_its_thread(demo_run, tmp_path):
    out = tmp_path / "run.json"
    done = _cli("timeline", str(demo_run), "--steps", "20-24", "--format", "perfetto",
                "-o", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    trace = json.loads(out.read_text())
    jsonschema.validate(trace, TRACE_EVENT_SCHEMA)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    count, lanes = _expected(demo_run, 20, 24)
    assert len(complete) == count
    threads = {(e["pid"], e["tid"]) for e in complete}
    assert len(threads) == len(lanes)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert set(names) >= threads
    processes = {e["args"]["name"] for e in events if e["ph"] == "M"
                 and e["name"] == "process_name"}  # fmt: skip
    assert any(p.startswith("trainer 1 · pid") for p in processes)
    steps = [e for e in events if e["ph"] == "i" and e["cat"] == "step"]
    assert [e["name"] for e in steps] == [f"step {n}" for n in range(20, 25)]
    worker = next(e for e in complete if e["name"] == "worker_step")
    assert worker["args"]["otel_rl.rank"] in (0, 1) and worker["dur"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "500-600"], "the run has no such step (its steps: 0-99)"),
        (["--steps", "x"], "expected A-B or A"),
        (["--steps", "5-2"], "expected 0 <= A <= B"),
        (["--steps", ""], "expected A-B or A"),
        (["--steps", "\u0663"], "expected A-B or A"),
    ],
)
def test_a_bad_range_is_refused_with_the_range_the_run_has(demo_run, tmp_path, args, message):
    done = _cli("timeline", str(demo_run), *args, "-o", str(tmp_path / "x.html"))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.html").exists()


def test_a_directory_without_spans_or_steps_says_what_it_lacks(tmp_path):
    done = _cli("timeline", str(tmp_path))
    assert done.returncode == 2 and "holds no spans (traces.jsonl) and no steps" in done.stderr
    assert "on disk by default" in done.stderr  # (it told to turn on what is on by default)
    done = _cli("timeline", str(tmp_path / "missing"))
    assert done.returncode == 2 and "no such directory" in done.stderr
    (tmp_path / "metrics.jsonl").write_text("")
    done = _cli("timeline", str(tmp_path / "metrics.jsonl"))  # a run's file, not its folder
    assert done.returncode == 2 and f"a file: give the run's folder, {tmp_path}" in done.stderr


def test_a_torn_or_foreign_line_in_the_trace_file_costs_only_itself(demo_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(demo_run, copy, ignore=shutil.ignore_patterns(".otel-rl"))
    lines = (copy / "traces.jsonl").read_text().splitlines()
    # A crash's torn line (half of one), a line of another shape, and an array, among the lines.
    torn = [lines[0][: len(lines[0]) // 2], "[1, 2]", '{"resourceSpans": "x"}', *lines]
    (copy / "traces.jsonl").write_text("\n".join(torn) + "\n")
    page = tmp_path / "torn.html"
    done = _cli("timeline", str(copy), "--steps", "20-24", "-o", str(page))
    assert done.returncode == 0, done.stderr
    count, _ = _expected(demo_run, 20, 24)
    assert int(browser.render(page).body["spans"]) == count


def _traced(log_dir: Path, **cfg) -> Logger:
    return Logger({"log_dir": str(log_dir), "tracing": {"enabled": True}, **cfg})


def _perfetto(log_dir: Path, *args: str) -> dict:
    out = log_dir / "t.json"
    done = _cli("timeline", str(log_dir), "--format", "perfetto", "-o", str(out), *args)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def _step_seconds(trace: dict) -> dict[int, float]:
    return {int(e["name"].split()[1]): e["args"]["seconds"]
            for e in trace["traceEvents"] if e.get("cat") == "step"}  # fmt: skip


def test_names_that_change_how_html_reads_a_script_are_drawn_like_any_other(tmp_path):
    """A timer, a thread and a worker role named with what HTML treats specially inside a
    script ("<!--<script>" swallows the rest of the page, "</script>" ends the script)."""
    names = ["<!--<script>", "</script><script>document.body.dataset.errors='9'</script>",
             "a & b > c", "\u2028line\u2029"]  # fmt: skip
    log_dir = tmp_path / "run"
    with _traced(log_dir) as logger:
        worker = WorkerMetrics(rank=0, role="<!--<script>", tracing=True)

        def timed() -> None:
            with logger.timer(names[0]):
                pass

        for step in range(2):
            for name in names:
                with logger.timer(name):
                    pass
            with worker.timer(names[1]):
                pass
            thread = threading.Thread(target=timed, name="<!--<script>")
            thread.start()
            thread.join()
            logger.log_worker_metrics([worker.snapshot(step=step)], step=step)
            logger.log_metrics({"x": 1.0}, step=step)
    page = tmp_path / "names.html"
    assert _cli("timeline", str(log_dir), "--steps", "0-1", "-o", str(page)).returncode == 0
    count, lanes = _expected(log_dir, 0, 1)
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    assert int(shown.body["spans"]) == count and int(shown.body["lanes"]) == len(lanes) >= 3
    assert "<!--<script>" not in page.read_text().split("const RUN = ", 1)[1]


def test_threads_of_one_name_get_a_lane_each(tmp_path):
    log_dir = tmp_path / "run"
    with _traced(log_dir) as logger:
        barrier = threading.Barrier(4)

        def load() -> None:
            barrier.wait()
            with logger.timer("load"):
                time.sleep(0.05)

        threads = [threading.Thread(target=load, name="loader") for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        logger.log_metrics({"x": 1.0}, step=0)
    trace = _perfetto(log_dir, "--steps", "0")
    loads = [e for e in trace["traceEvents"] if e.get("name") == "load" and e["ph"] == "X"]
    assert len({e["tid"] for e in loads}) == 4  # side by side, not stacked on one lane
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"loader", "loader #2", "loader #3", "loader #4"} <= names


def test_a_relaunched_run_is_drawn_at_its_latest_attempt(tmp_path):
    """Run ``x`` logs 0-9, is relaunched a second later from step 5 and logs 5-12: steps 5-9 are
    the second attempt's (their length is their row's wall), not one step across both."""
    log_dir = tmp_path / "run"
    for steps in (range(10), range(5, 13)):
        with _traced(log_dir, run_id="x") as logger:
            for step in steps:
                with logger.timer("generation"):
                    time.sleep(0.01)
                logger.log_metrics({"x": 1.0}, step=step)
        time.sleep(1.0)
    rows = {r["step"]: r["metrics"]["anatomy/wall/seconds"]  # the latest attempt's row: the last
            for r in jsonl_rows(log_dir / "metrics.jsonl")
            if "anatomy/wall/seconds" in r.get("metrics", {})}  # fmt: skip
    drawn = _step_seconds(_perfetto(log_dir, "--steps", "5-9"))
    assert sorted(drawn) == [5, 6, 7, 8, 9]
    for step, seconds in drawn.items():
        assert seconds < 0.5 and seconds == pytest.approx(rows[step], abs=0.02)


def test_without_tracing_each_step_lasts_its_anatomy_wall(tmp_path):
    log_dir = tmp_path / "run"
    with Logger({"log_dir": str(log_dir), "tracing": {"enabled": False}}) as logger:
        for step in range(5):
            with logger.timer("generation"):
                time.sleep(0.01 * (step + 1))
            logger.log_metrics({"x": 1.0}, step=step)
    assert not (log_dir / "traces.jsonl").exists()
    rows = {r["step"]: r["metrics"]["anatomy/wall/seconds"]
            for r in jsonl_rows(log_dir / "metrics.jsonl")}  # fmt: skip
    assert _step_seconds(_perfetto(log_dir, "--steps", "0-4")) == pytest.approx(rows, abs=1e-6)


_KILLED_IN_A_STALL = """
import sys, time
from otel_rl import Logger
logger = Logger({"log_dir": sys.argv[1], "tracing": {"enabled": True},
                 "stalls": {"after": 0.5, "factor": 1.0}})
for step in range(40):
    with logger.timer("generation"):
        time.sleep(100 if step == 30 else 0.01)
    logger.log_metrics({"x": 1.0}, step=step)
"""


def test_a_run_killed_in_a_stall_is_drawn_around_the_stall_and_why_counts_it(tmp_path):
    """The run is one process of a job whose processes share ``log_dir`` (``WORLD_SIZE`` 2):
    it publishes its state to ``<log_dir>/job/``, and the page says where it last was."""
    log_dir = tmp_path / "run"
    env = {**os.environ, "WORLD_SIZE": "2"}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_IN_A_STALL, str(log_dir)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list((log_dir / "stalls").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # the span processor has written the steps before the stall
    finally:
        child.kill()
        child.wait()
    (report,) = [json.loads(p.read_text()) for p in (log_dir / "stalls").glob("*.json")]
    assert report["ended"] is None and report["last_step"] == 29
    page = tmp_path / "killed.html"
    done = _cli("timeline", str(log_dir), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "1 stall(s)" in done.stdout  # the picture is the stall's, not a step's
    data = _page_data(page)
    (stall,) = data["stalls"]
    # It starts where the work drawn ends (step 29's generation), not a second before it.
    worked = max(s["end"] for s in data["spans"])
    assert worked - 0.05 <= stall["start"] <= worked + 0.1
    why = _cli("why", str(log_dir)).stdout
    assert "lost to 1 stall(s): " in why and "1 never ended" in why
    text = html.unescape(page.read_text().split("<script>")[0])
    captions = re.findall(r"<caption>(.*?)</caption>", text)
    assert captions[0] == "where the job's processes were, at the stall after step 29"
    assert captions[1].startswith(f"where the job's processes were, as each last published "
                                  f"({log_dir / 'job'}), at ")  # fmt: skip
    last = text.split(captions[1])[1]
    assert re.search(rf"<td>process \(pid {child.pid}\)</td><td>29</td><td>inside generation, "
                     r"at <module> \(<string>:8\), pid ", last)  # fmt: skip
    assert browser.render(page).body["places"] == "2"


def test_malformed_rows_and_reports_cost_only_themselves(demo_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(demo_run, copy, ignore=shutil.ignore_patterns(".otel-rl"))
    with open(copy / "metrics.jsonl", "a") as rows:
        rows.write('{"step": 0, "time": 1.0, "metrics": [1, 2]}\n')
        rows.write('{"step": 1, "time": NaN, "metrics": {}}\n')
        rows.write('{"step": 2, "time": "x", "axis": "ray/ray_step", "metrics": 3}\n')
    bad = {"verdict": "hung", "stalled_at": "2026-01-01T00:00:00+00:00",
           "stalled_at_unix": "x", "ended": "no", "last_step": "y"}  # fmt: skip
    (copy / "stalls" / "zz.json").write_text(json.dumps(bad))
    for fmt in ("html", "perfetto"):
        done = _cli("timeline", str(copy), "--steps", "20-24", "--format", fmt,
                    "-o", str(tmp_path / f"out.{fmt}"))  # fmt: skip
        assert done.returncode == 0, done.stderr
    count, _ = _expected(demo_run, 20, 24)
    assert int(browser.render(tmp_path / "out.html").body["spans"]) == count
    trace = json.loads((tmp_path / "out.perfetto").read_text())
    jsonschema.validate(trace, TRACE_EVENT_SCHEMA)


def test_a_folder_of_runs_names_them(demo_run):
    done = _cli("timeline", str(demo_run.parent))
    assert done.returncode == 2 and "holds runs: exp_001" in done.stderr


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Path:
    """200 steps of a real Logger: step 0 the slowest (its warm-up), then step 120, each by a
    margin no stall of a loaded machine makes up (a step of 0.15 s was once outrun by one)."""
    log_dir = tmp_path_factory.mktemp("long") / "run"
    with _traced(log_dir) as logger:
        for step in range(200):
            with logger.timer("generation"):
                time.sleep(1.0 if step == 0 else 0.5 if step == 120 else 0.002)
            with logger.timer("train"):
                pass
            logger.log_metrics({"loss": 1.0}, step=step)
    return log_dir


def _shown(log_dir: Path, page: Path, *args: str) -> browser.Rendered:
    done = _cli("timeline", str(log_dir), "-o", str(page), *args)
    assert done.returncode == 0, done.stderr
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    return shown


@pytest.mark.slow
def test_the_page_draws_every_step_of_the_run_above_its_window(long_run, tmp_path):
    page = tmp_path / "run.html"
    shown = _shown(long_run, page)
    assert shown.body["overview-steps"] == "200"
    data = _page_data(page)
    assert [row[0] for row in data["overview"]] == list(range(200))
    generation = 6 + data["phases"].index("generation")  # its column: each phase's seconds
    assert data["overview"][120][generation] == pytest.approx(0.5, abs=0.1)


@pytest.mark.slow
def test_by_default_the_slowest_step_after_the_run_s_first_is_shown(long_run, tmp_path):
    page = tmp_path / "default.html"
    done = _cli("timeline", str(long_run), "-o", str(page))
    assert done.returncode == 0 and "steps 118-122," in done.stdout, done.stdout + done.stderr
    shown = browser.render(page)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    assert shown.body["window"] == "118-122" and shown.body["steps"] == "5"
    count, lanes = _expected(long_run, 118, 122)
    assert int(shown.body["spans"]) == count and int(shown.body["lanes"]) == len(lanes)
    one = tmp_path / "one"
    with _traced(one) as logger:  # a run of one step: that step
        logger.log_metrics({"x": 1.0}, step=0)
    assert _shown(one, tmp_path / "one.html").body["window"] == "0"


#: After the page's own scripts: a click (the mouse moved there, pressed, released) on the
#: overview, just above the axis at a step.
_CLICK = """<script>(function () {
  const box = document.getElementById("overview");
  const [x, y] = echarts.getInstanceByDom(box).convertToPixel({gridIndex: 0}, ["STEP", 0]);
  const canvas = box.querySelector("canvas"), rect = canvas.getBoundingClientRect();
  const at = {clientX: rect.left + x, clientY: rect.top + y - 4, bubbles: true, button: 0};
  for (const type of ["mousemove", "mousedown", "mouseup", "click"])
    canvas.dispatchEvent(new MouseEvent(type, at));
})();</script>"""


def _with_script(page: Path, script: str) -> browser.Rendered:
    """``page`` with ``script`` run after its own, in Chromium."""
    head, body_end, tail = page.read_text().rpartition("</body>")
    changed = page.with_name(f"with-{page.name}")
    changed.write_text(head + script + body_end + tail)
    shown = browser.render(changed)
    assert shown.console_errors == [] and shown.body["errors"] == "0", shown.log[-3000:]
    return shown


@pytest.mark.slow
def test_a_click_on_a_step_of_the_overview_opens_it_and_its_neighbours(long_run, tmp_path):
    page = tmp_path / "run.html"
    _shown(long_run, page)
    shown = _with_script(page, _CLICK.replace("STEP", "40"))
    assert shown.body["window"] == "38-42" and shown.body["steps"] == "5"
    count, lanes = _expected(long_run, 38, 42)
    assert int(shown.body["spans"]) == count and int(shown.body["lanes"]) == len(lanes)


# Rank 0 logs with a Logger, rank 1 records with WorkerMetrics; both sync each step in an
# all_reduce of a gloo group, until at step 3 rank 1 sits in load_the_next_batch instead.
_TWO_RANKS = """
import pathlib, sys, time
import torch
import torch.distributed as dist

rank, port, log_dir = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 0:
    from otel_rl import Logger
    metrics = Logger({"log_dir": str(log_dir), "tracing": {"enabled": True},
                      "stalls": {"after": 1.0, "factor": 1.0}})
else:
    from otel_rl import WorkerMetrics
    metrics = WorkerMetrics(rank=1, role="trainer")


def load_the_next_batch():
    while True:
        time.sleep(0.1)


values = torch.ones(2)
for step in range(10):
    if step == 3 and rank == 1:
        load_the_next_batch()
    with metrics.timer("sync"):
        dist.all_reduce(values)
    if rank == 0:
        metrics.log_metrics({"loss": 1.0}, step=step)
"""


@pytest.mark.slow
def test_where_each_rank_was_when_the_run_stopped_is_on_the_page(tmp_path):
    from testkit.servers import free_port

    log_dir, port = tmp_path / "run", str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(rank), port, str(log_dir)],
                              env=env, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not list((log_dir / "stalls").glob("*.json")) and time.monotonic() < deadline:
            assert ranks[0].poll() is None, ranks[0].communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # the span processor has written the steps before the stall
    finally:
        for rank in ranks:  # the run stops here
            rank.kill()
            rank.communicate()
    (report,) = [json.loads(p.read_text()) for p in (log_dir / "stalls").glob("*.json")]
    assert report["last_step"] == 2 and report["job"]["odd_ones_out"]
    page = tmp_path / "stopped.html"
    shown = _shown(log_dir, page)
    assert shown.body["places"] == "2"
    text = html.unescape(page.read_text().split("<script>")[0])
    table = re.search(r"<table><caption>(.*?)</caption>(.*?)</table>", text, re.S)
    assert table[1].startswith("where the job's processes were, at the stall after step 2: rank 1 "
                               "has not joined all_reduce #4 on the default group")  # fmt: skip
    places = {cells[0]: cells[1:] for cells in (re.findall(r"<td>(.*?)</td>", row)
              for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table[2])) if cells}  # fmt: skip
    step, where = places["rank 0"]
    assert step == "2" and where.startswith("inside sync, waits on torch.distributed.all_reduce")
    _, where = places["trainer rank 1"]
    assert where.startswith("outside any timer, at load_the_next_batch (<string>:")
    assert f"pid {ranks[1].pid} on " in where
    assert re.search(r'<tr class=odd><td>trainer rank 1</td>', text)  # named by the verdict


@pytest.mark.slow
def test_a_relaunched_run_s_page_draws_each_step_once_and_no_step_outside_it(tmp_path):
    """Run ``x`` logs 0-9 and ends; relaunched, it redoes 5-9 and logs on to 12. Steps 3-7 are
    drawn with 3 and 4 as the first launch ran them, 5-7 as the second did (the page says the
    first ran them too), and without the ``rl.step`` spans of steps 2 and 8 that touch them."""
    log_dir = tmp_path / "run"
    for steps in (range(10), range(5, 13)):
        with _traced(log_dir, run_id="x") as logger:
            for step in steps:
                with logger.timer("generation"):
                    time.sleep(0.01)
                with logger.timer("train"):
                    pass
                logger.log_metrics({"x": 1.0}, step=step)
    page = tmp_path / "relaunched.html"
    _shown(log_dir, page, "--steps", "3-7")
    shown = _with_script(page, "<script>document.body.dataset.legend = "
                               "document.getElementById('legend').textContent;</script>")
    count, lanes = _expected(log_dir, 3, 7)
    assert count == 5 * 3  # rl.step, generation and train of each step, of one launch
    assert int(shown.body["spans"]) == count and int(shown.body["lanes"]) == len(lanes)
    assert "an earlier launch ran steps 5\u20137 too: drawn as launch 2 ran them" \
        in shown.body["legend"]  # fmt: skip
    data = _page_data(page)
    assert sorted(s["step"] for s in data["spans"] if s["name"] == "rl.step") == [3, 4, 5, 6, 7]
    trace = _perfetto(log_dir, "--steps", "3-7")
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == count


def test_two_runs_in_one_log_dir_are_two_launches_and_each_step_is_the_later_ones(tmp_path):
    """A script run twice on one log_dir (each run its own run_id, both attempt 1): each step
    is drawn from the later run that logged it, as ``otel-rl why`` counts its row, not as one
    step stretched from the first run to the second (every step lasted the time between the
    runs), and the default window is at the later run's slowest step."""
    from otel_rl import Logger
    from otel_rl.timeline.run_picture import load_run
    from otel_rl.timeline.window import choose

    for steps, slow, seconds in ((30, 25, 0.08), (20, 7, 0.2)):
        with Logger({"log_dir": str(tmp_path), "tracing": {"picture": False}}) as logger:
            for step in range(steps):
                with logger.timer("generation"):
                    time.sleep(seconds if step == slow else 0.002)
                logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
        time.sleep(0.5)
    picture = load_run(tmp_path)
    assert [s.step for s in picture.steps] == list(range(30))
    assert [s.attempt for s in picture.steps] == [2] * 20 + [1] * 10
    # (step 0 starts with its Logger's start: a loaded machine may take long there)
    assert all(s.end - s.start < 0.45 for s in picture.steps[1:]), picture.steps
    assert 7 in [s.step for s in choose(picture, None).steps]
