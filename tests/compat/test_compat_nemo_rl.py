"""The NeMo RL drop-in (otel_rl.compat.nemo_rl), driven the way NeMo RL's GRPO loop drives its
Logger, read back with TensorBoard's EventAccumulator as NeMo RL's nightly checks read them."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from otel_rl.compat.nemo_rl import (
    Logger,
    Timer,
    flatten_dict,
    get_next_experiment_dir,
    print_message_log_samples,
)
from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node
from testkit.readers import jsonl_rows, tensorboard_accumulator, tensorboard_scalars


def f32(x: float) -> float:
    return float(np.float32(x))


def nemo_config(log_dir: Path, **extra: object) -> dict:
    """A NeMo RL ``logger:`` section as its example configs spell it."""
    cfg = {
        "log_dir": str(log_dir),
        "num_val_samples_to_print": 2,
        "wandb_enabled": False,
        "tensorboard_enabled": True,
        "mlflow_enabled": False,
        "swanlab_enabled": False,
        "monitor_gpus": False,
        "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger",
                  "log_nemo_gym_full_result_tables": False},
        "tensorboard": {},
        "mlflow": {"experiment_name": "grpo-dev", "run_name": "grpo-dev-logger"},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    }
    cfg.update(extra)
    return cfg


def gpu_rows(node_index: int, node) -> dict[str, float]:
    """The ``ray/node.{n}...`` values a node serving ``node``'s numbers must produce."""
    base = f"ray/node.{node_index}"
    rows = {
        f"{base}.mem_gb": node.mem_used / 2**30,
        f"{base}.mem_total_gb": node.mem_total / 2**30,
        f"{base}.cpu_util": node.cpu_util,
    }
    for i, gpu in node.gpus.items():
        rows[f"{base}.gpu.{i}.util"] = gpu.utilization
        rows[f"{base}.gpu.{i}.mem_gb"] = gpu.used_mib / 1024
        rows[f"{base}.gpu.{i}.mem_total_gb"] = (gpu.used_mib + gpu.available_mib) / 1024
        rows[f"{base}.gpu.{i}.power_w"] = gpu.power_mw / 1000
        rows[f"{base}.gpu.{i}.temp_c"] = gpu.temperature_c
    return rows


MESSAGES = [
    [{"role": "user", "content": f"What is {k} + {k}?"},
     {"role": "assistant", "content": f"The answer is {2 * k if k % 2 else k}. [/done]"}]
    for k in range(6)
]
VAL_REWARDS = [1.0, 0.0, 1.0, 0.0, 0.5, 0.25]


