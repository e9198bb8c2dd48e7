"""NeMo RL's public behaviour, difference by difference: what ``nemo_rl.utils.logger`` and
``nemo_rl.utils.timer`` do and print, observed through ``otel_rl.compat.nemo_rl`` exactly as a
NeMo RL script or its nightly checks observe it."""

from __future__ import annotations

import gc
import logging
import time
import uuid
from pathlib import Path

import pytest

from otel_rl.compat.nemo_rl import (
    Logger,
    TimeoutChecker,
    Timer,
    log_container_init_timing,
    print_message_log_samples,
)
from testkit import servers
from testkit.readers import metric_rows

mlflow_server = servers.mlflow_server


def nemo_config(log_dir: Path, **extra: object) -> dict:
    """A NeMo RL ``logger:`` section with every backend off, as its configs spell it."""
    cfg = {
        "log_dir": str(log_dir),
        "wandb_enabled": False,
        "tensorboard_enabled": False,
        "mlflow_enabled": False,
        "swanlab_enabled": False,
        "monitor_gpus": False,
        "wandb": {"project": "p", "name": "n"},
        "tensorboard": {},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    }
    cfg.update(extra)
    return cfg


# ---- Logger.loggers holds exactly the enabled backends ------------------------------------------


def test_every_backend_off_means_no_loggers_and_jsonl_only_when_asked(log_dir, capsys):
    logger = Logger(nemo_config(log_dir))
    assert logger.loggers == []
    assert capsys.readouterr().out == "No loggers initialized\n"  # NeMo RL's notice
    logger.log_metrics({"loss": 1.0}, 1, prefix="train")
    logger.finish()
    assert not (log_dir / "metrics.jsonl").exists()

    with Logger(nemo_config(log_dir, jsonl_enabled=True)) as logger:
        assert [e.name for e in logger.loggers] == ["jsonl"]
        logger.log_metrics({"loss": 0.5}, 3, prefix="train")
    # The same config in the same log dir is the run's next attempt (docs/recipes/nemo-rl.md).
    (row,) = metric_rows(log_dir / "metrics.jsonl")
    assert row["step"] == 3 and row["metrics"] == {"train/loss": 0.5} and row["attempt"] == 2
    assert "No loggers initialized" not in capsys.readouterr().out


# ---- print_message_log_samples prints NeMo RL's screen ------------------------------------------

MESSAGES = [
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": f"What is {k} + {k}?"},
     {"role": "assistant", "content": f"{2 * k} [/done]"}]
    for k in range(5)
]
REWARDS = [0.0, 1.0, -1.0, 0.5, 1.0]

# What NeMo RL's print_message_log_samples(MESSAGES, REWARDS, num_samples=3, step=7) prints on
# a 72-column terminal without colours: the two highest-ranked halves (one each) and the median
# sample, numbered from 1, rewards with 4 decimals.
NEMO_RL_SCREEN = """\
─────────────────────────── TRAINING STEP 7 ────────────────────────────
╭───────────────────────── Reward Statistics ──────────────────────────╮
│ Batch Summary                                                        │
│ Total Samples: 5                                                     │
│ Avg Reward: 0.3000                                                   │
│ Min: -1.0000 | Max: 1.0000                                           │
│                                                                      │
│ Discrete Reward Levels:                                              │
│ 🔴 Reward -1.0000: ██████████ (1 samples)                            │
│ 🟠 Reward 0.0000: ▒▒▒▒▒▒▒▒▒▒ (1 samples)                             │
│ ✨ Reward 0.5000: ██████████ (1 samples)                             │
│ 🔥 Reward 1.0000: ████████████████████ (2 samples)                   │
╰──────────────────────────────────────────────────────────────────────╯

Sample Conversations
╭──────────────────── 🔥 Sample 1 | Reward: 1.0000 ────────────────────╮
│ SYSTEM: Answer briefly.                                              │
│                                                                      │
│ USER: What is 1 + 1?                                                 │
│                                                                      │
│ ASSISTANT: 2 [/done]                                                 │
╰──────────────────────────────────────────────────────────────────────╯

╭─────────────────── 🔴 Sample 2 | Reward: -1.0000 ────────────────────╮
│ SYSTEM: Answer briefly.                                              │
│                                                                      │
│ USER: What is 2 + 2?                                                 │
│                                                                      │
│ ASSISTANT: 4 [/done]                                                 │
╰──────────────────────────────────────────────────────────────────────╯

╭──────────────────── ✨ Sample 3 | Reward: 0.5000 ────────────────────╮
│ SYSTEM: Answer briefly.                                              │
│                                                                      │
│ USER: What is 3 + 3?                                                 │
│                                                                      │
│ ASSISTANT: 6 [/done]                                                 │
╰──────────────────────────────────────────────────────────────────────╯

──────────────────────────── End of Samples ────────────────────────────
"""


