"""The rest of NeMo RL's logging module in the drop-in: ``LoggerInterface`` loggers fed on their
own delivery threads, the per-backend classes writing on their own (TensorBoard files read back,
W&B offline, a real MLflow server, SwanLab offline), backend classes replaced by name,
``RayGpuMonitorLogger`` against real ``/metrics`` endpoints and a local Ray cluster, and the
timer's module logger."""

from __future__ import annotations

import copy
import inspect
import logging
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from otel_rl.compat import nemo_rl
from otel_rl.compat.nemo_rl import (
    GpuMetricSnapshot,
    Logger,
    LoggerInterface,
    MLflowLogger,
    RayGpuMonitorLogger,
    SwanlabLogger,
    TensorboardLogger,
    Timer,
    WandbLogger,
)
from testkit import servers
from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node
from testkit.readers import tensorboard_accumulator, tensorboard_scalars

mlflow_server = servers.mlflow_server


def nemo_config(log_dir: Path, **extra: object) -> dict:
    cfg = {
        "log_dir": str(log_dir),
        "wandb_enabled": False,
        "tensorboard_enabled": True,
        "mlflow_enabled": False,
        "swanlab_enabled": False,
        "monitor_gpus": False,
        "wandb": {"project": "surface", "name": "surface-run"},
        "tensorboard": {},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    }
    cfg.update(extra)
    return cfg


def small_figure() -> Any:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 2))
    figure.add_subplot().plot([0, 1, 2], [2, 0, 1])
    return figure


