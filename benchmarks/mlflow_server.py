"""One local ``mlflow server`` (SQLite backend, 127.0.0.1) shared by the benchmarks of a run.

Starting it takes ~10 s, so the first benchmark that asks starts it and the others reuse it; it is
stopped when the process exits. :func:`start_in_background` lets the harness boot it while other
benchmarks run. The server is the test suite's (testkit/servers.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_server: Any = None


def shared_server_url() -> str:
    """The URL of the shared server, started on first use (waits for a start under way)."""
    global _server
    with _lock:
        if _server is None or _server.process.poll() is not None:
            from testkit.servers import start_mlflow_server, stop_mlflow_server

            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            workdir = Path(tempfile.mkdtemp(prefix="otel-rl-bench-mlflow-"))
            _server = start_mlflow_server(workdir)

            def stop(server: Any = _server) -> None:
                stop_mlflow_server(server)
                shutil.rmtree(workdir, ignore_errors=True)

            atexit.register(stop)
        return _server.url


def start_in_background() -> None:
    """Start the shared server on a thread; a later :func:`shared_server_url` waits for it."""

    def start() -> None:
        # A failure (or pytest's skip when mlflow's server is not installed) is reported by the
        # benchmark that needs the server, when it asks again.
        with contextlib.suppress(BaseException):
            shared_server_url()

    threading.Thread(target=start, name="mlflow-server-start", daemon=True).start()