@pytest.fixture
def plain_terminal(monkeypatch):
    """stdout as a 72-column terminal without colours (rich reads these at Console())."""
    monkeypatch.setenv("COLUMNS", "72")
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES"):
        monkeypatch.delenv(name, raising=False)


def test_print_message_log_samples_prints_nemo_rls_screen(plain_terminal, capsys):
    print_message_log_samples(MESSAGES, REWARDS, num_samples=3, step=7)
    assert capsys.readouterr().out == NEMO_RL_SCREEN


def test_print_message_log_samples_with_a_recording_console_and_small_inputs(capsys):
    from rich.console import Console

    console = Console(record=True, width=72, color_system=None, file=_Sink())
    print_message_log_samples(MESSAGES, REWARDS, num_samples=3, step=7, console=console)
    assert console.export_text() == NEMO_RL_SCREEN

    # Upstream's test input: one sample, shown as "Sample 1 | Reward: 1.0000".
    single = [[{"role": "user", "content": "What is 2+2?"},
               {"role": "assistant", "content": "2+2 = 4"}]]
    print_message_log_samples(single, [1.0], num_samples=1, step=0)
    out = capsys.readouterr().out
    assert "What is 2+2?" in out and "2+2 = 4" in out and "Sample 1 | Reward: 1.0000" in out

    # One of several: the highest reward. Nothing to show: NeMo RL's line, before any check
    # of num_samples. num_samples <= 0 with samples: nothing at all.
    print_message_log_samples(MESSAGES, REWARDS, num_samples=1, step=1)
    titles = [line for line in capsys.readouterr().out.splitlines() if "| Reward:" in line]
    assert len(titles) == 1 and "Sample 1 | Reward: 1.0000" in titles[0]
    print_message_log_samples([], [], num_samples=0)
    assert capsys.readouterr().out == "⚠️  No message logs or rewards to display\n"
    print_message_log_samples(MESSAGES, REWARDS, num_samples=0)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="same length"):
        print_message_log_samples(MESSAGES, REWARDS[:2], num_samples=2)


class _Sink:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


# ---- TimeoutChecker -----------------------------------------------------------------------------


