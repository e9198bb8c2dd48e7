"""A NeMo RL GRPO config and a verl PPO config, with secrets planted where users put them, logged
by a real ``otel_rl.Logger`` in a subprocess to TensorBoard, JSONL, MLflow (a real server on
127.0.0.1, its URI with ``user:password@``), W&B (offline) and OTLP (a real receiver, its
endpoint with ``user:password@`` and API-key headers).

Checked: every non-secret hyperparameter arrives unchanged in every tracker, read back with the
tracker's own reader; no planted secret is in any file under ``log_dir`` (spool and ``meta.json``
included), in the MLflow server's store, or in the process's output; the collector still gets the
credentials it needs.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_rl.core.redaction import REDACTED, flatten_params
from testkit import servers
from testkit.otlp_receiver import OtlpHttpReceiver
from testkit.readers import jsonl_rows

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

mlflow_server = servers.mlflow_server

CONFIGS = Path(__file__).resolve().parents[2] / "testkit" / "fixtures" / "configs"
ROOT = Path(__file__).resolve().parents[2]

# Each planted secret is unique to this module, so that finding it anywhere is a leak.
SECRETS = {
    "openai": "sk-PLANTED-openai-5c1e9a7f02",
    "cred_key": "PLANTED-credkey-88d1e0",
    "cred_user": "PLANTED-creduser-3b7c",
    "private_key": "PLANTEDprivkeyMIIEvQIBADANBgkqhkiG9w0",
    "list_password": "PLANTED-listpw-61f0aa",
    "pg_password": "PLANTED-pgpass-0e4d2c",
    "curl_password": "PLANTED-curlpw-9a8b7c",
    "hf_token": "hf_PLANTEDtoken4f9e2a1b",
    "mlflow_password": "PLANTED-mlflowpw-d4e5",
    "otlp_password": "PLANTED-otlppw-7788",
    "honeycomb": "PLANTED-honeycomb-a1b2c3d4",
    "api_key_header": "PLANTED-apikeyhdr-e5f6",
    "wandb_env": "PLANTEDwandbenvkey0123456789abcdef0123",
}
#: The flat keys holding a planted secret, and what each tracker must show instead.
PLANTED = {
    "secrets.openai": REDACTED,
    "credentials.key": REDACTED,
    "credentials.user": REDACTED,
    "cluster.ssh.private_key": REDACTED,
    "policy.hf_token": REDACTED,
    "data.db_url": f"postgresql://trainer:{REDACTED}@db.internal:5432/prompts",
    "checkpointing.upload_cmd": (
        f"rsync -a results/ /mnt/ckpt && curl -T done https://ci:{REDACTED}@artifacts.internal/up"
    ),
    "trainer.launcher_note": f"launched by slurm; W&B key {REDACTED} from the env",
}
LIST_KEY = "data.extra_sources"  # a list of dicts, one with a password


def plant(config: dict[str, Any], top: str) -> dict[str, Any]:
    """The config with secrets where users put them (nested, in lists, in URLs, in text)."""
    cfg = copy.deepcopy(config)
    cfg["secrets"] = {"openai": SECRETS["openai"]}
    cfg["credentials"] = {"key": SECRETS["cred_key"], "user": SECRETS["cred_user"]}
    cfg.setdefault("cluster", {})["ssh"] = {
        "user": "trainer",
        "private_key": "-----BEGIN PRIVATE KEY-----\n" + SECRETS["private_key"] + "\n-----END",
    }
    cfg.setdefault("policy", {})["hf_token"] = SECRETS["hf_token"]
    data = cfg.setdefault("data", {})
    data["db_url"] = f"postgresql://trainer:{SECRETS['pg_password']}@db.internal:5432/prompts"
    data["extra_sources"] = [
        {"name": "gsm8k-aug", "path": "s3://rl-data/gsm8k-aug"},
        {"name": "private-mix", "user": "reader", "password": SECRETS["list_password"]},
    ]
    cfg.setdefault("checkpointing", {})["upload_cmd"] = (
        "rsync -a results/ /mnt/ckpt && curl -T done "
        f"https://ci:{SECRETS['curl_password']}@artifacts.internal/up"
    )
    cfg.setdefault("trainer", {})["launcher_note"] = (
        f"launched by slurm; W&B key {SECRETS['wandb_env']} from the env"
    )
    assert top in cfg
    return cfg


DRIVER = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
logging.getLogger("otel_rl").setLevel(logging.DEBUG)
from otel_rl import Logger

spec = json.load(open(sys.argv[1]))
with Logger(spec["logger"]) as logger:
    logger.log_hyperparams(spec["hyperparams"])
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 / (step + 1), "train/reward": 0.1 * step}, step=step)
print("driver done", flush=True)
"""


