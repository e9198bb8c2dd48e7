"""MLflow without a server: name mapping against MLflow's own validator, the default local SQLite
store under ``log_dir``, and the file store, where a name can't be both a metric and a folder."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from otel_rl import Logger
from otel_rl.exporters.mlflow import is_file_store, run_status
from otel_rl.exporters.mlflow_names import MAX_NAME_LENGTH, NameMap, sanitize

pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def _no_mlflow_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def mlflow_accepts(name: str) -> bool:
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    try:
        _validate_metric_name(name)
        _validate_param_name(name)
    except MlflowException:
        return False
    return len(name) <= MAX_NAME_LENGTH


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("train/loss", "train/loss"),
        ("Reward Mean.x-y_z", "Reward Mean.x-y_z"),
        ("a//b", "a/b"),
        ("/lead/", "lead"),
        ("a/./b/../c", "a/_/b/__/c"),
        ("loss{rank=0,gpu=1}", "loss_rank_0_gpu_1_"),
        ("time:step", "time_step"),
        ("", "_"),
        ("..0", "_.0"),
        ("...", "_.."),
        ("../x", "__/x"),
        ("ü/métrique", "ü/métrique"),
    ],
)
def test_sanitize(key, name):
    assert sanitize(key) == name
    assert mlflow_accepts(name)


def test_long_keys_are_cut_with_a_hash_that_tells_them_apart():
    a, b = "k" * 300 + "a", "k" * 300 + "b"
    assert len(sanitize(a)) == MAX_NAME_LENGTH and mlflow_accepts(sanitize(a))
    assert sanitize(a) != sanitize(b)
    # The same name in every run: another process, with another string hash seed, cuts it alike.
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from otel_rl.exporters.mlflow_names import sanitize; "
         "print(sanitize(sys.argv[1]))", a],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "7"},
    )  # fmt: skip
    assert other.stdout.strip() == sanitize(a), other.stderr


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=300))
@example("..0")  # once found by the random draw: MLflow refuses a name that starts with ".."
def test_every_key_maps_to_a_name_mlflow_accepts(key):
    assert mlflow_accepts(sanitize(key))


def test_two_keys_never_share_a_name():
    names = NameMap("metric")
    first, second = names("a{b}"), names("a_b_")
    assert first == "a_b_" and second != first and mlflow_accepts(second)
    assert names("a{b}") == first and names("a_b_") == second  # stable for the run
    assert set(names.renamed) == {"a{b}", "a_b_"}


def test_file_store_names_never_need_a_file_and_a_folder_of_one_name():
    names = NameMap("metric", file_store=True)
    assert names("timing/x") == "timing/x"
    assert names("timing/x/total") == "timing/x.total"
    other = NameMap("metric", file_store=True)
    assert other("timing/x/total") == "timing/x/total"
    assert other("timing/x") == "timing.x"
    assert other("timing") not in ("timing", "timing/x/total")
    server = NameMap("metric", file_store=False)
    assert (server("timing/x"), server("timing/x/total")) == ("timing/x", "timing/x/total")


@pytest.mark.parametrize(
    ("code", "status"),
    [(0, "FINISHED"), (1, "FAILED"), (2, "FAILED"), (130, "KILLED"), (143, "KILLED"),
     (137, "KILLED"), (-15, "KILLED")],
)
def test_run_status(code, status):
    assert run_status(code) == status


@pytest.mark.parametrize(
    ("uri", "file"),
    [("sqlite:///x.db", False), ("http://127.0.0.1:5000", False), ("databricks", False),
     ("file:///tmp/mlruns", True), ("./mlruns", True), ("postgresql://h/db", False)],
)
def test_is_file_store(uri, file):
    assert is_file_store(uri) is file


@pytest.mark.parametrize(
    ("uri", "anchored_at_tmp"),
    [("sqlite:///x.db", "sqlite:///{tmp}/x.db"), ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
     ("sqlite:///:memory:", "sqlite:///:memory:"), ("file:mlruns", "file://{tmp}/mlruns"),
     ("file:///abs/mlruns", "file:///abs/mlruns"), ("./mlruns", "{tmp}/mlruns"),
     ("http://127.0.0.1:5000", "http://127.0.0.1:5000"), ("databricks", "databricks")],
)  # fmt: skip
def test_a_relative_local_store_is_anchored_where_the_exporter_was_built(
    tmp_path, monkeypatch, uri, anchored_at_tmp
):
    from otel_rl.exporters.mlflow import anchored

    monkeypatch.chdir(tmp_path)
    assert anchored(uri) == anchored_at_tmp.format(tmp=tmp_path.as_posix())


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                              key=lambda m: m.step)]


@pytest.mark.slow
def test_default_store_is_sqlite_under_log_dir(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    with Logger({"log_dir": "logs", "mlflow_enabled": True}) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        logger.log_metrics({"loss": math.nan}, step=1)
        logger.log_plot(plt.figure(figsize=(2, 2), dpi=30), step=1, name="fig")
        exporter = next(e.tracker for e in logger.exporters if e.name == "mlflow")
    plt.close("all")

    db = tmp_path / "logs" / "mlflow" / "mlflow.db"
    assert exporter.tracking_uri == f"sqlite:///{db.as_posix()}"
    assert db.is_file()
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=exporter.tracking_uri)
    run = client.get_run(exporter.run_id)
    assert run.info.status == "FINISHED"
    loss = _history(client, exporter.run_id, "loss")
    assert loss[0] == (0, 0.5) and loss[1][0] == 1 and math.isnan(loss[1][1])
    plots = list((tmp_path / "logs" / "mlflow" / "artifacts").rglob("plots/fig/step_1.png"))
    assert len(plots) == 1 and plots[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_a_relative_sqlite_uri_stays_where_logger_ran_after_chdir(tmp_path, monkeypatch, delivery):
    """``tracking_uri: sqlite:///runs.db`` means the directory ``Logger()`` ran in, also when
    the script changes directory before the tracker opens its store (it opens on its own
    thread, or in the delivery process); before, the store was made in the new directory."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    cfg = {"log_dir": "logs", "mlflow_enabled": True, "jsonl_enabled": False,
           "mlflow": {"tracking_uri": "sqlite:///runs.db", "experiment_name": "anchored"},
           "export": {"delivery": delivery}}  # fmt: skip
    logger = Logger(cfg)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for step in range(3):
        logger.log_metrics({"loss": step / 2, "note": f"text {step}"}, step=step)
    logger.finish()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'runs.db').as_posix()}")
    experiment = client.get_experiment_by_name("anchored")
    assert experiment.artifact_location == (tmp_path / "mlruns").as_uri()  # MLflow's ./mlruns
    (run,) = client.search_runs([experiment.experiment_id])
    assert _history(client, run.info.run_id, "loss") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    texts = (tmp_path / "mlruns").glob("*/artifacts/text/note/step_*.txt")
    assert sorted(p.read_text() for p in texts) == ["text 0", "text 1", "text 2"]