class RecordingLogger(LoggerInterface):
    """A team's own backend: keeps every call, the thread it came on, and whether it finished."""

    def __init__(self, delay: float = 0.0, fail_first: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.threads: set[int] = set()
        self.delay = delay
        self.fail_first = fail_first
        self.finished = threading.Event()

    def _note(self, method: str, *args: Any) -> None:
        self.threads.add(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)
        if self.fail_first and not self.calls:
            self.calls.append(("raised", args))
            raise RuntimeError(f"{method} refused by a broken backend")
        self.calls.append((method, args))

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        self._note("log_metrics", metrics, step, prefix, step_metric, step_finished)

    def log_hyperparams(self, params):
        self._note("log_hyperparams", params)

    def log_histogram(self, histogram, step, name):
        self._note("log_histogram", histogram, step, name)

    def log_plot(self, figure, step, name):
        self._note("log_plot", figure, step, name)

    def finish(self) -> None:
        self.finished.set()


# ---- every public name of NeMo RL's modules ----------------------------------------------------


def test_nemo_rls_names_are_here_with_nemo_rls_parameters():
    """Each name NeMo RL's logger and timer modules define, with the parameters NeMo RL gives
    its constructor or function."""
    from otel_rl.compat import nemo_timer

    expected = {
        "TensorboardLogger": ["cfg", "log_dir"],
        "WandbLogger": ["cfg", "log_dir"],
        "SwanlabLogger": ["cfg", "log_dir"],
        "MLflowLogger": ["cfg", "log_dir"],
        "RayGpuMonitorLogger": ["collection_interval", "flush_interval", "metric_prefix",
                                "step_metric", "parent_logger"],
        "flatten_dict": ["d", "sep", "expand_lists"],
        "get_next_experiment_dir": ["base_log_dir"],
        "configure_rich_logging": ["level", "show_time", "show_path"],
        "log_container_init_timing": [],
        "should_log_nemo_gym_full_result_tables": ["wandb_enabled", "wandb_config"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(nemo_rl, name)).parameters) == params, name
    for name in ("WandbConfig", "SwanlabConfig", "TensorboardConfig", "MLflowConfig",
                 "GPUMonitoringConfig", "LoggerConfig", "Logger", "print_message_log_samples"):
        assert name in nemo_rl.__all__
    assert GpuMetricSnapshot.__annotations__.keys() == {"step", "metrics"}
    assert set(LoggerInterface.__abstractmethods__) == {
        "log_metrics", "log_hyperparams", "log_histogram", "log_plot"}
    for cls in (TensorboardLogger, WandbLogger, SwanlabLogger, MLflowLogger):
        assert issubclass(cls, LoggerInterface)
    timer_params = {
        "Timer": ["context"], "ThreadSafeTimer": ["context"], "convert_to_seconds":
        ["time_string"], "TimeoutChecker": ["timeout", "fit_last_save_time", "clock"],
    }
    for name, params in timer_params.items():
        assert list(inspect.signature(getattr(nemo_timer, name)).parameters) == params, name
    assert nemo_timer.logger.name == "otel_rl.compat.nemo_timer"
    for method in ("start", "stop", "record", "mark", "get_markers", "time", "get_elapsed",
                   "get_latest_elapsed", "reduce", "get_timing_metrics", "reset"):
        assert callable(getattr(nemo_timer.ThreadSafeTimer, method))


def test_importing_the_drop_in_imports_no_tracker_sdk():
    """The SDK attributes NeMo RL's module has are imported on first access, not at import."""
    heavy = ["wandb", "mlflow", "swanlab", "torch", "ray", "matplotlib.pyplot", "requests"]
    code = (
        "import sys, otel_rl.compat.nemo_rl as m\n"
        f"print([n for n in {heavy!r} if n in sys.modules])\n"
        "m.requests\n"
        "print('requests' in sys.modules, m.requests is sys.modules['requests'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True True"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        nemo_rl.not_a_name  # noqa: B018


# ---- a team's own LoggerInterface ---------------------------------------------------------------


def test_appended_logger_gets_every_call_on_its_own_thread(log_dir):
    """A LoggerInterface appended to ``logger.loggers`` receives each call with the arguments
    NeMo RL's Logger passes, in order, off the training thread; the built-in TensorBoard tracker
    still writes as before; ``finish()`` finishes it."""
    own = RecordingLogger()
    figure = small_figure()
    logger = Logger(nemo_config(log_dir))
    logger.loggers.append(own)
    metrics = {"loss": 0.5, "reward": 1.25}
    logger.log_metrics(metrics, 3, prefix="train")
    metrics["loss"] = 99.0  # the caller's dict changes after the call: the logger got a copy
    logger.log_metrics({"ray/ray_step": 7, "node.0.mem_gb": 2.0}, 7, prefix="ray",
                       step_metric="ray/ray_step")
    logger.log_hyperparams({"policy": {"lr": 1e-5}})
    logger.log_histogram([1.0, 2.0, 2.0], 3, "train/adv")
    logger.log_plot(figure, 3, "plots/curve")
    logger.log_plot_per_worker_timeline_metrics({0: [1, 2], 1: [3, 5]}, 4, "vllm", "kv", 0.5)
    logger.finish()

    assert own.finished.is_set()
    assert threading.get_ident() not in own.threads and len(own.threads) == 1
    methods = [call[0] for call in own.calls]
    assert methods == ["log_metrics", "log_metrics", "log_hyperparams", "log_histogram",
                       "log_plot", "log_plot", "log_plot"]
    assert own.calls[0][1] == ({"loss": 0.5, "reward": 1.25}, 3, "train", None, False)
    assert own.calls[1][1] == ({"ray/ray_step": 7, "node.0.mem_gb": 2.0}, 7, "ray",
                               "ray/ray_step", False)
    assert own.calls[2][1] == ({"policy": {"lr": 1e-5}},)
    assert own.calls[3][1] == ([1.0, 2.0, 2.0], 3, "train/adv")
    assert own.calls[4][1] == (figure, 3, "plots/curve")
    assert [(c[1][1], c[1][2]) for c in own.calls[5:]] == [(4, "vllm/per_worker_kv"),
                                                           (4, "vllm/average_kv")]
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["train/loss"] == [(3, 0.5)]
    assert scalars["train/reward"] == [(3, 1.25)]


class MutatingLogger(RecordingLogger):
    """Changes what it is handed, in place, as a careless backend might."""

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        super().log_metrics(copy.deepcopy(metrics), step, prefix, step_metric, step_finished)
        metrics["reward"].append(99.0)


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_each_logger_sees_a_calls_values_as_they_were_when_it_was_made(
    log_dir, delivery, otel_rl_warnings
):
    """A loop that reuses its dicts, lists and tensors for the next step, a logger that changes
    what it gets in place, and a slow one beside it: each call arrives with its own step's
    values, neither logger sees the other's change nor the caller's. With the delivery process,
    otel-rl's own trackers are not taken for foreign loggers (nothing refused, nothing lost)."""
    import torch

    slow, careless = RecordingLogger(delay=0.02), MutatingLogger()
    cfg = nemo_config(log_dir)
    cfg["export"] = {"delivery": delivery}
    logger = Logger(cfg)
    logger.loggers += [careless, slow]
    metrics = {"reward": [0.0, 1.0], "nested": {"x": 0}}
    tokens = torch.zeros(3)
    for step in range(1, 4):
        metrics["reward"][0] = float(step)
        metrics["nested"]["x"] = step
        tokens.fill_(float(step))
        logger.log_metrics(metrics, step, prefix="train")
        logger.log_histogram(tokens, step, "train/tokens")
    logger.finish()

    for own in (slow, careless):
        got = [args for method, args in own.calls if method == "log_metrics"]
        assert [(a[1], a[0]) for a in got] == [
            (step, {"reward": [float(step), 1.0], "nested": {"x": step}}) for step in (1, 2, 3)
        ]
        histograms = [args for method, args in own.calls if method == "log_histogram"]
        assert [(a[1], a[0].tolist()) for a in histograms] == [
            (step, [float(step)] * 3) for step in (1, 2, 3)
        ]
    assert metrics == {"reward": [3.0, 1.0], "nested": {"x": 3}}
    assert not [r for r in otel_rl_warnings.records if "refused" in r.getMessage()
                or "lost" in r.getMessage()]  # fmt: skip
    assert {e.name: e.lost for e in logger.core.exporters} == {"tensorboard": {}}
    assert tensorboard_scalars(log_dir / "tensorboard")["train/nested/x"] == [
        (1, 1.0), (2, 2.0), (3, 3.0)
    ]


def test_slow_and_raising_loggers_neither_block_nor_break_training(log_dir, otel_rl_warnings):
    """A logger that takes 0.3 s per call does not hold up ``log_metrics``; one that raises
    loses that call only (a warning names it) and gets the next; a healthy one gets all."""
    slow, broken, healthy = RecordingLogger(delay=0.3), RecordingLogger(fail_first=True), \
        RecordingLogger()
    logger = Logger(nemo_config(log_dir, tensorboard_enabled=False))
    logger.loggers.extend([slow, broken, healthy])
    started = time.perf_counter()
    for step in range(5):
        logger.log_metrics({"loss": float(step)}, step, prefix="train")
    spent = time.perf_counter() - started
    # Made on the training thread, the slow logger alone would take 1.5 s.
    assert spent < 0.75, f"5 calls took {spent:.3f}s with a 0.3 s/call logger attached"
    assert logger.flush(10)
    logger.finish()

    steps = [call[1][1] for call in healthy.calls]
    assert steps == [0, 1, 2, 3, 4]
    assert [call[1][1] for call in slow.calls] == [0, 1, 2, 3, 4]
    assert [(c[0], c[1][1]) for c in broken.calls] == [
        ("raised", 0), ("log_metrics", 1), ("log_metrics", 2), ("log_metrics", 3),
        ("log_metrics", 4)]
    warnings = [r.getMessage() for r in otel_rl_warnings.records]
    (refusal,) = [w for w in warnings if "set aside (" in w]
    assert "nemo_rl logger RecordingLogger" in refusal
    assert "RuntimeError: log_metrics refused by a broken backend" in refusal
    (loss,) = [w for w in warnings if "lost for good" in w]
    assert "RecordingLogger: 1 record(s) lost for good in this run: 1 refused" in loss
    assert all(logger_.finished.is_set() for logger_ in (slow, broken, healthy))


def test_a_hung_logger_is_left_behind_when_finish_runs_out_of_time(log_dir, otel_rl_warnings):
    """A logger that never returns: ``finish()`` ends within ``export.shutdown_timeout`` (+
    the grace), the built-in tracker has its rows, and one message says it, in the terms of
    the Logger it was given to: the deadline it has (no ``shutdown()`` was called), that it is
    left behind, and that the calls left are lost (there is no spool to turn on: its calls
    hold live objects)."""
    release = threading.Event()

    class Hung(RecordingLogger):
        def log_metrics(self, *args: Any, **kwargs: Any) -> None:
            release.wait(30)

    logger = Logger(nemo_config(log_dir, export={"shutdown_timeout": 1.0}))
    logger.loggers.append(Hung())
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step, prefix="train")
    started = time.monotonic()
    logger.finish()
    took = time.monotonic() - started
    release.set()
    assert took < 5.0
    assert tensorboard_scalars(log_dir / "tensorboard")["train/loss"] == [
        (0, 0.0), (1, 1.0), (2, 2.0)]
    warnings = [r.getMessage() for r in otel_rl_warnings.records]
    assert [w for w in warnings if "Hung" in w] == [
        "otel-rl: nemo_rl logger Hung: 3 record(s) not delivered before the shutdown timeout "
        "(export.shutdown_timeout: 1 s; it had not returned from a write or its close 0.3 s "
        "later and is left behind). They are lost: a LoggerInterface's calls hold live objects "
        "(figures, tensors) and are never spooled."
    ], warnings
    ((_, exporter),) = logger._channels.values()  # its counters say the same
    assert (exporter.delivery.undelivered, exporter.delivery.lost) == (3, {"exit_timeout": 3})


def test_a_run_left_open_delivers_its_own_loggers_calls_at_exit(tmp_path):
    """A script that never calls ``finish()``: at interpreter exit its own logger still gets
    every call (the slow one included) and is finished."""
    out = tmp_path / "calls.txt"
    script = f"""
import time
from otel_rl.compat.nemo_rl import Logger, LoggerInterface

class FileLogger(LoggerInterface):
    def __init__(self):
        self.out = open({str(out)!r}, "w")
    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        time.sleep(0.1)
        self.out.write(f"{{prefix}} {{step}} {{metrics['loss']}}\\n")
    def log_hyperparams(self, params): pass
    def log_histogram(self, histogram, step, name): pass
    def log_plot(self, figure, step, name): pass
    def finish(self):
        self.out.write("finished\\n")
        self.out.close()

logger = Logger({{"log_dir": {str(tmp_path / "logs")!r}, "wandb_enabled": False,
                 "tensorboard_enabled": False, "mlflow_enabled": False,
                 "swanlab_enabled": False, "monitor_gpus": False, "wandb": {{}},
                 "gpu_monitoring": {{"collection_interval": 10, "flush_interval": 10}}}})
logger.loggers.append(FileLogger())
for step in range(4):
    logger.log_metrics({{"loss": step / 4}}, step, prefix="train")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True)
    assert out.read_text().split("\n") == [
        "train 0 0.0", "train 1 0.25", "train 2 0.5", "train 3 0.75", "finished", ""]


# ---- the backend classes on their own -----------------------------------------------------------


def test_tensorboard_logger_on_its_own_writes_scalars_hparams_and_figures(tmp_path, capsys):
    import torch

    tb = TensorboardLogger({}, log_dir=str(tmp_path))
    tb.log_metrics({"loss": 0.5, "np": np.float32(1.5), "t": torch.tensor([2.5]),
                    "rows": [1, 2], "many": torch.tensor([1.0, 2.0])}, 4, prefix="train")
    tb.log_metrics({"loss": 0.25}, 5, prefix="train")
    tb.log_hyperparams({"policy": {"lr": 0.5}, "seed": 3})
    tb.log_plot(small_figure(), 5, "plots/curve")
    tb.log_histogram([1.0, 2.0], 5, "adv")  # NeMo RL's TensorBoard backend writes none
    tb.finish()

    out = capsys.readouterr().out
    assert "Skipping metric 'train/rows' for TensorBoard logging (unsupported type: list)" in out
    assert "Skipping metric 'train/many'" in out
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["train/loss"] == [(4, 0.5), (5, 0.25)]
    assert scalars["train/np"] == [(4, 1.5)]
    assert scalars["train/t"] == [(4, 2.5)]
    assert "train/rows" not in scalars and "train/many" not in scalars
    acc = tensorboard_accumulator(tmp_path)
    assert [image.step for image in acc.Images("plots/curve")] == [5]
    assert acc.Tags()["histograms"] == []
    # add_hparams writes its own run folder holding the flattened keys
    hparams_runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(hparams_runs) == 1
    from tensorboard.plugins.hparams import plugin_data_pb2

    hparams_run = tensorboard_accumulator(hparams_runs[0])
    session = hparams_run.SummaryMetadata("_hparams_/session_start_info")
    info = plugin_data_pb2.HParamsPluginData.FromString(session.plugin_data.content)
    hparams = info.session_start_info.hparams
    assert hparams["policy.lr"].number_value == 0.5 and hparams["seed"].number_value == 3


@pytest.mark.slow
def test_wandb_logger_on_its_own_writes_an_offline_run(offline_trackers, tmp_path, monkeypatch,
                                                       capsys):
    """W&B offline, read back with W&B's own decoder: prefixed rows at their steps, the step
    metric's rows on their own axis, the config without NeMo RL's own key, the pattern's axis,
    a histogram."""
    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    monkeypatch.chdir(tmp_path)  # no git repository here: code and diffs are not saved
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    backend = WandbLogger({"project": "surface", "name": "alone", "mode": "offline",
                           "log_nemo_gym_full_result_tables": True}, log_dir=str(run_dir))
    backend.define_metric("ray/*", step_metric="ray/ray_step")
    backend.log_hyperparams({"policy": {"lr": 0.001}})
    backend.log_metrics({"loss": 0.5}, 1, prefix="train")
    backend.log_metrics({"loss": 0.25}, 2, prefix="train", step_finished=True)
    backend.log_metrics({"node.0.mem_gb": 3.5, "ray/ray_step": 40}, 2, prefix="ray",
                        step_metric="ray/ray_step")
    backend.log_histogram([1.0, 2.0, 3.0], 3, "adv")
    backend.finish()
    assert backend.run is None
    assert "Initialized WandbLogger for project surface, run alone" in capsys.readouterr().out

    run = read_wandb(wandb_run_dirs(run_dir)[0])
    assert run.series("train/loss", axis="_step") == [(1, 0.5), (2, 0.25)]
    assert run.series("ray/node.0.mem_gb", axis="ray/ray_step") == [(40, 3.5)]
    assert run.config["policy"] == {"lr": 0.001}
    assert "log_nemo_gym_full_result_tables" not in run.config
    assert wandb_glob_axes(wandb_run_dirs(run_dir)[0]) == {"ray/*": "ray/ray_step"}
    (histogram,) = [row for row in run.history if row.get("adv._type") == "histogram"]
    assert histogram["_step"] == 3 and sum(histogram["adv.values"]) == 3
    assert histogram["adv.bins"][0] == 1.0 and histogram["adv.bins"][-1] == 3.0


def wandb_glob_axes(run_dir: Path) -> dict[str, str]:
    """``{pattern: step metric}`` of a run's ``define_metric`` globs, by W&B's own decoder."""
    import json

    wandb_cli = Path(sys.executable).with_name("wandb")
    command = [str(wandb_cli)] if wandb_cli.exists() else [sys.executable, "-m", "wandb"]
    out = subprocess.run([*command, "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {r["metric"]["glob_name"]: r["metric"]["step_metric"]
            for r in records if r.get("type") == "metric" and "glob_name" in r["metric"]}


@pytest.mark.slow
def test_swanlab_logger_on_its_own_writes_an_offline_run(offline_trackers, tmp_path):
    from testkit.tracker_readers import read_swanlab, swanlab_run_dirs

    backend = SwanlabLogger({"project": "surface", "name": "alone", "mode": "offline"},
                            log_dir=str(tmp_path / "swan"))
    backend.log_hyperparams({"seed": 5})
    backend.log_metrics({"loss": 0.5, "acc": 0.75}, 1, prefix="train")
    backend.log_metrics({"loss": 0.25, "train/epoch": 1}, 2, prefix="train",
                        step_metric="train/epoch")
    backend.finish()

    run = read_swanlab(swanlab_run_dirs(tmp_path / "swan")[0])
    assert run.scalars["train/loss"] == [(1, 0.5), (2, 0.25)]
    assert run.scalars["train/acc"] == [(1, 0.75)]
    assert run.scalars["train/epoch"] == [(2, 1.0)]
    assert run.config["seed"] == 5
    assert run.finish_state == "RUN_STATE_FINISHED"


@pytest.mark.slow
def test_mlflow_logger_on_its_own_against_a_server(mlflow_server, tmp_path, monkeypatch):
    """A real ``mlflow server``: scalars at their steps, lists as mean/p50/p90/max, worker lists
    merged, flattened params, the figure under ``plots/``; the experiment created with
    ``log_dir`` as its artifact location."""
    import mlflow
    from mlflow import MlflowClient

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)  # no global URI left behind
    experiment = f"surface-{uuid.uuid4().hex[:8]}"
    artifacts = tmp_path / "mlflow"
    backend = MLflowLogger({"experiment_name": experiment, "run_name": "alone",
                            "tracking_uri": mlflow_server.url}, log_dir=str(artifacts))
    try:
        # bools are not numbers to summarise, numpy's included
        backend.log_metrics({"loss": 0.5, "lens": [1, np.int64(2), 3.0, 4, True, np.True_]}, 1,
                            prefix="train")
        backend.log_metrics({"generation_logger_metrics": {"kv": {0: [1.0], 1: [3.0]}}}, 2)
        backend.log_hyperparams({"policy": {"lr": 0.5}, "tags": ["a", "b"]})
        backend.log_plot(small_figure(), 1, "curve")
    finally:
        mlflow.end_run()

    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(backend.run_id)
    assert run.info.run_name == "alone" and run.info.status == "FINISHED"
    assert run.data.metrics == {
        "train/loss": 0.5, "train/lens/mean": 2.5, "train/lens/p50": 2.5,
        "train/lens/p90": pytest.approx(3.7), "train/lens/max": 4.0,
        "generation_logger_metrics/kv/mean": 2.0, "generation_logger_metrics/kv/p50": 2.0,
        "generation_logger_metrics/kv/p90": pytest.approx(2.8),
        "generation_logger_metrics/kv/max": 3.0,
    }
    assert [m.step for m in client.get_metric_history(backend.run_id, "train/loss")] == [1]
    assert run.data.params == {"policy.lr": "0.5", "tags.0": "a", "tags.1": "b"}
    location = client.get_experiment_by_name(experiment).artifact_location
    assert Path(location.removeprefix("file://")) == artifacts
    assert (artifacts / backend.run_id / "artifacts" / "plots" / "curve.png").stat().st_size > 0


# ---- backend classes replaced by name -----------------------------------------------------------


class CountingTensorboard(TensorboardLogger):
    """NeMo RL's TensorBoard backend, subclassed by a team (it counts what it writes)."""

    built: list[tuple[Any, Any]] = []

    def __init__(self, cfg, log_dir=None):
        super().__init__(cfg, log_dir=log_dir)
        type(self).built.append((cfg, log_dir))
        self.metric_calls = 0

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        self.metric_calls += 1
        super().log_metrics(metrics, step, prefix, step_metric, step_finished)


class RecordingWandb(RecordingLogger):
    built: list[tuple[Any, Any]] = []

    def __init__(self, cfg, log_dir=None):
        super().__init__()
        type(self).built.append((cfg, log_dir))
        self.defined: list[tuple[str, str | None]] = []

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))


