"""One run's OTel plumbing: resource, meter providers, readers and operator outputs.

Two providers share one resource:

- ``provider`` holds every instrument that code creates through OTel's API. Its
  :class:`StepReader` is collected at each ``log_metrics`` call on the caller's thread, so what
  those instruments record is attributed to the step it happened in.
- ``side_provider`` holds one observable gauge per logged key (whose callback reads the latest
  value), the timers' histograms (fed from the timers' records when an output collects:
  ``telemetry/timing.TimingInstruments``), otel-rl's own telemetry and GPU data. It is read
  only by the operator outputs
  (Prometheus, OTLP) on their own threads, never at a step boundary: collecting 100 gauges
  costs ~1 ms, which the training thread must not pay every step.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.exemplar import AlwaysOffExemplarFilter
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from otel_rl.core.errors import ConfigError
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.step_reader import StepReader


@runtime_checkable
class RunIdentity(Protocol):
    """What the run's resource attributes are read from: the typed logger config
    (``otel_rl.config.schema.LoggerSettings``, a layer above this one)."""

    @property
    def role(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def experiment(self) -> str | None: ...
    @property
    def service_name(self) -> str | None: ...


class PrometheusConfig(Protocol):
    """The ``prometheus:`` section."""

    @property
    def enabled(self) -> bool: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...


class OtlpConfig(Protocol):
    """The ``otlp:`` section: its switch, and its keys (read by :mod:`otel_rl.telemetry.otlp`
    from a mapping of them)."""

    @property
    def enabled(self) -> bool: ...
    def keys(self) -> Iterable[str]: ...
    def __getitem__(self, key: str, /) -> Any: ...


@runtime_checkable
class PipelineConfig(Protocol):
    """What :class:`Pipeline` reads of the typed logger config."""

    @property
    def otlp(self) -> OtlpConfig: ...
    @property
    def prometheus(self) -> PrometheusConfig: ...


def not_typed(cfg: object) -> TypeError:
    """The error for a config that is not the typed one (a plain mapping, say)."""
    return TypeError(
        "expected the typed logger config (otel_rl.config.loading.resolve_settings()), got "
        f"{type(cfg).__name__}"
    )


def build_resource(cfg: Mapping[str, Any] | RunIdentity, run_id: str) -> Resource:
    """Resource attributes that identify the run.

    ``otel_rl.*`` always come from the config (they must name this run exactly).
    ``service.name``: config ``service_name``, else ``OTEL_SERVICE_NAME``, else ``service.name``
    in ``OTEL_RESOURCE_ATTRIBUTES``, else ``otel-rl``. Every other key of
    ``OTEL_RESOURCE_ATTRIBUTES`` (``host.name`` included, to name a node as the cluster does)
    wins over what is detected here.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector

    if not isinstance(cfg, RunIdentity):
        raise not_typed(cfg)

    env = OTELResourceDetector().detect().attributes
    attributes: dict[str, Any] = {
        "otel_rl.run_id": run_id,
        "otel_rl.role": cfg.role,
        "otel_rl.rank": cfg.rank,
        # A relaunched run's attempt (1, 2, ...): dashboards tell its launches apart by it.
        "otel_rl.attempt": cfg.attempt,
        "process.pid": os.getpid(),
    }
    if "host.name" not in env:
        attributes["host.name"] = socket.gethostname()
    if cfg.experiment:
        attributes["otel_rl.experiment"] = cfg.experiment
    attributes["service.name"] = (
        cfg.service_name
        or os.environ.get("OTEL_SERVICE_NAME", "").strip()
        or env.get("service.name")
        or "otel-rl"
    )
    return Resource.create(attributes)


