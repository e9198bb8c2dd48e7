"""The step still being logged, copied to the spools while the training loop works on it.

A step is handed to the trackers when the next one starts. Without a copy, a crash during a long
step (minutes of generation) would lose the previous ``log_metrics`` calls of the current step.
This thread takes a snapshot of that step every half ``export.fsync_interval`` when it changed
and hands it to every spooled exporter as a *provisional* batch: it is written to the spool only,
never to a tracker, and ``otel-rl replay`` delivers it only if the step was never sealed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from otel_rl.core.records import StepBatch
from otel_rl.delivery.fanout import Delivery, Fanout
from otel_rl.process.fork_safe_log import log as _log


class PendingStepCheckpointer:
    """A daemon thread calling ``snapshot()`` every ``interval`` seconds and submitting what it
    returns (a provisional :class:`StepBatch`, or ``None`` when nothing changed)."""

    def __init__(
        self,
        interval: float,
        snapshot: Callable[[], StepBatch | None],
        fanout: Fanout,
    ) -> None:
        self._interval = max(0.01, interval)
        self._snapshot = snapshot
        self._fanout = fanout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self._fanout.select(_spooled) or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="otel-rl-checkpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self._interval):
            try:
                batch = self._snapshot()
                if batch is None:
                    continue
                self._fanout.send(batch, to=_spooled)
            except Exception as exc:  # never end the thread: the next snapshot may work
                if not warned:
                    warned = True
                    _log.warning("otel-rl: cannot checkpoint the pending step: %s", exc)


def _spooled(delivery: Delivery) -> bool:
    """A checkpoint is for the spools only: trackers without one never see it."""
    return delivery.spool_dir is not None
