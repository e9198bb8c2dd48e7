"""The config schema: users' typing mistakes refused at Logger() with the key, the value and what
the key takes; real NeMo RL configs accepted; the docs table generated from the schema."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_rl import ConfigError, Logger
from otel_rl.config.loading import resolve_config
from otel_rl.config.schema import markdown_table

ROOT = Path(__file__).resolve().parents[2]

# ---- the mistakes users make, each with the whole message it must get ------------------------

MISTAKES = [
    # YAML `enabled: "false"`: a quoted string, which used to switch Prometheus ON
    (
        {"prometheus": {"enabled": "false"}},
        "logger config 'prometheus.enabled' must be bool (true or false), got 'false' "
        "(a string, not a bool; write false without quotes)",
    ),
    (
        {"export": {"spool": "no"}},
        "logger config 'export.spool' must be bool (true or false), got 'no' "
        "(a string, not a bool; write false without quotes)",
    ),
    (
        {"export": {"handle_signals": "no"}},
        "logger config 'export.handle_signals' must be bool (true or false), got 'no' "
        "(a string, not a bool; write false without quotes)",
    ),
    # used to raise a raw TypeError ('<' between str and int)
    (
        {"console": {"every": "2"}},
        "logger config 'console.every' must be an integer, got '2' "
        "(a string; write 2 without quotes)",
    ),
    # used to fail later with a bare ValueError
    (
        {"rank": "zero"},
        "logger config 'rank' must be an integer, got 'zero' "
        "(a string; write a number, without quotes or units)",
    ),
    (
        {"export": {"shutdown_timeout": "30s"}},
        "logger config 'export.shutdown_timeout' must be a number, got '30s' "
        "(a string; write a number, without quotes or units)",
    ),
    (
        {"wandb_enabled": "yes"},
        "logger config 'wandb_enabled' must be bool (true or false), got 'yes' "
        "(a string, not a bool; write true without quotes)",
    ),
    ({"rank": True}, "logger config 'rank' must be an integer, got True (bool)"),
    (
        {"console": {"every": 0}},
        "logger config 'console.every' must be an integer >= 1, got 0 (int)",
    ),
    (
        {"export": {"queue_size": 2.5}},
        "logger config 'export.queue_size' must be an integer, got 2.5 (float)",
    ),
    (
        {"export": {"fsync_interval": 0}},
        "logger config 'export.fsync_interval' must be a number > 0, got 0 (int)",
    ),
    (
        {"prometheus": {"port": 70000}},
        "logger config 'prometheus.port' must be an integer <= 65535, got 70000 (int)",
    ),
    (
        {"export": {"on_full": "explode"}},
        "logger config 'export.on_full' must be one of 'spool', 'block' or 'drop_oldest', "
        "got 'explode' (str)",
    ),
    ({"log_dir": None}, "logger config 'log_dir' must be a path (a non-empty string), got None "
                        "(NoneType)"),
    ({"role": 3}, "logger config 'role' must be a string, got 3 (int)"),
    ({"wandb": ["project"]}, "logger config 'wandb' must be a mapping, got ['project'] (list)"),
    ({"export": 5}, "logger config 'export' must be a mapping, got 5 (int)"),
    (
        {"gpu_monitoring": {"endpoints": "http://node:8080"}},
        "logger config 'gpu_monitoring.endpoints' must be a list, got 'http://node:8080' (str)",
    ),
    (
        {"otlp": {"headers": {"x-api-key": 123}}},
        "logger config 'otlp.headers.x-api-key' must be a string, got 123 (int)",
    ),
    (
        {"redaction": {"extra_patterns": ["ok_.*", "(unclosed"]}},
        "logger config 'redaction.extra_patterns[1]' must be a valid regular expression "
        "(missing ), unterminated subpattern at position 0), got '(unclosed' (str)",
    ),
    (
        {"rollout_monitoring": {"endpoints": ["http://gen-0:8000/metrics", "gen-1"]}},
        "logger config 'rollout_monitoring.endpoints[1]' must be `host:port` or an http:// or "
        "https:// URL with a host, got 'gen-1' (str)",
    ),
    (
        {"rollout_monitoring": {"endpoints": ["ftp://gen-0:21"]}},
        "logger config 'rollout_monitoring.endpoints[0]' must be `host:port` or an http:// or "
        "https:// URL with a host, got 'ftp://gen-0:21' (str)",
    ),
    (
        {"rollout_monitoring": {"engine": "tgi"}},
        "logger config 'rollout_monitoring.engine' must be one of 'auto', 'vllm', 'vllm-v1', "
        "'vllm-v0' or 'sglang', got 'tgi' (str)",
    ),
    (
        {"tensorbord_enabled": True},
        "unknown logger config key 'tensorbord_enabled'; did you mean 'tensorboard_enabled'?",
    ),
    (
        {"gpu_monitoring": {"colection_interval": 5}},
        "unknown logger config key 'gpu_monitoring.colection_interval'; did you mean "
        "'collection_interval'?",
    ),
    ({1: True}, "logger config key 1 (int) at the top level is not a string"),
]


@pytest.mark.parametrize(("cfg", "message"), MISTAKES)
def test_each_mistake_is_one_clear_error(cfg, message):
    with pytest.raises(ConfigError) as info:
        resolve_config(cfg)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("cfg", "message"),
    [MISTAKES[0], MISTAKES[3], MISTAKES[4], MISTAKES[5]],
    ids=["prometheus-enabled-string", "console-every-string", "rank-zero", "timeout-30s"],
)
def test_logger_refuses_the_mistake_before_starting_anything(tmp_path, cfg, message):
    log_dir = tmp_path / "logs"
    with pytest.raises(ConfigError) as info:
        Logger({"log_dir": str(log_dir), **cfg})
    assert str(info.value) == message
    assert not log_dir.exists()  # nothing was created: no spool, no metrics.jsonl


def test_string_booleans_in_a_yaml_file_are_refused(tmp_path):
    path = tmp_path / "logger.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            logger:
              log_dir: logs
              prometheus:
                enabled: "false"
              export:
                spool: "no"
            """
        )
    )
    with pytest.raises(ConfigError) as info:
        Logger(path)
    assert str(info.value) == (
        "2 problems in the logger config:\n"
        "  - logger config 'prometheus.enabled' must be bool (true or false), got 'false' "
        "(a string, not a bool; write false without quotes)\n"
        "  - logger config 'export.spool' must be bool (true or false), got 'no' "
        "(a string, not a bool; write false without quotes)"
    )


