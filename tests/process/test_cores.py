"""Background work keeps off the training thread's core (``otel_rl/process/cores.py``).

Real threads and a real delivery process; the cores each one may use are read back from the
kernel (``/proc/<pid>/task/<tid>/status``), not from otel-rl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.process.cores import current_core, keep_to, spare_cores, thread_cores
from testkit.readers import jsonl_rows

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not Path("/proc/thread-self/stat").exists(),
    reason="which core a thread runs on is read from Linux's /proc",
)


def allowed_cores(pid: int | str, tid: int | str) -> set[int]:
    """The cores the kernel lets thread ``tid`` of process ``pid`` use."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    listed = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in listed.split(":", 1)[1].strip().split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def in_thread(work):
    """``work()``'s result, run on a thread of its own (whose cores a test may change)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join(30)
    return result[0]


def test_a_thread_kept_to_one_core_is_told_that_core_and_has_none_to_spare():
    for core in sorted(os.sched_getaffinity(0))[:2]:

        def pinned(core=core):
            keep_to({core})
            here = allowed_cores(os.getpid(), threading.get_native_id())
            return current_core(), spare_cores(), here

        assert in_thread(pinned) == (core, None, {core})


def test_background_threads_get_the_spare_cores_only_where_two_or_more_are_spare():
    assert thread_cores(None) is None
    assert thread_cores(frozenset({3})) is None
    assert thread_cores(frozenset({0, 2})) == {0, 2}


def test_the_spare_cores_are_the_allowed_ones_but_the_callers():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one core allowed: nothing to spare")
    spare = spare_cores()
    assert spare is not None and spare < allowed and len(allowed - spare) == 1


def test_the_delivery_process_and_its_threads_keep_off_the_training_threads_core(tmp_path):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one core allowed: nothing to spare")
    logger = Logger({
        "log_dir": str(tmp_path), "jsonl_enabled": True,
        "export": {"delivery": "process", "fsync_interval": 0.1},
    })  # fmt: skip
    try:
        for step in range(50):
            logger.log_metrics({"loss": 1.0 / (step + 1), "reward": float(step)}, step=step)
        assert logger.flush(30)
        child = logger.exporters[0].link.process.pid
        child_threads = os.listdir(f"/proc/{child}/task")
        assert len(child_threads) > 1  # the trackers' threads, too
        kept = {frozenset(allowed_cores(child, tid)) for tid in child_threads}
        assert len(kept) == 1
        spare = set(kept.pop())
        assert spare < allowed and len(allowed - spare) == 1
        # This end's threads keep off it too where that leaves them two cores; with one spare
        # (a 2-core machine) they run anywhere: kept to one core, a thread holding the GIL
        # would wait there behind everything else.
        threads_on = spare if len(spare) >= 2 else allowed
        here = {t.name: t.native_id for t in threading.enumerate()}
        for name in ("otel-rl-delivery-pipe", "otel-rl-delivery-status"):
            assert allowed_cores(os.getpid(), here[name]) == threads_on, name
        # The training thread itself is left as it was.
        assert allowed_cores(os.getpid(), threading.get_native_id()) == allowed
    finally:
        logger.finish()
    rows = jsonl_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(50))
    assert [r["metrics"]["reward"] for r in rows] == [float(s) for s in range(50)]
    assert rows[9]["metrics"]["loss"] == pytest.approx(0.1)


def test_with_one_core_allowed_the_delivery_process_shares_it_and_delivers_every_step(tmp_path):
    core = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import json, os, sys
        os.sched_setaffinity(0, {{{core}}})
        from otel_rl import Logger
        logger = Logger({{"log_dir": sys.argv[1], "jsonl_enabled": True,
                         "export": {{"delivery": "process", "fsync_interval": 0.1}}}})
        for step in range(30):
            logger.log_metrics({{"reward": step * 2.0}}, step=step)
        assert logger.flush(30)
        child = logger.exporters[0].link.process.pid
        status = [open(f"/proc/{{child}}/task/{{t}}/status").read()
                  for t in os.listdir(f"/proc/{{child}}/task")]
        print(json.dumps(sorted({{line.split(":")[1].strip() for s in status
                                  for line in s.splitlines()
                                  if line.startswith("Cpus_allowed_list")}})))
        logger.finish()
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [str(core)]
    rows = jsonl_rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["reward"]) for r in rows] == [(s, s * 2.0) for s in range(30)]
