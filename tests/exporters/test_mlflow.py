"""MLflow exporter against a real ``mlflow server`` (SQLite backend) on 127.0.0.1.

Everything is read back through ``MlflowClient`` from the server: metric histories step by
step, params, artifacts, run status. Tests without a server use MLflow's own local stores.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from otel_rl import Logger
from otel_rl.core.errors import ConfigError
from otel_rl.exporters.mlflow import MlflowExporter
from otel_rl.exporters.tensorboard_summaries import png_size
from testkit import servers
from testkit.figures import line_figure, rendered_png
from testkit.servers import MlflowServer

mlflow_server = servers.mlflow_server  # the session's one shared server (fixture)

pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow  # one shared server start (~7 s) plus MLflow's import (~1.5 s)

MLFLOW_ENV = (
    "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
)


@pytest.fixture(autouse=True)
def _clean_mlflow_env(monkeypatch):
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def config(server: MlflowServer, log_dir: Path, **mlflow: Any) -> dict[str, Any]:
    mlflow.setdefault("experiment_name", f"test-{uuid.uuid4().hex[:8]}")
    return {
        "log_dir": str(log_dir),
        "jsonl_enabled": False,
        "mlflow_enabled": True,
        "mlflow": {"tracking_uri": server.url, **mlflow},
    }


def mlflow_of(logger: Logger) -> MlflowExporter:
    return next(e.tracker for e in logger.exporters if e.name == "mlflow")


def client_of(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def history(client: Any, run_id: str, key: str) -> list[tuple[int, Any]]:
    """``[(step, value)]`` in step order; NaN as the string "nan" so lists compare equal."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(m.step, "nan" if math.isnan(m.value) else m.value) for m in points]


def download(client: Any, run_id: str, path: str, tmp_path: Path) -> bytes:
    dst = tmp_path / f"dl-{uuid.uuid4().hex[:6]}"
    dst.mkdir()
    return Path(client.download_artifacts(run_id, path, str(dst))).read_bytes()


def artifact_files(client: Any, run_id: str, folder: str) -> list[str]:
    return sorted(f.path for f in client.list_artifacts(run_id, folder))


# ---- metrics ---------------------------------------------------------------------------------


def test_metric_history_equals_what_was_logged(mlflow_server, log_dir):
    expected: dict[str, list[tuple[int, Any]]] = {}
    with Logger(config(mlflow_server, log_dir)) as logger:
        for step in range(25):
            row = {"loss": 1.0 / (step + 1), "Reward/Mean": step * 0.37 - 3, "kl": 1e-9 * step}
            logger.log_metrics(row, step=step, prefix="train")
            for k, v in row.items():
                expected.setdefault(f"train/{k}", []).append((step, v))
            if step % 10 == 0:
                logger.log_metrics({"accuracy": step / 25}, step=step, prefix="val")
                expected.setdefault("val/accuracy", []).append((step, step / 25))
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    run = client.get_run(exporter.run_id)
    assert set(run.data.metrics) == set(expected)
    for key, points in expected.items():
        assert history(client, exporter.run_id, key) == points, key
    assert exporter.delivery.stats["delivered"] > 0 and exporter.delivery.stats["rejected"] == 0


def test_nan_stays_nan_and_inf_is_stored_as_mlflow_does(mlflow_server, log_dir):
    with Logger(config(mlflow_server, log_dir)) as logger:
        logger.log_metrics({"loss": 0.5, "grad": 1.0}, step=0)
        logger.log_metrics({"loss": math.nan, "grad": math.inf}, step=1)
        logger.log_metrics({"loss": 0.25, "grad": -math.inf}, step=2)
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    assert history(client, exporter.run_id, "loss") == [(0, 0.5), (1, "nan"), (2, 0.25)]
    # MLflow clamps ±inf to ±(largest double) in its store.
    big = sys.float_info.max
    assert history(client, exporter.run_id, "grad") == [(0, 1.0), (1, big), (2, -big)]


