"""Leaving a run while a tracker is unreachable: the wait is export.shutdown_timeout, and the
final message names the tracker's last error, how to wait less, and how to deliver the rest.

The tracker is a real one over TCP: each step is sent to a loopback port nothing listens on, so
every write fails with the operating system's own "connection refused"."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, socket, sys
    from otel_rl import Logger
    from otel_rl.exporters import TrackerExporter

    PORT = int(sys.argv[2])

    class TcpTracker(TrackerExporter):
        name = "tcp-tracker"

        def write_step(self, step, rows, batch):
            with socket.create_connection(("127.0.0.1", PORT), timeout=2) as conn:
                conn.sendall(json.dumps({"step": step, "rows": rows}).encode())

    cfg = {"log_dir": sys.argv[1], "jsonl_enabled": False,
           "export": {"shutdown_timeout": 3, "retry_max_backoff": 0.2}}
    with Logger(cfg, exporters=[TcpTracker()]) as logger:
        for step in range(3):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    print("left the run")
    """
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_exit_with_an_unreachable_tracker_names_its_last_error_and_the_setting(tmp_path: Path):
    log_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log_dir), str(closed_port())],
        capture_output=True, text=True, timeout=25,  # the default wait alone would be 30 s
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "left the run"
    match = re.search(
        r"tcp-tracker: (\d+) record\(s\) not delivered before the shutdown timeout "
        r"\(export\.shutdown_timeout: 3 s; last error: ConnectionRefusedError: "
        r"\[Errno \d+\] Connection refused; raise export\.shutdown_timeout to deliver more "
        r"before exit, lower it to wait less\)\. They are in the spool \((?P<spool>[^)]+)\); "
        r"deliver them with: otel-rl replay (?P<log_dir>\S+)",
        done.stderr,
    )
    assert match, done.stderr
    assert int(match.group(1)) >= 1
    assert match.group("log_dir") == str(log_dir)
    assert Path(match.group("spool")).is_dir()
    assert Path(match.group("spool")).is_relative_to(log_dir)
