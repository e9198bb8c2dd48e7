"""The counters an exporter held before they moved to its delivery: ``exporter.stats``,
``lost``, ``pending``, ``failure`` and ``undelivered`` still answer for one release, with the
delivery's own values, and say once (``DeprecationWarning``) where they went
(docs/backends/README.md)."""

from __future__ import annotations

import json
import warnings

import pytest

from otel_rl import Logger
from otel_rl.exporters import base
from otel_rl.exporters.jsonl import JsonlExporter

MOVED = ("stats", "lost", "pending", "failure", "undelivered")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each alias warns once per process: start from none warned yet."""
    monkeypatch.setattr(base, "_MOVED_WARNED", set())


def test_the_old_names_give_the_deliverys_numbers_after_real_writes_and_warn_once(
    tmp_path, fresh_warnings
):
    exporter = JsonlExporter(tmp_path / "given.jsonl")
    with Logger({"log_dir": str(tmp_path / "logs"), "jsonl_enabled": False},
                exporters=[exporter]) as logger:  # fmt: skip
        for step in range(3):
            logger.log_metrics({"loss": step / 2}, step=step)
    lines = [json.loads(line) for line in (tmp_path / "given.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "metrics" in row] == [0, 1, 2]
    delivery = exporter.delivery
    assert delivery.stats["delivered"] == 3

    for name in MOVED:
        with pytest.warns(DeprecationWarning) as caught:
            old = getattr(exporter, name)
        assert old == getattr(delivery, name), name
        (warning,) = caught
        message = str(warning.message)
        assert f"JsonlExporter.{name} is deprecated" in message
        assert f"exporter.delivery.{name}" in message
        assert warning.filename == __file__  # points at the caller's line
    assert exporter.stats is delivery.stats  # the same dict, not a copy
    assert exporter.lost == {} and exporter.pending == 0 and exporter.failure is None

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second read says nothing more
        for name in MOVED:
            assert getattr(exporter, name) == getattr(delivery, name)


def test_the_aliases_are_on_the_exporter_not_on_the_tracker_contract(tmp_path):
    from otel_rl.exporters import Tracker

    for name in MOVED:
        assert name not in vars(Tracker)
        assert isinstance(vars(base.TrackerExporter)[name], property)
        with pytest.raises(AttributeError):  # read-only, as the counters always were
            setattr(JsonlExporter(tmp_path / "unused.jsonl"), name, 0)
