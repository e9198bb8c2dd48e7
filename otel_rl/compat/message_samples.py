"""Validation samples: NeMo RL's ``print_message_log_samples`` screen, and the same samples handed
to the trackers as a table.

The printed output is NeMo RL's, line for line: a ``TRAINING STEP <step>`` rule, the ``Reward
Statistics`` panel (batch summary and one bar per distinct reward level), ``Sample
Conversations`` with one panel per chosen sample titled ``<emoji> Sample <k> | Reward: <r>``
(1-based, 4 decimals), and an ``End of Samples`` rule. The samples are chosen as NeMo RL chooses
them: all of them when there are at most ``num_samples``, else the ``n // 2`` highest rewards,
the ``n // 2`` lowest and, for an odd ``n``, the median one (``n == 1``: the highest).

Added after that, nothing printed: when an otel-rl NeMo RL ``Logger`` is alive in the process (or
one is passed as ``logger=``), the same samples are logged as the table ``validation/samples``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Columns of the samples table sent to the trackers (``sample`` is the panel's number).
SAMPLE_COLUMNS = ("step", "sample", "index", "reward", "conversation")

#: Printed by NeMo RL when there is nothing to show.
NOTHING_TO_SHOW = "⚠️  No message logs or rewards to display"

#: Role → colour of its label and text, NeMo RL's palette.
_ROLE_COLORS = {"SYSTEM": "#8A2BE2", "USER": "#4682B4", "ASSISTANT": "#2E8B57"}


def rewards_as_floats(rewards: Any) -> list[float]:
    """Numbers from a list, numpy array or tensor (of any shape) as a flat list of floats."""
    if hasattr(rewards, "detach"):
        rewards = rewards.detach().float().cpu()
    if hasattr(rewards, "reshape") and hasattr(rewards, "tolist"):
        rewards = rewards.reshape(-1).tolist()
    return [float(r) for r in rewards]


def pick_samples(rewards: Sequence[float], num_samples: int) -> list[int]:
    """Indices of the samples to show, in the order NeMo RL shows them.

    At most ``num_samples`` samples: all of them (in their order) when that is every sample;
    else the ``n // 2`` highest rewards (highest first), then the ``n // 2`` lowest (in the same
    descending order), then for an odd ``n`` the sample at the middle of that order. A single
    sample is the highest. Ties keep the original order; NaN ranks lowest.
    """
    count = len(rewards)
    n = min(max(num_samples, 0), count)
    if n == count:
        return list(range(count))
    order = sorted(range(count), key=lambda i: _sortable(rewards[i]), reverse=True)
    if n == 1:
        return order[:1]
    half = n // 2
    picks = order[:half] + order[count - half :]
    if n % 2:
        picks.append(order[count // 2])
    return picks


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def conversation_text(message_log: Any) -> str:
    """``ROLE: content`` per message of a message log (dicts with ``role`` and ``content``)."""
    if isinstance(message_log, str):
        return message_log
    return "\n\n".join(
        f"{role}: {content}" for role, content in _messages(message_log)
    )


def _messages(message_log: Any) -> list[tuple[str, str]]:
    """``(ROLE, text)`` of each message that has a role and content, as NeMo RL shows them."""
    out = []
    for message in message_log or ():
        if isinstance(message, Mapping) and "role" in message and "content" in message:
            out.append((str(message["role"]).upper(), _text(message["content"])))
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal content lists: keep their text parts
        texts = [c.get("text", "") for c in content if isinstance(c, Mapping)]
        if any(texts):
            return "\n".join(t for t in texts if t)
    return str(content)


def samples_rows(
    message_logs: Sequence[Any], rewards: Sequence[float], picks: Sequence[int], step: int
) -> list[tuple[Any, ...]]:
    return [
        (int(step), number, index, rewards[index], conversation_text(message_logs[index]))
        for number, index in enumerate(picks, start=1)
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
    """Print NeMo RL's reward statistics and sample panels, and log the samples to the trackers
    of ``logger`` (default: the live otel-rl NeMo RL ``Logger``, if any).

    ``console`` (an otel-rl addition) is the ``rich`` console to print on; by default a new one
    on stdout, as NeMo RL does. Message logs and rewards of different lengths are a
    ``ValueError``.
    """
    from otel_rl.compat.nemo_utils import configure_rich_logging

    configure_rich_logging(level="INFO")
    if not message_logs or rewards is None or len(rewards) == 0:
        if console is None:
            print(NOTHING_TO_SHOW)
        else:
            console.print(NOTHING_TO_SHOW, markup=False, emoji=False)
        return
    if num_samples <= 0:
        return
    values = rewards_as_floats(rewards)
    if len(values) != len(message_logs):
        raise ValueError(
            f"{len(message_logs)} message logs but {len(values)} rewards: "
            "Message logs and rewards must have the same length"
        )
    picks = pick_samples(values, num_samples)
    if console is None:
        from rich.console import Console

        console = Console()
    render_samples(console, message_logs, values, picks, step)
    if logger is None:
        from otel_rl.compat.live import NEMO_RL_LOGGERS

        logger = NEMO_RL_LOGGERS.latest()
    if logger is not None:
        logger.log_samples_table(samples_rows(message_logs, values, picks, step), step)


def render_samples(
    console: Any,
    message_logs: Sequence[Any],
    rewards: Sequence[float],
    picks: Sequence[int],
    step: int,
) -> None:
    """NeMo RL's screen: the step rule, the reward statistics panel, the sample panels."""
    from rich.box import ROUNDED
    from rich.panel import Panel

    console.rule(f"[bold bright_white on purple4]TRAINING STEP {step}")
    console.print(
        Panel(
            _statistics_text(rewards),
            title="[bold purple4]Reward Statistics",
            border_style="purple4",
            box=ROUNDED,
        )
    )
    console.print("\n[bold bright_white]Sample Conversations[/]")
    for number, index in enumerate(picks, start=1):
        reward = rewards[index]
        body = "\n\n".join(
            _message_markup(role, content) for role, content in _messages(message_logs[index])
        )
        if not body.strip():
            body = "[italic]No message content to display[/]"
        title = f"[bold]{_emoji(reward)} Sample {number} | Reward: {reward:.4f}"
        console.print(Panel(body, title=title, border_style=_color(reward), box=ROUNDED))
        console.print("")
    console.rule("[bold bright_white on purple4]End of Samples")