class RecordingMonitor:
    built: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        type(self).built.append(kwargs)
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True


def test_classes_put_in_place_of_nemo_rls_names_are_built_and_fed_as_nemo_rl_does(
    log_dir, monkeypatch
):
    """With other classes under ``WandbLogger``, ``TensorboardLogger`` and
    ``RayGpuMonitorLogger`` (as a patch or a team's fork puts them), the Logger builds them
    with NeMo RL's arguments instead of otel-rl's trackers for those backends, gives them NeMo
    RL's calls, and the subclassed TensorBoard backend's files hold each value once."""
    CountingTensorboard.built, RecordingWandb.built, RecordingMonitor.built = [], [], []
    monkeypatch.setattr(nemo_rl, "TensorboardLogger", CountingTensorboard)
    monkeypatch.setattr(nemo_rl, "WandbLogger", RecordingWandb)
    monkeypatch.setattr(nemo_rl, "RayGpuMonitorLogger", RecordingMonitor)
    cfg = nemo_config(log_dir, wandb_enabled=True, monitor_gpus=True,
                      tensorboard={"log_dir": "ignored-as-in-nemo-rl"},
                      gpu_monitoring={"collection_interval": 15.0, "flush_interval": 45.0})
    logger = Logger(cfg)
    wandb_backend, tb_backend = logger.loggers
    assert isinstance(wandb_backend, RecordingWandb) and logger.wandb_logger is wandb_backend
    assert isinstance(tb_backend, CountingTensorboard)
    assert RecordingWandb.built == [({"project": "surface", "name": "surface-run"},
                                     str(log_dir / "wandb"))]
    assert CountingTensorboard.built == [({"log_dir": "ignored-as-in-nemo-rl"},
                                          str(log_dir / "tensorboard"))]
    assert wandb_backend.defined == [("ray/*", "ray/ray_step")]
    assert RecordingMonitor.built == [{"collection_interval": 15.0, "flush_interval": 45.0,
                                       "metric_prefix": "ray", "step_metric": "ray/ray_step",
                                       "parent_logger": logger}]
    assert logger.gpu_monitor.started

    for step in (1, 2):
        logger.log_metrics({"loss": 1.0 / step}, step, prefix="train")
    logger.log_hyperparams({"lr": 0.25})
    assert logger.flush(10)
    assert wandb_backend.calls == [
        ("log_metrics", ({"loss": 1.0}, 1, "train", None, False)),
        ("log_metrics", ({"loss": 0.5}, 2, "train", None, False)),
        ("log_hyperparams", ({"lr": 0.25},)),
    ]
    logger.finish()
    assert logger.gpu_monitor.stopped and wandb_backend.finished.is_set()
    assert tb_backend.metric_calls == 2
    assert tensorboard_scalars(log_dir / "tensorboard")["train/loss"] == [(1, 1.0), (2, 0.5)]


