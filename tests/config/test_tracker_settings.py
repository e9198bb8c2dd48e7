"""A tracker's own settings are checked when the Logger is built, with the nearest valid name,
instead of failing later on the tracker's thread (or, for SwanLab, being ignored)."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.config.loading import resolve_config
from otel_rl.config.tracker_settings import (
    _init_parameters,
    _named_parameters,
    _parameters_in_source,
    accepted_settings,
    sdk_init,
)
from otel_rl.exporters.base import SdkInit


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"wandb_enabled": True, "wandb": {"projcet": "grpo"}},
            "unknown wandb setting 'projcet'; did you mean 'project'? (logger config "
            "'wandb.projcet'; the settings are those of wandb.init)",
        ),
        (
            {"wandb_enabled": True, "wandb": {"project": "grpo", "entitiy": "team"}},
            "unknown wandb setting 'entitiy'; did you mean 'entity'? (logger config "
            "'wandb.entitiy'; the settings are those of wandb.init)",
        ),
        (
            {"mlflow_enabled": True, "mlflow": {"experiment": "grpo"}},
            "unknown mlflow setting 'experiment'; did you mean 'experiment_name'? (logger "
            "config 'mlflow.experiment'; the settings are those of the otel-rl exporter)",
        ),
        (
            {"swanlab_enabled": True, "swanlab": {"projet": "grpo"}},
            "unknown swanlab setting 'projet'; did you mean 'project'? (logger config "
            "'swanlab.projet'; the settings are those of swanlab.init)",
        ),
        (
            {"trackio_enabled": True, "trackio": {"proejct": "grpo"}},
            "unknown trackio setting 'proejct'; did you mean 'project'? (logger config "
            "'trackio.proejct'; the settings are those of trackio.init)",
        ),
        (
            {"clearml_enabled": True, "clearml": {"project": "grpo"}},
            "unknown clearml setting 'project'; did you mean 'project_name'? (logger config "
            "'clearml.project'; the settings are those of clearml.Task.init)",
        ),
    ],
)
def test_a_typo_in_a_tracker_setting_fails_at_logger(tmp_path, cfg, message):
    log_dir = tmp_path / "logs"
    with pytest.raises(ConfigError) as info:
        Logger({"log_dir": str(log_dir), **cfg})
    assert str(info.value) == message
    assert not log_dir.exists()


def test_a_setting_with_no_near_name_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        resolve_config({"mlflow_enabled": True, "mlflow": {"zzz": 1}})
    assert str(info.value) == (
        "unknown mlflow setting 'zzz' (logger config 'mlflow.zzz'; the settings are those of the "
        "otel-rl exporter); valid: artifact_location, experiment_name, run_id, run_name, tags, "
        "tracking_uri"
    )


def test_every_unknown_setting_is_listed_at_once():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            {"wandb_enabled": True, "wandb": {"projcet": "p", "nmae": "n"},
             "mlflow_enabled": True, "mlflow": {"run": "r"}}
        )
    lines = str(info.value).splitlines()
    assert [line.split(";")[0] for line in lines] == [
        "unknown wandb setting 'projcet'",
        "unknown wandb setting 'nmae'",
        "unknown mlflow setting 'run'",
    ]


def test_valid_settings_of_real_configs_pass():
    """The sections NeMo RL's and verl's configs give (otel_rl.compat.verl_config builds the
    latter), plus the resume settings ``otel-rl replay`` adds."""
    cfg = resolve_config(
        {
            "wandb_enabled": True,
            "wandb": {"project": "grpo-dev", "name": "run", "entity": "team", "tags": ["a"],
                      "id": "abc", "resume": "allow", "dir": "/tmp/w", "settings": {}},
            "mlflow_enabled": True,
            "mlflow": {"experiment_name": "e", "run_name": "r", "tracking_uri": "sqlite:///x.db",
                       "artifact_location": "/tmp/a", "tags": {"k": "v"}, "run_id": None},
            "swanlab_enabled": True,
            "swanlab": {"project": "p", "experiment_name": "e", "log_dir": "swanlog",
                        "config": {"FRAMEWORK": "verl"}, "mode": "offline"},
            "trackio_enabled": True,
            "trackio": {"project": "p", "name": "e", "resume": "allow"},
        }
    )
    assert cfg["swanlab"]["experiment_name"] == "e"


def test_disabled_trackers_are_not_checked():
    # NeMo RL configs keep a wandb section with wandb_enabled: false
    cfg = resolve_config({"wandb_enabled": False, "wandb": {"projcet": "x"}})
    assert cfg["wandb"] == {"projcet": "x"}


def test_built_in_tracker_options_under_trackers_are_refused():
    with pytest.raises(ConfigError) as info:
        resolve_config({"trackers": {"wandb": {"project": "x"}}})
    assert str(info.value) == (
        "logger config 'trackers.wandb': the built-in wandb tracker reads its settings from "
        "'wandb:', not from 'trackers:'; move them there"
    )
    assert resolve_config({"trackers": {"wandb": {}}})["trackers"] == {"wandb": {}}


@pytest.mark.parametrize("name", ["wandb", "swanlab", "trackio", "clearml"])
def test_source_reading_gives_the_sdk_signature(name):
    """What is read from the installed SDK's source without importing it equals what
    ``inspect.signature`` gives after importing it (ClearML: ``Task.init``)."""
    if not _installed(name):
        pytest.skip(f"{name} not installed")
    spec = sdk_init(name)
    from_source = _parameters_in_source(spec)
    module = __import__(name)
    owner = getattr(module, spec.init_class) if spec.init_class else module
    assert from_source == _named_parameters(inspect.signature(owner.init))
    assert "project" in from_source or "project_name" in from_source


def test_an_sdk_that_cannot_be_read_falls_back_to_the_declared_list():
    spec = SdkInit(package="otel_rl_no_such_sdk", init_files=("x.py",),
                   declared=frozenset({"project", "name"}))
    assert _parameters_in_source(spec) is None
    assert _init_parameters(spec) == {"project", "name"}


def test_declared_lists_cover_the_installed_sdks():
    """The fallback lists name every parameter of the SDK versions installed here (so a
    machine without the SDK's source refuses nothing that SDK accepts)."""
    for name in ("wandb", "swanlab", "trackio", "clearml"):
        if not _installed(name):
            continue
        spec = sdk_init(name)
        assert _parameters_in_source(spec) <= spec.declared, name


def test_swanlab_aliases_are_accepted():
    assert {"experiment_name", "notes", "logdir", "log_dir"} <= accepted_settings("swanlab")


def test_checking_does_not_import_the_sdks():
    code = (
        "import sys\n"
        "from otel_rl.config.loading import resolve_config\n"
        "resolve_config({'wandb_enabled': True, 'wandb': {'project': 'p'},"
        " 'swanlab_enabled': True, 'swanlab': {'project': 'p'},"
        " 'trackio_enabled': True, 'trackio': {'project': 'p'},"
        " 'clearml_enabled': True, 'clearml': {'project_name': 'p', 'offline': True}})\n"
        "print(sorted(m for m in ('wandb', 'swanlab', 'trackio', 'clearml') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
