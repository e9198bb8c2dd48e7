"""The recipes of docs/recipes/, run as their pages say: each page's config block is read from
the page itself (the ```yaml block after ``<!-- recipe-config -->``), so the page and this test
cannot drift apart. Only the addresses a test must provide are changed, as a job's command-line
overrides would change them (:func:`recipe_config`); relative paths land in the test's working
directory.

Each config runs through a loop of its framework's shape, on the drop-in with the timer the
recipe imports, for five steps, and every output is read back with a real reader:

- NeMo RL GRPO (``otel_rl.compat.nemo_rl``): JSONL, TensorBoard, W&B offline (W&B's own
  decoder), Prometheus, an OTLP collector (metrics and one trace per step), GPU rows from the
  8 x H100 fixture node, rollout rows of vLLM engines forwarded to a real local Ray cluster
  (``source: ray``), and no stall report;
- verl PPO (``otel_rl.compat.verl``): the same with MLflow (a real server) instead of W&B, and
  the vLLM engine's own ``/metrics`` page added by the recipe's line in ``fit()``.

Each test prints what appears where (``pytest -s``): the recipe pages show that output.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testkit import servers
from testkit.gpu_nodes import NodeFarm, render, simulated_node
from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of
from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.rollout_pages import V1_EXP, V1_FIRST, V1_LATER, PageServer

omegaconf = pytest.importorskip("omegaconf")
OmegaConf = omegaconf.OmegaConf

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
MARKER = "<!-- recipe-config -->"
_BLOCK = re.compile(
    re.escape(MARKER) + r"[ \t]*\n```yaml[ \t]*\n(?P<yaml>.*?)^```[ \t]*$", re.S | re.M
)
STEPS = (1, 2, 3, 4, 5)
WORK_S = 0.002  # each timed block's work
TOLERANCE_S = 1e-6  # a span lasts its timer's value (nanoseconds against float seconds)

#: What simulated_node(1) serves for GPU i: utilization (8 + i) %, (40010 + i) MiB used of 81559.
GPU_NODE = simulated_node(1)


def recipe_yaml(page: str) -> str:
    """The config block of ``docs/recipes/<page>``: the one ```yaml block after the marker."""
    text = (RECIPES / page).read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"{page}: one {MARKER} line, before the config block"
    (block,) = _BLOCK.findall(text)
    return block


_ABSENT = object()


def recipe_config(page: str, section: str, otlp_endpoint: str, gpu_node: str) -> Any:
    """The recipe's block as an OmegaConf config (as Hydra, and NeMo RL's ``load_config``, read
    a YAML file), with the addresses this test provides, as a job's command-line overrides
    would set them, and nothing else changed (``section``: where the recipe's otel-rl keys are):

    - ``<section>.otlp.endpoint``: the test's collector instead of the recipe's;
    - ``<section>.prometheus.port``: 0 (a free port) instead of the recipe's;
    - ``<section>.gpu_monitoring.endpoints``, added: the fixture node, where the recipe's run
      finds its nodes with ``ray.nodes()``.
    """
    cfg = OmegaConf.create(recipe_yaml(page))
    replaced = {f"{section}.otlp.endpoint": otlp_endpoint, f"{section}.prometheus.port": 0}
    for key, value in replaced.items():
        assert OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT, f"{page}: no {key}"
        OmegaConf.update(cfg, key, value, merge=False)
    key = f"{section}.gpu_monitoring.endpoints"
    assert OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT, f"{page} sets {key}"
    OmegaConf.update(cfg, key, [gpu_node], merge=False, force_add=True)
    return cfg


@pytest.fixture
def collector() -> Iterator[OtlpHttpReceiver]:
    """An OTel Collector: metrics, traces and logs on one OTLP/HTTP address."""
    server = OtlpHttpReceiver()
    yield server
    server.close()


@pytest.fixture
def gpu_node() -> Iterator[str]:
    """A Ray node's metrics page (the 8 x H100 fixture with node 1's values)."""
    with NodeFarm() as farm:
        yield farm.add(render(GPU_NODE))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory; no OTel, verl, MLflow or W&B variable from outside."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "WANDB_", "MLFLOW_", "TENSORBOARD_", "VERL_", "SWANLAB_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    gc.collect()  # drop-ins an earlier test left unfinished are finished by now
    return tmp_path


# ---- readers ------------------------------------------------------------------------------------


def prometheus_page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def prometheus_samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` read with Prometheus's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def span_duration(span: Any) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9


