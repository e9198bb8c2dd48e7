"""A log directory shared the way clusters share one: several processes and runs in one
``log_dir``, files left behind or put there by others. Real processes (three Loggers of one job
that share ``log_dir``, launched as a launcher launches them), real files (a named pipe, links to
a device and out of the directory, a huge file, a torn one), a real TCP store."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_rl.watch.job_state import DirectoryBoard, JobState, StatePublisher, TorchStoreBoard
from testkit.servers import free_port
from testkit.waiting import wait_for

# One of three processes of a job that share log_dir (WORLD_SIZE 3, no process group: the
# directory board). Each steps inside a timer `sync` until the test says `stall`: then process 1
# sits in the function named by argv[4] until `release`, the others wait for it; all three stall
# (the phase deadline: 1 s), and they step again until `stop`.
_WORKER = textwrap.dedent("""
    import os, pathlib, resource, sys, time
    # a bound for the machine: a read that never ends fails here rather than taking its memory
    resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    from otel_rl import Logger

    log_dir, flags, me, stuck = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), \\
        int(sys.argv[3]), sys.argv[4]
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 2, "phase_after": 1}})

    def stuck_reading_shard():
        while not (flags / "release").exists(): time.sleep(0.02)

    def load_the_next_shard():
        while not (flags / "release").exists(): time.sleep(0.02)

    def wait_for_the_others():
        while not (flags / "release").exists(): time.sleep(0.02)

    step, stalled = 1000 * me, False  # steps of their own: no two stall at the same step
    while not (flags / "stop").exists():
        with logger.timer("sync"):
            if not stalled and (flags / "stall").exists():
                stalled = True
                (globals()[stuck] if me == 1 else wait_for_the_others)()
            time.sleep(0.05)
        logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        step += 1
    logger.finish()
    os._exit(0)
""")

# What a launcher (torchrun's agent, a job script) does: it starts the job's processes, and
# kills them when it is told to end.
_LAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys
    worker, *args = sys.argv[1:]
    env = {**os.environ, "WORLD_SIZE": "3"}
    workers = [subprocess.Popen([sys.executable, "-c", worker, *args[:2], str(me), args[2]],
                                env=env) for me in range(3)]
    signal.signal(signal.SIGTERM, lambda *_: [w.kill() for w in workers])  # then reaped below
    print(" ".join(str(w.pid) for w in workers), flush=True)
    sys.exit(max(w.wait() for w in workers))
""")


def _env(**more: str) -> dict[str, str]:
    """The tests' environment without a launcher's names of its own (torchrun's, Slurm's)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "SLURM_", "OTEL_RL_")) and k != "WORLD_SIZE"}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **more}  # fmt: skip


def _states(job: Path, pids: list[int]) -> dict[int, dict]:
    """The workers' own published states by pid (their files only: the test opens no pipe)."""
    out = {}
    for path in job.glob("process-*.json"):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(path.read_text())
            if state.get("pid") in pids:
                out[state["pid"]] = state
    return {pid: out[pid] for pid in pids if pid in out}


def _reports(log_dir: Path, pids: list[int]) -> dict[int, dict]:
    out = {}
    for path in (log_dir / "stalls").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            report = json.loads(path.read_text())
            if report.get("pid") in pids and report.get("verdict"):
                out[report["pid"]] = {**report, "path": path}
    return out


def _of_each(found: dict[int, dict]) -> dict[int, dict]:
    """``found`` once it has one for each of the three processes, else nothing."""
    return found if len(found) == 3 else {}


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) * 1024


def _stalled_and_resumed(
    log_dir: Path, flags: Path, pids: list[int], peak: dict[int, int] | None = None
) -> dict[int, dict]:
    """Makes the job stall, waits for each process's report, releases it, and waits until each
    process's published step is past the step it stalled at; the reports, by pid."""
    job, peak = log_dir / "job", {} if peak is None else peak

    def sampled(value: object) -> object:
        for pid in peak:
            peak[pid] = max(peak[pid], _rss(pid))
        return value

    (flags / "stall").touch()
    try:
        reports = wait_for(lambda: sampled(_of_each(_reports(log_dir, pids))), 60,
                           "a stall report from each process")  # fmt: skip
    finally:
        (flags / "release").touch()
    stalled_at = {pid: report["last_step"] for pid, report in reports.items()}
    wait_for(lambda: sampled(all(s.get("step") is not None and s["step"] > stalled_at[p] + 3
                                 for p, s in _states(job, pids).items())),
             30, "each process publishing its steps after the stall")  # fmt: skip
    return reports