class Clock:
    """A hand-set time source, so deadlines are tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_timeout_checker_saves_once_at_the_deadline():
    clock = Clock()
    checker = TimeoutChecker(timeout="00:00:00:10", clock=clock)
    assert checker.last_save_time == 10
    clock.now += 9.9
    assert checker.check_save() is False
    clock.now += 0.1
    assert checker.check_save() is True
    assert checker.check_save() is False  # one save per job, as in NeMo RL
    assert checker.last_saved is True

    never = TimeoutChecker(timeout=None, clock=clock)
    clock.now += 10 ** 9
    assert never.check_save() is False
    assert TimeoutChecker().last_save_time == 3 * 3600 + 45 * 60  # NeMo RL's default 00:03:45:00
    assert TimeoutChecker(timeout="00:00:00:00").check_save() is True  # the real clock


def test_timeout_checker_fits_one_more_iteration_before_the_deadline():
    clock = Clock()
    fitted = TimeoutChecker(timeout="00:00:01:00", fit_last_save_time=True, clock=clock)
    plain = TimeoutChecker(timeout="00:00:01:00", clock=clock)
    fitted.start_iterations()
    plain.start_iterations()
    for seconds in (4.0, 6.0, 5.0):  # a mean iteration of 5 s
        clock.now += seconds
        fitted.mark_iteration()
        plain.mark_iteration()
    assert fitted.iteration_times == [4.0, 6.0, 5.0]
    assert fitted.previous_iteration_time == clock.now
    clock.now += 40.0  # 55 s elapsed: 55 + 5 reaches 60 only when fitting the last save
    assert fitted.check_save() is True
    assert plain.check_save() is False
    clock.now += 5.0
    assert plain.check_save() is True


def test_timeout_checker_mark_without_start_is_a_clear_error():
    checker = TimeoutChecker(clock=Clock())
    with pytest.raises(RuntimeError, match="before start_iterations"):
        checker.mark_iteration()
    assert checker.iteration_times == []


# ---- log_container_init_timing ------------------------------------------------------------------

TIMING_ENV = ("SLURM_JOB_START_TIME", "NRL_JOB_START_EPOCH", "NRL_RAY_READY_EPOCH")


@pytest.fixture
def no_timing_env(monkeypatch):
    for name in TIMING_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_container_init_timing_without_job_start_warns_and_prints_nothing(
    no_timing_env, caplog, capsys
):
    with caplog.at_level(logging.WARNING):
        log_container_init_timing()
    (record,) = [r for r in caplog.records if "NRL_JOB_START_EPOCH" in r.getMessage()]
    assert record.name == "root" and record.levelno == logging.WARNING
    assert record.getMessage() == (
        "Cannot detect container startup time: NRL_JOB_START_EPOCH not set. "
        "Ensure the launch script exports this variable for init timing."
    )
    assert capsys.readouterr().out == ""


def _timing_block(out: str) -> list[str]:
    assert out.startswith("\n" + "=" * 60 + "\n" + " " * 14 + "CONTAINER INIT TIMING\n")
    assert out.endswith("\n" + "=" * 60 + "\n\n")
    return out.splitlines()[3:-2]


def test_container_init_timing_total_only(no_timing_env, capsys):
    no_timing_env.setenv("NRL_JOB_START_EPOCH", str(time.time() - 42.0))
    log_container_init_timing()
    (line,) = _timing_block(capsys.readouterr().out)
    name, seconds = line.split(": ")
    assert name == "  total" and seconds.endswith("s")
    assert float(seconds[:-1]) == pytest.approx(42.0, abs=1.0)


def test_container_init_timing_full_breakdown(no_timing_env, capsys):
    now = time.time()
    no_timing_env.setenv("SLURM_JOB_START_TIME", str(now - 100.0))
    no_timing_env.setenv("NRL_JOB_START_EPOCH", str(now - 90.0))
    no_timing_env.setenv("NRL_RAY_READY_EPOCH", str(now - 30.0))
    log_container_init_timing()
    lines = _timing_block(capsys.readouterr().out)
    assert lines[:2] == [
        "  slurm_prologue: 10.0s",
        "  cluster_startup (orchestrator+container+ray): 60.0s",
    ]
    driver, total = (line.split(": ") for line in lines[2:])
    assert driver[0] == "  driver_startup (launch+python+imports)"
    assert float(driver[1][:-1]) == pytest.approx(30.0, abs=1.0)
    assert total[0] == "  total"  # counted from Slurm's start when it is known
    assert float(total[1][:-1]) == pytest.approx(100.0, abs=1.0)


# ---- MLflow artifact location -------------------------------------------------------------------


@pytest.mark.slow
def test_mlflow_experiment_keeps_artifacts_under_log_dir(mlflow_server, tmp_path, monkeypatch):
    """Against a real ``mlflow server``: a new experiment gets ``<log_dir>/mlflow`` as its
    artifact location when none is configured, and the run's artifacts land there; a configured
    ``artifact_location`` wins."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    client = MlflowClient(tracking_uri=mlflow_server.url)

    def run(log_dir: Path, **mlflow: str) -> tuple[str, str]:
        experiment = f"nemo-{uuid.uuid4().hex[:8]}"
        cfg = nemo_config(log_dir, mlflow_enabled=True, mlflow={
            "experiment_name": experiment, "run_name": "r", "tracking_uri": mlflow_server.url,
            **mlflow})
        with Logger(cfg) as logger:
            logger.log_metrics({"loss": 0.25, "note": "hello"}, 2, prefix="train")
            exporter = logger.loggers[0]
        run_id = exporter.run_id
        assert client.get_run(run_id).data.metrics == {"train/loss": 0.25}
        return client.get_experiment_by_name(experiment).artifact_location, run_id

    log_dir = tmp_path / "logs"
    location, run_id = run(log_dir)
    expected = log_dir.absolute() / "mlflow"
    assert Path(location.removeprefix("file://")) == expected
    note = expected / run_id / "artifacts" / "text" / "train" / "note" / "step_2.txt"
    assert note.read_text() == "hello"

    elsewhere = tmp_path / "artifacts-here"
    location, run_id = run(tmp_path / "logs2", artifact_location=str(elsewhere))
    assert Path(location.removeprefix("file://")) == elsewhere
    assert (elsewhere / run_id / "artifacts" / "text" / "train" / "note" / "step_2.txt").exists()
    assert not (tmp_path / "logs2" / "mlflow").exists()


