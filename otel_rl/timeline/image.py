"""The window's picture as a PNG, for trackers that show images but not pages (TensorBoard).

Drawn with matplotlib (Agg, no display): a lane per process and thread with the window's spans
(nested spans thinner inside their parent), step boundaries as dotted lines, stalls shaded in
red. The page (``page.py``) is the one to read; this is its glance.
"""

from __future__ import annotations

import io

from otel_rl.timeline.page import depths
from otel_rl.timeline.run_picture import RunPicture
from otel_rl.timeline.window import Window

#: Lanes drawn at most: a job of hundreds of processes gets its first lanes and a note.
MAX_LANES = 40


def draw_png(picture: RunPicture, window: Window) -> bytes:
    """The PNG bytes of ``window``'s lanes; raises ``ImportError`` without matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display

    used = sorted({s.lane for s in window.spans})[:MAX_LANES]
    row_of = {lane: row for row, lane in enumerate(used)}
    depth = depths(window)
    figure = Figure(figsize=(12, 2.0 + 0.42 * max(len(used), 1)), dpi=80)
    axes = figure.add_subplot()
    names = sorted({s.name for s in window.spans})
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for span in window.spans:
        row = row_of.get(span.lane)
        if row is None:
            continue
        height = 0.8 * 0.75 ** depth.get(span.span_id, 0)
        extent = [(span.start, max(span.end - span.start, 1e-6))]
        axes.broken_barh(extent, (row - height / 2, height), color=colours[span.name],
                         edgecolor="white", linewidth=0.3)  # fmt: skip
    for step in window.steps:
        axes.axvline(step.start, color="#888", linestyle=":", linewidth=0.8)
        axes.text(step.start, -0.7, f"step {step.step}", fontsize=7, color="#555")
    for stall in window.stalls:
        axes.axvspan(stall.start, stall.end if stall.end is not None else window.end,
                     color="#d62728", alpha=0.15)  # fmt: skip
    axes.set_yticks(range(len(used)), [picture.lanes[lane].label for lane in used], fontsize=7)
    axes.set_ylim(len(used) - 0.4, -1.0)
    axes.set_xlim(window.start, max(window.end, window.start + 1e-3))
    axes.set_xlabel("seconds")
    shown = f"steps {window.steps[0].step}-{window.steps[-1].step}" if window.steps else "the run"
    more = len({s.lane for s in window.spans}) - len(used)
    axes.set_title(f"{shown}: {len(window.spans)} spans" + (f" ({more} lanes more on the page)"
                   if more > 0 else ""), fontsize=9)  # fmt: skip
    handles = [axes.bar(0, 0, color=colours[n], label=n) for n in names[:12]]
    if handles:  # below the chart, where it hides no span
        figure.legend(handles=handles, fontsize=7, loc="lower center", ncol=min(len(handles), 8))
    figure.tight_layout(rect=(0, 0.12 if handles else 0, 1, 1))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
