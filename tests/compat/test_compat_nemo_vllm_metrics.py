"""NeMo RL's own vLLM metrics through the drop-in (``otel_rl.compat.nemo_rl.Logger``).

With ``policy.generation.vllm_cfg.enable_vllm_metrics_logger`` (async engine), each model-owner
vLLM worker (``VllmAsyncGenerationWorkerImpl`` in ``nemo_rl/models/generation/vllm/
vllm_worker_async.py``) polls vLLM's Prometheus registry every ``vllm_metrics_logger_interval``
seconds and appends, per poll: ``int(vllm:num_requests_running)`` to ``inflight_batch_sizes``,
``int(vllm:num_requests_waiting)`` to ``num_pending_samples``, ``float(vllm:kv_cache_usage_perc)``
to ``kv_cache_usage_perc`` and ``int(vllm:generation_tokens)`` (the counter's running total) to
``generation_tokens``; the lists are cleared when a generation starts. The driver
(``VllmGeneration.get_vllm_logger_metrics``) asks each data-parallel leader and builds
``{metric: {dp_idx: [values]}}``, a worker appearing only for the metrics whose list is not
empty. GRPO then calls the Logger twice with it:

- ``logger.log_metrics(metrics, step, prefix="train")`` with
  ``metrics["generation_logger_metrics"]`` set to that nested dict (``{}`` when the logger
  is off or the engine is not async), next to the flat speculative-decoding deltas
  ``vllm/spec_*`` (``VllmGeneration.get_step_metrics``);
- ``log_generation_metrics()``: ``logger.log_plot_per_worker_timeline_metrics(glm[name],
  step=step, prefix="generation_metrics", name=name, timeline_interval=interval)`` per metric.

Managed Dynamo workers (``DynamoMetricsSampler.snapshot()``) send the same nested shape with
float samples, more names (``vllm_prompt_tokens_total``, ...) and ``{}`` for a canonical name
none of whose sources a worker exposes.

The tests build those values the way that code builds them, make NeMo RL's calls, and read back
JSONL and TensorBoard: every key at its step with the value it must have, no warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from otel_rl.compat.nemo_plots import per_worker_timeline_figures
from otel_rl.compat.nemo_rl import Logger
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars

INTERVAL = 0.5  # vllm_cfg.vllm_metrics_logger_interval in NeMo RL's example configs
METRICS = ("inflight_batch_sizes", "num_pending_samples", "kv_cache_usage_perc",
           "generation_tokens")  # fmt: skip
STATS = ("count", "mean", "std", "min", "max", "p50", "p90")


def f32(x: float) -> float:
    return float(np.float32(x))


def nemo_config(log_dir: Path) -> dict[str, Any]:
    """A NeMo RL ``logger:`` section with TensorBoard and otel-rl's JSONL tracker on."""
    return {
        "log_dir": str(log_dir),
        "wandb_enabled": False,
        "tensorboard_enabled": True,
        "mlflow_enabled": False,
        "swanlab_enabled": False,
        "monitor_gpus": False,
        "jsonl_enabled": True,
        "wandb": {"project": "grpo-dev", "name": "vllm-metrics"},
        "tensorboard": {},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    }


# ---- NeMo RL's collection, step by step ---------------------------------------------------------


def poll(running: float, waiting: float, kv_usage: float, gen_tokens: float) -> dict[str, float]:
    """One ``get_metrics_snapshot()`` of an engine, as the values of the series the worker
    reads (the registry's values are floats)."""
    return {
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
        "vllm:kv_cache_usage_perc": kv_usage,
        "vllm:generation_tokens": gen_tokens,
    }


def worker_lists(polls: list[dict[str, float]]) -> dict[str, list[Any]]:
    """``get_vllm_logger_metrics()`` of one worker after these polls (the lists since the last
    ``clear_vllm_logger_metrics()``): one entry per poll, cast as the worker casts."""
    return {
        "inflight_batch_sizes": [int(p["vllm:num_requests_running"]) for p in polls],
        "num_pending_samples": [int(p["vllm:num_requests_waiting"]) for p in polls],
        "kv_cache_usage_perc": [float(p["vllm:kv_cache_usage_perc"]) for p in polls],
        "generation_tokens": [int(p["vllm:generation_tokens"]) for p in polls],
    }


