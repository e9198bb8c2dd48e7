"""``export.delivery: process``: the trackers built from the config run in a delivery process.

Real trackers (JSONL, TensorBoard read back with its own reader) and the ``faultfile`` tracker
where a tracker must hang or fail on demand (no real tracker SDK does; see
``tests/faults/fault_tracker.py``). The delivery process is a real child process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.delivery.spool import handoff_dir, holder_of, spool_root
from testkit.readers import jsonl_rows, tensorboard_scalars
from tests.faults.fault_tracker import env_with_faultfile, read_rows, set_mode

REPLAY = [sys.executable, "-m", "otel_rl.cli", "replay"]


def _cfg(tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": True,
        "export": {"delivery": "process", "fsync_interval": 0.1},
        **extra,
    }


def _handoff_files(tmp_path: Path) -> list[Path]:
    """What the run left in its handoff folder (none once every frame is spooled: the folder
    goes with its last file)."""
    folder = handoff_dir(tmp_path / "logs")
    return sorted(folder.iterdir()) if folder.exists() else []


def _replayed_steps(tmp_path: Path) -> list[int]:
    """``otel-rl replay`` of the run (it must succeed), then the JSONL file's steps."""
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    return [r["step"] for r in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")]


def _wait_released(spool: Path, timeout: float = 30.0) -> None:
    """Until the delivery process has let go of the spool (it ended)."""
    ends = time.monotonic() + timeout
    while holder_of(spool) is not None:
        assert time.monotonic() < ends, f"{spool} still held by {holder_of(spool)}"
        time.sleep(0.05)


def _wait_ended(pid: int, timeout: float = 30.0) -> None:
    """Until process ``pid`` (not ours: orphaned, it is reaped or left a zombie) has ended. A
    delivery process lets go of its spools before its last report, which deletes the handoff
    files: a released spool does not yet say they are gone."""
    ends = time.monotonic() + timeout
    stat = Path(f"/proc/{pid}/stat")
    while True:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (OSError, IndexError):
            return
        assert time.monotonic() < ends, f"process {pid} still runs"
        time.sleep(0.05)


def test_every_kind_of_record_arrives_with_its_values_and_no_tracker_thread_runs_here(tmp_path):
    logger = Logger(_cfg(tmp_path, tensorboard_enabled=True))
    assert [e.name for e in logger.exporters] == ["tensorboard", "jsonl"]
    names = {t.name for t in threading.enumerate()}
    assert not any(n.startswith(("otel-rl-jsonl", "otel-rl-tensorboard")) for n in names), names
    logger.log_hyperparams({"lr": 0.001, "model": {"name": "tiny"}})
    for step in range(40):
        logger.log_metrics(
            {"loss": 1.0 / (step + 1), "odd": float("nan") if step == 7 else float(step),
             "rewards": [float(step), float(step) + 2.0], "note": f"s{step}"},
            step=step,
        )  # fmt: skip
    assert logger.flush(30)
    # 40 steps and the hyperparameters, counted by the child, known here after the flush
    assert {e.name: e.stats["delivered"] for e in logger.exporters} == {
        "tensorboard": 41, "jsonl": 41
    }
    process = logger.exporters[0].link.process
    logger.finish()
    assert process is not None and process.wait(10) == 0

    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(40))
    for r in rows:
        step, metrics = r["step"], r["metrics"]
        assert metrics["loss"] == pytest.approx(1.0 / (step + 1))
        assert metrics["rewards/mean"] == pytest.approx(step + 1.0)
        assert metrics["note"] == f"s{step}"
        assert math.isnan(metrics["odd"]) if step == 7 else metrics["odd"] == float(step)
    params = (tmp_path / "logs" / "hyperparams.json").read_text()
    assert '"lr": 0.001' in params and '"model.name": "tiny"' in params
    scalars = tensorboard_scalars(tmp_path / "logs" / "tensorboard")
    assert [(s, round(v, 6)) for s, v in scalars["loss"]] == [
        (s, round(1.0 / (s + 1), 6)) for s in range(40)
    ]


def test_an_instance_given_with_the_name_of_a_tracker_there_spools_beside_it(tmp_path):
    """A JSONL tracker built from the config runs in the delivery process and a JSONL exporter
    given as an instance stays here: each has a spool of its own, as in thread mode (one
    spool for both made ``Logger()`` refuse the run as already in use)."""
    from otel_rl.exporters.jsonl import JsonlExporter

    given = JsonlExporter(tmp_path / "given.jsonl")
    with Logger(_cfg(tmp_path), exporters=[given]) as logger:
        assert [e.name for e in logger.exporters] == ["jsonl", "jsonl"]
        for step in range(5):
            logger.log_metrics({"loss": float(step)}, step=step)
    for path in (tmp_path / "logs" / "metrics.jsonl", tmp_path / "given.jsonl"):
        assert [(r["step"], r["metrics"]["loss"]) for r in jsonl_rows(path)] == [
            (step, float(step)) for step in range(5)
        ]
    assert sorted(p.name for p in spool_root(tmp_path / "logs").iterdir()) == ["jsonl", "jsonl-2"]


