"""A minimal asyncio HTTP GET for Prometheus endpoints: gzip, a hard total timeout.

Scraping hundreds of nodes from one thread needs a deadline on the whole request (a node can
accept the connection and then never answer, or trickle bytes forever), which socket timeouts
in ``urllib`` do not give, and one thread per node does not scale. This client speaks just
enough HTTP/1.1 for a ``/metrics`` endpoint: one request per connection, ``Content-Length``,
chunked or read-to-close bodies, and gzip.
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
import zlib
from urllib.parse import urlsplit

#: A Ray node's page is ~300 KB; anything far beyond is not a metrics page.
MAX_BODY_BYTES = 64 * 1024 * 1024


class FetchError(Exception):
    """The endpoint answered, but not with a usable 200 response."""


async def fetch_text(url: str, timeout: float, max_bytes: int = MAX_BODY_BYTES) -> str:
    """GET ``url`` and return the body as text; the whole exchange must finish in ``timeout``.

    Raises ``TimeoutError``, ``OSError`` (refused, unreachable) or :class:`FetchError`.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rsplit("@", 1)[-1]
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nAccept-Encoding: gzip\r\n"
        "Accept: text/plain\r\nConnection: close\r\nUser-Agent: otel-rl\r\n\r\n"
    ).encode("ascii")
    context = ssl.create_default_context() if secure else None

    async def exchange() -> tuple[dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=context)
        try:
            writer.write(request)
            await writer.drain()
            return await _read_response(reader, max_bytes)
        finally:
            writer.close()

    headers, body = await asyncio.wait_for(exchange(), timeout)
    if "gzip" in headers.get("content-encoding", ""):
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError, zlib.error) as exc:
            raise FetchError(f"bad gzip body: {exc}") from exc
    return body.decode("utf-8", errors="replace")


async def _read_response(
    reader: asyncio.StreamReader, max_bytes: int
) -> tuple[dict[str, str], bytes]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise FetchError("connection closed before a complete HTTP response") from exc
    except asyncio.LimitOverrunError as exc:
        raise FetchError("HTTP response headers too large") from exc
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
        raise FetchError(f"not an HTTP response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if status[1] != "200":
        raise FetchError(f"HTTP {status[1]} {status[2] if len(status) > 2 else ''}".rstrip())
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return headers, await _read_chunked(reader, max_bytes)
    length = headers.get("content-length")
    if length is not None and length.isdigit():
        if int(length) > max_bytes:
            raise FetchError(f"response of {length} bytes is too large")
        try:
            return headers, await reader.readexactly(int(length))
        except asyncio.IncompleteReadError as exc:
            raise FetchError("connection closed in the middle of the body") from exc
    body = await reader.read(max_bytes + 1)
    while body and len(body) <= max_bytes:
        more = await reader.read(max_bytes + 1 - len(body))
        if not more:
            break
        body += more
    if len(body) > max_bytes:
        raise FetchError("response too large")
    return headers, body


async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    body = bytearray()
    try:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
            if len(body) > max_bytes:
                raise FetchError("response too large")
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise FetchError(f"bad chunked body: {exc}") from exc
