"""Shared fixtures."""

from __future__ import annotations

import logging
import os

import pytest

# Local Ray clusters in tests stay on loopback: by default Ray advertises the machine's interface
# address for a single-node cluster; with this (read when ray is imported) it uses 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path / "logs"


@pytest.fixture
def otel_rl_warnings(caplog):
    """Captured ``otel_rl`` log records at WARNING and above."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    return caplog
