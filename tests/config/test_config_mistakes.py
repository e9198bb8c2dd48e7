"""Config mistakes answered by their cause: non-finite numbers, YAML 1.1's string-looking
numbers, YAML syntax errors, a directory as the config file, and a Prometheus port in use."""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Union

import pytest
from pydantic import BaseModel

from otel_rl import ConfigError, Logger
from otel_rl.config.env import config_from_env
from otel_rl.config.loading import resolve_config
from otel_rl.config.schema import settings_model
from otel_rl.telemetry.otlp import resolve_otlp
from testkit.otlp_receiver import closed_port

# ---- 10: inf and nan -----------------------------------------------------------------------------


def _base_type(annotation: Any) -> Any:
    """``float`` for ``Annotated[float, ...] | None`` and the like."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _base_type(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        kinds = {_base_type(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return annotation


def _numeric_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[Any]:
    """(key path, int or float) for every number the schema declares, sections included."""
    for name, field in model.model_fields.items():
        kind = _base_type(field.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _numeric_keys(kind, (*prefix, name))
        elif kind in (int, float):
            yield (*prefix, name), kind


NUMERIC_KEYS = list(_numeric_keys(settings_model()))
NON_FINITE = {"inf": (math.inf, ".inf"), "-inf": (-math.inf, "-.inf"), "nan": (math.nan, ".nan")}
CASES = [
    pytest.param(path, kind, name, id=f"{'.'.join(path)}={name}")
    for path, kind in NUMERIC_KEYS
    for name in NON_FINITE
]


def test_the_enumeration_sees_the_numbers_of_every_section():
    keys = {".".join(path) for path, _ in NUMERIC_KEYS}
    assert {
        "export.shutdown_timeout",
        "export.fsync_interval",
        "otlp.interval",
        "otlp.timeout",
        "prometheus.port",
        "gpu_monitoring.timeout",
        "rollout_monitoring.collection_interval",
        "console.every",
        "rank",
    } <= keys


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    cfg: Any = value
    for part in reversed(path):
        cfg = {part: cfg}
    return dict(cfg)


def _yaml(path: tuple[str, ...], text: str) -> str:
    lines = [f"{'  ' * depth}{part}:" for depth, part in enumerate(path[:-1])]
    lines.append(f"{'  ' * (len(path) - 1)}{path[-1]}: {text}")
    return "\n".join(lines) + "\n"


def _assert_names_key(exc: ConfigError, path: tuple[str, ...], kind: type) -> None:
    message = str(exc)
    assert f"'{'.'.join(path)}'" in message, message
    assert ("a finite number" if kind is float else "an integer") in message, message


@pytest.mark.parametrize(("path", "kind", "name"), CASES)
def test_non_finite_number_from_a_dict_is_a_config_error_naming_the_key(path, kind, name):
    with pytest.raises(ConfigError) as info:
        resolve_config(_nested(path, NON_FINITE[name][0]))
    _assert_names_key(info.value, path, kind)


@pytest.mark.parametrize(("path", "kind", "name"), CASES)
def test_non_finite_number_from_yaml_is_a_config_error_naming_the_key(tmp_path, path, kind, name):
    file = tmp_path / "logger.yaml"
    file.write_text(_yaml(path, NON_FINITE[name][1]))
    with pytest.raises(ConfigError) as info:
        resolve_config(file)
    _assert_names_key(info.value, path, kind)


def test_a_number_too_large_for_a_float_is_refused_too(tmp_path):
    file = tmp_path / "logger.yaml"
    file.write_text("export:\n  shutdown_timeout: 1e999\n")  # YAML reads it as inf
    with pytest.raises(ConfigError, match=r"'export\.shutdown_timeout' must be a finite number"):
        resolve_config(file)


def test_non_finite_number_through_otel_rl_config_env(tmp_path):
    file = tmp_path / "logger.yaml"
    file.write_text("otlp:\n  interval: .inf\n")
    with pytest.raises(ConfigError, match=r"'otlp\.interval' must be a finite number"):
        config_from_env({"OTEL_RL_CONFIG": str(file)})


@pytest.mark.parametrize(
    "variable",
    [
        "OTEL_METRIC_EXPORT_INTERVAL",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    ],
)
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "Infinity", "1e999"])
def test_non_finite_otlp_environment_variable_is_a_config_error_naming_it(variable, text):
    with pytest.raises(ConfigError) as info:
        resolve_otlp({}, environ={variable: text})
    message = str(info.value)
    assert variable.replace("_METRICS", "") in message.replace("[METRICS_]", ""), message
    assert "finite" in message and repr(text) in message, message


def test_finite_values_still_pass():
    cfg = resolve_config({"export": {"shutdown_timeout": 0, "fsync_interval": 0.25}})
    assert cfg["export"]["shutdown_timeout"] == 0 and cfg["export"]["fsync_interval"] == 0.25
    assert resolve_otlp({}, environ={"OTEL_METRIC_EXPORT_INTERVAL": "2500"}).interval_s == 2.5


# ---- 11: YAML numbers, syntax errors, a directory ----------------------------------------------


def _load(tmp_path: Path, text: str) -> dict[str, Any]:
    file = tmp_path / "logger.yaml"
    file.write_text(text)
    return resolve_config(file)


@pytest.mark.parametrize(
    ("text", "value"),
    [("5e-1", 0.5), ("1e3", 1000.0), ("1E+2", 100.0), ("2.5e1", 25.0), (".5", 0.5),
     ("+3e0", 3.0), (".5e1", 5.0), ("1.e1", 10.0), ("7", 7.0)],
)  # fmt: skip
def test_an_unquoted_number_with_an_exponent_is_a_number(tmp_path, text, value):
    cfg = _load(tmp_path, f"export:\n  shutdown_timeout: {text}\n")
    assert cfg["export"]["shutdown_timeout"] == value
    assert type(cfg["export"]["shutdown_timeout"]) is type(value)


@pytest.mark.parametrize("quoted", ['"5e-1"', "'5e-1'", "'0.5'", '"1e3"'])
def test_a_quoted_number_is_still_a_string(tmp_path, quoted):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, f"export:\n  shutdown_timeout: {quoted}\n")
    bare = quoted.strip("'\"")
    assert str(info.value) == (
        f"logger config 'export.shutdown_timeout' must be a number, got '{bare}' "
        f"(a string; write {bare} without quotes)"
    )


def test_strings_that_are_not_numbers_stay_strings(tmp_path):
    cfg = _load(tmp_path, "run_id: e5\nexperiment: 1e3x\nrole: 1e3.5\n")
    assert (cfg["run_id"], cfg["experiment"], cfg["role"]) == ("e5", "1e3x", "1e3.5")


def test_a_tab_in_the_indentation_is_a_config_error_with_line_and_column(tmp_path):
    file = tmp_path / "logger.yaml"
    file.write_text("log_dir: logs\nexport:\n\tshutdown_timeout: 5\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(file)
    message = str(info.value)
    assert str(file) in message and "line 3, column 1" in message, message
    assert "tab" in message.lower() and "spaces" in message, message
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("log_dir: logs\nprometheus: {enabled: true, port: 9464\n", "line 3, column 1"),
        ("log_dir: logs\n  jsonl_enabled: true\n", "line 2, column 16"),
        ("log_dir: [logs\nrank: 1\n", "line 2, column 5"),
    ],
)
def test_any_yaml_syntax_error_is_a_config_error_with_file_line_and_column(tmp_path, text, where):
    file = tmp_path / "logger.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve_config(file)
    message = str(info.value)
    assert message.startswith(f"logger config file {file}, {where}: "), message


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    file = tmp_path / "logger.yaml"
    file.write_bytes(b"log_dir: caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(file)
    assert str(file) in str(info.value) and "utf-8" in str(info.value).lower()


def test_a_directory_as_the_config_file_says_it_is_a_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(tmp_path)
    assert str(info.value) == (
        f"logger config file {tmp_path} is a directory; give the path of a YAML file"
    )
    with pytest.raises(ConfigError, match="logger config file not found: "):
        resolve_config(tmp_path / "missing.yaml")


# ---- 12: the Prometheus port already in use ---------------------------------------------------


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process would hold: a real socket bound and listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_prometheus_port_in_use_is_one_clear_error(tmp_path, busy_port):
    before = _threads()
    with pytest.raises(ConfigError) as info:
        Logger(
            {
                "log_dir": str(tmp_path),
                "jsonl_enabled": False,
                "capture_global_meters": False,
                "prometheus": {"enabled": True, "port": busy_port},
                "otlp": {"enabled": True, "endpoint": f"http://127.0.0.1:{closed_port()}"},
            }
        )
    message = str(info.value)
    assert message == (
        f"logger config 'prometheus.port': port {busy_port} on 127.0.0.1 is already in use "
        "(by another process, or by another Logger in this process); choose another port, "
        "or 0 to pick a free one (Logger.prometheus_url then says which)"
    )
    assert _threads() - before == set()


def test_a_prometheus_host_that_is_not_this_machine_names_the_host_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        Logger(
            {
                "log_dir": str(tmp_path),
                "jsonl_enabled": False,
                "capture_global_meters": False,
                # TEST-NET-1 (RFC 5737): no machine has this address
                "prometheus": {"enabled": True, "host": "192.0.2.1", "port": 0},
            }
        )
    assert str(info.value).startswith(
        "logger config 'prometheus.host': 192.0.2.1 is not an address of this machine"
    ), str(info.value)


def test_a_pipeline_that_fails_leaves_no_server_or_thread_running(tmp_path, monkeypatch):
    port = closed_port()
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "soon")  # checked when the run starts
    before = _threads()
    with pytest.raises(ConfigError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        Logger(
            {
                "log_dir": str(tmp_path),
                "jsonl_enabled": False,
                "capture_global_meters": False,
                "prometheus": {"enabled": True, "port": port},
                "otlp": {"enabled": True, "endpoint": f"http://127.0.0.1:{closed_port()}"},
            }
        )
    assert _threads() - before == set()
    assert _port_is_free(port)


def test_a_failed_logger_leaves_no_tracker_running(tmp_path, busy_port):
    before = _threads()
    with pytest.raises(ConfigError, match="already in use"):
        Logger({"log_dir": str(tmp_path), "prometheus": {"enabled": True, "port": busy_port}})
    assert _threads() - before == set()


def _is_duration(path: tuple[str, ...]) -> bool:
    last = path[-1]
    return any(word in last for word in ("interval", "timeout", "after")) or last == "timeout"


DURATIONS = [path for path, kind in NUMERIC_KEYS if kind is float and _is_duration(path)]


def test_the_durations_are_found():
    names = {".".join(p) for p in DURATIONS}
    assert {"export.fsync_interval", "export.shutdown_timeout", "otlp.interval",
            "stalls.after", "gpu_monitoring.collection_interval"} <= names  # fmt: skip


@pytest.mark.parametrize("path", DURATIONS, ids=lambda p: ".".join(p))
def test_a_duration_beyond_what_a_wait_can_hold_is_refused(path):
    """``1e10`` s (a "forever" written as a number) overflows Python's waits: refused at
    Logger() with the key named, instead of killing the spool thread or hanging finish()."""
    with pytest.raises(ConfigError) as refused:
        resolve_config(_nested(path, 1e10))
    assert ".".join(path) in str(refused.value) and "<= 10000000" in str(refused.value)
    resolve_config(_nested(path, 1e6))  # long but finite: fine


def test_an_otlp_environment_duration_beyond_a_wait_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1e13")  # milliseconds
    with pytest.raises(ConfigError, match="at most"):
        resolve_otlp({"enabled": True, "endpoint": None, "protocol": None, "interval": None,
                      "timeout": None, "headers": {}, "insecure": None, "histogram": None,
                      "semantic_conventions": False})  # fmt: skip


def test_a_key_given_twice_is_a_config_error_not_a_silent_loss(tmp_path):
    config = tmp_path / "logger.yaml"
    config.write_text("stalls:\n  after: 5\nlog_dir: x\nstalls:\n  factor: 3\n")
    with pytest.raises(ConfigError) as refused:
        resolve_config(str(config))
    assert "line 4, column 1" in str(refused.value)
    assert "the key 'stalls' is given twice (first at line 1)" in str(refused.value)
    # a YAML merge (<<) overridden by the mapping's own key is not a repeat
    config.write_text("defaults: &d {after: 5}\nstalls:\n  <<: *d\n  after: 7\n")
    assert load_config_file(config)["stalls"] == {"after": 7}


def load_config_file(path: Path) -> dict[str, Any]:
    from otel_rl.config.loading import load_config

    loaded: dict[str, Any] = load_config(str(path))
    return loaded


def test_spool_off_alone_means_drop_oldest_and_an_explicit_on_full_spool_is_refused():
    """``export.spool: false`` by itself works (the default ``on_full: spool`` means
    ``drop_oldest`` without a spool, docs/reliability.md); ``on_full: spool`` written beside it
    asks for what cannot be, and says so."""
    assert resolve_config({"export": {"spool": False}})["export"]["on_full"] == "drop_oldest"
    assert resolve_config({"export": {"spool": True}})["export"]["on_full"] == "spool"
    with pytest.raises(ConfigError, match=r"'export.on_full: spool' needs 'export.spool: true'"):
        resolve_config({"export": {"spool": False, "on_full": "spool"}})


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_a_log_dir_that_cannot_hold_the_spool_is_a_config_error(tmp_path, caplog, delivery):
    """A file where the log dir should be (or a read-only one): ``Logger()`` says which key and
    what to do, and leaves nothing running, instead of a bare ``OSError`` from a spool thread;
    the same words when the delivery process found it."""
    (tmp_path / "afile").write_text("")
    before = {t.name for t in threading.enumerate()}
    pipes = _pipes()
    with pytest.raises(ConfigError) as error:
        Logger({"log_dir": str(tmp_path / "afile" / "logs"), "export": {"delivery": delivery}})
    assert str(error.value).startswith(
        f"logger config 'log_dir': {str(tmp_path / 'afile' / 'logs')!r} cannot hold jsonl's spool "
        "([Errno 20] Not a directory"
    )
    assert str(error.value).endswith("give a writable folder, or set export.spool: false")
    assert {t.name for t in threading.enumerate()} - before == set()
    assert _pipes() == pipes  # the pipes to a delivery process that never started are closed
    time.sleep(0.3)  # the delivery process's end is heard by a thread of the link
    assert "delivery process exited" not in caplog.text  # no run had started: no such news


def _pipes() -> set[str]:
    """This process's open pipe descriptors, as ``<fd> -> pipe:[<inode>]``."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("pipe:"):
            found.add(f"{fd} -> {target}")
    return found
