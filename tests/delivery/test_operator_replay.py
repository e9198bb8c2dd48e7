"""``otel-rl replay`` from the operator's seat: damaged bytes, odd run ids, another working
directory, two replays at once or one under the live run, a spool it cannot write, and losses
counted by reason.

Every run here is a real training run (a real Logger, JSONL and TensorBoard read back with their
own readers) whose two trackers were down: the JSONL path was a directory and the TensorBoard
folder a file, so every record waited in the spool. The paths are fixed before the replay.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.delivery.spool import spool_root
from otel_rl.exporters.base import RowRejected, TrackerExporter
from otel_rl.run.replay import BUSY_EXIT_CODE, replay
from testkit.readers import jsonl_rows, tensorboard_scalars

REPO = Path(__file__).resolve().parents[2]
REPLAY = [sys.executable, "-m", "otel_rl.cli", "replay"]
STEPS = 200


def _run_with_trackers_down(log_dir: Path, steps: int = STEPS, **cfg) -> str:
    """A real run of ``steps`` steps whose JSONL and TensorBoard trackers could not write;
    afterwards both paths are usable again. Returns the run id."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "metrics.jsonl").mkdir()
    (log_dir / "tensorboard").write_text("in the way")
    logger = Logger({"log_dir": str(log_dir), "tensorboard_enabled": True,
                     "export": {"shutdown_timeout": 5}, **cfg})  # fmt: skip
    for step in range(steps):
        logger.log_metrics({"loss": step / 10, "reward": [1.0, 2.0, float(step)]}, step=step)
    logger.finish()
    (log_dir / "metrics.jsonl").rmdir()
    (log_dir / "tensorboard").unlink()
    return logger.run_id


def _wal(log_dir: Path, tracker: str = "jsonl") -> Path:
    (segment,) = sorted((spool_root(log_dir) / tracker).glob("*/wal-*.jsonl"))
    return segment


def _lines(segment: Path) -> list[tuple[int, int, dict]]:
    """``(start, end, record)`` of each line of an intact segment."""
    out, start = [], 0
    for raw in segment.read_bytes().splitlines(keepends=True):
        out.append((start, start + len(raw), json.loads(raw)))
        start += len(raw)
    return out