def driver_metrics(per_dp_leader: list[dict[str, list[Any]]]) -> dict[str, dict[int, list[Any]]]:
    """``VllmGeneration.get_vllm_logger_metrics()``: ``{metric: {dp_idx: list}}``, a worker
    listed under a metric only when its list is not empty."""
    collected: dict[str, dict[int, list[Any]]] = {name: {} for name in METRICS}
    for dp_idx, stats in enumerate(per_dp_leader):
        for name in METRICS:
            if stats.get(name):
                collected[name][dp_idx] = stats[name]
    return collected


def spec_decode_deltas(start: dict[Any, float], end: dict[Any, float]) -> dict[str, float]:
    """``VllmGeneration.get_step_metrics()``: the step's speculative-decoding counters (per
    position under ``(name, position)``) as NeMo RL's flat ``vllm/`` keys."""
    delta = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in set(start) | set(end)}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0.0)
    draft_tokens = delta.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    out = {
        "vllm/spec_num_drafts": drafts,
        "vllm/spec_num_draft_tokens": draft_tokens,
        "vllm/spec_num_accepted_tokens": accepted,
        "vllm/spec_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else 1.0,
        "vllm/spec_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else 0.0,
    }
    for key, value in delta.items():
        if isinstance(key, tuple):
            name, position = key
            out[f"vllm/{name}-{position}"] = value
            if drafts > 0:
                out[f"vllm/spec_acceptance_rate-pos-{position}"] = value / drafts
    return out


def grpo_step(logger: Logger, step: int, glm: dict[str, Any], train: dict[str, Any]) -> None:
    """The calls GRPO's loop makes at the end of a step, in its order."""
    for name in glm:  # log_generation_metrics()
        logger.log_plot_per_worker_timeline_metrics(
            glm[name], step=step, prefix="generation_metrics", name=name,
            timeline_interval=INTERVAL,
        )  # fmt: skip
    logger.log_metrics({**train, "generation_logger_metrics": glm}, step, prefix="train")
    logger.log_metrics({"total_step_time": 41.5 + step}, step, prefix="timing/train",
                       step_finished=True)  # fmt: skip


def expected_stats(key: str, values: list[float]) -> dict[str, float]:
    """What a merged list must become: count, mean, population std, min, max, p50, p90."""
    a = np.asarray(values, dtype=np.float64)
    stats = (len(a), a.mean(), a.std(), a.min(), a.max(), np.percentile(a, 50),
             np.percentile(a, 90))  # fmt: skip
    return {f"{key}/{name}": float(v) for name, v in zip(STATS, stats, strict=True)}


def training_rows(log_dir: Path) -> dict[int, dict[str, float]]:
    rows = [r for r in jsonl_rows(log_dir / "metrics.jsonl") if "axis" not in r]
    assert len({r["step"] for r in rows}) == len(rows), "one line per training step"
    return {r["step"]: r["metrics"] for r in rows}


# ---- the scenario: two data-parallel engines, three steps ---------------------------------------

# Step 1: worker 0 polled 6 times, worker 1 (its engine answered later) 5 times; a batch ramps
# up, fills the KV cache and drains. generation_tokens is vLLM's counter, cumulative.
STEP1 = [
    worker_lists([poll(0, 0, 0.0, 1_048_576), poll(48, 80, 0.412, 1_050_112),
                  poll(64, 16, 0.873, 1_057_280), poll(64, 0, 0.9, 1_065_472),
                  poll(37, 0, 0.517, 1_071_616), poll(9, 0, 0.068, 1_072_640)]),
    worker_lists([poll(12, 52, 0.104, 983_040), poll(64, 0, 0.861, 984_576),
                  poll(64, 0, 0.912, 991_744), poll(22, 0, 0.301, 998_400),
                  poll(0, 0, 0.0, 999_424)]),
]  # fmt: skip
# Step 2: a shorter generation; worker 1 polled once.
STEP2 = [
    worker_lists([poll(64, 112, 0.95, 1_080_000), poll(64, 48, 0.97, 1_088_192),
                  poll(20, 0, 0.33, 1_094_336)]),
    worker_lists([poll(64, 96, 0.94, 1_003_520)]),
]  # fmt: skip
# Step 3: the generation ended before the first poll: every list is empty, so NeMo RL sends
# {metric: {}} for all four.
STEP3 = [worker_lists([]), worker_lists([])]

