"""A NeMo RL ``LoggerInterface`` fed through a delivery channel of its own.

The drop-in ``Logger`` hands every ``log_metrics``/``log_hyperparams``/``log_histogram``/
``log_plot`` call to a ``LoggerInterface`` it did not build from otel-rl's trackers (a team's own
subclass appended to ``logger.loggers``, or a backend class put in place of NeMo RL's name) as an
:class:`InterfaceCall` on an :class:`InterfaceExporter`: the same
:class:`~otel_rl.delivery.channel.Channel` every otel-rl tracker writes through. The call is made
on that channel's worker thread, in order; the training thread only queues it. A logger that
raises loses that one call (a warning, counted in ``stats["rejected"]``) and gets the next; a
slow one falls behind on its own, and past ``queue_size`` waiting calls the oldest is dropped (a
warning, ``stats["lost"]["queue_full"]``) rather than the training loop waiting. The calls hold
live objects (figures, tensors): they are delivered from memory, never spooled to disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from otel_rl.core.failures import Failure
from otel_rl.core.records import Record
from otel_rl.delivery.options import ExportOptions
from otel_rl.exporters.base import TrackerExporter

__all__ = ["METHODS", "InterfaceCall", "InterfaceExporter"]

#: The ``LoggerInterface`` methods a call may name.
METHODS = ("log_metrics", "log_hyperparams", "log_histogram", "log_plot")

#: Calls waiting for one logger before the oldest is dropped.
QUEUE_SIZE = 10_000


@dataclass(frozen=True)
class InterfaceCall(Record):
    """One call of a ``LoggerInterface`` method, with its arguments as NeMo RL passes them."""

    kind: ClassVar[str] = "nemo_rl_call"

    method: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"not a LoggerInterface method: {self.method!r}")

    def deliver_to(self, exporter: Any) -> None:
        exporter.call(self)

    def encode(self) -> dict[str, Any]:
        raise TypeError("LoggerInterface calls hold live objects and are not spooled")

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Record:
        raise TypeError("LoggerInterface calls are not spooled")


class InterfaceExporter(TrackerExporter):
    """Delivers :class:`InterfaceCall` records to ``backend`` on this exporter's worker thread;
    at shutdown, calls ``backend.finish()`` when it has one."""

    name: ClassVar[str] = "nemo_rl_logger"

    def __init__(
        self, backend: Any, *, queue_size: int = QUEUE_SIZE, shutdown_timeout: float | None = None
    ) -> None:
        # Per instance, before the channel reads it: warnings name the logger.
        object.__setattr__(self, "name", f"nemo_rl logger {type(backend).__name__}")
        # The training loop never waits for a user's logger: a full queue drops the oldest call.
        super().__init__(queue_size=queue_size, on_full="drop_oldest")
        self.backend = backend
        # What the run's end says of calls left: in the user's terms, the Logger's deadline
        # (``export.shutdown_timeout``, of which finish() gives it what is left) and why they
        # are lost (there is no spool to turn on).
        self.delivery.memory_only = (
            "a LoggerInterface's calls hold live objects (figures, tensors) and are never spooled"
        )
        if shutdown_timeout is not None:
            self.delivery.attach(ExportOptions(shutdown_timeout=shutdown_timeout), None, None)

    def call(self, record: InterfaceCall) -> None:
        getattr(self.backend, record.method)(*record.args)

    def write_step(self, step: int, rows: Mapping[str, Any], batch: Any) -> None:
        raise TypeError(f"{self.name} takes LoggerInterface calls, not step rows")

    def classify_error(self, exc: BaseException, phase: str) -> Failure:
        # A user's logger that raises on one call still gets the next ones.
        if phase == "write":
            return Failure("record", exc, "the call is skipped; the logger gets the next ones")
        return super().classify_error(exc, phase)

    def close(self, exit_code: int) -> None:
        finish = getattr(self.backend, "finish", None)
        if callable(finish):
            finish()
