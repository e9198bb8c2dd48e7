"""The delivery process (``export.delivery: process``):
``python -m otel_rl.run.service <records fd> <status fd>``, started by the training process's
:class:`~otel_rl.delivery.service_link.ServiceLink`. Its machinery is the delivery layer's
(``otel_rl/delivery/delivery_process.py``); this entry point gives it the run's trackers, built
from the run's config as a training process builds them (:class:`RunTrackers`, here in the run
layer, above delivery)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otel_rl.config.schema import LoggerSettings
from otel_rl.core.redaction import compile_patterns
from otel_rl.delivery.delivery_process import main
from otel_rl.delivery.options import ExportOptions
from otel_rl.run.trackers import RunTrackers


def run_trackers(settings: Mapping[str, Any]) -> RunTrackers:
    """The trackers the training process's config enables, here where they run (``here``)."""
    cfg: LoggerSettings = settings["cfg"]  # the training process's, launch included
    return RunTrackers(
        cfg, (), run_id=settings["run_id"], here=True,
        options=ExportOptions.from_section(cfg.export),
        redaction=compile_patterns(tuple(cfg.redaction.extra_patterns)),
    )  # fmt: skip


if __name__ == "__main__":
    main(run_trackers)
