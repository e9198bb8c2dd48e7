"""One typed config object: otel-rl reads the resolved config's fields (``cfg.export.delivery``);
the same object reads as a mapping for code and trackers written for a dict, and its plain dict
is what goes where data goes (printing, files, the delivery process)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Mapping

import pytest

from otel_rl import Logger
from otel_rl.config.env import config_from_env
from otel_rl.config.loading import resolve_config, resolve_settings
from otel_rl.config.schema import LoggerSettings, plain
from otel_rl.telemetry.pipeline import Pipeline, build_resource


def test_resolve_settings_is_typed_and_resolve_config_is_its_plain_dict():
    user = {
        "export": {"delivery": "process", "spool": False},
        "console_enabled": True,
        "console": {"every": 3},
        "wandb": {"project": "p"},
        "stalls": {"after": 30},
    }
    cfg = resolve_settings(user)
    assert isinstance(cfg, LoggerSettings)
    assert cfg.export.delivery == "process"
    # The cross-key rule: without a spool, on_full's default means drop_oldest.
    assert cfg.export.on_full == "drop_oldest"
    assert cfg.stalls.after == 30 and cfg.tracker_enabled("console")
    assert cfg.tracker_section("console").every == 3 and cfg.tracker_section("wandb") == {
        "project": "p"
    }
    assert resolve_config(user) == plain(cfg)
    assert resolve_config(user)["export"] == {**plain(cfg.export), "on_full": "drop_oldest"}
    json.dumps(resolve_config(user))  # plain data all the way down


def test_the_typed_config_reads_as_a_read_only_mapping():
    cfg = resolve_settings({"tensorboard": {"log_dir": "tb"}, "trackers": {"mine": {"a": 1}}})
    assert isinstance(cfg, Mapping) and isinstance(cfg.export, Mapping)
    assert cfg["export"]["delivery"] == cfg.export.delivery == "thread"
    assert cfg["tensorboard"]["log_dir"] == "tb" and cfg.get("tensorboard").get("log_dir") == "tb"
    assert cfg.get("no_such_key", "fallback") == "fallback"
    with pytest.raises(KeyError):
        cfg["no_such_key"]
    assert list(cfg)[:2] == ["log_dir", "trackers"] and "jsonl_enabled" in cfg
    assert dict(cfg.export) == plain(cfg.export)
    with pytest.raises(TypeError):
        cfg["log_dir"] = "elsewhere"  # type: ignore[index]


def test_the_launch_is_read_with_the_config_once_set():
    cfg = resolve_settings({})
    assert cfg.attempt == 1 and cfg.launch is None and "attempt" not in cfg
    cfg.set_launch(3, "launch-3")
    assert (cfg.attempt, cfg["attempt"], cfg.get("launch")) == (3, 3, "launch-3")
    assert plain(cfg)["attempt"] == 3 and plain(cfg)["launch"] == "launch-3"


def test_the_config_sent_to_the_delivery_process_unpickles_there():
    """The training process sends ``dict(cfg)`` (nested sections included) to a fresh
    interpreter, which has not built the trackers' section classes yet."""
    cfg = resolve_settings({"tensorboard": {"log_dir": "tb"}, "console": {"every": 4}})
    cfg.set_launch(2, "l2")
    code = (
        "import pickle, sys\n"
        "cfg = pickle.loads(sys.stdin.buffer.read())\n"
        "print(cfg['tensorboard'].log_dir, cfg['console']['every'], cfg['attempt'],"
        " cfg['export'].delivery)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(dict(cfg)),
                         capture_output=True, check=True)  # fmt: skip
    assert out.stdout.decode().split() == ["tb", "4", "2", "thread"]
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.attempt == 2


def test_the_logger_holds_the_typed_config_with_its_run(tmp_path):
    with Logger({"log_dir": str(tmp_path), "run_id": "typed-1"}) as logger:
        cfg = logger.config
        assert isinstance(cfg, LoggerSettings)
        assert (cfg.run_id, cfg.attempt, cfg["attempt"]) == ("typed-1", 1, 1)
        assert cfg.launch == logger.history.launch
        logger.log_metrics({"loss": 0.5}, step=1)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["run_id"], r["attempt"], r["metrics"]) for r in rows] == [
        (1, "typed-1", 1, {"loss": 0.5})
    ]


def test_the_pipeline_refuses_a_plain_dict_with_a_clear_error():
    with pytest.raises(TypeError, match=r"expected the typed logger config .*got dict"):
        Pipeline(resolve_config({}), build_resource(resolve_settings({}), "r"))
    with pytest.raises(TypeError, match=r"expected the typed logger config .*got dict"):
        build_resource(resolve_config({}), "r")
    resource = build_resource(resolve_settings({"role": "worker", "rank": 2}), "r")
    assert resource.attributes["otel_rl.role"] == "worker"
    assert resource.attributes["otel_rl.rank"] == 2


def test_config_from_env_is_typed(tmp_path):
    file = tmp_path / "otel-rl.yaml"
    file.write_text("export:\n  on_full: block\n")
    cfg = config_from_env({"OTEL_RL_CONFIG": str(file), "OTEL_RL_LOG_DIR": str(tmp_path)})
    assert isinstance(cfg, LoggerSettings)
    assert (cfg.export.on_full, cfg.log_dir) == ("block", str(tmp_path))
