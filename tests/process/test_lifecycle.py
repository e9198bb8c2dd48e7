"""Process lifecycle with real processes: exit codes, signals at random moments, fork, routing.

Every training process here is a real ``python`` subprocess (or a real ``multiprocessing`` fork
child) and every check reads back what the trackers stored: JSONL rows, TensorBoard events, the
spool's ``meta.json``, MLflow run status from a real ``mlflow server``.
"""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics

from otel_rl import Logger
from testkit import servers
from testkit.readers import jsonl_rows, tensorboard_scalars

mlflow_server = servers.mlflow_server

FORK = "fork" in multiprocessing.get_all_start_methods()
TIMEOUT = 60  # a hang fails the test instead of blocking CI


def _run(script: str, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _metas(log_dir: Path) -> list[dict[str, Any]]:
    paths = glob.glob(str(log_dir / ".otel-rl" / "spool" / "*" / "*" / "meta.json"))
    assert paths, f"no spool meta.json under {log_dir}"
    return [json.loads(Path(p).read_text()) for p in paths]


def _stats(stderr: str) -> dict[str, int]:
    lines = [line for line in stderr.splitlines() if line.startswith("STATS ")]
    return json.loads(lines[-1][len("STATS "):]) if lines else {}


_STATS_AT_EXIT = """
import atexit, json, sys
from otel_rl.process import lifecycle
# Registered before any Logger: runs after their atexit finish.
atexit.register(lambda: sys.stderr.write("STATS " + json.dumps(lifecycle.stats) + "\\n"))
"""


# ---- exit codes --------------------------------------------------------------------------------

_SYS_EXIT = """
import sys
from otel_rl import Logger
logger = Logger({"log_dir": sys.argv[1], "tensorboard_enabled": True})
for step in range(5):
    logger.log_metrics({"loss": step / 10}, step=step)
sys.exit(3)  # outside any with block: the atexit finish must close the run with 3
"""


def test_sys_exit_outside_a_with_block_closes_the_trackers_with_its_code(log_dir):
    result = _run(_SYS_EXIT, str(log_dir))
    assert result.returncode == 3, result.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(s, s / 10) for s in range(5)]
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert [(s, round(v, 6)) for s, v in scalars["loss"]] == [(s, s / 10) for s in range(5)]
    assert {m["tracker"]: m["exit_code"] for m in _metas(log_dir)} == {
        "jsonl": 3, "tensorboard": 3,
    }  # fmt: skip


def test_a_caught_sys_exit_before_the_logger_does_not_mark_the_run_failed(log_dir):
    result = _run(
        """
        import sys
        try:
            sys.exit(2)  # argparse-style, caught: the process goes on
        except SystemExit:
            pass
        from otel_rl import Logger
        logger = Logger({"log_dir": sys.argv[1]})
        logger.log_metrics({"loss": 1.0}, step=0)
        """,
        str(log_dir),
    )
    assert result.returncode == 0, result.stderr
    assert [m["exit_code"] for m in _metas(log_dir)] == [0]
    assert jsonl_rows(log_dir / "metrics.jsonl")[0]["metrics"] == {"loss": 1.0}


@pytest.mark.slow
def test_sys_exit_outside_a_with_block_marks_the_mlflow_run_failed(mlflow_server, log_dir):
    from mlflow.tracking import MlflowClient

    experiment = f"exit-{uuid.uuid4().hex[:8]}"
    script = """
    import sys
    from otel_rl import Logger
    logger = Logger({
        "log_dir": sys.argv[1],
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": sys.argv[2], "experiment_name": sys.argv[3]},
    })
    for step in range(5):
        logger.log_metrics({"loss": step / 10}, step=step)
    sys.exit(3)
    """
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(log_dir), mlflow_server.url,
         experiment],
        capture_output=True, text=True, timeout=120,
        env={**env_free, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, result.stderr  # the run never reached the server
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(5)]
    assert {m["tracker"]: m["exit_code"] for m in _metas(log_dir)}["mlflow"] == 3


# ---- signals -----------------------------------------------------------------------------------

