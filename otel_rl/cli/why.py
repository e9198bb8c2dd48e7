"""``otel-rl why LOG_DIR [--step N] [--json]``: why a run's slow steps were slow, printed.

The answer is :func:`otel_rl.analysis.why.explain`'s, from the run's files alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from otel_rl.analysis.why import TOP, WhyError, explain


def run(target: str | Path, step: int | None = None, top: int = TOP, as_json: bool = False) -> int:
    """The command: print the answer (or one line on stderr and exit code 2)."""
    try:
        answer = explain(target, step=step, top=top)
    except WhyError as exc:
        print(f"otel-rl why: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(answer.to_json(), indent=2))
    else:
        sys.stdout.write(answer.to_text())
    return 0
