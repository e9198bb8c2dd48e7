"""Reward functions timed as their own phase: ``timing/reward/<name>`` in each step's row, and an
open timer a stall report names while one hangs.

TRL times reward functions itself only for W&B, MLflow and Trackio (its ``profiling_context``),
with no hook another tracker could use; wrapping the function is the way in. The wrapper keeps
the function's name (TRL names its reward columns and metrics after it) and its kind (an ``async``
function stays one: TRL runs those concurrently on its own event loop). It finds the Logger of
the live :class:`~otel_rl.compat.transformers.OtelRLCallback` when it is called, so it can be
built before the callback and the trainer; where no callback has a Logger (another rank than the
main one, or no callback at all) it calls the function untimed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from otel_rl.compat.live import LiveRegistry

__all__ = ["REWARD_TIMER_PREFIX", "timed_reward", "timed_rewards"]

#: A reward function ``f`` is timed as ``timing/reward/<f.__name__>``.
REWARD_TIMER_PREFIX = "reward/"

#: Live ``OtelRLCallback`` objects (their ``logger`` is ``None`` off the main process).
HF_CALLBACKS: LiveRegistry[Any] = LiveRegistry()


def _live_logger() -> Any:
    callback = HF_CALLBACKS.latest()
    return None if callback is None else callback.logger


def reward_name(func: Callable[..., Any]) -> str:
    """The name TRL gives a reward function: a ``functools.partial`` is named after the function
    it wraps, a callable object after its class."""
    while isinstance(func, functools.partial):
        func = func.func
    return str(getattr(func, "__name__", type(func).__name__))


def timed_reward(func: Any, name: str | None = None) -> Any:
    """``func`` timed into ``timing/reward/<name>`` (default: the name TRL gives it) each time it
    is called. What is not a Python callable (a reward model, a model id string) is returned as it
    is: TRL runs those itself. A callable that is an ``nn.Module`` is a reward model too."""
    if not callable(func) or isinstance(func, str) or _is_torch_module(func):
        return func
    label = REWARD_TIMER_PREFIX + (name or reward_name(func))
    # An async callable object counts as async too, as TRL tells them apart.
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):

        @functools.wraps(func)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            logger = _live_logger()
            if logger is None:
                return await func(*args, **kwargs)
            with logger.timer(label):
                return await func(*args, **kwargs)

        timed_async.__name__ = label.removeprefix(REWARD_TIMER_PREFIX)
        return timed_async

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        logger = _live_logger()
        if logger is None:
            return func(*args, **kwargs)
        with logger.timer(label):
            return func(*args, **kwargs)

    # TRL names the reward after ``__name__``; a callable object has none to copy.
    timed.__name__ = label.removeprefix(REWARD_TIMER_PREFIX)
    return timed


def timed_rewards(funcs: Any) -> Any:
    """:func:`timed_reward` applied to one reward function or to each of a list, as
    ``GRPOTrainer(reward_funcs=...)`` takes them."""
    if isinstance(funcs, Sequence) and not isinstance(funcs, str):
        return [timed_reward(f) for f in funcs]
    return timed_reward(funcs)


def _is_torch_module(obj: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # an nn.Module means torch is imported already
    return torch is not None and isinstance(obj, torch.nn.Module)
