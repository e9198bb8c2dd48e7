"""Drop-in users get everything: otel-rl's options from verl's own config (``config["otel_rl"]``,
a dict or an OmegaConf ``DictConfig``), their precedence, and the core Logger's attributes on both
drop-ins, each checked on what reaches Prometheus, OTLP, TensorBoard and the engines' rows; and
verl's standalone ``ValidationGenerationsLogger`` writing verl's TensorBoard text."""

from __future__ import annotations

import gc
import logging
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from otel_rl import ConfigError, Logger
from otel_rl.compat.nemo_rl import Logger as NemoLogger
from otel_rl.compat.verl import Tracking, ValidationGenerationsLogger, active_tracking
from otel_rl.rollout import RolloutMonitor
from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node
from testkit.otlp_receiver import OtlpHttpReceiver
from testkit.readers import tensorboard_accumulator, tensorboard_scalars
from testkit.rollout_pages import V1_FIRST, V1_LATER, PageServer

_VERL_ENV = (
    "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "SWANLAB_MODE", "SWANLAB_LOG_DIR",
    "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "WANDB_ENTITY", "WANDB_DIR",
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory, none of verl's or OTel's variables set, no Tracking alive."""
    for name in _VERL_ENV:
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith("OTEL_"):  # OTEL_RL_CONFIG, OTEL_RL_LOG_DIR, OTEL_EXPORTER_OTLP_*
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    gc.collect()  # a Tracking a previous test dropped is finished by now
    assert active_tracking() is None
    return tmp_path


@pytest.fixture
def engine():
    """A vLLM V1 engine's /metrics page over HTTP (the fixture's first scrape)."""
    server = PageServer(V1_FIRST)
    yield server
    server.close()


@pytest.fixture
def receiver():
    server = OtlpHttpReceiver()
    yield server
    server.close()


@pytest.fixture
def gpu_node():
    """A Ray node's metrics page (8 x H100, node 1's values) standing in for ray.nodes()."""
    with NodeFarm() as farm:
        yield farm.add(render(simulated_node(1), H100_FIXTURE.read_text()))


#: What simulated_node(1) serves for GPU 0: utilization (1 * 8 + 0) % 100 percent.
GPU0_UTIL = 8.0
#: Requests the vLLM fixture finished between its first and later page.
V1_FINISHED = 48.0


def f32(x: float) -> float:
    return float(np.float32(x))


def verl_metrics(step: int) -> dict[str, Any]:
    """What verl's PPO trainer logs each step."""
    return {
        "actor/pg_loss": np.float32(0.5 / step),
        "critic/score/mean": 0.1 * step,
        "response_length/mean": 100.0 + step,
    }


def ppo_config(
    tmp: Path, engine_url: str, otlp_endpoint: str, gpu_url: str, typo: bool = False
) -> dict[str, Any]:
    """verl's PPO trainer config (ppo_trainer.yaml's shape) with an ``otel_rl`` section; the
    ``${...}`` interpolations are left for OmegaConf to resolve."""
    otel_rl: dict[str, Any] = {
        "log_dir": f"{tmp}/otel/${{trainer.experiment_name}}",
        "run_id": "${trainer.experiment_name}-1",
        "tensorboard_enabled": True,
        "tensorboard": {"log_dir": "${otel_rl.log_dir}/tb"},
        "prometheus": {"enabled": True, "port": 0},
        "otlp": {"enabled": True, "endpoint": otlp_endpoint, "interval": 60.0, "timeout": 5.0},
        "rollout_monitoring": {"endpoints": [engine_url], "collection_interval": 3600},
        "monitor_gpus": True,
        "gpu_monitoring": {"endpoints": [gpu_url], "collection_interval": 0.2,
                           "flush_interval": 0.5, "timeout": 2.0},
    }
    return {
        "data": {
            "train_files": "~/data/gsm8k/train.parquet",
            "val_files": "~/data/gsm8k/test.parquet",
            "prompt_key": "prompt",
            "max_prompt_length": 512,
            "max_response_length": 1024,
            "train_batch_size": 256,
        },
        "actor_rollout_ref": {
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "enable_gradient_checkpointing": True},
            "actor": {
                "strategy": "fsdp",
                "ppo_mini_batch_size": 64,
                "ppo_micro_batch_size_per_gpu": 4,
                "use_kl_loss": False,
                "optim": {"lr": 1e-6},
            },
            "rollout": {
                "name": "vllm",
                "n": 1,
                "temperature": 1.0,
                "prompt_length": "${data.max_prompt_length}",
                "response_length": "${data.max_response_length}",
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.6,
            },
        },
        "critic": {"model": {"path": "${actor_rollout_ref.model.path}"}, "optim": {"lr": 1e-5}},
        "algorithm": {
            "adv_estimator": "gae",
            "gamma": 1.0,
            "lam": 1.0,
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.001},
        },
        "trainer": {
            "project_name": "gsm8k",
            "experiment_name": "qwen2.5-0.5b-ppo",
            "logger": ["console"],
            "nnodes": 1,
            "n_gpus_per_node": 8,
            "total_epochs": 15,
            "save_freq": -1,
            "test_freq": 10,
            "val_before_train": False,
            "default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        },
        "otel_rl": otel_rl,
    }


