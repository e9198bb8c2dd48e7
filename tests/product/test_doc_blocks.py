"""The docs' code, as a reader copies it: every ```python block of README.md and of every page
under docs/ (found by glob, so a new page is covered at once) runs as written, alone, in a fresh
interpreter and an empty working directory, and exits 0; the blocks that log metrics leave the
files, rows and spans they promise, with the values they log.

A block is one of three kinds, told by the line right above its fence:

- no marker: it runs. What it needs that a reader would start themselves (an OTLP collector, an
  inference server) is started here, its address given through the environment variable the
  block reads with a documented default. Each starts an interpreter of its own (a Ray cluster,
  a trainer), so the blocks that run are ``slow``: the inner loop leaves them to CI;
- ``<!-- fragment: <reason> -->``: a piece of a larger program (a call in someone else's
  framework, a line that needs a package the page is about to build);
- ``<!-- not-run: <reason> -->``: it needs what this machine cannot run (a GPU cluster, W&B
  online, inference servers).

The reason is required, fragments and not-run blocks stay few, and both must still compile. At
the end of the session a count per page says how many blocks ran, are fragments, are not run, and
failed.

Also here: what the README says about the benchmarks holds after its first command."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of
from testkit.otlp_trace_receiver import OtlpTraceReceiver
from testkit.readers import (
    jsonl_rows,
    tensorboard_accumulator,
    tensorboard_scalars,
    trace_file_spans,
)
from testkit.rollout_pages import V1_FIRST, PageServer
from testkit.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
KINDS = ("run", "fragment", "not-run")
MAX_FRAGMENTS = 3
MAX_NOT_RUN = 3
TIMEOUT_S = 300

_FENCE = re.compile(
    r"(?:<!--\s*(?P<kind>not-run|fragment):(?P<reason>[^>]*?)-->\s*\n)?"
    r"^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
    re.S | re.M,
)
_RAY = re.compile(r"^(?:import ray\b|from ray\b)", re.M)
#: A block whose first line is the torchrun command that runs it (``# torchrun ... train.py``).
_TORCHRUN = re.compile(r"\A# torchrun (?P<options>.*?)\s*(?P<script>\S+\.py)\s*$", re.M)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str
    kind: str = "run"
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def needs_ray(self) -> bool:
        return bool(_RAY.search(self.code))


def python_blocks(doc: str, text: str | None = None) -> list[Block]:
    if text is None:
        text = (ROOT / doc).read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code"))  # 1-based line of the ``` fence
        kind = match.group("kind") or "run"
        blocks.append(Block(doc, line, match.group("code"), kind, match.group("reason")))
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in python_blocks(doc)]


def test_every_page_is_read_and_few_blocks_are_not_run():
    # the glob reaches README.md, the pages, and the pages in folders under docs/
    assert {"README.md", "docs/quickstart.md", "docs/backends/tensorboard.md"} <= set(DOCS)
    assert len(DOCS) == 1 + len(list((ROOT / "docs").rglob("*.md")))
    kinds = Counter(b.kind for b in ALL_BLOCKS)
    assert kinds["run"] >= 15, kinds
    assert kinds["fragment"] <= MAX_FRAGMENTS, [b.id for b in ALL_BLOCKS if b.kind == "fragment"]
    assert kinds["not-run"] <= MAX_NOT_RUN, [b.id for b in ALL_BLOCKS if b.kind == "not-run"]
    for block in ALL_BLOCKS:
        if block.kind != "run":
            assert block.reason and block.reason.strip(), f"{block.id}: a {block.kind} says why"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind != "run"], ids=lambda b: b.id)
def test_fragments_and_not_run_blocks_are_python(block: Block) -> None:
    compile(block.code, block.id, "exec")  # a SyntaxError in a doc is a failure even there


def test_blocks_and_their_markers_are_read():
    text = (
        "intro\n\n```python\nprint(1)\n```\n\n```bash\nls\n```\n\n"
        "<!-- not-run: needs a Ray cluster -->\n```python\nimport ray\n```\n"
        "<!-- not-run: -->\n\n```python\nx = 1\n```\n"
        "<!-- fragment: one line of verl's trainer -->\n```python\nlogger.log(d, 1)\n```\n"
    )
    blocks = python_blocks("doc.md", text)
    assert [(b.line, b.code, b.kind, b.reason) for b in blocks] == [
        (3, "print(1)\n", "run", None),
        (12, "import ray\n", "not-run", " needs a Ray cluster "),
        (17, "x = 1\n", "not-run", " "),  # a blank reason is read, and refused above
        (21, "logger.log(d, 1)\n", "fragment", " one line of verl's trainer "),
    ]
    assert [b.needs_ray for b in blocks] == [False, True, False, False]
    assert _TORCHRUN.match("# torchrun --nproc_per_node 8 train.py\nimport os\n").group(
        "options", "script"
    ) == ("--nproc_per_node 8", "train.py")


# ---- how a block is run, and what it must leave behind ------------------------------------------


@dataclass
class Ran:
    """A block that exited 0: its working directory, its stdout, the server started for it."""

    cwd: Path
    stdout: str
    server: Any = None


@dataclass(frozen=True)
class How:
    #: What the block must have left (files, rows, spans), checked after it exits 0.
    check: Callable[[Ran], None] | None = None
    #: A context manager yielding a server started for the block (closed after the check).
    server: Callable[[], Any] | None = None
    #: Environment variables for the block, given the server.
    env: Callable[[Any], dict[str, str]] = lambda server: {}
    #: The page's own command for the block (the block is written to its ``.py`` file);
    #: empty: ``python -c <block>``, or the torchrun line the block starts with.
    command: tuple[str, ...] = ()


@contextmanager
def _serving(make: Callable[[], Any]) -> Iterator[Any]:
    server = make()
    try:
        yield server
    finally:
        server.close()


def _otlp_env(receiver: Any) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}


def _traced_env(receiver: Any) -> dict[str, str]:
    # Ray kills the actors when the driver exits, before their span processors' next export
    # (every 5 s by default): exporting every 100 ms, their spans are out before the run ends.
    return {**_otlp_env(receiver), "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _wait_for(receiver: OtlpTraceReceiver, done: Callable[[list], bool], timeout: float = 30):
    with receiver._cond:
        receiver._cond.wait_for(lambda: done(receiver.spans), timeout)
        return list(receiver.spans)


def _attrs(span: Any) -> dict[str, Any]:
    return attributes_of(span.attributes)


def _ancestors(span: Any, by_id: dict[bytes, Any]) -> list[str]:
    names = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        names.append(span.name)
    return names


def _duration(span: Any) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9


def _steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows]


def _usage_block(ran: Ran) -> None:
    """README "Usage": 100 steps with TensorBoard and JSONL into logs/exp_001."""
    run = ran.cwd / "logs" / "exp_001"
    rows = jsonl_rows(run / "metrics.jsonl")
    assert _steps(rows) == list(range(100))
    for row in rows:
        m = row["metrics"]
        assert m["train/kl"] == 0.01
        assert m["train/reward/count"] == 16.0
        assert m["train/reward/min"] <= m["train/reward/mean"] <= m["train/reward/max"]
        assert 0.1 <= m["train/loss"] <= 1.0
        assert m["timing/generation"] >= 0 and m["timing/train"] >= 0
    hyper = json.loads((run / "hyperparams.json").read_text())
    assert hyper["policy.lr"] == 1e-6 and hyper["grpo.num_generations"] == 16
    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == list(range(100))
    assert [v for _, v in scalars["train/kl"]] == pytest.approx([0.01] * 100)


def _quickstart_loop(ran: Ran) -> None:
    """docs/quickstart.md "Into a training loop": 20 steps, the stand-in's stats."""
    run = ran.cwd / "logs" / "exp_001"
    rows = jsonl_rows(run / "metrics.jsonl")
    assert _steps(rows) == list(range(20))
    for row in rows:
        m = row["metrics"]
        assert m["train/reward/count"] == 16.0
        assert 0.1 <= m["train/loss"] <= 1.0
        assert {"timing/generation", "timing/train", "train/reward/p90"} <= set(m)
    hyper = json.loads((run / "hyperparams.json").read_text())
    assert hyper == {"policy.lr": 1e-6, "policy.model": "my-model", "grpo.num_generations": 16}
    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/reward/mean"]] == list(range(20))


