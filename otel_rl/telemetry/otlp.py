"""OTLP output: a periodic reader per provider that pushes metrics to an OTel Collector.

Every setting is resolved in the same order: a key set in the ``otlp:`` config wins; a key left
unset (``null``) falls back to the standard ``OTEL_EXPORTER_OTLP_*`` / ``OTEL_METRIC_EXPORT_*``
env vars (the signal-specific ``..._METRICS_...`` one before the generic one); then to otel-rl's
default. Headers are the exception: env headers and config headers are merged, config winning per
header name. docs/outputs.md has the full table.

A collector that is down costs the training thread nothing: exports run on the reader's own
thread, each bounded by a short timeout (5 s unless set), and nothing here is ever flushed from
the training loop. It costs the log one warning, not the SDK's lines at every export: each of
our exporters is wrapped (:class:`ExportWatch`), which reads the export's result, counts the
failures and says once when exports start failing and once when they work again; while our
export call runs, a filter drops what the SDK's exporter loggers say on that thread (those lines
reach ``otel_rl``'s DEBUG level instead). Exporters the application builds itself are untouched.

With ``otlp.semantic_conventions`` the same wrapper renames otel-rl's GPU metrics to
OpenTelemetry's semantic conventions in what it sends (:class:`SemanticConventionNames`).
"""

from __future__ import annotations

import base64
import importlib
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    Sum,
)

from otel_rl.core import catalogue
from otel_rl.core.errors import MAX_SHOWN_REASON, ConfigError, shorten
from otel_rl.process.deadline import MAX_SECONDS
from otel_rl.process.fork_safe_log import log as _log

PROTOCOLS = ("http/protobuf", "grpc")
HISTOGRAMS = ("explicit", "exponential")

DEFAULT_HTTP_ENDPOINT = "http://127.0.0.1:4318"
DEFAULT_GRPC_ENDPOINT = "http://127.0.0.1:4317"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 10.0
#: The three signals and the path of each on an OTLP/HTTP endpoint.
SIGNALS = ("metrics", "traces", "logs")
# The spec gives OTLP timeouts in milliseconds; the Python SDK (and so otel-rl) reads seconds.
_TIMEOUT_LOOKS_LIKE_MS = 300.0


@dataclass(frozen=True)
class OtlpSettings:
    """The resolved OTLP settings of one run (see :func:`resolve_otlp`)."""

    protocol: str
    endpoint: str
    timeout_s: float
    interval_s: float
    headers: dict[str, str] = field(default_factory=dict)
    insecure: bool | None = None
    # None: as OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION says (explicit if unset)
    histogram: str | None = None
    # otel-rl's GPU metrics under semantic-convention names (otel_rl.core.catalogue), OTLP only
    semantic_conventions: bool = False


def resolve_otlp(
    otlp: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    signal: str = "metrics",
) -> OtlpSettings:
    """Resolve the ``otlp:`` config section against the environment (config wins per key) for
    one signal: ``metrics``, ``traces`` (the timers' spans) or ``logs`` (the run's events). All
    three go to the same collector with the same headers and Basic auth; each reads its own
    ``OTEL_EXPORTER_OTLP_<SIGNAL>_*`` variables before the generic ones, as the spec says."""
    env = os.environ if environ is None else environ
    var = _Variables(signal)
    protocol = otlp.get("protocol") or _env(env, *var.names("PROTOCOL"))
    protocol = protocol or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"otlp protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r} "
            f"(from the config or {var.shown('PROTOCOL')})"
        )
    endpoint, basic_auth = _split_userinfo(_endpoint(otlp.get("endpoint"), protocol, env, var))
    headers = _headers(otlp.get("headers"), env, var)
    if basic_auth is not None:
        # The endpoint's ``user:password@`` becomes the Basic auth header HTTP clients derive from
        # it, so that the endpoint itself (shown in log lines and errors) carries no secret. An
        # explicit Authorization header wins, as it would over the URL's userinfo.
        headers.setdefault("authorization", basic_auth)
    return OtlpSettings(
        protocol=protocol,
        endpoint=endpoint,
        timeout_s=_timeout(otlp.get("timeout"), env, var),
        interval_s=_interval(otlp.get("interval"), env),
        headers=headers,
        insecure=_insecure(otlp.get("insecure"), env, var),
        histogram=_histogram(otlp.get("histogram"), env),
        semantic_conventions=_semantic_conventions(otlp.get("semantic_conventions")),
    )