def span_step(span: Any) -> int | None:
    for attribute in span.attributes:
        if attribute.key == "rl.step":
            return int(attribute.value.int_value)
    return None


def span_tree(spans: list[tuple[dict, Any]], root: Any) -> tuple:
    """``(name, (children in start order))`` of ``root``."""
    children: dict[bytes, list[Any]] = defaultdict(list)
    for _, span in spans:
        children[span.parent_span_id].append(span)

    def walk(span: Any) -> tuple:
        kids = sorted(children[span.span_id], key=lambda s: s.start_time_unix_nano)
        return (span.name, tuple(walk(child) for child in kids))

    return walk(root)


def span_text(spans: list[tuple[dict, Any]], root: Any) -> str:
    children: dict[bytes, list[Any]] = defaultdict(list)
    for _, span in spans:
        children[span.parent_span_id].append(span)
    lines: list[str] = []

    def walk(span: Any, depth: int) -> None:
        step = span_step(span)
        name = f"{span.name} rl.step={step}" if step is not None else span.name
        lines.append(f"{'    ' * depth}{name}  {span_duration(span) * 1000:.1f} ms")
        for child in sorted(children[span.span_id], key=lambda s: s.start_time_unix_nano):
            walk(child, depth + 1)

    walk(root, 0)
    return "\n".join(lines)


def traces_by_step(spans: list[tuple[dict, Any]]) -> dict[int, tuple[Any, list]]:
    """``{step: (its rl.step span, the spans of its trace)}``; one root span per step."""
    roots = [s for _, s in spans if s.name == "rl.step"]
    by_step = {span_step(s): s for s in roots}
    assert len(by_step) == len(roots), "one rl.step span per step"
    assert all(s.parent_span_id == b"" for s in roots)
    return {
        step: (root, [(r, s) for r, s in spans if s.trace_id == root.trace_id])
        for step, root in by_step.items()
    }


def leaf(name: str) -> tuple:
    return (name, ())


def work() -> None:
    time.sleep(WORK_S)


def f32(x: float) -> float:
    """What TensorBoard keeps of a float."""
    return float(np.float32(x))


# ---- what appears where (printed with pytest -s; the recipe pages show it) ----------------------


def show(title: str, lines: list[str]) -> None:
    print(f"\n--- {title} ---")
    print("\n".join(lines))


def line_excerpt(line: dict[str, Any], keys: tuple[str, ...]) -> str:
    """A JSONL line with ``keys`` of its metrics only; how many others there are."""
    shown = {k: line["metrics"][k] for k in keys if k in line["metrics"]}
    head = {k: v for k, v in line.items() if k not in ("metrics", "time")}
    more = len(line["metrics"]) - len(shown)
    return json.dumps({**head, "metrics": shown})[:-2] + f", ...{more} more}}}}"


def grouped(names: list[str]) -> list[str]:
    """Names with a common prefix as one line: ``train/reward/{count,max,mean}``."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        cut = max(name.rfind("/"), name.rfind("."))
        groups[name[: cut + 1]].append(name[cut + 1 :])
    return [f"{prefix}{{{','.join(rest)}}}" if len(rest) > 1 else prefix + rest[0]
            for prefix, rest in groups.items()]  # fmt: skip


PROMETHEUS_SHOWN = (
    "train_loss", "validation_accuracy", "actor_pg_loss", "timing_train_total_step_time",
    "timing_s_gen", "ray_node_gpu_utilization_percent", "ray_node_gpu_memory_used_bytes",
    "otel_rl_step", "otel_rl_stalled", "otel_rl_seconds_since_step",
)
JSONL_SHOWN = (
    "train/loss", "actor/pg_loss", "timing/train/total_step_time", "timing_s/gen", "trace_id",
    "rollout/requests_finished", "rollout/prefix_cache_hit_rate", "rollout/kv_cache_usage_mean",
    "rollout/ttft_p90_s", "rollout/engine.0.requests_running_mean", "ray/ray_step",
    "ray/node.0.gpu.0.util", "ray/node.0.gpu.0.mem_gb", "ray/node.0.gpu.0.mem_total_gb",
)


def show_outputs(lines: list[dict], tb: dict, page: str, collector: OtlpHttpReceiver,
                 traces: dict[int, tuple[Any, list]], step: int) -> None:  # fmt: skip
    """Each output of a run, trimmed to a few lines."""
    at_step = [x for x in lines if x["step"] == step and x.get("axis") != "ray/ray_step"]
    gpu = [x for x in lines if x.get("axis") == "ray/ray_step"][:1]
    show(f"JSONL: the lines of step {step}, and a GPU line",
         [line_excerpt(x, JSONL_SHOWN) for x in at_step + gpu])  # fmt: skip
    show("TensorBoard tags", grouped(list(tb)))
    shown = page.splitlines()
    show("Prometheus /metrics", [
        x for name in PROMETHEUS_SHOWN
        for x in [y for y in shown if y.startswith((name + "{", name + " "))][:2]
    ])  # fmt: skip
    show("OTLP metric names received", grouped(list(collector.names())))
    show("OTLP log records received", [str(len(collector.logs))])
    for number, (root, trace) in sorted(traces.items()):
        if len(trace) == max(len(t) for _, t in traces.values()):
            show(f"spans of step {number} (trace {root.trace_id.hex()})", [span_text(trace, root)])
            break


def trimmed_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A training row, a GPU row and an engine row of a W&B run, a few keys each."""
    keys = ("global_step", "ray/ray_step", "rollout/step", *JSONL_SHOWN)
    out = []
    for axis in ("global_step", "ray/ray_step", "rollout/step"):
        row = next(r for r in history if axis in r)
        out.append({k: row[k] for k in keys if k in row})
    return out