_TIGHT_LOOP = (
    _STATS_AT_EXIT
    + """
from otel_rl import Logger
logger = Logger({"log_dir": sys.argv[1], "export": {"shutdown_timeout": 30}})
keys = [f"k{j}" for j in range(8)]
logger.log_metrics({k: 0.0 for k in keys}, step=0)
print("ready", flush=True)
step = 1
while True:  # only a signal ends this process
    logger.log_metrics({k: float(step) for k in keys}, step=step, step_finished=step % 3 == 0)
    step += 1
"""
)


def _kill_tight_loop(log_dir: Path, signum: int, delay: float) -> dict[str, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", _TIGHT_LOOP, str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)  # a random moment of the loop; nothing is asserted on timing
        child.send_signal(signum)
        _, stderr = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    expected_rc = 143 if signum == signal.SIGTERM else -signal.SIGINT  # Python re-kills on ^C
    assert child.returncode == expected_rc, stderr[-3000:]
    assert "Exception ignored" not in stderr, stderr[-3000:]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert rows, stderr[-3000:]
    # Every step logged reached the tracker whole, in order, once.
    assert [r["step"] for r in rows] == list(range(len(rows)))
    for row in rows:
        assert row["metrics"] == {f"k{j}": float(row["step"]) for j in range(8)}
    assert [m["exit_code"] for m in _metas(log_dir)] == [128 + signum]
    return _stats(stderr)


def _kill_at_random_moments(tmp_path: Path, seed: int, runs: int) -> dict[str, int]:
    rng = random.Random(seed)
    totals: dict[str, int] = {}
    for run in range(runs):
        signum = signal.SIGTERM if run % 4 else signal.SIGINT
        stats = _kill_tight_loop(tmp_path / f"run{run}", signum, rng.uniform(0.0, 0.2))
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    return totals


@pytest.mark.slow
def test_sigterm_and_sigint_at_random_moments_of_a_tight_loop(tmp_path):
    totals = _kill_at_random_moments(tmp_path, seed=12, runs=4)
    assert totals["received"] == totals["raised"] == 4


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_and_sigint_at_random_moments_of_a_tight_loop_many(tmp_path):
    totals = _kill_at_random_moments(tmp_path, seed=1212, runs=40)
    assert totals["received"] == totals["raised"] == 40
    print("signal path over 40 kills:", totals)


def test_a_signal_inside_log_metrics_takes_effect_after_the_call(log_dir):
    """The signal arrives while otel-rl is on the stack (iterating the caller's mapping, under
    the Logger's frames): it is raised once the call has returned, and that step is whole."""
    result = _run(
        _STATS_AT_EXIT
        + """
from collections.abc import Mapping
import os, signal, time
from otel_rl import Logger

class Metrics(Mapping):
    def __init__(self, step):
        self.data = {"a": float(step), "b": -float(step)}
        self.step = step
    def __getitem__(self, key):
        return self.data[key]
    def __len__(self):
        return len(self.data)
    def __iter__(self):
        if self.step == 3:
            signal.raise_signal(signal.SIGTERM)  # lands inside log_metrics
        return iter(self.data)

logger = Logger({"log_dir": sys.argv[1]})
for step in range(5):
    logger.log_metrics(Metrics(step), step=step)
    print("returned", step, flush=True)
    if step == 3:
        time.sleep(10)  # the signal is raised here, once log_metrics returned
print("signal lost", flush=True)
""",
        str(log_dir),
    )
    assert result.returncode == 143, result.stderr
    assert result.stdout.split("\n")[:4] == [f"returned {s}" for s in range(4)]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (s, {"a": float(s), "b": -float(s)}) for s in range(4)
    ]
    assert _stats(result.stderr)["deferred"] >= 1
    assert [m["exit_code"] for m in _metas(log_dir)] == [143]