def check_otlp_config(otlp: Mapping[str, Any]) -> None:
    """Reject bad ``otlp:`` values at config time (env vars are checked when the run starts).

    With ``otlp.protocol`` unset, the protocol may come from ``OTEL_EXPORTER_OTLP_PROTOCOL``
    when the run starts: an endpoint only gRPC takes (``collector:4317``) is checked then."""
    try:
        resolve_otlp(otlp, environ={})
    except ConfigError as http_error:
        if otlp.get("protocol") is not None:
            raise
        try:
            resolve_otlp({**otlp, "protocol": "grpc"}, environ={})
        except ConfigError:
            raise http_error from None


class OtlpOutput:
    """The run's OTLP metric export: one watched exporter per meter provider, built (and the
    environment checked) before anything starts; :meth:`readers` starts their threads."""

    def __init__(self, otlp: Mapping[str, Any], providers: int) -> None:
        self.settings = resolve_otlp(otlp)
        # The run's events build their exporter at the first event, on the watchdog's thread: a
        # bad OTEL_EXPORTER_OTLP_LOGS_* variable is refused now, before anything starts.
        resolve_otlp(otlp, signal="logs")
        every = f"every {self.settings.interval_s:g} s"
        self._watches = [
            ExportWatch("metrics", self.settings.endpoint, every, counted_in=FAILURES_SERIES)
            for _ in range(providers)
        ]
        self._exporters: list[MetricExporter] = []
        try:
            for watch in self._watches:
                self._exporters.append(
                    WatchedMetricExporter(
                        build_exporter(self.settings),
                        watch,
                        semantic_conventions=self.settings.semantic_conventions,
                    )
                )
        except BaseException:
            self.close()
            raise
        # DEBUG only: the endpoint is already free of userinfo (see resolve_otlp), but where
        # metrics go is the Logger's message to give, once.
        _log.debug(
            "otel-rl: OTLP metrics to %s (%s)", self.settings.endpoint, self.settings.protocol
        )

    def readers(self) -> list[PeriodicExportingMetricReader]:
        """One periodic reader per exporter (a reader serves one provider); each starts its
        thread here and shuts its exporter down with it."""
        return [
            PeriodicExportingMetricReader(
                exporter,
                export_interval_millis=self.settings.interval_s * 1000,
                export_timeout_millis=self.settings.timeout_s * 1000,
            )
            for exporter in self._exporters
        ]

    def failures(self) -> int:
        """Exports that have failed so far, every provider's together."""
        return sum(w.failures for w in self._watches)

    def close(self) -> None:
        """Shut the exporters down when no reader was made to do it."""
        for exporter in self._exporters:
            exporter.shutdown()


#: The SDK's OTLP exporter class of each signal and protocol: (package, module, class).
_SDK_EXPORTERS = {
    ("metrics", "http/protobuf"): ("http", "metric_exporter", "OTLPMetricExporter"),
    ("metrics", "grpc"): ("grpc", "metric_exporter", "OTLPMetricExporter"),
    ("traces", "http/protobuf"): ("http", "trace_exporter", "OTLPSpanExporter"),
    ("traces", "grpc"): ("grpc", "trace_exporter", "OTLPSpanExporter"),
    ("logs", "http/protobuf"): ("http", "_log_exporter", "OTLPLogExporter"),
    ("logs", "grpc"): ("grpc", "_log_exporter", "OTLPLogExporter"),
}


def build_exporter(settings: OtlpSettings) -> Any:
    """The OTLP metric exporter for ``settings`` (HTTP or gRPC package imported here, lazily)."""
    return _sdk_exporter(
        settings, "metrics", preferred_aggregation=_aggregation(settings.histogram)
    )


def build_span_exporter(settings: OtlpSettings, meter_provider: Any = None) -> Any:
    """The SDK's OTLP span exporter for ``settings`` (resolved with ``signal="traces"``)."""
    if settings.protocol == "grpc":
        return _sdk_exporter(settings, "traces")
    return _sdk_exporter(settings, "traces", meter_provider=meter_provider)


