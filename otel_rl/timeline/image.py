"""The window's picture as a PNG, for trackers that show images but not pages (TensorBoard).

Drawn with Pillow (a dependency of matplotlib and of the trackers that show images; it imports
in a tenth of matplotlib's time, which a run's last picture waits for at ``finish()``): a lane
per process and thread with the window's spans (nested spans thinner inside their parent), step
boundaries as dotted lines, stalls shaded in red, a legend of span names. The page
(``page.py``) is the one to read; this is its glance.
"""

from __future__ import annotations

import io

from otel_rl.timeline.page import depths
from otel_rl.timeline.run_picture import RunPicture
from otel_rl.timeline.window import Window

#: Lanes drawn at most: a job of hundreds of processes gets its first lanes and a note.
MAX_LANES = 40
#: Matplotlib's ten default colours, one per span name.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
WIDTH, LEFT, TOP, LANE, LEGEND = 960, 170, 34, 34, 18


def draw_png(picture: RunPicture, window: Window) -> bytes:
    """The PNG bytes of ``window``'s lanes; raises ``ImportError`` without Pillow."""
    from PIL import Image, ImageDraw

    used = sorted({s.lane for s in window.spans})[:MAX_LANES]
    row_of = {lane: row for row, lane in enumerate(used)}
    depth = depths(window.spans)
    names = sorted({s.name for s in window.spans})
    colours = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(names)}
    legend = names[:12]
    plot_bottom = TOP + LANE * max(len(used), 1)
    height = plot_bottom + 24 + LEGEND * ((len(legend) + 5) // 6)
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    start, end = window.start, max(window.end, window.start + 1e-3)

    def x(t: float) -> float:
        return LEFT + (WIDTH - LEFT - 10) * (min(max(t, start), end) - start) / (end - start)

    for stall in window.stalls:
        stop = stall.end if stall.end is not None else window.end
        draw.rectangle((x(stall.start), TOP, x(stop), plot_bottom), fill="#f7d4d4")
    for index, lane in enumerate(used):
        draw.text((4, TOP + LANE * index + LANE / 2 - 5), picture.lanes[lane].label[:28],
                  fill="#333")  # fmt: skip
    for span in window.spans:
        row = row_of.get(span.lane)
        if row is None:
            continue
        half = LANE * 0.4 * 0.75 ** depth.get(span.span_id, 0)
        middle = TOP + LANE * row + LANE / 2
        draw.rectangle((x(span.start), middle - half, max(x(span.end), x(span.start) + 1),
                        middle + half), fill=colours[span.name], outline="white")  # fmt: skip
    for step in window.steps:
        left = x(step.start)
        for y in range(TOP, plot_bottom, 6):
            draw.line((left, y, left, y + 3), fill="#888")
        draw.text((left + 2, TOP - 12), f"step {step.step}", fill="#555")
    shown = f"steps {window.steps[0].step}-{window.steps[-1].step}" if window.steps else "the run"
    more = len({s.lane for s in window.spans}) - len(used)
    title = f"{shown}: {len(window.spans)} spans, {end - start:.3g} s"
    draw.text((LEFT, 4), title + (f" ({more} lanes more on the page)" if more > 0 else ""),
              fill="black")  # fmt: skip
    for i, name in enumerate(legend):  # below the chart, where it hides no span
        left, top = LEFT + (i % 6) * 130, plot_bottom + 12 + LEGEND * (i // 6)
        draw.rectangle((left, top, left + 10, top + 10), fill=colours[name])
        draw.text((left + 14, top), name[:18], fill="#333")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
