"""The logger config declared once: defaults, types, validation and the docs table.

Each section is a pydantic (v2) model in strict mode with ``extra="forbid"``: ``"false"`` is
not a bool, ``"2"`` is not an int, ``"30s"`` is not a number of seconds, and an unknown key is an
error. :func:`validate` turns pydantic's errors into one :class:`~otel_rl.core.errors.ConfigError`
that names each key path, the value given and what is expected; :func:`markdown_table` renders
the key table of docs/configuration.md from the same declarations, so the two never drift.

Why pydantic rather than a dataclass tree with a hand-written validator: pydantic already does
strict type checks, numeric bounds, literals and nested collections, and reports every error of
a config at once with its location; a dataclass tree would need all of that written and tested
here. Its cost stays off ``import otel_rl``: this module is imported lazily by
:func:`otel_rl.config.loading.resolve_settings`, i.e. once, when the first Logger is built. Measured
on a
2-core machine (Python 3.11, pydantic 2.13): importing pydantic's models takes about 0.3 s and
building these models about 0.2 s, once per process (a dataclass tree of the same shape: about
0.05 s); validating a config then takes about 0.5 ms with either. Training processes that run
Ray, vLLM, W&B or MLflow have pydantic loaded already, which leaves only the build.

Conventions: ints are accepted where floats are expected (``10`` seconds); no number may be
``inf`` or ``nan``; a section given as ``null`` keeps its defaults; a list may be given as a
tuple.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from otel_rl.core.errors import ConfigError, shorten
from otel_rl.delivery.options import SHUTDOWN_TIMEOUT, ExportOptions
from otel_rl.process.deadline import MAX_SECONDS

# ---- value types ---------------------------------------------------------------------------


def _expected(what: str) -> PydanticCustomError:
    # The "expected" type carries our own wording of what a key takes into the error message.
    return PydanticCustomError("expected", "expected {expected}", {"expected": what})


def _path(value: Any) -> Any:
    if isinstance(value, (str, os.PathLike)) and str(value):
        return value
    raise _expected("a path (a non-empty string)")


def _endpoint(value: str) -> str:
    # The same check as RolloutMonitor.add_endpoints(), so both accept the same endpoints.
    from otel_rl.ray.discovery import endpoint_problem

    problem = endpoint_problem(value)
    if problem is not None:
        raise _expected(problem.removeprefix("expected "))
    return value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise _expected(f"a valid regular expression ({exc})") from None
    return value


def _listify(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _none_is_empty_mapping(value: Any) -> Any:
    return {} if value is None else value


Path_ = Annotated[Any, AfterValidator(_path)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
StrList = Annotated[list[str], BeforeValidator(_listify)]
EndpointList = Annotated[list[Annotated[str, AfterValidator(_endpoint)]], BeforeValidator(_listify)]
RegexList = Annotated[list[Annotated[str, AfterValidator(_regex)]], BeforeValidator(_listify)]
#: A tracker's own settings, handed to its SDK as they are (checked by
#: otel_rl.config.tracker_settings).
Passthrough = Annotated[dict[str, Any], BeforeValidator(_none_is_empty_mapping)]


def _field(
    default: Any = None,
    meaning: str = "",
    *,
    shown_type: str | None = None,
    shown_default: str | None = None,
    factory: Any = None,
    **bounds: Any,
) -> Any:
    """A config key: its default, the docs' "meaning" column and, where the annotation alone
    would read poorly in the docs, the type and default as the table shows them."""
    shown = {"shown_type": shown_type, "shown_default": shown_default}
    extra: dict[str, Any] = {k: v for k, v in shown.items() if v is not None}
    if factory is not None:
        return Field(
            default_factory=factory, description=meaning, json_schema_extra=extra, **bounds
        )
    return Field(default, description=meaning, json_schema_extra=extra, **bounds)


class Section(BaseModel, Mapping[str, Any]):
    """One mapping of the config: strict types, no unknown keys."""

    # No inf or nan: every number here is a duration, an interval, a size or a port, and a
    # non-finite one passes ``gt=0`` only to overflow later, on a thread or in ``finish()``.
    model_config = ConfigDict(
        strict=True, extra="forbid", validate_default=False, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_mapping(cls, data: Any) -> Any:
        # Strict models take dicts only; an OmegaConf DictConfig or a MappingProxy is a mapping
        # all the same. A nested section or a collection given as null keeps its default.
        if not isinstance(data, Mapping):
            return data
        out = {}
        for key, value in data.items():
            field = cls.model_fields.get(key) if isinstance(key, str) else None
            if value is None and field is not None and _nullable_by_default(field):
                continue
            if isinstance(value, Mapping) and not isinstance(value, dict):
                value = dict(value)
            out[key] = value
        return out

    # Read as a mapping too: ``cfg["export"]["delivery"]`` is ``cfg.export.delivery``. Code
    # written for the plain dict, and a third-party tracker's ``from_config(cfg)`` (documented as
    # taking a mapping), read the typed config unchanged. Read-only: the typed fields are set.

    def __getitem__(self, key: str) -> Any:
        if isinstance(key, str) and key in type(self).model_fields:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # keys, as a mapping's
        return iter(type(self).model_fields)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _nullable_by_default(field: Any) -> bool:
    """Whether ``null`` for this key means "the default": sections and collections."""
    if field.default_factory is not None:
        return True
    return isinstance(field.default, Section)


# ---- sections --------------------------------------------------------------------------------


class GpuMonitoringSection(Section):
    collection_interval: Seconds = _field(10.0, "how often nodes are scraped", shown_type="seconds")
    flush_interval: Seconds = _field(
        10.0, "how often GPU rows reach trackers", shown_type="seconds"
    )
    endpoints: StrList = _field(
        meaning="static node endpoints (`host:port` or URLs) instead of Ray discovery",
        factory=list,
        shown_type="list of URLs",
        shown_default="`[]` (use `ray.nodes()`)",
    )
    timeout: Seconds = _field(5.0, "limit for one node's whole request", shown_type="seconds")


class RolloutMonitoringSection(Section):
    endpoints: EndpointList = _field(
        meaning="inference engines' `/metrics` URLs (vLLM, SGLang) "
        "([rollout-monitoring.md](rollout-monitoring.md))",
        factory=list,
        shown_type="list of `host:port` or http(s) URLs",
    )
    collection_interval: Seconds = _field(
        5.0, "how often the engines are scraped", shown_type="seconds"
    )
    engine: Literal["auto", "vllm", "vllm-v1", "vllm-v0", "sglang"] = _field(
        "auto", "which engine's metric names to read (`auto`: recognised per page)"
    )
    timeout: Seconds = _field(5.0, "limit for one engine's request", shown_type="seconds")
    per_engine: bool = _field(True, "also keep rows per engine, not only the totals")
    enabled: bool | None = _field(
        None,
        "unset: on when `endpoints` is given; `true` with no "
        "endpoints: `logger.rollout_monitor.add_endpoints()` later",
    )
    sd_file: Path_ | None = _field(
        None,
        "keep the endpoints in this Prometheus `file_sd` file, labelled with the run id "
        "(for a collector or Prometheus)",
        shown_type="path",
    )
    source: Literal["http", "ray"] = _field(
        "http",
        "`ray`: also read vLLM engines that forward their metrics to Ray "
        "(`RayPrometheusStatLogger`) from every Ray node's metrics page, no URLs needed",
    )


class PrometheusSection(Section):
    enabled: bool = _field(False, "serve `/metrics`")
    host: str = _field("127.0.0.1", "address to listen on")
    port: int = _field(9464, "port (0 picks a free one)", ge=0, le=65535)


class OtlpSection(Section):
    enabled: bool = _field(False, "push metrics with OTLP ([outputs.md](outputs.md))")
    endpoint: str | None = _field(
        None,
        "collector URL, `http://` or `https://` (gRPC also takes `host:port` and "
        "`unix:///path`; anything else is refused with the URL meant); unset: "
        "`OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT`, then `http://127.0.0.1:4318`",
        shown_type="URL",
    )
    protocol: Literal["http/protobuf", "grpc"] | None = _field(
        None, "unset: `OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL`, then `http/protobuf`"
    )
    interval: Seconds | None = _field(
        None, "export period; unset: `OTEL_METRIC_EXPORT_INTERVAL`, then `10`", shown_type="seconds"
    )
    timeout: Seconds | None = _field(
        None,
        "per-export timeout; unset: `OTEL_EXPORTER_OTLP_[METRICS_]TIMEOUT`, then `5`",
        shown_type="seconds",
    )
    headers: dict[str, str] = _field(
        meaning="request headers, merged over `OTEL_EXPORTER_OTLP_[METRICS_]HEADERS`",
        factory=dict,
        shown_type="mapping of str",
    )
    insecure: bool | None = _field(None, "gRPC without TLS; unset: from the endpoint's scheme")
    histogram: Literal["explicit", "exponential"] | None = _field(
        None,
        "histogram aggregation on OTLP only (unset: `explicit`); Prometheus keeps explicit buckets",
    )
    semantic_conventions: bool = _field(
        False,
        "OTLP only: GPU metrics under OpenTelemetry's semantic-convention names and units "
        "(`hw.gpu.utilization`, ...); Prometheus and tracker keys keep otel-rl's "
        "([metrics.md](metrics.md#semantic-conventions-on-otlp))",
    )


class ExportSection(Section):
    queue_size: int = _field(
        ExportOptions.queue_size, "records each tracker may hold in memory", ge=1
    )
    on_full: Literal["spool", "block", "drop_oldest"] = _field(
        ExportOptions.on_full,
        "what a full queue does ([reliability.md](reliability.md#backpressure-exporton_full))",
    )
    shutdown_timeout: float = _field(
        SHUTDOWN_TIMEOUT,
        "deadline of `finish()` and exit: every part gives up at it",
        shown_type="seconds",
        ge=0,
        le=MAX_SECONDS,
    )
    retry_max_backoff: Seconds = _field(
        ExportOptions.retry_max_backoff,
        "ceiling of the exponential retry backoff (a server's `Retry-After` is honoured up to "
        "a minute, or this when longer: "
        "[reliability.md](reliability.md#errors-transient-or-permanent))",
        shown_type="seconds",
    )
    spool: bool = _field(True, "write-ahead log per tracker under `<log_dir>/.otel-rl/spool/`")
    fsync_interval: Seconds = _field(
        ExportOptions.fsync_interval,
        "how often the spool and its delivery marks are fsynced",
        shown_type="seconds",
    )
    handle_signals: bool = _field(True, "SIGTERM drains the trackers (`SystemExit(143)`)")
    delivery: Literal["thread", "process"] = _field(
        "thread",
        "where the trackers built from the config run: threads of the training process, or a "
        "delivery process of their own ([reliability.md](reliability.md#the-delivery-process))",
    )


class TracingSection(Section):
    enabled: bool | None = _field(
        None,
        "unset: every `timer()`'s span goes to `<log_dir>/traces.jsonl`, made from the timers' "
        "records off the training thread, with no tracing SDK; `true`: timers are also OTel SDK "
        "spans, exported with OTLP when `otlp.enabled` and followed into Ray actors and other "
        "ranks ([distributed.md](distributed.md#timers-as-spans)); `false`: no spans",
        shown_default="unset",
    )
    file: bool = _field(
        True,
        "the spans go to `<log_dir>/traces.jsonl`, OTLP JSON "
        "([tracing.md](tracing.md#spans-on-disk))",
    )
    file_max_mb: int = _field(
        64, "`traces.jsonl` and the `traces.1.jsonl` it rotates to stay within this", ge=1
    )
    picture: bool = _field(
        True,
        "with `file`: the timeline of the last steps goes to the trackers as a page and an "
        "image ([timeline.md](timeline.md#in-the-trackers))",
    )
    picture_every: float = _field(
        1800.0, "how often that picture is sent (and once at the end); 0: only at the end",
        shown_type="seconds", ge=0, le=MAX_SECONDS,
    )  # fmt: skip
    picture_steps: int = _field(10, "the steps that picture shows: the last ones", ge=1, le=1000)


class StallsSection(Section):
    enabled: bool = _field(True, "the stall watchdog ([stalls.md](stalls.md))")
    after: Seconds = _field(
        600.0, "a run with no step for this long is stalled (at least)", shown_type="seconds"
    )
    factor: float = _field(
        10.0, "... or for this many times the median of the recent step times, if longer", gt=0
    )
    phase_after: Seconds = _field(
        30.0,
        "a timer open this long with no step is a stall, once it has completed before (or "
        "`factor` times the p95 of its last 20 uses, if longer)",
        shown_type="seconds",
    )
    stacks_timeout: Seconds = _field(
        10.0, "how long a stall report may wait for the Ray actors' stacks", shown_type="seconds"
    )
    straggler_window: int = _field(
        10, "steps over which a rank slowest in more than half of them is named", ge=2
    )
    straggler_skew: float = _field(
        1.2, "a step counts for its slowest rank when that rank took this many times the median",
        ge=1,
    )


class RedactionSection(Section):
    extra_patterns: RegexList = _field(
        meaning="more secret patterns (regular expressions) for redaction "
        "([Hyperparameters](#hyperparameters))",
        factory=list,
        shown_type="list of regex",
    )


class LoggerSettings(Section):
    """The logger config (NeMo RL's logger keys plus otel-rl's own), typed.

    The built-in trackers' ``<name>_enabled`` flags and ``<name>:`` sections are added to it by
    :func:`settings_model` from what each tracker's exporter class declares; read them with
    :func:`otel_rl.delivery.registry.enabled_backends` and :meth:`tracker_section`.
    """

    log_dir: Path_ = _field("logs", "root of every on-disk output", shown_type="path")
    trackers: dict[str, Passthrough] = _field(
        meaning="more trackers by registry name with their options, e.g. a third-party one: "
        "`{mytracker: {option: 1}}` ([backends](backends/README.md#adding-a-tracker))",
        factory=dict,
        shown_type="mapping",
    )
    anatomy: bool = _field(
        True, "each step's `anatomy/*` rows: where its time went ([anatomy.md](anatomy.md))"
    )
    monitor_gpus: bool = _field(
        False, "Ray GPU/node metrics ([gpu-monitoring.md](gpu-monitoring.md))"
    )
    gpu_monitoring: GpuMonitoringSection = _field(GpuMonitoringSection())
    rollout_monitoring: RolloutMonitoringSection = _field(RolloutMonitoringSection())
    num_val_samples_to_print: int = _field(0, "validation samples printed", ge=0)
    prometheus: PrometheusSection = _field(PrometheusSection())
    otlp: OtlpSection = _field(OtlpSection())
    export: ExportSection = _field(ExportSection())
    strict: bool = _field(False, "raise `otel_rl.MetricError` on bad input")
    capture_global_meters: bool = _field(True, "route OTel's global meters to this Logger")
    service_name: str | None = _field(
        None, "OTel `service.name`", shown_default="`OTEL_SERVICE_NAME` or `otel-rl`"
    )
    run_id: str | None = _field(
        None, "resource attribute; the run's id in every output",
        shown_default="`OTEL_RL_RUN_ID` or random",
    )  # fmt: skip
    resume: Literal["auto", "never", "must"] = _field(
        "auto",
        "a launch with the `run_id` of one before it in this `log_dir`: `auto` continues that "
        "run in every tracker, `must` also refuses to start a new one, `never` starts a new "
        "run ([reliability.md](reliability.md#a-run-that-resumes))",
    )
    experiment: str | None = _field(None, "resource attribute")
    role: str = _field("driver", "resource attribute")
    rank: int = _field(0, "resource attribute", ge=0)
    reductions: dict[str, Any] = _field(
        meaning="how worker metrics combine across ranks, by key or glob: "
        '`{"timing/*": [max, min], "train/*_count": sum}` ([distributed.md](distributed.md))',
        factory=dict,
        shown_type="mapping",
    )
    tracing: TracingSection = _field(TracingSection())
    stalls: StallsSection = _field(StallsSection())
    redaction: RedactionSection = _field(RedactionSection())

    # The launch this config runs (run/history.py), set by the Logger once it knows it: not a
    # key a user gives, but read with the config where it goes (the delivery process, spools).
    _attempt: int | None = PrivateAttr(None)
    _launch: str | None = PrivateAttr(None)

    @property
    def attempt(self) -> int:
        """The run's launch this is: 1, then 2, ... after relaunches (1 until set)."""
        return 1 if self._attempt is None else self._attempt

    @property
    def launch(self) -> str | None:
        """This launch's id (``None`` until set)."""
        return self._launch

    def set_launch(self, attempt: int, launch: str | None) -> None:
        """Record which launch of the run this config is for (the mapping's ``attempt`` and
        ``launch`` keys from then on)."""
        self._attempt, self._launch = attempt, launch

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        yield from type(self).model_fields
        if self._attempt is not None:
            yield from _LAUNCH_KEYS

    def __getitem__(self, key: str) -> Any:
        if key in _LAUNCH_KEYS and self._attempt is not None:
            return getattr(self, key)
        return super().__getitem__(key)

    def tracker_enabled(self, name: str) -> bool:
        """Whether built-in tracker ``name``'s ``<name>_enabled`` flag is on."""
        return bool(getattr(self, f"{name}_enabled", False))

    def tracker_section(self, name: str) -> Any:
        """The built-in tracker ``name``'s ``<name>:`` section (a model or a mapping)."""
        return getattr(self, name)