def test_otel_rls_own_classes_mean_otel_rls_trackers(log_dir):
    """Unreplaced names: the TensorBoard backend is otel-rl's tracker (lists as statistics)."""
    with Logger(nemo_config(log_dir)) as logger:
        (tracker,) = logger.loggers
        assert not isinstance(tracker, LoggerInterface)
        logger.log_metrics({"lens": [1.0, 3.0]}, 1, prefix="train")
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["train/lens/mean"] == [(1, 2.0)]


# ---- RayGpuMonitorLogger ----------------------------------------------------------------------


def test_gpu_monitor_reads_a_ray_nodes_metrics_endpoint():
    """A simulated 8xH100 node's ``/metrics`` (Ray 2.60's exposition) over real HTTP: NeMo RL's
    names, memory in GiB, and the GPU model by ``_collect_gpu_sku``'s parser."""
    node = simulated_node(4)
    monitor = RayGpuMonitorLogger(1, 1, "ray", "ray/ray_step", None)
    with NodeFarm() as farm:
        url = farm.add(render(node, H100_FIXTURE.read_text()))
        address = url.removeprefix("http://").removesuffix("/metrics")
        values = monitor._fetch_and_parse_metrics(2, address, monitor._parse_metric)
        models = monitor._fetch_and_parse_metrics(2, address, monitor._parse_gpu_sku)
    expected = {"node.2.mem_gb": node.mem_used / 2**30,
                "node.2.mem_total_gb": node.mem_total / 2**30}
    for i, gpu in node.gpus.items():
        expected[f"node.2.gpu.{i}.util"] = gpu.utilization
        expected[f"node.2.gpu.{i}.mem_gb"] = gpu.used_mib / 1024
    assert values == pytest.approx(expected)
    assert models == {f"node.2.gpu.{i}.type": "NVIDIA H100 80GB HBM3" for i in range(8)}


