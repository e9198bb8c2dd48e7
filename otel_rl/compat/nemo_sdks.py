"""The SDKs NeMo RL's logger module imports at its top, as the drop-in's classes find them.

NeMo RL's ``nemo_rl.utils.logger`` has ``wandb``, ``swanlab``, ``mlflow``, ``ray``, ``requests``,
``plt``, ``SummaryWriter``, ``threading`` and ``time`` as attributes, and tests patch them there
(``nemo_rl.utils.logger.wandb``). In the drop-in they are attributes of
:mod:`otel_rl.compat.nemo_rl`, imported on first access (importing the drop-in stays light), and
the classes that use them (:mod:`otel_rl.compat.nemo_backends`,
:mod:`otel_rl.compat.nemo_gpu_monitor`) look each one up at each use with :func:`sdk`, on the
module that holds them: so patching ``otel_rl.compat.nemo_rl.wandb`` reaches those classes.

That module is below none of them: it names itself here when it is imported
(:func:`hold_sdks_on`), so that this module, and the classes, never import it. Before it is
imported (the classes used on their own), the SDKs are this module's own attributes.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from types import ModuleType
from typing import Any

__all__ = ["LAZY_SDKS", "hold_sdks_on", "imported_sdk", "sdk"]

# threading and time are attributes here as in NeMo RL's module (the GPU monitor's clock).
_THREADING, _TIME = threading, time

#: The SDKs imported on first access: attribute → (module, name in it or None).
LAZY_SDKS: dict[str, tuple[str, str | None]] = {
    "wandb": ("wandb", None),
    "swanlab": ("swanlab", None),
    "mlflow": ("mlflow", None),
    "ray": ("ray", None),
    "requests": ("requests", None),
    "plt": ("matplotlib.pyplot", None),
    "SummaryWriter": ("torch.utils.tensorboard", "SummaryWriter"),
}

_holder: ModuleType = sys.modules[__name__]


def hold_sdks_on(module: ModuleType) -> None:
    """Look the SDKs up on ``module`` from now on (the drop-in, as it is imported)."""
    global _holder
    _holder = module


def sdk(name: str) -> Any:
    """The SDK module (or class, or ``time``/``threading``) ``name`` as its holder has it now."""
    return getattr(_holder, name)


def imported_sdk(name: str) -> Any:
    """Import the SDK attribute ``name`` (one of :data:`LAZY_SDKS`); ``KeyError`` for others."""
    module_name, attribute = LAZY_SDKS[name]
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def __getattr__(name: str) -> Any:
    if name not in LAZY_SDKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = imported_sdk(name)
    globals()[name] = value
    return value
