"""Simulated Ray GPU nodes on 127.0.0.1: the 8 x H100 fixture with values varied per node.

:func:`simulated_node` gives each node its own numbers and :func:`render` writes them into the
fixture's own lines (every other line of the real exposition is kept), so a test knows the exact
values each node serves. :class:`NodeFarm` serves many nodes from one asyncio thread, each on its
own port, with failure modes: ``hang`` (accepts, never answers), ``malformed`` and ``refused``
(a port nobody listens on).
"""

from __future__ import annotations

import asyncio
import gzip
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
H100_FIXTURE = FIXTURES / "ray-2.60-8xh100-node.constructed.prom"
CPU_FIXTURE = FIXTURES / "ray-2.60-cpu-node.prom"

_LINE = re.compile(r"^(ray_node_[a-z_]+)\{(.*)\} (\S+)$")
_GPU_INDEX = re.compile(r'GpuIndex="(\d+)"')


@dataclass
class SimulatedGpu:
    utilization: float  # percent, -1 = NVML failure
    used_mib: float
    available_mib: float
    power_mw: float
    temperature_c: float
    device: str = "NVIDIA H100 80GB HBM3"


@dataclass
class SimulatedNode:
    ip: str
    mem_used: float
    mem_total: float
    cpu_util: float
    gpus: dict[int, SimulatedGpu] = field(default_factory=dict)


def simulated_node(k: int, gpus: int = 8) -> SimulatedNode:
    """Node ``k``'s values: distinct per node and per GPU, all exactly representable."""
    return SimulatedNode(
        ip=f"10.1.{k // 256}.{k % 256}",
        mem_used=float(100 * 2**30 + k * 2**20),
        mem_total=float(2048 * 2**30),
        cpu_util=float(k % 100) + 0.5,
        gpus={
            i: SimulatedGpu(
                utilization=float((k * 8 + i) % 100),
                used_mib=float(40_000 + k * 10 + i),
                available_mib=float(81_559 - (40_000 + k * 10 + i)),
                power_mw=float(300_000 + k * 1_000 + i * 10),
                temperature_c=float(40 + (k + i) % 40),
            )
            for i in range(gpus)
        },
    )


def render(node: SimulatedNode, template: str | None = None) -> str:
    """The fixture's exposition with ``node``'s values and ip put in."""
    template = template if template is not None else H100_FIXTURE.read_text()
    out = []
    for line in template.splitlines():
        match = _LINE.match(line)
        if match:
            name, labels, _value = match.groups()
            labels = re.sub(r'ip="[^"]*"', f'ip="{node.ip}"', labels)
            value = _value_for(node, name, labels)
            if value is not None:
                line = f"{name}{{{labels}}} {value!r}"
            else:
                line = f"{name}{{{labels}}} {_value}"
        out.append(line)
    return "\n".join(out) + "\n"


def _value_for(node: SimulatedNode, name: str, labels: str) -> float | None:
    node_values = {
        "ray_node_mem_used": node.mem_used,
        "ray_node_mem_total": node.mem_total,
        "ray_node_cpu_utilization": node.cpu_util,
    }
    if name in node_values:
        return node_values[name]
    index = _GPU_INDEX.search(labels)
    if index is None:
        return None
    gpu = node.gpus.get(int(index.group(1)))
    if gpu is None:
        return None
    return {
        "ray_node_gpus_utilization": gpu.utilization,
        "ray_node_gram_used": gpu.used_mib,
        "ray_node_gram_available": gpu.available_mib,
        "ray_node_gpu_power_milliwatts": gpu.power_mw,
        "ray_node_gpu_temperature_celsius": gpu.temperature_c,
    }.get(name)


def closed_port() -> int:
    """A port on 127.0.0.1 that refuses connections (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeFarm:
    """Many ``/metrics`` endpoints on 127.0.0.1, served by one asyncio thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[asyncio.base_events.Server] = []
        self.bodies: dict[int, str] = {}
        self.modes: dict[int, str] = {}
        self.requests: dict[int, int] = {}
        self.delays: dict[int, float] = {}
        self.gzip_served = 0

    def add(self, body: str = "", mode: str = "ok", delay: float = 0.0) -> str:
        """Serve ``body`` at a new port, answering after ``delay`` s; returns the URL.

        ``mode``: ok, hang, malformed, refused (may be changed later through :attr:`modes`).
        """
        if mode == "refused":
            return f"http://127.0.0.1:{closed_port()}/metrics"
        server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        port = server.sockets[0].getsockname()[1]
        self._servers.append(server)
        self.bodies[port] = body
        self.modes[port] = mode
        self.delays[port] = delay
        self.requests[port] = 0
        return f"http://127.0.0.1:{port}/metrics"

    def set_body(self, url: str, body: str) -> None:
        self.bodies[_port(url)] = body

    def set_mode(self, url: str, mode: str) -> None:
        self.modes[_port(url)] = mode

    def stop(self, url: str) -> None:
        """Close one endpoint (its node "dies": connections are refused from now on)."""
        port = _port(url)
        for server in list(self._servers):
            if server.sockets and server.sockets[0].getsockname()[1] == port:
                self._loop.call_soon_threadsafe(server.close)
                self._servers.remove(server)

    def close(self) -> None:
        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> NodeFarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _start(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests[port] = self.requests.get(port, 0) + 1
            mode = self.modes.get(port, "ok")
            if mode == "hang":
                await asyncio.sleep(30)
                return
            if self.delays.get(port):
                await asyncio.sleep(self.delays[port])
            body = self.bodies.get(port, "")
            if mode == "malformed":
                body = body[: len(body) // 2] + '\nray_node_gpus_utilization{GpuIndex="0" 12 ?\n'
            data = body.encode()
            extra = ""
            if b"gzip" in head.lower():
                data = gzip.compress(data)
                extra = "Content-Encoding: gzip\r\n"
                self.gzip_served += 1
            writer.write(
                (
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    f"{extra}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                ).encode()
                + data
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])
