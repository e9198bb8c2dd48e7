"""The shared shape of trackers whose SDK starts a run with ``init(**init_kwargs)``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from otel_rl.core.failures import RowRejected
from otel_rl.core.redaction import Patterns, redact_init_kwargs
from otel_rl.exporters.base import TrackerExporter

#: The run's config keys that record a relaunched run's attempts (as MLflow's tags do): the
#: number of the latest attempt, and the first step of each attempt after the first ("501,720").
ATTEMPTS_KEY, RESUME_STEPS_KEY = "otel_rl.attempts", "otel_rl.resume_steps"


def attempts_config(attempt: int, step: int, earlier: object) -> dict[str, Any]:
    """The config that records ``attempt`` beginning at ``step``, after the resume steps
    ``earlier`` (the run's ``otel_rl.resume_steps`` so far, if it has any)."""
    steps = [s for s in str(earlier or "").split(",") if s.strip()]
    return {ATTEMPTS_KEY: attempt, RESUME_STEPS_KEY: ",".join([*steps, str(step)])}


class SdkRunExporter(TrackerExporter):
    """A tracker whose SDK starts a run with ``init(**init_kwargs)``: W&B, SwanLab, Trackio.

    ``init_kwargs`` are the tracker's config section; its ``config`` and free-text fields reach
    the tracker's files as they are, so they go through the same redaction as
    ``log_hyperparams`` (docs/security.md). ``run`` is the SDK's own run object once the tracker
    is open, for power users.
    """

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.init_kwargs = redact_init_kwargs(dict(init_kwargs or {}))
        self.run: Any = None
        super().__init__(**kwargs)

    def continue_run(self, resume_config: Mapping[str, Any]) -> None:
        self.init_kwargs.update(resume_config.get(self.name) or {})

    def redact_own_config(self, patterns: Patterns) -> None:
        """``init_kwargs`` reach the SDK only when the tracker opens, after :meth:`attach`."""
        self.init_kwargs = redact_init_kwargs(self.init_kwargs, extra_patterns=patterns)

    @contextlib.contextmanager
    def refused_content(self) -> Iterator[None]:
        """The SDK's ``TypeError``/``ValueError`` on a row is its verdict on the content: the row
        is set aside (:class:`RowRejected`), never retried."""
        try:
            yield
        except (TypeError, ValueError) as exc:
            raise RowRejected(f"{self.name} refused the row: {exc}") from exc