def _stop(flags: Path, processes: list[subprocess.Popen]) -> None:
    (flags / "stop").touch()
    for process in processes:
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.terminate()  # a launcher then kills its processes
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate(timeout=30)


def _the_odd_one_named(reports: dict[int, dict], odd: int, function: str) -> None:
    for report in reports.values():
        job = report["job"]
        print(job["sentence"])
        assert [p["pid"] for p in job["odd_ones_out"]] == [odd], job["sentence"]
        assert job["odd_ones_out"][0]["at"].startswith(f"{function} (<string>:"), job
        assert sorted(p["pid"] for p in job["processes"]) == sorted(reports), job["processes"]
        assert job["not_heard_from"] == []


@pytest.mark.slow
def test_files_in_the_job_directory_that_are_no_state_hold_neither_a_publication_nor_the_verdict(
    tmp_path,
):
    """A named pipe, a link to /dev/zero, a link to a state outside log_dir, a 50 MB file and a
    torn state in ``<log_dir>/job`` while a job of three processes stalls: each process's
    verdict names the one stuck, none names the state behind the link, every process goes on
    publishing (its state's step moves past the stall) and its memory stays where it was."""
    log_dir, flags, outside = tmp_path / "logs", tmp_path / "flags", tmp_path / "outside"
    job = log_dir / "job"
    for folder in (job, flags, outside):
        folder.mkdir(parents=True)
    os.mkfifo(job / "fifo.json")
    (job / "zero.json").symlink_to("/dev/zero")
    (job / "big.json").write_bytes(b'{"pid": 7, "published": %.3f, "at": "' % time.time()
                                   + b"x" * 50_000_000 + b'"}')  # fmt: skip
    env = _env(WORLD_SIZE="3")
    workers = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(log_dir), str(flags), str(me),
                          "stuck_reading_shard"], env=env, stderr=subprocess.DEVNULL)
        for me in range(3)
    ]  # fmt: skip
    pids = [w.pid for w in workers]
    try:
        states = wait_for(lambda: _of_each(_states(job, pids)), 60, "the three states")
        (job / "torn.json").write_text(json.dumps(states[pids[0]])[:120])  # a write cut short
        intruder = {**states[pids[0]], "pid": 3_999_999, "phase": "elsewhere",
                    "at": "intruder_outside_the_log_dir (elsewhere.py:1)",
                    "published": time.time() + 3600}  # fmt: skip
        (outside / "state.json").write_text(json.dumps(intruder))
        (job / "intruder.json").symlink_to(outside / "state.json")
        before = {pid: _rss(pid) for pid in pids}
        peak = dict(before)
        reports = _stalled_and_resumed(log_dir, flags, pids, peak)
    finally:
        _stop(flags, workers)
    _the_odd_one_named(reports, pids[1], "stuck_reading_shard")
    for report in reports.values():
        assert "intruder" not in json.dumps(report["job"])
    grown = {pid: (peak[pid] - before[pid]) / 2**20 for pid in pids}
    assert max(grown.values()) < 32, f"MiB grown: {grown}"
    assert [w.returncode for w in workers] == [0, 0, 0]


