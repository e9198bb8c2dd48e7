"""The job's verdict: every process publishes where it is, and the one that sees a stall names
the processes that are not where the rest are. Real gloo ranks of ``torch.distributed`` (each a
process of its own, their store the job's TCP store), a real TCP store closed under a reader,
and a real HTTP server that never answers."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_rl.watch.job_state import (
    DirectoryBoard,
    JobStates,
    StatePublisher,
    TorchStoreBoard,
)
from otel_rl.watch.job_verdict import job_verdict
from otel_rl.watch.process_state import GroupCount, JobState, PublishedWait
from testkit.servers import free_port
from tests.sources.test_verdict import SilentServer

# Rank 0 logs with a Logger on the default config; the others record with WorkerMetrics. Every
# rank syncs three steps; at the fourth, rank ``odd`` either sits in a named function (``sleep``)
# or is killed (``kill``) instead of joining the all_reduce. ``nemo`` and ``verl`` run the same
# through a framework's drop-ins: rank 0 logs with its logger, every rank times with its timer.
_RANK = textwrap.dedent("""
    import contextlib, os, pathlib, signal, sys, time
    import torch
    import torch.distributed as dist

    rank, port, log_dir = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    odd, how, flavour = int(sys.argv[4]), sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    if flavour == "nemo":
        from otel_rl.compat.nemo_timer import Timer
        timer = Timer()
        sync = lambda: timer.time("sync")
        if rank == 0:
            from otel_rl.compat.nemo_rl import Logger
            logger = Logger({"log_dir": str(log_dir), "wandb_enabled": False,
                             "tensorboard_enabled": False, "mlflow_enabled": False,
                             "swanlab_enabled": False, "monitor_gpus": False})
            log = lambda step: logger.log_metrics({"loss": float(step)}, step, prefix="train")
    elif flavour == "verl":
        from otel_rl.compat.verl_timing import marked_timer
        timing_raw = {}
        sync = lambda: marked_timer("sync", timing_raw)
        if rank == 0:
            os.environ["OTEL_RL_LOG_DIR"] = str(log_dir)
            from otel_rl.compat.verl import Tracking
            tracking = Tracking("project", "experiment", ["console"])
            log = lambda step: tracking.log({"loss": float(step)}, step=step)
    elif rank == 0:
        from otel_rl import Logger
        metrics = Logger({"log_dir": str(log_dir)})
        sync = lambda: metrics.timer("sync")
        log = lambda step: metrics.log_metrics({"loss": float(step)}, step=step)
    else:
        from otel_rl import WorkerMetrics
        metrics = WorkerMetrics(rank=rank, role="trainer")
        sync = lambda: metrics.timer("sync")
        log = metrics.snapshot
    if rank != 0 and flavour != "core":
        log = lambda step: None

    def load_the_next_batch():
        while not list(log_dir.glob("**/stalls/*.json")):
            time.sleep(0.1)

    values = torch.ones(4)
    for step in range(4):
        if step == 3 and rank == odd:
            if how == "kill":
                time.sleep(2)  # its state published (a second after WorkerMetrics began)
                os.kill(os.getpid(), signal.SIGKILL)
            load_the_next_batch()
            os._exit(0)
        with sync():
            if step == 3 and how == "kill":  # gloo would see the dead peer at once (NCCL waits)
                dist.distributed_c10d._get_default_store().wait(["never written"])
            dist.all_reduce(values)
        log(step)
    os._exit(0)  # the others stay in the collective: the test ends them