def test_clashing_and_invalid_names_all_arrive(mlflow_server, log_dir, otel_rl_warnings):
    long_key = "train/" + "k" * 300
    with Logger(config(mlflow_server, log_dir)) as logger:
        for step in range(3):
            with logger.timer("x"):
                pass
            with logger.timer("x/total"):
                pass
            logger.log_metrics(
                {"a": 1.0 * step, "a/b": 2.0 * step, "loss{rank=0}": 3.0 * step,
                 "weird//key/": 4.0 * step, long_key: 5.0 * step},
                step=step,
            )
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    run_id = exporter.run_id
    names = exporter.metric_names
    assert [s for s, _ in history(client, run_id, "timing/x")] == [0, 1, 2]
    assert [s for s, _ in history(client, run_id, "timing/x/total")] == [0, 1, 2]
    assert all(v >= 0 for _, v in history(client, run_id, "timing/x/total"))
    assert history(client, run_id, "a") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert history(client, run_id, "a/b") == [(0, 0.0), (1, 2.0), (2, 4.0)]
    assert names.renamed["loss{rank=0}"] == "loss_rank_0_"
    assert history(client, run_id, "loss_rank_0_") == [(0, 0.0), (1, 3.0), (2, 6.0)]
    assert names.renamed["weird//key/"] == "weird/key"
    assert history(client, run_id, "weird/key") == [(0, 0.0), (1, 4.0), (2, 8.0)]
    stored_long = names.renamed[long_key]
    assert len(stored_long) == 250 and stored_long.startswith("train/kkk")
    assert history(client, run_id, stored_long) == [(0, 0.0), (1, 5.0), (2, 10.0)]
    # The mapping is reported once per renamed key, not once per step.
    reports = [r.getMessage() for r in otel_rl_warnings.records if "is stored as" in r.message]
    assert len(reports) == 3


def test_histograms_become_summary_metrics_and_text_an_artifact(mlflow_server, log_dir, tmp_path):
    with Logger(config(mlflow_server, log_dir)) as logger:
        logger.log_histogram([1.0, 2.0, 3.0, 10.0], step=4, name="train/advantages")
        logger.log_metrics({"sample": "the answer is 42 | ok"}, step=3, prefix="val")
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    run_id = exporter.run_id
    stats = {"count": 4.0, "sum": 16.0, "mean": 4.0, "min": 1.0, "max": 10.0}
    for stat, value in stats.items():
        assert history(client, run_id, f"train/advantages/{stat}") == [(4, value)], stat
    text = download(client, run_id, "text/val/sample/step_3.txt", tmp_path)
    assert text.decode() == "the answer is 42 | ok"


def test_backwards_step_is_kept_as_a_second_point(mlflow_server, log_dir, otel_rl_warnings):
    with Logger(config(mlflow_server, log_dir)) as logger:
        for step, value in [(0, 0.0), (1, 1.0), (2, 2.0), (1, 1.5), (3, 3.0)]:
            logger.log_metrics({"loss": value}, step=step, step_finished=True)
        exporter = mlflow_of(logger)

    points = client_of(mlflow_server.url).get_metric_history(exporter.run_id, "loss")
    # Both values at step 1 are kept (MLflow orders points of one step by timestamp, then value).
    assert sorted((m.step, m.value) for m in points) == [
        (0, 0.0), (1, 1.0), (1, 1.5), (2, 2.0), (3, 3.0)
    ]
    assert exporter.delivery.stats["backwards_steps"] == 1
    assert any("MLflow keeps both" in r.getMessage() for r in otel_rl_warnings.records)