def _hparams_from_tensorboard(tb_dir: Path) -> dict[str, Any]:
    """The hyperparameters of the HPARAMS tab, decoded from the event files with TensorBoard's
    own loader and the hparams plugin's protos."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    found: dict[str, Any] = {}
    for path in sorted(tb_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "hparams":
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(
                    value.metadata.plugin_data.content
                )
                if data.HasField("session_start_info"):
                    for key, v in data.session_start_info.hparams.items():
                        found[key] = getattr(v, v.WhichOneof("kind"))
    return found


def _tensorboard_form(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value if isinstance(value, str) else repr(value)


def _json_matches(expected: Any, got: Any) -> bool:
    """``got`` (read from a JSON file) is ``expected`` as JSON holds it; a mapping inside a list
    may be kept as a mapping or written as its ``str``."""
    if isinstance(expected, (list, tuple)):
        return isinstance(got, list) and len(got) == len(expected) and all(
            _json_matches(e, g) for e, g in zip(expected, got, strict=True)
        )
    if isinstance(expected, dict):
        return got == json.loads(json.dumps(expected)) or got == str(expected)
    return got == expected


def _files_containing(root: Path, needles: dict[str, bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits.extend(f"{name} in {path}" for name, n in needles.items() if n in data)
    return hits


def _needles() -> dict[str, bytes]:
    needles = {name: value.encode() for name, value in SECRETS.items()}
    basic = base64.b64encode(f"otel:{SECRETS['otlp_password']}".encode())
    needles["otlp_basic_auth"] = basic
    return needles


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fixture", "top"),
    [("nemo_rl_grpo_math.yaml", "grpo"), ("verl_ppo_gsm8k.yaml", "actor_rollout_ref")],
)
def test_real_config_arrives_intact_and_no_secret_is_written(
    fixture: str, top: str, tmp_path: Path, mlflow_server: Any
) -> None:
    from mlflow import MlflowClient

    original = yaml.safe_load((CONFIGS / fixture).read_text())
    hyperparams = plant(original, top)
    log_dir = tmp_path / "logs"
    experiment = f"real-config-{fixture.split('.')[0]}"
    host = mlflow_server.url.removeprefix("http://")
    receiver = OtlpHttpReceiver()
    try:
        otlp_host = receiver.endpoint.removeprefix("http://")
        logger_cfg = {
            "log_dir": str(log_dir),
            "tensorboard_enabled": True,
            "jsonl_enabled": True,
            "mlflow_enabled": True,
            "mlflow": {
                "tracking_uri": f"http://trainer:{SECRETS['mlflow_password']}@{host}",
                "experiment_name": experiment,
            },
            "wandb_enabled": True,
            "wandb": {"mode": "offline", "project": "real-configs"},
            "otlp": {
                "enabled": True,
                "endpoint": f"http://otel:{SECRETS['otlp_password']}@{otlp_host}",
                "interval": 0.5,
                "headers": {
                    "x-honeycomb-team": SECRETS["honeycomb"],
                    "api-key": SECRETS["api_key_header"],
                    "user-agent": "grpo-trainer/1.0",
                },
            },
            "export": {"shutdown_timeout": 60},
        }
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"logger": logger_cfg, "hyperparams": hyperparams}))
        env = {
            **os.environ,
            "WANDB_API_KEY": SECRETS["wandb_env"],
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PYTHONPATH": str(ROOT),
        }
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, str(spec)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-4000:]
        assert "driver done" in proc.stdout

        # The collector got the run's metrics with the credentials it needs.
        assert receiver.wait_for(1, timeout=30), "nothing reached the OTLP receiver"
        headers = {k.lower(): v for k, v in receiver.received[-1].headers.items()}
        assert headers["x-honeycomb-team"] == SECRETS["honeycomb"]
        assert headers["api-key"] == SECRETS["api_key_header"]
        basic = base64.b64encode(f"otel:{SECRETS['otlp_password']}".encode()).decode()
        assert headers["authorization"] == f"Basic {basic}"
    finally:
        receiver.close()

    flat = flatten_params(hyperparams)
    intact = {k: v for k, v in flat.items() if k not in PLANTED and k != LIST_KEY}
    # The keys the old substring rule wiped are in these configs and must stay.
    assert {k for k in intact if k.rsplit(".", 1)[-1] in {
        "max_new_tokens", "train_mb_tokens", "token_level_loss", "author", "authority_score",
        "ppo_max_token_len_per_gpu", "max_num_batched_tokens", "tokenizer_path",
    }}, "the fixture lost the keys that matter"

    # JSONL: hyperparams.json
    stored = json.loads((log_dir / "hyperparams.json").read_text())
    wrong = {
        k: (v, stored.get(k)) for k, v in intact.items() if not _json_matches(v, stored.get(k))
    }
    assert not wrong, wrong
    assert {k: stored[k] for k in PLANTED} == PLANTED
    sources = stored[LIST_KEY]
    assert _json_matches(
        [{"name": "gsm8k-aug", "path": "s3://rl-data/gsm8k-aug"},
         {"name": "private-mix", "user": "reader", "password": REDACTED}],
        sources,
    )  # fmt: skip
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [0, 1, 2]

    # TensorBoard: the HPARAMS tab's values
    tb = _hparams_from_tensorboard(log_dir / "tensorboard")
    wrong = {k: (v, tb.get(k)) for k, v in intact.items() if tb.get(k) != _tensorboard_form(v)}
    assert not wrong, wrong
    assert {k: tb[k] for k in PLANTED} == PLANTED

    # MLflow: the run's params on the server (read without the password: the server has no auth)
    client = MlflowClient(tracking_uri=mlflow_server.url)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    params = run.data.params
    wrong = {k: (v, params.get(k)) for k, v in intact.items() if params.get(k) != str(v)}
    assert not wrong, wrong
    assert {k: params[k] for k in PLANTED} == PLANTED
    assert {m.key for m in client.get_metric_history(run.info.run_id, "train/loss")} == {
        "train/loss"
    }

    # W&B (offline run, decoded with W&B's own reader)
    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    (run_dir,) = wandb_run_dirs(log_dir)
    wandb_config = read_wandb(run_dir).config
    got = {k: wandb_config.get(k) for k in flat}
    wrong = {k: (v, got[k]) for k, v in intact.items() if not _json_matches(v, got[k])}
    assert not wrong, wrong
    assert {k: got[k] for k in PLANTED} == PLANTED

    # No planted secret anywhere: every file under log_dir (trackers, spool, meta.json), the
    # MLflow server's store, and the process's output.
    needles = _needles()
    assert _files_containing(log_dir, needles) == []
    assert _files_containing(mlflow_server.workdir, needles) == []
    lines = output.splitlines()
    assert [line for line in lines if any(n.decode() in line for n in needles.values())] == []
    # MLflow's "View run" link is still printed, without the password.
    assert f"at: http://trainer:{REDACTED}@{host}/#/experiments/" in output
    # The spool's meta.json holds the redacted config (and the user name of the URIs).
    metas = list(log_dir.rglob("meta.json"))
    assert metas
    meta = json.loads(metas[0].read_text())["config"]
    assert meta["mlflow"]["tracking_uri"] == f"http://trainer:{REDACTED}@{host}"
    assert meta["otlp"]["headers"] == {
        "x-honeycomb-team": REDACTED, "api-key": REDACTED, "user-agent": "grpo-trainer/1.0"
    }  # fmt: skip