def test_nested_hyperparameters_arrive_as_in_thread_mode(tmp_path):
    """A list of mappings (a scheduler's config) among the hyperparameters reaches the trackers of
    the delivery process as it reaches them in-process: before, each mapping inside a list
    arrived as its ``str`` (a tuple still arrives as a list, as replay gives it)."""
    from testkit.readers import tensorboard_accumulator

    params = {"policy": {"scheduler": [{"name": "LinearLR", "kwargs": {"start_factor": 0.1}},
                                       {"milestones": [50]}], "betas": [0.9, 0.99]}}  # fmt: skip
    seen = {}
    for delivery in ("thread", "process"):
        log_dir = tmp_path / delivery
        cfg = {"log_dir": str(log_dir), "jsonl_enabled": True, "tensorboard_enabled": True,
               "export": {"delivery": delivery}}  # fmt: skip
        with Logger(cfg) as logger:
            logger.log_hyperparams(params)
            logger.log_metrics({"loss": 1.0}, step=0)
        acc = tensorboard_accumulator(log_dir / "tensorboard")
        text = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("hyperparams")]
        seen[delivery] = (json.loads((log_dir / "hyperparams.json").read_text()), text)
    assert seen["process"] == seen["thread"]
    assert "{'name': 'LinearLR', 'kwargs': {'start_factor': 0.1}}" in seen["process"][1][0]


def test_a_killed_training_process_loses_nothing_it_handed_over(tmp_path):
    """SIGKILL right after the last log_metrics: the delivery process still reads the pipe to
    its end, writes every step once, and closes the run as killed; the step still being logged
    was checkpointed to its spool, and replay delivers it."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from otel_rl import Logger
        logger = Logger({_cfg(tmp_path)!r})
        for step in range(500):
            logger.log_metrics({{"loss": step * 0.5}}, step=step, step_finished=True)
        logger.log_metrics({{"loss": 250.0}}, step=500)  # never finished: checkpointed only
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    spools = list((spool_root(tmp_path / "logs") / "jsonl").iterdir())
    assert len(spools) == 1
    _wait_released(spools[0])
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [
        (step, step * 0.5) for step in range(500)
    ]
    # The delivery process's stderr is the training process's: no timeout was involved.
    assert "jsonl: the step still being logged when the run ended was checkpointed" in (
        done.stderr
    )
    assert "before the shutdown timeout" not in done.stderr
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")  # the pending step, nothing twice
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [
        (step, step * 0.5) for step in range(501)
    ]


def _faultfile_script(tmp_path: Path, control: Path, shutdown_timeout: float, body: str) -> str:
    """A training script whose one tracker is ``faultfile`` (rows to ``rows.jsonl``, told how to
    behave by ``control``), in the delivery process; ``body`` runs after ``Logger(cfg)``."""
    return textwrap.dedent(f"""
        import os, signal, sys, time
        from otel_rl import Logger
        from otel_rl.delivery.spool import waiting_records
        from tests.faults.fault_tracker import set_mode
        cfg = {_cfg(tmp_path)!r}
        cfg["jsonl_enabled"] = False
        cfg["trackers"] = {{"faultfile": {{"path": {str(tmp_path / "rows.jsonl")!r},
                                           "control": {str(control)!r}}}}}
        cfg["export"]["shutdown_timeout"] = {shutdown_timeout!r}
        logger = Logger(cfg)
    """) + textwrap.dedent(body)


@pytest.mark.slow
def test_finish_keeps_its_deadline_when_a_tracker_hangs_there_and_replay_delivers_the_rest(
    tmp_path,
):
    control = tmp_path / "control"
    set_mode(control, "ok")
    script = _faultfile_script(tmp_path, control, 2.0, f"""
        for step in range(30):
            if step == 15:
                set_mode({str(control)!r}, "slow 1000")
                time.sleep(0.5)
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        time.sleep(0.5)
        began = time.monotonic()
        logger.finish()
        print("FINISH", time.monotonic() - began, file=sys.stderr, flush=True)
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    took = float(done.stderr.split("FINISH ", 1)[1].split()[0])
    assert took < 2.0 + 1.0, done.stderr
    assert len(read_rows(tmp_path / "rows.jsonl")) < 30  # the rest waits in the spool
    set_mode(control, "ok")
    spool = next((spool_root(tmp_path / "logs") / "faultfile").iterdir())
    _wait_released(spool)
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(s, r["loss"]) for s, r in rows] == [(s, float(s)) for s in range(30)]


