"""RayNodeScraper: every node's Prometheus endpoint, in parallel, at a fixed rate.

Each round (every ``interval`` seconds, measured from round start to round start, so a slow
round does not push the schedule back; missed slots are skipped rather than run back to back):

1. refresh the node list (``ray.nodes()`` or a static endpoint list);
2. GET every node's ``/metrics`` concurrently on one asyncio loop with one aiohttp session,
   each request bounded by ``timeout`` seconds in total (connect + response), gzip accepted;
3. parse each page (:func:`otel_rl.ray.gpu_metrics.parse_node_metrics`) and replace that node's
   entry in the cache; failures are counted per node and logged once per state change;
4. hand the :class:`Collection` to the listeners (the tracker bridge, self-telemetry).

The cache (:attr:`RayNodeScraper.latest`) is a dict swapped whole after each round, so readers on
other threads (OTel observable callbacks) read it without locks and never touch the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_rl.process.fork_safe_log import log as _log
from otel_rl.ray.discovery import (
    DiscoveryError,
    NodeIds,
    NodeTarget,
    endpoint_targets,
    ray_targets,
)
from otel_rl.ray.gpu_metrics import MalformedMetrics, NodeSample, parse_node_metrics
from otel_rl.ray.http_fetch import FetchError, fetch_text, new_session


@dataclass(frozen=True)
class NodeResult:
    """One node's outcome in one round: a sample, or an error with its kind."""

    node: int
    target: NodeTarget
    sample: NodeSample | None = None
    error: str | None = None
    #: ``timeout``, ``refused``, ``unreachable``, ``http``, ``malformed`` or ``error``.
    kind: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Collection:
    """The outcome of one round over all nodes."""

    #: Seconds since the scraper was created, at the start of the round.
    elapsed: float
    #: Unix time at the start of the round.
    time: float
    #: Wall time of the round (discovery + all fetches + parsing).
    duration: float
    results: Mapping[int, NodeResult] = field(default_factory=dict)

    @property
    def samples(self) -> dict[int, NodeSample]:
        return {n: r.sample for n, r in self.results.items() if r.sample is not None}

    @property
    def failures(self) -> dict[int, NodeResult]:
        return {n: r for n, r in self.results.items() if r.sample is None}


@dataclass(frozen=True)
class CachedNode:
    """The latest good sample of a node and when it was taken (``time.monotonic()``)."""

    node: int
    target: NodeTarget
    sample: NodeSample
    at: float


Listener = Callable[[Collection], None]


