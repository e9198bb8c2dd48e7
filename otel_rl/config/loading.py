"""Logger configuration: NeMo RL's logger keys plus otel-rl's own, validated up front.

A config is a plain mapping (or a YAML file). ``resolve_config`` merges it over the defaults and
checks every key against the one declaration in :mod:`otel_rl.config.schema` (types, bounds,
choices; unknown keys get the nearest valid one), then the settings of each enabled tracker
(:mod:`otel_rl.config.tracker_settings`), so a mistake fails when the Logger is built instead of
silently switching a feature on or failing later on a tracker's thread. ``resolve_settings``
returns the typed config that otel-rl reads (``cfg.export.delivery``); ``resolve_config`` its
plain dict, for the edges that take data (printing, files, ``from_config`` of a mapping).

The schema needs pydantic, so it is imported on the first ``resolve_config`` (or ``DEFAULTS``)
and ``import otel_rl`` stays light.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_rl.core.errors import ConfigError

if TYPE_CHECKING:
    from otel_rl.config.schema import LoggerSettings


def load_config(source: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """Return the user's raw config from a mapping, a YAML file path, or ``None``.

    A YAML file may hold the logger config at its top level or under a ``logger:`` key (as in
    NeMo RL's experiment files). Numbers with an exponent and no dot (``5e-1``, ``1e3``) are
    numbers, as in YAML 1.2 (PyYAML's YAML 1.1 would read them as strings); a quoted value is a
    string. A file that cannot be read or parsed is a :class:`ConfigError` naming the file and,
    for a syntax error, the line and column.
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            "the logger config must be a mapping or the path of a YAML file, got "
            f"{type(source).__name__}"
        )
    path = Path(source)
    data = _parse_yaml(path, _read(path))
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    if "logger" in data and isinstance(data["logger"], Mapping):
        data = data["logger"]
    return dict(data)


def _read(path: Path) -> bytes:
    if path.is_dir():
        raise ConfigError(f"logger config file {path} is a directory; give the path of a YAML file")
    if not path.exists():
        raise ConfigError(f"logger config file not found: {path}")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise ConfigError(f"logger config file {path} is not a regular file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read logger config file {path}: {exc.strerror or exc}") from None


def _parse_yaml(path: Path, data: bytes) -> Any:
    import yaml

    # Bytes, not text: PyYAML then reads UTF-8 (or UTF-16 with a BOM) as YAML requires, whatever
    # the locale's encoding.
    try:
        return yaml.load(data, Loader=_config_loader())  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_syntax_error(path, exc)) from None
    except yaml.reader.ReaderError as exc:
        if exc.encoding == "unicode":
            what = f"character #x{exc.character:04x} is not allowed in YAML"
        else:
            what = f"not {exc.encoding.upper()} text ({exc.reason}); save the file as UTF-8"
        raise ConfigError(f"logger config file {path}, byte {exc.position}: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"logger config file {path}: {' '.join(str(exc).split())}") from None


def _syntax_error(path: Path, exc: Any) -> str:
    """``logger config file <path>, line L, column C: <problem>`` (1-based, as editors count)."""
    mark = exc.problem_mark or exc.context_mark
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = exc.problem or exc.context or "invalid YAML"
    if "'\\t'" in problem:  # PyYAML's words for it do not say what to do
        return f"logger config file {path}{where}: a tab; YAML indents with spaces only"
    if exc.context and exc.problem:
        context = exc.context
        if exc.context_mark is not None and exc.context_mark is not mark:
            line, column = exc.context_mark.line + 1, exc.context_mark.column + 1
            context += f" that starts at line {line}, column {column}"
        problem += f" ({context})"
    return f"logger config file {path}{where}: {problem}"


# YAML 1.2 reads 5e-1, 1e3, 1.5e3 and .5e1 as numbers, and so does OmegaConf, which reads NeMo
# RL's experiment files; YAML 1.1 (PyYAML) wants a dot and a signed exponent, and makes them
# strings, which a number key then refuses. Added to PyYAML's own float resolvers (the ones with
# a dot stay as they are), for plain scalars only: a quoted "5e-1" is still a string.
_EXPONENT_FLOAT = r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"


@functools.cache
def _config_loader() -> Any:
    """PyYAML's safe loader, with YAML 1.2's numbers that have an exponent."""
    import yaml

    # type() rather than a class statement: yaml has no type information, and mypy refuses a
    # class whose base is Any. add_implicit_resolver copies the resolvers into the subclass
    # first, so SafeLoader itself is unchanged.
    loader: Any = type("ConfigLoader", (yaml.SafeLoader,), {})
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(_EXPONENT_FLOAT), list("-+0123456789.")
    )
    loader.add_constructor("tag:yaml.org,2002:map", _mapping_without_repeats)
    return loader