def test_mlflow_tensorboard_and_jsonl_hold_the_same_rows(mlflow_server, log_dir):
    from testkit.readers import jsonl_rows, tensorboard_scalars

    cfg = {**config(mlflow_server, log_dir), "tensorboard_enabled": True, "jsonl_enabled": True}
    logged: dict[str, list[tuple[int, float]]] = {}
    with Logger(cfg) as logger:
        for step in range(12):
            row = {"loss": 1.0 / (step + 1), "reward/mean": step * 0.25 - 1,
                   "grad_norm": math.nan if step == 5 else float(step)}
            logger.log_metrics(row, step=step, prefix="train")
            for k, v in row.items():
                logged.setdefault(f"train/{k}", []).append((step, v))
        exporter = mlflow_of(logger)

    def same(points: list[tuple[int, float]]) -> list[tuple[int, Any]]:
        return [(s, "nan" if math.isnan(v) else v) for s, v in points]

    client = client_of(mlflow_server.url)
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    lines = jsonl_rows(log_dir / "metrics.jsonl")
    for key, points in logged.items():
        assert history(client, exporter.run_id, key) == same(points), key
        f32 = [(s, float(np.float32(v))) for s, v in points]
        assert same(scalars[key]) == same(f32), key
        assert same([(r["step"], r["metrics"][key]) for r in lines]) == same(points), key


# ---- params ----------------------------------------------------------------------------------


def test_params_flattened_redacted_and_long_values_noted(mlflow_server, log_dir, tmp_path):
    long_value = "p" * 7000
    with Logger(config(mlflow_server, log_dir)) as logger:
        logger.log_hyperparams({
            "lr": 3e-4,
            "model": {"name": "qwen", "layers": [1, 2], "prompt": long_value},
            "wandb": {"api_key": "sk-very-secret"},
            "grpo": {"num_generations": 8, "use_kl": True},
        })
        logger.log_metrics({"loss": 1.0}, step=0)
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    params = client.get_run(exporter.run_id).data.params
    assert params["lr"] == "0.0003"
    assert params["model.name"] == "qwen"
    assert params["model.layers"] == "[1, 2]"
    assert params["grpo.num_generations"] == "8"
    assert params["grpo.use_kl"] == "True"
    assert params["wandb.api_key"] == "***REDACTED***"
    assert "sk-very-secret" not in json.dumps(params)
    prompt = params["model.prompt"]
    assert len(prompt) == 6000
    assert prompt.startswith("ppp") and "truncated: 7000 chars" in prompt
    full = download(client, exporter.run_id, "params/model.prompt.txt", tmp_path)
    assert full.decode() == long_value


def test_many_params_go_out_in_requests_of_100(mlflow_server, log_dir):
    exporter = CountingMlflowExporter(
        tracking_uri=mlflow_server.url, experiment_name=f"params-{uuid.uuid4().hex[:8]}"
    )
    params = {f"p{i:03d}": i for i in range(250)}
    with Logger({"log_dir": str(log_dir), "jsonl_enabled": False}, exporters=[exporter]) as lg:
        lg.log_hyperparams(params)

    assert exporter.requests == [("params", 100), ("params", 100), ("params", 50)]
    stored = client_of(mlflow_server.url).get_run(exporter.run_id).data.params
    assert stored == {k: str(v) for k, v in params.items()}


def test_changed_param_on_resume_is_refused_alone(mlflow_server, log_dir, otel_rl_warnings):
    cfg = config(mlflow_server, log_dir)
    with Logger(cfg) as logger:
        logger.log_hyperparams({"lr": 0.1, "seed": 1})
    run_id = mlflow_of(logger).run_id
    resumed = config(mlflow_server, log_dir, run_id=run_id)
    with Logger(resumed) as logger:
        # MLflow params are immutable: "lr" is refused, "epochs" (new) must still arrive.
        logger.log_hyperparams({"lr": 0.2, "seed": 2, "epochs": 3})
        logger.log_metrics({"loss": 0.5}, step=0)
        exporter = mlflow_of(logger)

    run = client_of(mlflow_server.url).get_run(run_id)
    assert run.data.params == {"lr": "0.1", "seed": "1", "epochs": "3"}
    assert run.data.metrics["loss"] == 0.5
    # Two values of one record refused: the values are counted, the record is delivered (it
    # is not set aside, and the delivered count never goes below what arrived).
    stats = exporter.delivery.stats
    assert (stats["refused_values"], stats["rejected"]) == (2, 0)
    assert stats["delivered"] == stats["submitted"] >= 2
    said = [r.getMessage() for r in otel_rl_warnings.records]
    assert any("refused param 'lr'" in m for m in said)
    assert any("refused param 'seed'" in m for m in said)