def _otel_api_only(ran: Ran) -> None:
    """backends/otel-metrics-exporter.md: train.py under ``opentelemetry-instrument`` reaches
    TensorBoard and MLflow at the step of ``train.step``; one export, at exit."""
    scalars = tensorboard_scalars(ran.cwd / "logs" / "tensorboard")
    assert scalars["train.step"] == [(19, 19.0)]
    assert scalars["tokens"] == [(19, 20 * 4096.0)]
    [(step, loss)] = scalars["train.loss"]
    assert step == 19 and 0.1 <= loss <= 1.0
    with sqlite3.connect(ran.cwd / "logs" / "mlflow" / "mlflow.db") as db:
        runs = db.execute(
            "SELECT e.name, r.status FROM runs r JOIN experiments e USING (experiment_id)"
        ).fetchall()
        metrics = dict(db.execute("SELECT key, value FROM metrics WHERE step = 19").fetchall())
    assert runs == [("grpo-dev", "FINISHED")]
    assert metrics["tokens"] == 20 * 4096.0 and metrics["train.step"] == 19.0
    assert metrics["train.loss"] == pytest.approx(loss, rel=1e-6)


def _tensorboard_reader(ran: Ran) -> None:
    """backends/tensorboard.md: the scalars, the plot and the table the short run wrote."""
    acc = tensorboard_accumulator(ran.cwd / "logs" / "tensorboard")
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    [image] = acc.Images("rollouts/reward")
    assert image.step == 2 and image.width > 0 and image.encoded_image_string[:4] == b"\x89PNG"
    [table] = acc.Tensors("val/samples")
    assert table.step == 2
    assert table.tensor_proto.string_val[0].decode().startswith("| prompt | response |")