@pytest.mark.slow
def test_a_delivery_process_killed_at_the_deadline_says_what_each_spool_keeps_for_replay(
    tmp_path,
):
    """The delivery process never reaches the end of the run (stopped here: SIGSTOP, as one far
    behind), so its channels never say what they leave: the training process says it for them,
    from the spools, as thread mode's channels do, and ``undelivered`` counts it. Replay then
    delivers exactly those records."""
    control = tmp_path / "control"
    set_mode(control, "ok")
    script = _faultfile_script(tmp_path, control, 1.0, f"""
        for step in range(10):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        assert logger.flush(30)
        set_mode({str(control)!r}, "raise")  # the backend is down: the rest stays spooled
        for step in range(10, 30):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        tracker = logger.exporters[0]
        ends = time.monotonic() + 30
        while waiting_records(tracker.spool_dir) < 20 and time.monotonic() < ends:
            time.sleep(0.05)
        os.kill(tracker.link.process.pid, signal.SIGSTOP)
        logger.finish()
        print("UNDELIVERED", tracker.undelivered, "LOST", tracker.lost, file=sys.stderr)
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "UNDELIVERED 20 LOST {}" in done.stderr, done.stderr
    spool = next((spool_root(tmp_path / "logs") / "faultfile").iterdir())
    said = (
        "faultfile: 20 record(s) not delivered before the shutdown timeout (export.shutdown_timeout"
        f": 1 s; the delivery process was killed there). They are in the spool ({spool}); deliver "
        f"them with: otel-rl replay {tmp_path / 'logs'}"
    )
    assert said in done.stderr, done.stderr
    assert [s for s, _ in read_rows(tmp_path / "rows.jsonl")] == list(range(10))
    set_mode(control, "ok")
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(s, r["loss"]) for s, r in rows] == [(s, float(s)) for s in range(30)]


def _replayed(tmp_path: Path, env: dict[str, str]) -> str:
    """``otel-rl replay`` of the run (it must succeed): its summary line for ``faultfile``."""
    replay = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    (line,) = [line for line in replay.stdout.splitlines() if line.startswith("faultfile ")]
    return line


@pytest.mark.slow
def test_a_delivery_process_behind_at_finish_keeps_the_runs_deadline_and_says_what_it_left(
    tmp_path,
):
    """The delivery process reads the end of the run late (it is behind: stopped here from
    ``finish()`` on, for 1.5 s of a 3 s deadline). It gives up at the training process's
    deadline, not 3 s after its reading, which would pass the training process's kill a grace
    later: its tracker is closed and its channel counts what it left, exactly, with the replay
    command; replay then delivers exactly that many."""
    control = tmp_path / "control"
    set_mode(control, "ok")
    script = _faultfile_script(tmp_path, control, 3.0, f"""
        import threading
        for step in range(10):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        assert logger.flush(30)
        set_mode({str(control)!r}, "raise")  # the backend is down: the rest stays spooled
        for step in range(10, 40):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        tracker = logger.exporters[0]
        child = tracker.link.process.pid
        ends = time.monotonic() + 30
        while waiting_records(tracker.spool_dir) < 30 and time.monotonic() < ends:
            time.sleep(0.05)
        os.kill(child, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (child, signal.SIGCONT)).start()
        logger.finish()
        print("UNDELIVERED", tracker.undelivered, "PENDING", tracker.pending, file=sys.stderr)
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "UNDELIVERED 30 PENDING 0" in done.stderr, done.stderr
    spool = next((spool_root(tmp_path / "logs") / "faultfile").iterdir())
    said = [line for line in done.stderr.splitlines() if "not delivered" in line]
    assert said == [
        "otel-rl: faultfile: 30 record(s) not delivered before the shutdown timeout "
        "(export.shutdown_timeout: 3 s; last error: ConnectionError: faultfile: backend down "
        "(control file says so); raise export.shutdown_timeout to deliver more before exit, "
        f"lower it to wait less). They are in the spool ({spool}); deliver them with: "
        f"otel-rl replay {tmp_path / 'logs'}"
    ], done.stderr
    assert "killed" not in done.stderr, done.stderr
    set_mode(control, "ok")
    assert _replayed(tmp_path, env).endswith(": 30/30 record(s) delivered")
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(s, r["loss"]) for s, r in rows] == [(s, float(s)) for s in range(40)]