def build_log_exporter(settings: OtlpSettings) -> Any:
    """The SDK's OTLP log-record exporter for ``settings`` (resolved with ``signal="logs"``)."""
    return _sdk_exporter(settings, "logs")


def _sdk_exporter(settings: OtlpSettings, signal: str, **extra: Any) -> Any:
    package, module, name = _SDK_EXPORTERS[(signal, settings.protocol)]
    try:
        found = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{package}.{module}")
    except ImportError as exc:
        raise ConfigError(
            f"otlp {signal} over {settings.protocol} needs "
            f"'opentelemetry-exporter-otlp-proto-{package}': pip install 'otel-rl[otlp]'"
        ) from exc
    if settings.protocol == "grpc":
        extra["insecure"] = settings.insecure
    return getattr(found, name)(
        endpoint=settings.endpoint,
        headers=settings.headers or None,
        timeout=settings.timeout_s,
        **extra,
    )


@dataclass(frozen=True)
class _Variables:
    """The ``OTEL_EXPORTER_OTLP_*`` variables of one signal, signal-specific first."""

    signal: str

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")

    def names(self, setting: str) -> tuple[str, str]:
        return (
            f"OTEL_EXPORTER_OTLP_{self.signal.upper()}_{setting}",
            f"OTEL_EXPORTER_OTLP_{setting}",
        )

    def shown(self, setting: str) -> str:
        return f"OTEL_EXPORTER_OTLP_[{self.signal.upper()}_]{setting}"

    def with_path(self, base: str) -> str:
        """``base`` (a collector's URL, perhaps with another signal's path) + ``/v1/<signal>``."""
        base = base.rstrip("/")
        for signal in SIGNALS:
            base = base.removesuffix(f"/v1/{signal}")
        return f"{base}/v1/{self.signal}"


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def _endpoint(
    configured: str | None, protocol: str, env: Mapping[str, str], var: _Variables
) -> str:
    specific_name, generic_name = var.names("ENDPOINT")
    if configured:
        given, source = str(configured).strip(), "otlp.endpoint"
    elif specific := _env(env, specific_name):
        given, source = specific, specific_name
    elif generic := _env(env, generic_name):
        given, source = generic, generic_name
    else:
        return DEFAULT_GRPC_ENDPOINT if protocol == "grpc" else var.with_path(DEFAULT_HTTP_ENDPOINT)
    problem = endpoint_problem(given, protocol)
    if problem is not None:
        raise ConfigError(f"{source} {_shown(given)!r}: {problem}")
    # Per the spec, the signal-specific variable is the full URL; the generic one is a base.
    if protocol == "grpc" or source == specific_name:
        return given
    return var.with_path(given)


#: gRPC name-resolver schemes: a target such as ``unix:///run/otel.sock`` reaches gRPC as it is.
GRPC_TARGET_SCHEMES = ("unix", "unix-abstract", "dns", "ipv4", "ipv6", "vsock")
_DEFAULT_PORTS = {"http/protobuf": 4318, "grpc": 4317}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:/@\[\]]+):(\d{1,5})$")


def endpoint_problem(endpoint: str, protocol: str) -> str | None:
    """Why ``endpoint`` cannot be the collector's address over ``protocol``, with the URL that
    was likely meant; ``None`` when it can.

    OTLP/HTTP needs an ``http://`` or ``https://`` URL with a host. The SDK's gRPC exporter also
    takes ``host:port`` (TLS unless ``otlp.insecure``/``OTEL_EXPORTER_OTLP_INSECURE`` says
    otherwise) and gRPC's own targets (``unix:///path``, ``dns:///host:port``, ...). Anything
    else would be retried at every export as if the collector were down, forever.
    """
    grpc = protocol == "grpc"
    scheme_match = _SCHEME.match(endpoint)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if "://" not in endpoint:
        if grpc and (_HOST_PORT.match(endpoint) or scheme in GRPC_TARGET_SCHEMES):
            return None
        return f"{_forms(protocol)}; did you mean {_shown(_suggested(endpoint, protocol))!r}?"
    rest = endpoint.split("://", 1)[1]
    if scheme not in ("http", "https"):
        if grpc and scheme in GRPC_TARGET_SCHEMES:
            authority = urlsplit(endpoint).netloc
            if not authority:
                return None
            # The SDK's exporter keeps a URL's authority alone, as if it were the collector.
            return (
                f"the OTel gRPC exporter would connect to {_shown(authority)!r} alone; write "
                f"the target without an authority, e.g. '{scheme}:///host:port'"
            )
        return (
            f"{_forms(protocol)}, not {scheme or 'an empty scheme'}://; did you mean "
            f"{_shown(_suggested(rest, protocol))!r}?"
        )
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return f"the URL has no host; e.g. '{scheme}://127.0.0.1:{_DEFAULT_PORTS[protocol]}'"
    try:
        parts.port  # noqa: B018 - it raises on a port that is not a number up to 65535
    except ValueError:
        return "its port is not a number from 0 to 65535"
    return None


