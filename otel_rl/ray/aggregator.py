"""MetricsAggregator: a named Ray actor that collects worker snapshots for the driver.

Workers push ``WorkerMetrics.snapshot()`` results fire-and-forget; the driver drains them once
per step and logs them with ``Logger.log_worker_metrics``::

    aggregator = MetricsAggregator.start()                 # driver, once
    ...                                                     # worker (any Ray actor or task):
    MetricsAggregator.connect().push(worker.snapshot(step=step))
    ...                                                     # driver, each step:
    logger.log_worker_metrics(aggregator.drain(step, expect=n_workers), step=step)

A push never waits for the actor: it submits the call and returns. A dead or missing aggregator
costs the worker one failed name lookup per ``retry_interval`` seconds; snapshots pushed
meanwhile are dropped and counted in ``stats``.

A process that pushed also tells the aggregator, every :data:`BEAT_INTERVAL` seconds while they
change, which timers are open in it (``WorkerMetrics`` timers and the drop-ins' timers), from a
daemon thread: a stall report on the driver names the timers each worker was inside when the run
stopped (:meth:`MetricsAggregator.open_timers`), even when the worker is stuck and pushes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading
import time
from typing import Any

DEFAULT_NAME = "otel_rl.metrics_aggregator"
#: Seconds between two reports of a worker's open timers (sent only when they changed, or every
#: ten intervals as a sign of life).
BEAT_INTERVAL = 2.0

#: Push results a worker keeps to learn, later and without waiting, that the actor is gone.
_MAX_PENDING = 256


class MetricsAggregator:
    """A handle on the aggregator actor, usable from the driver and from workers (picklable:
    it travels by name and looks the actor up where it is used)."""

    def __init__(
        self,
        name: str = DEFAULT_NAME,
        namespace: str | None = None,
        *,
        handle: Any = None,
        retry_interval: float = 5.0,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.retry_interval = float(retry_interval)
        self._handle = handle
        self._next_lookup = 0.0
        self._pending: collections.deque[Any] = collections.deque()
        #: pushed: calls submitted; failed: calls that reached a dead actor; dropped: snapshots
        #: not sent because no aggregator was reachable.
        self.stats = {"pushed": 0, "failed": 0, "dropped": 0}

    @classmethod
    def start(
        cls,
        name: str = DEFAULT_NAME,
        namespace: str | None = None,
        max_snapshots: int = 10_000,
    ) -> MetricsAggregator:
        """Start the named actor (or attach to it if it already runs); call on the driver.

        It takes no CPU slot. It keeps at most ``max_snapshots`` undrained snapshots, dropping
        the oldest (counted in :meth:`actor_stats`).
        """
        import ray

        actor = ray.remote(_AggregatorActor).options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
        )
        return cls(name, namespace, handle=actor.remote(max_snapshots))

    @classmethod
    def connect(cls, name: str = DEFAULT_NAME, namespace: str | None = None) -> MetricsAggregator:
        """A handle for a worker; the actor is looked up on the first push."""
        return cls(name, namespace)

    # ---- worker side ----------------------------------------------------------------------------

    def push(self, snapshot: dict[str, Any]) -> bool:
        """Send ``snapshot`` without waiting; ``False`` if it was dropped (no aggregator)."""
        try:
            self._reap()
            handle = self._resolve()
            if handle is None:
                self.stats["dropped"] += 1
                return False
            self._pending.append(handle.push.remote(snapshot))
            if len(self._pending) > _MAX_PENDING:
                self._pending.popleft()
            self.stats["pushed"] += 1
            _Heartbeat.ensure(self, snapshot)
            return True
        except Exception:  # a worker must survive whatever happens to the aggregator
            self._forget()
            self.stats["dropped"] += 1
            return False

    # ---- driver side ----------------------------------------------------------------------------

    def drain(
        self, step: int | None = None, expect: int = 0, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Take the snapshots pushed for ``step`` or earlier (untagged ones too; all if ``step``
        is ``None``); later ones stay for a later drain.

        Pushes travel asynchronously, so a drain can run before the last ones arrive: with
        ``expect=n`` it waits (up to ``timeout`` seconds) until ``n`` snapshots of ``step`` are
        there (tagged with it, or untagged); a late one of an earlier step is taken too, but
        does not count towards ``n``.
        """
        import ray

        handle = self._resolve(force=True)
        if handle is None:
            raise RuntimeError(f"no metrics aggregator named {self.name!r} is running")
        drained = ray.get(handle.drain.remote(step, int(expect), float(timeout)))
        return list(drained)

    def actor_stats(self) -> dict[str, int]:
        """The actor's counters: ``received``, ``drained``, ``dropped`` (buffer full), ``held``."""
        import ray

        handle = self._resolve(force=True)
        if handle is None:
            raise RuntimeError(f"no metrics aggregator named {self.name!r} is running")
        stats: dict[str, int] = ray.get(handle.stats.remote())
        return stats

    def open_timers(self, timeout: float = 5.0) -> dict[str, Any]:
        """``{worker: {"timers": {thread: [[name, seconds open], ...]}, "at": unix time}}``: the
        timers open in each process that pushed, as it last reported them."""
        import ray

        handle = self._resolve(force=True)
        if handle is None:
            raise RuntimeError(f"no metrics aggregator named {self.name!r} is running")
        reported: dict[str, Any] = ray.get(handle.open_timers.remote(), timeout=timeout)
        return reported

    def kill(self) -> None:
        """Stop the actor (undrained snapshots are lost)."""
        import ray

        handle = self._resolve(force=True)
        if handle is not None:
            ray.kill(handle)
        self._forget()

    # ---- internals ------------------------------------------------------------------------------

    def _resolve(self, force: bool = False) -> Any:
        if self._handle is not None:
            return self._handle
        now = time.monotonic()
        if not force and now < self._next_lookup:
            return None
        self._next_lookup = now + self.retry_interval
        import ray

        try:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:  # no such actor (never started, or dead)
            return None
        return self._handle

    def _reap(self) -> None:
        """Check finished pushes without waiting; one failure means the actor is gone."""
        if not self._pending:
            return
        import ray

        ready, waiting = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        self._pending = collections.deque(waiting)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception:
                self.stats["failed"] += 1
                self._forget()

    def _forget(self) -> None:
        self._handle = None
        self._next_lookup = time.monotonic() + self.retry_interval

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "retry": self.retry_interval}

    def __setstate__(self, state: dict[str, Any]) -> None:
        MetricsAggregator.__init__(
            self, state["name"], state["namespace"], retry_interval=state["retry"]
        )