""")


def _start_ranks(
    tmp_path: Path, odd: int, how: str, flavour: str = "core"
) -> tuple[list[subprocess.Popen], Path]:
    port, log_dir = free_port(), tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(port), str(log_dir), str(odd), how,
             flavour],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in range(4)
    ]  # fmt: skip
    return ranks, log_dir


def _first_report(
    log_dir: Path, ranks: list[subprocess.Popen], within: float
) -> tuple[dict, float]:
    began = time.monotonic()
    deadline = began + within
    while time.monotonic() < deadline:
        found = sorted(log_dir.glob("**/stalls/*.json"))
        if found:
            report = json.loads(found[0].read_text())
            report["written"] = found[0].stat().st_mtime
            return report, time.monotonic() - began
        for rank in ranks[:1]:
            if rank.poll() is not None:
                raise AssertionError(f"rank 0 ended: {rank.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no stall report within {within} s")


def _end(ranks: list[subprocess.Popen]) -> list[str]:
    """Ends every rank; what each wrote to stderr."""
    errors = []
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
        errors.append(rank.communicate(timeout=30)[1])
    return errors


@pytest.mark.slow
def test_the_rank_that_never_joins_an_all_reduce_is_named_with_its_function_and_count(tmp_path):
    """Four gloo ranks, rank 2 in ``load_the_next_batch`` instead of its fourth ``all_reduce``:
    rank 0's report on the default config names rank 2, the function, and that it entered one
    collective fewer, within 45 s of the others' wait."""
    ranks, log_dir = _start_ranks(tmp_path, odd=2, how="sleep")
    try:
        report, _ = _first_report(log_dir, ranks, within=240)
    finally:
        errors = _end(ranks)
    # from rank 0's last step (its wait began right after) to the report on disk
    waited = report["written"] - (_unix(report["stalled_at"]) - report["seconds_since_step"])
    assert waited <= 45, (waited, report["verdict"]["text"])

    text = report["verdict"]["text"]
    print(text)
    assert text.startswith("rank 2 has not joined all_reduce #4 on the default group (4 ranks), "
                           "which ranks 0, 1, 3 wait in: it entered only #3 (1 behind) and is at "
                           "load_the_next_batch (<string>:"), text  # fmt: skip
    assert "last step 2, pid " in text
    job = report["job"]
    assert job == report["verdict"]["job"]
    (odd,) = job["odd_ones_out"]
    assert (odd["rank"], odd["count"], odd["behind"], odd["others_in"]) == (2, 3, 1, 4)
    assert odd["at"].startswith("load_the_next_batch (<string>:")
    assert odd["role"] == "trainer" and odd["step"] == 2 and odd["seconds_old"] < 10
    assert sorted(p["rank"] for p in job["processes"]) == [0, 1, 2, 3]
    assert {p["collectives"]["default"]["count"] for p in job["processes"] if p["rank"] != 2} \
        == {4}  # fmt: skip
    assert job["not_heard_from"] == [] and job["missing"] == []
    # the warning line starts with the same sentence, and `otel-rl why` prints it
    assert f"otel-rl: {text.split('. ')[0]}" in errors[0]
    why = subprocess.run([sys.executable, "-m", "otel_rl.cli", "why", str(log_dir)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert why.returncode == 0, why.stderr
    assert text.split(". ")[0] in " ".join(why.stdout.split()), why.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["nemo", "verl"])
def test_the_same_verdict_through_a_framework_s_drop_in_logger_and_timers(tmp_path, flavour):
    """The job as NeMo RL or verl runs it: rank 0 logs through the framework's drop-in logger,
    every rank times the sync with the framework's own timer (NeMo RL's ``Timer``, verl's
    ``marked_timer``) and none has a ``WorkerMetrics``: the timers make each rank publish, and
    rank 0's report names rank 2, its function and the count it is behind."""
    ranks, log_dir = _start_ranks(tmp_path, odd=2, how="sleep", flavour=flavour)
    try:
        report, _ = _first_report(log_dir, ranks, within=240)
    finally:
        _end(ranks)
    text = report["verdict"]["text"]
    print(text)
    assert text.startswith("rank 2 has not joined all_reduce #4 on the default group (4 ranks), "
                           "which ranks 0, 1, 3 wait in: it entered only #3 (1 behind) and is at "
                           "load_the_next_batch (<string>:"), text  # fmt: skip
    (odd,) = report["job"]["odd_ones_out"]
    assert (odd["rank"], odd["count"], odd["behind"]) == (2, 3, 1)
    assert odd["step"] is None  # a worker's timer knows no step
    processes = sorted((p["rank"], p["role"]) for p in report["job"]["processes"])
    assert processes == [(rank, "rank") for rank in range(4)]


def _unix(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()



@pytest.mark.slow
def test_a_rank_killed_while_the_others_wait_is_named_as_not_heard_from_since_a_time(tmp_path):
    """Rank 3 is SIGKILLed while the others wait for it: rank 0's report names it as not heard
    from since the time of its last state, and names no rank as behind (the dead one is not
    compared). Gloo notices a dead peer inside a collective at once (the connection resets,
    where NCCL waits): the others wait for rank 3 on the job's store instead."""
    ranks, log_dir = _start_ranks(tmp_path, odd=3, how="kill")
    try:
        report, _ = _first_report(log_dir, ranks, within=240)
    finally:
        _end(ranks)
    assert ranks[3].returncode == -9
    text = report["verdict"]["text"]
    print(text)
    found = re.match(r"rank 3 \(pid (\d+) on [^)]+\) has not been heard from since "
                     r"(\d\d:\d\d:\d\d) UTC \((\d+) s ago\), when it ", text)  # fmt: skip
    assert found, text
    assert int(found[1]) == ranks[3].pid and int(found[3]) > 20
    job = report["job"]
    (silent,) = job["not_heard_from"]
    assert silent["rank"] == 3 and silent["last_heard"] == f"{found[2]} UTC"
    assert job["odd_ones_out"] == []
    assert "Rank 0 is in sync (" in text


def test_a_closed_store_is_said_once_by_the_publisher_and_in_the_verdict(otel_rl_warnings):
    """The job's TCP store (a real one, hosted here) goes away: publishing warns once and goes
    on; reading says which store could not be read, in the verdict's ``missing``."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))  # fmt: skip
    board = TorchStoreBoard("127.0.0.1", port, world_size=2)
    state = JobState(published=time.time(), rank=1, world_rank=1, step=7)
    board.put(state, state.to_json())
    states, missing = board.read()
    assert [(s.rank, s.step) for s in states] == [(1, 7)] and missing == ["rank 0"]
    publisher = StatePublisher(lambda: (7, time.time()), role="trainer", rank=1)
    publisher.boards = lambda: [board]  # type: ignore[method-assign]
    publisher.publish()
    assert otel_rl_warnings.records == []
    del master  # the store's server is gone
    for _ in range(3):
        publisher.publish()
    said = [r.getMessage() for r in otel_rl_warnings.records if "state cannot be" in r.getMessage()]
    assert len(said) == 1, said
    assert f"the torch.distributed store at 127.0.0.1:{port}" in said[0]
    found = publisher.read([board])
    assert found.unreadable and found.unreadable[0].startswith(
        f"the torch.distributed store at 127.0.0.1:{port} could not be read ("
    )
    verdict = job_verdict(found, time.time())
    assert verdict.missing == verdict.unknown == found.unreadable
    assert [s.rank for s in found.states] == [1]  # its own state, made at the reading


# The training thread (the main one, inside a timer) waits on a URL with credentials; the
# publisher's thread publishes until its state names an HTTP wait.
_WAITS_ON_A_URL = textwrap.dedent("""
    import contextlib, json, sys, threading, time
    import requests
    from pathlib import Path
    from otel_rl.telemetry.timing import PhaseTimer
    from otel_rl.watch.job_state import DirectoryBoard, StatePublisher

    url, directory = sys.argv[1], Path(sys.argv[2])
    board = DirectoryBoard(directory)
    publisher = StatePublisher(lambda: (3, time.time()), role="reward", rank=0)
    publisher.boards = lambda: [board]

    def publish() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            publisher.publish()
            state = json.loads(next(directory.glob("*.json")).read_text())
            if (state.get("wait") or {}).get("kind") == "http":
                break
            time.sleep(0.1)
        print("published", flush=True)

    threading.Thread(target=publish, daemon=True).start()
    with PhaseTimer(lambda _: None, "timing/reward", "reward"), contextlib.suppress(OSError):
        requests.post(url, json={"prompt": "2+2"}, timeout=90)  # the credentials go as a header
""")


_DOWN_STORE = textwrap.dedent("""
    import sys, time
    from otel_rl.watch import job_state
    # every 10 ms instead of every 5 s, each try given 50 ms: the exit falls inside one
    job_state.BOARD_TIMEOUT, job_state.PUBLISH_EVERY, job_state.FIRST_AFTER = 0.05, 0.01, 0.0
    publisher = job_state.StatePublisher(lambda: (1, time.time()))
    board = job_state.TorchStoreBoard("127.0.0.1", int(sys.argv[1]), world_size=2)
    publisher.boards = lambda: [board]
    publisher.start()
    time.sleep(1.0)
    print(len(publisher._failed), flush=True)
""")


def test_a_store_that_is_down_costs_a_refused_connect_with_no_noise_and_a_clean_exit():
    """A job's store that is down (nothing listens on its port): each publication fails at the
    connect, before c10d's client (which would retry for its whole timeout, write each try with
    a C++ stack to stderr, and abort the process when the interpreter ended during a try)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _DOWN_STORE, str(port)], capture_output=True,
                              text=True, timeout=60, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "1"  # the board failed, and was said once
        assert "[c10d]" not in done.stderr and "terminate called" not in done.stderr
        said = [line for line in done.stderr.splitlines() if "cannot be published" in line]
        assert len(said) == 1 and "ConnectionRefusedError" in said[0], done.stderr