def _forms(protocol: str) -> str:
    if protocol == "grpc":
        return (
            "OTLP over gRPC needs http://host:port (plaintext), https://host:port (TLS), "
            "host:port or a gRPC target (unix:///path)"
        )
    return "OTLP/HTTP needs a URL starting with http:// (or https:// for TLS)"


def _suggested(address: str, protocol: str) -> str:
    """``address`` (what follows a wrong scheme, or all of it) as an ``http://`` URL, with the
    protocol's port when it names none."""
    address = address.lstrip("/")
    hostport, sep, path = address.partition("/")
    host = hostport.rpartition("@")[2]
    if host and not re.search(r":\d*$", host.removesuffix("]") if "]" in host else host):
        hostport = f"{hostport}:{_DEFAULT_PORTS[protocol]}"
    return f"http://{hostport}{sep}{path}"


def _shown(endpoint: str) -> str:
    """``endpoint`` as an error may show it: a ``user:password@`` becomes ``***@``."""
    return re.sub(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?/*)[^/@]*@", r"\1***@", endpoint)


def _split_userinfo(endpoint: str) -> tuple[str, str | None]:
    """``http://user:pw@host/x`` → (``http://host/x``, ``"Basic <base64(user:pw)>"``)."""
    parts = urlsplit(endpoint)
    if "@" not in parts.netloc:
        return endpoint, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    credentials = f"{unquote(user)}:{unquote(password)}".encode()
    stripped = urlunsplit(parts._replace(netloc=hostport))
    return stripped, "Basic " + base64.b64encode(credentials).decode("ascii")


def _timeout(configured: Any, env: Mapping[str, str], var: _Variables) -> float:
    if configured is not None:
        return _positive(configured, "otlp.timeout")
    raw = _env(env, *var.names("TIMEOUT"))
    if raw is None:
        return DEFAULT_TIMEOUT_S
    seconds = _positive(raw, var.shown("TIMEOUT"))
    if seconds > _TIMEOUT_LOOKS_LIKE_MS:
        _log.warning(
            "otel-rl: %s=%s is read in seconds (as the Python OTel SDK reads it); a value in "
            "milliseconds makes shutdown wait that long",
            var.shown("TIMEOUT"), raw,
        )  # fmt: skip
    return seconds


def _interval(configured: Any, env: Mapping[str, str]) -> float:
    if configured is not None:
        return _positive(configured, "otlp.interval")
    raw = _env(env, "OTEL_METRIC_EXPORT_INTERVAL")
    if raw is None:
        return DEFAULT_INTERVAL_S
    return _positive(raw, "OTEL_METRIC_EXPORT_INTERVAL") / 1000  # milliseconds, as the spec says


def _headers(
    configured: Mapping[str, Any] | None, env: Mapping[str, str], var: _Variables
) -> dict[str, str]:
    from opentelemetry.util.re import parse_env_headers

    raw = _env(env, *var.names("HEADERS"))
    for part in (raw or "").split(","):
        if part.strip() and "=" not in part:  # the SDK would drop it with a log line
            name = part.strip()[:40]  # (a header's value may be a secret: never shown)
            raise ConfigError(f"{var.shown('HEADERS')}: the header {name!r} has no value: "
                              "write name=value pairs joined by commas")  # fmt: skip
    merged = {k.lower(): v for k, v in parse_env_headers(raw or "", liberal=True).items()}
    merged.update({str(k).lower(): str(v) for k, v in (configured or {}).items()})
    return merged


def _insecure(configured: Any, env: Mapping[str, str], var: _Variables) -> bool | None:
    """Only what the config sets: left ``None``, the SDK's gRPC exporter reads
    ``OTEL_EXPORTER_OTLP_[METRICS_]INSECURE`` itself (checked here: it takes any other word
    for false), then the endpoint's scheme."""
    if configured is not None and not isinstance(configured, bool):
        raise ConfigError(f"otlp.insecure must be true, false or null, got {configured!r}")
    raw = _env(env, *var.names("INSECURE"))
    if configured is None and raw is not None and raw.lower() not in ("true", "false"):
        raise ConfigError(f"{var.shown('INSECURE')} must be true or false, got {raw!r}")
    return configured


#: ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``'s values, as the spec names them.
_HISTOGRAM_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
_HISTOGRAM_VALUES = ("explicit_bucket_histogram", "base2_exponential_bucket_histogram")


def _histogram(configured: Any, env: Mapping[str, str]) -> str | None:
    if configured is None:
        raw = _env(env, _HISTOGRAM_VARIABLE)  # the SDK reads it (checked here: it would warn
        if raw is not None and raw.lower() not in _HISTOGRAM_VALUES:  # and use explicit)
            raise ConfigError(f"{_HISTOGRAM_VARIABLE} must be one of "
                              f"{', '.join(_HISTOGRAM_VALUES)}, got {raw!r}")  # fmt: skip
        return None
    if configured not in HISTOGRAMS:
        raise ConfigError(
            f"otlp.histogram must be one of {', '.join(HISTOGRAMS)} or null, got {configured!r}"
        )
    return str(configured)


def _semantic_conventions(configured: Any) -> bool:
    if configured is not None and not isinstance(configured, bool):
        raise ConfigError(f"otlp.semantic_conventions must be true or false, got {configured!r}")
    return bool(configured)


def _aggregation(histogram: str | None) -> dict[type, Any] | None:
    """Exporter-level histogram aggregation: it applies to this reader only, so Prometheus keeps
    explicit buckets (a View would change every reader of the provider)."""
    if histogram is None:
        return None  # the exporter reads OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import (
        ExplicitBucketHistogramAggregation,
        ExponentialBucketHistogramAggregation,
    )

    if histogram == "exponential":
        return {Histogram: ExponentialBucketHistogramAggregation()}
    # No boundaries given: each histogram keeps its advisory ones (timers: TIMING_BUCKETS).
    return {Histogram: ExplicitBucketHistogramAggregation()}


def _positive(value: Any, what: str) -> float:
    # float() reads "inf", "nan" and "1e999" (inf) too: refused, as the schema refuses them,
    # since an infinite interval or timeout never exports and overflows at shutdown.
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}") from exc
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    if number > MAX_SECONDS:
        raise ConfigError(f"{what} must be at most {MAX_SECONDS:g} seconds, got {value!r}")
    return number


# ---- a collector that is down ------------------------------------------------------------------

#: The self-telemetry series that counts failed OTLP metric exports (docs/outputs.md).
FAILURES_SERIES = "otel_rl_otlp_export_failures_total"

_state_lock = threading.Lock()
_ours = threading.local()  # .depth: our export calls on this thread; .said: the SDK's first line


@dataclass
class _Collector:
    """What the log has said about one collector (scheme, host and port): a run's metric
    exporters and its span exporter reach the same collector, and one line is enough."""

    failing: weakref.WeakSet[ExportWatch] = field(default_factory=weakref.WeakSet)
    missed: int = 0  # exports failed since the warning
    # Told to be down and not seen back since: an exporter shut down while failing (the metrics
    # at finish()) leaves it down, so that the spans failing after it add no second warning.
    down: bool = False


_collectors: dict[str, _Collector] = {}


class ExportWatch:
    """One exporter's results, told once: a warning at the first failure while the collector
    was fine, a line when every exporter to it that failed works again; ``failures`` counts.

    Each exporter has its own watch (its own failing or not): two exporters to one collector of
    which only one fails (a payload too large, say) keep one warning, not one per export.
    """

    def __init__(
        self, signal: str, endpoint: str, every: str, counted_in: str | None = None
    ) -> None:
        self.signal = signal
        self.endpoint = endpoint
        self.failures = 0
        self._every = every
        self._counted_in = counted_in
        self._failing = False
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        with _state_lock:
            self._collector = _collectors.setdefault(parts.netloc.lower(), _Collector())

    def failed(self, reason: str) -> None:
        with _state_lock:
            self.failures += 1
            collector = self._collector
            first = not self._failing and not collector.failing and not collector.down
            self._failing = True
            collector.down = True
            collector.failing.add(self)
            collector.missed = 1 if first else collector.missed + 1
        if first:
            counted = f", counts the failures in {self._counted_in}" if self._counted_in else ""
            _log.warning(
                "otel-rl: OTLP export of %s to %s failed: %s. Training goes on; otel-rl keeps "
                "retrying (%s) without a line per failure%s, and says when the collector is "
                "reachable again",
                self.signal, self.endpoint, shorten(reason.rstrip(". "), MAX_SHOWN_REASON),
                self._every,
                counted,
            )  # fmt: skip

    def succeeded(self) -> None:
        with _state_lock:
            if not self._failing:
                if not self._collector.failing:  # it answers: whoever said it was down is done
                    self._collector.down = False
                return
            self._failing = False
            collector = self._collector
            collector.failing.discard(self)
            back = not collector.failing
            if back:
                collector.down = False
            missed = collector.missed
        if back:
            _log.warning(
                "otel-rl: OTLP collector at %s reachable again (%d exports had failed)",
                self.endpoint, missed,
            )  # fmt: skip

    def close(self) -> None:
        """The exporter is shut down: its failures no longer hold the collector's state."""
        with _state_lock:
            self._collector.failing.discard(self)


class _WhileOurExportRuns(logging.Filter):
    """Drops a record of the SDK's exporter loggers while one of our export calls runs on the
    record's thread (the watch says it once instead); any other record passes, so exporters
    the application builds itself keep their lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(_ours, "depth", 0):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a record with bad arguments still goes quiet
            text = str(record.msg)
        if _ours.said is None:
            _ours.said = text
        _log.debug("otel-rl: OTLP exporter (%s): %s", record.name, text)
        return False


_FILTER = _WhileOurExportRuns()


def _quiet_loggers_of(exporter: Any) -> None:
    """Put the filter on every logger the SDK's exporter logs through: its classes' modules and
    its HTTP client's (which is given the exporter's logger, or logs through its own)."""
    objects = [exporter, getattr(exporter, "_client", None)]
    modules = {
        cls.__module__ for obj in objects for cls in type(obj).__mro__
        if cls.__module__.startswith("opentelemetry.")
    }  # fmt: skip
    for name in modules:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


_Result = TypeVar("_Result")


def _watched_call(watch: ExportWatch, call: Callable[[], _Result], success: _Result) -> bool:
    """Run one export with the SDK's loggers quiet on this thread; tell ``watch`` the outcome."""
    depth = getattr(_ours, "depth", 0)
    if depth == 0:
        _ours.said = None
    _ours.depth = depth + 1
    try:
        result: Any = call()
        problem = None
    except Exception as exc:  # an exporter that raises has failed this export, nothing more
        result, problem = None, f"{type(exc).__name__}: {exc}"
    finally:
        _ours.depth = depth
    if result == success:
        watch.succeeded()
        return True
    said = _ours.said if depth == 0 else None
    watch.failed(problem or said or "the exporter reported a failure")
    return False


def _in_a_fork_child(made_in: int) -> bool:
    """The SDK starts its readers' and span processors' threads again in a fork child, with the
    parent's measurements and spans: those are the parent's to send (once), so an exporter
    made before the fork sends nothing from the child (where the parent's Logger is disabled)."""
    return os.getpid() != made_in


class WatchedMetricExporter(MetricExporter):
    """The SDK's OTLP metric exporter, its failures told by an :class:`ExportWatch`; with
    ``semantic_conventions``, what it sends is renamed first (:class:`SemanticConventionNames`).
    In a fork child it sends nothing (:func:`_in_a_fork_child`).
    """

    def __init__(
        self, inner: MetricExporter, watch: ExportWatch, *, semantic_conventions: bool = False
    ) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self.watch = watch
        self._rename = SemanticConventionNames() if semantic_conventions else None
        self._pid = os.getpid()
        _quiet_loggers_of(inner)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if _in_a_fork_child(self._pid):
            return MetricExportResult.SUCCESS
        if self._rename is not None:
            metrics_data = self._rename(metrics_data)

        def call() -> MetricExportResult:
            return self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

        ok = _watched_call(self.watch, call, MetricExportResult.SUCCESS)
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis=timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.watch.close()
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


# ---- semantic conventions (otlp.semantic_conventions) -------------------------------------------


class SemanticConventionNames:
    """Rewrites otel-rl's own metrics that an OpenTelemetry semantic convention defines into
    the convention's name, unit, instrument, value and attributes, in the data one OTLP
    exporter sends; the mapping is declared with each metric in :mod:`otel_rl.core.catalogue`.

    Why in the exporter rather than with SDK Views: a View applies to every reader of its
    MeterProvider, and each of the run's two providers also feeds Prometheus (and the main one
    the trackers' step reader), which must keep otel-rl's names. A third provider for OTLP
    alone would run every observable callback once more per collection and split the
    instruments between providers. Renaming here changes what OTLP sends and nothing else.
    """

    def __init__(self) -> None:
        # The start of the cumulative sums an up-down counter becomes: this exporter's start,
        # the same for every export so that a backend sees one continuing series.
        self._start_ns = time.time_ns()

    def __call__(self, data: MetricsData) -> MetricsData:
        renamed = catalogue.SEMCONV_BY_NAME
        resource_metrics = []
        for rm in data.resource_metrics:
            scopes = []
            for sm in rm.scope_metrics:
                if catalogue.is_own_scope(sm.scope.name) and any(
                    m.name in renamed for m in sm.metrics
                ):
                    metrics = [self._renamed(m, renamed.get(m.name)) for m in sm.metrics]
                    sm = replace(sm, metrics=metrics)
                scopes.append(sm)
            resource_metrics.append(replace(rm, scope_metrics=scopes))
        return MetricsData(resource_metrics=resource_metrics)

    def _renamed(self, metric: Metric, entry: catalogue.Metric | None) -> Metric:
        semconv = entry.semconv if entry is not None else None
        if semconv is None or not isinstance(metric.data, Gauge):
            return metric
        sum_start = self._start_ns if semconv.kind == "updowncounter" else None
        points = [
            NumberDataPoint(
                attributes=semconv.point_attributes(point.attributes or {}),
                start_time_unix_nano=sum_start or point.start_time_unix_nano,
                time_unix_nano=point.time_unix_nano,
                value=point.value / semconv.per if semconv.per != 1 else point.value,
                exemplars=point.exemplars,
            )
            for point in metric.data.data_points
        ]
        data: Gauge | Sum = (
            Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=False)
            if sum_start is not None
            else Gauge(points)
        )
        return Metric(
            name=semconv.name, description=semconv.description, unit=semconv.unit, data=data
        )


class WatchedSpanExporter:
    """An OTLP span (or log record) exporter, its failures told once by an
    :class:`ExportWatch`.

    Duck-typed (``export``, ``shutdown``, ``force_flush``) rather than a ``SpanExporter``
    subclass, so that this module does not import the tracing SDK when tracing is off. In a
    fork child it sends nothing (:func:`_in_a_fork_child`).
    """

    signal = "spans"

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        endpoint = str(getattr(inner, "_endpoint", None) or "the OTLP endpoint")
        self.watch = ExportWatch(self.signal, endpoint, "at every batch")
        self._pid = os.getpid()
        _quiet_loggers_of(inner)

    def export(self, items: Sequence[Any]) -> Any:
        success, failure = self._results()
        if _in_a_fork_child(self._pid):
            return success
        ok = _watched_call(self.watch, lambda: self._inner.export(items), success)
        return success if ok else failure

    def _results(self) -> tuple[Any, Any]:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS, SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.watch.close()
        self._inner.shutdown()


class WatchedLogExporter(WatchedSpanExporter):
    """An OTLP log record exporter (the run's stall and straggler events), told the same way."""

    signal = "log records"

    def _results(self) -> tuple[Any, Any]:
        from opentelemetry.sdk._logs.export import LogRecordExportResult

        return LogRecordExportResult.SUCCESS, LogRecordExportResult.FAILURE