def _replay_cli(log_dir: Path, *args: str, cwd: Path | None = None, **kw):
    return subprocess.run([*REPLAY, str(log_dir), "--no-progress", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd or REPO, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def down_run(tmp_path_factory) -> Path:
    """One run with both trackers down, copied by each test that damages it. Its spool holds each
    step once, sealed: no provisional copy of a step still being logged, which the checkpoint
    thread writes every half ``fsync_interval`` while a step is pending (a loaded machine could
    stretch the loop over one) and which replay rightly delivers when the sealed line is
    damaged, so the steps a damage costs are those of the lines it touches."""
    log_dir = tmp_path_factory.mktemp("template") / "logs"
    _run_with_trackers_down(log_dir, export={"shutdown_timeout": 5, "fsync_interval": 3600})
    assert not any(record.get("provisional") for _, _, record in _lines(_wal(log_dir)))
    return log_dir


# ---- 1. one damaged byte costs one record ------------------------------------------------------

GARBAGE = bytes(range(0x80, 0xA6)) + b"\x00 \xff\xfe junk \x00\x01\x02"  # 48 bytes, not UTF-8


def _region(lines: list[tuple[int, int, dict]], where: str) -> tuple[int, bytes]:
    """Where (byte offset) and what to write, for one offset class."""
    middle = len(lines) // 2
    start, end, _ = lines[middle]
    first_start = lines[0][0]
    last_start, last_end, _ = lines[-1]
    return {
        "inside a line": (start + 20, GARBAGE),
        "across a newline": (end - 24, GARBAGE),
        "ending on a newline": (end - len(GARBAGE), GARBAGE),  # the next line is not touched
        "in the first line": (first_start + 2, GARBAGE),
        "in the last line": (last_start + 30, GARBAGE),
        "over the last newline": (last_end - 24, GARBAGE[:24]),
        "invalid UTF-8 only": (start + 40, b"\xff\xfe"),
        "one NUL byte": (start + 40, b"\x00"),
        # the line cut in two unreadable pieces, which name the same record: counted once
        "a newline inside a line": (start + 20, GARBAGE[:24] + b"\n" + GARBAGE[24:]),
    }[where]


def _touched_steps(lines: list[tuple[int, int, dict]], at: int, size: int) -> set[int]:
    """Steps whose sealed record sits in a line the bytes ``[at, at + size)`` touch."""
    return {
        record["step"]
        for start, end, record in lines
        if start < at + size and at < end  # overlaps
        and record["kind"] == "step" and not record.get("provisional")
    }


@pytest.mark.parametrize("where", [
    "inside a line", "across a newline", "ending on a newline", "in the first line",
    "in the last line",
    "over the last newline", "invalid UTF-8 only", "one NUL byte", "a newline inside a line",
])  # fmt: skip
def test_damaged_bytes_cost_only_the_records_they_touch(down_run, tmp_path, where):
    log_dir = tmp_path / "logs"
    shutil.copytree(down_run, log_dir)
    segment = _wal(log_dir)
    lines = _lines(segment)
    at, garbage = _region(lines, where)
    data = bytearray(segment.read_bytes())
    data[at : at + len(garbage)] = garbage
    segment.write_bytes(bytes(data))
    lost = _touched_steps(lines, at, len(garbage))
    assert 1 <= len(lost) <= 2

    out = _replay_cli(log_dir)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "UnicodeDecodeError" not in out.stderr
    assert f"{STEPS - len(lost)}/{STEPS - len(lost)} record(s) delivered" in out.stdout
    assert f"lost: {len(lost)} in spool lines that could not be read back" in out.stdout
    named = [line for line in out.stdout.splitlines() if "skipped an unreadable spool line" in line]
    assert named and all(str(segment) in line for line in named)
    assert f"{STEPS}/{STEPS} record(s) delivered" in out.stdout  # tensorboard: untouched
    steps = [row["step"] for row in jsonl_rows(log_dir / "metrics.jsonl")]
    assert steps == [s for s in range(STEPS) if s not in lost]
    assert [s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["loss"]] == list(
        range(STEPS)
    )
    # Reported once and set aside: the next replay has nothing left and succeeds.
    again = _replay_cli(log_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "unreadable" not in again.stdout
    assert [row["step"] for row in jsonl_rows(log_dir / "metrics.jsonl")] == steps


def test_two_random_damaged_regions_never_cost_more_than_their_lines(down_run, tmp_path):
    """The reported case: two 48-byte regions of garbage at random offsets, 25 placements."""
    rng = random.Random(21)
    for trial in range(25):
        log_dir = tmp_path / f"t{trial}" / "logs"
        shutil.copytree(down_run, log_dir)
        segment = _wal(log_dir)
        lines = _lines(segment)
        data = bytearray(segment.read_bytes())
        lost: set[int] = set()
        for _ in range(2):
            at = rng.randrange(len(data) - len(GARBAGE))
            data[at : at + len(GARBAGE)] = GARBAGE
            lost |= _touched_steps(lines, at, len(GARBAGE))
        segment.write_bytes(bytes(data))
        results = {r.tracker: r for r in replay(log_dir, progress=False)}
        assert results["jsonl"].error is None
        assert results["jsonl"].skipped, f"trial {trial}: the damage was not reported"
        steps = [row["step"] for row in jsonl_rows(log_dir / "metrics.jsonl")]
        assert steps == [s for s in range(STEPS) if s not in lost], f"trial {trial}"
        assert results["tensorboard"].delivered == STEPS


def test_damage_to_records_already_delivered_is_not_reported(tmp_path):
    """A line the tracker already holds is damaged later: nothing is lost, nothing to say."""
    log_dir = tmp_path / "logs"
    _run_with_trackers_down(log_dir, steps=50)
    assert _replay_cli(log_dir).returncode == 0
    # A later outage of the same run id leaves new records; the old, delivered ones get damaged.
    segment = _wal(log_dir)
    lines = _lines(segment)
    data = bytearray(segment.read_bytes())
    data[lines[3][0] + 5 : lines[3][0] + 5 + len(GARBAGE)] = GARBAGE
    segment.write_bytes(bytes(data))
    out = _replay_cli(log_dir)
    assert out.returncode == 0, out.stdout
    assert "unreadable" not in out.stdout
    assert [row["step"] for row in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(50))


# ---- 2. a run id never chooses where files go --------------------------------------------------


@pytest.mark.parametrize("run_id", ["../../escaped", "<abs>", "team/exp 1", ".."])
def test_a_run_id_is_a_folder_name_inside_the_log_dir(tmp_path, run_id):
    if run_id == "<abs>":  # an absolute path, outside the log dir
        run_id = str(tmp_path / "elsewhere" / "abs")
    log_dir = tmp_path / "box" / "logs"
    _run_with_trackers_down(log_dir, steps=20, run_id=run_id)
    outside = [p for p in tmp_path.rglob("*") if not str(p).startswith(str(tmp_path / "box"))]
    assert outside == []
    spools = sorted(p.parent.name for p in spool_root(log_dir).glob("*/*/meta.json"))
    assert len(spools) == 2 and all("/" not in s and s not in (".", "..") for s in spools)
    out = _replay_cli(log_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(20))
    assert {r["run_id"] for r in rows} == {run_id}


# ---- 3. replay from any directory --------------------------------------------------------------

RELATIVE_RUN = textwrap.dedent("""
    import os, sys
    from otel_rl import Logger
    os.makedirs("logs/metrics.jsonl")              # the JSONL tracker is down
    open("tb", "w").close()                        # and so is TensorBoard
    logger = Logger({"log_dir": "logs", "tensorboard_enabled": True,
                     "tensorboard": {"log_dir": "tb"}, "export": {"shutdown_timeout": 3}})
    for step in range(30):
        logger.log_metrics({"loss": step / 10}, step=step)
    logger.finish()
    os.rmdir("logs/metrics.jsonl")
    os.remove("tb")
""")


def _relative_run(started_in: Path) -> None:
    started_in.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RELATIVE_RUN], cwd=started_in, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_replay_from_another_directory_writes_where_the_run_wrote(tmp_path):
    started_in, elsewhere = tmp_path / "a", tmp_path / "b"
    _relative_run(started_in)
    elsewhere.mkdir()
    out = _replay_cli(Path("../a/logs"), cwd=elsewhere)  # a relative path, from another folder
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["step"] for r in jsonl_rows(started_in / "logs" / "metrics.jsonl")] == list(range(30))
    assert [s for s, _ in tensorboard_scalars(started_in / "tb")["loss"]] == list(range(30))
    assert list(elsewhere.iterdir()) == []


def test_replay_of_a_moved_log_dir_writes_into_it(tmp_path):
    """The run's folder gone (or the logs copied to another machine): relative paths follow the
    log_dir to where it is now."""
    started_in = tmp_path / "a"
    _relative_run(started_in)
    moved = tmp_path / "archive" / "run7"
    moved.mkdir(parents=True)
    shutil.move(str(started_in / "logs"), moved / "logs")
    shutil.rmtree(started_in)
    out = _replay_cli(moved / "logs", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["step"] for r in jsonl_rows(moved / "logs" / "metrics.jsonl")] == list(range(30))
    assert [s for s, _ in tensorboard_scalars(moved / "tb")["loss"]] == list(range(30))


# ---- 4. one replay at a time, never under a live run -------------------------------------------

LIVE_RUN = textwrap.dedent("""
    import sys, time
    from otel_rl import Logger
    log_dir, delivery = sys.argv[1:]
    logger = Logger({"log_dir": log_dir, "jsonl": {"path": log_dir + "/metrics.jsonl"},
                     "export": {"delivery": delivery}})
    for step in range(40):
        logger.log_metrics({"loss": step / 10}, step=step)
    logger.flush(timeout=10)                       # the JSONL tracker has met its directory
    print("logged", flush=True)
    sys.stdin.readline()                           # alive until the test says so
    logger.finish()
""")


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_a_replay_under_the_live_run_delivers_nothing_and_says_who_holds_the_spool(
    tmp_path, delivery
):
    """The holder named is the training process, also when its delivery process holds the
    spool (the operator looks for the training run's pid)."""
    log_dir = tmp_path / "logs"
    (log_dir / "metrics.jsonl").mkdir(parents=True)  # down while the run lives
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(log_dir), delivery], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert run.stdout.readline().strip() == "logged"
        (log_dir / "metrics.jsonl").rmdir()
        out = _replay_cli(log_dir)
        assert out.returncode == BUSY_EXIT_CODE, out.stdout + out.stderr
        assert f"in use by the training run (pid {run.pid}" in out.stdout
        assert not (log_dir / "metrics.jsonl").exists()
    finally:
        run.communicate("\n", timeout=60)
    out = _replay_cli(log_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(40))