SPEC_START = {"vllm:spec_decode_num_drafts": 1200.0, "vllm:spec_decode_num_draft_tokens": 3600.0,
              "vllm:spec_decode_num_accepted_tokens": 2100.0,
              ("vllm:spec_decode_num_accepted_tokens_per_pos", 1): 1000.0,
              ("vllm:spec_decode_num_accepted_tokens_per_pos", 2): 700.0}  # fmt: skip
SPEC_END = {"vllm:spec_decode_num_drafts": 1500.0, "vllm:spec_decode_num_draft_tokens": 4500.0,
            "vllm:spec_decode_num_accepted_tokens": 2640.0,
            ("vllm:spec_decode_num_accepted_tokens_per_pos", 1): 1270.0,
            ("vllm:spec_decode_num_accepted_tokens_per_pos", 2): 880.0}  # fmt: skip


def test_the_async_workers_timelines_arrive_as_statistics_and_plots_at_their_steps(log_dir, caplog):
    caplog.set_level(logging.INFO, logger="otel_rl")
    steps = {1: driver_metrics(STEP1), 2: driver_metrics(STEP2), 3: driver_metrics(STEP3)}
    assert steps[3] == {name: {} for name in METRICS}
    train = {
        1: {"loss": 0.0412, "mean_gen_tokens_per_sample": 611.25},
        2: {"loss": 0.0387, "mean_gen_tokens_per_sample": 598.5,
            **spec_decode_deltas(SPEC_START, SPEC_END)},
        3: {"loss": 0.0371, "mean_gen_tokens_per_sample": 17.0},
    }  # fmt: skip
    with Logger(nemo_config(log_dir)) as logger:
        for step, glm in steps.items():
            grpo_step(logger, step, glm, train[step])

    # Every key, and only those, at its step, with its value.
    expected: dict[int, dict[str, float]] = {}
    for step, glm in steps.items():
        row = {f"train/{k}": float(v) for k, v in train[step].items()}
        row["timing/train/total_step_time"] = 41.5 + step
        for name, by_worker in glm.items():
            merged = [v for dp_idx in sorted(by_worker) for v in by_worker[dp_idx]]
            if merged:
                row.update(expected_stats(f"train/generation_logger_metrics/{name}", merged))
        expected[step] = row
    assert expected[1]["train/generation_logger_metrics/inflight_batch_sizes/count"] == 11.0
    assert expected[1]["train/generation_logger_metrics/num_pending_samples/max"] == 80.0
    assert expected[2]["train/vllm/spec_acceptance_rate"] == pytest.approx(0.6)
    assert expected[2]["train/vllm/vllm:spec_decode_num_accepted_tokens_per_pos-1"] == 270.0
    assert not [k for k in expected[3] if "generation_logger_metrics" in k]

    rows = training_rows(log_dir)
    assert sorted(rows) == [1, 2, 3]
    for step, row in expected.items():
        assert set(rows[step]) == set(row), step
        for key, value in row.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    tags = {key for row in expected.values() for key in row}
    assert set(scalars) == tags
    for tag in tags:
        want = [(step, f32(row[tag])) for step, row in expected.items() if tag in row]
        assert scalars[tag] == want, tag

    # The timelines: two plots per metric and step with samples, none for step 3; the PNG that
    # TensorBoard holds is the one the JSONL tracker wrote beside metrics.jsonl.
    acc = tensorboard_accumulator(log_dir / "tensorboard")
    images = {tag: {e.step: e.encoded_image_string for e in acc.Images(tag)}
              for tag in acc.Tags()["images"]}  # fmt: skip
    assert set(images) == {f"generation_metrics/{kind}_{name}"
                           for name in METRICS for kind in ("per_worker", "average")}  # fmt: skip
    for tag, by_step in images.items():
        assert sorted(by_step) == [1, 2], tag
        for step, png in by_step.items():
            assert png.startswith(b"\x89PNG\r\n\x1a\n")
            assert (log_dir / "plots" / tag / f"step_{step}.png").read_bytes() == png

    # What those plots draw is NeMo RL's: one line per worker, points INTERVAL apart, and the
    # mean over the workers up to the shortest series.
    glm = steps[1]["inflight_batch_sizes"]
    (_, per_worker), (_, average) = per_worker_timeline_figures(glm, "inflight_batch_sizes",
                                                                 INTERVAL)  # fmt: skip
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in per_worker.axes[0].get_lines()}  # fmt: skip
    assert lines == {
        "worker_0": ([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], [0.0, 48.0, 64.0, 64.0, 37.0, 9.0]),
        "worker_1": ([0.0, 0.5, 1.0, 1.5, 2.0], [12.0, 64.0, 64.0, 22.0, 0.0]),
    }
    (mean_line,) = average.axes[0].get_lines()
    assert list(mean_line.get_ydata()) == [6.0, 56.0, 64.0, 43.0, 18.5]

    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("otel_rl") and r.levelno >= logging.WARNING]  # fmt: skip
    assert not warnings, warnings
    skipped = sorted(r.getMessage() for r in caplog.records if "no per-worker timeline" in
                     r.getMessage())  # fmt: skip
    assert skipped == sorted(f"otel-rl: {name}: no per-worker timeline data at step 3; no plot"
                             for name in METRICS)  # fmt: skip


