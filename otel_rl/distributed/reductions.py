"""Reductions across workers, and the rules that pick one per key.

A reduction spec is one name or a list of names. The first name gives the key's value; each
further name adds ``<key>/<name>`` (so ``"timing/*": ["max", "min", "mean"]`` logs the slowest
rank under the key plus ``/min`` and ``/mean``).

Rules come from the logger config (``reductions: {"timing/*": "max", "train/*_count": "sum"}``):
exact keys first, then glob patterns (``fnmatch``, case-sensitive, ``*`` also matches ``/``) in
the order they were declared; the first match wins. A pattern matches a key if it matches the
key as the worker recorded it or the key with the driver's prefix applied.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

from otel_rl.core.errors import ConfigError, MetricError

#: Every reduction a scalar can declare.
REDUCTIONS = ("mean", "sum", "min", "max", "last")

#: A resolved spec: the key's own reduction first, then the extra ``/<name>`` statistics.
Spec = tuple[str, ...]

#: What a key with no declared reduction gets.
DEFAULT_SCALAR: Spec = ("mean",)
DEFAULT_TIMING: Spec = ("max",)


class ReductionConflictError(MetricError):
    """One key was declared with two different reductions (or as two kinds of metric)."""


def normalize_spec(spec: str | Sequence[str], where: str = "reduction") -> Spec:
    """``"max"`` → ``("max",)``; lists are checked and de-duplicated in order."""
    names = (spec,) if isinstance(spec, str) else tuple(spec)
    if not names:
        raise ConfigError(f"{where}: an empty list of reductions")
    unknown = [n for n in names if n not in REDUCTIONS]
    if unknown:
        raise ConfigError(
            f"{where}: unknown reduction {unknown[0]!r}; choose from {', '.join(REDUCTIONS)}"
        )
    return tuple(dict.fromkeys(names))


def check_reductions(rules: Any) -> None:
    """Validate the ``reductions`` config section (raises :class:`ConfigError`)."""
    if not isinstance(rules, Mapping):
        raise ConfigError(f"logger config 'reductions' must be a mapping, got {rules!r}")
    for pattern, spec in rules.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"logger config 'reductions': bad key pattern {pattern!r}")
        if not isinstance(spec, (str, list, tuple)):
            raise ConfigError(
                f"logger config 'reductions.{pattern}' must be a reduction name or a list of "
                f"them, got {spec!r}"
            )
        normalize_spec(spec, where=f"logger config 'reductions.{pattern}'")


class ReductionRules:
    """Per-key reductions declared once, by exact key or glob pattern; lookups are cached."""

    def __init__(self, rules: Mapping[str, str | Sequence[str]] | None = None) -> None:
        rules = dict(rules or {})
        check_reductions(rules)
        self._exact: dict[str, Spec] = {}
        self._patterns: list[tuple[re.Pattern[str], Spec]] = []
        for pattern, spec in rules.items():
            normalized = normalize_spec(spec)
            if any(ch in pattern for ch in "*?["):
                self._patterns.append((re.compile(fnmatch.translate(pattern)), normalized))
            else:
                self._exact[pattern] = normalized
        self._cache: dict[tuple[str, str], Spec | None] = {}

    def __bool__(self) -> bool:
        return bool(self._exact or self._patterns)

    def lookup(self, key: str, full_key: str | None = None) -> Spec | None:
        """The declared spec for ``key`` (also tried as ``full_key``), or ``None``."""
        full = key if full_key is None else full_key
        cache_key = (key, full)
        try:
            return self._cache[cache_key]
        except KeyError:
            pass
        spec = self._exact.get(full) or self._exact.get(key)
        if spec is None:
            for regex, candidate in self._patterns:
                if regex.match(full) or regex.match(key):
                    spec = candidate
                    break
        if len(self._cache) < 100_000:  # keys are bounded in practice; never grow without end
            self._cache[cache_key] = spec
        return spec
