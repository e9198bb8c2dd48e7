"""The tracker contract: a tracker holds its verbs; the run builds the delivery around it.

A plain :class:`~otel_rl.exporters.Tracker` (no OTel exporter, no channel of its own) is given
to a Logger, or registered by an entry point (real package metadata on ``sys.path``, as pip
would install it) and enabled by config; its rows arrive at their steps and every counter is its
delivery's. The run speaks to trackers through one protocol: no type checks and no attribute
probes on trackers in the run or the fan-out.
"""

from __future__ import annotations

import ast
import json
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.core.records import StepBatch
from otel_rl.delivery.channel import Channel
from otel_rl.exporters import Tracker

ROOT = Path(__file__).resolve().parents[2]


class ListTracker(Tracker):
    """Keeps each step's rows; refuses a key named ``refused`` (its other values arrive)."""

    name = "listed"

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, Any]]] = []

    def write_step(self, step: int, rows: Mapping[str, Any], batch: StepBatch) -> None:
        if "refused" in rows:
            self._value_refused("metric", "refused", "the tracker takes no such key")
        self.steps.append((step, {k: v for k, v in rows.items() if k != "refused"}))


def test_a_plain_tracker_given_to_a_logger_gets_its_rows_and_its_delivery_the_counters(tmp_path):
    tracker = ListTracker()
    with Logger({"log_dir": str(tmp_path), "jsonl_enabled": False}, exporters=[tracker]) as lg:
        for step in range(3):
            lg.log_metrics({"loss": step / 2, "refused": 1.0}, step=step)
        (delivery,) = lg.exporters
    assert delivery.tracker is tracker and delivery.tracker_class is ListTracker
    assert tracker.steps == [(0, {"loss": 0.0}), (1, {"loss": 0.5}), (2, {"loss": 1.0})]
    # The counters are the delivery's: the tracker holds none of them.
    assert delivery.stats["delivered"] == delivery.stats["submitted"] == 3
    assert delivery.stats["refused_values"] == 3 and delivery.lost == {}
    assert not hasattr(tracker, "stats") and not hasattr(tracker, "submit")


def test_a_tracker_has_one_channel_whoever_asks_for_it():
    tracker = ListTracker()
    channel = Channel.of(tracker)
    assert Channel.of(tracker) is channel
    with pytest.raises(RuntimeError, match="delivered by a channel already"):
        Channel(tracker)


def test_what_is_not_a_tracker_is_refused_at_logger_naming_the_base_class(tmp_path):
    with pytest.raises(ConfigError, match=r"takes trackers.*subclass otel_rl.exporters.Tracker"):
        Logger({"log_dir": str(tmp_path)}, exporters=[object()])  # type: ignore[list-item]


PACKAGE = "otel_rl_listed_tracker"
MODULE = '''
import json
from otel_rl.exporters import Tracker


class FileTracker(Tracker):
    name = "filed"

    def __init__(self, path, tag=""):
        self.path, self.tag = path, tag

    def write_step(self, step, rows, batch):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "tag": self.tag, "rows": dict(rows)}) + "\\n")
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A tracker package as pip lays it out: the module, and its dist-info with the entry
    point, on ``sys.path``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{PACKAGE}.py").write_text(textwrap.dedent(MODULE))
    info = site / "otel_rl_listed_tracker-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otel-rl-listed-tracker\n"
                                   "Version: 0.1\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        f"[otel_rl.exporters]\nfiled = {PACKAGE}:FileTracker\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop(PACKAGE, None)


def test_a_plain_tracker_registered_by_entry_point_is_built_from_its_trackers_options(
    installed, tmp_path
):
    out = tmp_path / "filed.jsonl"
    cfg = {"log_dir": str(tmp_path / "logs"), "trackers": {"filed": {"path": str(out),
                                                                     "tag": "t"}}}  # fmt: skip
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 0.25}, step=4)
        logger.log_metrics({"loss": 0.125}, step=5)
        assert [d.name for d in logger.exporters] == ["jsonl", "filed"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step"], r["tag"], r["rows"]["loss"]) for r in lines] == [(4, "t", 0.25),
                                                                          (5, "t", 0.125)]


def test_a_plain_tracker_cannot_be_built_by_otels_sdk_and_says_what_it_needs(installed):
    from otel_rl.run.sdk_exporters import sdk_exporter_class

    with pytest.raises(ConfigError, match=r"OTEL_METRICS_EXPORTER=filed.*TrackerExporter"):
        sdk_exporter_class("filed")


#: The tracker contract's public members: the verbs, the class's declarations and its run. A
#: member added here is a deliberate change of the contract.
CONTRACT = {
    "name", "max_batch", "requires", "backwards_policy", "repeat_is_backwards", "from_config",
    "open", "write_step", "write_batches", "write_hyperparams", "write_plot", "write_table",
    "write_event", "write_page", "continue_run", "write_resume", "flush_backend", "write_position",
    "holds_since", "landed_since", "classify_error", "close", "redact_own_config",
    "resume_config",
}  # fmt: skip


def test_the_tracker_holds_only_its_verbs():
    members = {m for m in dir(Tracker) if not m.startswith("_")}
    members |= {m for m in Tracker.__annotations__ if not m.startswith("_")}
    assert members == CONTRACT


def _calls(paths: Sequence[Path]) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            called = node.func.id if isinstance(node, ast.Call) and isinstance(
                node.func, ast.Name) else None  # fmt: skip
            if called in ("hasattr", "getattr") or (
                called == "isinstance" and "ServiceTracker" in ast.unparse(node)
            ):
                found.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
            if isinstance(node, ast.Compare) and "ServiceTracker" in ast.unparse(node):
                found.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
    return found


def test_the_run_and_the_fanout_neither_check_types_nor_probe_trackers():
    paths = [*sorted((ROOT / "otel_rl" / "run").glob("*.py")),
             ROOT / "otel_rl" / "delivery" / "fanout.py"]  # fmt: skip
    assert _calls(paths) == []


def test_a_tracker_given_twice_is_one_delivery_and_gets_each_step_once(tmp_path):
    tracker = ListTracker()
    cfg = {"log_dir": str(tmp_path), "jsonl_enabled": False}
    with Logger(cfg, exporters=[tracker, tracker]) as logger:
        logger.log_metrics({"loss": 0.5}, step=1)
        assert len(logger.exporters) == 1
    assert tracker.steps == [(1, {"loss": 0.5})]


def test_in_process_mode_the_configs_trackers_are_there_and_those_given_stay_here(tmp_path):
    """docs/backends/README.md: a tracker of the delivery process has no ``tracker`` here (its
    class is known); a tracker given as an instance stays in this process with its own."""
    from otel_rl.exporters.jsonl import JsonlExporter

    given = ListTracker()
    cfg = {"log_dir": str(tmp_path), "export": {"delivery": "process"}}
    with Logger(cfg, exporters=[given]) as logger:
        logger.log_metrics({"loss": 0.5}, step=1)
        remote, local = logger.exporters
        assert (remote.name, remote.tracker, remote.tracker_class) == ("jsonl", None,
                                                                       JsonlExporter)
        assert local.tracker is given
    assert given.steps == [(1, {"loss": 0.5})]
    assert remote.stats["delivered"] == 1 and remote.undelivered == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(1, 0.5)]
