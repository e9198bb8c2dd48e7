"""Shared fixtures."""

from __future__ import annotations

import logging
import os
import signal

import pytest

# Local Ray clusters in tests stay on loopback: by default Ray advertises the machine's interface
# address for a single-node cluster; with this (read when ray is imported) it uses 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# A shell started in the background without job control (``cmd &`` in a script) runs its
# children with SIGINT ignored, and an ignored disposition survives exec: every process the
# tests start to stop with SIGINT would then ignore it (and otel-rl rightly leaves an ignored
# signal alone). A Python handler is reset to the default at exec, so the children get it back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n``, tests are handed to the workers one at a time as each becomes free (unless
    ``--maxschedchunk`` says otherwise): pytest-xdist's default hands each worker a run of
    consecutive tests at the start, which gave one worker every ``long`` test, one after the
    other, while the others sat idle at the end."""
    if config.getoption("numprocesses", None) and config.getoption("maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n`` the tests marked ``long`` start first, then the other slow ones: pytest-xdist
    hands tests to its workers in this order, and a worker that drew a test of several minutes
    near the end would run it alone while the others wait. A plain run keeps the files' order
    (each module's fixtures set up once)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def start(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("long") else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=start)  # stable: the files' order within each class


@pytest.fixture(autouse=True)
def _clearml_leaves_no_process_state():
    """ClearML marks the process in its environment (``CLEARML_OFFLINE_MODE``, and
    ``CLEARML_PROC_MASTER_ID``: a child started later then takes itself for a subprocess of
    that task and gets a stand-in task). Each test starts from the environment it was given."""
    before = {k: v for k, v in os.environ.items() if k.startswith(("CLEARML_", "TRAINS_"))}
    yield
    for key in [k for k in os.environ if k.startswith(("CLEARML_", "TRAINS_"))]:
        if key not in before:
            del os.environ[key]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _each_test_starts_with_no_timer_open():
    """The process's phase clock (open timers, each path's recent durations) is the process's,
    as a training loop's is: a timer a test leaves open (a hang it provokes, a NeMo RL ``Timer``
    started and dropped) would otherwise be the next test's open phase and stall deadline."""
    yield
    from otel_rl.telemetry.timing import PROCESS_CLOCK

    PROCESS_CLOCK._threads.clear()
    if PROCESS_CLOCK._history is not None:
        PROCESS_CLOCK._history.clear()


@pytest.fixture(scope="module")
def ray_with_dashboard():
    """A local Ray cluster with its dashboard (the state API the stall report reads), for the
    tests of one module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path / "logs"


@pytest.fixture
def otel_rl_warnings(caplog):
    """Captured ``otel_rl`` log records at WARNING and above."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    return caplog


@pytest.fixture
def offline_trackers(monkeypatch, tmp_path):
    """W&B and SwanLab offline, their files and settings under ``tmp_path`` (no account, no
    network: read back with their own readers, testkit/tracker_readers.py)."""
    from testkit.tracker_readers import wandb_offline_env

    wandb_offline_env(monkeypatch, tmp_path)
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))
