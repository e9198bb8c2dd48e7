"""Exceptions raised by otel-rl."""

from __future__ import annotations


class OtelRLError(Exception):
    """Base class of every error otel-rl raises on purpose."""


class ConfigError(OtelRLError, ValueError):
    """The logger configuration is invalid (unknown key, wrong type, unavailable backend)."""


class MetricError(OtelRLError, ValueError):
    """A metric key or value cannot be logged (raised only in strict mode).

    ``key`` is the offending key as the caller gave it, ``reason`` says what is wrong.
    """

    def __init__(self, key: object, reason: str) -> None:
        super().__init__(f"metric {key!r}: {reason}")
        self.key = key
        self.reason = reason
