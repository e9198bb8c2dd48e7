"""Which endpoints to scrape: Ray's alive nodes, or a static list; and stable node ids.

A node's id (the ``n`` in ``ray/node.{n}.…``) is given the first time the node is seen and kept
for the whole run, keyed by Ray's ``NodeID`` (or the endpoint URL for a static list). Positions
in ``ray.nodes()`` shift whenever a node joins or dies, which would silently splice two machines'
series together.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class DiscoveryError(Exception):
    """The node list could not be obtained this round (the previous one is kept)."""


@dataclass(frozen=True)
class NodeTarget:
    """One endpoint to scrape. ``key`` identifies the node across rounds."""

    key: str
    url: str
    host: str


#: What an endpoint may be, in the words of every error that refuses one.
ENDPOINT_FORMS = "`host:port` or an http:// or https:// URL with a host"


def endpoint_problem(value: object) -> str | None:
    """Why ``value`` is not an engine endpoint (``None`` when it is one): a string, either
    ``host:port`` or an http(s) URL with a host. The config's ``rollout_monitoring.endpoints``
    and ``RolloutMonitor.add_endpoints()`` both decide with this."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    text = value.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:  # not a number from 0 to 65535
        return "expected " + ENDPOINT_FORMS
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected " + ENDPOINT_FORMS
    if "://" not in text and port is None:  # a bare host needs its port
        return "expected " + ENDPOINT_FORMS
    return None


def without_userinfo(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``: how an endpoint is shown in
    log lines and errors."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if "@" not in parts.netloc:
        return url
    shown = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()
    return shown if "://" in url else shown.split("://", 1)[1]


def endpoint_targets(endpoints: Iterable[str]) -> list[NodeTarget]:
    """Targets for a static list; ``host:port`` and URLs without a path get ``/metrics``."""
    targets = []
    for raw in endpoints:
        url = str(raw).strip()
        if "://" not in url:
            url = f"http://{url}"
        parts = urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"not an endpoint URL: {raw!r}")
        if parts.path in ("", "/"):
            url = url.rstrip("/") + "/metrics"
        targets.append(NodeTarget(key=url, url=url, host=parts.hostname))
    return targets


def targets_from_ray_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[NodeTarget]:
    """Targets for the alive entries of ``ray.nodes()`` (dead nodes stay listed with
    ``Alive: False``; nodes without a metrics port are skipped)."""
    targets = []
    for node in nodes:
        port = node.get("MetricsExportPort")
        address = node.get("NodeManagerAddress")
        if not node.get("Alive") or not port or not address:
            continue
        host = f"[{address}]" if ":" in str(address) else str(address)
        targets.append(
            NodeTarget(
                key=str(node.get("NodeID") or f"{address}:{port}"),
                url=f"http://{host}:{int(port)}/metrics",
                host=str(address),
            )
        )
    return targets


def ray_targets() -> list[NodeTarget]:
    """Alive nodes of the Ray cluster this process is connected to."""
    import ray

    if not ray.is_initialized():
        raise DiscoveryError(
            "Ray is not initialized in this process; call ray.init() (GPU monitoring retries "
            "every collection) or set gpu_monitoring.endpoints"
        )
    try:
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
    except Exception as exc:  # GCS unreachable, cluster shutting down
        raise DiscoveryError(f"ray.nodes() failed: {type(exc).__name__}: {exc}") from exc
    return targets_from_ray_nodes(nodes)


class NodeIds:
    """Stable small integers for node keys, in first-seen order."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def id_for(self, key: str) -> int:
        with self._lock:
            node = self._ids.get(key)
            if node is None:
                node = self._ids[key] = len(self._ids)
            return node

    def known(self) -> dict[str, int]:
        with self._lock:
            return dict(self._ids)