# ---- Logger.__del__ stops the GPU monitor -------------------------------------------------------


def test_a_collected_logger_stops_its_gpu_monitor(log_dir):
    """A Logger dropped without finish() stops scraping the cluster (a real HTTP node
    endpoint on 127.0.0.1 stands in for a Ray node)."""
    from testkit.gpu_nodes import H100_FIXTURE, NodeFarm, render, simulated_node

    with NodeFarm() as farm:
        url = farm.add(render(simulated_node(1), H100_FIXTURE.read_text()))
        cfg = nemo_config(log_dir, monitor_gpus=True, gpu_monitoring={
            "collection_interval": 0.2, "flush_interval": 0.5, "endpoints": [url],
            "timeout": 2.0})
        logger = Logger(cfg)
        scraper, core = logger.gpu_monitor.scraper, logger.core
        assert scraper.running
        del logger
        gc.collect()
        assert not scraper.running
        core.finish()


# ---- the timer logs where NeMo RL's does --------------------------------------------------------


def test_timer_logs_under_nemo_rls_logger_name(caplog):
    timer = Timer(context={"rank": 2, "worker": "policy"})
    with caplog.at_level(logging.DEBUG, logger="nemo_rl.utils.timer"):
        with timer.time("idle/refit_bubble"):
            pass
        timer.record("generation", 1.0)
        timer.mark("vllm/worker_crashed", {"error": "OOM"})
    records = [r for r in caplog.records if r.name == "nemo_rl.utils.timer"]
    assert [r.levelno for r in records] == [logging.DEBUG] * 4
    messages = [r.getMessage() for r in records]
    assert messages[0].startswith("[rank=2 worker=policy hostname=")
    assert "] idle/refit_bubble start ts=" in messages[0]
    assert "] idle/refit_bubble end elapsed=" in messages[1]
    assert "] generation record elapsed=1.0000s ts=" in messages[2]
    assert "] vllm/worker_crashed mark meta={'error': 'OOM'} ts=" in messages[3]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nemo_rl.utils.timer"):
        timer.start("quiet")
        timer.stop("quiet")
    assert caplog.records == []
    with pytest.raises(ValueError, match=r"Timer 'never' is not running\. Running times: "):
        timer.stop("never")
