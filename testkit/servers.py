"""Real tracker servers on 127.0.0.1 for integration tests.

``mlflow_server`` is a session-scoped fixture: one ``mlflow server`` (full ``mlflow`` package,
from the test extra) with a SQLite backend and proxied artifacts in a temp directory. It takes
~7 s and ~500 MiB to start, so every MLflow test of the session shares it; tests keep apart by
creating their own experiments. Use it in a test module with
``mlflow_server = servers.mlflow_server``. Under ``pytest -n`` each worker is a session of its own,
with a server of its own (its port, its store under the worker's temp directory): no two
processes ever create or migrate the same store.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen
    workdir: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_mlflow_server(
    workdir: Path, timeout: float = 90.0, port: int | None = None
) -> MlflowServer:
    """Start ``mlflow server`` (on a free port unless given; its store in ``workdir``) and wait
    until ``/health`` answers. A port found free can be taken by another process in the seconds
    the server takes to bind it (tests run in parallel): then it starts again on another."""
    for attempt in range(3 if port is None else 1):
        try:
            return _start_mlflow_server(workdir, timeout, port or free_port())
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    pass


def _start_mlflow_server(workdir: Path, timeout: float, port: int) -> MlflowServer:
    pytest.importorskip("mlflow.server", reason="the MLflow server needs the full mlflow package")
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no job runner: starts in ~7 s
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    log = workdir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "mlflow", "server",
                "--host", "127.0.0.1",
                "--port", str(port),
                "--workers", "1",
                "--backend-store-uri", f"sqlite:///{(workdir / 'mlflow.db').as_posix()}",
                "--artifacts-destination", str(workdir / "artifacts"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,  # its own process group: the uvicorn worker goes with it
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", process, workdir, log)
    _guard(process.pid)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            text = server.log_text()
            error = _PortTaken if "address already in use" in text.lower() else RuntimeError
            raise error(f"mlflow server exited: {text[-3000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_mlflow_server(server)
            tail = server.log_text()[-3000:]
            raise RuntimeError(f"mlflow server not ready in {timeout}s: {tail}")
        time.sleep(0.2)


# Stops the server's process group once the test process is gone, also when pytest itself is
# killed (SIGKILL, a CI timeout) and never reaches the fixture's teardown.
_GUARD = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
parent, group = int(sys.argv[1]), int(sys.argv[2])
def alive(kill):
    try:
        kill()
        return True
    except ProcessLookupError:
        return False
while alive(lambda: os.killpg(group, 0)):
    if not alive(lambda: os.kill(parent, 0)) or os.getppid() != parent:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if alive(lambda: os.killpg(group, sig)):
                time.sleep(10)
        break
    time.sleep(1)
"""


def _guard(group: int) -> None:
    subprocess.Popen(
        [sys.executable, "-c", _GUARD, str(os.getpid()), str(group)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a signal to pytest's group must not stop it
    )


def stop_mlflow_server(server: MlflowServer) -> None:
    """Stop the server's process group (the CLI process and its uvicorn worker)."""
    if server.process.poll() is not None:
        return
    pgid = os.getpgid(server.process.pid)
    os.killpg(pgid, signal.SIGTERM)
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        server.process.wait(timeout=15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the worker may outlive the CLI process briefly
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)


_shared: MlflowServer | None = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server for the whole session, however many test modules import this fixture
    (pytest keeps one fixture instance per importing module; they all get the same server)."""
    global _shared
    if _shared is None or _shared.process.poll() is not None:
        _shared = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    server = _shared
    try:
        yield server
    finally:
        stop_mlflow_server(server)  # at session end; a no-op for the modules after the first
