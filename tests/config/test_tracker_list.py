"""One tracker list: otel-rl's entry points, with what the config needs declared on each
exporter class. The schema's flags and sections, the docs table, the enabled order and the
drop-ins' backend names all come from it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from otel_rl import ConfigError
from otel_rl.cli.demo import demo_config
from otel_rl.compat.verl_config import core_trackers
from otel_rl.config.loading import resolve_config
from otel_rl.config.schema import markdown_table, settings_model, validate_settings
from otel_rl.delivery import registry
from otel_rl.delivery.registry import builtin_tracker_classes, builtin_trackers, enabled_backends
from otel_rl.exporters.base import TrackerExporter

#: The order trackers are enabled in (and listed in the docs), kept from before the list was one.
ENABLED_ORDER = ["tensorboard", "jsonl", "console", "wandb", "mlflow", "swanlab", "trackio",
                 "clearml"]  # fmt: skip


def own_entry_points() -> dict[str, str]:
    dist = importlib.metadata.distribution("otel-rl")
    return {ep.name: ep.value for ep in dist.entry_points if ep.group == "otel_rl.exporters"}


def test_the_builtin_trackers_are_the_entry_points_in_the_enabled_order():
    assert sorted(own_entry_points()) == sorted(ENABLED_ORDER)
    assert builtin_trackers() == ENABLED_ORDER
    for name, cls in builtin_tracker_classes().items():
        module, _, attr = own_entry_points()[name].partition(":")
        assert (cls.__module__, cls.__name__) == (module, attr)


def test_every_builtin_tracker_declares_what_the_config_needs():
    declared = {name: cls.config for name, cls in builtin_tracker_classes().items()}
    orders = [config.order for config in declared.values() if config is not None]
    assert len(set(orders)) == len(orders) == len(declared)
    for name, cls in builtin_tracker_classes().items():
        config = cls.config
        assert issubclass(cls, TrackerExporter) and cls.name == name
        assert config is not None and config.flag, name
        # A section is either typed keys or a mapping handed over, never both.
        assert bool(config.keys) != bool(config.mapping), name
        if config.mapping:  # a mapping's names are checked against a declared list
            assert (config.sdk_init is None) != (config.accepted is None), name


def test_the_schema_has_exactly_the_flags_and_sections_the_classes_declare():
    fields = settings_model().model_fields
    flags = [key.removesuffix("_enabled") for key in fields if key.endswith("_enabled")]
    assert flags == ENABLED_ORDER
    for name, cls in builtin_tracker_classes().items():
        config = cls.config
        flag = fields[f"{name}_enabled"]
        assert (flag.default, flag.description) == (config.enabled, config.flag)
        section = fields[name]
        if config.keys:
            model = section.annotation
            assert list(model.model_fields) == list(config.keys)
            for key, declared in config.keys.items():
                field = model.model_fields[key]
                assert (field.default, field.description) == (declared.default, declared.meaning)
        else:
            assert section.default_factory() == {}
            assert section.description == config.mapping
    defaults = resolve_config({})
    assert [n for n in ENABLED_ORDER if defaults[f"{n}_enabled"]] == ["jsonl"]


def test_the_docs_table_lists_the_trackers_from_their_declarations():
    rows = markdown_table().splitlines()[2:]
    keys = [row.split("|")[1].strip().strip("`") for row in rows]
    tracker_rows = keys[1 : keys.index("trackers")]  # right after log_dir
    expected = []
    for name, cls in builtin_tracker_classes().items():
        expected.append(f"{name}_enabled")
        expected.extend([f"{name}.{key}" for key in cls.config.keys] or [name])
    assert tracker_rows == expected
    console_every = rows[keys.index("console.every")]
    assert console_every == "| `console.every` | int | `1` | print every N-th step |"


def test_a_typed_key_keeps_its_checks_and_messages():
    with pytest.raises(ConfigError, match=r"'console\.every' must be an integer >= 1, got 0"):
        resolve_config({"console": {"every": 0}})
    with pytest.raises(ConfigError, match=r"'tensorboard\.log_dir' must be a path"):
        resolve_config({"tensorboard": {"log_dir": ""}})
    with pytest.raises(ConfigError, match=r"unknown logger config key 'jsonl\.pth'; did you mean"):
        resolve_config({"jsonl": {"pth": "x"}})


def test_enabled_backends_follow_the_list_order_from_a_mapping_or_the_typed_config():
    user = {f"{name}_enabled": True for name in reversed(ENABLED_ORDER)}
    user["trackers"] = {"mytracker": {}}
    user["clearml"] = {"offline": True}
    assert enabled_backends(resolve_config(user)) == [*ENABLED_ORDER, "mytracker"]
    assert enabled_backends(validate_settings(user)) == [*ENABLED_ORDER, "mytracker"]


def test_the_drop_ins_and_the_demo_take_their_tracker_names_from_the_list():
    # verl's console is served by its own console lines; jsonl is no verl backend.
    assert core_trackers() == [n for n in ENABLED_ORDER if n not in ("jsonl", "console")]
    cfg = demo_config("logs", backends=("console",))
    assert {k: v for k, v in cfg.items() if k.endswith("_enabled")} == {
        f"{name}_enabled": name == "console" for name in ENABLED_ORDER
    }
    with pytest.raises(ValueError, match="choose from tensorboard, jsonl, console, wandb"):
        demo_config("logs", backends=("nope",))


def test_missing_entry_points_are_a_clear_error(monkeypatch):
    """otel-rl imported from a folder on sys.path, never installed: its metadata (and so its
    entry points) is absent, simulated by a lookup that finds no distribution."""

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(registry, "distribution", not_installed)
    registry._own_entry_points.cache_clear()
    registry._builtin_classes.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"entry points .* pip install -e \."):
            registry.exporter_class("jsonl")
    finally:
        monkeypatch.undo()
        registry._own_entry_points.cache_clear()
        registry._builtin_classes.cache_clear()
    assert registry.exporter_class("jsonl").__name__ == "JsonlExporter"


def test_reading_the_declarations_imports_no_tracker_sdk():
    code = (
        "import sys\n"
        "from otel_rl.config.schema import markdown_table\n"
        "markdown_table()\n"
        "heavy = ('wandb', 'mlflow', 'swanlab', 'trackio', 'clearml', 'tensorboard', 'torch')\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
