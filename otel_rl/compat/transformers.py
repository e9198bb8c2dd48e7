"""otel-rl for the transformers ``Trainer`` and TRL's trainers (``GRPOTrainer``, ...): one callback.

::

    from otel_rl.compat.transformers import OtelRLCallback, timed_rewards

    otel = OtelRLCallback({"log_dir": "logs/grpo", "tensorboard_enabled": True})
    trainer = GRPOTrainer(model=..., reward_funcs=timed_rewards([accuracy]), args=...,
                          train_dataset=..., callbacks=[otel])
    otel.watch(trainer)  # TRL's completions (log_completions=True) as samples
    trainer.train()

What a run gives (docs/recipes/trl.md): the ``TrainingArguments`` and the model's config as
hyperparameters; every ``Trainer.log`` at ``state.global_step`` under transformers' own names
(``train/loss``, ``train/reward``, ``eval/loss``: the ``rewrite_logs`` of its W&B, MLflow and
TensorBoard integrations); ``timing/step`` for each optimizer step (``on_step_begin`` to
``on_step_end``), beside TRL's own ``train/step_time``; ``timing/reward/<name>`` for reward
functions wrapped with :func:`timed_rewards`; TRL's completions as the table
``train/completions`` (``eval/completions``) where a tracker keeps tables. Only the main process
(``state.is_world_process_zero``) has a Logger: transformers and TRL reduce their metrics across
processes before ``log``. The run is finished at ``on_train_end`` (status finished); a training
that raises never gets there, and :meth:`OtelRLCallback.finish` in an ``except``/``finally`` (or
leaving a ``with`` block, or the interpreter's exit) marks it failed.

transformers has no way to register a ``report_to`` name: ``report_to`` names are looked up in a
fixed table of its own and any other name is a ``ValueError``. The callback goes in
``callbacks=[...]`` (or ``trainer.add_callback``) and works beside any ``report_to``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from otel_rl.compat.common import exit_code_now
from otel_rl.compat.hf_rewards import HF_CALLBACKS, timed_reward, timed_rewards
from otel_rl.process.fork_safe_log import log as _log

if TYPE_CHECKING:
    from otel_rl.logger import Logger
    from otel_rl.telemetry.timing import PhaseTimer

__all__ = [
    "EVALUATE_TIMER", "STEP_TIMER", "OtelRLCallback", "rewrite_logs", "timed_reward",
    "timed_rewards",
]

#: The timer of each optimizer step: ``timing/step``.
STEP_TIMER = "step"
#: The timer of an evaluation, from its first prediction step to ``on_evaluate``:
#: ``timing/evaluate``; a stall report during a long evaluation names it among the open timers.
EVALUATE_TIMER = "evaluate"


def rewrite_logs(logs: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' names for ``Trainer.log`` values, as its W&B, MLflow and TensorBoard
    integrations write them: ``eval_x`` → ``eval/x``, ``test_x`` → ``test/x``, anything else
    ``train/x``."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if key.startswith("eval_"):
            out["eval/" + key[len("eval_") :]] = value
        elif key.startswith("test_"):
            out["test/" + key[len("test_") :]] = value
        else:
            out["train/" + key] = value
    return out


class OtelRLCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that turns a Trainer run into an otel-rl run.

    ``cfg`` is :class:`otel_rl.Logger`'s config (a mapping or a YAML path, docs/configuration.md);
    ``exporters`` adds tracker exporters built by the caller. The Logger is created on the main
    process when the Trainer is built (``on_init_end``) and is :attr:`logger` from then on
    (``None`` on the other processes, and before).

    ``trainer`` (or :meth:`watch` later) is the TRL trainer whose completions become samples:
    a callback is never handed its trainer, and TRL keeps the completions of a ``log`` on it.
    ``finish_on_train_end=False`` keeps the run open after training (for ``trainer.evaluate()``
    after ``train()``); :meth:`finish` then ends it.
    """

    def __init__(
        self,
        cfg: Mapping[str, Any] | str | Path | None = None,
        *,
        trainer: Any = None,
        exporters: Sequence[Any] = (),
        finish_on_train_end: bool = True,
    ) -> None:
        self.cfg = cfg
        self.exporters = tuple(exporters)
        self.finish_on_train_end = bool(finish_on_train_end)
        self.trainer = trainer
        #: The otel-rl Logger of the run (main process, from ``on_init_end``), else ``None``.
        self.logger: Logger | None = None
        self.finished = False
        self._lock = threading.Lock()
        self._params_logged = False
        self._step_timer: PhaseTimer | None = None
        self._evaluate_timer: PhaseTimer | None = None
        #: Table name → the step its completions were last logged at.
        self._tables_sent: dict[str, int] = {}
        self._warned: set[str] = set()
        HF_CALLBACKS.add(self)

    def watch(self, trainer: Any) -> OtelRLCallback:
        """Log the completions ``trainer`` (a TRL trainer with ``log_completions=True``) keeps
        at each ``log``; returns this callback."""
        self.trainer = trainer
        return self

    # ---- the Trainer's events ---------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start(state)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        logger = self._start(state)
        if logger is None:
            return
        if not self._params_logged:
            self._params_logged = True
            logger.log_hyperparams(hyperparams(args, model))
        if getattr(args, "log_completions", False) and self.trainer is None:
            self._warn_once(
                "completions",
                "otel-rl: log_completions is on but the callback does not know the trainer: "
                "TRL's completions are not logged as samples; call OtelRLCallback.watch(trainer) "
                "or pass trainer=",
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logger = self.logger
        if logger is None or self.finished:
            return
        timer = logger.timer(STEP_TIMER)
        timer.__enter__()
        self._step_timer = timer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logger = self.logger
        if logger is None or self.finished:
            return
        timer, self._step_timer = self._step_timer, None
        if timer is not None:
            timer.__exit__(None, None, None)
        # Every optimizer step is a row (its timer, and a stamp for the stall watchdog), also
        # between two ``logging_steps``; the step's logs, if any, merge into it next.
        logger.log_metrics({}, step=int(state.global_step))

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logger = self.logger
        if logger is None or self.finished or self._evaluate_timer is not None:
            return
        timer = logger.timer(EVALUATE_TIMER)
        timer.__enter__()
        self._evaluate_timer = timer

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._evaluated()

    def _evaluated(self) -> None:
        """The evaluation's timer stops: at its log (transformers logs an evaluation's metrics
        before ``on_evaluate``, and the time must join their step), else at ``on_evaluate``."""
        timer, self._evaluate_timer = self._evaluate_timer, None
        if timer is not None and not self.finished:
            timer.__exit__(None, None, None)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        logger = self.logger
        if logger is None or not logs:
            return
        if self.finished:
            self._warn_once(
                "after-finish",
                "otel-rl: Trainer logs at step %s after the run finished (on_train_end) are not "
                "logged; OtelRLCallback(finish_on_train_end=False) keeps the run open for "
                "trainer.evaluate() after train()",
                state.global_step,
            )
            return
        # An evaluation's prediction steps ran: this is its log (a training step's log never
        # comes between them and on_evaluate), and its time belongs to the same step.
        self._evaluated()
        step = int(state.global_step)
        # TRL gives None for a metric with no valid value in the interval (every reward None):
        # such a metric has no value at this step, and its row leaves it out.
        values = {k: v for k, v in rewrite_logs(logs).items() if v is not None}
        logger.log_metrics(values, step=step)
        if self.trainer is not None and getattr(args, "log_completions", False):
            mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
            self._log_completions(logger, mode, step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.logger is not None and self.finish_on_train_end:
            self.finish(exit_code=0)

    # ---- the run --------------------------------------------------------------------------

    def finish(self, exit_code: int | None = None) -> None:
        """Drain every tracker and close the run; ``exit_code != 0`` marks it failed.

        Without ``exit_code``: failed when called while an exception propagates (``except:``,
        ``finally:``; killed for Ctrl-C and SIGTERM), else finished.
        """
        code = exit_code_now() if exit_code is None else int(exit_code)
        with self._lock:
            logger, self.finished = self.logger, True
            # A step that raised never reached on_step_end: its timer has no duration.
            self._step_timer = self._evaluate_timer = None
        if logger is not None:
            logger.finish(exit_code=code)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every tracker has written what was logged (``True`` off the main
        process)."""
        return True if self.logger is None else self.logger.flush(timeout)

    def __enter__(self) -> OtelRLCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from otel_rl.process.lifecycle import exit_code_of

        self.finish(exit_code=exit_code_of(exc_type, exc))

    # ---- helpers --------------------------------------------------------------------------

    def _start(self, state: Any) -> Logger | None:
        with self._lock:
            if self.logger is not None or self.finished:
                return self.logger
            if not getattr(state, "is_world_process_zero", True):
                return None
            from otel_rl.logger import Logger

            self.logger = Logger(self.cfg, exporters=self.exporters)
            return self.logger

    def _log_completions(self, logger: Logger, mode: str, step: int) -> None:
        from otel_rl.compat.tracker_tables import submit_table

        name = f"{mode}/completions"
        if self._tables_sent.get(name) == step:
            # transformers' last log (train_runtime, ...) comes at the last step again, with the
            # same completions kept on the trainer.
            return
        table = completions_table(self.trainer, step)
        if table is None:
            self._warn_once(
                "no-completions",
                "otel-rl: %s keeps no completions TRL's way (a _logs dict with prompt, completion, "
                "rewards, advantages): completions are not logged as samples",
                type(self.trainer).__name__,
            )
            return
        if not table[1]:
            return
        self._tables_sent[name] = step
        submit_table(logger.fanout, name, step, *table)

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _log.warning(message, *args)


def hyperparams(args: Any, model: Any = None) -> dict[str, Any]:
    """The run's hyperparameters as transformers' W&B and MLflow integrations take them: the
    model's config, then the ``TrainingArguments`` over it (``args.to_dict()``: tokens hidden),
    and ``model/num_parameters``."""
    params: dict[str, Any] = {}
    config = getattr(model, "config", None)
    if config is not None:
        params.update(config if isinstance(config, dict) else config.to_dict())
    if hasattr(args, "to_dict"):
        params.update(args.to_dict())
    num_parameters = getattr(model, "num_parameters", None)
    if callable(num_parameters):
        # A model that cannot count its parameters still trains.
        with contextlib.suppress(Exception):
            params["model/num_parameters"] = int(num_parameters())
    return params


#: The columns TRL gives each completion, in its table's order (reward columns go in between).
COMPLETION_COLUMNS = ("step", "prompt", "completion")


def completions_table(trainer: Any, step: int) -> tuple[list[str], list[list[Any]]] | None:
    """``(columns, rows)`` of the completions ``trainer`` keeps for its next table, as TRL builds
    it for W&B: ``step, prompt, completion``, one column per reward function, TRL's extra
    columns, ``advantage``; conversations as ``ROLE: content`` text. ``None`` when the trainer
    keeps none this way."""
    from otel_rl.compat.tracker_tables import cell

    kept = getattr(trainer, "_logs", None)
    if not isinstance(kept, Mapping) or not {"prompt", "completion"} <= kept.keys():
        return None
    prompts = list(kept["prompt"])
    completions = list(kept["completion"])
    rewards = {str(k): list(v) for k, v in dict(kept.get("rewards") or {}).items()}
    extra = {str(k): list(v) for k, v in dict(kept.get("extra") or {}).items()}
    advantages = list(kept.get("advantages") or ())
    columns = [*COMPLETION_COLUMNS, *rewards, *extra]
    if advantages:
        columns.append("advantage")
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=False)):
        row: list[Any] = [step, _text(prompt), _text(completion)]
        row += [cell(_at(values, i)) for values in rewards.values()]
        row += [cell(_at(values, i)) for values in extra.values()]
        if advantages:
            row.append(cell(_at(advantages, i)))
        rows.append(row)
    return columns, rows


def _text(value: Any) -> str:
    from otel_rl.compat.message_samples import conversation_text

    return value if isinstance(value, str) else conversation_text(value)


def _at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else ""
