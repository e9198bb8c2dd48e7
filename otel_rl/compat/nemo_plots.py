"""The figures behind NeMo RL's ``log_plot_per_worker_timeline_metrics`` and
``log_plot_token_mult_prob_error``, drawn with matplotlib's object API (no pyplot state, so they
are safe off the main thread) from numpy arrays or tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _figure() -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(6.4, 4.8))


def _numpy(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy() if value.is_floating_point() else (
            value.detach().cpu().numpy()
        )
    return np.asarray(value)


def per_worker_timeline_figures(
    metrics: Mapping[Any, Sequence[Any]], name: str, timeline_interval: float
) -> list[tuple[str, Any]]:
    """``[("per_worker_<name>", fig), ("average_<name>", fig)]``; empty when there is no data.

    One line per worker (``worker_<id>``, points ``timeline_interval`` seconds apart), and the
    mean over the workers that have data, up to the shortest of their series.
    """
    import numpy as np

    if timeline_interval <= 0:
        raise ValueError(f"timeline_interval must be positive; received {timeline_interval}")
    series = {
        worker: [float(v) for v in values] for worker, values in metrics.items() if len(values)
    }
    if not series:
        return []
    per_worker = _figure()
    ax = per_worker.add_subplot()
    for worker in sorted(series, key=str):
        ys = series[worker]
        ax.plot([i * timeline_interval for i in range(len(ys))], ys, label=f"worker_{worker}")
    _decorate(ax, name, f"{name} (per worker)")
    ax.legend(fontsize="small")

    shortest = min(len(ys) for ys in series.values())
    mean = np.mean([ys[:shortest] for ys in series.values()], axis=0)
    average = _figure()
    ax = average.add_subplot()
    ax.plot([i * timeline_interval for i in range(shortest)], mean, label="average")
    _decorate(ax, name, f"{name} (average)")
    return [(f"per_worker_{name}", per_worker), (f"average_{name}", average)]


def _decorate(ax: Any, title: str, ylabel: str) -> None:
    ax.set_xlabel("Time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.2)


def token_mult_prob_error_figure(data: Mapping[str, Any]) -> tuple[Any, dict[str, float]] | None:
    """The sample with the highest multiplicative probability error, plotted token by token.

    ``data``: ``token_mask``, ``sample_mask``, ``generation_logprobs``, ``prev_logprobs`` (batch x
    tokens), ``prompt_lengths``, ``full_lengths``. The error of a sample is the mean over its
    valid tokens (after the first) of ``exp(|generation - prev|)``. Returns ``(figure, facts)``
    or ``None`` when no sample has a valid generated token.
    """
    import numpy as np

    token_mask = _numpy(data["token_mask"])[:, 1:].astype(np.float64)
    sample_mask = _numpy(data["sample_mask"]).astype(np.float64)
    generated = _numpy(data["generation_logprobs"])[:, 1:].astype(np.float64)
    previous = _numpy(data["prev_logprobs"])[:, 1:].astype(np.float64)
    diff = np.abs(generated - previous) * token_mask
    mask = token_mask * sample_mask[:, None]
    counts = mask.sum(axis=1)
    valid = counts > 0
    if not valid.any():
        return None
    error = np.full(len(counts), -np.inf)
    error[valid] = (np.exp(diff) * mask).sum(axis=1)[valid] / counts[valid]
    sample = int(np.argmax(error))
    # Position t of the shifted arrays predicts token t + 1: generation starts at prompt - 1.
    start = int(_numpy(data["prompt_lengths"])[sample]) - 1
    end = int(_numpy(data["full_lengths"])[sample]) - 1
    if start >= end:
        return None
    positions = np.arange(start, end)
    gen, prev, delta = generated[sample, start:end], previous[sample, start:end], diff[
        sample, start:end
    ]
    worst_abs = int(np.argmax(delta))
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.abs((np.exp(gen) - np.exp(prev)) / np.exp(gen))
    worst_rel = int(np.nanargmax(relative)) if np.isfinite(relative).any() else worst_abs
    facts = {
        "sample": float(sample),
        "token_mult_prob_error": float(error[sample]),
        "max_abs_error": float(delta[worst_abs]),
        "max_rel_error": float(relative[worst_rel]),
    }
    figure = _figure()
    ax = figure.add_subplot()
    ax.plot(positions, gen, label="logprob (inference engine)")
    ax.plot(positions, prev, label="logprob (training policy recompute)")
    ax.plot(positions, delta, label=f"abs diff (token_mult_prob_error={error[sample]:.2f})")
    ax.plot(positions[worst_abs], delta[worst_abs], "ro", markersize=8,
            label=f"Max abs error: {facts['max_abs_error']:.4f}")
    ax.plot(positions[worst_rel], delta[worst_rel], "bo", markersize=8,
            label=f"Max rel error (prob): {facts['max_rel_error']:.4f}")
    ax.set_xlabel("Token Position (starting from prompt end)")
    ax.set_ylabel("Log Probability/Difference")
    ax.legend(fontsize="small")
    return figure, facts