def test_gpu_monitor_flush_hands_each_collection_to_the_parent_at_its_step(log_dir):
    with Logger(nemo_config(log_dir)) as logger:
        monitor = RayGpuMonitorLogger(1, 1, "ray", "ray/ray_step", parent_logger=logger)
        monitor.metrics_buffer = [{"step": 10, "metrics": {"node.0.gpu.0.util": 50.0}},
                                  {"step": 20, "metrics": {"node.0.gpu.0.util": 75.0}}]
        monitor.flush()
        assert monitor.metrics_buffer == []
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["ray/node.0.gpu.0.util"] == [(10, 50.0), (20, 75.0)]


def test_gpu_monitor_start_needs_ray_initialised():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster of another test is up")
    with pytest.raises(ValueError, match="Ray must be initialized"):
        RayGpuMonitorLogger(1, 1, "ray", "ray/ray_step").start()


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_gpu_monitor_on_a_local_ray_cluster(ray_cluster, log_dir):
    """Started against a real local Ray cluster (CPU only: host memory), the monitor finds the
    node through ``ray.nodes()``, and its rows reach the Logger's TensorBoard on the
    ``ray/ray_step`` axis of seconds since it started."""
    with Logger(nemo_config(log_dir)) as logger:
        monitor = RayGpuMonitorLogger(0.2, 0.5, "ray", "ray/ray_step", parent_logger=logger)
        monitor.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not monitor._collect_metrics():
            time.sleep(0.2)
        time.sleep(1.0)
        monitor.stop()
        assert not monitor.is_running
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    total = scalars["ray/node.0.mem_total_gb"]
    used = scalars["ray/node.0.mem_gb"]
    assert total and len(used) == len(total)
    meminfo = Path("/proc/meminfo").read_text().split("\n")[0].split()
    host_gib = int(meminfo[1]) * 1024 / 2**30
    assert all(0 < value <= host_gib * 1.01 for _, value in total)
    assert all(0 < u <= t for (_, u), (_, t) in zip(used, total, strict=True))
    assert [step for step, _ in total] == sorted(step for step, _ in total)


# ---- the timer's module logger -----------------------------------------------------------------


def test_timer_lines_reach_either_logger_name_once(caplog):
    """NeMo RL's timer logs under its module's name: the drop-in's module name switches the
    DEBUG lines on too; with both names enabled each line is written once."""
    timer = Timer(context={"rank": 1})
    with caplog.at_level(logging.DEBUG, logger="otel_rl.compat.nemo_timer"):
        timer.record("gen", 0.25)
    assert [(r.name, r.getMessage().split(" ts=")[0]) for r in caplog.records] == [
        ("otel_rl.compat.nemo_timer", f"[rank=1 hostname={timer._context['hostname']}] gen "
                                      "record elapsed=0.2500s")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="otel_rl.compat.nemo_timer"), \
            caplog.at_level(logging.DEBUG, logger="nemo_rl.utils.timer"):
        timer.mark("crash")
    assert [r.name for r in caplog.records] == ["nemo_rl.utils.timer"]