_FORKED_LOADER = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from otel_rl.compat.nemo_timer import Timer
    from otel_rl.watch import job_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                            world_size=1)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a data loader's worker: it times its work with the framework's timer
        Timer().start("load")
        os.write(write, b"1" if os.getpid() in job_state._PUBLISHERS else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    Timer().start("step")
    print(os.read(read, 1).decode(), int(os.getpid() in job_state._PUBLISHERS), flush=True)
""")


def test_a_child_forked_from_a_rank_does_not_publish_as_that_rank():
    """A framework's timer makes a rank publish, but not a child forked from it (a data
    loader's worker), which inherits the rank's process group and would publish under its
    key."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _FORKED_LOADER, str(free_port())],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]  # the child: no publisher; the rank: its own


_FROZEN_STORE = textwrap.dedent("""
    import json, os, pathlib, socket, sys, time
    from otel_rl import Logger
    from otel_rl.watch import job_state

    log_dir = pathlib.Path(sys.argv[1])
    frozen = socket.socket()  # accepts connections, never answers: a store whose host froze
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 2}})
    publisher = job_state._PUBLISHERS[os.getpid()]
    board = job_state.TorchStoreBoard("127.0.0.1", frozen.getsockname()[1], world_size=2)
    publisher.boards = lambda: [board]
    costs = []
    for step in range(40):
        began = time.perf_counter()
        logger.log_metrics({"loss": 1.0}, step=step)
        costs.append(time.perf_counter() - began)
        time.sleep(0.05)  # the publisher's first publication enters the store's client
    began = time.monotonic()
    with logger.timer("generation"):
        while not list((log_dir / "stalls").glob("*.json")) and time.monotonic() - began < 90:
            time.sleep(0.2)
    print(json.dumps({"seconds": time.monotonic() - began, "max_cost": max(costs)}), flush=True)
    # The publisher's thread is still inside c10d's client, which would abort the process if it
    # returned while the interpreter ends (the frozen host here is this process's socket).
    os._exit(0)
""")


def test_a_store_that_never_answers_holds_neither_the_training_thread_nor_the_stall_report(
    tmp_path,
):
    """The job's store accepts connections and never answers (its host frozen): c10d's client
    holds the publisher's thread for good, but ``log_metrics`` stays fast, the stall report is
    written on time, and its verdict says the store could not be read."""
    log_dir = tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _FROZEN_STORE, str(log_dir)],
                          capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["seconds"] < 20 and seen["max_cost"] < 0.05, seen
    (report_path,) = (log_dir / "stalls").glob("*.json")
    verdict = json.loads(report_path.read_text())["verdict"]
    assert verdict["text"].startswith("the training process is in generation ("), verdict

    (unread,) = [m for m in verdict["missing"] if "torch.distributed store" in m]
    assert "could not be read (TimeoutError: no answer within " in unread, unread


