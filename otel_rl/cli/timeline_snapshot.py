"""``python -m otel_rl.cli.timeline_snapshot LOG_DIR LAST HTML PNG``: the page and the image of a
run's last ``LAST`` steps, and where the run's time went as a table, for the run's trackers
(``otel_rl/run/picture.py``).

A process of its own: reading the trace file and drawing take seconds of CPU and hold the GIL,
which the training process's threads would feel. Prints one line of JSON: the steps drawn,
whether the image was (it needs Pillow) and the time table (:func:`time_table`); exit code 2
when the run has no step to draw yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_rl.timeline.run_picture import RunPicture


def time_table(log_dir: Path) -> tuple[list[list[object]], list[str]]:
    """Where the run's time went (``otel-rl why``'s table) as rows of a table of two columns,
    ``part`` and ``value`` (the part names its unit), and as its lines; none for a run without
    anatomy rows."""
    from otel_rl.analysis.why import WhyError, explain

    try:
        spent = explain(log_dir).time_spent
    except (WhyError, OSError):
        return [], []
    if spent is None:
        return [], []
    rows: list[list[object]] = [["steps, seconds", spent.steps_seconds]]
    rows += [[f"phase {name}, seconds", seconds] for name, seconds in spent.phases]
    if spent.stalls:
        rows.append([f"{spent.stalls} stall(s), seconds", spent.stalls_seconds])
    if spent.redone_steps:
        rows.append([f"relaunches ({spent.redone_steps} step rows redone), seconds",
                     spent.redone_seconds])  # fmt: skip
    rows += [[f"{role} idle, share of the steps' time", share] for role, share in spent.idle]
    return rows, spent.lines()


#: The end of the run's files read first; four times more while it holds too few steps.
FIRST_TAIL = 1 << 20


def read_latest(log_dir: Path, last: int) -> RunPicture:
    """The run's latest ``last`` steps and one more, read from the end of its files: a run's
    trace files hold up to twice ``tracing.file_max_mb`` (128 MB by default), which would take
    seconds to read whole."""
    from otel_rl.telemetry.trace_file import trace_files
    from otel_rl.timeline.run_picture import load_run

    size = sum(p.stat().st_size for p in [*trace_files(log_dir), log_dir / "metrics.jsonl"]
               if p.is_file())  # fmt: skip
    tail = FIRST_TAIL
    while True:
        picture = load_run(log_dir, tail)
        if len(picture.steps) > last or tail >= size:
            return picture
        tail *= 4


def snapshot(log_dir: Path, last: int, html_path: Path, png_path: Path) -> dict[str, object]:
    from otel_rl.timeline.page import render
    from otel_rl.timeline.window import choose, last_steps

    picture = read_latest(log_dir, last)
    steps = last_steps(picture, last)
    if steps is None:
        return {"steps": None}
    window = choose(picture, steps)
    rows, lines = time_table(log_dir)
    html_path.write_text(render(picture, window, lines), encoding="utf-8")
    drawn: str | None = None
    try:
        from otel_rl.timeline.image import draw_png

        png_path.write_bytes(draw_png(picture, window))
    except ImportError as exc:
        drawn = f"no image: {exc} (pip install pillow)"
    return {"steps": list(steps), "spans": len(window.spans), "image": drawn or "drawn",
            "time_table": rows}  # fmt: skip


def main(argv: list[str]) -> int:
    log_dir, last, html_path, png_path = argv
    result = snapshot(Path(log_dir), int(last), Path(html_path), Path(png_path))
    print(json.dumps(result), flush=True)
    return 0 if result["steps"] is not None else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
