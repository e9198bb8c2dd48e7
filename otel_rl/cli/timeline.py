"""``otel-rl timeline LOG_DIR``: a run's picture from its files, as a page or a Perfetto trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("html", "perfetto")


def run(log_dir: str, steps: str | None = None, out: str | None = None,
        fmt: str = "html") -> int:  # fmt: skip
    """Write the picture; returns the exit code (2: nothing to draw, or a bad argument)."""
    from otel_rl.timeline.run_picture import load_run
    from otel_rl.timeline.window import choose, parse_steps

    root = Path(log_dir)
    if not root.is_dir():
        shown = f"a file: give the run's folder, {root.parent}" if root.exists() else (
            "no such directory"
        )  # fmt: skip
        print(f"otel-rl timeline: {log_dir}: {shown}", file=sys.stderr)
        return 2
    picture = load_run(root)
    if not picture.spans and not picture.steps:
        runs = sorted(p.parent.name for p in root.glob("*/metrics.jsonl"))
        runs += sorted(p.parent.name for p in root.glob("*/traces.jsonl")
                       if p.parent.name not in runs)  # fmt: skip
        if runs:
            print(f"otel-rl timeline: {log_dir} is not a run but holds runs: "
                  f"{', '.join(runs[:10])}{' …' if len(runs) > 10 else ''}; name one, e.g. "
                  f"otel-rl timeline {root / runs[-1]}", file=sys.stderr)  # fmt: skip
            return 2
        print(
            f"otel-rl timeline: {log_dir} holds no spans (traces.jsonl) and no steps "
            "(metrics.jsonl): is it the log_dir of a run that logged steps? (spans are on disk "
            "by default; tracing: {enabled: false} turns them off)",
            file=sys.stderr,
        )
        return 2
    try:
        window = choose(picture, None if steps is None else parse_steps(steps))
    except ValueError as exc:
        print(f"otel-rl timeline: {exc}", file=sys.stderr)
        return 2
    if fmt == "perfetto":
        from otel_rl.timeline.perfetto import trace_events

        text = json.dumps(trace_events(picture, window), separators=(",", ":"))
        default = root / "timeline.perfetto.json"
    else:
        from otel_rl.cli.timeline_snapshot import time_table
        from otel_rl.timeline.page import render

        text = render(picture, window, time_spent=time_table(root)[1])
        default = root / "timeline.html"
    target = Path(out) if out else default
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"otel-rl timeline: cannot write {target}: {exc}", file=sys.stderr)
        return 1
    shown = f"steps {window.steps[0].step}-{window.steps[-1].step}" if window.steps else "the run"
    lanes = len({s.lane for s in window.spans})
    print(f"{target}: {shown}, {len(window.spans)} spans on {lanes} lanes, "
          f"{len(window.stalls)} stall(s)")  # fmt: skip
    if not picture.spans:
        print("  no spans on disk: the page has the steps only (tracing: {enabled: true} "
              "records them)")  # fmt: skip
    return 0
