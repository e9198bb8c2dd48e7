"""Config validation, YAML loading, and backend lookup errors."""

from __future__ import annotations

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.config.loading import resolve_config
from otel_rl.delivery.registry import exporter_class


def test_nemo_rl_keys_are_accepted():
    cfg = resolve_config(
        {
            "log_dir": "logs/exp_001",
            "wandb_enabled": False,
            "tensorboard_enabled": True,
            "mlflow_enabled": False,
            "swanlab_enabled": False,
            "monitor_gpus": False,
            "num_val_samples_to_print": 5,
            "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
            "wandb": {"project": "grpo-dev", "name": "run-1"},
            "tensorboard": {"log_dir": "tb_logs"},
            "mlflow": {"experiment_name": "e", "run_name": "r"},
            "swanlab": {"project": "p"},
        }
    )
    assert cfg["tensorboard_enabled"] is True and cfg["num_val_samples_to_print"] == 5
    assert cfg["wandb"] == {"project": "grpo-dev", "name": "run-1"}
    assert cfg["export"]["queue_size"] == 10_000  # defaults filled in
    assert cfg["gpu_monitoring"]["flush_interval"] == 10


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"tensorbord_enabled": True}, "unknown logger config key 'tensorbord_enabled'; did you "
                                       "mean 'tensorboard_enabled'?"),
        ({"gpu_monitoring": {"colection_interval": 5}},
         "'gpu_monitoring.colection_interval'; did you mean 'collection_interval'?"),
        ({"export": {"on_full": "explode"}}, "export.on_full' must be one of"),
        ({"wandb_enabled": "yes"}, "'wandb_enabled' must be bool"),
        ({"wandb": ["project"]}, "'wandb' must be a mapping"),
    ],
)
def test_invalid_config_is_a_clear_error(cfg, message):
    with pytest.raises(ConfigError) as info:
        resolve_config(cfg)
    assert message in str(info.value)


def test_yaml_file_top_level_or_under_logger(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("log_dir: /tmp/x\ntensorboard_enabled: true\n")
    nested = tmp_path / "exp.yaml"
    nested.write_text("policy:\n  lr: 1.0e-6\nlogger:\n  log_dir: /tmp/y\n  jsonl_enabled: false\n")
    assert resolve_config(flat)["tensorboard_enabled"] is True
    assert resolve_config(nested)["jsonl_enabled"] is False
    assert resolve_config(str(nested))["log_dir"] == "/tmp/y"
    with pytest.raises(ConfigError, match="not found"):
        resolve_config(tmp_path / "missing.yaml")


def test_logger_from_yaml(tmp_path):
    path = tmp_path / "logger.yaml"
    path.write_text(f"log_dir: {tmp_path / 'logs'}\n")
    with Logger(path) as logger:
        logger.log_metrics({"x": 1}, step=0)
    assert (tmp_path / "logs" / "metrics.jsonl").read_text().count("\n") == 1


def test_unknown_backend_name():
    with pytest.raises(ConfigError, match="no tracker exporter named 'nope'"):
        exporter_class("nope")
