"""GET a Prometheus ``/metrics`` page with aiohttp: a hard total deadline, gzip, a size bound.

Scraping hundreds of nodes from one thread needs a deadline on the whole request (a node can
accept the connection and then never answer, or trickle bytes forever) and one event loop rather
than a thread per node. aiohttp gives both, plus chunked bodies, gzip and connection reuse within
a round; the one thing added here is a bound on the *decompressed* size, so a gzip bomb or a
runaway page costs at most ``max_bytes`` of memory.
"""

from __future__ import annotations

import math
from typing import Any

#: A Ray node's page is ~300 KB; anything far beyond is not a metrics page.
MAX_BODY_BYTES = 64 * 1024 * 1024

_HEADERS = {"Accept": "text/plain", "Accept-Encoding": "gzip", "User-Agent": "otel-rl"}


class FetchError(Exception):
    """The endpoint answered, but not with a usable 200 response."""


def import_aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError as exc:  # pragma: no cover - aiohttp is a core dependency
        raise ImportError(
            "scraping metrics endpoints needs aiohttp: pip install aiohttp"
        ) from exc
    return aiohttp


def new_session(max_connections: int) -> Any:
    """A client session for one round of scrapes (call inside the running event loop)."""
    aiohttp = import_aiohttp()
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        headers=_HEADERS,
        # The environment's proxy settings are for the outside world, not for cluster nodes.
        trust_env=False,
    )


async def fetch_text(
    session: Any, url: str, timeout: float, max_bytes: int = MAX_BODY_BYTES
) -> str:
    """GET ``url`` and return the body as text; the whole exchange must finish in ``timeout``.

    Raises ``TimeoutError``, ``OSError`` (refused, unreachable) or :class:`FetchError`.
    """
    aiohttp = import_aiohttp()
    try:
        # aiohttp rounds a deadline of ceil_threshold (5 s) or more up to the next whole second,
        # which made the default 5 s timeout last up to 6 s: the deadline here is exact.
        exact = aiohttp.ClientTimeout(total=timeout, ceil_threshold=math.inf)
        async with session.get(url, timeout=exact) as response:
            if response.status != 200:
                raise FetchError(f"HTTP {response.status} {response.reason or ''}".rstrip())
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):  # decompressed
                body += chunk
                if len(body) > max_bytes:
                    raise FetchError(f"response larger than {max_bytes} bytes")
            charset = response.charset or "utf-8"
    except aiohttp.ClientConnectorError as exc:
        raise (exc.os_error if isinstance(exc.os_error, OSError) else OSError(str(exc))) from exc
    except aiohttp.InvalidURL as exc:
        raise FetchError(f"not an http(s) URL: {url!r}") from exc
    except aiohttp.ClientPayloadError as exc:
        raise FetchError(f"bad response body: {exc}") from exc
    except aiohttp.ClientResponseError as exc:
        raise FetchError(f"bad HTTP response: {exc.message}") from exc
    except aiohttp.ClientConnectionError as exc:  # closed early, server disconnected
        raise FetchError(f"connection lost: {exc}") from exc
    return body.decode(charset, errors="replace")