# ---- artifacts -------------------------------------------------------------------------------


def test_plots_are_stored_per_step_and_never_overwritten(mlflow_server, log_dir, tmp_path):
    import matplotlib.pyplot as plt

    figures = {1: line_figure([1, 2, 3]), 2: line_figure([3, 1, 2])}
    again = line_figure([0, 0, 1])
    with Logger(config(mlflow_server, log_dir)) as logger:
        logger.log_plot(figures[1], step=1, name="rollouts/reward curve")
        logger.log_plot(figures[2], step=2, name="rollouts/reward curve")
        logger.log_plot(again, step=2, name="rollouts/reward curve")  # same step again
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    folder = "plots/rollouts/reward curve"
    assert artifact_files(client, exporter.run_id, folder) == [
        f"{folder}/step_1.png", f"{folder}/step_2.png", f"{folder}/step_2_1.png",
    ]
    for path, figure in [("step_1.png", figures[1]), ("step_2.png", figures[2]),
                         ("step_2_1.png", again)]:
        stored = download(client, exporter.run_id, f"{folder}/{path}", tmp_path)
        assert stored == rendered_png(figure), path  # the exact PNG the Logger rendered
        assert png_size(stored)[:2] == png_size(rendered_png(figure))[:2]
    plt.close("all")


def test_tables_are_json_artifacts_per_step(mlflow_server, log_dir, tmp_path):
    rows = [["1+1", "2", 1.0], ["2+2", "5", 0.0]]
    with Logger(config(mlflow_server, log_dir)) as logger:
        logger.log_table("val/samples", ["prompt", "answer", "score"], rows, step=7)
        exporter = mlflow_of(logger)

    client = client_of(mlflow_server.url)
    data = json.loads(download(client, exporter.run_id, "tables/val/samples/step_7.json", tmp_path))
    assert data == {"columns": ["prompt", "answer", "score"], "data": rows}


# ---- run lifecycle ---------------------------------------------------------------------------


def test_status_finished_on_clean_exit(mlflow_server, log_dir):
    with Logger(config(mlflow_server, log_dir, run_name="clean")) as logger:
        logger.log_metrics({"loss": 1.0}, step=0)
        exporter = mlflow_of(logger)
    run = client_of(mlflow_server.url).get_run(exporter.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "clean")
    assert run.info.end_time is not None


def test_status_failed_after_an_exception(mlflow_server, log_dir):
    with pytest.raises(RuntimeError, match="boom"), Logger(config(mlflow_server, log_dir)) as lg:
        lg.log_metrics({"loss": 1.0}, step=0)
        exporter = mlflow_of(lg)
        raise RuntimeError("boom")
    client = client_of(mlflow_server.url)
    assert client.get_run(exporter.run_id).info.status == "FAILED"
    assert history(client, exporter.run_id, "loss") == [(0, 1.0)]


def test_status_killed_on_ctrl_c_and_on_sigterm_exit_code(mlflow_server, log_dir):
    with pytest.raises(KeyboardInterrupt), Logger(config(mlflow_server, log_dir)) as lg:
        lg.log_metrics({"loss": 1.0}, step=0)
        interrupted = mlflow_of(lg)
        raise KeyboardInterrupt
    logger = Logger(config(mlflow_server, log_dir))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finish(exit_code=143)
    client = client_of(mlflow_server.url)
    assert client.get_run(interrupted.run_id).info.status == "KILLED"
    assert client.get_run(mlflow_of(logger).run_id).info.status == "KILLED"


