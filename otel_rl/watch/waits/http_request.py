"""A wait in an HTTP client (``http.client``, urllib, urllib3, requests, httpx, httpcore,
aiohttp): the server and URL from the client's frames, credentials left out; followed to the
inference engines the rollout monitor sees on that host."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar
from urllib.parse import urlsplit

from otel_rl.watch.locks import where as _where
from otel_rl.watch.waits.base import Following, Wait, in_module, local_vars
from otel_rl.watch.waits.serving import engine_links

__all__ = ["HttpWait", "recognise"]

#: Module paths of the HTTP clients whose frames name the server waited on.
_HTTP_MODULES = ("/http/client.py", "/urllib/request.py", "/urllib3/", "/requests/", "/httpx/",
                 "/httpcore/", "/aiohttp/")  # fmt: skip


@dataclass
class HttpWait(Wait):
    kind: ClassVar[str] = "http"
    host: str | None = None  # "host:port"
    url: str | None = None  # without credentials

    def follow(self, following: Following) -> None:
        if self.host is not None:
            engine_links(self.host, following.engines(), following.verdict)


def recognise(frames: list[FrameType]) -> HttpWait | None:
    http = [f for f in frames if in_module(f, *_HTTP_MODULES)]
    if not http:
        return None
    host = url = method = None
    client = None
    for frame in http:  # innermost first: the connection's host, then the caller's URL
        variables = local_vars(frame)
        this = variables.get("self")
        if host is None and this is not None:
            h, p = getattr(this, "host", None), getattr(this, "port", None)
            if isinstance(h, str) and isinstance(p, int):
                # urllib hands http.client the URL's netloc, credentials and all
                host = f"{h.rpartition('@')[2]}:{p}"
                client = _client(frame)
        for name in ("url", "fullurl", "str_or_url"):
            value = variables.get(name)
            if isinstance(value, str) and "://" in value:
                url = value
            elif value is not None and hasattr(value, "scheme") and hasattr(value, "host"):
                url = str(value)
        for name in ("req", "request"):
            value = variables.get(name)
            full = getattr(value, "full_url", None) or getattr(value, "url", None)
            if isinstance(full, str) and "://" in full:
                url = full
            elif full is not None and hasattr(full, "host") and hasattr(full, "scheme"):
                url = str(full)
            verb = getattr(value, "method", None)
            if isinstance(verb, str) and verb:
                method = verb
            elif callable(getattr(value, "get_method", None)):
                with contextlib.suppress(Exception):
                    method = str(getattr(value, "get_method")())  # noqa: B009
        verb = variables.get("method")
        if isinstance(verb, str) and verb.isupper():
            method = verb
    if host is None and url is not None:
        parts = urlsplit(url)
        if parts.hostname:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = f"{parts.hostname}:{port}"
    client = client or _client(http[0])
    if host is None:
        return HttpWait(f"an HTTP request ({client})", f"its stack, frames of {client}")
    url = None if url is None else _without_credentials(url)
    target = url or f"http://{host}"
    words = f"HTTP {method + ' ' if method else ''}{target}"
    if url is not None and host not in url:
        words += f" (connection to {host})"
    evidence = f"its stack, frame {_where(http[0])} of {client}: no response yet"
    return HttpWait(words, evidence, host=host, url=url)


def _without_credentials(url: str) -> str:
    """``url`` without its user and password: a verdict is written to files, logs and trackers."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _client(frame: FrameType) -> str:
    name = frame.f_code.co_filename.replace("\\", "/")
    for client in ("requests", "urllib3", "httpx", "httpcore", "aiohttp"):
        if f"/{client}/" in name:
            return client
    return "urllib" if "/urllib/" in name else "http.client"