@pytest.mark.slow
@pytest.mark.serial  # finish() held to its deadline to the second
def test_what_a_killed_delivery_process_left_is_said_before_finish_returns_however_busy(
    tmp_path,
):
    """The delivery process never ends the run (stopped here: killed at the deadline), and the
    training process's own threads are held back past the grace (a thread of the script holds
    the GIL in one C call from just before the kill until after the grace, as a machine too
    busy to schedule them would): the count of what each spool keeps, with the replay command,
    is still said before ``finish()`` returns (one grace late at most), and replay delivers
    exactly that many."""
    control = tmp_path / "control"
    set_mode(control, "ok")
    script = _faultfile_script(tmp_path, control, 1.0, f"""
        import ctypes, logging, threading
        said = []
        class Keep(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("otel_rl").addHandler(Keep())
        for step in range(10):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        assert logger.flush(30)
        set_mode({str(control)!r}, "raise")  # the backend is down: the rest stays spooled
        for step in range(10, 50):
            logger.log_metrics({{"loss": float(step)}}, step=step, step_finished=True)
        tracker = logger.exporters[0]
        ends = time.monotonic() + 30
        while waiting_records(tracker.spool_dir) < 40 and time.monotonic() < ends:
            time.sleep(0.05)
        os.kill(tracker.link.process.pid, signal.SIGSTOP)
        def busy():
            time.sleep(1.0 + 0.6)  # the deadline, then the grace the delivery process has
            ctypes.PyDLL(None).usleep(900_000)  # holds the GIL: no other thread runs
        threading.Thread(target=busy, daemon=True).start()
        began = time.monotonic()
        logger.finish()
        print("FINISH", time.monotonic() - began, file=sys.stderr)
        print("SAID", [m for m in said if m.startswith("otel-rl: faultfile: ")
                       and "not delivered" in m], file=sys.stderr)
        print("UNDELIVERED", tracker.undelivered, file=sys.stderr)
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    spool = next((spool_root(tmp_path / "logs") / "faultfile").iterdir())
    message = (
        "otel-rl: faultfile: 40 record(s) not delivered before the shutdown timeout "
        "(export.shutdown_timeout: 1 s; the delivery process was killed there). They are in "
        f"the spool ({spool}); deliver them with: otel-rl replay {tmp_path / 'logs'}"
    )
    assert f"SAID {[message]!r}" in done.stderr, done.stderr
    assert "UNDELIVERED 40" in done.stderr, done.stderr
    took = float(done.stderr.split("FINISH ", 1)[1].split()[0])
    assert took < 1.0 + 2.0, done.stderr  # one grace more than a run whose parts all end
    set_mode(control, "ok")
    assert _replayed(tmp_path, env).endswith(": 40/40 record(s) delivered")
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(s, r["loss"]) for s, r in rows] == [(s, float(s)) for s in range(50)]


@pytest.mark.slow
def test_a_replay_right_after_a_kill_waits_for_the_delivery_process_still_delivering(
    tmp_path,
):
    """SIGKILL while a tracker hangs in the delivery process: until it has given up (its
    ``shutdown_timeout`` after reading everything) it holds the spool, so a replay says who
    holds it (the killed training process) and exits 75; ``--wait`` waits for it and then
    delivers every step once."""
    control = tmp_path / "control"
    set_mode(control, "slow 1000")
    script = _faultfile_script(tmp_path, control, 3.0, """
        print(os.getpid(), flush=True)
        for step in range(20):
            logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = env_with_faultfile(tmp_path)
    out = tmp_path / "out.txt"
    with out.open("w") as sink:  # the delivery process keeps the output open after the kill
        done = subprocess.run([sys.executable, "-c", script], env=env, stdout=sink,
                              stderr=subprocess.STDOUT, timeout=120)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, out.read_text()
    pid = out.read_text().split()[0]
    busy = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert busy.returncode == 75, busy.stdout + busy.stderr
    assert f"in use by the training run (pid {pid}, its delivery process pid" in busy.stdout
    set_mode(control, "ok")
    waited = subprocess.run([*REPLAY, str(tmp_path / "logs"), "--no-progress", "--wait", "60"],
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert waited.returncode == 0, waited.stdout + waited.stderr
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(s, r["loss"]) for s, r in rows] == [(s, float(s)) for s in range(20)]


def test_a_run_id_in_use_is_refused_at_logger_with_the_delivery_process_reason(tmp_path):
    first = Logger(_cfg(tmp_path, run_id="same"))
    try:
        with pytest.raises(ConfigError, match="run_id 'same' is already in use"):
            Logger(_cfg(tmp_path, run_id="same"))
    finally:
        first.finish()


def test_a_second_logger_of_one_process_on_the_same_log_dir_is_refused_at_once(tmp_path):
    """A launch's handoff files are named by its pid: a second Logger of the process on the
    same log_dir is refused with the way out (it waited for the first one's lock for ever),
    the first goes on, and once it finished the log_dir takes a new Logger."""
    first = Logger(_cfg(tmp_path))
    began = time.monotonic()
    with pytest.raises(ConfigError, match="another Logger of this process delivers to"):
        Logger(_cfg(tmp_path))
    assert time.monotonic() - began < 10
    for step in range(3):
        first.log_metrics({"loss": float(step)}, step=step)
    first.finish()
    with Logger(_cfg(tmp_path)) as again:
        again.log_metrics({"loss": 3.0}, step=3)
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(s, float(s)) for s in range(4)]