def no_stall(log_dir: Path, samples: dict, collector: OtlpHttpReceiver) -> None:
    """The watchdog ran (its gauges are on the page) and saw none: no report, no event."""
    assert sample(samples, "otel_rl_stalled") == 0.0
    assert 0.0 <= sample(samples, "otel_rl_seconds_since_step") < 60.0
    assert not (log_dir / "stalls").exists()
    assert not (log_dir / "events.jsonl").exists()
    assert not any(r.event_name == "otel_rl/stall" for _, r in collector.logs)
    assert "otel_rl.stalled" in collector.names()


KV_LATER = V1_EXP["kv_cache_usage"]["later"]
#: The rows the vLLM fixture gives over the interval between its two pages (vllm-v1-expected.json).
#: Its rates (``*_per_s``) are over its 10 s; here they divide by the seconds between this run's
#: scrapes, so only their ratio is the fixture's.
ENGINE_STEP = {
    "requests_finished": float(V1_EXP["requests_finished"]),
    "preemptions": float(V1_EXP["preemptions_delta"]),
    "prefix_cache_hit_rate": V1_EXP["prefix_cache"]["hit_rate"],
    "ttft_p50_s": V1_EXP["time_to_first_token_seconds"]["p50"],
    "ttft_p90_s": V1_EXP["time_to_first_token_seconds"]["p90"],
    "e2e_latency_p90_s": V1_EXP["e2e_request_latency_seconds"]["p90"],
}


def check_engine_rows(rows: dict[int, dict[str, float]], steps: list[int], busy_step: int) -> None:
    """One engine, a row at every step; it went from its first fixture page to its later one
    during ``busy_step``, and stood on the later page afterwards."""
    assert sorted(rows) == steps
    for step, row in rows.items():
        assert row["rollout/engines_reporting"] == 1.0
        assert row["rollout/engine.0.requests_running_max"] == 64.0  # both pages: 64 running
        if step == busy_step:
            for name, value in ENGINE_STEP.items():
                assert row[f"rollout/{name}"] == pytest.approx(value, rel=1e-9), name
            assert row["rollout/gen_tokens_per_s"] / row["rollout/prompt_tokens_per_s"] == (
                pytest.approx(V1_EXP["generation_tokens_delta"] / V1_EXP["prompt_tokens_delta"])
            )
            assert row["rollout/kv_cache_usage_max"] == pytest.approx(KV_LATER)
        elif step < busy_step:  # the engine's first scrape: gauges, no increase yet
            assert "rollout/requests_finished" not in row
            assert row["rollout/requests_waiting_max"] == 12.0  # the first page's queue
        else:
            assert row["rollout/requests_finished"] == 0.0
            assert row["rollout/requests_waiting_max"] == 9.0  # the later page's queue
            assert row["rollout/kv_cache_usage_mean"] == pytest.approx(KV_LATER)
            assert "rollout/ttft_p90_s" not in row  # no request finished: no quantile