def as_given(config: dict[str, Any], form: str) -> Any:
    """``dict``: what verl's trainer passes (``OmegaConf.to_container(cfg, resolve=True)``);
    ``omegaconf``: the Hydra ``DictConfig`` itself, interpolations unresolved."""
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(config)
    if form == "dict":
        return omegaconf.OmegaConf.to_container(node, resolve=True)
    return node


def prometheus_samples(url: str) -> dict[str, float]:
    """``{sample name: value}`` of the page at ``url``, read with Prometheus's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- verl: config["otel_rl"] -------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dict", "omegaconf"])
def test_tracking_takes_otel_rl_options_from_verls_config(
    workdir, engine, receiver, gpu_node, form, capsys
):
    """verl's usual ``trainer.logger: [console]`` plus ``config["otel_rl"]``: Prometheus, OTLP,
    TensorBoard, the engine monitor and the GPU monitor all run, and timers land at their
    step."""
    config = as_given(ppo_config(workdir, engine.url, receiver.endpoint, gpu_node), form)
    trainer = config["trainer"]
    tracking = Tracking(
        project_name=trainer["project_name"],
        experiment_name=trainer["experiment_name"],
        default_backend=trainer["logger"],
        config=config,
    )
    core = tracking.core
    log_dir = workdir / "otel" / "qwen2.5-0.5b-ppo"  # ${trainer.experiment_name} resolved
    try:
        assert core.run_id == "qwen2.5-0.5b-ppo-1"
        assert tracking.backends == ["console", "tensorboard"]
        # The core Logger's own objects, not copies.
        assert tracking.prometheus_url == core.prometheus_url
        assert tracking.prometheus_url.startswith("http://127.0.0.1:")
        assert tracking.otlp_endpoint == core.otlp_endpoint
        assert tracking.otlp_endpoint.startswith(receiver.endpoint)
        monitor = tracking.rollout_monitor
        assert isinstance(monitor, RolloutMonitor) and monitor is core.rollout_monitor
        assert monitor.endpoints == [engine.url]
        assert tracking.gpu_monitor is core.gpu_monitor and tracking.gpu_monitor is not None

        wait_for(lambda: monitor.stats["rounds"] >= 1)  # the scrape that opens step 1
        engine.page = V1_LATER  # what the engine did during step 1
        timed: dict[int, float] = {}
        for step in (1, 2, 3):
            began = time.perf_counter()
            with tracking.timer("gen"):
                time.sleep(0.02 * step)
            timed[step] = time.perf_counter() - began
            tracking.log(data=verl_metrics(step), step=step)
            assert tracking.flush(timeout=30)  # the step's closing scrape is done

        page = prometheus_samples(tracking.prometheus_url)
        assert page["actor_pg_loss"] == f32(0.5 / 3)
        assert page["critic_score_mean"] == pytest.approx(0.3, rel=1e-12)
        assert page["timing_gen_seconds_count"] == 3.0
    finally:
        tracking.finish()

    scalars = tensorboard_scalars(log_dir / "tb")
    assert scalars["actor/pg_loss"] == [(s, f32(0.5 / s)) for s in (1, 2, 3)]
    assert scalars["response_length/mean"] == [(1, 101.0), (2, 102.0), (3, 103.0)]
    # timing/gen: the seconds of that step's block, at that step.
    assert [s for s, _ in scalars["timing/gen"]] == [1, 2, 3]
    for step, seconds in scalars["timing/gen"]:
        assert 0.02 * step <= seconds <= timed[step] + 1e-6
    # The engine's rows at their training step: 48 requests finished during step 1.
    assert scalars["rollout/requests_finished"] == [(1, V1_FINISHED), (2, 0.0), (3, 0.0)]
    gpu = scalars["ray/node.0.gpu.0.util"]
    assert gpu and {v for _, v in gpu} == {GPU0_UTIL}
    # OTLP: the last value of each metric reached the collector by the end of the run.
    assert receiver.last_point("actor/pg_loss").as_double == f32(0.5 / 3)
    assert receiver.last_point("critic/score/mean").as_double == pytest.approx(0.3, rel=1e-12)
    # The spool is under the section's log_dir; verl's console backend printed every step.
    assert (log_dir / ".otel-rl" / "spool").is_dir()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step:")]
    assert [x.split(" - ")[0] for x in lines] == ["step:1", "step:2", "step:3"]


def test_a_live_tracking_writes_generations_as_verls_text(workdir):
    """TensorBoard switched on in config["otel_rl"] (not a verl backend) takes the validation
    generations too, in verl's text layout."""
    config = {"trainer": {"project_name": "p"}, "otel_rl": {"tensorboard_enabled": True}}
    with Tracking("p", "e", ["console"], config=config) as tracking:
        assert "tensorboard" in tracking.backends
        ValidationGenerationsLogger("p", "e").log(["tensorboard"], [("2+2?", "4", 1.0)], 7)
        tracking.log({"val-core/acc": 1.0}, step=7)
    tb = workdir / "tensorboard_log" / "p" / "e"  # verl's default directory
    assert tensorboard_scalars(tb) == {"val-core/acc": [(7, 1.0)]}
    (event,) = tensorboard_accumulator(tb).Tensors("val/generations")
    assert event.step == 7
    text = event.tensor_proto.string_val[0].decode()
    assert text.startswith("**Generation Results - Step 7**\n\n| input | output | score |")
    assert text.endswith("### Sample 1\n**Input:** 2+2?\n\n**Output:** 4\n\n**Score:** 1.0\n\n"
                         "---\n\n")