@pytest.mark.slow
def test_grpo_script_writes_nemo_rl_tags_and_values(log_dir):
    """A GRPO-shaped loop against NeMo RL's API, with GPU monitoring on two simulated 8xH100
    nodes (real HTTP endpoints on 127.0.0.1): every TensorBoard tag and value is the one
    expected, at its step."""
    nodes = [simulated_node(k) for k in (3, 5)]
    with NodeFarm() as farm:
        urls = [farm.add(render(node, H100_FIXTURE.read_text())) for node in nodes]
        cfg = nemo_config(
            log_dir,
            monitor_gpus=True,
            gpu_monitoring={"collection_interval": 0.2, "flush_interval": 0.5,
                            "endpoints": urls, "timeout": 2.0},
        )
        expected: dict[str, list[tuple[int, float]]] = {}

        def expect(prefix: str, values: dict[str, float], step: int) -> None:
            for key, value in values.items():
                expected.setdefault(f"{prefix}/{key}", []).append((step, f32(value)))

        logger = Logger(cfg)
        logger.log_hyperparams({"grpo": {"num_prompts_per_step": 32}, "policy": {"lr": 5e-6}})
        timer = Timer()
        # each generation block's wall time as measured around it: the anatomy's reading of
        # the same block lies between the sleep and this, however loaded the machine
        around: dict[int, float] = {}
        for step in range(1, 9):
            with timer.time("total_step_time"):
                began = time.perf_counter()
                with timer.time("generation"):
                    time.sleep(0.05)
                around[step] = time.perf_counter() - began
                timer.record("policy_training", 0.125 * step)
                timer.record("policy_training", 0.5)
            train = {"loss": 1.0 / step, "reward": 0.1 * step, "grad_norm": 2.0 ** -step,
                     "token_mult_prob_error": 1.0 + step / 100}
            logger.log_metrics(train, step, prefix="train")
            expect("train", train, step)
            # A list is logged as summary statistics, never one key per index.
            logger.log_metrics({"advantages": [-1.0, 0.0, 1.0, 2.0]}, step, prefix="train")
            expect("train", {"advantages/count": 4, "advantages/mean": 0.5,
                             "advantages/std": 1.118033988749895, "advantages/min": -1.0,
                             "advantages/max": 2.0, "advantages/p50": 0.5,
                             "advantages/p90": 1.7000000000000002}, step)
            timing = timer.get_timing_metrics(reduction_op="sum")
            assert timing["policy_training"] == 0.125 * step + 0.5
            logger.log_metrics(timing, step, prefix="timing/train", step_finished=True)
            expect("timing/train", timing, step)
            timer.reset()
            if step % 4 == 0:
                val = {"accuracy": 0.25 * step / 4, "avg_length": 100.0 + step}
                logger.log_metrics(val, step, prefix="validation")
                expect("validation", val, step)
                logger.log_metrics({"total_validation_time": 1.5}, step,
                                   prefix="timing/validation", step_finished=True)
                expect("timing/validation", {"total_validation_time": 1.5}, step)
                # NeMo RL's validate() calls this without a logger: the live one gets the table.
                print_message_log_samples(MESSAGES, VAL_REWARDS, num_samples=2, step=step,
                                          console=_console())
            time.sleep(0.1)
        assert logger.flush(timeout=30)
        logger.finish()
        # read once the bridge has stopped: it may collect again between a flush and finish()
        collections = logger.gpu_monitor.scraper.stats["collections"]
    assert collections >= 3

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    training = {tag: points for tag, points in scalars.items()
                if not tag.startswith(("ray/", "anatomy/"))}  # fmt: skip
    # NeMo RL's own Timer is the steps' phases: generation, inside total_step_time
    generation = scalars["anatomy/total_step_time/generation/seconds"]
    logged = sorted({step for step, _ in scalars["timing/train/policy_training"]})
    assert [step for step, _ in generation] == logged
    assert all(0.05 <= seconds <= around[step] + 1e-6 for step, seconds in generation), (
        generation, around)
    assert training == expected
    assert "train/advantages/0" not in scalars

    gpu = {tag: points for tag, points in scalars.items() if tag.startswith("ray/")}
    want = {**gpu_rows(0, nodes[0]), **gpu_rows(1, nodes[1])}
    assert set(gpu) == set(want) | {"ray/ray_step"}
    axis = [(step, value) for step, value in gpu["ray/ray_step"]]
    assert len(axis) == collections
    assert all(step == int(value) for step, value in axis)
    for tag, value in want.items():
        assert gpu[tag] == [(step, f32(value)) for step, _ in axis], tag
    assert gpu["ray/node.0.gpu.0.mem_gb"][0][1] == f32(nodes[0].gpus[0].used_mib / 1024)

    texts = _texts(log_dir / "tensorboard", "validation/samples")
    assert [step for step, _ in texts] == [4, 8]
    table = texts[0][1]
    # NeMo RL's choice for two samples: the highest reward and the lowest, numbered as printed.
    assert "| 4 | 1 | 0 | 1.0 | USER: What is 0 + 0?" in table
    assert "| 4 | 2 | 3 | 0.0 | USER: What is 3 + 3?" in table
    assert "What is 4 + 4?" not in table


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_sample_tables_reach_tensorboard_wherever_the_trackers_run(tmp_path, delivery):
    """With ``export.delivery: process`` the drop-in's trackers are stand-ins for those of the
    delivery process: a table still reaches each tracker that stores tables (it was skipped,
    as if TensorBoard had no table)."""
    rows = [[3, 0, 1, 0.5, "USER: hi"], [3, 0, 2, 1.0, "USER: bye"]]
    with Logger(nemo_config(tmp_path / "logs", export={"delivery": delivery})) as logger:
        assert logger.log_samples_table(rows, step=3) == ["tensorboard"]
    ((step, table),) = _texts(tmp_path / "logs" / "tensorboard", "validation/samples")
    assert step == 3 and "| 3 | 0 | 2 | 1.0 | USER: bye |" in table