def _statistics_text(rewards: Sequence[float]) -> str:
    counts: dict[float, int] = {}
    for reward in rewards:
        counts[reward] = counts.get(reward, 0) + 1
    widest = max(counts.values())
    lines = [
        "[bold]Batch Summary[/]",
        f"Total Samples: [bright_yellow]{len(rewards)}[/]",
        f"Avg Reward: [bright_blue]{sum(rewards) / len(rewards):.4f}[/]",
        f"Min: [orange3]{min(rewards):.4f}[/] | Max: [bright_green]{max(rewards):.4f}[/]",
        "",
        "[bold bright_white]Discrete Reward Levels:[/]",
    ]
    for level in sorted(counts, key=_sortable):
        count = counts[level]
        color = _color(level)
        bar = _bar_char(level) * int(count / widest * 20)
        lines.append(
            f"{_emoji(level)} Reward [bold {color}]{level:.4f}[/]: [{color}]{bar}[/] "
            f"({count} samples)"
        )
    return "\n".join(lines)


def _message_markup(role: str, content: str) -> str:
    from rich.markup import escape

    color = _ROLE_COLORS.get(role)
    label = f"[bold {color}]{role}:[/]" if color else f"[bold]{role}:[/]"
    # Escaped whole: text that looks like markup ("[/done]", "list[int]") is shown as written.
    return f"{label} [{color or 'bright_white'}]{escape(content)}[/]"


def _emoji(reward: float) -> str:
    if reward >= 0.7:
        return "🔥"
    if reward >= 0.3:
        return "✨"
    if reward >= -0.5:
        return "🟠"
    return "🔴"


def _color(reward: float) -> str:
    if reward > 0.5:
        return "bright_green"
    if reward > 0:
        return "green"
    if reward == 0:
        return "bright_white"
    if reward > -0.5:
        return "orange3"
    return "red"


def _bar_char(reward: float) -> str:
    if reward == 0:
        return "▒"
    if -0.5 < reward < 0:
        return "▓"
    return "█"