def _csv_tracker(ran: Ran) -> None:
    """backends/README.md "Adding a tracker": the tracker's file holds each step's loss, and
    JSONL, the tracker on by default, holds the same rows."""
    import csv

    with open(ran.cwd / "logs" / "metrics.csv", newline="") as f:
        lines = [(key, int(step), float(value)) for key, step, value in csv.reader(f)]
    assert lines == [("loss", 0, 1.0), ("loss", 1, 0.5), ("loss", 2, pytest.approx(1 / 3))]
    rows = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(k, v) for _, k, v in lines]


def _ray_single_controller(ran: Ran) -> None:
    """distributed.md "Ray: single controller": the rows the page lists, reduced per key."""
    rows = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    assert _steps(rows) == [0, 1, 2]
    for row in rows:
        m = row["metrics"]
        assert {"train/loss", "train/grad_norm", "timing/train"} <= set(m)
        assert m["train/tokens"] == 512 + 256  # summed over the two workers
        assert 0.1 <= m["train/loss"] <= 1.0 and 0.5 <= m["train/grad_norm"] <= 2.0
        slowest, fastest = (
            m["train/timing/forward_backward"], m["train/timing/forward_backward/min"]
        )  # fmt: skip
        assert 0 < fastest <= slowest
    scalars = tensorboard_scalars(ran.cwd / "logs" / "tensorboard")
    assert [s for s, _ in scalars["train/tokens"]] == [0, 1, 2]


def _ray_aggregator(ran: Ran) -> None:
    """distributed.md "Pushing instead of returning": both workers' pushes, drained per step."""
    rows = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    # the mean of 100 and 200, at each step
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (step, {"response_length": 150.0}) for step in range(3)
    ]


def _torchrun_reduce(ran: Ran) -> None:
    """distributed.md "torchrun (SPMD)": rank 0 logs what 8 ranks reduced."""
    rows = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    assert _steps(rows) == list(range(5))
    for row in rows:
        m = row["metrics"]
        assert m["train/tokens"] == 8 * 512
        assert 0.1 <= m["train/loss"] <= 1.0 and 0.5 <= m["train/grad_norm"] <= 2.0
        t = m["train/timing/step"]
        assert 0 <= m["train/timing/step/min"] <= m["train/timing/step/mean"] <= t
    scalars = tensorboard_scalars(ran.cwd / "logs" / "tensorboard")
    assert [s for s, _ in scalars["train/tokens"]] == list(range(5))


