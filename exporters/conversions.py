"""Conversions shared by the tracker SDK exporters (W&B, SwanLab, Trackio).

Everything here runs on an exporter's worker thread and imports its heavy modules (Pillow)
only when called.
"""

from __future__ import annotations

import io
import math
from typing import Any

from otel_rl.core.records import HistogramValue


def png_to_image(png: bytes) -> Any:
    """A Pillow image of ``png`` (what every tracker's image type accepts), fully loaded so the
    bytes buffer can go away."""
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def histogram_edges(value: HistogramValue) -> tuple[list[int], list[float]] | None:
    """``(counts, edges)`` in numpy's ``np.histogram`` layout, or ``None`` when there is nothing
    to draw (no samples, or non-finite limits).

    OTel's explicit buckets are ``(-inf, b0], (b0, b1], …, (b_last, +inf)``; the open ends are
    closed with the observed min and max so that every count keeps a finite bucket.
    """
    if value.count <= 0 or not (math.isfinite(value.min) and math.isfinite(value.max)):
        return None
    bounds = list(value.bounds)
    counts = [int(c) for c in value.counts]
    if not bounds:
        hi = value.max if value.max > value.min else value.min + 1.0
        return [value.count], [value.min, hi]
    if len(counts) != len(bounds) + 1:
        return None
    edges = [min(value.min, bounds[0]), *bounds, max(value.max, bounds[-1])]
    return counts, edges