def gpu_rows_hold_the_node(rows: list[dict[str, Any]]) -> None:
    """Every GPU row holds the fixture node's values (node 0: the first node seen)."""
    assert rows
    for values in rows:
        for i, gpu in GPU_NODE.gpus.items():
            assert values[f"ray/node.0.gpu.{i}.util"] == gpu.utilization
            assert values[f"ray/node.0.gpu.{i}.mem_gb"] == pytest.approx(gpu.used_mib / 1024)
            total = (gpu.used_mib + gpu.available_mib) / 1024
            assert values[f"ray/node.0.gpu.{i}.mem_total_gb"] == pytest.approx(total)
        assert values["ray/node.0.mem_gb"] == pytest.approx(GPU_NODE.mem_used / 2**30)


# ---- NeMo RL: GRPO on otel_rl.compat.nemo_rl ---------------------------------------------------


@pytest.fixture
def ray_engine() -> Iterator[tuple[Any, Any, str]]:
    """A vLLM engine inside a Ray actor that forwards its metrics to Ray, as vLLM's
    ``RayPrometheusStatLogger`` records them, on a real local Ray cluster; it has served the
    fixture's first page. Yields ``(ray, the actor, its node's metrics page)``."""
    ray = pytest.importorskip("ray")
    from tests.sources.test_rollout_ray_source import ForwardingEngine, recording_ops

    ray.init(
        num_cpus=2,
        include_dashboard=False,  # the node's metrics agent still starts
        object_store_memory=100 * 2**20,
        logging_level="ERROR",
        log_to_driver=False,
        # As rollout-monitoring.md says for short steps: workers push every second.
        _system_config={"metrics_report_interval_ms": 1000},
        # the workers import the engine's class from this checkout, whatever the current dir
        job_config=ray.job_config.JobConfig(code_search_path=[str(ROOT)]),
    )
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        actor = ray.remote(num_cpus=0)(ForwardingEngine).remote()
        ray.get(actor.record.remote(recording_ops(V1_FIRST)))
        wait_for_ray_page(url, V1_FIRST)
        yield ray, actor, url
    finally:
        ray.shutdown()


def wait_for_ray_page(url: str, page: str, timeout: float = 60.0) -> None:
    """Until the node's page shows the engine as it is on ``page``: every counter, gauge and
    histogram the rows read. A worker can push its metrics while a recording is under way; the
    page then shows the counters recorded first at their new values and the histograms recorded
    last in part, and a step closed on that page would hold part of the work."""
    from otel_rl.rollout.engines import parse_engine_page, parse_ray_node_page

    (want,) = parse_engine_page(page).values()
    deadline = time.monotonic() + timeout
    while True:
        seen = list(parse_ray_node_page(prometheus_page(url)).values())
        if [(s.counters, s.gauges, s.histograms) for s in seen] == [
            (want.counters, want.gauges, want.histograms)
        ]:
            return
        assert time.monotonic() < deadline, f"the node's page never showed {page[:80]}: {seen}"
        time.sleep(0.1)


def nemo_validate(step: int) -> tuple[dict[str, float], dict[str, float]]:
    """NeMo RL's ``validate()``: its own Timer, its metrics and timings."""
    from otel_rl.compat.nemo_rl import Timer

    timer = Timer()
    with timer.time("total_validation_time"):
        work()
    return {"accuracy": 0.5 + 0.05 * step}, timer.get_timing_metrics(reduction_op="sum")


def nemo_grpo_tree(validate: bool, save: bool) -> tuple:
    return ("rl.step", (("total_step_time", (
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
        *((leaf("total_validation_time"),) if validate else ()),
        *((leaf("checkpointing"),) if save else ()),
    )),))  # fmt: skip