def test_a_dead_delivery_process_never_costs_the_loop_and_its_records_wait_for_replay(
    tmp_path, caplog
):
    """Killed during the run (as by the OOM killer): the loop goes on at once, every record
    logged after goes to the leftover file, and replay delivers every step once."""
    cfg = _cfg(tmp_path)
    cfg["export"] = {**cfg["export"], "shutdown_timeout": 600}  # finish() must not wait for it
    logger = Logger(cfg)
    for step in range(10):
        logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
    assert logger.flush(30)
    link = logger.exporters[0].link
    link.process.kill()
    link.process.wait(10)
    with caplog.at_level(logging.ERROR, logger="otel_rl"):
        deadline = time.monotonic() + 10
        while not link.dead:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for step in range(10, 60):
            logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
    began = time.monotonic()
    logger.finish()
    # It never waited for the dead process until the deadline (600 s, see the config).
    assert time.monotonic() - began < 60
    assert (logger.exporters[0].lost, logger.exporters[0].undelivered) == ({}, 50)
    assert [r.getMessage() for r in caplog.records if "delivery process exited" in r.getMessage()]
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert _replayed_steps(tmp_path) == list(range(60))


def test_a_delivery_process_dying_with_frames_unread_leaves_them_and_later_records_to_replay(
    tmp_path, caplog
):
    """Stopped with frames in the pipe and in handoff files, then killed: what it never read
    (the pipe's frames, kept here until it has spooled them; the handoff files) and what is
    logged after it wait in files for ``otel-rl replay``, which delivers every step once."""
    logger, pid = _ten_steps_then_stopped(tmp_path)
    for step in range(10, 2010):
        logger.log_metrics({"x": float(step), "pad": "p" * 2000}, step=step, step_finished=True)
    time.sleep(0.2)  # the pusher hands the backlog to the file meanwhile
    assert list(handoff_dir(tmp_path / "logs").glob("handoff-*.frames"))
    with caplog.at_level(logging.ERROR, logger="otel_rl"):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "delivery process exited" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for step in range(2010, 2020):
            logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
    logger.finish()
    (error,) = [m for m in caplog.messages if "delivery process exited" in m]
    assert "wait in" in error and "for otel-rl replay" in error, error
    tracker = logger.exporters[0]
    assert (tracker.lost, tracker.undelivered, tracker.link.in_files("jsonl")) == ({}, 2010, 2010)
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert _replayed_steps(tmp_path) == list(range(2020))
    assert _handoff_files(tmp_path) == []


@pytest.mark.parametrize("kill_after", [0.05, 0.3])
def test_every_record_is_delivered_or_replayable_when_the_delivery_process_dies(
    tmp_path, caplog, kill_after
):
    """Killed while ``finish()`` waits for it, far behind a loop of 30,000 steps: each step is
    in the tracker once after replay, none lost, also what it had read but not yet spooled;
    ``delivered`` and ``undelivered`` come from its spools and files, not from its last report
    (which missed up to 20,000)."""
    steps = 30_000
    for attempt in range(3):
        # A fast delivery process can be done before the kill lands: then the run ended well,
        # which is not what this test is about, and it runs again.
        run = tmp_path / f"attempt{attempt}"
        logger = Logger(_cfg(run))
        process = logger.exporters[0].link.process
        for step in range(steps):
            # Far behind whatever the machine's load: it waits. 20,000 steps take it about a
            # second to catch up here (5,000 were sometimes caught up within 0.3 s).
            if step == steps - 20_000:
                os.kill(process.pid, signal.SIGSTOP)
            logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
        os.kill(process.pid, signal.SIGCONT)
        threading.Timer(kill_after, process.kill).start()  # SIGKILL, unless reaped already
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="otel_rl"):
            logger.finish()
        if process.wait(30) == -signal.SIGKILL:
            break
    else:
        pytest.fail(f"the delivery process was done within {kill_after} s of finish() 3 times")
    tmp_path = run
    assert "delivery process exited (code -9) before the run ended" in caplog.text
    tracker = logger.exporters[0]
    assert tracker.lost == {} and tracker.pending == 0
    # Read from the spool once it died, not from its last report (a quarter second old).
    delivered, undelivered = tracker.stats["delivered"], tracker.undelivered
    assert _replayed_steps(tmp_path) == list(range(steps))
    assert delivered + undelivered == steps


class _RaisingHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("a broken handler")