def test_precedence_file_then_section_then_what_verl_is_told(workdir, monkeypatch, caplog):
    """OTEL_RL_CONFIG file < config["otel_rl"] < verl's arguments and environment variables;
    every value that loses is named in a warning."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    config_file = workdir / "otel-rl.yaml"
    config_file.write_text(
        "log_dir: from-file\n"
        "prometheus: {enabled: true, port: 0}\n"
        "tensorboard: {log_dir: from-file/tb}\n"
        "export: {queue_size: 500, fsync_interval: 0.5}\n"
    )
    monkeypatch.setenv("OTEL_RL_CONFIG", str(config_file))
    config = {
        "trainer": {"project_name": "p", "experiment_name": "e", "logger": ["tensorboard"]},
        "otel_rl": {
            "tensorboard_enabled": False,  # default_backend names tensorboard: it stays on
            "tensorboard": {"log_dir": "from-section/tb"},
            "export": {"queue_size": 700},
        },
    }

    with Tracking("p", "e", ["tensorboard"], config=config) as tracking:
        # The file's keys the section does not set still apply...
        assert tracking.prometheus_url is not None
        assert tracking.core.config["export"]["fsync_interval"] == 0.5
        # ...and the section wins where both set one.
        assert tracking.core.config["export"]["queue_size"] == 700
        tracking.log({"x": 1.0}, step=1)
    assert tensorboard_scalars(workdir / "from-section" / "tb") == {"x": [(1, 1.0)]}
    assert not (workdir / "from-file" / "tb").exists()
    assert (workdir / "from-file" / ".otel-rl" / "spool").is_dir()  # the file's log_dir
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "otel-rl: verl config 'otel_rl' sets 'tensorboard_enabled' to False; Tracking's "
        "default_backend (True) is used instead: what verl is told wins over otel-rl's "
        "options (docs/migrating.md)"
    ]

    # verl's environment variables win over the section and the file.
    caplog.clear()
    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "env-tb"))
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(workdir / "env-otel"))
    with Tracking("p", "e", ["tensorboard"], config=config) as tracking:
        tracking.log({"x": 2.0}, step=1)
    assert tensorboard_scalars(workdir / "env-tb") == {"x": [(1, 2.0)]}
    assert tensorboard_scalars(workdir / "from-section" / "tb") == {"x": [(1, 1.0)]}
    assert (workdir / "env-otel" / ".otel-rl" / "spool").is_dir()
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"otel-rl: the OTEL_RL_CONFIG file {config_file} sets 'log_dir' to "
                     f"'from-file'; OTEL_RL_LOG_DIR ('{workdir / 'env-otel'}') is used")
        for m in messages
    ), messages
    assert any(
        m.startswith("otel-rl: verl config 'otel_rl' sets 'tensorboard.log_dir' to "
                     f"'from-section/tb'; TENSORBOARD_DIR ('{workdir / 'env-tb'}') is used")
        for m in messages
    ), messages


@pytest.mark.parametrize("form", ["dict", "omegaconf"])
def test_a_typo_under_otel_rl_is_the_loggers_did_you_mean(workdir, form):
    with pytest.raises(ConfigError) as core_error:
        Logger({"tensorbord_enabled": True})
    config = {"trainer": {"project_name": "p"}, "otel_rl": {"tensorbord_enabled": True}}
    with pytest.raises(ConfigError) as error:
        Tracking("p", "e", ["console"], config=as_given(config, form))
    assert str(error.value) == f"verl config 'otel_rl': {core_error.value}"
    assert str(error.value) == (
        "verl config 'otel_rl': unknown logger config key 'tensorbord_enabled'; "
        "did you mean 'tensorboard_enabled'?"
    )
    # A nested key and a wrong type, all reported at once, as the Logger reports them.
    section = {"prometheus": {"enabeld": True}, "export": {"queue_size": "big"}}
    with pytest.raises(ConfigError) as core_error:
        Logger(section)
    with pytest.raises(ConfigError) as error:
        Tracking("p", "e", ["console"], config=as_given({"otel_rl": section}, form))
    assert str(error.value) == f"verl config 'otel_rl': {core_error.value}"
    assert "'prometheus.enabeld'; did you mean 'enabled'?" in str(error.value)
    assert active_tracking() is None  # nothing was started


def test_bad_otel_rl_sections_and_files_are_clear_errors(workdir, monkeypatch):
    with pytest.raises(ConfigError, match=r"verl config 'otel_rl' must be a mapping .* got list"):
        Tracking("p", "e", ["console"], config={"otel_rl": ["prometheus"]})
    omegaconf = pytest.importorskip("omegaconf")
    broken = omegaconf.OmegaConf.create({"otel_rl": {"log_dir": "${trainer.nope}"}})
    with pytest.raises(ConfigError, match=r"Tracking config: cannot resolve .*trainer\.nope"):
        Tracking("p", "e", ["console"], config=broken)
    bad_file = workdir / "bad.yaml"
    bad_file.write_text("prometheus: {prot: 0}\n")
    monkeypatch.setenv("OTEL_RL_CONFIG", str(bad_file))
    with pytest.raises(ConfigError) as error:
        Tracking("p", "e", ["console"])
    assert str(error.value) == (
        f"OTEL_RL_CONFIG file {bad_file}: unknown logger config key 'prometheus.prot'; "
        "did you mean 'port'?"
    )
    assert active_tracking() is None


# ---- NeMo RL: the same attributes ----------------------------------------------------------------


def test_nemo_rl_logger_exposes_the_core_loggers_attributes(
    workdir, engine, receiver, gpu_node
):
    """NeMo RL's logger section as an OmegaConf DictConfig (lists are ListConfigs there)."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({
        "log_dir": str(workdir / "logs"),
        "wandb_enabled": False, "swanlab_enabled": False, "mlflow_enabled": False,
        "tensorboard_enabled": True, "wandb": {"project": "grpo"},
        "monitor_gpus": True,
        "gpu_monitoring": {"collection_interval": 0.2, "flush_interval": 0.5,
                           "endpoints": [gpu_node], "timeout": 2.0},
        "prometheus": {"enabled": True, "port": 0},
        "otlp": {"enabled": True, "endpoint": receiver.endpoint, "interval": 60.0},
        "rollout_monitoring": {"endpoints": [engine.url], "collection_interval": 3600},
    })
    logger = NemoLogger(cfg)
    core = logger.core
    try:
        assert logger.prometheus_url == core.prometheus_url is not None
        assert logger.otlp_endpoint == core.otlp_endpoint is not None
        assert logger.rollout_monitor is core.rollout_monitor
        assert isinstance(logger.rollout_monitor, RolloutMonitor)
        assert logger.gpu_monitor is core.gpu_monitor and logger.gpu_monitor is not None
        wait_for(lambda: logger.rollout_monitor.stats["rounds"] >= 1)
        engine.page = V1_LATER
        for step in (1, 2):
            with logger.timer("generation"):
                time.sleep(0.02)
            logger.log_metrics({"loss": 1.0 / step}, step, prefix="train", step_finished=True)
            assert logger.flush(timeout=30)
        page = prometheus_samples(logger.prometheus_url)
        assert page["train_loss"] == 0.5
        assert page["timing_generation_seconds_count"] == 2.0
    finally:
        logger.finish()

    scalars = tensorboard_scalars(workdir / "logs" / "tensorboard")
    assert scalars["train/loss"] == [(1, 1.0), (2, 0.5)]
    assert [s for s, _ in scalars["timing/generation"]] == [1, 2]
    assert all(seconds >= 0.02 for _, seconds in scalars["timing/generation"])
    assert scalars["rollout/requests_finished"] == [(1, V1_FINISHED), (2, 0.0)]
    assert {v for _, v in scalars["ray/node.0.gpu.0.util"]} == {GPU0_UTIL}
    assert receiver.last_point("train/loss").as_double == 0.5


