"""Phase deadlines: a timer path that stays open, with no step logged, for longer than
``max(stalls.phase_after, stalls.factor x p95 of its last 20 uses)`` is a stall, reported then
rather than after the step-level threshold.

Real Loggers and real timers throughout; the phases' durations come from the process's phase
clock. That clock keeps each path's history for the whole process, so each test here times paths
of its own name (a test's ``generation`` would otherwise lend its durations to the next), and the
one that must use ``generation`` with the default config runs in a fresh interpreter.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.watch.stalls import p95, phase_deadline
from testkit.readers import jsonl_rows


def _fresh(name: str) -> str:
    """A timer name no other test of this process has used."""
    return f"{name}_{uuid.uuid4().hex[:8]}"


def _reports(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "stalls").glob("*.json"))


def _hang_until_reported(logger: Logger, name: str, log_dir: Path, limit: float) -> float:
    """Open ``name`` and stay inside it until a stall report exists; the seconds that took."""
    with logger.timer(name):
        began = time.monotonic()
        while not _reports(log_dir):
            assert time.monotonic() - began < limit, f"no stall report within {limit} s"
            time.sleep(0.01)
        return time.monotonic() - began


def _reason(log_dir: Path) -> dict:
    (report,) = _reports(log_dir)
    return json.loads(report.read_text())


def test_a_phase_that_hangs_is_reported_at_its_deadline_not_the_steps(log_dir):
    """``generation`` took ~0.05 s three times, then hangs: with ``phase_after`` 0.5 s it is a
    stall 0.5 s after it opened (the step-level threshold is the default 600 s), and the report
    says which phase, on which thread, and the numbers of its deadline."""
    name = _fresh("generation")
    cfg = {"log_dir": str(log_dir), "stalls": {"phase_after": 0.5, "factor": 2}}
    with Logger(cfg) as logger:
        for step in range(3):
            with logger.timer(name):
                time.sleep(0.05)
            logger.log_metrics({"loss": 1.0}, step=step)
        waited = _hang_until_reported(logger, name, log_dir, limit=10)
        logger.log_metrics({"loss": 0.5}, step=3)
    assert 0.5 <= waited < 1.5
    report = _reason(log_dir)
    assert report["last_step"] == 2
    assert report["threshold_seconds"] == 0.5  # max(0.5 s, 2 x ~0.05 s)
    assert re.fullmatch(
        rf"phase {name} \(MainThread\) open 0\.[5-9] s without a step: its deadline "
        r"max\(phase_after 0\.5 s, factor 2 x p95 0\.05\d* s of its last 3 uses\)",
        report["threshold"],
    ), report["threshold"]
    assert report["ended"]["seconds"] >= 0.5
    events = jsonl_rows(log_dir / "events.jsonl")
    assert [(e["event"], e["step"], e["level"]) for e in events] == [
        ("otel_rl/stall", 2, "warning"), ("otel_rl/stall", 3, "info"),
    ]  # fmt: skip


def test_a_phase_slower_by_nature_gets_factor_times_its_p95(log_dir):
    """A phase whose uses took ~0.2 s, with ``factor`` 5: its deadline is ~1 s, not
    ``phase_after`` (0.3 s)."""
    name = _fresh("rollout")
    cfg = {"log_dir": str(log_dir), "stalls": {"phase_after": 0.3, "factor": 5}}
    with Logger(cfg) as logger:
        took = []
        for step in range(4):
            with logger.timer(name):
                began = time.monotonic()
                time.sleep(0.2)
            took.append(time.monotonic() - began)
            logger.log_metrics({"loss": 1.0}, step=step)
        waited = _hang_until_reported(logger, name, log_dir, limit=10)
        logger.log_metrics({"loss": 0.5}, step=4)
    deadline = _reason(log_dir)["threshold_seconds"]
    assert deadline == pytest.approx(5 * p95(took), rel=0.05)
    assert 0.95 <= deadline <= 1.3
    assert deadline <= waited < deadline + 1
    assert "factor 5 x p95 0.2" in _reason(log_dir)["threshold"]


def test_a_nested_phase_is_named_by_its_path_and_watched_by_its_own_history(log_dir):
    """``step`` (~0.27 s a use: deadline 2 x its p95) wraps ``step/generation`` (~0.02 s:
    deadline ``phase_after`` 0.4 s). The run hangs inside generation at once: its own deadline
    passes first, and the report names ``step/generation``."""
    outer, inner = _fresh("step"), _fresh("generation")
    cfg = {"log_dir": str(log_dir), "stalls": {"phase_after": 0.4, "factor": 2}}
    with Logger(cfg) as logger:
        for step in range(3):
            with logger.timer(outer):
                time.sleep(0.25)
                with logger.timer(inner):
                    time.sleep(0.02)
            logger.log_metrics({"loss": 1.0}, step=step)
        with logger.timer(outer):
            waited = _hang_until_reported(logger, inner, log_dir, limit=10)
        logger.log_metrics({"loss": 0.5}, step=3)
    assert 0.4 <= waited < 1.5
    report = _reason(log_dir)
    assert report["threshold"].startswith(f"phase {outer}/{inner} (MainThread) open 0.4 s ")
    assert report["threshold_seconds"] == 0.4


def test_the_drop_in_timers_have_deadlines_too(tmp_path):
    """verl's ``marked_timer`` nested in ``simple_timer``, and NeMo RL's ``Timer`` started and
    never stopped: each hang is named by its path once its deadline passes."""
    from otel_rl.compat.nemo_timer import Timer as NemoTimer
    from otel_rl.compat.verl_timing import marked_timer, simple_timer

    step, gen = _fresh("step"), _fresh("gen")
    cfg = {"stalls": {"phase_after": 0.3, "factor": 2}}
    verl_dir = tmp_path / "verl"
    with Logger({**cfg, "log_dir": str(verl_dir)}) as logger:
        timing_raw: dict[str, float] = {}
        for n in range(3):
            with simple_timer(step, timing_raw), marked_timer(gen, timing_raw, color="red"):
                time.sleep(0.02)
            logger.log_metrics({f"timing_s/{k}": v for k, v in timing_raw.items()}, step=n)
        with simple_timer(step, timing_raw), marked_timer(gen, timing_raw):
            began = time.monotonic()
            while not _reports(verl_dir):
                assert time.monotonic() - began < 10, "no stall report within 10 s"
                time.sleep(0.01)
        logger.log_metrics({"loss": 0.5}, step=3)
    assert _reason(verl_dir)["threshold"].startswith(f"phase {step}/{gen} (MainThread) open 0.3")

    label = _fresh("policy_training")
    nemo_dir = tmp_path / "nemo"
    with Logger({**cfg, "log_dir": str(nemo_dir)}) as logger:
        timer = NemoTimer()
        for n in range(3):
            with timer.time(label):
                time.sleep(0.02)
            logger.log_metrics({"loss": 1.0}, step=n)
        timer.start(label)
        began = time.monotonic()
        while not _reports(nemo_dir):
            assert time.monotonic() - began < 10, "no stall report within 10 s"
            time.sleep(0.01)
        timer.stop(label)
        logger.log_metrics({"loss": 0.5}, step=3)
    assert _reason(nemo_dir)["threshold"].startswith(f"phase {label} (MainThread) open 0.3")


def test_a_phase_on_a_thread_the_loop_waits_for_is_named_with_that_thread(log_dir):
    """The loop waits (no timer of its own) for a thread whose ``rollout`` took ~0.03 s three
    times and then hangs: the report names the phase and that thread."""
    name = _fresh("rollout")
    release = threading.Event()
    cfg = {"log_dir": str(log_dir), "stalls": {"phase_after": 0.3, "factor": 2}}
    with Logger(cfg) as logger:

        def rollouts() -> None:
            for _ in range(3):
                with logger.timer(name):
                    time.sleep(0.03)
            with logger.timer(name):
                release.wait(10)

        logger.log_metrics({"loss": 1.0}, step=0)
        worker = threading.Thread(target=rollouts, name="rollout-thread")
        worker.start()
        began = time.monotonic()
        while not _reports(log_dir) and time.monotonic() - began < 10:
            time.sleep(0.01)
        release.set()
        worker.join()
        logger.log_metrics({"loss": 0.5}, step=1)
    assert _reason(log_dir)["threshold"].startswith(f"phase {name} (rollout-thread) open 0.3")


def test_a_phase_never_completed_waits_for_the_step_level_threshold(log_dir):
    """A timer never completed before has no history: the step-level threshold (``after``)
    decides, however long past ``phase_after`` it stays open."""
    cfg = {"log_dir": str(log_dir), "stalls": {"after": 1.5, "factor": 1, "phase_after": 0.2}}
    with Logger(cfg) as logger:
        for step in range(3):
            logger.log_metrics({"loss": 1.0}, step=step)
        waited = _hang_until_reported(logger, _fresh("checkpoint"), log_dir, limit=10)
        logger.log_metrics({"loss": 0.5}, step=3)
    assert 1.4 <= waited < 2.5
    assert _reason(log_dir)["threshold"].startswith("max(after 1.5 s, factor 1 x median step")


def test_a_timer_around_the_logging_calls_is_not_stuck_while_steps_come(log_dir):
    """An outer timer that took 0.05 s once, then stays open for 1.5 s around steps logged every
    0.1 s: no step is missing, so no stall (the deadline counts from the last step logged)."""
    name = _fresh("epoch")
    cfg = {"log_dir": str(log_dir), "stalls": {"phase_after": 0.3, "factor": 2}}
    with Logger(cfg) as logger:
        with logger.timer(name):
            time.sleep(0.05)
        with logger.timer(name):
            for step in range(15):
                time.sleep(0.1)
                logger.log_metrics({"loss": 1.0}, step=step)
    assert not (log_dir / "stalls").exists()


def test_the_deadline_is_the_larger_of_phase_after_and_factor_times_the_p95():
    assert phase_deadline(30, 10, []) is None  # never completed: no deadline of its own
    assert phase_deadline(30, 10, [2.0, 2.1, 1.9]) == 30
    assert phase_deadline(30, 10, [5.0]) == 50
    assert p95([float(v) for v in range(1, 21)]) == pytest.approx(19.05)  # 19 + 5 % of the gap
    assert p95([3.0, 1.0, 2.0]) == pytest.approx(2.9)  # unordered in, nearest ranks 2 and 3


@pytest.mark.slow
def test_a_two_second_generation_that_hangs_is_reported_within_35_s(tmp_path):
    """The default config (only the log directory set), in a fresh interpreter: ``generation``
    takes ~2 s three times, then hangs. The report comes ~30 s (``phase_after``) after it
    opened, naming the phase, not after the step-level 600 s."""
    script = textwrap.dedent("""
        import json, sys, time
        from pathlib import Path
        from otel_rl import Logger

        log_dir = Path(sys.argv[1])
        logger = Logger({"log_dir": str(log_dir)})
        for step in range(3):
            with logger.timer("generation"):
                time.sleep(2)
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)

        def generate_and_never_return():
            with logger.timer("generation"):
                hung_at, began = time.time(), time.monotonic()
                while not list((log_dir / "stalls").glob("*.json")):
                    if time.monotonic() - began > 90:
                        break
                    time.sleep(0.05)
                return hung_at, time.monotonic() - began

        hung_at, seen_after = generate_and_never_return()
        logger.log_metrics({"loss": 0.1}, step=3)
        logger.finish()
        print(json.dumps({"hung_at": hung_at, "seen_after": seen_after}))
    """)
    log_dir = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-c", script, str(log_dir)], capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert 30 <= seen["seen_after"] <= 35, seen
    (report_path,) = _reports(log_dir)
    report = json.loads(report_path.read_text())
    stalled_at = datetime.datetime.fromisoformat(report["stalled_at"]).timestamp()
    assert 29 <= stalled_at - seen["hung_at"] <= 35  # the report's time, to the second
    assert report["last_step"] == 2
    assert report["threshold_seconds"] == 30
    assert report["threshold"].startswith("phase generation (MainThread) open 30.")
    assert "max(phase_after 30 s, factor 10 x p95 2" in report["threshold"]
    assert "of its last 3 uses" in report["threshold"]
    assert "stall ended" in report_path.with_suffix(".txt").read_text()
    warned = [ln for ln in done.stderr.splitlines() if "stalled" in ln]
    assert len(warned) == 1 and str(report_path.with_suffix(".txt")) in warned[0]