#: The mapping keys of :attr:`LoggerSettings.attempt` and :attr:`LoggerSettings.launch` (as
#: otel_rl.run.history's ``ATTEMPT_KEY`` and ``LAUNCH_KEY``).
_LAUNCH_KEYS = ("attempt", "launch")


# ---- the trackers' keys, from their exporter classes --------------------------------------------

#: What each ``kind`` of a tracker's typed key (``otel_rl.exporters.base.ConfigKey``) takes.
_KEY_KINDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "path": (Path_ | None, {"shown_type": "path"}),
    "count": (int, {"ge": 1}),
}


@functools.cache
def settings_model() -> type[LoggerSettings]:
    """:class:`LoggerSettings` with a ``<name>_enabled`` flag and, where the tracker declares
    one, a ``<name>:`` section for each tracker otel-rl registers, in their order."""
    from otel_rl.delivery.registry import builtin_tracker_classes

    fields: dict[str, Any] = {}
    for name, cls in builtin_tracker_classes().items():
        declared = cls.config
        if declared is None:
            raise ConfigError(
                f"the built-in tracker '{name}' ({cls.__module__}.{cls.__qualname__}) declares "
                "no config (TrackerConfig): the config cannot list it"
            )
        for key in (f"{name}_enabled", name):
            if key in LoggerSettings.model_fields:
                raise ConfigError(f"the tracker '{name}' would take the config key '{key}'")
        fields[f"{name}_enabled"] = (bool, _field(declared.enabled, declared.flag))
        if declared.keys:
            section = _section_model(name, declared.keys)
            fields[name] = (section, _field(section()))
        elif declared.mapping:
            fields[name] = (
                Passthrough, _field(meaning=declared.mapping, factory=dict, shown_type="mapping")
            )  # fmt: skip
    model: type[LoggerSettings] = create_model(
        _DERIVED_NAME, __base__=LoggerSettings, __module__=__name__, **fields
    )
    model.__doc__ = LoggerSettings.__doc__
    _derived[_DERIVED_NAME] = model
    return model