class RayNodeScraper:
    """Scrapes Ray nodes' metrics endpoints; see the module docstring for one round.

    ``endpoints`` (URLs or ``host:port``) replaces Ray discovery; ``discover`` may supply any
    other node list (a callable returning :class:`NodeTarget`s). A node that fails keeps its last
    sample in the cache for ``stale_after`` seconds (default: three intervals); a node that leaves
    the node list is dropped from the cache at once but keeps its id should it come back.
    """

    def __init__(
        self,
        endpoints: Iterable[str] = (),
        *,
        interval: float = 10.0,
        timeout: float = 5.0,
        discover: Callable[[], list[NodeTarget]] | None = None,
        stale_after: float | None = None,
        max_concurrency: int = 256,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        static = endpoint_targets(endpoints)
        if discover is None:
            discover = (lambda: list(static)) if static else ray_targets
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.stale_after = float(stale_after) if stale_after is not None else 3 * self.interval
        self.max_concurrency = max(1, int(max_concurrency))
        self.node_ids = NodeIds()
        self.stats: dict[str, Any] = {
            "collections": 0,
            "errors": 0,
            "errors_by_node": Counter(),
            "skipped_slots": 0,
            "last_duration": None,
            "series": 0,
        }
        self.latest: Mapping[int, CachedNode] = {}
        self.last: Collection | None = None
        self._discover: Callable[[], list[NodeTarget]] = discover
        self._targets: list[NodeTarget] = []
        self._states: dict[str, str] = {}
        self._listeners: list[Listener] = []
        self._started_at = time.monotonic()
        self._round_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[list[NodeResult]] | None = None
        self._worker: int | None = None

    # ---- public API ---------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(collection)`` on the scraper's thread after every round."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Run rounds on a daemon thread at a fixed rate until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="otel-rl-ray-scraper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; a round in flight is cancelled (its nodes are not waited for)."""
        self._stop.set()
        self._cancel_round()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def seconds_since_start(self) -> float:
        return time.monotonic() - self._started_at

    def collect_once(self) -> Collection | None:
        """Run one round now, on the caller's thread; ``None`` if it was cancelled by stop()."""
        with self._round_lock:
            collection = self._round()
        if collection is None:
            return None
        for listener in list(self._listeners):
            try:
                listener(collection)
            except Exception as exc:  # a listener bug must not stop the monitoring
                self._note_state(
                    f"listener:{getattr(listener, '__qualname__', listener)}",
                    f"error:{type(exc).__name__}",
                    f"GPU monitoring: a collection listener failed: {type(exc).__name__}: {exc}",
                )
        return collection

    # ---- one round ----------------------------------------------------------------------------

    def _round(self) -> Collection | None:
        started = time.monotonic()
        wall = time.time()
        targets = self._refresh_targets()
        numbered = [(self.node_ids.id_for(t.key), t) for t in targets]
        results = self._run_async(self._fetch_all(numbered))
        if results is None:
            return None
        duration = time.monotonic() - started
        collection = Collection(
            elapsed=started - self._started_at,
            time=wall,
            duration=duration,
            results={r.node: r for r in results},
        )
        self._update_cache(collection, {n for n, _ in numbered}, time.monotonic())
        self.stats["collections"] += 1
        self.stats["last_duration"] = duration
        self.last = collection
        return collection

    def _refresh_targets(self) -> list[NodeTarget]:
        try:
            targets = self._discover()
        except DiscoveryError as exc:
            self._note_state("discovery", "error", f"GPU monitoring: {exc}")
            return self._targets
        except Exception as exc:
            self._note_state(
                "discovery", "error", f"GPU monitoring: node discovery failed: {exc!r}"
            )
            return self._targets
        self._note_state("discovery", "ok", "GPU monitoring: node discovery works again")
        unique: dict[str, NodeTarget] = {}
        for target in targets:  # one node listed twice must not be scraped twice
            unique.setdefault(target.key, target)
        self._targets = list(unique.values())
        return self._targets

    async def _fetch_all(self, numbered: list[tuple[int, NodeTarget]]) -> list[NodeResult]:
        # The semaphore, not the connector's limit, bounds concurrency: a request waiting for a
        # free connection must not have its deadline running.
        gate = asyncio.Semaphore(self.max_concurrency)
        session = new_session(self.max_concurrency)

        async def one(node: int, target: NodeTarget) -> NodeResult:
            async with gate:
                began = time.monotonic()
                try:
                    text = await fetch_text(session, target.url, self.timeout)
                    sample = parse_node_metrics(text)
                except Exception as exc:
                    kind, message = _classify(exc, self.timeout)
                    return NodeResult(
                        node, target, error=message, kind=kind, seconds=time.monotonic() - began
                    )
                return NodeResult(node, target, sample=sample, seconds=time.monotonic() - began)

        async with session:
            return list(await asyncio.gather(*(one(n, t) for n, t in numbered)))

    def _run_async(
        self, coro: Coroutine[Any, Any, list[NodeResult]]
    ) -> list[NodeResult] | None:
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(coro)
            self._loop, self._task = loop, task
            # stop() may have looked for a round before this one was registered.
            if self._stop.is_set() and threading.get_ident() == self._worker:
                task.cancel()
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                return None
        finally:
            self._loop = self._task = None
            _close_loop(loop)

    def _cancel_round(self) -> None:
        loop, task = self._loop, self._task
        if loop is None or task is None:
            return
        # RuntimeError: the loop closed in between, so the round is over anyway.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(task.cancel)

    def _update_cache(self, collection: Collection, listed: set[int], now: float) -> None:
        cache = {
            n: c for n, c in self.latest.items() if n in listed and now - c.at <= self.stale_after
        }
        series = 0
        for node, result in collection.results.items():
            key = f"node:{node}"
            if result.sample is not None:
                cache[node] = CachedNode(node, result.target, result.sample, now)
                series += result.sample.series
                self._note_state(
                    key, "ok", f"GPU monitoring: node {node} ({result.target.url}) answers again"
                )
            else:
                self.stats["errors"] += 1
                self.stats["errors_by_node"][node] += 1
                self._note_state(
                    key,
                    str(result.kind),
                    f"GPU monitoring: node {node} ({result.target.url}): {result.error}; "
                    "skipped until it answers",
                )
        for node in set(self.latest) - listed:
            self._states.pop(f"node:{node}", None)
            _log.info("otel-rl: GPU monitoring: node %d left the cluster", node)
        self.stats["series"] = series
        self.latest = cache

    def _note_state(self, key: str, state: str, message: str) -> None:
        """Log when ``key`` changes state (first success is silent), not at every round."""
        previous = self._states.get(key)
        self._states[key] = state
        if previous == state or (previous is None and state == "ok"):
            return
        if state == "ok":
            _log.info("otel-rl: %s", message)
        else:
            _log.warning("otel-rl: %s", message)

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._worker = threading.get_ident()
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.collect_once()
            except Exception as exc:  # keep monitoring whatever one round hit
                self._note_state(
                    "round", f"error:{type(exc).__name__}", f"GPU monitoring round failed: {exc!r}"
                )
            now = time.monotonic()
            next_at, missed = next_slot(next_at, now, self.interval)
            self.stats["skipped_slots"] += missed
            self._stop.wait(next_at - now)


def next_slot(started_at: float, now: float, interval: float) -> tuple[float, int]:
    """The start of the next round after one that started at ``started_at``, and how many
    slots were missed: rounds keep a fixed rate (start to start), and a round that overran
    skips the slots it covered instead of running them back to back."""
    next_at = started_at + interval
    if next_at > now:
        return next_at, 0
    missed = int((now - next_at) // interval) + 1
    return next_at + missed * interval, missed


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Let cancelled requests unwind and sockets close before the loop goes away."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


def _classify(exc: BaseException, timeout: float) -> tuple[str, str]:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout", f"no complete response within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "refused", "connection refused"
    if isinstance(exc, MalformedMetrics):
        return "malformed", str(exc)
    if isinstance(exc, FetchError):
        return "http", str(exc)
    if isinstance(exc, OSError):
        return "unreachable", f"{type(exc).__name__}: {exc}"
    return "error", f"{type(exc).__name__}: {exc}"