def test_nemo_rl_logger_without_those_outputs_says_none(workdir):
    cfg = {"log_dir": str(workdir / "logs"), "tensorboard_enabled": True}
    with NemoLogger(cfg) as logger:
        assert logger.prometheus_url is None and logger.otlp_endpoint is None
        assert logger.rollout_monitor is None and logger.gpu_monitor is None
        with logger.timer("x"):
            time.sleep(0.01)
        logger.log_metrics({"a": 1.0}, 4)
    scalars = tensorboard_scalars(workdir / "logs" / "tensorboard")
    assert scalars["a"] == [(4, 1.0)]
    ((step, seconds),) = scalars["timing/x"]
    assert step == 4 and seconds >= 0.01


# ---- verl: ValidationGenerationsLogger with no Tracking ------------------------------------------


def test_standalone_generations_are_verls_tensorboard_text(workdir, monkeypatch):
    """verl's async rollouter: no Tracking in the process; the generations go to
    TENSORBOARD_DIR as verl's text, read back with TensorBoard's reader and text plugin."""
    from tensorboard.plugins.text import text_plugin
    from tensorboard.util import tensor_util

    monkeypatch.setenv("TENSORBOARD_DIR", str(workdir / "tb"))
    reasoning = "Two plus two: add the units, no carry, so the total is four. " * 3 + "#### 4"
    generations = ValidationGenerationsLogger("gsm8k", "ppo-qwen")
    generations.log(
        loggers=["console", "tensorboard"],
        samples=[("What is 2+2?", reasoning, 1.0), ("What is 3+3?", "7", np.float32(0.0))],
        step=10,
    )
    generations.log(loggers=["tensorboard"], samples=[("Q", "A")], step=20)
    generations.finish()

    acc = tensorboard_accumulator(workdir / "tb")
    assert acc.Tags()["tensors"] == ["val/generations"]
    assert acc.SummaryMetadata("val/generations").plugin_data.plugin_name == "text"
    events = acc.Tensors("val/generations")
    assert [e.step for e in events] == [10, 20]
    texts = [e.tensor_proto.string_val[0].decode() for e in events]
    assert texts[0] == (
        "**Generation Results - Step 10**\n\n"
        "| input | output | score |\n|---|---|---|\n"
        f"| What is 2+2? | {reasoning[:79]}… | 1.0 |\n"
        "| What is 3+3? | 7 | 0.0 |\n\n"
        "### Sample 1\n**Input:** What is 2+2?\n\n"
        f"**Output:** {reasoning}\n\n**Score:** 1.0\n\n---\n\n"
        "### Sample 2\n**Input:** What is 3+3?\n\n**Output:** 7\n\n**Score:** 0.0\n\n---\n\n"
    )
    # A sample that is not (input, output, score): verl writes it whole as Data.
    assert texts[1] == (
        "**Generation Results - Step 20**\n\n"
        "| input | output | score |\n|---|---|---|\n| Q | A |  |\n\n"
        "### Sample 1\n**Data:** ('Q', 'A')\n\n---\n\n"
    )
    # TensorBoard's text plugin renders it: one heading per sample, the summary as a table.
    html = text_plugin.text_array_to_html(tensor_util.make_ndarray(events[0].tensor_proto), True)
    assert "<h3>Sample 1</h3>" in html and "<h3>Sample 2</h3>" in html
    assert "<p><strong>Score:</strong> 1.0</p>" in html
    assert "<td>What is 3+3?</td>" in html