def test_two_replays_at_once_deliver_each_record_once(tmp_path):
    log_dir = tmp_path / "logs"
    _run_with_trackers_down(log_dir, steps=3000)
    first = subprocess.Popen([*REPLAY, str(log_dir), "--no-progress"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen([*REPLAY, str(log_dir), "--no-progress", "--wait", "120"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=240) for p in (first, second)]
    codes = [first.returncode, second.returncode]
    assert codes.count(0) >= 1 and set(codes) <= {0, BUSY_EXIT_CODE}, outs
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(3000))
    assert [s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["loss"]] == list(
        range(3000)
    )


def test_a_killed_replay_never_holds_the_spool(tmp_path):
    log_dir = tmp_path / "logs"
    _run_with_trackers_down(log_dir, steps=3000)
    victim = subprocess.Popen([*REPLAY, str(log_dir), "--no-progress"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jsonl = log_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (jsonl.exists() and jsonl.stat().st_size > 10_000):
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    out = _replay_cli(log_dir)  # no --wait: the kernel released the dead holder's lock
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["step"] for r in jsonl_rows(jsonl)] == list(range(3000))


# ---- 5. a spool that cannot be written ---------------------------------------------------------


def _read_only(directory: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``directory`` read-only: a read-only bind mount in a mount namespace of
    its own when root (root writes through any mode bits), else the folder's mode."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o500)
        return argv
    script = (f'mount --bind "{directory}" "{directory}" && '
              f'mount -o remount,bind,ro "{directory}"')  # fmt: skip
    probe = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here: {probe.stderr.decode()[:200]}")
    return ["unshare", "-m", "sh", "-c", script + ' && exec "$@"', "sh", *argv]


@pytest.mark.slow
def test_a_read_only_spool_names_the_path_and_what_waits_there(tmp_path):
    log_dir = tmp_path / "logs"
    _run_with_trackers_down(log_dir, steps=10)
    spool_dir = next((spool_root(log_dir) / "jsonl").iterdir())
    argv = [*REPLAY, str(log_dir), "--no-progress"]
    out = subprocess.run(_read_only(spool_dir, argv), capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert str(spool_dir) in out.stderr
    assert "Read-only file system" in out.stderr or "Permission denied" in out.stderr
    assert "10 record(s) wait there" in out.stderr
    assert "0/0 record(s) delivered" not in out.stdout
    assert "10/10 record(s) delivered" in out.stdout  # tensorboard's spool is writable
    os.chmod(spool_dir, 0o700)  # fixed as the message says (the mount lived with that replay)
    again = _replay_cli(log_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(10))


# ---- 6. losses counted by reason ---------------------------------------------------------------


class Refusing(TrackerExporter):
    """Refuses the rows of odd steps (a tracker's verdict on content) and is slow, so that a
    small queue overflows."""

    name = "refusing"

    def __init__(self, **kwargs):
        self.steps: list[int] = []
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        time.sleep(0.002)
        if step % 2:
            raise RowRejected(f"step {step} refused")
        self.steps.append(step)


class Broken(TrackerExporter):
    """Stops for good at its first write (a permanent error: a missing package, say)."""

    name = "broken"

    def write_step(self, step, rows, batch):
        raise ModuleNotFoundError("No module named 'broken_sdk'")


def test_losses_are_counted_by_reason_in_stats_the_exit_message_and_prometheus(
    tmp_path, otel_rl_warnings
):
    refusing = Refusing(on_full="drop_oldest", queue_size=5)
    broken = Broken()
    logger = Logger(
        {"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False,
         "export": {"spool": False, "on_full": "drop_oldest", "shutdown_timeout": 10},
         "prometheus": {"enabled": True, "port": 0}},
        exporters=[refusing, broken],
    )  # fmt: skip
    for step in range(400):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.flush(timeout=30)
    page = urllib.request.urlopen(logger.prometheus_url, timeout=10).read().decode()
    logger.finish()

    queue_full = refusing.delivery.lost["queue_full"]
    assert queue_full > 0
    delivered_or_refused = 400 - queue_full
    assert refusing.delivery.lost["refused"] == delivered_or_refused - len(refusing.steps)
    assert all(s % 2 == 0 for s in refusing.steps)
    assert refusing.delivery.stats["dropped"] == sum(refusing.delivery.lost.values())
    assert broken.delivery.lost == {"tracker_stopped": 400}

    def sample(tracker: str, reason: str) -> float:
        line = next(ln for ln in page.splitlines() if ln.startswith("otel_rl_exporter_dropped")
                    and f'tracker="{tracker}"' in ln and f'reason="{reason}"' in ln)
        return float(line.rsplit(" ", 1)[1])

    assert sample("broken", "tracker_stopped") == 400
    assert sample("refusing", "queue_full") == queue_full
    assert sample("refusing", "corrupt") == 0
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    (said,) = [m for m in messages if m.startswith("otel-rl: refusing:") and "lost for good" in m]
    assert f"{queue_full} dropped from a full queue" in said
    assert f"{refusing.delivery.lost['refused']} refused by the tracker" in said


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_two_live_loggers_with_one_run_id_is_a_clear_error_and_leaves_nothing_running(
    tmp_path, delivery
):
    import threading

    export = {"delivery": delivery}
    first = Logger({"log_dir": str(tmp_path), "run_id": "same", "export": export})
    before = {t.name for t in threading.enumerate()}
    try:
        with pytest.raises(ConfigError, match=r"^run_id 'same' is already in use") as refused:
            Logger({"log_dir": str(tmp_path), "run_id": "same", "tensorboard_enabled": True,
                    "export": export})  # fmt: skip
        assert f"held by the training run (pid {os.getpid()}" in str(refused.value)
        time.sleep(0.2)
        assert {t.name for t in threading.enumerate()} <= before
    finally:
        first.log_metrics({"x": 1.0}, step=0)
        first.finish()
    # the first run's rows are whole, and the id is free again once it ended
    assert [r["step"] for r in jsonl_rows(tmp_path / "metrics.jsonl")] == [0]
    Logger({"log_dir": str(tmp_path), "run_id": "same"}).finish()


@pytest.mark.slow
def test_a_run_restarted_with_the_same_run_id_never_takes_the_dead_runs_waiting_records(
    tmp_path,
):
    """Killed with records waiting for replay, then started again under the same run_id as a
    new run (``resume: never``; a resumed one delivers them first: tests/run/test_resume.py):
    the new run spools beside the old records, says so once, and replay still delivers them;
    nothing is lost, nothing doubled."""
    log_dir = tmp_path / "logs"
    _run_with_trackers_down(log_dir, steps=50, run_id="job-7")  # 50 records wait
    with Logger({"log_dir": str(log_dir), "run_id": "job-7", "tensorboard_enabled": True,
                 "resume": "never"}) as lg:  # fmt: skip
        for step in range(100, 105):
            lg.log_metrics({"loss": step / 10, "reward": [1.0, 2.0, float(step)]}, step=step)
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(100, 105))
    out = _replay_cli(log_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")]
    assert sorted(steps) == list(range(50)) + list(range(100, 105))  # each once
    assert {r["run_id"] for r in jsonl_rows(log_dir / "metrics.jsonl")} == {"job-7"}
    assert _replay_cli(log_dir).stdout.count("0/0 record(s) delivered") >= 2  # nothing left


def _spool_of(log_dir: Path, steps: int) -> Path:
    """A JSONL spool of ``steps`` records, as a run that ended leaves it (meta with last_seq)."""
    from otel_rl.core.records import StepBatch
    from otel_rl.delivery.spool import Spool

    directory = spool_root(log_dir) / "jsonl" / "run1"
    spool = Spool(directory)
    for start in range(0, steps, 1000):  # as a run appends: segments rotate between writes
        batch = range(start, min(steps, start + 1000))
        spool.append([StepBatch(step=s, values={"x": float(s)}, seal=s) for s in batch])
    spool.close()
    spool.write_meta({"tracker": "jsonl", "run_id": "run1", "log_dir": str(log_dir),
                      "config": {"log_dir": str(log_dir)}, "exit_code": 0,
                      "last_seq": spool.last_seq})  # fmt: skip
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["middle segment deleted", "last segment deleted",
                                    "last segment emptied", "last segment cut mid-line"])
def test_records_cut_from_the_spool_from_outside_are_named_and_counted(tmp_path, damage):
    log_dir = tmp_path / "logs"
    directory = _spool_of(log_dir, 45_000)  # three segments: 1.., 20001.., 40001..
    segments = sorted(directory.glob("wal-*.jsonl"))
    assert [p.name for p in segments] == [
        "wal-000000000001.jsonl", "wal-000000020001.jsonl", "wal-000000040001.jsonl",
    ]  # fmt: skip
    if damage == "middle segment deleted":
        segments[1].unlink()
        gone = range(20_000, 40_000)  # steps (seq - 1)
    elif damage == "last segment deleted":
        segments[2].unlink()
        gone = range(40_000, 45_000)
    elif damage == "last segment emptied":
        segments[2].write_bytes(b"")
        gone = range(40_000, 45_000)
    else:
        data = segments[2].read_bytes()
        cut = data.index(b"\n", len(data) // 2) - 7  # inside a line
        segments[2].write_bytes(data[:cut])
        gone = range(40_000 + data[:cut].count(b"\n"), 45_000)
    out = _replay_cli(log_dir)
    assert out.returncode == 1, out.stdout + out.stderr
    delivered = 45_000 - len(gone)
    assert f"{delivered}/{delivered} record(s) delivered" in out.stdout
    if damage == "last segment cut mid-line":  # the torn line and what followed it
        assert f"lost: {len(gone)} in spool lines that could not be read back" in out.stdout
    else:
        assert f"lost: {len(gone)} deleted or cut from the spool from outside" in out.stdout
        assert f"records {gone[0] + 1}..{gone[-1] + 1} are missing from {directory}" in out.stdout
    steps = [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")]
    assert steps == [s for s in range(45_000) if s not in gone]
    again = _replay_cli(log_dir)  # reported once: the next replay has nothing to say
    assert again.returncode == 0 and "lost" not in again.stdout, again.stdout


def test_a_spool_without_its_metadata_is_reported_with_what_waits_there(tmp_path):
    log_dir = tmp_path / "logs"
    directory = _spool_of(log_dir, 50)
    (directory / "meta.json").unlink()
    out = _replay_cli(log_dir)
    assert out.returncode == 1
    assert f"{directory / 'meta.json'} is missing" in out.stderr
    assert "its 50 waiting record(s) cannot be delivered" in out.stderr
    (directory / "meta.json").write_text("{not json")
    out = _replay_cli(log_dir)
    assert out.returncode == 1 and "is unreadable" in out.stderr and "50 waiting" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_replay_waiting_for_a_spool_stops_at_once_on_a_signal(tmp_path, sig):
    log_dir = tmp_path / "logs"
    (log_dir / "metrics.jsonl").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(log_dir), "thread"], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert run.stdout.readline().strip() == "logged"
        waiting = subprocess.Popen([*REPLAY, str(log_dir), "--no-progress", "--wait", "120"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)  # fmt: skip
        time.sleep(2.0)  # well inside its wait
        assert waiting.poll() is None
        sent = time.monotonic()
        waiting.send_signal(sig)
        _, err = waiting.communicate(timeout=30)
        assert time.monotonic() - sent < 3.0, "the wait ignored the signal"
        assert waiting.returncode == 128 + sig, err
        assert "Traceback" not in err
    finally:
        run.communicate("\n", timeout=60)


def test_replay_of_the_folder_above_the_runs_points_at_the_runs_with_records(tmp_path):
    """``otel-rl replay logs/demo`` after the demo printed ``logs/demo/exp_002``: the runs
    below with records waiting are named, and the exit says something is left."""
    demo = tmp_path / "demo"
    (demo / "exp_001").mkdir(parents=True)
    Logger({"log_dir": str(demo / "exp_001")}).finish()  # delivered: nothing waits
    _run_with_trackers_down(demo / "exp_002", steps=5)
    out = _replay_cli(demo)
    assert out.returncode == 1
    assert "10 record(s) wait below it" in out.stderr and str(demo / "exp_002") in out.stderr
    assert str(demo / "exp_001") not in out.stderr
    empty = subprocess.run([*REPLAY, ""], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert empty.returncode == 2 and "is not a directory" in empty.stderr


def test_a_line_copied_over_the_next_one_is_reported_not_delivered_twice(tmp_path):
    """Damage that is valid JSON: line 11 overwritten by a copy of line 10 (same number)."""
    log_dir = tmp_path / "logs"
    directory = _spool_of(log_dir, 20)
    (segment,) = directory.glob("wal-*.jsonl")
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[10] = lines[9]
    segment.write_bytes(b"".join(lines))
    out = _replay_cli(log_dir)
    assert out.returncode == 1
    assert "sequence number 10 comes again after 10" in out.stdout and "(record 11)" in out.stdout
    steps = [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")]
    assert steps == [s for s in range(20) if s != 10]  # step 10 once; step 11's line is gone


class _InMemory(TrackerExporter):
    """A tracker given to the Logger as an instance only: no entry point can build it again."""

    name = "inmemory"

    def __init__(self) -> None:
        self.steps: list[int] = []
        super().__init__()

    def write_step(self, step, rows, batch) -> None:
        self.steps.append(step)


def test_replay_passes_over_a_spool_with_nothing_waiting_even_when_its_tracker_cannot_be_built(
    tmp_path,
):
    """An exporter given as an instance delivered everything: replay has nothing to send there
    and says 0/0 with exit 0, instead of failing (exit 1) for want of a tracker it does not
    need. With records waiting, the missing tracker is still an error naming it."""
    log_dir = tmp_path / "logs"
    tracker = _InMemory()
    with Logger({"log_dir": str(log_dir), "jsonl_enabled": False, "stalls": {"enabled": False}},
                exporters=[tracker]) as logger:  # fmt: skip
        for step in range(5):
            logger.log_metrics({"x": float(step)}, step=step)
    assert tracker.steps == list(range(5))
    done = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "inmemory" in done.stdout and "0/0 record(s) delivered" in done.stdout

    waiting = tmp_path / "waiting"
    tracker = _InMemory()
    tracker.write_step = lambda step, rows, batch: (_ for _ in ()).throw(ConnectionError("down"))
    logger = Logger({"log_dir": str(waiting), "jsonl_enabled": False, "stalls": {"enabled": False},
                     "export": {"shutdown_timeout": 0.2}}, exporters=[tracker])  # fmt: skip
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finish()
    refused = subprocess.run([*REPLAY, str(waiting), "--no-progress"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 1
    assert "no tracker exporter named 'inmemory'" in refused.stdout + refused.stderr
    assert "inmemory" in refused.stdout and "0/1 record(s) delivered" in refused.stdout


@pytest.mark.slow
def test_a_record_the_tracker_refuses_in_replay_is_counted_lost_not_delivered(tmp_path):
    """The summary line counts what the tracker holds; a refused record is set aside (replay
    exits 0 and never offers it again) and named among the losses."""
    from tests.faults.fault_tracker import env_with_faultfile, read_rows, set_mode

    control, rows = tmp_path / "control", tmp_path / "rows.jsonl"
    set_mode(control, "raise")  # down for the whole run: every step waits in the spool
    cfg = {"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False,
           "trackers": {"faultfile": {"path": str(rows), "control": str(control)}},
           "export": {"shutdown_timeout": 0.5, "retry_max_backoff": 0.1}}  # fmt: skip
    script = textwrap.dedent(f"""
        from otel_rl import Logger
        logger = Logger({cfg!r})
        for step in range(6):
            logger.log_metrics({{"loss": float(step)}}, step=step)
        logger.finish()
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    set_mode(control, "refuse 3")
    out = _replay_cli(tmp_path / "logs", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5/6 record(s) delivered; lost: 1 refused by the tracker" in out.stdout, out.stdout
    assert [step for step, _ in read_rows(rows)] == [0, 1, 2, 4, 5]
    again = _replay_cli(tmp_path / "logs", env=env)
    assert again.returncode == 0 and "0/0 record(s) delivered" in again.stdout, again.stdout
