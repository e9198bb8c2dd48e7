"""How a run ends in a tracker with a run status, whatever idiom the program uses.

Each training script is a real ``python`` subprocess logging to a real ``mlflow server`` on
127.0.0.1 (the run's status and metric history are read back from the server) or to JSONL (the
rows and the exit code its spool recorded at close).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from testkit import servers
from testkit.readers import jsonl_rows
from testkit.servers import MlflowServer

mlflow_server = servers.mlflow_server


_HEAD = """
import sys
log_dir, uri, experiment = sys.argv[1:4]
cfg = {
    "log_dir": log_dir,
    "jsonl_enabled": False,
    "mlflow_enabled": True,
    "mlflow": {"tracking_uri": uri, "experiment_name": experiment},
}
"""

_CORE = _HEAD + "from otel_rl import Logger\n"
_DROP_IN = _HEAD + "from otel_rl.compat.nemo_rl import Logger\n"

# (script, expected MLflow status, expected process exit code)
CASES = {
    "core_try_finally_crash": (
        _CORE
        + """
logger = Logger(cfg)
try:
    for step in range(3):
        logger.log_metrics({"loss": step / 10}, step=step)
    raise RuntimeError("boom")
finally:
    logger.finish()
""",
        "FAILED",
        1,
    ),
    "core_try_finally_ctrl_c": (
        _CORE
        + """
logger = Logger(cfg)
try:
    for step in range(3):
        logger.log_metrics({"loss": step / 10}, step=step)
    raise KeyboardInterrupt
finally:
    logger.finish()
""",
        "KILLED",
        -signal.SIGINT,  # Python ends an uncaught KeyboardInterrupt by SIGINT's default action
    ),
    "core_uncaught_without_finish": (
        _CORE
        + """
logger = Logger(cfg)
for step in range(3):
    logger.log_metrics({"loss": step / 10}, step=step)
raise RuntimeError("boom")  # no finish(): the atexit one closes the run
""",
        "FAILED",
        1,
    ),
    "core_uncaught_without_signal_handling": (
        _CORE
        + """
cfg["export"] = {"handle_signals": False}
logger = Logger(cfg)
for step in range(3):
    logger.log_metrics({"loss": step / 10}, step=step)
raise RuntimeError("boom")
""",
        "FAILED",
        1,
    ),
    "core_uncaught_with_the_apps_own_excepthook": (
        _CORE
        + """
logger = Logger(cfg)
# Installed after the Logger and not chaining to the previous hook (as rich.traceback does).
sys.excepthook = lambda *exc: sys.stderr.write("app hook\\n")
for step in range(3):
    logger.log_metrics({"loss": step / 10}, step=step)
raise RuntimeError("boom")
""",
        "FAILED",
        1,
    ),
    "core_clean_without_finish": (
        _CORE
        + """
logger = Logger(cfg)
for step in range(3):
    logger.log_metrics({"loss": step / 10}, step=step)
""",
        "FINISHED",
        0,
    ),
    "core_clean_try_finally": (
        _CORE
        + """
logger = Logger(cfg)
try:
    for step in range(3):
        logger.log_metrics({"loss": step / 10}, step=step)
finally:
    logger.finish()
""",
        "FINISHED",
        0,
    ),
    "core_handled_error_explicit_success": (
        _CORE
        + """
logger = Logger(cfg)
for step in range(3):
    logger.log_metrics({"loss": step / 10}, step=step)
try:
    raise TimeoutError("early stop")
except TimeoutError:
    logger.finish(exit_code=0)  # the program says: this ending is a success
""",
        "FINISHED",
        0,
    ),
    "drop_in_try_finally_crash": (
        _DROP_IN
        + """
logger = Logger(cfg)
try:
    for step in range(3):
        logger.log_metrics({"loss": step / 10}, step=step)
    raise RuntimeError("boom")
finally:
    logger.finish()
""",
        "FAILED",
        1,
    ),
}


def _run(
    server: MlflowServer, log_dir: Path, script: str
) -> tuple[subprocess.CompletedProcess, str]:
    experiment = f"run-end-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(log_dir), server.url, experiment],
        capture_output=True, text=True, timeout=120,
        env={**env, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )  # fmt: skip
    return result, experiment


@pytest.mark.slow  # the shared server start plus MLflow's import in each child
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_mlflow_status_says_how_the_run_ended(mlflow_server, log_dir, case):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    script, status, code = CASES[case]
    result, experiment = _run(mlflow_server, log_dir, script)
    assert result.returncode == code, result.stderr
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, result.stderr  # the run never reached the server
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == status, result.stderr
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.1), (2, 0.2)]


_GENERATOR = """
import sys
from otel_rl import Logger

def steps(logger):
    try:
        for step in range(1_000):
            logger.log_metrics({"loss": step / 10}, step=step)
            yield step
    finally:
        logger.finish()  # reached by GeneratorExit when the consumer stops early

logger = Logger({"log_dir": sys.argv[1]})
for step in steps(logger):
    if step == 2:
        break
"""


def test_a_generator_closed_early_is_not_a_failed_run(log_dir):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_GENERATOR), str(log_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    (meta,) = [json.loads(p.read_text()) for p in log_dir.glob(".otel-rl/spool/*/*/meta.json")]
    assert meta["exit_code"] == 0
