"""Tracker exporters as OTel's SDK builds them: ``OTEL_METRICS_EXPORTER=tensorboard,mlflow``.

The SDK looks each name up in the ``opentelemetry_metrics_exporter`` entry-point group, calls
the class with no arguments and wraps the instance in a ``PeriodicExportingMetricReader``
(``OTEL_METRIC_EXPORT_INTERVAL``). The entry points name attributes of this module
(``otel_rl.run.sdk_exporters:mlflow``); each resolves, on first use, to a subclass of that
tracker's exporter whose zero-argument construction reads its configuration from the environment
(:mod:`otel_rl.config.env`) and returns an exporter built by the tracker's own ``from_config``,
exactly as a ``Logger`` would build it. Any tracker in otel-rl's registry works this way.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[str, type] = {}


def sdk_exporter_class(name: str) -> type:
    """The zero-argument exporter class for the tracker registered as ``name``."""
    cls = _CLASSES.get(name)
    if cls is None:
        from otel_rl.core.errors import ConfigError
        from otel_rl.delivery.registry import exporter_class
        from otel_rl.exporters.base import TrackerExporter

        base = exporter_class(name)
        if not issubclass(base, TrackerExporter):
            raise ConfigError(
                f"OTEL_METRICS_EXPORTER={name}: {base.__module__}.{base.__qualname__} is a "
                "Tracker, and an OTel reader needs a MetricExporter: subclass "
                "otel_rl.exporters.TrackerExporter to be built this way"
            )

        def __new__(klass: type, **overrides: Any) -> Any:
            from otel_rl.config.env import config_from_env, exporter_options_from_env

            cfg = config_from_env()
            options = {**exporter_options_from_env(), **overrides}
            # No Logger attaches a spool here, so a full queue cannot wait on disk: it drops its
            # oldest record (or blocks, when export.on_full says so), without a warning.
            full = cfg.export.on_full
            options.setdefault("on_full", "block" if full == "block" else "drop_oldest")
            # An instance of ``base``, not of ``klass``: Python then skips ``__init__`` here. The
            # typed config reads as the mapping ``from_config`` takes.
            return base.from_config(cfg, **options)

        cls = type(
            f"{base.__name__}FromEnv",
            (base,),
            {"__new__": __new__, "__module__": __name__, "__doc__": f"{base.__name__} from env."},
        )
        _CLASSES[name] = cls
    return cls


def __getattr__(name: str) -> type:
    from otel_rl.delivery.registry import available_exporters

    if name.startswith("_") or name not in available_exporters():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return sdk_exporter_class(name)  # a missing optional dependency raises ConfigError here