@pytest.mark.parametrize("where", ["weakref_callback", "__del__"])
def test_a_signal_landing_where_exceptions_are_swallowed_is_not_lost(log_dir, where):
    result = _run(
        _STATS_AT_EXIT
        + """
import signal, time, weakref
from otel_rl import Logger

def raise_here(*_):
    signal.raise_signal(signal.SIGTERM)  # the handler runs before this frame returns
    total = 0
    for i in range(1000):
        total += i

class Obj:
    pass

class WithDel:
    def __del__(self):
        raise_here()

logger = Logger({"log_dir": sys.argv[1]})
logger.log_metrics({"loss": 1.0}, step=0)
if sys.argv[2] == "weakref_callback":
    obj = Obj()
    ref = weakref.ref(obj, raise_here)
    del obj  # the callback runs now; an exception raised in it is printed and swallowed
else:
    obj = WithDel()
    del obj
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    time.sleep(0.001)
print("signal lost", flush=True)
""",
        str(log_dir),
        where,
    )
    assert result.returncode == 143, (result.stdout, result.stderr)
    assert "signal lost" not in result.stdout
    assert "Exception ignored" not in result.stderr, result.stderr
    stats = _stats(result.stderr)
    # A __del__ frame is recognised before raising; a plain weakref callback is caught after.
    assert stats["rearmed"] == (1 if where == "weakref_callback" else 0), stats
    assert jsonl_rows(log_dir / "metrics.jsonl")[0]["metrics"] == {"loss": 1.0}
    assert [m["exit_code"] for m in _metas(log_dir)] == [143]


