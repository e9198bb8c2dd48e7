"""A Ray cluster of two nodes on this machine: ``ray start --head`` and a second
``ray start --address … --resources …``, each a raylet of its own with its own node id.

The nodes run without Ray's token authentication (``RAY_AUTH_MODE=disabled``), which a
process joining them must share: :data:`CLIENT_ENV`.

The cluster keeps its files in a temporary directory of its own: ``ray start`` records its
address in its temp directory, and a ``ray.init()`` without an address elsewhere on the machine
(a parallel test's) would otherwise join it. Each ``ray start --block`` runs in a session of its
own and is stopped by signalling that session, so the cluster never touches another cluster of
the machine (``ray stop`` would stop them all). Every port is chosen free, so the two raylets'
agents do not collide on Ray's fixed defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testkit.servers import free_port

#: What a driver joining the cluster needs in its environment.
CLIENT_ENV = {"RAY_AUTH_MODE": "disabled"}

_PORT_OPTIONS = (
    "--node-manager-port", "--object-manager-port", "--metrics-export-port",
    "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port", "--runtime-env-agent-port",
)  # fmt: skip


@dataclass
class TwoNodes:
    address: str  # the GCS, for ray.init(address=…)
    dashboard: str
    #: The custom resource of each node: ``{"head_node": 1}`` places an actor on the head.
    resources: tuple[str, str] = ("head_node", "second_node")


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    ports = [str(part) for option in _PORT_OPTIONS for part in (option, free_port())]
    with log.open("ab") as out:
        return subprocess.Popen(["ray", "start", "--block", "--disable-usage-stats", *args,
                                 *ports], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)  # ray start --block stops its processes on it
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _wait_for_nodes(
    address: str,
    started: list[subprocess.Popen[bytes]],
    log: Path,
    env: dict[str, str],
    timeout: float = 180.0,
) -> None:
    count = len(started)
    deadline = time.monotonic() + timeout
    probe = ("import ray,sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(n['Alive'] for n in ray.nodes()))")  # fmt: skip
    while True:
        # A probe that hangs (a GCS still starting, on a loaded machine) is one more try, not
        # the end: only the whole wait is bounded.
        wait = min(max(deadline - time.monotonic(), 10.0), 60.0)
        try:
            done = subprocess.run([sys.executable, "-c", probe, address], capture_output=True,
                                  text=True, timeout=wait, env=env)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
            done = subprocess.CompletedProcess(exc.cmd, -1, "", said or "the probe hung")
        if done.returncode == 0 and done.stdout.strip().endswith(str(count)):
            return
        if time.monotonic() > deadline or any(p.poll() is not None for p in started):
            raise RuntimeError(f"{count} Ray nodes never joined {address}: {done.stderr[-2000:]}"
                               f"\n{log}:\n{log.read_text()[-2000:]}")  # fmt: skip
        time.sleep(1.0)


@contextlib.contextmanager
def two_node_cluster(workdir: Path, cpus_each: int = 4) -> Iterator[TwoNodes]:
    """Start the two nodes (the head with its dashboard, which may run py-spy through each
    node's agent) and stop them at exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "ray-start.log"
    # (tests/conftest.py keeps single-node clusters on loopback by declaring multi-node
    # clusters unsupported: these two nodes are one)
    env = {**os.environ, **CLIENT_ENV, "RAY_DASHBOARD_ENABLE_PROFILING": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # fmt: skip
    gcs, dashboard = free_port(), free_port()
    # short: Ray's socket paths under it must fit a Unix socket's 107 bytes
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    address = f"127.0.0.1:{gcs}"
    nodes = TwoNodes(address=address, dashboard=f"http://127.0.0.1:{dashboard}")
    started: list[subprocess.Popen[bytes]] = []
    try:
        started.append(_start(
            ["--head", "--temp-dir", temp_dir, "--node-ip-address", "127.0.0.1", "--port", str(gcs),
             "--num-cpus", str(cpus_each), "--resources", json.dumps({nodes.resources[0]: 8}),
             "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
             "--dashboard-port", str(dashboard), "--ray-client-server-port", str(free_port())],
            log, env,
        ))  # fmt: skip
        _wait_for_nodes(address, started, log, env)
        started.append(_start(
            ["--address", address, "--node-ip-address", "127.0.0.1",
             "--num-cpus", str(cpus_each), "--resources", json.dumps({nodes.resources[1]: 8})],
            log, env,
        ))  # fmt: skip
        _wait_for_nodes(address, started, log, env)
        yield nodes
    finally:
        for process in reversed(started):
            _stop(process)
        shutil.rmtree(temp_dir, ignore_errors=True)