def test_compat_imports_are_light():
    code = (
        "import sys, otel_rl.compat.nemo_rl, otel_rl.compat.verl; "
        "print(' '.join(m for m in ('torch', 'numpy', 'wandb', 'mlflow', 'swanlab', 'trackio', "
        "'tensorboard', 'matplotlib', 'ray', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tensorboard_log_dir_is_honoured(tmp_path):
    target = tmp_path / "elsewhere" / "tb"
    with Logger(nemo_config(tmp_path / "logs", tensorboard={"log_dir": str(target)})) as logger:
        logger.log_metrics({"loss": 0.5}, 3, prefix="train")
    assert tensorboard_scalars(target) == {"train/loss": [(3, 0.5)]}
    assert not (tmp_path / "logs" / "tensorboard").exists()


def test_a_crashed_run_is_marked_failed_not_finished(log_dir):
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    logger = Logger(nemo_config(log_dir))
    logger.log_hyperparams({"seed": 1})
    with pytest.raises(RuntimeError):
        try:
            logger.log_metrics({"loss": 1.0}, 1, prefix="train")
            raise RuntimeError("CUDA out of memory")
        finally:
            logger.finish()  # NeMo RL's call, no exit code: the exception decides
    acc = tensorboard_accumulator(log_dir / "tensorboard")
    (event,) = acc.Tensors("_hparams_/session_end_info")
    data = plugin_data_pb2.HParamsPluginData.FromString(
        acc.SummaryMetadata("_hparams_/session_end_info").plugin_data.content
    )
    assert data.session_end_info.status == api_pb2.STATUS_FAILURE
    assert event.step == 0


def test_plots_reach_tensorboard_at_their_steps(log_dir):
    pytest.importorskip("matplotlib")
    with Logger(nemo_config(log_dir)) as logger:
        logger.log_plot_per_worker_timeline_metrics(
            {0: [1.0, 2.0, 3.0], 1: [2.0, 2.0], 2: []}, step=5, prefix="generation",
            name="pending_requests", timeline_interval=0.5,
        )
        data = {
            "token_mask": np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]]),
            "sample_mask": np.array([1, 1]),
            "generation_logprobs": np.array([[0, -1.0, -0.5, -0.1, -2.0],
                                             [0, -0.3, -0.2, -0.9, 0.0]]),
            "prev_logprobs": np.array([[0, -1.0, -0.4, -0.1, -1.0],
                                       [0, -0.3, -0.2, -0.9, 0.0]]),
            "prompt_lengths": np.array([2, 1]),
            "full_lengths": np.array([5, 4]),
        }
        logger.log_plot_token_mult_prob_error(data, step=6, name="train/token_mult_prob_error")
    acc = tensorboard_accumulator(log_dir / "tensorboard")
    images = {tag: [(e.step, e.width, e.height) for e in acc.Images(tag)]
              for tag in acc.Tags()["images"]}
    assert set(images) == {"generation/per_worker_pending_requests",
                           "generation/average_pending_requests",
                           "train/token_mult_prob_error"}
    assert [s for s, _, _ in images["generation/per_worker_pending_requests"]] == [5]
    assert [s for s, _, _ in images["train/token_mult_prob_error"]] == [6]
    assert all(w > 100 and h > 100 for points in images.values() for _, w, h in points)


def test_string_lists_append_and_batched_dicts_follow_nemo_rl_layout(log_dir):
    import torch

    with Logger(nemo_config(log_dir, tensorboard_enabled=False)) as logger:
        logger.log_string_list_as_jsonl(['{"a": 1}', '{"a": 2}'], "samples/strings.jsonl")
        logger.log_string_list_as_jsonl(['{"a": 3}'], "samples/strings.jsonl")
        logger.log_batched_dict_as_jsonl(
            {"content": ["x", "y"], "rewards": torch.tensor([1.0, float("-inf")]),
             "ids": torch.tensor([[1, 2], [3, 4]])},
            "train_data_step1.jsonl",
        )
    lines = (log_dir / "samples" / "strings.jsonl").read_text().splitlines()
    assert [json.loads(line)["a"] for line in lines] == [1, 2, 3]
    rows = jsonl_rows(log_dir / "train_data_step1.jsonl")
    assert rows == [
        {"content": ["x"], "rewards": [1.0], "ids": [[1, 2]], "idx": 0},
        {"content": ["y"], "rewards": [float("-inf")], "ids": [[3, 4]], "idx": 1},
    ]


def test_print_message_log_samples_picks_as_nemo_rl_and_shows_text_as_written():
    console = _console()
    print_message_log_samples(MESSAGES, VAL_REWARDS, num_samples=3, step=7, console=console)
    out = console.file.getvalue()
    assert "TRAINING STEP 7" in out and "End of Samples" in out
    assert "Total Samples: 6" in out and "Avg Reward: 0.4583" in out
    titles = re.findall(r"Sample (\d+) \| Reward: ([\d.-]+)", out)
    # The best, the worst (the later of two zeros), then the median of the ranking.
    assert titles == [("1", "1.0000"), ("2", "0.0000"), ("3", "0.2500")]
    assert "The answer is 0. [/done]" in out  # markup-like text is shown, not interpreted
    assert "What is 3 + 3?" in out and "What is 5 + 5?" in out and "What is 2 + 2?" not in out


