"""Validation samples: the best and worst conversations by reward, printed with ``rich`` and
handed to the trackers as a table.

``print_message_log_samples`` keeps NeMo RL's signature. It prints a reward summary (count, mean,
std, min, max and a bar per distinct reward level) and one panel per chosen sample — the highest
rewards first, then the lowest — and, when an otel-rl NeMo RL ``Logger`` is alive in the process
(or one is passed as ``logger=``), logs the same samples as the table ``validation/samples``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

#: Columns of the samples table sent to the trackers.
SAMPLE_COLUMNS = ("step", "rank", "index", "reward", "conversation")


def rewards_as_floats(rewards: Any) -> list[float]:
    """Numbers from a list, numpy array or tensor (of any shape) as a flat list of floats."""
    if hasattr(rewards, "detach"):
        rewards = rewards.detach().float().cpu()
    if hasattr(rewards, "reshape") and hasattr(rewards, "tolist"):
        rewards = rewards.reshape(-1).tolist()
    return [float(r) for r in rewards]


def pick_best_worst(rewards: Sequence[float], num_samples: int) -> list[tuple[str, int]]:
    """``[(label, index)]``: the ``ceil(n/2)`` highest rewards, then the ``floor(n/2)`` lowest
    (no sample twice; ties keep the original order). Labels are ``best 1``, ``worst 1``, ..."""
    n = min(max(num_samples, 0), len(rewards))
    order = sorted(range(len(rewards)), key=lambda i: (-_sortable(rewards[i]), i))
    best = order[: (n + 1) // 2]
    chosen = set(best)
    lowest = sorted(range(len(rewards)), key=lambda i: (_sortable(rewards[i]), i))
    worst = [i for i in lowest if i not in chosen][: n // 2]
    return [(f"best {k + 1}", i) for k, i in enumerate(best)] + [
        (f"worst {k + 1}", i) for k, i in enumerate(worst)
    ]


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def reward_summary(rewards: Sequence[float]) -> dict[str, float]:
    finite = [r for r in rewards if math.isfinite(r)]
    if not finite:
        return {"count": float(len(rewards)), "mean": math.nan, "std": math.nan,
                "min": math.nan, "max": math.nan}
    mean = math.fsum(finite) / len(finite)
    var = math.fsum((r - mean) ** 2 for r in finite) / len(finite)
    return {"count": float(len(rewards)), "mean": mean, "std": math.sqrt(var),
            "min": min(finite), "max": max(finite)}


def conversation_text(message_log: Any) -> str:
    """``ROLE: content`` per message of a message log (dicts with ``role`` and ``content``)."""
    if isinstance(message_log, str):
        return message_log
    parts = []
    for message in message_log or ():
        if isinstance(message, Mapping) and "role" in message and "content" in message:
            content = message["content"]
            parts.append(f"{str(message['role']).upper()}: {_text(content)}")
    return "\n\n".join(parts)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal content lists: keep their text parts
        texts = [c.get("text", "") for c in content if isinstance(c, Mapping)]
        if any(texts):
            return "\n".join(t for t in texts if t)
    return str(content)


def samples_rows(
    message_logs: Sequence[Any], rewards: Sequence[float], picks: Sequence[tuple[str, int]],
    step: int,
) -> list[tuple[Any, ...]]:
    return [
        (int(step), label, index, rewards[index], conversation_text(message_logs[index]))
        for label, index in picks
    ]


def print_message_log_samples(
    message_logs: list[Any],
    rewards: list[float],
    num_samples: int = 5,
    step: int = 0,
    *,
    logger: Any = None,
    console: Any = None,
) -> None:
    """Print the best/worst ``num_samples`` conversations with a reward summary, and log them
    to the trackers of ``logger`` (default: the live otel-rl NeMo RL ``Logger``, if any)."""
    from otel_rl.compat.nemo_utils import configure_rich_logging

    configure_rich_logging(level="INFO")
    from rich.console import Console

    console = console or Console()
    if num_samples <= 0:
        return
    if not message_logs or rewards is None or len(rewards) == 0:
        console.print("[yellow]No message logs or rewards to display[/]")
        return
    values = rewards_as_floats(rewards)
    if len(values) != len(message_logs):
        raise ValueError(
            f"{len(message_logs)} message logs but {len(values)} rewards: they must match"
        )
    picks = pick_best_worst(values, num_samples)
    render_samples(console, message_logs, values, picks, step)
    if logger is None:
        from otel_rl.compat.nemo_rl import active_logger

        logger = active_logger()
    if logger is not None:
        logger.log_samples_table(samples_rows(message_logs, values, picks, step), step)


def render_samples(
    console: Any,
    message_logs: Sequence[Any],
    rewards: Sequence[float],
    picks: Sequence[tuple[str, int]],
    step: int,
) -> None:
    from rich.box import ROUNDED
    from rich.markup import escape
    from rich.panel import Panel

    console.rule(f"[bold]Validation samples, step {step}")
    summary = reward_summary(rewards)
    lines = [
        f"samples: [bold]{int(summary['count'])}[/]   mean: [bold]{summary['mean']:.4f}[/]   "
        f"std: {summary['std']:.4f}   min: {summary['min']:.4f}   max: {summary['max']:.4f}",
        "",
    ]
    levels = Counter(r for r in rewards if math.isfinite(r))
    if len(levels) <= 12:  # discrete rewards: one bar per level
        widest = max(levels.values(), default=1)
        for level in sorted(levels, reverse=True):
            count = levels[level]
            bar = "█" * max(1, round(20 * count / widest))
            lines.append(f"[{_color(level)}]{level:>9.4f} {bar}[/] {count}")
    console.print(Panel("\n".join(lines), title="[bold]Rewards", box=ROUNDED))
    for label, index in picks:
        reward = rewards[index]
        body = escape(conversation_text(message_logs[index])) or "[italic]no message content[/]"
        title = f"[bold]{label}[/] | sample {index} | reward {reward:.4f}"
        console.print(Panel(body, title=title, border_style=_color(reward), box=ROUNDED))
    console.rule()


def _color(reward: float) -> str:
    if math.isnan(reward):
        return "magenta"
    if reward > 0.5:
        return "bright_green"
    if reward > 0:
        return "green"
    if reward == 0:
        return "white"
    return "orange3" if reward > -0.5 else "red"