class Pipeline:
    """Builds the providers and operator outputs for one run, and shuts them down.

    What can fail (the OTLP environment, the OTLP packages, the Prometheus port) is done before
    any reader thread starts, and a failure closes what was opened: a ``Pipeline`` that raises
    leaves no server, thread or socket behind.
    """

    def __init__(self, cfg: Mapping[str, Any] | PipelineConfig, resource: Resource) -> None:
        self.resource = resource
        self.step_reader = StepReader()
        self._closers: list[Callable[[], None]] = []
        self.prometheus_url: str | None = None
        self.otlp_endpoint: str | None = None
        #: The resolved OTLP settings (``otlp.enabled``), else ``None``.
        try:
            if not isinstance(cfg, PipelineConfig):
                raise not_typed(cfg)
            self._build(cfg, resource)
        except BaseException:
            self._close_outputs()
            raise

    def _build(self, cfg: PipelineConfig, resource: Resource) -> None:
        main_readers: list[MetricReader] = [self.step_reader]
        side_readers: list[MetricReader] = []
        otlp = None
        if cfg.otlp.enabled:
            from otel_rl.telemetry.otlp import OtlpOutput

            otlp = OtlpOutput(dict(cfg.otlp), providers=2)
            self._closers.append(otlp.close)
            self.otlp_endpoint = otlp.settings.endpoint
        if cfg.prometheus.enabled:
            self._add_prometheus(cfg.prometheus, main_readers, side_readers)
        if otlp is not None:
            # From here on the readers own the exporters (and shut them down).
            self._closers.remove(otlp.close)
            main_reader, side_reader = otlp.readers()
            main_readers.append(main_reader)
            side_readers.append(side_reader)
            _log.info("otel-rl: pushing OTLP metrics to %s", self.otlp_endpoint)

        def provider(readers: list[MetricReader]) -> _MeterProvider:
            return _MeterProvider(
                metric_readers=readers,
                resource=resource,
                exemplar_filter=AlwaysOffExemplarFilter(),
                shutdown_on_exit=False,
            )

        self.provider = provider(main_readers)
        self.side_provider = provider(side_readers)
        self.has_side_readers = bool(side_readers)
        if otlp is not None:
            from otel_rl.core.records import OWN_SCOPE
            from otel_rl.telemetry.self_telemetry import install_otlp_telemetry

            install_otlp_telemetry(self.side_provider.get_meter(OWN_SCOPE), otlp.failures)

    def take_step_data(self) -> list[Any]:
        """What the main provider's instruments recorded since the last call (the step
        reader's collection), or nothing at once while no meter was ever asked of it."""
        if not self.provider.meters_asked:
            return []
        return self.step_reader.take()

    def _add_prometheus(
        self,
        prom: PrometheusConfig,
        main_readers: list[MetricReader],
        side_readers: list[MetricReader],
    ) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        host, port = prom.host, prom.port
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
            thread.name = "otel-rl-prometheus"  # ours, in a stall report's list of threads
        except OSError as exc:
            raise ConfigError(_listen_problem(host, port, exc)) from None
        bound = server.server_address[1]

        def close_server() -> None:
            server.shutdown()
            server.server_close()

        self._closers.append(close_server)
        # One target_info per endpoint, from the side provider, which always has data (otel-rl's
        # own health): the main one has none until a library meter or a timer records.
        main_readers.append(PrometheusMetricReader(registry=registry, disable_target_info=True))
        side_readers.append(PrometheusMetricReader(registry=registry))
        shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
        self.prometheus_url = f"http://{shown}:{bound}/metrics"
        self.prometheus_registry = registry
        _log.info("otel-rl: Prometheus metrics at %s", self.prometheus_url)

    def _close_outputs(self) -> None:
        for close in self._closers:
            try:
                close()
            except Exception as exc:
                _log.warning("otel-rl: closing an output: %s", exc)

    def shutdown(self, timeout: float) -> None:
        """Shut both providers down within ``timeout`` seconds (a final OTLP export each), then
        the server; the milliseconds of OTel's own API stay at its boundary.

        The providers shut down in parallel: each makes a final OTLP export, and against a
        collector that is down each takes the whole OTLP timeout; one after the other would
        double what ``finish()`` costs.
        """
        threads = [
            threading.Thread(
                target=_shutdown_provider, args=(provider, timeout * 1000), daemon=True
            )
            for provider in (self.provider, self.side_provider)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout + 0.5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._close_outputs()


class _MeterProvider(MeterProvider):
    """A ``MeterProvider`` that knows whether a meter was ever asked of it."""

    meters_asked = False

    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.meters_asked = True
        return super().get_meter(name, *args, **kwargs)


def _listen_problem(host: str, port: int, exc: OSError) -> str:
    """Why the Prometheus endpoint cannot listen, naming the key to change."""
    if isinstance(exc, socket.gaierror):
        return (
            f"logger config 'prometheus.host': cannot listen on {host!r}: {exc.strerror or exc} "
            "(give an address or a name of this machine, e.g. 127.0.0.1 or 0.0.0.0)"
        )
    if exc.errno == errno.EADDRINUSE:
        return (
            f"logger config 'prometheus.port': port {port} on {host} is already in use "
            "(by another process, or by another Logger in this process); choose another port, "
            "or 0 to pick a free one (Logger.prometheus_url then says which)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"logger config 'prometheus.host': {host} is not an address of this machine "
            f"({exc.strerror}); use 127.0.0.1, 0.0.0.0 or one of its interfaces' addresses"
        )
    if exc.errno == errno.EACCES:
        return (
            f"logger config 'prometheus.port': port {port} on {host} is not allowed to this "
            f"process ({exc.strerror}); ports below 1024 need privileges: choose another, or 0"
        )
    return (
        f"logger config 'prometheus.host'/'prometheus.port': cannot listen on {host}:{port}: "
        f"{exc.strerror or exc}"
    )


def _shutdown_provider(provider: MeterProvider, timeout_millis: float) -> None:
    try:
        provider.shutdown(timeout_millis=timeout_millis)
    except Exception as exc:  # shutdown must finish whatever one reader does
        _log.warning("otel-rl: meter provider shutdown: %s", exc)
