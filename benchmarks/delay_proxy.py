"""A TCP proxy on 127.0.0.1 that holds each HTTP request for a fixed delay before passing it on.

It makes a local tracker server behave like a remote, slow one. The proxy does not parse HTTP:
on each connection, the first bytes the client sends after the server's last answer start a new
request, and that request (all of its segments) waits ``delay`` seconds; answers pass at once.
This holds for HTTP/1.1 keep-alive without pipelining, which is what tracker SDKs do.

It runs in its own process (:class:`DelayProxy`), so its threads never compete with the measured
training loop for the GIL.

    python -m benchmarks.delay_proxy --upstream 127.0.0.1:5000 --delay 0.05 [--port 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from types import TracebackType

_CHUNK = 65536


def _relay(
    src: socket.socket,
    dst: socket.socket,
    delay: float,
    new_request: threading.Event,
    is_request: bool,
) -> None:
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            if is_request and new_request.is_set():
                new_request.clear()
                time.sleep(delay)
            elif not is_request:
                new_request.set()  # the answer has started: the next request bytes are new
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _handle(client: socket.socket, upstream: tuple[str, int], delay: float) -> None:
    try:
        server = socket.create_connection(upstream, timeout=30)
    except OSError:
        client.close()
        return
    server.settimeout(None)
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    new_request = threading.Event()
    new_request.set()
    threads = [
        threading.Thread(
            target=_relay, args=(client, server, delay, new_request, True), daemon=True
        ),
        threading.Thread(
            target=_relay, args=(server, client, delay, new_request, False), daemon=True
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    server.close()


def serve(listen: socket.socket, upstream: tuple[str, int], delay: float) -> None:
    while True:
        client, _ = listen.accept()
        threading.Thread(target=_handle, args=(client, upstream, delay), daemon=True).start()


class DelayProxy:
    """The proxy in a child process; ``url`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, upstream_url: str, delay: float) -> None:
        host_port = upstream_url.split("://", 1)[-1].rstrip("/")
        self.delay = delay
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.delay_proxy", "--upstream", host_port,
             "--delay", str(delay)],
            stdin=subprocess.PIPE,  # closed when this process dies: the proxy then exits too
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        self.url = f"http://127.0.0.1:{line}"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()


def _exit_with_parent() -> None:
    sys.stdin.read()  # returns at EOF: the parent closed the pipe or is gone
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port of the real server")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds added per request")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", args.port))
    listen.listen(64)
    print(listen.getsockname()[1], flush=True)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    serve(listen, (host, int(port)), args.delay)


if __name__ == "__main__":
    main()
