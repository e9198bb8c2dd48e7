"""RolloutMonitor: scrape vLLM/SGLang servers on a thread and turn each training step's interval
into rollout rows.

Scraping: every ``collection_interval`` seconds (start to start; an overrunning round skips the
slots it covered) one round GETs every endpoint concurrently. The HTTP side is aiohttp on one
asyncio loop owned by the monitor's thread, through the same bounded fetch the Ray GPU scraper
uses (:mod:`otel_rl.ray.http_fetch`): a hard deadline on the whole exchange, gzip, a size bound,
and one long-lived session so keep-alive connections are reused from round to round. A thread
pool with ``urllib`` would need a thread per in-flight request to get the same deadline and would
re-open a connection every round; at 256 engines that is 256 threads or a serialized round.

Steps: :meth:`RolloutMonitor.mark_step` (training thread) only appends ``(step, clock())`` to a
deque and wakes the monitor's loop, which starts a round at once (or right after the one in
flight): the step's closing scrape is taken when the step closed, off the training thread.
After each round, every mark made before the round started is closed: the engines' windows (see
:mod:`otel_rl.rollout.rows`) become that step's rows and ``emit(step, values)`` is called on the
monitor's thread. The scrape that closes a step is the first one started after the mark, and it
also opens the next step, so consecutive steps share a bracket and no increase is counted twice
or lost: a step's row holds exactly the increase between the scrape at the previous step's close
and the scrape at its own. Several marks closed by the same round (steps shorter than the
collection interval) give one set of rows, to the latest of them; the earlier ones get none
(``stats["steps_without_scrape"]``).

Engines without a URL (``source="ray"``): vLLM engines inside Ray actors that forward their
metrics to Ray (``RayPrometheusStatLogger``) show up on their node's Ray metrics page. Every round
then also lists the alive Ray nodes (as the GPU bridge does) and reads each node's page as a set
of engines, one per recording worker process (:func:`otel_rl.rollout.engines.parse_ray_node_page`).

Credentials: an endpoint may carry ``user:password@``; aiohttp sends it as Basic auth. Log lines
show the endpoint as ``***@host``, and the ``file_sd`` file lists ``host:port`` only (the
collector's scrape job holds the credentials; docs/security.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from otel_rl.process.fork_safe_log import log as _log
from otel_rl.ray.discovery import (
    DiscoveryError,
    NodeTarget,
    endpoint_problem,
    endpoint_targets,
    ray_targets,
    without_userinfo,
)
from otel_rl.ray.http_fetch import FetchError, fetch_text, import_aiohttp, new_session
from otel_rl.ray.scraper import next_slot
from otel_rl.rollout.engines import (
    ENGINE_CHOICES,
    EXPECTED_ROLES,
    EngineSample,
    NotAnEnginePage,
    parse_engine_page,
    parse_ray_node_page,
)
from otel_rl.rollout.rows import (
    EngineStep,
    EngineWindow,
    below_zero,
    combine,
    engine_rows,
    prefixed,
)

Emit = Callable[[int, dict[str, float]], None]

#: Accepted values of ``rollout_monitoring.source``.
SOURCE_CHOICES = ("http", "ray")

#: Rows a role feeds, for the "missing metric" warning.
_ROLE_ROWS = {
    "gen_tokens": "gen_tokens_per_s",
    "prompt_tokens": "prompt_tokens_per_s",
    "requests_finished": "requests_finished",
    "preemptions": "preemptions",
    "prefix_hits": "prefix_cache_hit_rate",
    "prefix_queries": "prefix_cache_hit_rate",
    "running": "requests_running_mean/max",
    "waiting": "requests_waiting_mean/max",
    "kv_usage": "kv_cache_usage_mean/max",
    "ttft": "ttft_p50_s/ttft_p90_s",
    "e2e": "e2e_latency_p90_s",
}


@dataclass(frozen=True)
class EngineInfo:
    """An engine the monitor has seen: its id in ``rollout/engine.<id>.…``."""

    id: int
    url: str  # without credentials
    #: vLLM's ``engine`` label when one server fronts several engines; for an engine read from
    #: a Ray node's page, ``worker=<WorkerId prefix> engine=<engine>``
    label: str | None
    kind: str


class RolloutMonitor:
    """Scrapes inference-engine endpoints and emits rollout rows per training step.

    ``emit(step, values)`` is called on the monitor's thread, in step order, with the rows of
    ``docs/rollout-monitoring.md``; it must not block for long (hand the values to a queue).
    ``engine`` is ``auto``, ``vllm``, ``vllm-v1``, ``vllm-v0`` or ``sglang``. ``source="ray"``
    also reads the vLLM engines forwarded to Ray from every alive node of the Ray cluster this
    process is connected to (see the module's docstring). ``clock`` stamps
    marks and scrapes (monotonic seconds); it exists so tests can give exact intervals.
    Construction starts the thread (``start=False`` to call :meth:`start` later) and raises
    ``ImportError`` with the pip command when aiohttp is missing.
    """

    def __init__(
        self,
        endpoints: Iterable[str] = (),
        *,
        emit: Emit,
        collection_interval: float = 5.0,
        engine: str = "auto",
        timeout: float = 5.0,
        max_concurrency: int = 256,
        per_engine: bool = True,
        source: str = "http",
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        if source not in SOURCE_CHOICES:
            raise ValueError(
                f"rollout_monitoring.source must be one of {', '.join(SOURCE_CHOICES)}, "
                f"not {source!r}"
            )
        if engine not in ENGINE_CHOICES:
            raise ValueError(
                f"rollout_monitoring.engine must be one of {', '.join(ENGINE_CHOICES)}, "
                f"not {engine!r}"
            )
        if not collection_interval > 0 or not timeout > 0:
            raise ValueError("rollout_monitoring: collection_interval and timeout must be > 0")
        if not callable(emit):
            raise TypeError("emit must be a callable emit(step, values)")
        import_aiohttp()  # fail here, on the caller's thread, with the install hint
        self.collection_interval = float(collection_interval)
        self.engine = engine
        self.timeout = float(timeout)
        self.max_concurrency = max(1, int(max_concurrency))
        self.per_engine = per_engine
        self.source = source
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "scrape_errors": 0,
            "steps_emitted": 0,
            "steps_without_scrape": 0,
            "restarts": 0,
            "emit_errors": 0,
            "negative_samples": 0,
            "last_round_seconds": None,
        }
        self._emit = emit
        self._clock = clock
        self._endpoints: list[str] = []
        self._endpoint_lock = threading.Lock()
        self._ray_nodes: list[NodeTarget] = []
        self._credentials: set[str] = set()  # user-info strings never to be shown
        self._sd_file: tuple[str | os.PathLike[str], dict[str, str] | None] | None = None
        self._sd_lock = threading.Lock()
        self._engines: dict[tuple[str, str | None], EngineInfo] = {}
        #: Each page's latest good read (the monitor's clock): an engine that was not on it
        #: then came into being since, during the run (EngineWindow.add's ``since``).
        self._read_at: dict[str, float] = {}
        self._windows: dict[int, EngineWindow] = {}
        self._round_totals: dict[str, list[float]] = {}
        self._marks: collections.deque[tuple[int, float]] = collections.deque()
        self._flushes: list[threading.Event] = []
        self._flush_lock = threading.Lock()
        self._states: dict[str, str] = {}
        self._warned: set[tuple[str, ...]] = set()
        #: Engines forwarded to Ray, by kind: the roles any of them has shown so far.
        self._ray_roles_seen: dict[str, set[str]] = {}
        self._closed = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._round_done = threading.Condition()
        self.add_endpoints(endpoints)
        if start:
            self.start()

    @classmethod
    def from_config(cls, section: dict[str, Any], *, emit: Emit) -> RolloutMonitor:
        """Build from a ``rollout_monitoring`` config section."""
        known = {
            "endpoints", "collection_interval", "engine", "timeout", "per_engine", "enabled",
            "sd_file", "source",
        }  # fmt: skip
        unknown = set(section) - known
        if unknown:
            raise ValueError(f"rollout_monitoring: unknown keys {sorted(unknown)}")
        return cls(
            section.get("endpoints") or (),
            emit=emit,
            collection_interval=float(section.get("collection_interval", 5.0)),
            engine=str(section.get("engine", "auto")),
            timeout=float(section.get("timeout", 5.0)),
            per_engine=bool(section.get("per_engine", True)),
            source=str(section.get("source", "http")),
        )

    # ---- public API (any thread) --------------------------------------------------------------

    def add_endpoints(self, endpoints: Iterable[str] | str) -> list[str]:
        """Scrape these endpoints too from the next round on (``host:port`` or http(s) URLs; a
        URL without a path gets ``/metrics``). Returns the URLs; ones already known are ignored.

        Each endpoint is checked as the config's ``rollout_monitoring.endpoints`` are (one
        function decides for both); a bad one raises ``ValueError`` naming it (without its
        credentials) and none of the given endpoints is added."""
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        endpoints = list(endpoints)
        for raw in endpoints:
            problem = endpoint_problem(raw)
            if problem is not None:
                shown = without_userinfo(raw) if isinstance(raw, str) else raw
                raise ValueError(f"rollout monitoring: not an endpoint URL: {shown!r}: {problem}")
        urls = [t.url for t in endpoint_targets(endpoints)]
        for url in urls:
            userinfo = urlsplit(url).netloc.rpartition("@")[0]
            if userinfo:
                self._credentials.update({userinfo, userinfo.partition(":")[2]} - {""})
        with self._endpoint_lock:
            for url in urls:
                if url not in self._endpoints:
                    self._endpoints.append(url)
            sd_file = self._sd_file
        if sd_file is not None:
            self._rewrite_sd_file(*sd_file)
        return urls

    def keep_sd_file(
        self, path: str | os.PathLike[str], labels: dict[str, str] | None = None
    ) -> bool:
        """:meth:`write_sd_file` now and again whenever :meth:`add_endpoints` adds one, so that a
        collector or Prometheus reading the file follows the engines the run scrapes.

        A file that cannot be written costs the dashboards, not the run: one warning naming the
        path and the cause, and the next endpoint added tries again. Returns whether it was
        written."""
        with self._endpoint_lock:
            self._sd_file = (path, labels)
        return self._rewrite_sd_file(path, labels)

    def _rewrite_sd_file(self, path: str | os.PathLike[str], labels: dict[str, str] | None) -> bool:
        with self._sd_lock:  # the last write holds every endpoint added so far
            try:
                self.write_sd_file(path, labels)
            except OSError as exc:
                if ("sd_file", str(path)) not in self._warned:
                    self._warned.add(("sd_file", str(path)))
                    _log.warning(
                        "otel-rl: rollout monitoring: cannot write the file_sd file %s (%s: %s); "
                        "a collector reading it will not see these engines (rollout_monitoring."
                        "sd_file)", path, type(exc).__name__, exc.strerror or exc,
                    )  # fmt: skip
                return False
        return True

    @property
    def endpoints(self) -> list[str]:
        """The endpoints scraped, as they may be shown: credentials as ``***@``."""
        return [without_userinfo(url) for url in self._targets()]

    def _targets(self) -> list[str]:
        """The endpoints scraped, credentials included (for the requests only)."""
        with self._endpoint_lock:
            return list(self._endpoints)

    def engine_states(self) -> list[dict[str, Any]]:
        """Each engine as of its latest scrape: ``url``, ``label``, ``running`` (requests in
        flight), ``finished`` (requests finished since the last step closed) over
        ``window_seconds``, and ``seconds_ago`` (the scrape's age); for the stall verdict. Read
        on another thread while this one's may write: a value being replaced is the old or the
        new one, both true at some moment."""
        out = []
        for info in self.engines:
            window = self._windows.get(info.id)
            sample = None if window is None else window.previous
            if window is None or sample is None:
                continue
            out.append({
                "url": info.url,
                "label": info.label,
                "running": sample.gauges.get("running"),
                "finished": window.increases.get("requests_finished"),
                "window_seconds": window.seconds,
                "seconds_ago": max(0.0, time.monotonic() - window.previous_at),
            })  # fmt: skip
        return out

    @property
    def engines(self) -> list[EngineInfo]:
        """Engines seen so far, by id."""
        return sorted(self._engines.values(), key=lambda e: e.id)

    def mark_step(self, step: int) -> None:
        """The training step ``step`` ended now: its rows hold the engines' counts as of now.

        The scrape is not made here, on the training thread, but on the monitor's: the mark
        (step, time) goes to a deque and the monitor's event loop is woken (one byte written to
        its wake-up pipe, no network, no disk), which starts a round at once, or right after the
        round in flight. That round is the step's closing scrape: it started after the mark, so
        it holds everything the engines did in the step, and it starts within one GET's time of
        the mark, not up to ``collection_interval`` later, so it holds next to nothing of the
        next step. Its rows follow on the monitor's thread."""
        self._marks.append((int(step), self._clock()))
        self._poke()

    def start(self) -> None:
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._run, name="otel-rl-rollout", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def flush(self, timeout: float = 10.0) -> bool:
        """Scrape now and emit the rows of every step marked before this call. Blocks up to
        ``timeout`` seconds; returns whether that happened. Not callable from ``emit``."""
        if self._thread is None or not self._thread.is_alive():
            return False
        if threading.current_thread() is self._thread:
            raise RuntimeError("RolloutMonitor.flush() cannot be called from its emit callback")
        done = threading.Event()
        with self._flush_lock:
            self._flushes.append(done)
        self._poke()
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Flush (a last scrape closes the steps still open), then stop the thread."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        if self._marks:
            self.flush(timeout)
        self._closed = True
        self._stop = True
        self._poke()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(max(0.1, deadline - time.monotonic()))
        self._warn_never_seen()

    def write_sd_file(
        self, path: str | os.PathLike[str], labels: dict[str, str] | None = None
    ) -> Path:
        """Write the endpoints as a Prometheus ``file_sd`` target list (atomically, so a reader
        never sees half a file), for an OTel Collector's prometheus receiver. ``labels`` are
        added to every target (e.g. ``{"otel_rl_run_id": run_id}``, which the dashboard's
        rollout row filters on); see docs/rollout-monitoring.md. Targets are ``host:port``: an
        endpoint's ``user:password@`` is never written (one warning names the endpoint without
        it)."""
        extra = {str(k): str(v) for k, v in (labels or {}).items()}
        groups: dict[tuple[str, str], list[str]] = {}
        for url in self._targets():
            parts = urlsplit(url)
            # A target is host:port; credentials have no place in a file_sd file and stay out of
            # it (the collector's scrape job gives them: docs/security.md).
            netloc = parts.netloc.rpartition("@")[2]
            if netloc != parts.netloc and ("sd_credentials", url) not in self._warned:
                self._warned.add(("sd_credentials", url))
                _log.warning(
                    "otel-rl: rollout monitoring: %s carries credentials; the file_sd file lists "
                    "it as %s without them, so give the collector's scrape job its basic_auth "
                    "(docs/security.md)", without_userinfo(url), netloc,
                )  # fmt: skip
            groups.setdefault((parts.scheme, parts.path or "/metrics"), []).append(netloc)
        content = [
            {
                "targets": targets,
                "labels": {
                    "__metrics_path__": mpath,
                    "__scheme__": scheme,
                    "otel_rl_role": "rollout",
                    **extra,
                },
            }
            for (scheme, mpath), targets in groups.items()
        ]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(content, fh, indent=2)
        os.replace(tmp, target)
        return target

    # ---- the thread -----------------------------------------------------------------------------

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(wake.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # pragma: no cover - a bug must be visible, not silent
            _log.error("otel-rl: rollout monitoring stopped: %r", exc)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._ready.set()
        async with new_session(self.max_concurrency) as session:
            next_at = time.monotonic()
            while True:
                delay = next_at - time.monotonic()
                if delay > 0 and not self._stop:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
                if self._stop:
                    break
                with self._flush_lock:
                    flushes, self._flushes = self._flushes, []
                scheduled = time.monotonic() >= next_at
                try:
                    await self._round(session)
                except Exception as exc:  # keep monitoring whatever one round hit
                    self._note("round", f"error:{type(exc).__name__}",
                               f"rollout monitoring round failed: {exc!r}")  # fmt: skip
                for done in flushes:
                    done.set()
                if scheduled:
                    next_at, _ = next_slot(next_at, time.monotonic(), self.collection_interval)
        self._loop = self._wake = None
        with self._flush_lock:
            for done in self._flushes:
                done.set()

    async def _round(self, session: Any) -> None:
        started = time.monotonic()
        round_at = self._clock()
        urls = self._targets()
        node_urls: set[str] = set()
        if self.source == "ray":
            node_urls = {t.url for t in self._refresh_ray_nodes()} - set(urls)
            urls = urls + sorted(node_urls)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(url: str) -> tuple[str, float, Any]:
            async with gate:
                at = self._clock()
                try:
                    return url, at, await fetch_text(session, url, self.timeout)
                except Exception as exc:
                    return url, at, exc

        fetched = await asyncio.gather(*(one(u) for u in urls))
        # Parsing waits until every response is in: done inside the fetches it would hold the
        # loop, and the deadlines of the requests still in flight would run out meanwhile.
        results = [
            (url, at, _parse(got, "ray" if url in node_urls else self.engine))
            for url, at, got in fetched
        ]
        totals: dict[str, float] = {}
        for url, at, outcome in results:  # endpoint order: engine ids in order of first appearance
            shown = without_userinfo(url)
            if isinstance(outcome, BaseException):
                self.stats["scrape_errors"] += 1
                what = "Ray node " if url in node_urls else ""
                self._note(f"endpoint:{url}", _kind(outcome),
                           f"rollout monitoring: {what}{shown}: "
                           f"{_describe(outcome, self.timeout)}; its rows are left out until "
                           "it answers")  # fmt: skip
                continue
            self._note(f"endpoint:{url}", "ok", f"rollout monitoring: {shown} answers again")
            read_before = self._read_at.get(url)
            self._read_at[url] = at
            for label, sample in outcome.items():
                # An engine missing from an earlier read of its page started during the run
                # (Ray shows a worker's series from its first record on): its first sample is
                # no baseline, it holds the engine's first requests. One on a page read for the
                # first time may have run before the run: that one's first sample is.
                since = read_before if (url, label) not in self._engines else None
                info = self._engine(url, label, sample.kind)
                negative = below_zero(sample)
                if negative:
                    self.stats["negative_samples"] += 1
                    self._warn_negative(info, negative)
                    continue
                self._check_roles(info, sample, from_ray=url in node_urls)
                back = self._windows[info.id].add(sample, at, since)
                if back:
                    self.stats["restarts"] += 1
                    _log.warning(
                        "otel-rl: rollout monitoring: engine %d (%s) restarted (%s went back); "
                        "counting its counters from zero",
                        info.id, info.url, ", ".join(back[:3]),
                    )  # fmt: skip
                for role in ("running", "waiting"):
                    if role in sample.gauges:
                        totals[role] = totals.get(role, 0.0) + sample.gauges[role]
        for role, value in totals.items():
            self._round_totals.setdefault(role, []).append(value)
        self.stats["rounds"] += 1
        self.stats["last_round_seconds"] = time.monotonic() - started
        self._close_steps(round_at)
        with self._round_done:
            self._round_done.notify_all()

    def _engine(self, url: str, label: str | None, kind: str) -> EngineInfo:
        key = (url, label)
        info = self._engines.get(key)
        if info is None or info.kind != kind:
            number = info.id if info is not None else len(self._engines)
            info = self._engines[key] = EngineInfo(number, without_userinfo(url), label, kind)
            self._windows.setdefault(number, EngineWindow())
            detail = "" if label is None else f" {label}" if "=" in label else f" engine={label}"
            _log.info("otel-rl: rollout monitoring: engine %d = %s%s (%s)", number, info.url,
                      detail, kind)  # fmt: skip
        return info

    def _refresh_ray_nodes(self) -> list[NodeTarget]:
        """The alive Ray nodes' metrics endpoints; the previous list when Ray cannot say."""
        try:
            self._ray_nodes = ray_targets()
        except DiscoveryError as exc:
            self._note("ray-discovery", "failed",
                       f"rollout monitoring (source: ray): {exc}; engines forwarded to Ray are "
                       "left out until it answers")  # fmt: skip
        else:
            self._note("ray-discovery", "ok", "rollout monitoring: Ray's node list answers again")
        return self._ray_nodes

    def _check_roles(self, info: EngineInfo, sample: EngineSample, from_ray: bool) -> None:
        """Warn about a metric an engine's page lacks. An engine's own ``/metrics`` page lists
        every series from the engine's start, so a missing one is warned about at once; an engine
        forwarded to Ray has a series only from its first record on, so what such an engine
        lacks is only warned about by :meth:`close`, if it never appeared."""
        seen = self._ray_roles_seen.setdefault(sample.kind, set()) if from_ray else None
        if seen is not None:
            seen.update(sample.roles())
            return
        for role in sorted(EXPECTED_ROLES[sample.kind] - sample.roles()):
            self._warn_missing(info, sample.kind, role)

    def _warn_missing(self, info: EngineInfo, kind: str, role: str) -> None:
        key = ("missing", kind, _ROLE_ROWS.get(role, role))
        if key in self._warned:
            return
        self._warned.add(key)
        _log.warning(
            "otel-rl: rollout monitoring: engine %d (%s, %s) has no metric for %s (an older "
            "release?); that row is left out for %s engines without it",
            info.id, info.url, kind, _ROLE_ROWS.get(role, role), kind,
        )  # fmt: skip

    def _warn_negative(self, info: EngineInfo, names: list[str]) -> None:
        for name in names:
            key = ("negative", str(info.id), name)
            if key in self._warned:
                continue
            self._warned.add(key)
            _log.warning(
                "otel-rl: rollout monitoring: engine %d (%s) shows %s below zero (a bug in the "
                "engine or its exporter); its samples with a counter below zero are skipped, "
                "their increases go to the next good sample",
                info.id, info.url, name,
            )  # fmt: skip

    def _warn_never_seen(self) -> None:
        """At close: the metrics no engine forwarded to Ray ever showed (one warning per row and
        engine kind, as for an engine's own page)."""
        for kind, seen in list(self._ray_roles_seen.items()):
            for role in sorted(EXPECTED_ROLES[kind] - set(seen)):
                row = _ROLE_ROWS.get(role, role)
                if ("missing", kind, row) in self._warned:
                    continue
                self._warned.add(("missing", kind, row))
                _log.warning(
                    "otel-rl: rollout monitoring: no %s engine forwarded to Ray ever had a metric "
                    "for %s over the run (Ray shows a series from its first record on: none was "
                    "recorded, or an older release lacks it); that row was left out",
                    kind, row,
                )  # fmt: skip

    def _close_steps(self, round_at: float) -> None:
        due: list[int] = []
        while self._marks and self._marks[0][1] <= round_at:
            due.append(self._marks.popleft()[0])
        if not due:
            return
        self.stats["steps_without_scrape"] += len(due) - 1
        step = due[-1]
        parts: dict[int, EngineStep] = {}
        for number, window in self._windows.items():
            part = window.close()
            if part is not None:
                parts[number] = part
        totals, self._round_totals = self._round_totals, {}
        values = prefixed(combine(parts, totals))
        values["rollout/engines_reporting"] = float(len(parts))
        if self.per_engine:
            for number in sorted(parts):
                values.update(prefixed(engine_rows(parts[number]), number))
        try:
            self._emit(step, values)
            self.stats["steps_emitted"] += 1
        except Exception as exc:  # a consumer bug must not stop the monitoring
            self.stats["emit_errors"] += 1
            self._note("emit", f"error:{type(exc).__name__}",
                       f"rollout monitoring: emit({step}, ...) failed: {exc!r}")  # fmt: skip

    def _note(self, key: str, state: str, message: str) -> None:
        """Log when ``key`` changes state (a first success is silent), not at every round."""
        previous = self._states.get(key)
        self._states[key] = state
        if previous == state or (previous is None and state == "ok"):
            return
        (_log.info if state == "ok" else _log.warning)("otel-rl: %s", self._scrubbed(message))

    def _scrubbed(self, text: str) -> str:
        """``text`` without any endpoint's credentials, wherever an error message quoted them."""
        for secret in sorted(self._credentials, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def wait_rounds(self, count: int, timeout: float = 10.0) -> bool:
        """Block until at least ``count`` rounds have completed (for tests and tools)."""
        with self._round_done:
            return bool(self._round_done.wait_for(lambda: self.stats["rounds"] >= count, timeout))


def _parse(got: str | BaseException, engine: str) -> dict[str | None, EngineSample] | Exception:
    """The engines on a fetched page (``engine="ray"``: a Ray node's page), or the error."""
    if isinstance(got, BaseException):
        return got if isinstance(got, Exception) else RuntimeError(repr(got))
    try:
        if engine == "ray":
            engines: dict[str | None, EngineSample] = {}
            engines.update(parse_ray_node_page(got))
            return engines
        return parse_engine_page(got, engine)
    except Exception as exc:  # malformed text, not an engine page
        return exc


def _kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, NotAnEnginePage):
        return "not-engine"
    if isinstance(exc, FetchError):
        return "http"
    if isinstance(exc, ValueError):
        return "malformed"
    if isinstance(exc, OSError):
        return "unreachable"
    return f"error:{type(exc).__name__}"


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no complete response within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (NotAnEnginePage, FetchError)):
        return str(exc)
    if isinstance(exc, ValueError):
        return f"not Prometheus text: {exc}"
    return f"{type(exc).__name__}: {exc}"
