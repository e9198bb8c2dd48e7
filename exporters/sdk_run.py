"""The shared shape of trackers whose SDK starts a run with ``init(**init_kwargs)``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from otel_rl.core.failures import RowRejected
from otel_rl.core.redaction import Patterns, redact_init_kwargs
from otel_rl.exporters.base import TrackerExporter


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
