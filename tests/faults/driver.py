"""Run one fault-injection iteration: start the training child, inject the planned faults, kill
it, replay (itself perhaps killed, then run again), read every tracker back and check.

The MLflow server, when used, is a real ``mlflow server`` (:mod:`testkit.servers`); "down" means
that server stopped while the child runs, then restarted on the same port and store before the
replay.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from otel_rl.delivery.spool import holder_of, spool_root
from otel_rl.run.replay import BUSY_EXIT_CODE
from tests.faults import delivered as readers
from tests.faults.fault_tracker import install_entry_point, set_mode
from tests.faults.invariant import Counts, Finding, check
from tests.faults.plan import DEFAULT_GRACE, OVERLOAD_SECONDS, ChildPlan, IterationPlan

REPO = Path(__file__).resolve().parents[2]
REPLAY_ATTEMPTS = 4


@dataclass
class Harness:
    """What every iteration of a run shares."""

    root: Path
    fsync_interval: float = 0.2
    shutdown_timeout: float = 1.0
    grace: float = DEFAULT_GRACE
    mlflow: Any = None  # testkit.servers.MlflowServer, restarted in place when planned down
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        site = install_entry_point(self.root / "site")
        path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
        self.env = {**os.environ, "PYTHONPATH": path, "MLFLOW_DISABLE_TELEMETRY": "true"}


@dataclass
class IterationResult:
    plan: IterationPlan
    findings: list[Finding]
    counts: dict[str, Counts]
    kills: int
    replay_kills: int
    what_happened: str
    #: Replays tried while the run lived that were refused (the spool was in use).
    refused_during_run: int = 0
    #: Steps whose spool lines were damaged (they may be lost, never doubled).
    damaged_steps: int = 0


class _ChildOutput:
    """Reads the child's side channel on a thread, so the parent kills on its own schedule."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.returned: dict[int, float] = {}
        self.ready = threading.Event()
        self.finishing = threading.Event()
        self.finished = threading.Event()
        self.marks: dict[str, float] = {}
        self._thread = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        events = {"R": self.ready, "F": self.finishing, "D": self.finished, "P": None}
        for line in stream:
            parts = line.split()
            if len(parts) != 2:
                continue
            tag, at = parts
            try:
                when = float(at)
                if tag in events:
                    self.marks[tag] = when
                    event = events[tag]
                    if event is not None:
                        event.set()
                else:
                    self.returned[int(tag)] = when
            except ValueError:
                continue  # a line cut by the kill
        self.ready.set()  # EOF: nobody waits forever on a child that died
        self.finishing.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def run_iteration(h: Harness, index: int, plan: IterationPlan) -> IterationResult:
    began = time.monotonic()
    work = h.root / f"it{index:04d}"
    work.mkdir(parents=True)
    log_dir, rows, control = work / "logs", work / "faultfile.jsonl", work / "control"
    findings: list[Finding] = []
    notes: list[str] = []
    kills = replay_kills = refused = 0

    initial = "ok"
    if plan.tracker_mode == "slow":
        initial = f"slow {plan.slow_delay}"
    elif plan.tracker_mode == "outage" and plan.outage_start == 0.0:
        initial = "raise"
    set_mode(control, initial)

    experiment = f"fault-{plan.seed.replace(':', '-')}"
    child_plan = ChildPlan(
        # Relative: the run starts in its work folder, the replay elsewhere (operator's seat).
        log_dir="logs" if plan.relative_paths else str(log_dir),
        seed=plan.seed,
        loop="paced" if plan.kill_point == "loop" else plan.kill_point,
        steps=plan.steps,
        long_steps=plan.long_steps,
        fsync_interval=h.fsync_interval,
        shutdown_timeout=h.shutdown_timeout,
        faultfile={"path": str(rows), "control": str(control)},
        delivery=plan.delivery,
        max_seconds=OVERLOAD_SECONDS if plan.kill_point == "overload" else 60.0,
        mlflow=(
            {"tracking_uri": h.mlflow.url, "experiment_name": experiment}
            if plan.mlflow
            else None
        ),
    )
    stderr_path = work / "child.stderr"
    with stderr_path.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.child", child_plan.to_json()],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
            cwd=work if plan.relative_paths else REPO, env=h.env,
        )
    out = _ChildOutput(child)
    timers: list[threading.Timer] = []
    stopper: threading.Thread | None = None
    try:
        if not out.ready.wait(60) or "R" not in out.marks:
            child.kill()
            child.wait(10)
            findings.append(Finding("child", "start", [], _tail(stderr_path)))
            return IterationResult(plan, findings, {}, 0, 0, "the child never became ready")
        if plan.tracker_mode == "outage":
            if plan.outage_start > 0:
                timers.append(threading.Timer(plan.outage_start, set_mode, (control, "raise")))
            if plan.outage_end is not None:
                timers.append(threading.Timer(plan.outage_end, set_mode, (control, "ok")))
        if plan.mlflow_down_at is not None:
            from testkit.servers import stop_mlflow_server

            stopper = threading.Timer(plan.mlflow_down_at, stop_mlflow_server, (h.mlflow,))
            timers.append(stopper)
        for timer in timers:
            timer.start()

        if plan.kill_point == "finish":
            out.finishing.wait(120)
        began_wait = time.monotonic()
        if plan.replay_during_run:
            time.sleep(plan.kill_delay / 2)
            code, text = _replay_under_the_run(h, log_dir, work)
            # A run that ended before the replay took its spools (its finish() can take less than
            # the replay's start on a loaded machine) left an ordinary replay, which may leave
            # records undelivered (exit 1) while the plan has the MLflow server stopped.
            allowed = (0, BUSY_EXIT_CODE) if child.poll() is None else (0, 1, BUSY_EXIT_CODE)
            if code not in allowed or "Traceback" in text:
                findings.append(Finding("replay", "during-run", [], f"exit {code}: {text[-600:]}"))
            refused += code == BUSY_EXIT_CODE
            notes.append(f"replay during the run: exit {code}")
        with contextlib.suppress(subprocess.TimeoutExpired):  # one that ended is not waited for
            child.wait(max(0.0, plan.kill_delay - (time.monotonic() - began_wait)))
        sig = getattr(signal, plan.signal)
        kill_at = time.monotonic()
        if child.poll() is None:
            os.kill(child.pid, sig)
            kills += 1
            where = "during finish()" if out.finishing.is_set() else "in the loop"
            last = max(out.returned, default=None)
            notes.append(f"{plan.signal} {where}, last returned step {last}")
        else:
            notes.append(f"the child had exited ({child.returncode}) before the kill")
        if sig != signal.SIGKILL:
            try:
                child.wait(h.shutdown_timeout + 15)
            except subprocess.TimeoutExpired:
                findings.append(Finding(
                    "child", "exit", [], f"still running {h.shutdown_timeout + 15:.0f}s after "
                    f"{plan.signal}: the signal was lost or the exit hung"))
                kill_at = time.monotonic()
                child.kill()
                kills += 1
        child.wait(30)
        out.join(30)
        notes.append(f"child exit {child.returncode}")
    finally:
        for timer in timers:
            timer.cancel()
        if child.poll() is None:
            child.kill()
            child.wait(30)

    if "P" in out.marks:  # stopped by the child, which was killed before it let it go on
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(out.marks["P"]), signal.SIGCONT)
    if plan.delivery == "process":
        # The delivery process outlives a killed training process: it delivers what the pipe
        # and its handoff files held, closes the run, then lets go of the spools (never later
        # than the timeout).
        held = _wait_spools_released(log_dir, h.shutdown_timeout + 15)
        if held:
            findings.append(Finding("delivery", "release", [], f"still held: {held}"))
        notes.append("the delivery process let go of the spools")

    # The outage ends (or the server comes back) before the replay.
    set_mode(control, "slow 0.003" if plan.replay_slow else "ok")
    if stopper is not None:
        stopper.join()
        if h.mlflow.process.poll() is not None:
            from testkit.servers import start_mlflow_server

            port = int(h.mlflow.url.rsplit(":", 1)[1])
            h.mlflow = start_mlflow_server(h.mlflow.workdir, port=port)

    damaged: dict[str, frozenset[int]] = {}
    if plan.corrupt:
        damaged[plan.corrupt] = damage_spool(log_dir, plan.corrupt, random.Random(plan.seed))
        notes.append(f"{plan.corrupt} spool damaged at steps {sorted(damaged[plan.corrupt])}")
    # From another folder, naming the log dir relatively when the run used relative paths.
    where = work / "elsewhere"
    where.mkdir()
    target = "../logs" if plan.relative_paths else str(log_dir)

    attempts: list[str] = []
    for attempt in range(REPLAY_ATTEMPTS):
        replay_out, replay_err = work / f"replay{attempt}.out", work / f"replay{attempt}.err"
        command = [sys.executable, "-m", "otel_rl.cli", "replay", target, "--no-progress",
                   "--timeout", "60"]  # fmt: skip
        with replay_out.open("wb") as o, replay_err.open("wb") as e:
            replay = subprocess.Popen(command, stdout=o, stderr=e, cwd=where, env=h.env)
        rival = None
        if attempt == 0 and plan.concurrent_replays:
            rival = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=where, env=h.env, text=True)  # fmt: skip
        if attempt == 0 and plan.replay_kill_signal:
            try:
                replay.wait(plan.replay_kill_delay)
            except subprocess.TimeoutExpired:
                replay.send_signal(getattr(signal, plan.replay_kill_signal))
                replay_kills += 1
                attempts.append(f"killed ({plan.replay_kill_signal})")
        try:
            code = replay.wait(180)
        except subprocess.TimeoutExpired:
            replay.kill()
            code = replay.wait(30)
            findings.append(Finding("replay", "hang", [], f"attempt {attempt + 1} ran for 180s"))
        if rival is not None:
            rival_text, _ = rival.communicate(timeout=240)
            attempts.append(f"rival exit {rival.returncode}")
            if rival.returncode not in (0, 1, BUSY_EXIT_CODE) or "Traceback" in rival_text:
                findings.append(Finding("replay", "rival", [], rival_text[-600:]))
        attempts.append(f"exit {code}")
        set_mode(control, "ok")
        if code == 0:
            break
    else:
        findings.append(Finding("replay", "converge", [],
                                f"{REPLAY_ATTEMPTS} attempts, none exited 0; last stderr: "
                                f"{_tail(replay_err, 800)}"))
    if any(where.iterdir()):
        findings.append(Finding("replay", "elsewhere", [],
                                f"wrote into its own working directory: {list(where.iterdir())}"))
    notes.append("replay " + ", ".join(attempts))

    cutoff = kill_at - h.fsync_interval - h.grace
    if kills == 0 and child.returncode == 0:
        cutoff = float("inf")  # no kill reached it: finish() ran, so every step must arrive
    got = [readers.jsonl(log_dir / "metrics.jsonl"), readers.tensorboard(log_dir / "tensorboard"),
           readers.faultfile(rows)]
    if plan.mlflow:
        got.append(readers.mlflow(h.mlflow.url, experiment))
    counts: dict[str, Counts] = {}
    for tracker in got:
        lost_ok = damaged.get(tracker.tracker, frozenset())
        found, counts[tracker.tracker] = check(tracker, out.returned, cutoff, lost_ok)
        findings.extend(found)
    notes.append(f"{time.monotonic() - began:.1f}s")
    return IterationResult(plan, findings, counts, kills, replay_kills, "; ".join(notes),
                           refused, sum(len(v) for v in damaged.values()))  # fmt: skip


