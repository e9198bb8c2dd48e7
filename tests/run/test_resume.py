"""A run that resumes: a relaunch with the same ``run_id`` continues one history in every tracker.

The first test is the whole story on real processes: a training process with TensorBoard, JSONL,
a real MLflow server, W&B offline and a Prometheus endpoint logs steps 0-530 (a checkpoint at
500), is SIGKILLed with MLflow behind (its server stopped), and is relaunched from step 501 to
600. Each tracker is then read back from its own storage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.delivery.spool import spool_root, waiting_records
from otel_rl.run.history import RUN_ID_ENV
from testkit.readers import jsonl_rows, tensorboard_scalars
from testkit.servers import start_mlflow_server, stop_mlflow_server
from testkit.tracker_readers import (
    read_wandb,
    wandb_folder_run_id,
    wandb_run_dirs,
    wandb_wrote_a_run,
)
from testkit.waiting import wait_for


@pytest.fixture(autouse=True)
def _trackers_of_this_test_only(monkeypatch):
    """MLflow's default store under ``log_dir``, and W&B's own service for each process: what
    earlier code in this process left in the environment (``mlflow.set_experiment`` sets
    ``MLFLOW_EXPERIMENT_ID``, W&B keeps its service's address in ``WANDB_SERVICE``, which
    children would otherwise share) does not reach these runs."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID", "WANDB_SERVICE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