@pytest.mark.slow
def test_the_run_id_is_known_to_the_training_process_with_a_delivery_process(tmp_path):
    """The MLflow run is opened in the delivery process; its stand-in here names it through
    ``resume_config`` as the exporter itself does, once the run has started."""
    from mlflow import MlflowClient

    db = f"sqlite:///{(tmp_path / 'runs.db').as_posix()}"
    cfg = {"log_dir": str(tmp_path / "logs"), "mlflow_enabled": True,
           "mlflow": {"tracking_uri": db, "experiment_name": "ids"},
           "export": {"delivery": "process"}}  # fmt: skip
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        assert logger.flush(30)
        mlflow = next(e for e in logger.exporters if e.name == "mlflow")
        run_id = mlflow.resume_config["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=db)
    (run,) = client.search_runs([client.get_experiment_by_name("ids").experiment_id])
    assert run.info.run_id == run_id
    assert _history(client, run_id, "loss") == [(0, 0.5)]


@pytest.mark.slow
def test_file_store_keeps_a_metric_next_to_its_own_subfolder(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses it otherwise
    uri = (tmp_path / "mlruns").as_uri()
    cfg = {"log_dir": str(tmp_path / "logs"), "mlflow_enabled": True,
           "mlflow": {"tracking_uri": uri}}
    with Logger(cfg) as logger:
        for step in range(3):
            with logger.timer("x"):
                pass
            with logger.timer("x/total"):
                pass
            logger.log_metrics({"a": 1.0 * step, "a/b": 2.0 * step}, step=step)
        exporter = next(e.tracker for e in logger.exporters if e.name == "mlflow")

    client = MlflowClient(tracking_uri=uri)
    metrics = set(client.get_run(exporter.run_id).data.metrics)
    # the steps' anatomy rows (docs/anatomy.md) are beside them, each under its own name
    assert {"anatomy/x/seconds", "anatomy/x/total/seconds"} <= metrics
    assert {m for m in metrics if not m.startswith("anatomy/")} == {
        "timing/x", "timing/x.total", "a", "a.b"
    }
    assert [s for s, _ in _history(client, exporter.run_id, "timing/x.total")] == [0, 1, 2]
    assert _history(client, exporter.run_id, "a.b") == [(0, 0.0), (1, 2.0), (2, 4.0)]
    assert exporter.delivery.stats["rejected"] == 0


_OPEN_THE_STORE = """
import sys, time
from pathlib import Path
from otel_rl.exporters.mlflow import MlflowExporter
exporter = MlflowExporter(log_dir=sys.argv[1], experiment_name=sys.argv[2])
go = Path(sys.argv[3]) if len(sys.argv) > 3 else None
if go is not None:
    import mlflow.store.tracking.sqlalchemy_store  # imported: the openings start together
    print("ready", flush=True)
while go is not None and not go.exists():
    time.sleep(0.001)
exporter.open()
print(exporter.run_id, flush=True)
"""


def _store_files(mlflow_dir) -> list:
    return sorted(p.name for p in mlflow_dir.iterdir()) if mlflow_dir.exists() else []


@pytest.mark.slow
def test_a_store_creation_killed_part_way_leaves_a_store_the_next_run_opens(tmp_path):
    """MLflow builds a new SQLite store migration by migration: a launch SIGKILLed meanwhile (or
    a delivery process killed at the run's deadline) left a half-built store that every later
    opening refused ("table ... already exists"), replay included. Killed at several moments of
    the creation, the next opening always works, in a whole store with log_dir's artifact root,
    and nothing of the killed creation is left beside it."""
    from mlflow import MlflowClient

    from otel_rl.exporters.mlflow import MlflowExporter

    for trial, delay in enumerate((0.0, 0.1, 0.4)):  # the creation takes about a second
        log_dir = tmp_path / f"t{trial}"
        mlflow_dir = log_dir / "mlflow"
        child = subprocess.Popen([sys.executable, "-c", _OPEN_THE_STORE, str(log_dir), "e"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        while not _store_files(mlflow_dir) and child.poll() is None:
            time.sleep(0.002)  # the creation has begun: its first file is there
        time.sleep(delay)
        child.kill()
        child.wait(30)
        again = MlflowExporter(log_dir=log_dir, experiment_name="e")
        again.open()
        client = MlflowClient(tracking_uri=f"sqlite:///{(mlflow_dir / 'mlflow.db').as_posix()}")
        (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
        assert run.info.run_id == again.run_id
        default = client.get_experiment("0")
        assert default.artifact_location == (mlflow_dir / "artifacts" / "0").as_uri()
        assert _store_files(mlflow_dir) == ["mlflow.db"], trial


@pytest.mark.slow
def test_processes_creating_one_store_at_once_all_open_it(tmp_path):
    """Three processes open the same new store at the same moment (a relaunch beside a replay
    and a reader): each opens it, with its run in the one store."""
    from mlflow import MlflowClient

    go = tmp_path / "go"
    log_dir = tmp_path / "logs"
    children = [
        subprocess.Popen([sys.executable, "-c", _OPEN_THE_STORE, str(log_dir), f"e{i}", str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]  # fmt: skip
    assert [child.stdout.readline() for child in children] == ["ready\n"] * 3
    go.touch()
    done = [child.communicate(timeout=300) for child in children]
    assert [child.returncode for child in children] == [0, 0, 0], [err[-1500:] for _, err in done]
    client = MlflowClient(tracking_uri=f"sqlite:///{(log_dir / 'mlflow' / 'mlflow.db').as_posix()}")
    for i, (out, _) in enumerate(done):
        (run,) = client.search_runs([client.get_experiment_by_name(f"e{i}").experiment_id])
        assert run.info.run_id == out.strip()
    assert _store_files(log_dir / "mlflow") == ["mlflow.db"]