@pytest.mark.slow
def test_a_previous_run_s_states_in_the_same_log_dir_are_not_this_job_s(tmp_path):
    """A job of three processes is killed while its process 1 sits in
    ``stuck_reading_shard``; a new launch of the job in the same log_dir stalls seconds later,
    its process 1 in ``load_the_next_shard``: its verdicts name the new process 1 only, and
    compare only the new launch's processes."""
    log_dir = tmp_path / "logs"
    job = log_dir / "job"

    def launch(flags: Path, stuck: str) -> tuple[subprocess.Popen, list[int]]:
        flags.mkdir()
        launcher = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, _WORKER, str(log_dir), str(flags), stuck],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert launcher.stdout is not None
        return launcher, [int(pid) for pid in launcher.stdout.readline().split()]

    before, old = launch(tmp_path / "before", "stuck_reading_shard")
    try:
        wait_for(lambda: len(_states(job, old)) == 3, 60, "the first launch's states")
        (tmp_path / "before" / "stall").touch()
        wait_for(lambda: [str(s.get("at")).split(" ")[0] for s in _states(job, old).values()]
                 == ["wait_for_the_others", "stuck_reading_shard", "wait_for_the_others"], 30,
                 "the first launch's processes stalled")  # fmt: skip
    finally:
        before.terminate()  # the launcher kills its processes, as the job's end would
        before.communicate(timeout=30)
    launcher, new = launch(tmp_path / "again", "load_the_next_shard")
    try:
        wait_for(lambda: len(_states(job, new)) == 3, 60, "the new launch's states")
        reports = _stalled_and_resumed(log_dir, tmp_path / "again", new)
    finally:
        _stop(tmp_path / "again", [launcher])
    _the_odd_one_named(reports, new[1], "load_the_next_shard")
    for report in reports.values():
        said = json.dumps(report["job"])
        assert "stuck_reading_shard" not in said
        assert not any(str(pid) in said for pid in old), said
    assert launcher.returncode == 0


# Each of three processes sharing log_dir (no job of theirs: nothing published) logs step 0 at
# the moment the test gives, then stalls: the three reports begin within the same second.
_AT_ONCE = textwrap.dedent("""
    import pathlib, sys, time
    from otel_rl import Logger

    log_dir, flags = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 1}})
    logger.log_metrics({"loss": 1.0}, step=0)
    print("ready", flush=True)
    while not (flags / "go").exists() or time.time() < float((flags / "go").read_text()):
        logger.log_metrics({"loss": 1.0}, step=0)  # not stalled while it waits
        time.sleep(0.01)
    with logger.timer("generation"):
        while not (flags / "release").exists(): time.sleep(0.02)
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.finish()
""")


@pytest.mark.slow
def test_three_processes_stalling_at_once_in_one_log_dir_leave_three_reports(tmp_path):
    """Three processes stall at the same step in the same second: three reports, each under a
    name of its own, each told in its own warning; a file already at the name one of them would
    take is left as it was, and that process's report goes beside it."""
    log_dir, flags = tmp_path / "logs", tmp_path / "flags"
    (log_dir / "stalls").mkdir(parents=True)
    flags.mkdir()
    errors = [tmp_path / f"stderr-{me}.txt" for me in range(3)]
    workers = []
    for error in errors:
        with error.open("w") as sink:
            workers.append(subprocess.Popen(
                [sys.executable, "-c", _AT_ONCE, str(log_dir), str(flags)], env=_env(),
                stdout=subprocess.PIPE, stderr=sink, text=True))  # fmt: skip
    pids = [w.pid for w in workers]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert "ready" in (line.strip() for line in iter(worker.stdout.readline, ""))
        go = int(time.time()) + 2.1  # a tenth of a second into a second: the stalls begin ~1 s on
        taken = []
        for second in (int(go) + 1, int(go) + 2):  # the name process 0 would take
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
            taken.append(log_dir / "stalls" / f"0-{stamp}-{pids[0]}.txt")
            taken[-1].write_text("another report")
        (flags / "go.tmp").write_text(repr(go))
        (flags / "go.tmp").rename(flags / "go")
        wait_for(lambda: all("report: " in e.read_text() for e in errors), 60,
                 "each process's stall warning")  # fmt: skip
    finally:
        (flags / "release").touch()
        for worker in workers:
            worker.communicate(timeout=60)
    assert [w.returncode for w in workers] == [0, 0, 0]
    reports = {json.loads(p.read_text())["pid"]: p for p in (log_dir / "stalls").glob("*.json")}
    assert sorted(reports) == sorted(pids)
    assert all(t.read_text() == "another report" for t in taken)
    assert reports[pids[0]].name in {t.name.replace(".txt", "-2.json") for t in taken}
    said = []
    for pid, error in zip(pids, errors, strict=True):
        (line,) = [ln for ln in error.read_text().splitlines() if "report: " in ln]
        path = Path(line.rsplit("report: ", 1)[1])
        assert path == reports[pid].with_suffix(".txt")
        assert f"pid {pid} on " in path.read_text() and "stall ended" in path.read_text()
        said.append(path)
    assert len(set(said)) == 3


