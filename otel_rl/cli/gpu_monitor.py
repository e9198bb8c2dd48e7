"""``otel-rl gpu-monitor``: the GPU bridge on its own (e.g. a sidecar on the head node).

It scrapes the Ray nodes (``--ray-address``) or the given endpoints, serves the ``ray.node.*``
gauges on Prometheus and/or pushes them over OTLP, and prints a live table of the latest values.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from otel_rl.ray.gpu_metrics import GIB

DESCRIPTION = (
    "Scrape the GPU and node metrics of a Ray cluster's nodes (--ray-address) or of given "
    "endpoints, serve them on Prometheus and/or push them over OTLP, and print a live table."
)

#: How long to wait for a TCP answer from an explicit Ray address before saying it is down
#: (ray.init itself retries an unreachable address for minutes).
CONNECT_TIMEOUT = 5.0

_NO_RAY_HINT = (
    "start one with: ray start --head, pass a running cluster's address "
    "(--ray-address HOST:6379), or scrape nodes directly with --endpoint http://HOST:PORT/metrics"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="join this Ray cluster (auto: the one running on this machine, or HOST:PORT) "
        "and scrape its alive nodes",
    )
    source.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="a node's metrics endpoint, http://host:port/metrics (repeatable)",
    )
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between rounds")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per node request")
    parser.add_argument(
        "--otlp",
        nargs="?",
        const="",
        default=None,
        metavar="ENDPOINT",
        help="push over OTLP (to ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT / localhost)",
    )
    parser.add_argument("--prometheus-port", type=int, default=None, help="serve /metrics here")
    parser.add_argument(
        "--prometheus-host", default="127.0.0.1", help="address to serve /metrics on"
    )
    parser.add_argument("--once", action="store_true", help="one round, print it, exit")


def run(args: argparse.Namespace) -> int:
    """Run the monitor until SIGTERM or Ctrl-C (or one round with ``--once``).

    A signal ends the watch loop; the Logger then stops the scraper, pushes the last values
    over OTLP and the last table is printed. Exit code: 0, 143 (SIGTERM), 130 (SIGINT), 2 when
    the Ray cluster cannot be joined, 1 when ``--once`` got no answer.
    """
    if args.ray_address:
        try:
            problem = join_ray(args.ray_address)
        except KeyboardInterrupt:
            print("otel-rl gpu-monitor: interrupted while joining the Ray cluster", file=sys.stderr)
            return 128 + signal.SIGINT
        if problem is not None:
            print(f"otel-rl gpu-monitor: {problem}", file=sys.stderr)
            return 2
    # Installed after ray.init, which sets its own SIGTERM handler (sys.exit), and before the
    # Logger, which then leaves them alone: the loop below is the only place that waits.
    stop = _StopOnSignal()
    try:
        return _monitor(args, stop)
    finally:
        stop.restore()


class _StopOnSignal:
    """SIGTERM and SIGINT end the watch loop, which waits on :meth:`wait`, instead of raising
    where the main thread happens to be (inside rich's rendering, or our own code, where the
    Logger's handler would hold the signal back for as long as the loop runs).

    The handler only writes a byte to a pipe: it runs on the main thread between two bytecodes,
    possibly while that thread holds a lock, so it must take none (``Event.set`` does).
    """

    def __init__(self) -> None:
        self.signum = 0
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        with contextlib.suppress(OSError):  # a full pipe: the loop is woken already
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; whether a signal asked to stop."""
        if not self.signum:
            select.select([self._read], [], [], timeout)
        return bool(self.signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        for fd in (self._read, self._write):
            os.close(fd)


def _monitor(args: argparse.Namespace, stop: _StopOnSignal) -> int:
    from otel_rl import Logger

    cfg: dict[str, Any] = {
        "jsonl_enabled": False,
        "monitor_gpus": True,
        "capture_global_meters": False,
        "role": "gpu-monitor",
        "gpu_monitoring": {
            "endpoints": list(args.endpoint or []),
            "collection_interval": args.interval,
            "flush_interval": args.interval,
            "timeout": args.timeout,
        },
    }
    if args.prometheus_port is not None:
        cfg["prometheus"] = {
            "enabled": True,
            "port": args.prometheus_port,
            "host": args.prometheus_host,
        }
    if args.otlp is not None:
        cfg["otlp"] = {"enabled": True, "endpoint": args.otlp or None}

    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=140)
    with Logger(cfg) as logger:
        scraper = logger.gpu_monitor.scraper
        if logger.prometheus_url:
            console.print(f"Prometheus: {logger.prometheus_url}")
        if args.once:
            deadline = time.monotonic() + args.timeout + 30
            while scraper.last is None and time.monotonic() < deadline:
                if stop.wait(0.02):
                    break
            console.print(render(scraper))
            if stop.signum:
                logger.finish(exit_code=stop.exit_code)
                return stop.exit_code
            # An answer is a node's page read: a round where every node failed is none.
            return 0 if scraper.last is not None and scraper.last.samples else 1
        from rich.live import Live

        with Live(render(scraper), console=console, refresh_per_second=2) as live:
            while not stop.wait(0.5):
                live.update(render(scraper))
            live.update(render(scraper))  # the last table stays on screen
        # The scraper stops and the last values are pushed (OTLP) before the process exits.
        logger.finish(exit_code=stop.exit_code)
    return stop.exit_code


def join_ray(address: str) -> str | None:
    """Join the Ray cluster at ``address``; on failure, one line saying why and what to do.

    Ray's own error names the flags of its own commands and comes with a traceback; an
    unreachable explicit address makes ray.init retry for minutes. So an explicit address is
    probed first, and a missing cluster is explained in this command's own terms.
    """
    try:
        import ray
    except ImportError:
        return (
            "--ray-address needs Ray: pip install 'otel-rl[ray]', or scrape nodes directly "
            "with --endpoint http://HOST:PORT/metrics"
        )
    if ray.is_initialized():
        return None
    target = address
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        target = os.environ["RAY_ADDRESS"]  # what ray.init("auto") would use
    if target not in ("auto", "local"):
        unreachable = _probe(target)
        if unreachable is not None:
            via = " (from RAY_ADDRESS)" if target != address else ""
            return f"no Ray cluster answers at {target}{via}: {unreachable}; {_NO_RAY_HINT}"
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError:
        return f"no running Ray cluster found for --ray-address {address}; {_NO_RAY_HINT}"
    except Exception as exc:  # ray's reason, without its traceback
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"could not join the Ray cluster at {target}: {reason}"
    return None


def _probe(address: str) -> str | None:
    """Why ``host:port`` (or ``ray://host:port``) takes no TCP connection, else None."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        return "not an address of the form HOST:PORT"
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def render(scraper: Any) -> Any:
    """Two tables from the scraper's cache: nodes (with failures) and GPUs."""
    from rich.console import Group
    from rich.table import Table

    last = scraper.last
    title = "waiting for the first round"
    if last is not None:
        title = (
            f"{len(last.samples)}/{len(last.results)} nodes answered, round took "
            f"{last.duration:.2f} s, {time.strftime('%H:%M:%S', time.localtime(last.time))}"
        )
    nodes = Table(title=f"Ray nodes - {title}", title_justify="left")
    for column in ("node", "host", "status", "CPU %", "memory GiB", "GPUs"):
        nodes.add_column(column, justify="right" if column in ("node", "CPU %", "GPUs") else "left")
    gpus = Table(title="GPUs", title_justify="left")
    for column in ("node", "GPU", "device", "util %", "memory GiB", "power W", "temp °C"):
        gpus.add_column(column, justify="left" if column == "device" else "right")

    cache = scraper.latest
    results = last.results if last is not None else {}
    for node in sorted(set(cache) | set(results)):
        result = results.get(node)
        cached = cache.get(node)
        status = "ok"
        if result is not None and result.sample is None:
            status = f"{result.kind}: {result.error}"
        if cached is None:
            nodes.add_row(str(node), result.target.host if result else "", status, "", "", "")
            continue
        sample = cached.sample
        nodes.add_row(
            str(node),
            cached.target.host,
            status,
            _num(sample.cpu_utilization, "{:.0f}"),
            _pair(sample.memory_used_bytes, sample.memory_total_bytes, GIB),
            str(len(sample.gpus)),
        )
        for gpu in sample.gpus.values():
            gpus.add_row(
                str(node),
                gpu.label,
                gpu.device,
                _num(gpu.utilization, "{:.0f}"),
                _pair(gpu.memory_used_mib, gpu.memory_total_mib, 1024),
                _num(gpu.power_w, "{:.0f}"),
                _num(gpu.temperature_c, "{:.0f}"),
            )
    return Group(nodes, gpus) if gpus.row_count else nodes


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _pair(used: float | None, total: float | None, unit: float) -> str:
    if used is None:
        return "-"
    if total is None:
        return f"{used / unit:.1f}"
    return f"{used / unit:.1f} / {total / unit:.1f}"