class _AggregatorActor:
    """The actor: an in-memory buffer of snapshots (asyncio, so a drain can wait for pushes)."""

    def __init__(self, max_snapshots: int) -> None:
        self._max = max(1, int(max_snapshots))
        self._items: collections.deque[dict[str, Any]] = collections.deque()
        self._changed = asyncio.Condition()
        self._counts = {"received": 0, "drained": 0, "dropped": 0}
        self._beats: dict[str, dict[str, Any]] = {}

    async def push(self, snapshot: dict[str, Any]) -> None:
        async with self._changed:
            self._items.append(snapshot)
            self._counts["received"] += 1
            if len(self._items) > self._max:
                self._items.popleft()
                self._counts["dropped"] += 1
            self._changed.notify_all()

    async def drain(self, step: int | None, expect: int, timeout: float) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._changed:
            while self._count_due(step) < expect:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    break
            due = [s for s in self._items if _is_due(s, step)]
            self._items = collections.deque(s for s in self._items if not _is_due(s, step))
            self._counts["drained"] += len(due)
            return due

    async def stats(self) -> dict[str, int]:
        return {**self._counts, "held": len(self._items)}

    async def beat(self, worker: str, timers: dict[str, Any], at: float) -> None:
        self._beats[worker] = {"timers": timers, "at": at}

    async def open_timers(self) -> dict[str, Any]:
        return dict(self._beats)

    def _count_due(self, step: int | None) -> int:
        """The snapshots held that count towards a drain's ``expect``: those of ``step``."""
        return sum(1 for s in self._items if _is_due(s, step, exactly=True))


def _is_due(snapshot: dict[str, Any], step: int | None, exactly: bool = False) -> bool:
    """Whether a drain of ``step`` takes ``snapshot``: untagged, or tagged with ``step`` (or,
    unless ``exactly``, an earlier one)."""
    tagged = snapshot.get("step") if isinstance(snapshot, dict) else None
    if step is None or tagged is None:
        return True
    return bool(tagged == step if exactly else tagged <= step)


class _Heartbeat:
    """The daemon thread of one process that reports its open timers to the aggregator."""

    _lock = threading.Lock()
    _running: _Heartbeat | None = None
    _pid = 0

    def __init__(self, aggregator: MetricsAggregator, worker: str) -> None:
        self.aggregator = aggregator
        self.worker = worker
        self._last: Any = None
        self._sent_at = 0.0
        thread = threading.Thread(target=self._run, name="otel-rl-timer-beat", daemon=True)
        thread.start()

    @classmethod
    def ensure(cls, aggregator: MetricsAggregator, snapshot: Any) -> None:
        """Start this process's heartbeat once (again in a fork child)."""
        if cls._running is not None and cls._pid == os.getpid():
            return
        with cls._lock:
            if cls._running is not None and cls._pid == os.getpid():
                return
            role = snapshot.get("role", "worker") if isinstance(snapshot, dict) else "worker"
            rank = snapshot.get("rank", "?") if isinstance(snapshot, dict) else "?"
            worker = f"{role} rank {rank} (pid {os.getpid()} on {socket.gethostname()})"
            cls._pid = os.getpid()
            cls._running = cls(aggregator, worker)

    def _run(self) -> None:
        from otel_rl.telemetry.timing import open_timers

        while True:
            time.sleep(BEAT_INTERVAL)
            try:
                names = {t.ident: t.name for t in threading.enumerate()}
                now = time.monotonic()
                timers = {
                    names.get(ident, str(ident)): [[n, round(now - at, 3)] for n, at in stack]
                    for ident, stack in open_timers().items()
                }
                shape = {thread: [n for n, _ in stack] for thread, stack in timers.items()}
                if shape == self._last and now - self._sent_at < 10 * BEAT_INTERVAL:
                    continue
                handle = self.aggregator._resolve()
                if handle is None:
                    continue
                handle.beat.remote(self.worker, timers, time.time())
                self._last, self._sent_at = shape, now
            except Exception:  # the worker goes on whatever happens to the aggregator
                continue
