"""Exceptions raised by otel-rl."""

from __future__ import annotations

from typing import Any

#: Longest key shown in a message; longer keys are cut with an ellipsis and their length.
MAX_SHOWN_KEY = 120
#: Longest reason shown in a message (a reason may quote an exception's own text).
MAX_SHOWN_REASON = 400


class OtelRLError(Exception):
    """Base class of every error otel-rl raises on purpose."""


class ConfigError(OtelRLError, ValueError):
    """The logger configuration is invalid (unknown key, wrong type, unavailable backend)."""


class MetricError(OtelRLError, ValueError):
    """A metric key or value cannot be logged (raised only in strict mode).

    ``key`` is the offending key as the caller gave it (unshortened), ``reason`` says what is
    wrong. The message shows the key cut to :data:`MAX_SHOWN_KEY` characters.
    """

    def __init__(self, key: object, reason: str) -> None:
        super().__init__(f"metric {shown_key(key)}: {shorten(reason, MAX_SHOWN_REASON)}")
        self.key = key
        self.reason = reason


def shown_key(key: object) -> str:
    """``key`` as it appears in a message: its ``repr`` for a string, cut when long.

    ``'train/loss'``; a 10,000-character key shows as its first characters, ``…`` and
    ``(10000 chars)``. Keys that are not strings show as ``<type>`` plus, when it can be
    computed, their ``repr``; a key whose ``__repr__`` raises shows its type only.
    """
    if isinstance(key, str):
        if len(key) <= MAX_SHOWN_KEY:
            return repr(key)
        return f"{key[:MAX_SHOWN_KEY]!r}… ({len(key)} chars)"
    try:
        text = repr(key)
    except Exception:  # an object whose __repr__ raises still gets a message
        return f"<{type(key).__name__} key>"
    return shorten(text, MAX_SHOWN_KEY)


def shorten(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with ``… (N chars)`` when longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} chars)"


class MetricReporter:
    """What the Logger does with a bad key or value: raise (strict) or warn once.

    Lenient: one warning per distinct (key, reason), so a value bad at every step warns once and
    a second bad key still warns. The set is bounded (``limit``) so that keys made unique per step
    cannot grow it; past the limit one line says so and the rest are silent.
    """

    def __init__(self, strict: bool, log: Any, limit: int = 1000) -> None:
        self.strict = strict
        self._log = log
        self._limit = limit
        self._warned: set[tuple[str, str]] = set()

    def __call__(self, key: object, reason: str) -> None:
        if self.strict:
            raise MetricError(key, reason)
        shown = shown_key(key)
        if (shown, reason) in self._warned:
            return
        if len(self._warned) >= self._limit:
            if len(self._warned) == self._limit:
                self._warned.add(("", ""))
                self._log.warning(
                    "otel-rl: %d different metric warnings so far; further bad keys and values "
                    "are skipped without a warning", self._limit,
                )  # fmt: skip
            return
        self._warned.add((shown, reason))
        self._log.warning("otel-rl: metric %s: %s", shown, shorten(reason, MAX_SHOWN_REASON))