class _SlowHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.5)
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(
    ("handler", "delivery"),
    [(_RaisingHandler, "process"), (_SlowHandler, "process"), (_RaisingHandler, "thread")],
)
def test_a_handler_that_raises_or_is_slow_costs_no_counter_nor_the_deadline(
    tmp_path, capfd, handler, delivery
):
    """The delivery process's warnings are said through the user's handlers of the ``otel_rl``
    logger. One that raises (said once on stderr) or takes half a second a line (the lines wait
    for it, on a thread of their own) must not stop the counters, ``flush()`` or ``finish()``:
    before, a raising handler ended the thread that reads the delivery process's reports."""
    cfg = _cfg(tmp_path, tensorboard_enabled=True)
    cfg["export"] = {**cfg["export"], "shutdown_timeout": 2.0, "delivery": delivery}
    own = logging.getLogger("otel_rl")
    installed = handler()
    own.addHandler(installed)
    try:
        logger = Logger(cfg)
        for step in [0, 1, 2, 1, 3]:  # a backwards step: each tracker warns once
            logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
        logger.log_hyperparams({"late": 1})  # TensorBoard warns: after the first step
        assert logger.flush(10)
        began = time.monotonic()
        logger.finish()
        assert time.monotonic() - began < 2.0 + 1.0  # its deadline (shutdown_timeout + grace)
    finally:
        own.removeHandler(installed)
    assert {e.name: (e.stats["delivered"], e.pending, e.stats["retries"])
            for e in logger.exporters} == {"tensorboard": (6, 0, 0), "jsonl": (6, 0, 0)}
    err = capfd.readouterr().err
    if handler is _RaisingHandler:
        assert "a handler of the otel_rl logger raised RuntimeError: a broken handler" in err
        assert "went backwards" in err  # the line it was to say
    else:
        said = installed.lines + [line for line in err.splitlines() if "not said" in line]
        assert said, err


def test_a_fork_child_neither_delivers_nor_keeps_the_delivery_process_waiting(tmp_path):
    logger = Logger(_cfg(tmp_path))
    logger.log_metrics({"loss": 0.0}, step=0, step_finished=True)
    pid = os.fork()
    if pid == 0:  # the child: its Logger is disabled; nothing it does reaches the trackers
        try:
            logger.log_metrics({"loss": 99.0}, step=99, step_finished=True)
            logger.finish()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    for step in range(1, 20):
        logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
    process = logger.exporters[0].link.process
    logger.finish()
    assert process.wait(10) == 0
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(s, float(s)) for s in range(20)]


def test_records_larger_than_the_pipe_arrive_whole_and_in_order(tmp_path):
    """Frames of 3 MiB (three times the pipe) are written in pieces by the pusher thread, with
    small records queued behind them: every byte arrives, in step order."""
    logger = Logger(_cfg(tmp_path))
    for step in range(12):
        text = chr(ord("a") + step) * (3 << 20) if step % 3 == 0 else f"small {step}"
        logger.log_metrics({"text": text, "x": float(step)}, step=step, step_finished=True)
    assert logger.flush(60)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(12))
    for r in rows:
        step, text = r["step"], r["metrics"]["text"]
        assert r["metrics"]["x"] == float(step)
        assert text == (chr(ord("a") + step) * (3 << 20) if step % 3 == 0 else f"small {step}")
    assert logger.exporters[0].lost == {}


def test_values_of_the_scripts_own_classes_arrive_as_in_thread_mode_or_cost_only_themselves(
    tmp_path,
):
    """A ``str`` enum defined in the training script arrives as its text (the delivery process
    cannot import the script); a value whose class the delivery process cannot import at all
    costs only its step, counted as refused, and the steps after it go on."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "onlyhere.py").write_text("class Label(str):\n    pass\n")
    script = textwrap.dedent(f"""
        import enum, json, shutil, sys
        sys.path.insert(0, {str(mods)!r})
        import onlyhere
        shutil.rmtree({str(mods)!r})  # imported here; the delivery process cannot import it
        from otel_rl import Logger
        class Phase(str, enum.Enum):
            TRAIN = "train"
        logger = Logger({_cfg(tmp_path)!r})
        logger.log_hyperparams({{"phase": Phase.TRAIN}})
        for step in range(6):
            value = {{2: Phase.TRAIN, 4: onlyhere.Label("odd")}}.get(step, f"s{{step}}")
            logger.log_metrics({{"x": float(step), "label": value}}, step=step)
        logger.finish()
        print(json.dumps(logger.exporters[0].lost))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == '{"refused": 1}', done.stderr
    assert "cannot be read in the delivery process" in done.stderr
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["label"]) for r in rows] == [
        (0, "s0"), (1, "s1"), (2, "train"), (3, "s3"), (5, "s5")
    ]
    assert '"phase": "train"' in (tmp_path / "logs" / "hyperparams.json").read_text()


def _stop_the_delivery_process(logger: Logger) -> int:
    pid = logger.exporters[0].link.process.pid
    os.kill(pid, signal.SIGSTOP)
    return pid


