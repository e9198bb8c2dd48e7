"""Small matplotlib figures for plot tests, and the PNG the Logger renders from them."""

from __future__ import annotations

import io
from typing import Any


def line_figure(points: list[float]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(3, 2), dpi=50)
    plt.plot(points)
    return figure


def rendered_png(figure: Any) -> bytes:
    """The bytes ``Logger.log_plot`` stores for ``figure``."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()
