"""otel-rl for training loops written on accelerate: :class:`OtelRLTracker`.

::

    from accelerate import Accelerator
    from otel_rl.compat.accelerate import OtelRLTracker

    accelerator = Accelerator(log_with=[OtelRLTracker({"log_dir": "logs/run"})])
    accelerator.init_trackers("my_project", config={"lr": 1e-4})  # hyperparameters
    for step in range(100):
        ...
        accelerator.log({"loss": loss}, step=step)
    accelerator.end_training()  # drains every tracker and closes the run

The tracker runs on the main process only (accelerate's ``main_process_only``): its Logger is
created by ``init_trackers`` there and is :attr:`OtelRLTracker.tracker`
(``accelerator.get_tracker("otel_rl", unwrap=True)``), for ``timer`` and the rest.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from accelerate.tracking import GeneralTracker  # type: ignore[import-untyped]
from accelerate.tracking import on_main_process as _on_main_process

from otel_rl.compat.common import exit_code_now

if TYPE_CHECKING:
    from otel_rl.logger import Logger

__all__ = ["OtelRLTracker"]

F = TypeVar("F", bound=Callable[..., Any])


def on_main_process(method: F) -> F:
    """accelerate's ``on_main_process`` (the method runs on the main process only when the
    tracker is ``main_process_only``), with the method's type kept."""
    return cast(F, _on_main_process(method))


class OtelRLTracker(GeneralTracker):  # type: ignore[misc]
    """An ``accelerate.tracking.GeneralTracker`` writing through one :class:`otel_rl.Logger`.

    ``cfg`` is the Logger's config (a mapping or a YAML path, docs/configuration.md);
    ``exporters`` adds tracker exporters built by the caller. ``log(values, step)`` is
    ``log_metrics(values, step=step)``: values at the same step merge into one row; a call with
    ``step=None`` is a step of its own, the one after the highest logged so far (as W&B counts
    its steps), so that no value of a loop that never passes a step overwrites another. ``log``
    takes ``prefix`` and ``step_finished`` too, through
    ``accelerator.log(..., log_kwargs={"otel_rl": {...}})``.
    """

    name = "otel_rl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(
        self,
        cfg: Mapping[str, Any] | str | Path | None = None,
        *,
        exporters: Sequence[Any] = (),
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.exporters = tuple(exporters)
        self.finished = False
        self._logger: Logger | None = None
        self._last_step = -1

    @property
    def tracker(self) -> Logger | None:
        """The :class:`otel_rl.Logger` of the run (``None`` before ``init_trackers`` and off the
        main process)."""
        return self._logger

    @on_main_process
    def start(self) -> None:
        self._core()

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """``values`` as the run's hyperparameters (nested keys flattened with ``.``)."""
        self._core().log_hyperparams(values)

    @on_main_process
    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        prefix: str = "",
        step_finished: bool = False,
    ) -> None:
        if step is None:
            step = self._last_step + 1
        self._core().log_metrics(values, step=step, prefix=prefix, step_finished=step_finished)
        if not isinstance(step, bool):  # refused by the Logger, as any step it cannot use
            with contextlib.suppress(TypeError):
                self._last_step = max(self._last_step, operator.index(step))

    @on_main_process
    def finish(self, exit_code: int | None = None) -> None:
        """Drain every tracker and close the run (``accelerator.end_training()``). Without
        ``exit_code``: failed when called while an exception propagates, else finished."""
        self.finished = True
        if self._logger is not None:
            self._logger.finish(exit_code=exit_code_now() if exit_code is None else exit_code)

    def _core(self) -> Logger:
        # An accelerate whose trackers have no start() gets the Logger at the first call.
        if self._logger is None:
            from otel_rl.logger import Logger

            self._logger = Logger(self.cfg, exporters=self.exporters)
        return self._logger