_SLOW_TRACKER = (
    _STATS_AT_EXIT
    + """
import os, time
from pathlib import Path
from otel_rl import Logger
from otel_rl.exporters.base import TrackerExporter

out, marker = Path(sys.argv[1]) / "slow.txt", Path(sys.argv[1]) / "draining"

class SlowFile(TrackerExporter):
    name = "slowfile"

    def open(self):
        self.file = out.open("a")

    def write_step(self, step, rows, batch):
        while not logger._run.steps.closed:  # hold the backlog until the run is finishing
            time.sleep(0.01)
        marker.touch()  # the test signals now: the drain takes 40 x 50 ms
        time.sleep(0.05)
        self.file.write(f"{step} {rows['loss']}\\n")
        self.file.flush()

    def close(self, exit_code):
        self.file.write(f"closed {exit_code}\\n")
        self.file.close()

logger = Logger({"log_dir": sys.argv[1], "export": {"shutdown_timeout": 30}},
                exporters=[SlowFile()])
for step in range(40):
    logger.log_metrics({"loss": float(step)}, step=step)
print("ready", flush=True)
if sys.argv[2] == "finish":
    logger.finish()
    print("after finish", flush=True)
    time.sleep(30)
elif sys.argv[2] == "exit_drain":
    while True:
        time.sleep(0.01)
# clean_exit: the script ends; the interpreter's exit drains the trackers
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["finish", "exit_drain", "clean_exit"])
def test_signals_during_finish_never_cut_the_drain(tmp_path, case):
    """``finish``: the program called finish() and SIGTERM+SIGINT arrive while it drains: every
    row is written, the tracker closed (with the code finish was given), then the process exits
    143. ``exit_drain``: a first SIGTERM ends the loop, more arrive during the atexit drain: the
    drain completes and the run is closed with 143. ``clean_exit``: the script ends, the signals
    arrive during the atexit drain: the drain completes (the run closed with the code it ended
    with, 0) and the process still exits 143, as the signal says."""
    log_dir = tmp_path / "logs"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_TRACKER, str(log_dir), case],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        if case == "exit_drain":
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT
        while not (log_dir / "draining").exists():
            assert time.monotonic() < deadline and child.poll() is None, child.stderr.read()
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, stderr[-3000:]
    assert "after finish" not in stdout  # the signal took effect as soon as finish() returned
    lines = (log_dir / "slow.txt").read_text().splitlines()
    closed_with = 143 if case == "exit_drain" else 0
    assert lines == [f"{s} {float(s)}" for s in range(40)] + [f"closed {closed_with}"]
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(s, float(s)) for s in range(40)]


def test_finish_leaves_a_sigterm_handler_installed_after_the_logger_alone(tmp_path):
    """In this (pytest's main) thread; no signal is sent, only handlers compared."""
    from otel_rl.process.lifecycle import _on_signal

    # `ray.init` earlier in this process leaves its own SIGTERM handler behind.
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def app_handler(signum, frame):  # pragma: no cover - never called
        pass

    try:
        first = Logger({"log_dir": str(tmp_path / "a")})
        second = Logger({"log_dir": str(tmp_path / "b")})
        assert signal.getsignal(signal.SIGTERM) is _on_signal
        first.finish()
        assert signal.getsignal(signal.SIGTERM) is _on_signal  # the second is still live
        second.finish()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back

        logger = Logger({"log_dir": str(tmp_path / "c")})
        signal.signal(signal.SIGTERM, app_handler)  # the application's own, installed after
        logger.finish()
        assert signal.getsignal(signal.SIGTERM) is app_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, original)


def test_the_last_finish_leaves_no_signal_thread_nor_its_pipe_behind(tmp_path):
    """A process that used Loggers and goes on without one keeps no thread or descriptor of
    ours: the signal re-send thread and its pipe end with the last Logger handling signals (and
    come back with the next one)."""
    script = textwrap.dedent(
        """
        import os, sys, threading, time
        from otel_rl import Logger

        def pipes():
            found = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                        found.add(int(fd))
                except OSError:
                    pass
            return found

        def ours():
            return [t.name for t in threading.enumerate() if t.name == "otel-rl-signals"]

        before = pipes()
        for run in ("a", "b"):
            logger = Logger({"log_dir": os.path.join(sys.argv[1], run)})
            assert ours() == ["otel-rl-signals"] and len(pipes() - before) == 2, (ours(), pipes())
            logger.log_metrics({"x": 1.0}, step=0)
            logger.finish()
            deadline = time.monotonic() + 5
            while ours() and time.monotonic() < deadline:
                time.sleep(0.01)
            print(run, ours(), sorted(pipes() - before), flush=True)
        """
    )
    out = _run(script, str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["a [] []", "b [] []"]


# ---- fork --------------------------------------------------------------------------------------


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _child_uses_the_inherited_logger(logger: Logger, queue: Any) -> None:
    handler = _ListHandler()
    logging.getLogger("otel_rl").addHandler(handler)
    for step in range(3):
        logger.log_metrics({"child": 1.0}, step=1_000_000 + step)
    logger.log_hyperparams({"child": True})
    flushed = logger.flush(timeout=1)
    logger.finish(exit_code=0)
    queue.put((handler.messages, flushed))


def _child_with_its_own_logger(log_dir: str, queue: Any) -> None:
    gauge = metrics.get_meter("forked_lib").create_gauge("forked_lib.depth")
    with Logger({"log_dir": log_dir}) as logger:
        for step in range(3):
            gauge.set(float(step * 10))
            logger.log_metrics({"child_loss": float(step)}, step=step)
    queue.put("done")


def _join_all(children: list[Any]) -> list[Any]:
    deadline = time.monotonic() + TIMEOUT
    for child in children:
        child.join(max(0.1, deadline - time.monotonic()))
    hung = [c for c in children if c.is_alive()]
    for child in hung:
        child.kill()
        child.join(5)
    return hung


@pytest.mark.skipif(not FORK, reason="no fork start method on this platform")
def test_fork_children_while_a_thread_logs_never_hang_nor_touch_the_parents_run(log_dir):
    ctx = multiprocessing.get_context("fork")
    logger = Logger({"log_dir": str(log_dir)})
    stop = threading.Event()
    logged = []

    def spin() -> None:  # holds Logger._lock a good part of the time: the fork may copy it held
        step = 0
        while not stop.is_set():
            logger.log_metrics({"parent": float(step)}, step=step)
            logged.append(step)
            step += 1

    thread = threading.Thread(target=spin)
    thread.start()
    queue = ctx.Queue()
    try:
        children = []
        for _ in range(10):
            while len(logged) < 50 * (len(children) + 1):
                time.sleep(0.001)
            child = ctx.Process(target=_child_uses_the_inherited_logger, args=(logger, queue))
            child.start()
            children.append(child)
        hung = _join_all(children)
    finally:
        stop.set()
        thread.join()
    assert not hung, f"{len(hung)} of 10 fork children hung"
    assert [c.exitcode for c in children] == [0] * 10
    for _ in children:
        messages, flushed = queue.get(timeout=10)
        assert flushed is False
        assert len(messages) == 1, messages  # one clear message, however much is logged
        assert "Create a new Logger in the child" in messages[0]
    assert all("exit_code" not in m for m in _metas(log_dir))  # no child closed the run
    logger.finish(exit_code=5)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(len(logged)))
    assert all(r["metrics"] == {"parent": float(r["step"])} for r in rows)  # nothing of a child
    assert [m["exit_code"] for m in _metas(log_dir)] == [5]


class _StreamWithALock:
    """Each write holds a plain lock for a while, as a buffered file's write holds its internal
    lock: a fork child inherits such a lock as it was at the fork, and nothing releases it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.writing = threading.Event()
        self.text: list[str] = []

    def write(self, text: str) -> int:
        with self._lock:
            self.writing.set()
            time.sleep(0.3)
            self.text.append(text)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            pass


class _Unreachable:
    name = "unreachable"

    def write_step(self, step, rows, batch):
        raise ConnectionError("tracker down")


def _child_writes_to(stream: _StreamWithALock, queue: Any) -> None:
    stream.write("the child's own line\n")
    queue.put("".join(stream.text))


@pytest.mark.skipif(not FORK, reason="no fork start method on this platform")
@pytest.mark.parametrize("writer", ["a tracker's warning", "the console tracker", "verl's console"])
def test_a_fork_while_otel_rl_writes_to_a_shared_stream_waits_for_the_write(tmp_path, writer):
    """A child forked while a background thread of otel-rl writes a line to a stream the process
    shares (a log handler's, the console's) must not inherit that stream's lock held."""
    from otel_rl.compat.verl_exporters import VerlConsoleExporter
    from otel_rl.exporters import TrackerExporter
    from otel_rl.exporters.console import ConsoleExporter

    ctx = multiprocessing.get_context("fork")
    stream = _StreamWithALock()
    handler = logging.StreamHandler(stream)  # type: ignore[arg-type]
    cfg = {"log_dir": str(tmp_path), "export": {"shutdown_timeout": 1}}
    if writer == "the console tracker":
        exporters, expected = [ConsoleExporter(stream=stream)], "step 0"  # type: ignore[arg-type]
    elif writer == "verl's console":
        exporters, expected = [VerlConsoleExporter(stream=stream)], "step:0 - loss:1.0"
    else:
        unreachable = type("Unreachable", (_Unreachable, TrackerExporter), {})
        exporters, expected = [unreachable()], "unreachable: write failed"
        logging.getLogger("otel_rl").addHandler(handler)
    queue = ctx.Queue()
    try:
        with Logger(cfg, exporters=exporters) as logger:
            logger.log_metrics({"loss": 1.0}, step=0)
            logger.log_metrics({"loss": 2.0}, step=1)  # step 0 is complete: off it goes
            assert stream.writing.wait(10), "no background write began"
            child = ctx.Process(target=_child_writes_to, args=(stream, queue))
            child.start()  # while the background thread is inside its write
            assert not _join_all([child]), "the fork child hung on the stream's inherited lock"
            seen_by_child = queue.get(timeout=10)
    finally:
        logging.getLogger("otel_rl").removeHandler(handler)
    assert child.exitcode == 0
    assert expected in seen_by_child  # the fork waited for the parent's line to be written
    assert seen_by_child.endswith("the child's own line\n")


@pytest.mark.skipif(not FORK, reason="no fork start method on this platform")
def test_forks_from_two_threads_at_once_never_leave_the_write_guard_held(monkeypatch):
    """Thread A forks and holds the write guard; thread B forks meanwhile and gives up waiting
    for it (``FORK_WAIT_S`` 0). A must still release the guard after its fork, or every later
    log line of otel-rl hangs. To stop A inside its fork, the test holds the logging module's
    own lock, which logging's fork hook takes after otel-rl's (a private name of ``logging``:
    nothing public pauses a fork half-way)."""
    from otel_rl.process import fork_safe_log

    monkeypatch.setattr(fork_safe_log, "FORK_WAIT_S", 0.0)

    checked = threading.Event()

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        checked.wait(TIMEOUT)  # alive till the check: a new thread could reuse its identity

    forks = [threading.Thread(target=fork) for _ in range(2)]
    with logging._lock:  # type: ignore[attr-defined]
        forks[0].start()
        deadline = time.monotonic() + 10
        while fork_safe_log._writing.acquire(blocking=False):  # until A holds the guard
            fork_safe_log._writing.release()
            assert time.monotonic() < deadline, "the first fork never took the guard"
            time.sleep(0.001)
        forks[1].start()
        time.sleep(0.3)  # lets B reach the guard and give up (if not, the test proves less)
    written = threading.Event()

    def warn() -> None:
        fork_safe_log.log.warning("after the forks")
        written.set()

    threading.Thread(target=warn, daemon=True).start()
    try:
        assert written.wait(5), "a fork left the write guard held: otel-rl's log lines now hang"
    finally:
        checked.set()
        for thread in forks:
            thread.join(TIMEOUT)


@pytest.mark.skipif(not FORK, reason="no fork start method on this platform")
def test_a_new_logger_in_a_fork_child_works_normally(tmp_path):
    ctx = multiprocessing.get_context("fork")
    parent_dir, child_dir = tmp_path / "parent", tmp_path / "child"
    queue = ctx.Queue()
    with Logger({"log_dir": str(parent_dir)}) as logger:
        logger.log_metrics({"loss": 1.0}, step=0)
        child = ctx.Process(target=_child_with_its_own_logger, args=(str(child_dir), queue))
        child.start()
        assert not _join_all([child])
        assert child.exitcode == 0
        assert queue.get(timeout=10) == "done"
        logger.log_metrics({"loss": 2.0}, step=1)
    rows = jsonl_rows(child_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (s, {"child_loss": float(s), "forked_lib.depth": float(s * 10)}) for s in range(3)
    ]
    assert [m["exit_code"] for m in _metas(child_dir)] == [0]
    parent_rows = jsonl_rows(parent_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in parent_rows] == [(0, {"loss": 1.0}),
                                                                (1, {"loss": 2.0})]


def test_an_os_fork_child_that_exits_normally_leaves_the_parents_spool_alone(log_dir):
    """A plain ``os.fork`` child runs ``atexit`` when it exits: it must not finish the parent's
    run (no meta.json with exit code 0, no "in the spool" message, no row of its own)."""
    result = _run(
        """
        import glob, json, os, sys
        from otel_rl import Logger
        log_dir = sys.argv[1]
        logger = Logger({"log_dir": log_dir})
        for step in range(5):
            logger.log_metrics({"loss": float(step)}, step=step)
        pid = os.fork()
        if pid == 0:
            logger.log_metrics({"child": 1.0}, step=100)
            logger.log_metrics({"child": 2.0}, step=101)
            sys.exit(0)  # a normal exit: atexit handlers run in the child
        _, status = os.waitpid(pid, 0)
        metas = [json.load(open(p)) for p in glob.glob(log_dir + "/.otel-rl/spool/*/*/meta.json")]
        print(json.dumps({"child": os.waitstatus_to_exitcode(status), "metas": metas}))
        logger.log_metrics({"loss": 5.0}, step=5)
        sys.exit(4)
        """,
        str(log_dir),
    )
    assert result.returncode == 4, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["child"] == 0
    assert [("exit_code" in m) for m in seen["metas"]] == [False]
    assert result.stderr.count("Create a new Logger in the child") == 1, result.stderr
    assert "in the spool" not in result.stderr, result.stderr
    assert "not delivered" not in result.stderr, result.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [(s, {"loss": float(s)}) for s in range(6)]
    assert [m["exit_code"] for m in _metas(log_dir)] == [4]


# ---- routing -----------------------------------------------------------------------------------


def test_global_meters_go_back_to_the_older_live_logger(tmp_path):
    meter = metrics.get_meter("routing_lib")
    gauge = meter.create_gauge("routing_lib.depth")
    counter = meter.create_counter("routing_lib.calls")
    older = Logger({"log_dir": str(tmp_path / "older")})
    newer = Logger({"log_dir": str(tmp_path / "newer")})
    gauge.set(1.0)
    counter.add(1)
    newer.log_metrics({"x": 1.0}, step=0)
    newer.finish()  # the older Logger is still live: library meters go back to it
    gauge.set(2.0)
    counter.add(2)
    older.log_metrics({"x": 2.0}, step=0)
    older.finish()  # none live: measurements are dropped, never an error
    gauge.set(3.0)
    counter.add(3)
    with Logger({"log_dir": str(tmp_path / "third")}) as third:
        gauge.set(4.0)
        third.log_metrics({"x": 4.0}, step=0)
    rows = {
        name: jsonl_rows(tmp_path / name / "metrics.jsonl") for name in ("older", "newer", "third")
    }
    assert rows["newer"][0]["metrics"] == {"x": 1.0, "routing_lib.depth": 1.0,
                                           "routing_lib.calls": 1.0}
    assert rows["older"][0]["metrics"] == {"x": 2.0, "routing_lib.depth": 2.0,
                                           "routing_lib.calls": 2.0}
    assert rows["third"][0]["metrics"] == {"x": 4.0, "routing_lib.depth": 4.0}


def test_finishing_the_older_logger_keeps_routing_on_the_newer(tmp_path):
    gauge = metrics.get_meter("routing_lib2").create_gauge("routing_lib2.depth")
    older = Logger({"log_dir": str(tmp_path / "older")})
    newer = Logger({"log_dir": str(tmp_path / "newer")})
    older.finish()
    gauge.set(7.0)
    newer.log_metrics({"x": 1.0}, step=0)
    newer.finish()
    rows = jsonl_rows(tmp_path / "newer" / "metrics.jsonl")
    assert rows[0]["metrics"] == {"x": 1.0, "routing_lib2.depth": 7.0}
    older_file = tmp_path / "older" / "metrics.jsonl"
    assert not older_file.exists() or jsonl_rows(older_file) == []


@pytest.mark.skipif(not FORK, reason="no fork start method on this platform")
def test_a_fork_child_sends_nothing_of_the_parent_s_run_over_otlp(log_dir):
    """The SDK starts its readers' and span processors' threads again in a fork child, holding
    the parent's measurements and spans: the parent's run is the parent's to send, and its
    collector must see it once (a child that warned of the parent's collector being down also
    broke the rule of one message per child). The training process is an interpreter of its
    own: its child runs the ``atexit`` functions of an interpreter's exit, which in a fork of
    the test process would run the test process's (W&B's among them, which removes its media
    folder)."""
    from testkit.otlp_receiver import OtlpHttpReceiver

    receiver = OtlpHttpReceiver()
    try:
        script = textwrap.dedent("""
            import atexit, multiprocessing, sys, time
            from otel_rl import Logger

            def child_lives_then_exits():
                time.sleep(1.5)  # several export intervals of the parent's readers
                atexit._run_exitfuncs()  # an interpreter's exit, which multiprocessing skips

            if __name__ == "__main__":
                logger = Logger({
                    "log_dir": sys.argv[1],
                    "otlp": {"enabled": True, "endpoint": sys.argv[2], "interval": 0.2},
                    "tracing": {"enabled": True},
                })
                with logger.timer("generation"):
                    logger.log_metrics({"parent": 1.0}, step=0)
                child = multiprocessing.get_context("fork").Process(target=child_lives_then_exits)
                child.start()
                logger.finish()
                print("finished", flush=True)
                sys.stdin.readline()  # the test has counted what the parent sent
                child.join(60)
                print("child", child.exitcode, flush=True)
            """)  # fmt: skip
        process = subprocess.Popen(
            [sys.executable, "-c", script, str(log_dir), receiver.endpoint],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None and process.stdin is not None
        assert process.stdout.readline() == "finished\n"
        sent = (len(receiver.received), len(receiver.spans))
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.stdout.readline() == "child 0\n"
        assert process.wait(TIMEOUT) == 0
        time.sleep(0.3)  # a late request would have arrived
        assert (len(receiver.received), len(receiver.spans)) == sent
        assert sent[0] >= 1 and sent[1] >= 1  # the parent's own exports arrived
    finally:
        receiver.close()
