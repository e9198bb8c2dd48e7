"""A third-party tracker found through entry points, as a user would install one.

The test writes a tiny package (an exporter class plus its ``pyproject.toml``), builds and
installs it with pip into a directory put on ``sys.path``, and then uses it by name: from a
Logger config (``otel_rl.exporters`` group) and as OTel's SDK would, with no arguments
(``opentelemetry_metrics_exporter`` group, configured by ``OTEL_RL_CONFIG``).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.config.loading import resolve_config
from otel_rl.delivery.registry import (
    available_exporters,
    builtin_trackers,
    enabled_backends,
    exporter_class,
)

PACKAGE = "otel_rl_jsonfile_tracker"

EXPORTER_SOURCE = '''
"""A tracker that appends each step's scalars to a JSON-lines file."""
import json

from otel_rl.exporters.base import TrackerExporter


class JsonFileTracker(TrackerExporter):
    name = "jsonfile"

    def __init__(self, path, tag="", **kwargs):
        self.path = path
        self.tag = tag
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        scalars = {k: v for k, v in rows.items() if type(v) is float}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "tag": self.tag, "rows": scalars}) + "\\n")

    def write_hyperparams(self, params):
        with open(self.path, "a") as f:
            f.write(json.dumps({"params": dict(params)}) + "\\n")
'''

PYPROJECT = f'''
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "otel-rl-jsonfile-tracker"
version = "0.0.1"

[tool.setuptools]
py-modules = ["{PACKAGE}"]

[project.entry-points."otel_rl.exporters"]
jsonfile = "{PACKAGE}:JsonFileTracker"

[project.entry-points.opentelemetry_metrics_exporter]
jsonfile = "otel_rl.run.sdk_exporters:jsonfile"
'''


@pytest.fixture(scope="module")
def installed_tracker(tmp_path_factory):
    """Build and install the package with pip; yield the directory it is installed in."""
    root = tmp_path_factory.mktemp("third-party")
    source, site = root / "src", root / "site"
    source.mkdir()
    (source / f"{PACKAGE}.py").write_text(textwrap.dedent(EXPORTER_SOURCE))
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(site), str(source)],
        check=True,
        capture_output=True,
    )
    assert list(site.glob("otel_rl_jsonfile_tracker-0.0.1.dist-info/entry_points.txt"))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(PACKAGE, None)
        importlib.invalidate_caches()


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_installed_tracker_is_found_and_used_by_name(installed_tracker, tmp_path, delivery):
    """Also by the delivery process, which imports what the training process can (the folder
    put on ``sys.path`` at run time here)."""
    assert available_exporters()["jsonfile"] == f"{PACKAGE}:JsonFileTracker"
    assert exporter_class("jsonfile").__module__ == PACKAGE

    out = tmp_path / "rows.jsonl"
    cfg = {"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False,
           "trackers": {"jsonfile": {"path": str(out), "tag": "run-a"}},
           "export": {"delivery": delivery}}
    with Logger(cfg) as logger:
        assert [e.name for e in logger.exporters] == ["jsonfile"]
        logger.log_hyperparams({"lr": 0.5})
        for step in range(3):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step, prefix="train")

    assert read_lines(out) == [
        {"params": {"lr": 0.5}},
        *({"step": s, "tag": "run-a", "rows": {"train/loss": 1.0 / (s + 1)}} for s in range(3)),
    ]


@pytest.mark.slow
def test_installed_tracker_gets_no_flag_of_its_own(installed_tracker):
    """The config's keys are the same wherever it runs: a third-party tracker is enabled by its
    ``trackers:`` entry, and ``<name>_enabled`` says so instead of being a key."""
    assert "jsonfile" in available_exporters() and "jsonfile" not in builtin_trackers()
    with pytest.raises(ConfigError) as raised:
        resolve_config({"jsonfile_enabled": True})
    assert str(raised.value) == (
        "unknown logger config key 'jsonfile_enabled': 'jsonfile' is a tracker of another "
        "package, enabled by its entry under 'trackers:' with its options, e.g. trackers: "
        "{jsonfile: {}} (only otel-rl's own trackers have <name>_enabled flags)"
    )
    cfg = resolve_config({"tensorboard_enabled": True, "trackers": {"jsonfile": {"path": "x"}}})
    assert "jsonfile_enabled" not in cfg
    assert enabled_backends(cfg) == ["tensorboard", "jsonl", "jsonfile"]


@pytest.mark.slow
def test_installed_tracker_as_an_otel_sdk_exporter(installed_tracker, tmp_path, monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    out = tmp_path / "sdk.jsonl"
    config = tmp_path / "otel-rl.yaml"
    config.write_text(f"trackers:\n  jsonfile:\n    path: {json.dumps(str(out))}\n")
    monkeypatch.setenv("OTEL_RL_CONFIG", str(config))
    monkeypatch.setenv("OTEL_RL_STEP_GAUGE", "train.step")

    (entry,) = entry_points(group="opentelemetry_metrics_exporter", name="jsonfile")
    exporter = entry.load()()  # what the SDK does for OTEL_METRICS_EXPORTER=jsonfile
    assert type(exporter).__name__ == "JsonFileTracker" and exporter.path == str(out)

    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("user_code")
    step_gauge, loss = meter.create_gauge("train.step"), meter.create_gauge("train.loss")
    for step in (10, 20):
        step_gauge.set(step)
        loss.set(step / 100)
        provider.force_flush()
    provider.shutdown()

    rows = read_lines(out)
    assert rows[:2] == [
        {"step": 10, "tag": "", "rows": {"train.step": 10.0, "train.loss": 0.1}},
        {"step": 20, "tag": "", "rows": {"train.step": 20.0, "train.loss": 0.2}},
    ]
    # The reader's final collection at shutdown repeats the gauges' last values at their step.
    assert all(row["step"] == 20 for row in rows[2:])
