"""``otel-rl replay`` delivers the trackers side by side: a slow tracker holds back no other.

Three trackers of one run left their records in the spool: ``quick`` writes at once, ``drip``
is slow (its first write waits until ``quick`` holds every step, as a slow server would still be
busy with its first requests), and ``broken`` cannot open (a permanent error). They are plain
trackers registered by entry point, as a third party's are, each writing one line per step with
the time it wrote it; the spools are real spools, the replay the command's own function.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from otel_rl.cli.replay import run
from otel_rl.core.records import StepBatch
from otel_rl.delivery.spool import Spool, spool_root

STEPS = 40
PACKAGE = "otel_rl_side_by_side_trackers"
MODULE = '''
import json
import time

from otel_rl.exporters import Tracker


def held(path):
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


class Quick(Tracker):
    name = "quick"
    max_batch = 8

    def __init__(self, path):
        self.path = path

    def write_step(self, step, rows, batch):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "at": time.monotonic_ns()}) + "\\n")


class Drip(Tracker):
    """Slow: its first write waits until ``waits_for`` holds ``steps`` lines (at most
    ``patience`` seconds, so that a replay that delivers one tracker after another ends too)."""

    name = "drip"

    def __init__(self, path, waits_for, steps, patience=60.0):
        self.path, self.waits_for, self.steps, self.patience = path, waits_for, steps, patience
        self.waited = False

    def write_step(self, step, rows, batch):
        if not self.waited:
            self.waited = True
            deadline = time.monotonic() + self.patience
            while held(self.waits_for) < self.steps and time.monotonic() < deadline:
                time.sleep(0.01)
        line = {"step": step, "at": time.monotonic_ns(), "quick_held": held(self.waits_for)}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\\n")


class Broken(Tracker):
    name = "broken"

    def __init__(self, path):
        self.path = path

    def open(self):
        raise TypeError("broken: unknown option 'colour' (a typo in its settings)")

    def write_step(self, step, rows, batch):
        raise AssertionError("never opened, never written")
'''


@pytest.fixture
def trackers(tmp_path, monkeypatch):
    """The three trackers as pip lays out a package: the module and its entry points."""
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{PACKAGE}.py").write_text(textwrap.dedent(MODULE))
    info = site / "otel_rl_side_by_side_trackers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: otel-rl-side-by-side-trackers\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[otel_rl.exporters]\n"
        + "".join(f"{name} = {PACKAGE}:{name.title()}\n" for name in ("quick", "drip", "broken"))
    )
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop(PACKAGE, None)


def _backlog(log_dir: Path, options: dict[str, dict]) -> None:
    """Each tracker's spool holding steps 0..STEPS-1, none delivered, as a run killed while its
    trackers were down leaves it."""
    config = {"log_dir": str(log_dir), "jsonl_enabled": False, "run_id": "run1",
              "trackers": options}  # fmt: skip
    for tracker in options:
        spool = Spool(spool_root(log_dir) / tracker / "run1")
        try:
            spool.append([StepBatch(step=s, values={"loss": s / 8}, time=1.7e9 + s, seal=s)
                          for s in range(STEPS)])  # fmt: skip
            spool.write_meta({"tracker": tracker, "run_id": "run1", "log_dir": str(log_dir),
                              "cwd": str(log_dir), "config": config, "resume": {},
                              "exit_code": 0, "last_seq": spool.last_seq})  # fmt: skip
        finally:
            spool.close()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_slow_tracker_holds_back_no_other_and_a_broken_one_stops_only_itself(
    trackers, tmp_path, capsys
):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    quick, drip = log_dir / "quick.jsonl", log_dir / "drip.jsonl"
    _backlog(log_dir, {
        "broken": {"path": str(log_dir / "broken.jsonl")},
        "drip": {"path": str(drip), "waits_for": str(quick), "steps": STEPS},
        "quick": {"path": str(quick)},
    })  # fmt: skip

    assert run(log_dir, progress=False) == 1  # broken's records were not delivered
    out, err = capsys.readouterr()

    quick_lines, drip_lines = _lines(quick), _lines(drip)
    # Each tracker got every step once, in step order.
    assert [line["step"] for line in quick_lines] == list(range(STEPS))
    assert [line["step"] for line in drip_lines] == list(range(STEPS))
    # The fast one had landed every record before the slow one wrote its first: the slow one
    # saw them all, and every write of the fast one is older than every write of the slow one.
    assert [line["quick_held"] for line in drip_lines] == [STEPS] * STEPS
    assert max(line["at"] for line in quick_lines) < min(line["at"] for line in drip_lines)
    # The summary names each tracker, the one that failed with its cause.
    summary = {line.split()[0]: line for line in out.splitlines()}
    assert summary["quick"].endswith(f"{STEPS}/{STEPS} record(s) delivered")
    assert summary["drip"].endswith(f"{STEPS}/{STEPS} record(s) delivered")
    assert summary["broken"].endswith(f"0/{STEPS} record(s) delivered")
    assert "broken: " in err and "unknown option 'colour'" in err
    assert not (log_dir / "broken.jsonl").exists()

    # Marked done as they landed: a second replay sends nothing again.
    assert run(log_dir, progress=False) == 1
    out, _ = capsys.readouterr()
    summary = {line.split()[0]: line for line in out.splitlines()}
    assert summary["quick"].endswith("0/0 record(s) delivered")
    assert summary["drip"].endswith("0/0 record(s) delivered")
    assert _lines(quick) == quick_lines and _lines(drip) == drip_lines