def _torchrun_worker_metrics(ran: Ran) -> None:
    """distributed.md: WorkerMetrics snapshots of 8 ranks gathered and merged on rank 0."""
    rows = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    assert _steps(rows) == [0, 1, 2]
    for row in rows:
        assert row["metrics"]["train/tokens"] == 8 * 512
        assert row["metrics"]["train/timing/step"] >= 0


def _grafana_otlp(ran: Ran) -> None:
    """grafana.md: the run's values reach the collector (OTEL_EXPORTER_OTLP_ENDPOINT)."""
    receiver: OtlpHttpReceiver = ran.server
    assert receiver.last_point("train/loss").as_double == pytest.approx(1 / 3)
    rows = jsonl_rows(ran.cwd / "logs" / "run1" / "metrics.jsonl")
    assert [r["metrics"]["train/loss"] for r in rows] == [1.0, 0.5, pytest.approx(1 / 3)]


def _nemo_rl_loop(ran: Ran) -> None:
    """migrating.md: NeMo RL's loop, unchanged, on the drop-in."""
    logs = ran.cwd / "logs"
    scalars = tensorboard_scalars(logs / "tensorboard")
    assert scalars["train/loss"] == [(s, 0.5) for s in range(1, 5)]
    assert scalars["validation/accuracy"] == [(2, 0.75), (4, 0.75)]
    assert [s for s, _ in scalars["timing/train/total_step_time"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["train/reward/mean"]] == pytest.approx([2 / 3] * 4)
    for step in range(1, 5):
        lines = jsonl_rows(logs / f"train_data_step{step}.jsonl")
        assert lines == [
            {"prompt": ["What is 2 + 2?"], "reward": [1.0], "idx": 0},
            {"prompt": ["Name a prime."], "reward": [0.0], "idx": 1},
        ]
    for step in (2, 4):
        assert f"TRAINING STEP {step}" in ran.stdout
    assert "TRAINING STEP 1" not in ran.stdout
    assert "Sample 1 | Reward: 1.0000" in ran.stdout


def _gauge(page: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", page, re.M))


def _rollout_api(ran: Ran) -> None:
    """rollout-monitoring.md "Python API": the rows of the served vLLM page, and the SD file."""
    emitted = {}
    for line in ran.stdout.splitlines():
        step, values = line.split(" ", 1)
        emitted[int(step)] = ast.literal_eval(values)
    # the three steps close in one round: the rows go to the latest (the page says so)
    assert list(emitted) == [2]
    rows = emitted[2]
    assert rows["rollout/engines_reporting"] == 1.0
    running = _gauge(V1_FIRST, "vllm:num_requests_running")
    assert rows["rollout/requests_running_mean"] == rows["rollout/requests_running_max"] == running
    kv = _gauge(V1_FIRST, "vllm:kv_cache_usage_perc")
    assert rows["rollout/kv_cache_usage_mean"] == pytest.approx(kv)
    assert rows["rollout/engine.0.requests_waiting_mean"] == _gauge(
        V1_FIRST, "vllm:num_requests_waiting"
    )
    [group] = json.loads((ran.cwd / "sd" / "rollout" / "run.json").read_text())
    served = ran.server.url.split("/")[2]
    assert group["targets"] == [served, "127.0.0.1:8001"]
    assert group["labels"]["otel_rl_run_id"] == "grpo-run-1"


def _traced_driver(ran: Ran) -> None:
    """tracing.md "The driver": one trace per step; the actors' timer spans hang under the
    driver timer that called them; each row carries its step's trace id."""
    rows = jsonl_rows(ran.cwd / "logs" / "run1" / "metrics.jsonl")
    assert _steps(rows) == [0, 1, 2]

    def complete(spans: list) -> bool:
        names = Counter(s.name for _, s in spans)
        return names["rl.step"] == 3 and names["generate"] == 6 and names["forward"] == 6

    spans = _wait_for(ran.server, complete)
    assert complete(spans), Counter(s.name for _, s in spans)
    by_id = {s.span_id: s for _, s in spans}
    for row in rows:
        [step_span] = [
            s for _, s in spans if s.name == "rl.step" and _attrs(s)["rl.step"] == row["step"]
        ]
        assert row["metrics"]["trace_id"] == step_span.trace_id.hex()
        in_step = [(r, s) for r, s in spans if s.trace_id == step_span.trace_id]
        for timer, driver_timer in (("generate", "rollout"), ("forward", "update")):
            found = [(r, s) for r, s in in_step if s.name == timer]
            assert sorted(r["otel_rl.rank"] for r, _ in found) == [0, 1]
            for resource, span in found:
                assert resource["otel_rl.role"] == "trainer"
                chain = _ancestors(span, by_id)
                assert chain[-2:] == [driver_timer, "rl.step"], chain
        longest = max(_duration(s) for _, s in in_step if s.name == "forward")
        assert row["metrics"]["workers/timing/forward"] == pytest.approx(longest, abs=1e-6)
    # the trace file has each span's parent: Ray's spans, in the actors and the driver, too
    on_disk = [span for _, span in trace_file_spans(ran.cwd / "logs" / "run1")]
    ids = {s.span_id for s in on_disk}
    assert [s.name for s in on_disk if s.parent_span_id not in (b"", *ids)] == []
    assert Counter(s.name for s in on_disk)["Trainer.train ray.remote_worker"] == 6


def _trace_carrier(ran: Ran) -> None:
    """tracing.md "explicit traceparent": the workers' spans join the driver's timer by hand."""
    [row] = jsonl_rows(ran.cwd / "logs" / "metrics.jsonl")
    assert row["metrics"]["responses"] == 4.0

    def complete(spans: list) -> bool:
        return Counter(s.name for _, s in spans)["decode"] == 2

    spans = _wait_for(ran.server, complete)
    assert complete(spans), Counter(s.name for _, s in spans)
    [rollout] = [s for r, s in spans if s.name == "rollout" and r["otel_rl.role"] == "driver"]
    assert rollout.trace_id.hex() == row["metrics"]["trace_id"]
    decode = [(r, s) for r, s in spans if s.name == "decode"]
    assert sorted(r["otel_rl.rank"] for r, _ in decode) == [0, 1]
    for resource, span in decode:
        assert resource["otel_rl.role"] == "rollout"
        assert span.trace_id == rollout.trace_id and span.parent_span_id == rollout.span_id


#: The page's command in otel-metrics-exporter.md, without the MLflow server: with no
#: MLFLOW_TRACKING_URI, the exporter uses the local store the page names.
_OTEL_INSTRUMENT_ENV = {
    "OTEL_METRICS_EXPORTER": "tensorboard,mlflow",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
    "OTEL_RL_LOG_DIR": "logs",
    "OTEL_RL_STEP_GAUGE": "train.step",
    "MLFLOW_EXPERIMENT_NAME": "grpo-dev",
}

#: (document, a line that identifies the block) -> how it is run and what it must leave.
EXPECTED: dict[tuple[str, str], How] = {
    ("README.md", "def generate_and_score() -> list[float]:"): How(_usage_block),
    ("docs/quickstart.md", "def rollout() -> list[float]:"): How(_quickstart_loop),
    ("docs/backends/otel-metrics-exporter.md", "# train.py: OTel API only"): How(
        _otel_api_only,
        env=lambda server: dict(_OTEL_INSTRUMENT_ENV),
        command=("opentelemetry-instrument", "python", "train.py"),
    ),
    ("docs/backends/tensorboard.md", "acc = EventAccumulator("): How(_tensorboard_reader),
    # The verdict names a lock's line from the script's source, which `python -c` has not.
    ("docs/stalls.md", "# train.py: a lock held by another thread"): How(
        command=("python", "train.py")
    ),
    ("docs/backends/README.md", "class CsvTracker(Tracker):"): How(_csv_tracker),
    ("docs/distributed.md", "class PolicyWorker:"): How(_ray_single_controller),
    ("docs/distributed.md", "aggregator = MetricsAggregator.start()"): How(_ray_aggregator),
    ("docs/distributed.md", "reduced = reduce_across_ranks("): How(_torchrun_reduce),
    ("docs/distributed.md", "dist.gather_object("): How(_torchrun_worker_metrics),
    ("docs/grafana.md", 'cfg["otlp"] = {"enabled": True}'): How(
        _grafana_otlp, server=lambda: _serving(OtlpHttpReceiver), env=_otlp_env
    ),
    ("docs/migrating.md", "logger.log_batched_dict_as_jsonl("): How(_nemo_rl_loop),
    ("docs/rollout-monitoring.md", "monitor = RolloutMonitor("): How(
        _rollout_api,
        server=lambda: _serving(lambda: PageServer(V1_FIRST)),
        env=lambda server: {"ROLLOUT_ENDPOINTS": server.url},
    ),
    ("docs/tracing.md", '_tracing_startup_hook="otel_rl.ray.tracing:setup"'): How(
        _traced_driver, server=lambda: _serving(OtlpTraceReceiver), env=_traced_env
    ),
    ("docs/tracing.md", "carrier = trace_carrier()"): How(
        _trace_carrier, server=lambda: _serving(OtlpTraceReceiver), env=_traced_env
    ),
}


def _how(block: Block) -> How:
    found = [how for (doc, marker), how in EXPECTED.items()
             if doc == block.doc and marker in block.code]  # fmt: skip
    assert len(found) <= 1, block.id
    return found[0] if found else How()


def test_every_expected_block_is_still_in_the_docs():
    """A check whose block was rewritten away would pass by never running."""
    for doc, marker in EXPECTED:
        found = [b for b in ALL_BLOCKS if b.doc == doc and marker in b.code]
        assert len(found) == 1, (doc, marker)
        assert found[0].kind == "run", found[0].id


def test_the_otel_instrument_command_is_the_pages():
    page = (ROOT / "docs/backends/otel-metrics-exporter.md").read_text(encoding="utf-8")
    assert "opentelemetry-instrument python train.py" in page
    for name, value in _OTEL_INSTRUMENT_ENV.items():
        assert f"{name}={value}" in page, name


def _program(name: str) -> str:
    if name == "python":
        return sys.executable
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed"
    return found


def _argv(block: Block, how: How, cwd: Path) -> list[str]:
    """The command that runs the block in ``cwd`` (writing it to its file where it has one)."""
    if how.command:
        *argv, script = how.command
        (cwd / script).write_text(block.code, encoding="utf-8")
        return [_program(a) for a in argv] + [script]
    torchrun = _TORCHRUN.match(block.code)
    if torchrun:
        (cwd / torchrun["script"]).write_text(block.code, encoding="utf-8")
        # a free rendezvous port: another job on the machine may hold torchrun's default 29500
        return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()),
                *torchrun["options"].split(), torchrun["script"]]  # fmt: skip
    return [sys.executable, "-c", block.code]