def _ten_steps_then_stopped(tmp_path: Path, **export: object) -> tuple[Logger, int]:
    """A run whose delivery process has delivered ten steps (its counters of them reported
    here), then is stopped (SIGSTOP): what is logged next stays unread. Returns its pid too."""
    cfg = _cfg(tmp_path)
    cfg["export"] = {**cfg["export"], **export}
    logger = Logger(cfg)
    for step in range(10):
        logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
    assert logger.flush(30)
    time.sleep(0.5)
    return logger, _stop_the_delivery_process(logger)


@pytest.mark.parametrize("pad", [2000, 6000], ids=["rows-under-PIPE_BUF", "rows-over-PIPE_BUF"])
def test_a_delivery_process_that_stops_reading_never_makes_the_loop_wait(tmp_path, pad):
    """SIGSTOP stands in for a delivery process far behind: what the pipe cannot take goes to
    a handoff file, so no call waits for it and nothing is dropped; once it reads again, every
    step arrives once, in order, and the file is gone. Rows larger than a pipe takes whole in
    one write (``PIPE_BUF``, 4 KiB) too: a row the pipe took in part used to hold every later
    one back."""
    logger = Logger(_cfg(tmp_path))
    logger.log_metrics({"x": 0.0}, step=0, step_finished=True)
    assert logger.flush(30)
    pid = _stop_the_delivery_process(logger)
    try:
        for step in range(1, 3001):  # ~6 MB: far more than the pipe holds
            logger.log_metrics({"x": float(step), "pad": "p" * pad}, step=step,
                               step_finished=True)  # fmt: skip
            if step % 1000 == 0:
                time.sleep(0.1)  # the pusher hands the backlog to the file meanwhile
        handoffs = list(handoff_dir(tmp_path / "logs").glob("handoff-*.frames"))
        assert handoffs and sum(p.stat().st_size for p in handoffs) > 1 << 20
    finally:
        os.kill(pid, signal.SIGCONT)
    stats = logger.exporters[0].stats
    # A call waits for the thread that writes the handoff file only when that thread has not
    # run for half an fsync interval (a loaded machine: at most a call or two here, as
    # reliability.md says); a loop held by the stopped process would count most of its calls.
    assert (stats["waits"], logger.exporters[0].lost) == (0, {})
    assert stats["spool_waits"] <= 3, stats
    assert logger.flush(60)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["x"]) for r in rows] == [(s, float(s)) for s in range(3001)]
    assert _handoff_files(tmp_path) == []


