"""Exit codes of a run (kept for imports of this name; the code lives in
:mod:`otel_rl.lifecycle`, with signals, ``atexit`` and fork)."""

from __future__ import annotations

from otel_rl.lifecycle import exit_code_hint, exit_code_of

__all__ = ["exit_code_hint", "exit_code_of"]