_TRAINING = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from otel_rl import Logger

    cfg, first, last, attempt_value, pause_at, killed = json.loads(sys.argv[1])
    logger = Logger(cfg)
    attempt = logger.history.attempt
    print("attempt", attempt, "metrics", logger.prometheus_url, flush=True)
    for step in range(first, last + 1):
        with logger.timer("generation"):
            reward = step + attempt_value
        logger.log_metrics({"train/reward": reward}, step=step)
        if step == 500:
            Path(cfg["log_dir"], "checkpoint-500").write_text("500")
        if step == pause_at:  # the test acts here (stops a server, reads /metrics), then goes on
            print("paused", step, flush=True)
            while not Path(cfg["log_dir"], f"go-{attempt}").exists():
                time.sleep(0.05)
    print("logged", last, flush=True)
    if killed:
        time.sleep(600)
    logger.finish()
    print("finished", flush=True)
    """
)


def _training(cfg: dict, first: int, last: int, value: float, pause_at: int, killed: bool):
    return subprocess.Popen(
        [sys.executable, "-c", _TRAINING, json.dumps([cfg, first, last, value, pause_at, killed])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _read_until(process: subprocess.Popen, word: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(word):
            return line
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"no {word!r} from the training process: {process.stderr.read()[-3000:]}")


@pytest.mark.slow
def test_a_run_killed_at_530_and_relaunched_from_501_has_one_history_in_every_tracker(
    tmp_path, offline_trackers
):
    from mlflow import MlflowClient

    server = start_mlflow_server(tmp_path / "mlflow-server")
    log_dir = tmp_path / "logs"
    cfg = {
        "log_dir": str(log_dir), "run_id": "grpo-7",
        "tensorboard_enabled": True, "jsonl_enabled": True, "wandb_enabled": True,
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": server.url, "experiment_name": "resume"},
        "wandb": {"project": "resume"},
        "prometheus": {"enabled": True, "port": 0},
        "export": {"retry_max_backoff": 0.5, "shutdown_timeout": 60},
    }  # fmt: skip
    try:
        first = _training(cfg, 0, 530, 0.25, pause_at=510, killed=True)
        assert _read_until(first, "attempt").split()[1] == "1"
        _read_until(first, "paused")
        # MLflow falls behind: its server stops answering for the last 20 steps and the kill.
        os.killpg(os.getpgid(server.process.pid), signal.SIGSTOP)
        (log_dir / "go-1").write_text("")
        _read_until(first, "logged")
        time.sleep(1.5)  # > export.fsync_interval: every step logged is in the spools
        first.kill()
        first.wait(30)
        os.killpg(os.getpgid(server.process.pid), signal.SIGCONT)
        mlflow_spool = next((spool_root(log_dir) / "mlflow").iterdir())
        left = waiting_records(mlflow_spool)
        assert left >= 20, f"MLflow should be behind at the kill; {left} record(s) wait"
        assert (log_dir / "checkpoint-500").read_text() == "500"

        second = _training(cfg, 501, 600, 0.75, pause_at=600, killed=False)
        attempt_line = _read_until(second, "attempt")
        assert attempt_line.split()[1] == "2"
        _read_until(second, "paused")
        page = wait_for(lambda: _page_with(attempt_line.split()[3], "otel_rl_attempt"), 30,
                        "target_info on /metrics")  # fmt: skip
        (log_dir / "go-2").write_text("")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0, err[-3000:]
        assert "finished" in out
    except BaseException:
        os.killpg(os.getpgid(server.process.pid), signal.SIGCONT)
        stop_mlflow_server(server)
        raise

    try:
        client = MlflowClient(server.url)
        (experiment,) = [e for e in client.search_experiments() if e.name == "resume"]
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1, [r.info.run_id for r in runs]  # one MLflow run
        (run,) = runs
        assert run.data.tags["otel_rl.attempts"] == "2"
        assert run.data.tags["otel_rl.resume_steps"] == "501"
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "train/reward")
    finally:
        stop_mlflow_server(server)
    first_attempt = sorted(m.step for m in history if m.value % 1 == 0.25)
    second_attempt = sorted(m.step for m in history if m.value % 1 == 0.75)
    assert first_attempt == list(range(531))  # nothing of the first attempt lost, none twice
    assert second_attempt == list(range(501, 601))
    latest = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        latest[m.step] = m.value
    assert all(latest[s] == s + 0.75 for s in range(501, 601))  # the later value of a step

    # TensorBoard: the purge step hides the first attempt's 501-530; one value per step.
    scalars = tensorboard_scalars(log_dir / "tensorboard")["train/reward"]
    assert [step for step, _ in scalars] == list(range(601))
    assert all(v == pytest.approx(s + (0.75 if s > 500 else 0.25)) for s, v in scalars)

    # JSONL: every row carries its attempt; the latest attempt of each step is the one counted.
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    resumes = [r for r in rows if "resume" in r]
    assert [r["resume"] for r in resumes] == [{"attempt": 2, "step": 501}]
    values = [(r["attempt"], r["step"], r["metrics"]["train/reward"])
              for r in rows if "train/reward" in r.get("metrics", {})]  # fmt: skip
    assert sorted(s for a, s, _ in values if a == 1) == list(range(531))
    assert sorted(s for a, s, _ in values if a == 2) == list(range(501, 601))
    latest_view = {s: v for a, s, v in values if a == 2 or s < 501}
    assert latest_view == {s: s + (0.75 if s > 500 else 0.25) for s in range(601)}

    # W&B: one run id across the launches (and the replay that delivered the first one's tail),
    # as W&B names each launch's folder (``offline-run-<time>-<id>``) and as its records say. A
    # launch killed while ``wandb.init`` ran, or before W&B's service wrote its buffer, leaves a
    # folder without records (docs/reliability.md): its id is still the run's.
    folders = wandb_run_dirs(log_dir)
    (run_id,) = {wandb_folder_run_id(folder) for folder in folders}
    runs_read = [read_wandb(d) for d in folders if wandb_wrote_a_run(d)]
    assert {r.run_id for r in runs_read} - {""} == {run_id}
    steps = {}
    for r in runs_read:
        for step, value in r.series("train/reward"):
            steps.setdefault(int(step), set()).add(round(float(value) % 1, 2))
    assert set(range(501, 601)) <= set(steps) <= set(range(601))
    assert all(steps[s] >= {0.75} for s in range(501, 601))  # the new attempt's values show
    assert all(steps[s] == {0.25} for s in steps if s <= 500)

    # Prometheus: the attempt is a resource attribute of the relaunched process.
    assert 'otel_rl_attempt="2"' in page and 'otel_rl_run_id="grpo-7"' in page


def _page_with(url: str, text: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            page = response.read().decode()
    except OSError:
        return None
    return page if text in page else None


# ---- identity and modes -----------------------------------------------------------------------


def _jsonl_cfg(log_dir: Path, **extra) -> dict:
    return {"log_dir": str(log_dir), "jsonl_enabled": True, **extra}


def test_a_relaunch_with_the_same_run_id_is_the_next_attempt_and_a_new_id_a_new_run(log_dir):
    with Logger(_jsonl_cfg(log_dir, run_id="a")) as first:
        first.log_metrics({"x": 1.0}, step=0)
    with Logger(_jsonl_cfg(log_dir, run_id="a")) as second:
        second.log_metrics({"x": 2.0}, step=0)
    with Logger(_jsonl_cfg(log_dir, run_id="b")) as other:
        other.log_metrics({"x": 3.0}, step=0)
    assert (first.history.attempt, second.history.attempt, other.history.attempt) == (1, 2, 1)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["run_id"], r["attempt"], r["metrics"]) for r in rows] == [
        ("a", 1, {"x": 1.0}), ("a", 2, {}), ("a", 2, {"x": 2.0}), ("b", 1, {"x": 3.0}),
    ]  # fmt: skip
    assert rows[1]["resume"] == {"attempt": 2, "step": 0}


def test_the_run_id_comes_from_the_environment_when_the_config_has_none(log_dir, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "slurm-4242")
    with Logger(_jsonl_cfg(log_dir)) as first:
        first.log_metrics({"x": 1.0}, step=0)
    with Logger(_jsonl_cfg(log_dir)) as second:
        second.log_metrics({"x": 2.0}, step=1)
    assert first.run_id == second.run_id == "slurm-4242"
    assert second.history.attempt == 2
    with Logger(_jsonl_cfg(log_dir, run_id="given")) as given:  # the config wins
        given.log_metrics({"x": 3.0}, step=0)
    assert given.run_id == "given" and given.history.attempt == 1


def test_resume_must_refuses_a_run_it_cannot_find_and_never_starts_anew(log_dir):
    with pytest.raises(ConfigError, match=r"'must'.*run_id 'lost'.*resume: auto"):
        Logger(_jsonl_cfg(log_dir, run_id="lost", resume="must"))
    assert not (log_dir / "metrics.jsonl").exists()
    with Logger(_jsonl_cfg(log_dir, run_id="lost")) as first:  # the refused one was no attempt
        first.log_metrics({"x": 1.0}, step=0)
    assert first.history.attempt == 1
    with Logger(_jsonl_cfg(log_dir, run_id="lost", resume="must")) as second:
        second.log_metrics({"x": 2.0}, step=1)
    assert second.history.attempt == 2
    with Logger(_jsonl_cfg(log_dir, run_id="lost", resume="never")) as anew:
        anew.log_metrics({"x": 3.0}, step=0)
    assert anew.history.attempt == 3 and not anew.history.resumed  # a new run, never a rewind
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r.get("resume") for r in rows] == [None, {"attempt": 2, "step": 1}, None, None]


def test_a_bad_resume_mode_is_a_config_error_naming_the_choices(log_dir):
    with pytest.raises(ConfigError, match="resume"):
        Logger(_jsonl_cfg(log_dir, resume="sometimes"))


def test_the_relaunch_continues_the_same_mlflow_run_with_its_status_and_attempt_tags(log_dir):
    from mlflow import MlflowClient

    cfg = {"log_dir": str(log_dir), "run_id": "m", "mlflow_enabled": True, "jsonl_enabled": False}
    first = Logger(cfg)
    first.log_metrics({"loss": 1.0}, step=0)
    first.log_metrics({"loss": 0.9}, step=1)
    first.finish(exit_code=1)  # a failed launch: its run is FAILED until the relaunch
    client = MlflowClient(f"sqlite:///{log_dir / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FAILED"
    second = Logger(cfg)
    second.log_metrics({"loss": 0.5}, step=1)
    assert second.flush(timeout=30)
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    second.log_metrics({"loss": 0.4}, step=2)
    second.finish()
    (again,) = client.search_runs(["0"])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["otel_rl.attempts"] == "2"
    assert again.data.tags["otel_rl.resume_steps"] == "1"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 0.5), (1, 0.9), (2, 0.4)]


# ---- the previous launch is completed first ----------------------------------------------------


def _killed_launch(log_dir: Path, steps: range, run_id: str, **extra) -> None:
    """A launch SIGKILLed after logging ``steps`` with its JSONL tracker unable to write (the
    path is a folder), so every row waits in its spool."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "metrics.jsonl").mkdir()
    cfg = {**_jsonl_cfg(log_dir, run_id=run_id), **extra}
    script = textwrap.dedent(
        f"""
        import json, time
        from otel_rl import Logger
        logger = Logger(json.loads({json.dumps(json.dumps(cfg))}))
        for step in {list(steps)!r}:
            logger.log_metrics({{"x": step + 0.25}}, step=step)
        time.sleep(1.5)  # every step in the spool
        print("logged", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("logged")
    finally:
        process.kill()
        process.wait(30)
    (log_dir / "metrics.jsonl").rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_what_the_killed_launch_left_is_delivered_before_the_relaunch_writes(log_dir, delivery):
    _killed_launch(log_dir, range(0, 40), "k", export={"delivery": delivery})
    (spool,) = (spool_root(log_dir) / "jsonl").iterdir()
    assert waiting_records(spool) >= 39  # the last step may be a checkpoint only
    with Logger(_jsonl_cfg(log_dir, run_id="k", export={"delivery": delivery})) as relaunch:
        assert relaunch.history.attempt == 2
        for step in range(30, 45):
            relaunch.log_metrics({"x": step + 0.75}, step=step)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    resume_at = next(i for i, r in enumerate(rows) if "resume" in r)
    before, after = rows[:resume_at], rows[resume_at + 1 :]
    assert [(r["attempt"], r["step"], r["metrics"]["x"]) for r in before] == [
        (1, s, s + 0.25) for s in range(40)
    ]  # in order, exactly once, all of it before the relaunch's first row
    assert [(r["attempt"], r["step"], r["metrics"]["x"]) for r in after] == [
        (2, s, s + 0.75) for s in range(30, 45)
    ]
    assert rows[resume_at]["resume"] == {"attempt": 2, "step": 30}
    assert waiting_records(spool) == 0


@pytest.mark.slow
def test_a_relaunch_that_ends_before_the_earlier_launch_is_delivered_keeps_both_replayable(
    log_dir, otel_rl_warnings
):
    """The earlier launch's tracker cannot take its records (the JSONL path is still a folder):
    the relaunch's records wait in its own spool, ``finish`` says what is left, and a later
    ``otel-rl replay`` delivers both, the earlier launch first."""
    _killed_launch(log_dir, range(0, 10), "slow")
    (log_dir / "metrics.jsonl").mkdir()  # still unusable when the relaunch starts
    relaunch = Logger(_jsonl_cfg(log_dir, run_id="slow", export={"shutdown_timeout": 3}))
    for step in range(5, 12):
        relaunch.log_metrics({"x": step + 0.75}, step=step)
    started = time.monotonic()
    relaunch.finish()
    assert time.monotonic() - started < 3 + 2  # on time, whatever the earlier launch does
    said = " ".join(r.getMessage() for r in otel_rl_warnings.records)
    assert "not delivered" in said and "otel-rl replay" in said
    (log_dir / "metrics.jsonl").rmdir()
    out = subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["attempt"], r["step"]) for r in rows if "resume" not in r] == [
        *((1, s) for s in range(10)), *((2, s) for s in range(5, 12))
    ]


def test_a_relaunch_that_flushes_timers_before_its_first_step_supersedes_nothing_early(log_dir):
    """Timers flushed before the relaunch logs a step make a step of their own (0, as for any
    run): the attempt begins at the first step the caller logs, not there."""
    with Logger(_jsonl_cfg(log_dir, run_id="t", tensorboard_enabled=True)) as first:
        for step in range(10):
            first.log_metrics({"x": step + 0.25}, step=step)
    with Logger(_jsonl_cfg(log_dir, run_id="t", tensorboard_enabled=True)) as second:
        with second.timer("load_checkpoint"):
            pass
        second.flush()
        for step in range(5, 12):
            second.log_metrics({"x": step + 0.75}, step=step)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["resume"] for r in rows if "resume" in r] == [{"attempt": 2, "step": 5}]
    scalars = tensorboard_scalars(log_dir / "tensorboard")["x"]
    assert scalars == [(s, s + (0.75 if s >= 5 else 0.25)) for s in range(12)]


# ---- what a hostile relaunch does -----------------------------------------------------------


def _mlflow_runs(log_dir: Path) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{log_dir / 'mlflow' / 'mlflow.db'}")
    return client.search_runs(["0"])


@pytest.mark.slow
def test_a_relaunch_that_never_opened_its_tracker_leaves_the_run_for_the_next_one(log_dir):
    """Launch 2 logs nothing (killed while loading its checkpoint, say): its tracker never
    opened the run, and launch 3 still continues launch 1's run."""
    cfg = {"log_dir": str(log_dir), "run_id": "n", "mlflow_enabled": True, "jsonl_enabled": False}
    with Logger(cfg) as first:
        first.log_metrics({"loss": 1.0}, step=0)
    Logger(cfg).finish()
    with Logger(cfg) as third:
        third.log_metrics({"loss": 0.5}, step=1)
    assert third.history.attempt == 3
    (run,) = _mlflow_runs(log_dir)
    assert run.data.tags["otel_rl.attempts"] == "3" and run.data.metrics["loss"] == 0.5


def test_attempts_never_repeat_when_the_history_file_is_torn_damaged_or_lost(
    log_dir, otel_rl_warnings
):
    """A launch killed while appending its line (the torn line is written here: a kill cannot
    be timed inside one write), bytes that are no text, the file deleted: the next attempts
    still count up, from the run's spools when the file cannot say."""
    attempts = []
    history = log_dir / ".otel-rl" / "runs" / "h" / "launches.jsonl"
    damage = [
        lambda: history.open("ab").write(b'{"attempt": 2, "launch": "dead'),
        lambda: history.open("ab").write(b"\xff\xfe not text\n"),
        history.unlink,
        lambda: None,
    ]
    for step, harm in enumerate(damage):
        with Logger(_jsonl_cfg(log_dir, run_id="h")) as launch:
            launch.log_metrics({"x": float(step)}, step=step)
        attempts.append(launch.history.attempt)
        harm()
    assert attempts == [1, 2, 3, 4]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    resumes = [r["resume"]["attempt"] for r in rows if "resume" in r]
    assert resumes == [2, 3, 4]
    said = " ".join(r.getMessage() for r in otel_rl_warnings.records)
    assert "are not launches and are passed over" in said


def test_resume_never_is_a_new_run_said_once_and_the_next_auto_continues_it(
    log_dir, otel_rl_warnings
):
    cfg = {"log_dir": str(log_dir), "run_id": "v", "mlflow_enabled": True}
    with Logger(cfg) as first:
        first.log_metrics({"loss": 1.0}, step=0)
    with Logger({**cfg, "resume": "never"}) as anew:
        anew.log_metrics({"loss": 2.0}, step=0)
    with Logger(cfg) as then:
        then.log_metrics({"loss": 3.0}, step=1)
    assert [first.history.attempt, anew.history.attempt, then.history.attempt] == [1, 2, 3]
    said = [r.getMessage() for r in otel_rl_warnings.records if "resume: never" in r.getMessage()]
    assert len(said) == 1 and "run_id 'v' was launched 1 time(s)" in said[0]
    runs = {r.info.run_id: r for r in _mlflow_runs(log_dir)}
    assert len(runs) == 2  # the never-launch is a run of its own, which the next one continues
    (continued,) = [r for r in runs.values() if "otel_rl.attempts" in r.data.tags]
    assert continued.data.metrics["loss"] == 3.0 and continued.data.tags["otel_rl.attempts"] == "3"
    rows = [(r["attempt"], r["step"]) for r in jsonl_rows(log_dir / "metrics.jsonl")]
    assert rows == [(1, 0), (2, 0), (3, 1), (3, 1)]  # the resume record, then its row


def test_an_empty_run_id_is_said_and_replaced(log_dir, otel_rl_warnings, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "")
    with Logger(_jsonl_cfg(log_dir)) as logger:
        logger.log_metrics({"x": 1.0}, step=0)
    assert logger.run_id and logger.run_id.strip()
    assert any("run_id is empty" in r.getMessage() for r in otel_rl_warnings.records)


@pytest.mark.slow
def test_a_relaunch_while_a_replay_delivers_the_earlier_spool_waits_for_it(log_dir):
    """The operator runs ``otel-rl replay`` as the job is relaunched: the relaunch is not
    refused; it spools beside the spool the replay holds and writes only once the replay has
    let go of it (the lock is taken here the way a replay takes it)."""
    from otel_rl.delivery.spool import REPLAY_LOCK, SpoolLock

    _killed_launch(log_dir, range(0, 10), "busy")
    (spool,) = (spool_root(log_dir) / "jsonl").iterdir()
    replay = SpoolLock(spool, REPLAY_LOCK)
    replay.acquire()
    try:
        relaunch = Logger(_jsonl_cfg(log_dir, run_id="busy"))
        for step in range(5, 8):
            relaunch.log_metrics({"x": step + 0.75}, step=step)
        time.sleep(1.0)
        assert not (log_dir / "metrics.jsonl").exists()  # nothing before the earlier launch
    finally:
        replay.release()
    relaunch.finish()
    rows = [(r["attempt"], r["step"]) for r in jsonl_rows(log_dir / "metrics.jsonl")
            if "resume" not in r]  # fmt: skip
    assert rows == [*((1, s) for s in range(10)), *((2, s) for s in range(5, 8))]


@pytest.mark.slow
def test_a_relaunch_that_ends_first_leaves_one_run_with_its_status_after_a_replay(tmp_path):
    """The earlier launch was killed with MLflow behind (its server stopped); the relaunch logs
    three steps and finishes (2 s deadline) before it could write them: the earlier launch's
    delivery is stopped by that deadline, what is left stays in the spools, and the replay run
    later delivers the rest into the same run, whose status is then the latest launch's."""
    from mlflow import MlflowClient

    server = start_mlflow_server(tmp_path / "mlflow-server")
    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "run_id": "first-ends", "mlflow_enabled": True,
           "mlflow": {"tracking_uri": server.url, "experiment_name": "ends"},
           "export": {"retry_max_backoff": 0.5, "shutdown_timeout": 2}}  # fmt: skip
    try:
        first = _training(cfg, 0, 29, 0.25, pause_at=9, killed=True)
        _read_until(first, "paused")
        client = MlflowClient(server.url)
        # The earlier launch has its run open before the server stops (on a loaded machine its
        # tracker may still be importing MLflow when the loop reaches the pause).
        deadline = time.monotonic() + 120
        while not [e for e in client.search_experiments() if e.name == "ends"] or not (
            client.search_runs([client.get_experiment_by_name("ends").experiment_id])
        ):
            assert time.monotonic() < deadline, "the earlier launch never opened its MLflow run"
            time.sleep(0.2)
        os.killpg(os.getpgid(server.process.pid), signal.SIGSTOP)
        (log_dir / "go-1").write_text("")
        _read_until(first, "logged")
        time.sleep(1.5)
        first.kill()
        first.wait(30)
        os.killpg(os.getpgid(server.process.pid), signal.SIGCONT)
        with Logger(cfg) as relaunch:
            for step in range(20, 23):
                relaunch.log_metrics({"train/reward": step + 0.75}, step=step)
        (experiment,) = [e for e in client.search_experiments() if e.name == "ends"]
        (run,) = client.search_runs([experiment.experiment_id])  # one run so far
        out = subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        (run,) = client.search_runs([experiment.experiment_id])
        history = client.get_metric_history(run.info.run_id, "train/reward")
    finally:
        stop_mlflow_server(server)
    assert run.info.status == "FINISHED"  # the latest launch's, not the killed one's
    assert sorted(m.step for m in history if m.value % 1 == 0.25) == list(range(30))
    assert sorted(m.step for m in history if m.value % 1 == 0.75) == [20, 21, 22]