def test_timer_reductions_match_numpy():
    timer = Timer()
    durations = [0.5, 0.125, 2.0, 0.25]
    for d in durations:
        timer.record("generation", d)
    with timer.time("step"):
        pass
    expected = {"mean": np.mean, "median": np.median, "min": np.min, "max": np.max,
                "std": np.std, "sum": np.sum}
    for op, fn in expected.items():
        assert timer.reduce("generation", op) == pytest.approx(float(fn(durations)), abs=0)
    assert timer.reduce("generation", "count") == 4
    metrics = timer.get_timing_metrics({"generation": "max"})
    assert metrics["generation"] == 2.0 and isinstance(metrics["step"], list)
    assert timer.get_latest_elapsed("generation") == 0.25
    assert timer.drain("generation") == 2.875 and "generation" not in timer.get_timing_metrics()
    with pytest.raises(ValueError, match="Valid options"):
        timer.reduce("step", "p99")
    with pytest.raises(ValueError, match="not running"):
        timer.stop("never")
    timer.start("a")
    with pytest.raises(ValueError, match="already running"):
        timer.start("a")
    timer.stop("a")


def test_flatten_dict_keeps_nemo_rl_semantics():
    assert flatten_dict({"a": 1, "b": {"c": 2}}) == {"a": 1, "b.c": 2}
    assert flatten_dict({"a": [1, 2], "b": {"c": [3, 4]}}) == {"a.0": 1, "a.1": 2, "b.c.0": 3,
                                                                "b.c.1": 4}
    assert flatten_dict({"a": [{"b": 1}, {"c": 2}]}) == {"a.0.b": 1, "a.1.c": 2}
    assert flatten_dict({"a": [1, 2], "b": {"c": 3}}, sep="/", expand_lists=False) == {
        "a": [1, 2], "b/c": 3}


def test_next_experiment_dir_ignores_exp_in_the_base_path(tmp_path):
    base = tmp_path / "exp_7" / "logs"
    assert get_next_experiment_dir(str(base)) == str(base / "exp_001")
    (base / "exp_009").mkdir()
    (base / "exp_note.txt").write_text("")
    (base / "old_exp_050").mkdir()
    assert get_next_experiment_dir(str(base)) == str(base / "exp_010")


def _claim(base: str, queue) -> None:
    queue.put(get_next_experiment_dir(base))


@pytest.mark.slow
def test_next_experiment_dir_is_unique_across_concurrent_jobs(tmp_path):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    jobs = [context.Process(target=_claim, args=(str(tmp_path), queue)) for _ in range(6)]
    for job in jobs:
        job.start()
    claimed = [queue.get(timeout=60) for _ in jobs]
    for job in jobs:
        job.join(30)
    assert sorted(claimed) == [str(tmp_path / f"exp_{i:03d}") for i in range(1, 7)]
    assert sorted(os.listdir(tmp_path)) == [f"exp_{i:03d}" for i in range(1, 7)]


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=100, color_system=None)


def _texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    acc = tensorboard_accumulator(log_dir)
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


@pytest.mark.slow
def test_mlflow_keeps_a_plot_per_step_summarizes_lists_and_fails_crashed_runs(
    log_dir, monkeypatch
):
    """NeMo RL's MLflow defects, fixed: plots of one name at several steps are all kept, a list
    is not one metric per index, and a crash is not a FINISHED run."""
    pytest.importorskip("mlflow")
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    logger = Logger(nemo_config(log_dir, tensorboard_enabled=False, mlflow_enabled=True))
    try:
        for step in (1, 2):
            figure = Figure(figsize=(2, 2))
            figure.add_subplot().plot([0, 1], [step, 0])
            logger.log_plot(figure, step, "train/logprob_error")
            logger.log_metrics({"rewards": [0.0, 1.0, 1.0, 0.0]}, step, prefix="train")
        raise KeyboardInterrupt  # Ctrl-C in the middle of training
    except KeyboardInterrupt:
        logger.finish()
    exporter = next(e for e in logger.loggers if e.name == "mlflow")
    client = MlflowClient(tracking_uri=exporter.tracking_uri)
    run = client.get_run(exporter.run_id)
    assert run.info.status == "KILLED"
    folder = "plots/train/logprob_error"
    plots = sorted(f.path for f in client.list_artifacts(exporter.run_id, folder))
    assert plots == [f"{folder}/step_1.png", f"{folder}/step_2.png"]
    assert sorted(run.data.metrics) == [f"train/rewards/{s}" for s in sorted(
        ("count", "mean", "std", "min", "max", "p50", "p90"))]
    assert run.data.metrics["train/rewards/mean"] == 0.5