def test_resume_by_run_id_from_env(mlflow_server, log_dir, monkeypatch):
    cfg = config(mlflow_server, log_dir)
    with Logger(cfg) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
    run_id = mlflow_of(logger).run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    with Logger(cfg) as logger:
        for step in range(3, 6):
            logger.log_metrics({"loss": float(step)}, step=step)
        assert logger.flush()
        client = client_of(mlflow_server.url)
        assert client.get_run(run_id).info.status == "RUNNING"
        assert mlflow_of(logger).run_id == run_id

    assert history(client, run_id, "loss") == [(s, float(s)) for s in range(6)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_env_vars_choose_server_and_experiment(mlflow_server, log_dir, monkeypatch):
    name = f"env-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    # The config's generic `experiment` comes after MLflow's own variable.
    cfg = {"log_dir": str(log_dir), "mlflow_enabled": True, "experiment": "not-this-one"}
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        exporter = mlflow_of(logger)
    client = client_of(mlflow_server.url)
    run = client.get_run(exporter.run_id)
    assert run.info.experiment_id == client.get_experiment_by_name(name).experiment_id
    assert client.get_experiment_by_name("not-this-one") is None
    assert not (log_dir / "mlflow").exists()  # no local store when a server is configured


# ---- batching --------------------------------------------------------------------------------


class CountingMlflowExporter(MlflowExporter):
    """The real exporter, recording the size of each ``log_batch`` request it makes.

    ``gate`` (test hook) holds ``open()`` until set, so records pile up as behind a slow
    tracker, deterministically.
    """

    def __init__(self, gate: threading.Event | None = None, **kwargs: Any) -> None:
        self.gate = gate
        self.requests: list[tuple[str, int]] = []
        super().__init__(**kwargs)

    def open(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(60)
        super().open()

    def _send(self, items: list[Any], kind: str) -> None:
        self.requests.append((kind, len(items)))
        super()._send(items, kind)


def test_backlog_goes_out_batched_complete_and_in_order(mlflow_server, log_dir):
    gate = threading.Event()
    exporter = CountingMlflowExporter(
        gate, tracking_uri=mlflow_server.url, experiment_name=f"batch-{uuid.uuid4().hex[:8]}"
    )
    with Logger({"log_dir": str(log_dir), "jsonl_enabled": False}, exporters=[exporter]) as lg:
        for step in range(300):
            lg.log_metrics({"loss": step * 0.5, "reward": -step, "kl": step / 300}, step=step)
        gate.set()

    sizes = [n for kind, n in exporter.requests if kind == "metrics"]
    assert sum(sizes) == 900
    assert max(sizes) == MlflowExporter.max_batch * 3  # 64 steps of 3 metrics in one request
    assert len(sizes) <= 7  # not 300
    client = client_of(mlflow_server.url)
    assert history(client, exporter.run_id, "loss") == [(s, s * 0.5) for s in range(300)]
    assert history(client, exporter.run_id, "reward") == [(s, float(-s)) for s in range(300)]
    assert history(client, exporter.run_id, "kl") == [(s, s / 300) for s in range(300)]


def test_a_wide_step_is_split_at_1000_metrics(mlflow_server, log_dir):
    exporter = CountingMlflowExporter(
        tracking_uri=mlflow_server.url, experiment_name=f"wide-{uuid.uuid4().hex[:8]}"
    )
    row = {f"layer{i:04d}/grad_norm": i / 7 for i in range(2500)}
    with Logger({"log_dir": str(log_dir), "jsonl_enabled": False}, exporters=[exporter]) as lg:
        lg.log_metrics(row, step=5)

    assert exporter.requests == [("metrics", 1000), ("metrics", 1000), ("metrics", 500)]
    metrics = client_of(mlflow_server.url).get_run(exporter.run_id).data.metrics
    assert metrics == row


# ---- config ----------------------------------------------------------------------------------


def test_unknown_mlflow_key_is_refused(log_dir):
    with pytest.raises(ConfigError, match=r"mlflow\.experiment"):
        Logger({"log_dir": str(log_dir), "mlflow_enabled": True,
                "mlflow": {"experiment": "typo"}})


def test_the_server_is_reached_where_mlflow_would_connect(monkeypatch):
    """The connection tried before the SDK is called goes where MLflow's own request goes: the
    server, or the proxy the environment routes it through (``NO_PROXY`` hosts bypass it);
    stores that are no HTTP server are not tried."""
    from otel_rl.exporters.mlflow import server_address

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert server_address("http://127.0.0.1:5000/") == ("127.0.0.1", 5000)
    assert server_address("https://user:secret@mlflow.example.com/path") == (
        "mlflow.example.com", 443,
    )  # fmt: skip
    for store in ("sqlite:///runs/mlflow.db", "file:/tmp/mlruns", "databricks", "mlruns"):
        assert server_address(store) is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "internal.corp")
    assert server_address("https://mlflow.example.com") == ("proxy.corp", 3128)
    assert server_address("https://mlflow.internal.corp") == ("mlflow.internal.corp", 443)
    assert server_address("http://mlflow.example.com:5000") == ("mlflow.example.com", 5000)


def test_a_server_that_refuses_fails_the_call_at_once_and_is_retried_until_it_is_up(
    log_dir, tmp_path
):
    """A tracking server that is not up yet: each try fails at once on the refused connection
    (not inside MLflow's minutes of retries), and once the server is up the rows arrive."""
    port = servers.free_port()
    logger = Logger({"log_dir": str(log_dir), "mlflow_enabled": True,
                     "mlflow": {"tracking_uri": f"http://127.0.0.1:{port}",
                                "experiment_name": "late"},
                     "export": {"delivery": "thread", "shutdown_timeout": 60}})  # fmt: skip
    logger.log_metrics({"loss": 0.5}, step=0, step_finished=True)
    (delivery,) = [d for d in logger.exporters if d.name == "mlflow"]
    deadline = time.monotonic() + 20
    while delivery.last_error is None:
        assert time.monotonic() < deadline, "the refused connection was never said"
        time.sleep(0.05)
    said = delivery.last_error.describe()
    assert "cannot be reached" in said and "ConnectionRefusedError" in said, said
    server = servers.start_mlflow_server(tmp_path / "late-server", port=port)
    try:
        logger.log_metrics({"loss": 0.25}, step=1, step_finished=True)
        logger.finish()
        client = client_of(server.url)
        (run,) = client.search_runs([client.get_experiment_by_name("late").experiment_id])
        assert history(client, run.info.run_id, "loss") == [(0, 0.5), (1, 0.25)]
    finally:
        servers.stop_mlflow_server(server)


def test_a_server_gone_before_the_close_fails_it_at_once_and_its_password_is_never_said(
    log_dir, tmp_path, monkeypatch, otel_rl_warnings
):
    """The server stops after the first step (MLflow's own retries turned off, as a user may:
    the write after it fails at once). The run's close then tries the connection first: it
    fails at once rather than inside MLflow's retries, nothing of otel-rl runs after finish(),
    and no message says the tracking URI's password."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = servers.start_mlflow_server(tmp_path / "gone-server")
    uri = server.url.replace("http://", "http://trainer:s3cr3t-word@")
    try:
        logger = Logger({"log_dir": str(log_dir), "mlflow_enabled": True,
                         "mlflow": {"tracking_uri": uri, "experiment_name": "gone"},
                         "export": {"delivery": "thread", "shutdown_timeout": 3}})  # fmt: skip
        logger.log_metrics({"loss": 0.5}, step=0, step_finished=True)
        assert logger.flush(timeout=30)
    finally:
        servers.stop_mlflow_server(server)
    logger.log_metrics({"loss": 0.25}, step=1, step_finished=True)
    logger.finish()
    assert [t.name for t in threading.enumerate() if t.name.startswith("otel-rl")] == []
    said = [r.getMessage() for r in otel_rl_warnings.records]
    (closed,) = [m for m in said if "close failed" in m]
    assert "cannot be reached" in closed and "trainer:***REDACTED***@127.0.0.1" in closed, closed
    assert not any("s3cr3t-word" in m for m in said), said