@pytest.mark.parametrize("pad", [2000, 6000], ids=["rows-under-PIPE_BUF", "rows-over-PIPE_BUF"])
def test_a_killed_training_process_loses_nothing_it_handed_to_a_file(tmp_path, pad):
    """SIGKILL while the delivery process is stopped and the frames it has not read are in
    handoff files whose names never reached the pipe: once it runs again, it reads the pipe to
    its end, then those files, and delivers every step once."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from otel_rl import Logger
        logger = Logger({_cfg(tmp_path)!r})
        child = logger.exporters[0].link.process.pid
        print(child, flush=True)
        os.kill(child, signal.SIGSTOP)
        for step in range(2000):
            logger.log_metrics({{"x": float(step), "pad": "p" * {pad}}}, step=step,
                               step_finished=True)
        time.sleep(0.5)  # the pusher hands the backlog to the file meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = tmp_path / "out.txt"  # not a pipe: the stopped delivery process holds its copy
    with out.open("w") as sink:
        done = subprocess.run([sys.executable, "-c", script], stdout=sink, stderr=sink,
                              timeout=120)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, out.read_text()
    child = int(out.read_text().split()[0])
    assert list(handoff_dir(tmp_path / "logs").glob("handoff-*.frames"))
    os.kill(child, signal.SIGCONT)
    _wait_ended(child)
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["x"]) for r in rows] == [(s, float(s)) for s in range(2000)]
    assert _handoff_files(tmp_path) == []


def test_without_a_handoff_file_a_stopped_delivery_process_holds_one_call_at_most_its_patience(
    tmp_path, caplog,
):
    """The handoff file cannot be written (a file stands where its folder goes): one call
    waits at most the patience (max(1 s, 2 x fsync_interval)), then the loop goes on, keeping
    ``queue_size`` records and dropping older ones, counted; once the process reads again,
    every record kept arrives."""
    cfg = _cfg(tmp_path)
    cfg["export"] = {**cfg["export"], "queue_size": 200}
    handoff_dir(tmp_path / "logs").parent.mkdir(parents=True)
    handoff_dir(tmp_path / "logs").write_text("not a folder")
    logger = Logger(cfg)
    logger.log_metrics({"x": 0.0}, step=0, step_finished=True)
    assert logger.flush(30)
    pid = _stop_the_delivery_process(logger)
    slowest = 0.0
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            for step in range(1, 3001):  # ~6 MB: far more than the pipe holds
                began = time.monotonic()
                logger.log_metrics({"x": float(step), "pad": "p" * 2000}, step=step,
                                   step_finished=True)  # fmt: skip
                slowest = max(slowest, time.monotonic() - began)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert slowest < 1.0 + 0.5
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        assert logger.flush(60)
        logger.finish()
    said = [r.getMessage() for r in caplog.records]
    assert sum("handoff file cannot be written" in m for m in said) == 1, said
    started = [i for i, m in enumerate(said) if "has not kept up for 1.0 s" in m]
    ended = [i for i, m in enumerate(said) if "has caught up again" in m]
    assert len(started) == 1 and len(ended) == 1 and started[0] < ended[0], said
    lost = logger.exporters[0].lost
    steps = [r["step"] for r in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 3000
    assert set(lost) == {"queue_full"} and len(steps) + lost["queue_full"] == 3001


@pytest.mark.slow
@pytest.mark.serial  # finish() held to its deadline to the second
def test_records_still_in_the_pipe_when_finish_gives_up_wait_for_replay(tmp_path, caplog):
    """The frames the pipe took and the stopped delivery process never read were kept here:
    at the deadline they go to the leftover file, and replay delivers them once."""
    logger, _ = _ten_steps_then_stopped(tmp_path, shutdown_timeout=1.0)
    for step in range(10, 20):
        logger.log_metrics({"x": float(step)}, step=step, step_finished=True)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        logger.finish()
    assert time.monotonic() - began < 1.0 + 1.5
    assert (logger.exporters[0].lost, logger.exporters[0].undelivered) == ({}, 10)
    messages = [r.getMessage() for r in caplog.records]
    assert any("what it had not delivered waits for otel-rl replay" in m for m in messages)
    assert any("10 record(s) not delivered before the shutdown timeout" in m
               and "10 in handoff files" in m for m in messages), messages  # fmt: skip
    assert not any("exited (code" in m or "lost" in m for m in messages), messages
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert [p.name.split("-")[0] for p in _handoff_files(tmp_path)] == ["launch", "launch", "left"]
    assert _replayed_steps(tmp_path) == list(range(20))
    assert _handoff_files(tmp_path) == []


@pytest.mark.slow
def test_a_handoff_file_that_fills_its_disk_loses_nothing_uncounted_and_sends_nothing_twice(
    tmp_path,
):
    """The disk fills while frames go to a handoff file (a file-size limit of 600 kB on the
    training process stands in for it): the file is cut back to its last whole write, one
    warning says so, the frames go by the pipe after it, and the loop waits for the delivery
    process as it would without a handoff file. Every step arrives once, in order, or is
    counted lost."""
    script = textwrap.dedent(f"""
        import json, os, resource, signal, time
        from otel_rl import Logger
        cfg = {_cfg(tmp_path)!r}
        cfg["export"]["queue_size"] = 500
        logger = Logger(cfg)
        child = logger.exporters[0].link.process.pid
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))
        os.kill(child, signal.SIGSTOP)
        threading = __import__("threading")
        threading.Timer(3.0, os.kill, (child, signal.SIGCONT)).start()
        for step in range(3000):
            logger.log_metrics({{"x": float(step), "pad": "p" * 2000}}, step=step,
                               step_finished=True)
        assert logger.flush(60)
        logger.finish()
        print(json.dumps(logger.exporters[0].lost))
    """)
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        done = subprocess.run([sys.executable, "-c", script], stdout=sink, stderr=sink,
                              timeout=180)  # fmt: skip
    text = out.read_text()
    assert done.returncode == 0, text
    lost = json.loads(text.strip().splitlines()[-1])
    assert text.count("handoff file cannot be written") == 1, text
    steps = [r["step"] for r in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 2999
    assert len(steps) + lost.get("queue_full", 0) == 3000, (len(steps), lost)
    assert set(lost) <= {"queue_full"}


@pytest.mark.slow
def test_frames_in_handoff_files_when_finish_gives_up_wait_for_replay(tmp_path, caplog):
    """``finish()`` keeps its deadline while the delivery process is stopped with frames in
    handoff files: it is killed, the files stay, and replay delivers every step once."""
    logger, _ = _ten_steps_then_stopped(tmp_path, shutdown_timeout=1.0)
    for step in range(10, 2010):
        logger.log_metrics({"x": float(step), "pad": "p" * 2000}, step=step, step_finished=True)
    time.sleep(0.2)  # the pusher hands the backlog to the file meanwhile
    assert list(handoff_dir(tmp_path / "logs").glob("handoff-*.frames"))
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        logger.finish()
    assert time.monotonic() - began < 1.0 + 1.5
    assert (logger.exporters[0].lost, logger.exporters[0].undelivered) == ({}, 2000)
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert _replayed_steps(tmp_path) == list(range(2010))
    assert _handoff_files(tmp_path) == []