@pytest.mark.slow
def test_nemo_rl_recipe(workdir, collector, gpu_node, ray_engine, monkeypatch):
    from otel_rl.compat.nemo_rl import Logger, Timer
    from testkit.tracker_readers import read_wandb, wandb_offline_env, wandb_run_dirs
    from tests.sources.test_rollout_ray_source import recording_ops

    ray, engine, node_page = ray_engine
    # W&B without a network, as on a cluster without internet access (wandb sync uploads later)
    wandb_offline_env(monkeypatch, workdir)

    # The experiment YAML: NeMo RL's sections, and the recipe's logger section as the page has it.
    experiment = OmegaConf.create({
        "grpo": {"num_prompts_per_step": 32, "num_generations_per_prompt": 16, "val_period": 2,
                 "max_num_steps": len(STEPS)},
        "policy": {"model_name": "Qwen/Qwen2.5-1.5B", "generation": {"backend": "vllm",
                   "vllm_cfg": {"async_engine": False, "enable_vllm_metrics_logger": True,
                                "gpu_memory_utilization": 0.6}}},
        "checkpointing": {"save_period": 5},
    })  # fmt: skip
    recipe = recipe_config("nemo-rl.md", "logger", collector.endpoint, gpu_node)
    master_config = OmegaConf.to_container(OmegaConf.merge(experiment, recipe), resolve=True)

    logger = Logger(master_config["logger"])
    try:
        logger.log_hyperparams(master_config)
        log_dir = Path(logger.base_log_dir)
        monitor = logger.rollout_monitor
        assert monitor is not None and monitor.source == "ray"
        assert monitor.wait_rounds(1)  # the scrape made when the monitor started
        grpo = master_config["grpo"]
        timer = Timer()
        timings: dict[int, dict[str, float]] = {}
        for step in STEPS:
            validate = step % grpo["val_period"] == 0
            save = step % master_config["checkpointing"]["save_period"] == 0
            with timer.time("total_step_time"):
                with timer.time("data_processing"):
                    work()
                with (
                    timer.time("prepare_for_generation/total"),
                    timer.time("prepare_for_generation/transfer_and_update_weights"),
                ):
                    work()
                with timer.time("generation"):
                    if step == 1:  # the engine's work: the fixture's first page to its later one
                        ray.get(engine.record.remote(recording_ops(V1_LATER, V1_FIRST)))
                        wait_for_ray_page(node_page, V1_LATER)
                    work()
                    logger.log_metrics({"mean_gen_tokens_per_sample": 500.0 + step}, step,
                                       prefix="train")  # fmt: skip
                for label in ("reward_calculation", "logprob_inference_prep",
                              "policy_and_reference_logprobs", "advantage_calculation",
                              "training_prep", "policy_training"):  # fmt: skip
                    with timer.time(label):
                        work()
                if validate:
                    val_metrics, validation_timings = nemo_validate(step)
                    logger.log_metrics(validation_timings, step, prefix="timing/validation")
                    logger.log_metrics(val_metrics, step, prefix="validation")
                if save:
                    with timer.time("checkpointing"):
                        work()
            logger.log_batched_dict_as_jsonl(
                {"content": [f"step {step} sample {i}" for i in range(2)], "rewards": [1.0, 0.0]},
                f"train_data_step{step}.jsonl",
            )
            metrics = {"loss": 1.0 / step, "reward": [0.0, 1.0, 1.0, 0.5 * step], "grad_norm": 2.0}
            timings[step] = timer.get_timing_metrics(reduction_op="sum")
            logger.log_metrics(metrics, step, prefix="train")
            logger.log_metrics(timings[step], step, prefix="timing/train", step_finished=True)
            timer.reset()
            # A real step lasts longer than the monitor's interval (5 s): its closing scrape comes
            # by itself. These last milliseconds: scrape now, so that each step has its own rows.
            assert monitor.flush(timeout=30)

        page = prometheus_page(logger.prometheus_url)
    finally:
        logger.finish()  # also when a check above fails: no thread outlives the test

    # ---- JSONL: training rows, GPU rows (ray/ray_step), engine rows (rollout/step) ----
    lines = jsonl_rows(log_dir / "metrics.jsonl")
    train = {r["step"]: r["metrics"] for r in lines if "axis" not in r}
    gpu = [r["metrics"] for r in lines if r.get("axis") == "ray/ray_step"]
    engine_rows = {r["step"]: r["metrics"] for r in lines if r.get("axis") == "rollout/step"}
    assert sorted(train) == list(STEPS)
    for step, row in train.items():
        assert row["train/loss"] == 1.0 / step
        assert row["train/reward/max"] == max(1.0, 0.5 * step)
        assert row["train/mean_gen_tokens_per_sample"] == 500.0 + step
        for label, seconds in timings[step].items():
            assert row[f"timing/train/{label}"] == seconds
        assert ("validation/accuracy" in row) == (step % 2 == 0)
    assert train[4]["validation/accuracy"] == pytest.approx(0.7)
    assert train[4]["timing/validation/total_validation_time"] >= WORK_S
    gpu_rows_hold_the_node(gpu)
    check_engine_rows(engine_rows, list(STEPS), busy_step=1)
    assert jsonl_rows(log_dir / "train_data_step3.jsonl") == [
        {"content": ["step 3 sample 0"], "rewards": [1.0], "idx": 0},
        {"content": ["step 3 sample 1"], "rewards": [0.0], "idx": 1},
    ]

    # ---- TensorBoard ----
    tb = tensorboard_scalars(log_dir / "tensorboard")
    assert tb["train/loss"] == [(s, f32(1.0 / s)) for s in STEPS]
    assert tb["validation/accuracy"] == [(2, f32(0.6)), (4, f32(0.7))]
    assert tb["timing/train/total_step_time"] == [
        (s, f32(timings[s]["total_step_time"])) for s in STEPS
    ]
    assert {v for _, v in tb["ray/node.0.gpu.3.util"]} == {11.0}
    assert tb["rollout/requests_finished"] == [(s, 48.0 if s == 1 else 0.0) for s in STEPS]

    # ---- W&B (offline), read with W&B's own decoder ----
    (run_dir,) = wandb_run_dirs(log_dir)
    run = read_wandb(run_dir)
    assert run.series("train/loss") == [(s, 1.0 / s) for s in STEPS]
    assert run.series("validation/accuracy") == [(2, pytest.approx(0.6)), (4, pytest.approx(0.7))]
    assert run.series("rollout/requests_finished", "rollout/step") == [
        (s, 48.0 if s == 1 else 0.0) for s in STEPS
    ]
    assert {v for _, v in run.series("ray/node.0.gpu.3.util", "ray/ray_step")} == {11.0}
    assert run.config["grpo.num_generations_per_prompt"] == 16
    assert run.config["logger.wandb.project"] == "grpo-math"
    assert run.config["policy.generation.vllm_cfg.async_engine"] is True  # the recipe's
    assert run.config["policy.generation.vllm_cfg.gpu_memory_utilization"] == 0.6
    assert run.exit_code == 0

    # ---- Prometheus /metrics (read while the run was alive) ----
    samples = prometheus_samples(page)
    assert sample(samples, "train_loss") == 0.2
    assert sample(samples, "timing_train_total_step_time") == timings[5]["total_step_time"]
    assert sample(samples, "ray_node_gpu_utilization_percent", gpu="3") == 11.0
    assert sample(samples, "otel_rl_step") == 5.0

    # ---- the collector: metrics, one trace per step ----
    assert collector.last_point("train/loss").as_double == 0.2
    assert collector.last_point("validation/accuracy").as_double == pytest.approx(0.7)
    gpu3 = [p.as_double for _, n, _, p in collector.points()
            if n == "ray.node.gpu.utilization" and attributes_of(p.attributes)["gpu"] == 3]
    assert gpu3 and set(gpu3) == {11.0}
    expected = {s: nemo_grpo_tree(s % 2 == 0, s == 5) for s in STEPS}
    n_spans = sum(_size(tree) for tree in expected.values())
    spans = collector.wait_for_spans(n_spans)
    traces = traces_by_step(spans)
    assert sorted(traces) == list(STEPS)
    for step, (root, trace) in traces.items():
        assert span_tree(trace, root) == expected[step]
        assert train[step]["trace_id"] == root.trace_id.hex()
        for _, span in trace:
            if span.name in timings[step]:
                assert span_duration(span) == pytest.approx(timings[step][span.name],
                                                            abs=TOLERANCE_S)  # fmt: skip

    no_stall(log_dir, samples, collector)

    show_outputs(lines, tb, page, collector, traces, step=1)
    show("W&B: history rows (wandb leet inspect --json), and their axes", [
        *(json.dumps(row) for row in trimmed_history(run.history)),
        json.dumps({k: run.metrics[k] for k in
                    ("train/loss", "ray/node.0.gpu.0.util", "rollout/requests_finished")}),
    ])