def test_a_wait_on_a_url_with_a_password_publishes_the_host_never_the_password(tmp_path):
    """A process waits on ``http://user:secret@host/…`` with ``requests`` (a real server that
    never answers):
    the state it publishes to a directory board names the host, and no byte of it holds the
    password."""
    server = SilentServer()  # never answers until hung up
    url = f"http://trainer:s3cr3t-pass-word@127.0.0.1:{server.port}/v1/reward"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    waiting = subprocess.Popen([sys.executable, "-c", _WAITS_ON_A_URL, url, str(tmp_path / "job")],
                               stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert waiting.stdout is not None and waiting.stdout.readline().strip() == "published"
    finally:
        waiting.kill()
        waiting.communicate(timeout=30)
        server.hang_up()
    (path,) = (tmp_path / "job").glob("*.json")
    state = JobState.from_json(path.read_bytes())
    assert state is not None and state.wait is not None, path.read_text()
    assert state.wait.kind == "http", state
    assert state.wait.host == f"127.0.0.1:{server.port}"
    assert f"127.0.0.1:{server.port}/v1/reward" in state.wait.words
    assert state.phase == "reward" and state.pid == waiting.pid
    assert b"s3cr3t-pass-word" not in path.read_bytes()
    found = JobStates()
    found.states = [state]
    assert "s3cr3t" not in job_verdict(found, time.time()).sentence


def test_a_state_stays_small_whatever_the_program_names_and_keeps_nothing_alive(tmp_path):
    """A timer named with 10,000 characters: the published state stays a few hundred bytes. The
    publisher outlives the object that gave its steps without keeping it: then no step."""
    import gc

    from otel_rl.telemetry.timing import PhaseTimer

    class Loop:
        def activity(self) -> tuple[int | None, float | None]:
            return 41, time.time()

    loop = Loop()
    board = DirectoryBoard(tmp_path / "job")
    publisher = StatePublisher(loop.activity, role="r" * 1_000_000, rank=5)
    publisher.boards = lambda: [board]  # type: ignore[method-assign]
    with PhaseTimer(lambda _: None, "timing/x", "x" * 10_000):
        publisher.publish()
    (path,) = (tmp_path / "job").glob("*.json")
    state = JobState.from_json(path.read_bytes())
    assert state is not None and state.step == 41 and state.phase == "x" * 299 + "…"
    assert state.role == "r" * 299 + "…"
    assert path.stat().st_size < 2_000
    del loop
    gc.collect()
    assert publisher.state().step is None


def test_a_state_that_is_not_one_costs_only_itself(tmp_path):
    """Files in the job's directory that are not states as a publisher writes them (a field of
    another type, a time that is not a number, another program's JSON, bytes, a huge file) are
    not read; the states beside them are, and the verdict is built."""
    now = time.time()
    directory = tmp_path / "job"
    directory.mkdir()
    good = {"pid": 11, "node": "n1", "role": "trainer", "rank": 1, "world_rank": 1, "step": 7,
            "published": now, "at": "train (loop.py:3)", "at_since": now - 2,
            "collectives": {"default": {"count": 5, "size": 2}}}  # fmt: skip
    (directory / "rank-1.json").write_text(json.dumps(good))
    bad = {
        "dict-node": {**good, "pid": 12, "node": {"a": 1}},
        "text-time": {**good, "pid": 13, "published": "abc"},
        "no-time": {"pid": 14},
        "list": [1, 2],
        "huge": {**good, "pid": 15, "at": "y" * 100_000},
    }
    for name, payload in bad.items():
        (directory / f"{name}.json").write_text(json.dumps(payload))
    (directory / "bytes.json").write_bytes(b"\xff\xfe{")
    (directory / "huge.json").write_text(json.dumps(bad["huge"]))
    states, _ = DirectoryBoard(directory).read()
    assert sorted(s.pid for s in states) == [11, 12]  # the dict node becomes text
    by_pid = {s.pid: s for s in states}
    assert by_pid[11].collectives == {"default": GroupCount(count=5, size=2)}
    assert by_pid[12].node == "{'a': 1}"
    found = JobStates()
    found.states = states
    verdict = job_verdict(found, now)
    assert len(verdict.processes) == 2 and verdict.not_heard_from == []


def test_of_a_role_the_one_not_where_the_most_are_is_named():
    """Four rollout workers outside any collective: three wait on their queue inside
    ``rollout``, one sits in ``score`` inside ``reward``. The comparison alone, on the states as
    their processes publish them."""
    now = time.time()

    def state(rank: int, phase: str, wait: PublishedWait | None, at: str) -> JobState:
        return JobState(role="rollout", rank=rank, pid=100 + rank, node=f"n{rank % 2}",
                        step=9, step_at=now - 50, published=now - 1, every=5.0, phase=phase,
                        phase_since=now - 40, at=at, at_since=now - 40, wait=wait)  # fmt: skip

    queue = PublishedWait("Queue.get (0 items queued)", since=now - 40, kind="sync")
    found = JobStates()
    found.states = [
        state(0, "rollout", queue, "collect (loop.py:20)"),
        state(1, "rollout", queue, "collect (loop.py:20)"),
        state(2, "reward", None, "score (reward.py:12)"),
        state(3, "rollout", queue, "collect (loop.py:20)"),
    ]
    verdict = job_verdict(found, now)
    assert verdict.sentence == (
        "rollout rank 2 is at score (reward.py:12) (40 s), inside reward for 40 s, last step 9, "
        "pid 102 on n0; as it said 1 s ago; not where rollout ranks 0, 1, 3 are (inside "
        "rollout, waiting on Queue.get (0 items queued))"
    )
    (odd,) = verdict.odd_ones_out
    assert (odd["rank"], odd["at"], odd["phase"]) == (2, "score (reward.py:12)", "reward")
    assert verdict.not_heard_from == [] and verdict.missing == []
    # the same four when one has not published for a minute: it is not heard from, not odd
    found.states[2] = dataclasses.replace(found.states[2], published=now - 60)
    verdict = job_verdict(found, now)
    assert verdict.odd_ones_out == [] and [p["rank"] for p in verdict.not_heard_from] == [2]
    assert verdict.sentence.startswith("rollout rank 2 (pid 102 on n0) has not been heard from ")