#: The name of :func:`settings_model`'s class (its trackers' sections are named after them).
_DERIVED_NAME = "TrackedLoggerSettings"
_derived: dict[str, type[Section]] = {}


def __getattr__(name: str) -> Any:
    # The classes settings_model() builds, by name, so that a pickled config (the delivery
    # process is sent one) finds them in a process that has not built them yet.
    if name == _DERIVED_NAME or name.endswith("Section"):
        settings_model()
        if name in _derived:
            return _derived[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _section_model(name: str, keys: Mapping[str, Any]) -> type[Section]:
    fields: dict[str, Any] = {}
    for key, declared in keys.items():
        if declared.kind not in _KEY_KINDS:
            raise ConfigError(
                f"the tracker '{name}' declares config key '{key}' of unknown kind "
                f"'{declared.kind}' (known: {', '.join(_KEY_KINDS)})"
            )
        annotation, options = _KEY_KINDS[declared.kind]
        options = dict(options)
        if declared.shown_default is not None:
            options["shown_default"] = declared.shown_default
        fields[key] = (annotation, _field(declared.default, declared.meaning, **options))
    section: type[Section] = create_model(
        f"{name.capitalize()}Section", __base__=Section, __module__=__name__, **fields
    )
    _derived[section.__name__] = section
    return section


# ---- validation -------------------------------------------------------------------------------


def validate(user: Mapping[str, Any]) -> dict[str, Any]:
    """The user's config merged over the defaults and checked: a plain nested dict.

    Raises :class:`ConfigError` listing every problem, each with its key path, the value given
    and what the key takes.
    """
    return plain(validate_settings(user))


def validate_settings(user: Mapping[str, Any]) -> LoggerSettings:
    """The user's config merged over the defaults and checked: the typed config.

    Raises :class:`ConfigError` as :func:`validate` does.
    """
    try:
        settings = settings_model().model_validate(user)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_problem(e) for e in exc.errors()))
        if len(problems) == 1:
            raise ConfigError(problems[0]) from None
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problems in the logger config:\n{listed}") from None
    return settings