def _mapping_without_repeats(loader: Any, node: Any) -> dict[Any, Any]:
    """A mapping in which a key given twice is an error (YAML says keys are unique; PyYAML
    would keep the last one and drop the first without a word: two ``stalls:`` sections lose
    one)."""
    import yaml

    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults`: its keys may be overridden, as YAML allows
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in seen:
                first = seen[key].start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (first at line "
                    f"{first.line + 1}); the second would silently replace the first",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node
        except TypeError:
            continue  # an unhashable key: the mapping's own constructor says so
    return loader.construct_mapping(node, deep=True)  # type: ignore[no-any-return]


def resolve_settings(source: Mapping[str, Any] | str | os.PathLike[str] | None) -> LoggerSettings:
    """Merge ``source`` over the defaults and validate it; returns the typed config
    (:class:`~otel_rl.config.schema.LoggerSettings`, read by its fields: ``cfg.export.delivery``;
    it reads as a mapping as well).

    Raises :class:`ConfigError` naming each wrong key, its value and what it takes.
    """
    from otel_rl.config.schema import validate_settings
    from otel_rl.config.tracker_settings import check_tracker_settings

    given = load_config(source)
    cfg = validate_settings(given)
    _check(cfg, given)
    check_tracker_settings(cfg)
    return cfg


def resolve_config(source: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """:func:`resolve_settings` as a new plain nested dict (to print, store or send as data).

    Raises :class:`ConfigError` naming each wrong key, its value and what it takes.
    """
    from otel_rl.config.schema import plain

    return plain(resolve_settings(source))


def __getattr__(name: str) -> Any:
    # DEFAULTS comes from the schema, which imports pydantic: built on first use only.
    if name == "DEFAULTS":
        from otel_rl.config.schema import defaults

        value = defaults()
        globals()["DEFAULTS"] = value
        return value
    raise AttributeError(f"module 'otel_rl.config.loading' has no attribute {name!r}")


#: Every key with its default (a plain nested dict, from :mod:`otel_rl.config.schema`).
DEFAULTS: dict[str, Any]


def _check(cfg: LoggerSettings, given: Mapping[str, Any]) -> None:
    """What involves several keys or another module's rules (the schema checked each key)."""
    export = cfg.export
    if export.on_full == "spool" and not export.spool:
        said = given.get("export")
        if isinstance(said, Mapping) and "on_full" in said:
            raise ConfigError(
                "logger config 'export.on_full: spool' needs 'export.spool: true'; "
                "choose 'block' or 'drop_oldest' without a spool"
            )
        export.on_full = "drop_oldest"  # the default's meaning without a spool
    _check_gpu_sources(cfg)
    from otel_rl.distributed.reductions import check_reductions

    check_reductions(cfg.reductions)
    from otel_rl.telemetry.otlp import check_otlp_config

    check_otlp_config(cfg.otlp)


def _check_gpu_sources(cfg: LoggerSettings) -> None:
    import importlib.util

    from otel_rl.ray.discovery import endpoint_targets

    endpoints = cfg.gpu_monitoring.endpoints
    try:
        endpoint_targets(endpoints)
    except ValueError as exc:
        raise ConfigError(f"logger config 'gpu_monitoring.endpoints': {exc}") from exc
    if cfg.monitor_gpus and not endpoints and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "monitor_gpus needs Ray to find the nodes (pip install 'otel-rl[ray]') or a "
            "list of metrics endpoints in gpu_monitoring.endpoints"
        )
