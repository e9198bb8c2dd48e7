"""Rollout monitoring through the Logger: engines' rows reach every tracker at the training step
they describe, and the Prometheus ``file_sd`` file follows the endpoints.

Two real HTTP servers on 127.0.0.1 serve the vLLM V1 and SGLang fixture pages; the test swaps
each page for its later scrape while step 0 runs, so the step's rows are the fixture's expected
values (counts and quantiles exactly; rates as the fixture's increase over the real seconds
between the two scrapes).
"""

from __future__ import annotations

import importlib.util
import json
import time

import numpy as np
import pytest

from otel_rl import ConfigError, Logger
from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.rollout_pages import SG_EXP, SG_FIRST, SG_LATER, V1_EXP, V1_FIRST, V1_LATER, PageServer
from testkit.tracker_readers import read_wandb, wandb_run_dirs

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture
def engines():
    vllm, sglang = PageServer(V1_FIRST), PageServer(SG_FIRST)
    yield vllm, sglang
    vllm.close()
    sglang.close()


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def f32(x: float) -> float:
    return float(np.float32(x))


def test_engine_rows_reach_the_trackers_at_their_training_step(engines, log_dir):
    vllm, sglang = engines
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "rollout_monitoring": {
            "endpoints": [vllm.url, sglang.url.removeprefix("http://").removesuffix("/metrics")],
            "collection_interval": 3600,  # only the opening scrape and the flushes
        },
    }
    if HAVE_WANDB:
        cfg["wandb_enabled"] = True
        cfg["wandb"] = {"mode": "offline", "project": "rollout"}
    began = time.monotonic()
    with Logger(cfg) as logger:
        monitor = logger.rollout_monitor
        _wait_for(lambda: monitor.stats["rounds"] >= 1)  # the scrape that opens step 0
        vllm.page, sglang.page = V1_LATER, SG_LATER  # what the engines did during step 0
        logger.log_metrics({"reward": 0.5}, step=0)
        assert logger.flush(timeout=30)
        bound = time.monotonic() - began
        logger.log_metrics({"reward": 0.75}, step=1)
    # finish() closed step 1 with one more scrape of the same pages: nothing happened in it.

    rows = jsonl_rows(log_dir / "metrics.jsonl")
    training = [r for r in rows if "axis" not in r]
    assert [(r["step"], r["metrics"]) for r in training] == [
        (0, {"reward": 0.5}),
        (1, {"reward": 0.75}),
    ]
    # Rollout rows come after their step's row, on their own axis whose value is the step.
    rollout = {r["step"]: r["metrics"] for r in rows if r.get("axis") == "rollout/step"}
    assert len(rollout) + len(training) == len(rows)
    assert sorted(rollout) == [0, 1]
    step0 = rollout[0]
    ttft_v, ttft_s = V1_EXP["time_to_first_token_seconds"], SG_EXP["time_to_first_token_seconds"]
    exact = {
        "rollout/engines_reporting": 2.0,
        "rollout/engine.0.requests_finished": 48.0,
        "rollout/engine.1.requests_finished": 128.0,
        "rollout/requests_finished": 176.0,
        "rollout/engine.0.preemptions": 2.0,
        "rollout/engine.0.prefix_cache_hit_rate": 40960 / 49152,
        "rollout/engine.1.prefix_cache_hit_rate": 128000 / 153600,
        "rollout/prefix_cache_hit_rate": (40960 + 128000) / (49152 + 153600),
        "rollout/engine.0.ttft_p90_s": ttft_v["p90"],
        "rollout/engine.1.ttft_p90_s": ttft_s["p90"],
        "rollout/engine.0.e2e_latency_p90_s": V1_EXP["e2e_request_latency_seconds"]["p90"],
        "rollout/engine.1.e2e_latency_p90_s": SG_EXP["e2e_request_latency_seconds"]["p90"],
    }
    for key, value in exact.items():
        assert step0[key] == pytest.approx(value, rel=1e-12), key
    # A rate is the fixture's increase over the seconds between the step's two scrapes.
    for engine, tokens in (
        (0, V1_EXP["generation_tokens_delta"]),
        (1, SG_EXP["generation_tokens_delta"]),
    ):
        seconds = tokens / step0[f"rollout/engine.{engine}.gen_tokens_per_s"]
        assert 0 < seconds <= bound
    # Step 1: the pages did not change, so nothing finished and no quantile exists.
    assert rollout[1]["rollout/requests_finished"] == 0.0
    assert rollout[1]["rollout/gen_tokens_per_s"] == 0.0
    assert not any("ttft" in key for key in rollout[1])

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["rollout/engine.1.requests_finished"] == [(0, 128.0), (1, 0.0)]
    assert scalars["rollout/engine.0.ttft_p90_s"] == [(0, f32(ttft_v["p90"]))]
    assert scalars["reward"] == [(0, 0.5), (1, 0.75)]

    if HAVE_WANDB:
        (run_dir,) = wandb_run_dirs(log_dir)
        run = read_wandb(run_dir)
        key = "rollout/engine.1.requests_finished"
        assert run.series(key, axis="rollout/step") == [(0, 128.0), (1, 0.0)]
        assert run.metrics.get(key) == "rollout/step"
        assert [(int(s), v) for s, v in run.series("reward")] == [(0, 0.5), (1, 0.75)]


