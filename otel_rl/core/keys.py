"""Map users' metric keys to valid OTel instrument names, and refuse keys that would collide.

Trackers receive the user's key exactly (``train/Loss`` stays ``train/Loss``). OTel instrument
names must match ``[a-zA-Z][-_./a-zA-Z0-9]{0,254}`` and are lower-cased by the SDK; Prometheus then
folds every run of other characters into ``_``. Two keys that end up as one Prometheus name
(``train/loss``, ``train.loss``, ``Train_Loss``) would silently merge into one series there, so the
second one to appear is refused.
"""

from __future__ import annotations

import hashlib
import re
import threading

from otel_rl.core.errors import shown_key

_INVALID_INSTRUMENT_CHARS = re.compile(r"[^-_./a-zA-Z0-9]")
_PROMETHEUS_FOLD = re.compile(r"[^a-z0-9:]+")
_MAX_INSTRUMENT_NAME = 255


def instrument_name(key: str) -> str:
    """A valid OTel instrument name for ``key`` (deterministic, case preserved)."""
    name = _INVALID_INSTRUMENT_CHARS.sub("_", key)
    if not name[:1].isascii() or not name[:1].isalpha():
        name = "m_" + name
    if len(name) > _MAX_INSTRUMENT_NAME:
        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        name = f"{name[: _MAX_INSTRUMENT_NAME - 11]}_{digest}"
    return name


def prometheus_name(key: str) -> str:
    """The metric name Prometheus shows for ``key`` (before any unit or type suffix): the
    instrument name for ``key``, lower-cased by the SDK, then folded by the Prometheus exporter."""
    return _PROMETHEUS_FOLD.sub("_", instrument_name(key).lower())


class KeyCollisionError(ValueError):
    """Two different keys map to the same OTel/Prometheus metric name."""

    def __init__(self, key: str, other: str, name: str) -> None:
        super().__init__(
            f"key {shown_key(key)} collides with {shown_key(other)}: both become the metric "
            f"{shown_key(name)} in OTel/Prometheus; rename one of them"
        )
        self.key, self.other, self.name = key, other, name


class KeyRegistry:
    """Remembers every key seen, its instrument name, and what kind of instrument it feeds.

    Lookups of known keys are a dict hit; only a new key pays for the name mapping.
    """

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[str, str]] = {}
        self._by_prometheus: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, key: str, kind: str) -> str:
        """Return the instrument name for ``key``; raise :class:`KeyCollisionError` on a clash.

        ``kind`` ("gauge", "timer", ...) is part of the claim: one key cannot feed two kinds.
        """
        known = self._by_key.get(key)
        if known is not None and known[1] == kind:
            return known[0]
        with self._lock:
            known = self._by_key.get(key)
            if known is not None:
                if known[1] != kind:
                    raise KeyCollisionError(key, f"{key} (as a {known[1]})", known[0])
                return known[0]
            prom = prometheus_name(key)
            other = self._by_prometheus.get(prom)
            if other is not None:
                raise KeyCollisionError(key, other, prom)
            name = instrument_name(key)
            self._by_key[key] = (name, kind)
            self._by_prometheus[prom] = key
            return name