def test_unquoted_yaml_booleans_and_int_seconds_are_what_keys_take(tmp_path):
    path = tmp_path / "logger.yaml"
    path.write_text(
        "prometheus:\n  enabled: false\nexport:\n  spool: no\n  on_full: block\n"
        "  shutdown_timeout: 10\nconsole:\n  every: 2\n"
    )
    cfg = resolve_config(path)
    assert cfg["prometheus"]["enabled"] is False
    assert cfg["export"]["spool"] is False  # YAML 1.1: unquoted no is a bool
    assert cfg["export"]["shutdown_timeout"] == 10.0
    assert type(cfg["export"]["shutdown_timeout"]) is float
    assert cfg["console"]["every"] == 2


def test_null_sections_keep_defaults_and_tuples_are_lists():
    cfg = resolve_config(
        {
            "tensorboard": None,
            "wandb": None,
            "trackers": {"mine": None},
            "gpu_monitoring": {"endpoints": ("127.0.0.1:8080",)},
        }
    )
    assert cfg["tensorboard"] == {"log_dir": None}
    assert cfg["wandb"] == {}
    assert cfg["trackers"] == {"mine": {}}
    assert cfg["gpu_monitoring"]["endpoints"] == ["127.0.0.1:8080"]


def test_new_sections_defaults_and_values():
    cfg = resolve_config(
        {
            "redaction": {"extra_patterns": ["^internal_"]},
            "rollout_monitoring": {
                "endpoints": ["http://gen-0:8000/metrics", "gen-1:8000"],
                "engine": "vllm",
            },
        }
    )
    assert cfg["redaction"] == {"extra_patterns": ["^internal_"]}
    assert cfg["rollout_monitoring"] == {
        "endpoints": ["http://gen-0:8000/metrics", "gen-1:8000"],
        "collection_interval": 5.0,
        "engine": "vllm",
        "timeout": 5.0,
        "per_engine": True,
        "enabled": None,
        "sd_file": None,
        "source": "http",
    }
    assert resolve_config({})["redaction"] == {"extra_patterns": []}


def test_engine_choices_match_the_rollout_monitor():
    from otel_rl.rollout.engines import ENGINE_CHOICES

    with pytest.raises(ConfigError) as info:
        resolve_config({"rollout_monitoring": {"engine": "?"}})
    listed = str(info.value).split("must be one of ")[1].split(", got")[0]
    assert listed.replace(" or ", ", ").replace("'", "").split(", ") == list(ENGINE_CHOICES)


def test_passthrough_values_reach_trackers_as_the_same_objects():
    settings = object()  # e.g. a wandb.Settings instance: not serialized on the way
    cfg = resolve_config({"wandb": {"settings": settings, "tags": ["a"]}})
    assert cfg["wandb"]["settings"] is settings
    assert cfg["wandb"]["tags"] == ["a"]


def test_defaults_are_derived_from_the_schema():
    from otel_rl.config.loading import DEFAULTS

    assert resolve_config({}) == DEFAULTS
    assert DEFAULTS["prometheus"] == {"enabled": False, "host": "127.0.0.1", "port": 9464}
    assert DEFAULTS["export"]["queue_size"] == 10_000