def test_the_sd_file_follows_the_endpoints_and_names_the_run(engines, log_dir):
    vllm, sglang = engines
    sd_file = log_dir / "sd" / "engines.json"
    cfg = {
        "log_dir": str(log_dir),
        "rollout_monitoring": {"endpoints": [vllm.url], "sd_file": str(sd_file)},
    }
    with Logger(cfg) as logger:
        (group,) = json.loads(sd_file.read_text())
        assert group["targets"] == [vllm.url.removeprefix("http://").removesuffix("/metrics")]
        assert group["labels"]["otel_rl_run_id"] == logger.run_id
        assert group["labels"]["__metrics_path__"] == "/metrics"
        logger.rollout_monitor.add_endpoints([sglang.url])
        (group,) = json.loads(sd_file.read_text())
        assert sorted(group["targets"]) == sorted(
            u.removeprefix("http://").removesuffix("/metrics") for u in (vllm.url, sglang.url)
        )


def test_enabled_without_endpoints_waits_for_added_ones_and_off_means_no_thread(log_dir):
    with Logger({"log_dir": str(log_dir), "rollout_monitoring": {"enabled": True}}) as logger:
        assert logger.rollout_monitor is not None and logger.rollout_monitor.endpoints == []
        logger.log_metrics({"x": 1.0}, step=0)
    cfg = {"log_dir": str(log_dir), "rollout_monitoring": {"endpoints": ["h:1"], "enabled": False}}
    with Logger(cfg) as logger:
        assert logger.rollout_monitor is None
    with Logger({"log_dir": str(log_dir)}) as logger:
        assert logger.rollout_monitor is None
    with pytest.raises(ConfigError, match=r"rollout_monitoring\.endpoints\[0\]"):
        Logger({"log_dir": str(log_dir), "rollout_monitoring": {"endpoints": ["no-port"]}})


def test_an_unwritable_sd_file_is_one_warning_and_the_rows_still_arrive(engines, log_dir, caplog):
    vllm, _ = engines
    blocker = log_dir / "not-a-dir"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the folder should be")
    cfg = {
        "log_dir": str(log_dir),
        "rollout_monitoring": {
            "endpoints": [vllm.url],
            "collection_interval": 3600,
            "sd_file": str(blocker / "engines.json"),
        },
    }
    with caplog.at_level("WARNING", logger="otel_rl"), Logger(cfg) as logger:
        logger.rollout_monitor.add_endpoints(["127.0.0.1:1"])  # tries again, warns no more
        logger.log_metrics({"reward": 1.0}, step=0)
    warnings = [r.getMessage() for r in caplog.records if "file_sd" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        str(blocker / "engines.json") in warnings[0] and "rollout_monitoring.sd_file" in warnings[0]
    )
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["metrics"] for r in rows if "axis" not in r] == [{"reward": 1.0}]
    (rollout,) = [r for r in rows if r.get("axis") == "rollout/step"]
    assert rollout["step"] == 0 and rollout["metrics"]["rollout/engine.0.requests_finished"] == 0.0
