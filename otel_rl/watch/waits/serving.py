"""The serving side of a host a wait leads to: the rollout monitor's counts of the inference
engines there, and the GPU bridge's last reading of its GPUs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from otel_rl.watch.chain import Link, Verdict
from otel_rl.watch.stalls import seconds

__all__ = ["engine_links", "gpu_link"]


def engine_links(host: str | None, engines: Sequence[Mapping[str, Any]], verdict: Verdict) -> None:
    """The engines on ``host`` (``ip`` or ``ip:port``) with their in-flight and finished
    requests, as one link."""
    if host is None:
        return
    ip, _, port = host.partition(":")
    mine = [
        e for e in engines
        if urlsplit(e["url"]).hostname == ip and (not port or str(urlsplit(e["url"]).port) == port)
    ]  # fmt: skip
    if not mine:
        return
    parts, ages = [], []
    for engine in mine[:4]:
        label = engine["url"]
        if engine.get("label"):  # as the monitor names it: vLLM's engine label, or Ray's
            shown = engine["label"]
            label += f" {shown}" if "=" in shown else f" engine={shown}"
        said = []
        if engine.get("running") is not None:
            said.append(f"{engine['running']:.0f} running")
        if engine.get("finished") is not None:
            said.append(f"{engine['finished']:.0f} finished in {seconds(engine['window_seconds'])}")
        parts.append(f"engine {label}: {', '.join(said) or 'no request counts'}")
        ages.append(engine["seconds_ago"])
    if len(mine) > 4:
        parts.append(f"{len(mine) - 4} more engines")
    evidence = f"the rollout monitor's latest scrape, {seconds(max(ages))} old"
    running = sum(e.get("running") or 0 for e in mine)
    verdict.chain.append(Link(f"engines on {host}", None, f"{running:.0f} requests running", None,
                              evidence, text="; ".join(parts)))  # fmt: skip


def gpu_link(ip: str | None, gpus: Any, verdict: Verdict) -> None:
    """The GPU bridge's last reading of the node at ``ip``, appended to the last link."""
    if ip is None or not isinstance(gpus, Mapping) or not gpus.get("available"):
        return
    for reading in (gpus.get("nodes") or {}).values():
        if reading.get("host") != ip:
            continue
        shown = [f"{label} at {g.get('util_percent', float('nan')):.0f} %"
                 for label, g in (reading.get("gpus") or {}).items()]  # fmt: skip
        if not shown:
            return
        link = verdict.chain[-1]
        more = f" (+{len(shown) - 8})" if len(shown) > 8 else ""
        link.text += f"; GPUs on {ip}: " + ", ".join(shown[:8]) + more
        age = seconds(reading.get("seconds_ago", 0))
        link.evidence += f"; the GPU bridge's reading, {age} old"
        return