def test_a_state_of_another_job_or_attempt_or_naming_none_is_read_but_not_compared(tmp_path):
    """States in the job's directory that an older otel-rl wrote (no job named), of another
    launch, or of an earlier attempt of this process's run each still read, as states; the
    process compares only its own job's (here a peer of another run id, and itself)."""
    board = DirectoryBoard(tmp_path / "job")
    publisher = StatePublisher(lambda: (3, time.time()), run_id="run-a", attempt=2)
    publisher.boards = lambda: [board]  # type: ignore[method-assign]
    now = time.time()
    common = {"role": "process", "node": "n1", "published": now, "step": 1}
    written = {
        "older": {**common, "pid": 11},
        "another-launch": {**common, "pid": 12, "job": "started by pid 1 on n1 (at tick 5)"},
        "earlier-attempt": {**common, "pid": 13, "job": board.job, "run_id": "run-a",
                            "attempt": 1},
        "peer": {**common, "pid": 14, "job": board.job, "run_id": "run-b", "attempt": 1},
    }  # fmt: skip
    (tmp_path / "job").mkdir()
    for name, state in written.items():
        (tmp_path / "job" / f"{name}.json").write_text(json.dumps(state))
    states, _ = board.read()
    assert sorted(s.pid for s in states) == [11, 12, 13, 14]
    assert {s.version for s in states} == {1}  # written before states said their version
    found = publisher.read()
    assert sorted(s.pid for s in found.states) == sorted([14, os.getpid()])
    own = next(s for s in found.states if s.pid == os.getpid())
    assert (own.run_id, own.attempt, own.job, own.version) == ("run-a", 2, board.job, 2)


@pytest.mark.slow  # importing torch takes seconds
def test_the_torch_store_keys_of_an_earlier_restart_are_not_read(monkeypatch):
    """torchrun's restart count and run id scope the keys in the job's store (a real TCP store):
    the states of restart 0 are not read by restart 1, whose ranks have not published."""
    from datetime import timedelta

    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))  # fmt: skip
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = TorchStoreBoard("127.0.0.1", port, world_size=2)
    state = JobState(published=time.time(), rank=1, world_rank=1, step=7)
    first.put(state, state.to_json())
    assert [s.step for s in first.read()[0]] == [7]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = TorchStoreBoard("127.0.0.1", port, world_size=2)
    assert again.read() == ([], ["rank 0", "rank 1"])
    assert first.job != again.job and "job-7" in again.job
    del master


class _SlowAfterFirstRead(DirectoryBoard):
    """A real directory board whose reads after the first take longer than a read is given: a
    job's store under load, which cannot be made slow on cue here."""

    reads = 0

    def read(self) -> tuple[list[JobState], list[str]]:
        self.reads += 1
        if self.reads > 1:
            time.sleep(3.0)
        return super().read()


def test_a_re_read_cut_short_by_a_slow_board_keeps_what_the_first_read_found(tmp_path):
    """The verdict reads the job's states again while a peer's is older than the stall; a
    re-read the board does not answer in time takes nothing away from the first read: the
    peer's state is still there, and the board is not said unreadable."""
    board = _SlowAfterFirstRead(tmp_path / "job")
    publisher = StatePublisher(lambda: (3, time.time()), run_id="run-a", attempt=1)
    publisher.boards = lambda: [board]  # type: ignore[method-assign]
    (tmp_path / "job").mkdir()
    since = time.time()
    peer = {"role": "process", "node": "n1", "published": since - 5, "step": 7, "pid": 14,
            "job": board.job, "run_id": "run-a", "attempt": 1}  # fmt: skip
    (tmp_path / "job" / "peer.json").write_text(json.dumps(peer))
    found = publisher.read_fresh(since, wait=1.5)
    assert board.reads >= 2  # the peer's state was older than the stall: read again
    assert found.unreadable == []
    assert sorted((s.pid, s.step) for s in found.states) == sorted([(14, 7), (os.getpid(), 3)])