def _size(tree: tuple) -> int:
    return 1 + sum(_size(child) for child in tree[1])


# ---- verl: PPO (GRPO) on otel_rl.compat.verl ---------------------------------------------------

mlflow_server = servers.mlflow_server

#: verl's own config around the recipe's keys (ppo_trainer.yaml's shape, GRPO settings).
VERL_CONFIG = {
    "data": {"train_files": "~/data/gsm8k/train.parquet", "val_files": "~/data/gsm8k/test.parquet",
             "train_batch_size": 256, "max_prompt_length": 512, "max_response_length": 1024},
    "actor_rollout_ref": {
        "model": {"path": "Qwen/Qwen2.5-3B-Instruct"},
        "actor": {"strategy": "fsdp", "ppo_mini_batch_size": 64, "optim": {"lr": 1e-6}},
        "rollout": {"name": "vllm", "mode": "async", "n": 5, "disable_log_stats": True,
                    "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.6,
                    "prompt_length": "${data.max_prompt_length}"},
    },
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "trainer": {"project_name": "verl_examples", "experiment_name": "gsm8k", "logger": ["console"],
                "nnodes": 1, "n_gpus_per_node": 8, "total_epochs": 1, "test_freq": 2,
                "save_freq": 5, "val_before_train": True},
}  # fmt: skip


