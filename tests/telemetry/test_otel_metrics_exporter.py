"""``OTEL_METRICS_EXPORTER=tensorboard,mlflow opentelemetry-instrument python train.py``.

A script that only uses OTel's API (``metrics.get_meter``) runs under ``opentelemetry-instrument``
(opentelemetry-distro, in the test extra) in a subprocess. OTel's SDK builds otel-rl's
TensorBoard and MLflow exporters from their entry points with no arguments; the environment
configures them. The TensorBoard event file and the MLflow run on the real server are read back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from testkit import servers
from testkit.readers import tensorboard_scalars

mlflow_server = servers.mlflow_server  # the session's one shared server (fixture)

pytest.importorskip("mlflow")

TRAIN_SCRIPT = """
from opentelemetry import metrics

meter = metrics.get_meter("my_trainer")
step_gauge = meter.create_gauge("train.step")
loss = meter.create_gauge("train.loss")
tokens = meter.create_counter("tokens")
latency = meter.create_histogram("rollout.latency", unit="s")
provider = metrics.get_meter_provider()

for step in range(5):
    step_gauge.set(step)
    loss.set(1.0 / (step + 1))
    tokens.add(100 + step)
    latency.record(0.25 * (step + 1))
    provider.force_flush()  # one export per step; the periodic one is set to an hour
print("trained")
"""


def instrument_command() -> str:
    beside_python = Path(sys.executable).parent / "opentelemetry-instrument"
    found = str(beside_python) if beside_python.exists() else shutil.which(
        "opentelemetry-instrument"
    )
    if not found:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("opentelemetry-instrument is missing: the test extra installs it")
        pytest.skip("opentelemetry-instrument is not installed (pip install opentelemetry-distro)")
    return found


@pytest.mark.slow
@pytest.mark.long
def test_otel_only_script_reaches_tensorboard_and_mlflow(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT))
    experiment = f"otel-sdk-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path / "logs"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_"))},
        "OTEL_METRICS_EXPORTER": "tensorboard,mlflow",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_METRIC_EXPORT_INTERVAL": "3600000",
        "OTEL_RL_LOG_DIR": str(log_dir),
        "OTEL_RL_STEP_GAUGE": "train.step",
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    done = subprocess.run(
        [instrument_command(), sys.executable, str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout

    expected_loss = {step: 1.0 / (step + 1) for step in range(5)}
    expected_tokens = {step: 100.0 + step for step in range(5)}

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert dict(scalars["train.loss"]) == {s: float(np.float32(v)) for s, v in
                                           expected_loss.items()}
    assert dict(scalars["tokens"]) == expected_tokens
    assert dict(scalars["rollout.latency/count"]) == {s: 1.0 for s in range(5)}

    client = MlflowClient(tracking_uri=mlflow_server.url)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"

    def by_step(key: str) -> dict[int, float]:
        points = client.get_metric_history(run.info.run_id, key)
        # The SDK's final collection at shutdown repeats the gauges at the last step.
        assert sorted({m.step for m in points}) == list(range(5)), key
        return {m.step: m.value for m in points}

    assert by_step("train.loss") == expected_loss
    assert by_step("tokens") == expected_tokens  # counters arrive as per-export deltas
    assert by_step("rollout.latency/sum") == {s: 0.25 * (s + 1) for s in range(5)}


def test_sdk_builds_the_exporters_from_the_environment(tmp_path, monkeypatch, otel_rl_warnings):
    """The lookup and zero-argument construction that the SDK configurator performs, in-process;
    with no config of the user's, not a single warning."""
    from opentelemetry.sdk._configuration import _import_exporters
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otel_rl.exporters.jsonl import JsonlExporter
    from otel_rl.exporters.tensorboard import TensorBoardExporter
    from testkit.readers import jsonl_rows

    config = tmp_path / "otel-rl.yaml"
    config.write_text(f"log_dir: ignored\njsonl:\n  path: {tmp_path / 'rows.jsonl'}\n")
    monkeypatch.setenv("OTEL_RL_CONFIG", str(config))
    monkeypatch.setenv("OTEL_RL_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("OTEL_RL_STEP_GAUGE", "Train.Step")  # matched lower-cased, as exported

    _, classes, _ = _import_exporters([], ["tensorboard", "jsonl"], [])
    tensorboard, jsonl = classes["tensorboard"](), classes["jsonl"]()
    assert isinstance(tensorboard, TensorBoardExporter) and isinstance(jsonl, JsonlExporter)
    assert tensorboard.log_dir == tmp_path / "logs" / "tensorboard"
    assert jsonl.path == tmp_path / "rows.jsonl"

    readers = [PeriodicExportingMetricReader(e, export_interval_millis=3_600_000)
               for e in (tensorboard, jsonl)]
    provider = MeterProvider(metric_readers=readers)
    meter = provider.get_meter("lib")
    step, loss = meter.create_gauge("Train.Step"), meter.create_gauge("loss")
    for s in (3, 4):
        step.set(s)
        loss.set(s / 10)
        provider.force_flush()
    provider.shutdown()

    assert dict(tensorboard_scalars(tmp_path / "logs" / "tensorboard")["loss"]) == {
        3: float(np.float32(0.3)), 4: float(np.float32(0.4))
    }
    rows = jsonl_rows(tmp_path / "rows.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows[:2]] == [(3, 0.3), (4, 0.4)]
    assert all("axis" not in r for r in rows)  # on the step axis, not elapsed seconds
    assert [r.getMessage() for r in otel_rl_warnings.records] == []