# ---- a real NeMo RL experiment file ----------------------------------------------------------

NEMO_RL_GRPO = """\
# a GRPO math experiment in NeMo RL's layout (examples/configs/grpo_math_1B.yaml)
grpo:
  num_prompts_per_step: 32
  num_generations_per_prompt: 16
  max_num_steps: 1000000
  normalize_rewards: true
  use_leave_one_out_baseline: true
  val_period: 10
loss_fn:
  reference_policy_kl_penalty: 0.01
  ratio_clip_min: 0.2
  ratio_clip_max: 0.2
  token_level_loss: true
checkpointing:
  enabled: true
  checkpoint_dir: "results/grpo"
  metric_name: "val_reward"
policy:
  model_name: "Qwen/Qwen2.5-1.5B"
  train_global_batch_size: 512
  train_micro_batch_size: 4
  max_total_sequence_length: 512
  generation:
    backend: "vllm"
    max_new_tokens: ${{policy.max_total_sequence_length}}
    temperature: 1.0
data:
  prompt_file: "examples/prompts/cot.txt"
  dataset_name: "OpenMathInstruct-2"
logger:
  log_dir: "{log_dir}"
  num_val_samples_to_print: 0
  wandb_enabled: false
  tensorboard_enabled: true
  mlflow_enabled: false
  swanlab_enabled: false
  monitor_gpus: false
  wandb:
    project: "grpo-dev"
    name: "grpo-dev-logger"
  tensorboard: {{}}
  mlflow:
    experiment_name: "grpo-dev"
    run_name: "grpo-dev-logger"
  swanlab:
    project: "grpo-dev"
    name: "grpo-dev-logger"
  gpu_monitoring:
    collection_interval: 10
    flush_interval: 10
cluster:
  gpus_per_node: 1
  num_nodes: 1
"""


def test_nemo_rl_grpo_experiment_file_resolves_and_logs(tmp_path):
    log_dir = tmp_path / "logs"
    path = tmp_path / "grpo_math.yaml"
    path.write_text(NEMO_RL_GRPO.format(log_dir=log_dir))
    cfg = resolve_config(path)
    assert cfg["tensorboard_enabled"] is True and cfg["wandb_enabled"] is False
    assert cfg["wandb"] == {"project": "grpo-dev", "name": "grpo-dev-logger"}
    assert cfg["mlflow"] == {"experiment_name": "grpo-dev", "run_name": "grpo-dev-logger"}
    assert cfg["gpu_monitoring"]["collection_interval"] == 10.0
    assert cfg["tensorboard"] == {"log_dir": None}
    with Logger(path) as logger:
        logger.log_metrics({"loss": 0.25}, step=3)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["metrics"]) for r in rows] == [(3, {"loss": 0.25})]
    assert (log_dir / "tensorboard").is_dir()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="monitor_gpus needs Ray")
def test_nemo_rl_monitor_gpus_true_resolves(tmp_path):
    path = tmp_path / "grpo_math.yaml"
    path.write_text(
        NEMO_RL_GRPO.format(log_dir=tmp_path).replace("monitor_gpus: false", "monitor_gpus: true")
    )
    assert resolve_config(path)["monitor_gpus"] is True


# ---- the docs table --------------------------------------------------------------------------


def test_docs_table_is_the_generated_one():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_config_table
    finally:
        sys.path.remove(str(ROOT / "docs"))
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert gen_config_table.table_in(text) == markdown_table(), (
        "docs/configuration.md's key table differs from the schema: run "
        "python docs/gen_config_table.py"
    )


def test_table_lists_every_key_with_its_default():
    table = markdown_table()
    rows = {line.split(" | ")[0].strip("|` "): line for line in table.splitlines()[2:]}
    assert len(rows) == len(table.splitlines()) - 2  # one row per key, no duplicates
    assert rows["export.shutdown_timeout"] == (
        "| `export.shutdown_timeout` | seconds | `30` "
        "| deadline of `finish()` and exit: every part gives up at it |"
    )
    assert "`spool` \\| `block` \\| `drop_oldest`" in rows["export.on_full"]
    for key in ("redaction.extra_patterns", "rollout_monitoring.engine", "prometheus.enabled",
                "otlp.headers", "trackers", "rank"):
        assert key in rows


# ---- import cost -----------------------------------------------------------------------------


def test_import_otel_rl_does_not_load_the_validator():
    code = (
        "import sys, otel_rl, otel_rl.config.loading\n"
        "assert 'pydantic' not in sys.modules, 'pydantic imported'\n"
        "assert 'otel_rl.config.schema' not in sys.modules\n"
        "otel_rl.config.loading.resolve_config({})\n"
        "assert 'otel_rl.config.schema' in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