def plain(model: BaseModel) -> dict[str, Any]:
    """A validated model as a plain nested dict, for where data goes (printing, files, JSON);
    a :class:`LoggerSettings` with its launch set includes ``attempt`` and ``launch``.

    Values are kept as validated, not serialized: a tracker's ``settings`` object in a
    passthrough section reaches its SDK as the same object.
    """
    out: dict[str, Any] = {}
    names = list(model) if isinstance(model, Section) else type(model).model_fields
    for name in names:
        value = model[name] if isinstance(model, Section) else getattr(model, name)
        out[name] = plain(value) if isinstance(value, BaseModel) else value
    return out


def defaults() -> dict[str, Any]:
    """Every key with its default value."""
    return plain(settings_model()())


_EXPECTED_BY_TYPE = {
    "bool_type": "bool (true or false)",
    "bool_parsing": "bool (true or false)",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_STRING_BOOLEANS = {"true", "false", "yes", "no", "on", "off", "y", "n", "0", "1"}


def _problem(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        if len(loc) == 1:
            hint = _third_party_flag_hint(str(loc[0]))
            if hint:
                return hint
        return unknown_key_message(loc[-1], _fields_at(loc[:-1]), _path_of(loc))
    if kind == "invalid_key":
        where = f"under '{_path_of(loc[:-1])}'" if loc[:-1] else "at the top level"
        return f"logger config key {_shown(loc[-1])} {where} is not a string"
    if kind == "expected":
        expected = str(ctx["expected"])
    elif kind == "literal_error":
        expected = f"one of {ctx['expected']}"
    elif kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        number = "an integer" if _annotation_at(loc) is int else "a number"
        expected = f"{number} {_BOUNDS[kind]} {bound}"
    else:
        expected = _EXPECTED_BY_TYPE.get(kind) or str(error.get("msg", kind)).lower()
    return f"logger config '{_path_of(loc)}' must be {expected}, got {_shown(value, kind)}"


def _shown(value: Any, kind: str = "") -> str:
    """The value given, with a hint when it is a quoted bool or number (a YAML slip). A URL's
    ``user:password@`` is shown as ``***@``: an error message is no place for a password."""
    if isinstance(value, str) and "@" in value and "://" in value:
        from otel_rl.ray.discovery import without_userinfo

        value = without_userinfo(value)
    try:
        text = shorten(repr(value), 200)
    except Exception:  # a value whose __repr__ raises is still named by its type
        text = "<unprintable>"
    if isinstance(value, str) and kind.startswith("bool"):
        word = {
            "true": "true",
            "yes": "true",
            "on": "true",
            "y": "true",
            "1": "true",
            "false": "false",
            "no": "false",
            "off": "false",
            "n": "false",
            "0": "false",
        }
        literal = word.get(value.strip().lower())
        if literal:
            return f"{text} (a string, not a bool; write {literal} without quotes)"
    if isinstance(value, str) and kind.startswith(("int", "float")):
        try:
            float(value)
        except ValueError:
            return f"{text} (a string; write a number, without quotes or units)"
        return f"{text} (a string; write {value.strip()} without quotes)"
    return f"{text} ({type(value).__name__})"


def _annotation_at(loc: tuple[Any, ...]) -> Any:
    model: Any = settings_model()
    annotation = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        annotation = model = fields[part].annotation
    return annotation


def _path_of(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys valid where ``loc`` points (for did-you-mean)."""
    model: Any = settings_model()
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return list(model.model_fields)


def _third_party_flag_hint(key: str) -> str | None:
    """Why ``<name>_enabled`` (or ``<name>:``) of an installed third-party tracker is no key: the
    config's keys are the same wherever it runs, whatever else is installed there."""
    from otel_rl.delivery.registry import available_exporters

    name = key.removesuffix("_enabled")
    if name not in available_exporters():
        return None
    return (
        f"unknown logger config key '{key}': '{name}' is a tracker of another package, enabled "
        f"by its entry under 'trackers:' with its options, e.g. trackers: {{{name}: {{}}}} "
        "(only otel-rl's own trackers have <name>_enabled flags)"
    )


def unknown_key_message(key: object, known: list[str], where: str) -> str:
    """``unknown logger config key 'a.b'; did you mean 'c'?`` (or the valid keys)."""
    near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if near:
        hint = f"; did you mean '{near[0]}'?"
    elif known:
        hint = f"; valid keys: {', '.join(sorted(known))}"
    else:
        hint = ""
    return f"unknown logger config key '{where}'{hint}"


# ---- the docs table ------------------------------------------------------------------------

TABLE_HEADER = "| key | type | default | meaning |\n| --- | --- | --- | --- |"


def markdown_table() -> str:
    """The key table of docs/configuration.md, one row per key, in declaration order."""
    rows = [TABLE_HEADER]
    for key, field in _table_order(_leaf_fields(settings_model(), "")):
        extra = field.json_schema_extra or {}
        shown_type = extra.get("shown_type") or _type_name(field.annotation)
        if "shown_default" in extra:
            shown_default = extra["shown_default"]
        else:
            default = field.default_factory() if field.default_factory else field.default
            shown_default = _default_text(default)
        meaning = (field.description or "").replace("|", "\\|")
        shown_type = shown_type.replace("|", "\\|")
        rows.append(f"| `{key}` | {shown_type} | {shown_default} | {meaning} |")
    return "\n".join(rows)


def _table_order(fields: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The trackers' keys right after ``log_dir``, as users read them: outputs first."""
    base = LoggerSettings.model_fields
    own = [(key, field) for key, field in fields if key.split(".")[0] in base]
    added = [(key, field) for key, field in fields if key.split(".")[0] not in base]
    return own[:1] + added + own[1:]


def _leaf_fields(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(_leaf_fields(annotation, f"{prefix}{name}."))
        else:
            out.append((f"{prefix}{name}", field))
    return out


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return {bool: "bool", int: "int", float: "number", str: "str"}.get(annotation, "any")


def _default_text(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, float) and default.is_integer():
        return f"`{int(default)}`"
    if isinstance(default, (list, dict)) and not default:
        return "`[]`" if isinstance(default, list) else "`{}`"
    return f"`{default}`"
