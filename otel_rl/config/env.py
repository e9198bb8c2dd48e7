"""Configuration from environment variables, for exporters that OTel's SDK builds itself.

``OTEL_METRICS_EXPORTER=tensorboard,mlflow opentelemetry-instrument python train.py`` makes the
SDK construct each exporter with no arguments, so everything comes from the environment:

- ``OTEL_RL_CONFIG``: a logger config file (YAML, as for ``Logger(path)``), for any option;
- ``OTEL_RL_LOG_DIR``: ``log_dir`` (overrides the file's), default ``logs``;
- ``OTEL_RL_STEP_GAUGE``: the name of a gauge whose last value is the training step; without
  it, rows go on the ``otel_rl/elapsed_s`` axis (whole seconds since the exporter started);
- each tracker's own variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...).

See docs/backends/otel-metrics-exporter.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from otel_rl.config.loading import load_config, resolve_settings

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings

CONFIG_ENV = "OTEL_RL_CONFIG"
LOG_DIR_ENV = "OTEL_RL_LOG_DIR"
STEP_GAUGE_ENV = "OTEL_RL_STEP_GAUGE"


def config_from_env(environ: Mapping[str, str] | None = None) -> LoggerSettings:
    """The resolved (typed) logger config that ``OTEL_RL_CONFIG`` and ``OTEL_RL_LOG_DIR``
    describe."""
    environ = os.environ if environ is None else environ
    source = environ.get(CONFIG_ENV)
    user = load_config(source) if source else {}
    if environ.get(LOG_DIR_ENV):
        user["log_dir"] = environ[LOG_DIR_ENV]
    return resolve_settings(user)


def exporter_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for a tracker exporter fed by a periodic reader (time axis)."""
    environ = os.environ if environ is None else environ
    gauge = environ.get(STEP_GAUGE_ENV)
    # Instrument names are lower-cased by the SDK; match the gauge the way it is exported.
    return {"step_gauge": gauge.strip().lower()} if gauge and gauge.strip() else {}