def _wait_spools_released(log_dir: Path, timeout: float) -> list[str]:
    """The spools still held by someone after ``timeout`` seconds (none, normally)."""
    ends = time.monotonic() + timeout
    while True:
        held = [
            f"{lock.parent}: {holder}"
            for lock in spool_root(log_dir).glob("*/*/lock")
            if (holder := holder_of(lock.parent)) is not None
        ]
        if not held or time.monotonic() > ends:
            return held
        time.sleep(0.1)


def _replay_under_the_run(h: Harness, log_dir: Path, work: Path) -> tuple[int, str]:
    """A replay started while the training run lives: it must leave the run's spools alone. Its
    own deadline bounds it when the run has ended first and a tracker's server is stopped."""
    done = subprocess.run(
        [sys.executable, "-m", "otel_rl.cli", "replay", str(log_dir), "--no-progress",
         "--timeout", "30"],
        capture_output=True, text=True, cwd=work, env=h.env, timeout=180,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


GARBAGE = b"\x00\xff\xfe\x80 garbage \x00\xc3\x28" * 4


def damage_spool(log_dir: Path, tracker: str, rng: random.Random) -> frozenset[int]:
    """Overwrite a seeded run of bytes in one of ``tracker``'s spool segments; returns the steps
    whose sealed records sat in the lines it touched."""
    segments = sorted((log_dir / ".otel-rl" / "spool").glob(f"{tracker}/*/wal-*.jsonl"))
    segments = [p for p in segments if p.stat().st_size > 0]
    if not segments:
        return frozenset()
    segment = rng.choice(segments)
    data = bytearray(segment.read_bytes())
    size = rng.randint(1, len(GARBAGE))
    at = rng.randrange(max(1, len(data) - size))
    steps: set[int] = set()
    start = 0
    for raw in bytes(data).splitlines(keepends=True):
        end = start + len(raw)
        if start < at + size and at < end:
            try:
                record = json.loads(raw)
                if record.get("kind") == "step" and not record.get("provisional"):
                    steps.add(int(record["step"]))
            except ValueError:
                pass  # a torn last line: no record of its own
        start = end
    data[at : at + size] = GARBAGE[:size]
    segment.write_bytes(bytes(data))
    return frozenset(steps)


@dataclass
class RunSummary:
    seed: str
    iterations: int = 0
    kills: int = 0  # signals that reached a live training process
    replay_kills: int = 0  # signals that reached a live replay
    relative_paths: int = 0  # iterations replayed from another folder than the run's
    concurrent_replays: int = 0  # iterations whose first replay had a rival started with it
    replays_during_run: int = 0  # replays tried while the run lived ...
    refused_during_run: int = 0  # ... that left the spools alone (in use)
    damaged_spools: int = 0  # iterations with spool bytes overwritten before the replay
    damaged_steps: int = 0  # steps whose spool lines were damaged (may be lost, never doubled)
    delivery_process: int = 0  # iterations whose trackers ran in the delivery process
    delivery_paused: int = 0  # ... which was stopped for a while before a SIGKILL
    overloads: dict[str, int] = field(default_factory=dict)  # loops flat out, by delivery mode
    per_tracker: dict[str, Counts] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # one line per iteration

    def add(self, result: IterationResult) -> None:
        self.iterations += 1
        rows = ", ".join(
            f"{t} {c.expected_delivered}/{c.expected}+{c.delivered - c.expected_delivered}"
            f"{f' dup {c.duplicates}' if c.duplicates else ''}"
            for t, c in result.counts.items()
        )
        self.log.append(f"{result.plan.describe()} | {result.what_happened} | {rows}")
        self.kills += result.kills
        self.replay_kills += result.replay_kills
        plan = result.plan
        self.relative_paths += plan.relative_paths
        self.concurrent_replays += plan.concurrent_replays
        self.replays_during_run += plan.replay_during_run
        self.refused_during_run += result.refused_during_run
        self.damaged_spools += plan.corrupt is not None
        self.damaged_steps += result.damaged_steps
        self.delivery_process += plan.delivery == "process"
        self.delivery_paused += plan.pause_delivery is not None
        if plan.kill_point == "overload":
            self.overloads[plan.delivery] = self.overloads.get(plan.delivery, 0) + 1
        for tracker, counts in result.counts.items():
            self.per_tracker.setdefault(tracker, Counts())
            self.per_tracker[tracker] += counts
        for finding in result.findings:
            self.failures.append(
                f"[{result.plan.describe()}] {result.what_happened}: {finding}"
            )

    @property
    def total(self) -> Counts:
        total = Counts()
        for counts in self.per_tracker.values():
            total += counts
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "iterations": self.iterations,
            "kills_injected": self.kills + self.replay_kills,
            "training_kills": self.kills,
            "replay_kills": self.replay_kills,
            "relative_paths": self.relative_paths,
            "concurrent_replays": self.concurrent_replays,
            "replays_during_run": self.replays_during_run,
            "refused_during_run": self.refused_during_run,
            "damaged_spools": self.damaged_spools,
            "damaged_steps": self.damaged_steps,
            "delivery_process": self.delivery_process,
            "delivery_paused": self.delivery_paused,
            "overloads": self.overloads,
            "rows_expected": self.total.expected,
            "rows_delivered": self.total.delivered,
            "expected_rows_delivered": self.total.expected_delivered,
            "rows_missing": self.total.missing,
            "duplicates": self.total.duplicates,
            "per_tracker": {k: asdict(v) for k, v in self.per_tracker.items()},
            "failures": self.failures,
            "iterations_log": self.log,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))
