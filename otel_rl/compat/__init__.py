"""Drop-in replacements for the loggers RL frameworks ship, built on :class:`otel_rl.Logger`.

- :mod:`otel_rl.compat.nemo_rl`: ``nemo_rl.utils.logger`` and ``nemo_rl.utils.timer``
  (``Logger``, ``LoggerConfig``, ``Timer``, ``TimeoutChecker``, ``flatten_dict``,
  ``print_message_log_samples``, ``log_container_init_timing``, ...).
- :mod:`otel_rl.compat.verl`: ``verl.utils.tracking`` (``Tracking``,
  ``ValidationGenerationsLogger``, ``FileLogger``, ``ClearMLLogger``).
- :mod:`otel_rl.compat.transformers`: ``OtelRLCallback``, a ``TrainerCallback`` for the
  transformers ``Trainer`` and TRL's trainers; :mod:`otel_rl.compat.accelerate`:
  ``OtelRLTracker``, an accelerate ``GeneralTracker`` (these two import transformers/accelerate).

Switching is one import line; see docs/migrating.md for what differs and what is not supported.
Importing this package loads nothing heavy.
"""