#: Outcome of each block tried in this session: "run" or "failing".
_OUTCOMES: dict[str, str] = {}


class _CountLine:
    """Writes the per-page count of blocks at the end of the session's report."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        terminalreporter.write_sep("-", "doc blocks: run / fragment / not-run / failing")
        total: Counter[str] = Counter()
        for doc in DOCS:
            blocks = [b for b in ALL_BLOCKS if b.doc == doc]
            if not blocks:
                continue
            count = _count(blocks)
            total.update(count)
            write(f"{doc}: {_format(count)}")
        write(f"total ({len(ALL_BLOCKS)} blocks): {_format(total)}")


def _count(blocks: list[Block]) -> Counter[str]:
    count: Counter[str] = Counter()
    for block in blocks:
        if block.kind != "run":
            count[block.kind] += 1
        else:
            count[_OUTCOMES.get(block.id, "not tried")] += 1
    return count


def _format(count: Counter[str]) -> str:
    line = (
        f"{count['run']} run / {count['fragment']} fragment / {count['not-run']} not-run / "
        f"{count['failing']} failing"
    )
    return line + (f" ({count['not tried']} not tried here)" if count["not tried"] else "")


@pytest.fixture(scope="module", autouse=True)
def _count_line(request: pytest.FixtureRequest) -> None:
    plugins = request.config.pluginmanager
    if not plugins.has_plugin("otel-rl-doc-blocks"):
        plugins.register(_CountLine(), "otel-rl-doc-blocks")


def _clean_env() -> dict[str, str]:
    """The test's environment less what would point a block elsewhere than a reader's fresh
    shell: OTel settings, a Ray cluster to join."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "RAY_ADDRESS"}


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=[pytest.mark.slow] if b.kind == "run" else []) for b in ALL_BLOCKS],
    ids=[b.id for b in ALL_BLOCKS],
)
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.kind != "run":
        pytest.skip(f"{block.kind}: {(block.reason or '').strip()}")
    _OUTCOMES[block.id] = "failing"
    how = _how(block)
    cwd = tmp_path / "reader"
    cwd.mkdir()
    with how.server() if how.server else nullcontext() as server:
        returncode, stdout, stderr = _run(_argv(block, how, cwd), cwd, how.env(server))
        assert returncode == 0, f"{block.id} failed as written:\n{stderr[-3000:]}"
        assert "Traceback" not in stderr, stderr[-3000:]
        if how.check is not None:
            how.check(Ran(cwd, stdout, server))
    _OUTCOMES[block.id] = "run"


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run in its own process group: a block past its timeout goes with everything it started
    (torchrun's ranks, a Ray driver's cluster)."""
    process = subprocess.Popen(
        argv, cwd=cwd, env={**_clean_env(), **env}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(argv[:3])}: still running after {TIMEOUT_S} s\n{stderr[-3000:]}")
    return process.returncode, stdout, stderr


# ---- the benchmarks after the README's first command --------------------------------------------

#: What ``pip install -e ".[all]"`` leaves out that some benchmarks need (the test extra has them).
#: They are installed here, so their absence is simulated: a ``None`` in ``sys.modules`` makes
#: ``import torch`` raise ModuleNotFoundError exactly as on a machine without the package.
NOT_IN_ALL = ("torch", "pytest")

_WITHOUT = (
    "import runpy, sys\n"
    "for name in {names!r}:\n"
    "    sys.modules[name] = None\n"
    "sys.argv = ['benchmarks', *sys.argv[1:]]\n"
    "runpy.run_module('benchmarks', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.slow
@pytest.mark.long
def test_quick_benchmarks_without_the_test_extra_skip_and_name_what_is_missing(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(names=NOT_IN_ALL), "--quick",
         "--only", "artifact_dump,training_thread,spool_drain", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    install = 'pip install -e ".[all,test]"'
    assert f"   skipped: needs torch ({install})" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == (
        "skipped 2 benchmark(s): artifact_dump (needs torch), training_thread (needs torch); "
        f"{install} installs everything they need"
    )
    results = json.loads(out.read_text())
    assert results["artifact_dump"] == {"skipped": "needs torch"}
    assert results["training_thread"] == {"skipped": "needs torch"}
    assert "skipped" not in results["spool_drain"] and "error" not in results["spool_drain"]


def test_the_readme_says_what_the_benchmarks_need():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(row for row in readme.splitlines() if row.startswith("| `python -m benchmarks"))
    assert 'pip install -e ".[all,test]"' in line and "torch" in line and "skipped" in line
    # the two commands of "Two commands" are what they claim
    assert 'pip install -e ".[all]" && otel-rl demo' in readme
    assert 'pip install -e ".[all,test]" && python -m pytest -q' in readme


def test_ci_runs_the_readme_s_test_command():
    """The README's test command is what ``.ci/run`` runs: its install, and each of its pytest
    invocations (CI adds ``-ra``, the reasons of skips and failures)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = 'pip install -e ".[all,test]" && python -m pytest'
    command = next(line for line in readme.splitlines() if line.startswith(first))
    install, *runs = command.split(" && ")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f'python -m pip install -q {install.split(" ", 2)[2]}' in ci
    for run in runs:
        args = run.removeprefix("python -m pytest -q").strip()
        assert f"python -m pytest -q -ra {args}".rstrip() in ci, run