def verl_ppo_tree(testing: bool, saving: bool) -> tuple:
    phases = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")
    return ("rl.step", (
        leaf("start_profile"),
        ("step", tuple(leaf(name) for name in phases)),
        *((leaf("testing"),) if testing else ()),
        *((leaf("save_checkpoint"),) if saving else ()),
        leaf("stop_profile"),
    ))  # fmt: skip


@pytest.fixture
def vllm_server() -> Iterator[PageServer]:
    """One rollout replica's vLLM server: its own ``/metrics`` page (the fixture's first)."""
    server = PageServer(V1_FIRST)
    yield server
    server.close()


@pytest.mark.slow
def test_verl_recipe(workdir, collector, gpu_node, vllm_server, mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    from otel_rl.compat.verl import Tracking, marked_timer

    engine = vllm_server
    server_addresses = [engine.url.split("/")[2]]  # AgentLoopManager.server_addresses: ip:port
    # verl's variable for MLflow, as the recipe sets it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    recipe = recipe_config("verl.md", "otel_rl", collector.endpoint, gpu_node)
    config = OmegaConf.merge(OmegaConf.create(VERL_CONFIG), recipe)  # what Hydra composes
    # RayPPOTrainer.fit(), with the recipe's imports and its one added line
    logger = Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_backend=config.trainer.logger,
        config=OmegaConf.to_container(config, resolve=True),
    )
    try:
        logger.rollout_monitor.add_endpoints(server_addresses)
        monitor = logger.rollout_monitor

        val = {"val-core/openai/gsm8k/reward/mean@1": 0.25}
        logger.log(data=val, step=0)  # val_before_train, on the engines' first page
        assert monitor.flush(timeout=30)
        timings: dict[int, dict[str, float]] = {}
        for global_steps in STEPS:
            metrics: dict[str, Any] = {}
            timing_raw: dict[str, float] = {}
            testing = global_steps % config.trainer.test_freq == 0
            saving = global_steps % config.trainer.save_freq == 0
            with marked_timer("start_profile", timing_raw):
                pass
            with marked_timer("step", timing_raw):
                with marked_timer("gen", timing_raw, color="red"):
                    if global_steps == 1:  # the engine's work: from its first page to its later one
                        engine.page = V1_LATER
                    work()
                for name, color in (("reward", "yellow"), ("old_log_prob", "blue"),
                                    ("adv", "brown"), ("update_actor", "red"),
                                    ("update_weights", "red")):  # fmt: skip
                    with marked_timer(name, timing_raw, color=color):
                        work()
            if testing:
                with marked_timer("testing", timing_raw, color="green"):
                    work()
                metrics.update({"val-core/openai/gsm8k/reward/mean@1": 0.25 + 0.1 * global_steps})
            if saving:
                with marked_timer("save_checkpoint", timing_raw, color="green"):
                    work()
            with marked_timer("stop_profile", timing_raw):
                pass
            metrics.update({
                "training/global_step": global_steps, "training/epoch": 0,
                "actor/pg_loss": -0.01 * global_steps, "actor/entropy": 0.5,
                "critic/score/mean": 0.1 * global_steps,
                "response_length/mean": 200.0 + global_steps,
            })  # fmt: skip
            metrics.update({f"timing_s/{name}": value for name, value in timing_raw.items()})
            timings[global_steps] = dict(timing_raw)
            logger.log(data=metrics, step=global_steps)
            # Real steps outlast the monitor's 5 s interval; these last milliseconds.
            assert monitor.flush(timeout=30)

        page = prometheus_page(logger.prometheus_url)
        assert logger.backends == ["console", "tensorboard", "mlflow"]
    finally:
        logger.finish()  # also when a check above fails: no thread outlives the test
    mlflow_run_id = logger.logger["mlflow"].run_id  # the run its thread started

    log_dir = workdir / "otel_rl_logs" / "gsm8k" / "qwen2.5-3b-grpo"
    tb_dir = workdir / "tensorboard_log" / "gsm8k" / "qwen2.5-3b-grpo"

    # ---- JSONL ----
    lines = jsonl_rows(log_dir / "metrics.jsonl")
    train = {r["step"]: r["metrics"] for r in lines if "axis" not in r}
    gpu = [r["metrics"] for r in lines if r.get("axis") == "ray/ray_step"]
    engine_rows = {r["step"]: r["metrics"] for r in lines if r.get("axis") == "rollout/step"}
    assert sorted(train) == [0, *STEPS]
    assert train[0]["val-core/openai/gsm8k/reward/mean@1"] == 0.25
    for step in STEPS:
        row = train[step]
        assert row["actor/pg_loss"] == pytest.approx(-0.01 * step)
        assert row["training/global_step"] == float(step)
        assert {k for k in row if k.startswith("timing_s/")} == {
            f"timing_s/{name}" for name in timings[step]
        }
        assert row["timing_s/gen"] == timings[step]["gen"]
        assert ("val-core/openai/gsm8k/reward/mean@1" in row) == (step % 2 == 0)
    gpu_rows_hold_the_node(gpu)
    check_engine_rows(engine_rows, [0, *STEPS], busy_step=1)

    # ---- TensorBoard, in verl's directory ----
    tb = tensorboard_scalars(tb_dir)
    assert tb["actor/pg_loss"] == [(s, f32(-0.01 * s)) for s in STEPS]
    assert tb["val-core/openai/gsm8k/reward/mean@1"] == [
        (0, 0.25), (2, f32(0.45)), (4, f32(0.65))
    ]
    assert [s for s, _ in tb["timing_s/step"]] == list(STEPS)
    assert {v for _, v in tb["ray/node.0.gpu.3.util"]} == {11.0}
    assert tb["rollout/requests_finished"] == [(s, 48.0 if s == 1 else 0.0) for s in STEPS]

    # ---- MLflow: the server's run, read with MLflow's client ----
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "qwen2.5-3b-grpo"
    assert client.get_experiment(run.info.experiment_id).name == "gsm8k"
    pg = client.get_metric_history(mlflow_run_id, "actor/pg_loss")
    assert sorted((m.step, m.value) for m in pg) == [
        (s, pytest.approx(-0.01 * s)) for s in STEPS
    ]
    val_history = client.get_metric_history(mlflow_run_id, "val-core/openai/gsm8k/reward/mean_at_1")
    assert sorted(m.step for m in val_history) == [0, 2, 4]  # verl's name for '@'
    finished = client.get_metric_history(mlflow_run_id, "rollout/requests_finished")
    assert sorted((m.step, m.value) for m in finished) == [
        (s, 48.0 if s == 1 else 0.0) for s in STEPS
    ]
    gpu3 = client.get_metric_history(mlflow_run_id, "ray/node.0.gpu.3.util")
    assert gpu3 and {m.value for m in gpu3} == {11.0}
    assert run.data.params["actor_rollout_ref.rollout.disable_log_stats"] == "False"
    assert run.data.params["otel_rl.tracing.enabled"] == "True"

    # ---- Prometheus ----
    samples = prometheus_samples(page)
    assert sample(samples, "actor_pg_loss") == pytest.approx(-0.05)
    assert sample(samples, "timing_s_gen") == timings[5]["gen"]
    assert sample(samples, "ray_node_gpu_utilization_percent", gpu="3") == 11.0
    assert sample(samples, "otel_rl_step") == 5.0

    # ---- the collector ----
    assert collector.last_point("actor/pg_loss").as_double == pytest.approx(-0.05)
    expected = {0: ("rl.step", ())} | {
        s: verl_ppo_tree(s % 2 == 0, s == 5) for s in STEPS
    }
    spans = collector.wait_for_spans(sum(_size(tree) for tree in expected.values()))
    traces = traces_by_step(spans)
    assert sorted(traces) == [0, *STEPS]
    for step, (root, trace) in traces.items():
        assert span_tree(trace, root) == expected[step]
        assert train[step]["trace_id"] == root.trace_id.hex()
        for _, span in trace:
            if span.name != "rl.step":
                assert span_duration(span) == pytest.approx(timings[step][span.name],
                                                            abs=TOLERANCE_S)  # fmt: skip

    no_stall(log_dir, samples, collector)

    show_outputs(lines, tb, page, collector, traces, step=1)
    run_id = mlflow_run_id
    show("MLflow: metric histories of the run (MlflowClient), and a param", [
        *(f"{key}: {sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))}"
          for key in ("actor/pg_loss", "val-core/openai/gsm8k/reward/mean_at_1",
                      "rollout/requests_finished", "ray/node.0.gpu.0.util")),
        f"{len(run.data.params)} params, e.g. otel_rl.tracing.enabled = "
        f"{run.data.params['otel_rl.tracing.enabled']}",
    ])  # fmt: skip