def test_with_the_metrics_logger_off_nemo_rl_sends_an_empty_dict_and_nothing_is_reported(
    log_dir, otel_rl_warnings
):
    """``get_logger_metrics()`` is ``{}`` when ``enable_vllm_metrics_logger`` is off or the
    engine is not async; GRPO still sets ``metrics["generation_logger_metrics"]`` to it."""
    with Logger(nemo_config(log_dir)) as logger:
        logger.log_metrics({"loss": 0.25, "generation_logger_metrics": {}}, 4, prefix="train")
        logger.log_metrics({"total_step_time": 12.0}, 4, prefix="timing/train",
                           step_finished=True)  # fmt: skip
    assert training_rows(log_dir) == {4: {"train/loss": 0.25, "timing/train/total_step_time": 12.0}}
    assert tensorboard_scalars(log_dir / "tensorboard") == {
        "train/loss": [(4, 0.25)],
        "timing/train/total_step_time": [(4, 12.0)],
    }
    assert not [r.getMessage() for r in otel_rl_warnings.records if r.name.startswith("otel_rl")]


def test_dynamo_snapshots_with_extra_names_and_a_missing_alias(log_dir, otel_rl_warnings):
    """``DynamoMetricsSampler.snapshot()``: per worker ordinal, one float per poll of each name
    its include prefixes keep (``:`` as ``_``, series of a name summed); the canonical names
    take the first source present, and a canonical name with no source is ``{}``."""
    snapshot = {
        "vllm_prompt_tokens_total": {0: [20480.0, 22528.0, 26624.0], 1: [18432.0, 19456.0]},
        "vllm_inter_token_latency_seconds_sum": {0: [81.2, 84.9, 90.3], 1: [77.0, 79.5]},
        "vllm_inter_token_latency_seconds_count": {0: [4096.0, 4301.0, 4610.0],
                                                   1: [3890.0, 4017.0]},
        "inflight_batch_sizes": {0: [32.0, 64.0, 40.0], 1: [64.0, 64.0]},
        "num_pending_samples": {},  # neither dynamo_work_handler_queue_depth nor vllm_…waiting
        "kv_cache_usage_perc": {0: [0.41, 0.88, 0.52], 1: [0.9, 0.93]},
        "generation_tokens": {0: [5120.0, 7168.0, 9216.0], 1: [4096.0, 5120.0]},
    }  # fmt: skip
    with Logger(nemo_config(log_dir)) as logger:
        grpo_step(logger, 9, snapshot, {"loss": 0.5})
    row = training_rows(log_dir)[9]
    expected = {"train/loss": 0.5, "timing/train/total_step_time": 50.5}
    for name, by_worker in snapshot.items():
        if by_worker:
            merged = by_worker[0] + by_worker[1]
            expected.update(expected_stats(f"train/generation_logger_metrics/{name}", merged))
    assert set(row) == set(expected)
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-12), key
    assert row["train/generation_logger_metrics/vllm_prompt_tokens_total/max"] == 26624.0
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert {tag: points for tag, points in scalars.items()} == {
        key: [(9, f32(value))] for key, value in expected.items()
    }
    images = tensorboard_accumulator(log_dir / "tensorboard").Tags()["images"]
    assert sorted(images) == sorted(f"generation_metrics/{kind}_{name}"
                                    for name, by_worker in snapshot.items() if by_worker
                                    for kind in ("per_worker", "average"))  # fmt: skip
    assert not [r.getMessage() for r in otel_rl_warnings.records if r.name.startswith("otel_rl")]
