"""Shared fixtures."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path / "logs"


@pytest.fixture
def otel_rl_warnings(caplog):
    """Captured ``otel_rl`` log records at WARNING and above."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    return caplog
