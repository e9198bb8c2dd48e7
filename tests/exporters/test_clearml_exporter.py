"""ClearML exporter: every test runs ClearML in its offline mode, the session written under
``CLEARML_CACHE_DIR=<tmp_path>/clearml`` (ClearML's ``<cache>/offline/<task id>/``), and reads back
what ClearML stored there: ``task.json`` (name, project, parameters), ``metrics.jsonl`` (the
reported events: scalars, plots, tables, debug images) and ``log.jsonl`` (the console log)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("clearml")

from otel_rl import ConfigError, Logger
from otel_rl.core.records import StepBatch
from otel_rl.exporters.clearml import title_series

Series = tuple[str, str]


@dataclass
class ClearMLSession:
    """What one offline ClearML session holds, as ClearML wrote it."""

    folder: Path
    name: str
    project: str
    parameters: dict[str, dict[str, str]]  # section → name → value (ClearML keeps text)
    configuration: dict[str, str]  # configuration object name → its text
    scalars: dict[Series, list[tuple[int, float]]] = field(default_factory=dict)
    plots: dict[Series, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    images: dict[Series, list[tuple[int, Path]]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


def clearml_sessions(cache_dir: Path, task_name: str) -> list[Path]:
    """The offline session folders of tasks named ``task_name``, oldest first."""
    found = []
    for task_file in sorted((Path(cache_dir) / "offline").glob("*/task.json")):
        if json.loads(task_file.read_text())["name"] == task_name:
            found.append(task_file.parent)
    return sorted(found, key=lambda p: p.stat().st_mtime)


def read_clearml_session(folder: Path) -> ClearMLSession:
    """Decode an offline session folder (the files ClearML's offline mode writes)."""
    task = json.loads((folder / "task.json").read_text())
    parameters = {
        section: {name: p["value"] for name, p in values.items()}
        for section, values in (task.get("hyperparams") or {}).items()
    }
    configuration = {k: v["value"] for k, v in (task.get("configuration") or {}).items()}
    session = ClearMLSession(folder, task["name"], task["project_name"], parameters, configuration)
    for event in _events(folder / "metrics.jsonl"):
        series = (event["metric"], event["variant"])
        if event["type"] == "training_stats_scalar":
            session.scalars.setdefault(series, []).append((event["iter"], event["value"]))
        elif event["type"] == "plot":
            plot = json.loads(event["plot_str"])
            session.plots.setdefault(series, []).append((event["iter"], plot))
        elif event["type"] == "training_debug_image":
            session.images.setdefault(series, []).append((event["iter"], Path(event["url"])))
    session.log = [event["msg"] for event in _events(folder / "log.jsonl")]
    return session


def read_clearml(cache_dir: Path, task_name: str) -> ClearMLSession:
    """The one offline session of ``task_name`` under ``cache_dir``."""
    (folder,) = clearml_sessions(cache_dir, task_name)
    return read_clearml_session(folder)


def table_of(plot: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of a table ClearML stored as a Plotly table (cells by column)."""
    (data,) = plot["data"]
    columns = list(data["header"]["values"])
    by_column = data["cells"]["values"]
    return columns, [list(row) for row in zip(*by_column, strict=True)]


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if line.strip():
            events.extend(json.loads(line))  # one JSON list of events per flush
    return events


@pytest.fixture
def clearml_cache(monkeypatch, tmp_path):
    """ClearML's cache (and so its offline sessions) under ``tmp_path``."""
    cache = tmp_path / "clearml"
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(cache))
    return cache


def _config(tmp_path, task_name: str, **clearml: object) -> dict:
    return {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": False,
        "clearml_enabled": True,
        "clearml": {"project_name": "otel-rl-tests", "task_name": task_name, "offline": True,
                    **clearml},
    }  # fmt: skip


def test_title_and_series_split_at_the_first_slash():
    assert title_series("actor/pg_loss") == ("actor", "pg_loss")
    assert title_series("val-core/openai/gsm8k/acc") == ("val-core", "openai/gsm8k/acc")
    assert title_series("loss") == ("loss", "loss")
    assert title_series("/x") == ("/x", "/x")
    assert title_series("x/") == ("x/", "x/")


def test_scalars_parameters_text_and_gpu_axis(clearml_cache, tmp_path, otel_rl_warnings):
    expected: dict[int, dict[str, float]] = {}
    with Logger(_config(tmp_path, "scalars")) as logger:
        logger.log_hyperparams({"optimizer": {"lr": 3e-4}, "seed": 7, "layers": [1, 2]})
        for step in range(4):
            row: dict[str, Any] = {
                "train/loss": 1.0 / (step + 1),
                "val-core/openai/gsm8k/acc": 0.5 + step / 10,
                "reward": float(step),
                "train/sample": f"answer {step}",
            }
            if step == 2:
                row["train/kl"] = math.nan
            else:
                row["train/kl"] = 0.01 * step
            logger.log_metrics(row, step=step)
            expected[step] = row
            if step == 1:
                (exporter,) = logger.exporters
                exporter.submit(
                    StepBatch(step=35, values={"ray/node.n1.gpu.0.util": 35.0}, axis="ray/ray_step")
                )
    assert exporter.resume_config == {}  # an offline task cannot be continued

    session = read_clearml(clearml_cache, "scalars")
    assert (session.name, session.project) == ("scalars", "otel-rl-tests")
    assert session.parameters == {
        "General": {"optimizer.lr": "0.0003", "seed": "7", "layers": "[1, 2]"}
    }
    assert session.scalars[("train", "loss")] == [(s, 1.0 / (s + 1)) for s in range(4)]
    assert session.scalars[("val-core", "openai/gsm8k/acc")] == [
        (s, 0.5 + s / 10) for s in range(4)
    ]
    assert session.scalars[("reward", "reward")] == [(s, float(s)) for s in range(4)]
    # NaN is left out (ClearML would store 0.0), with one warning naming the key.
    assert session.scalars[("train", "kl")] == [(0, 0.0), (1, 0.01), (3, 0.03)]
    assert [r.getMessage() for r in otel_rl_warnings.records if "'train/kl' is nan" in
            r.getMessage()] == [
        "otel-rl: clearml: 'train/kl' is nan; ClearML would store it as 0.0, so non-finite "
        "values of this key are left out (the other trackers keep them)"
    ]  # fmt: skip
    assert session.scalars[("ray", "node.n1.gpu.0.util")] == [(35, 35.0)]
    texts = "\n".join(session.log)
    for step in range(4):
        assert f"[step {step}] train/sample: answer {step}" in texts


def test_table_histogram_plot_event_and_backwards_step(clearml_cache, tmp_path, otel_rl_warnings):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from otel_rl.core.records import Event

    figure, axes = plt.subplots()
    axes.plot([0, 1], [1, 0])
    with Logger(_config(tmp_path, "media")) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
        logger.log_metrics({"loss": 99.0}, step=1)  # backwards: ClearML keeps both points
        logger.log_table("val/samples", ["prompt", "score"], [["1+1", 1.0], ["2+2", 0.0]], step=3)
        logger.log_histogram([0.0, 1.0, 1.0, 2.0], step=3, name="adv", bins=2)
        logger.log_plot(figure, step=3, name="plots/curve")
        (exporter,) = logger.exporters
        exporter.submit(Event(name="otel_rl/stall", step=3, title="Stalled", text="no step",
                              level="warning"))  # fmt: skip
    plt.close(figure)
    assert exporter.stats["backwards_steps"] == 1
    assert any("clearml: step went backwards (1 after 2)" in r.getMessage()
               for r in otel_rl_warnings.records)  # fmt: skip

    session = read_clearml(clearml_cache, "media")
    assert session.scalars[("loss", "loss")] == [(0, 0.0), (1, 1.0), (2, 2.0), (1, 99.0)]
    ((step, table),) = session.plots[("val", "samples")]
    assert step == 3
    assert table_of(table) == (["prompt", "score"], [["1+1", 1.0], ["2+2", 0.0]])
    ((step, histogram),) = session.plots[("adv", "adv")]
    assert step == 3
    (bars,) = histogram["data"]
    assert bars["y"] == [1, 3] and bars["x"] == ["0..1", "1..2"]
    ((step, image),) = session.images[("plots", "curve")]
    assert step == 3 and image.is_file() and image.stat().st_size > 0
    assert "[step 3] Stalled\nno step" in "\n".join(session.log)


def test_settings_are_checked_before_anything_starts(clearml_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown clearml setting 'task_nme'; did you mean "
                       r"'task_name'\?"):  # fmt: skip
        Logger(_config(tmp_path, "typo", task_nme="x"))
    with pytest.raises(ConfigError, match="clearml"):
        Logger({"log_dir": str(tmp_path / "logs"), "clearml_enabled": True, "clearml": 3})
    with pytest.raises(ConfigError, match=r"clearml.offline must be true or false, got 'false'"):
        Logger({"log_dir": str(tmp_path / "logs"), "clearml_enabled": True,
                "clearml": {"offline": "false"}})  # fmt: skip
    assert not (clearml_cache / "offline").exists()


def test_project_and_task_default_to_experiment_and_run_id(clearml_cache, tmp_path):
    cfg = {
        "log_dir": str(tmp_path / "logs"), "jsonl_enabled": False, "experiment": "grpo-exp",
        "run_id": "run-42", "clearml_enabled": True, "clearml": {"offline": True},
    }  # fmt: skip
    with Logger(cfg) as logger:
        logger.log_metrics({"actor/lr": 1e-6}, step=1)
    session = read_clearml(clearml_cache, "run-42")
    assert session.project == "grpo-exp"
    assert session.scalars == {("actor", "lr"): [(1, 1e-6)]}


@pytest.mark.slow
def test_a_server_that_never_answers_does_not_block_training(tmp_path):
    """ClearML online against a real TCP server that accepts connections and never answers
    (in a child process, so that ClearML's half-opened task cannot leak into other tests):
    ``log_metrics`` stays in microseconds, the other tracker gets every row, ``finish`` returns
    after ``export.shutdown_timeout`` and the ClearML rows wait in the spool for replay."""
    script = textwrap.dedent(
        f"""
        import json, os, socket, time
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # accepts, never reads or answers
        host = "http://127.0.0.1:%d" % server.getsockname()[1]
        for name in ("CLEARML_API_HOST", "CLEARML_WEB_HOST", "CLEARML_FILES_HOST"):
            os.environ[name] = host
        os.environ["CLEARML_API_ACCESS_KEY"] = "A" * 20
        os.environ["CLEARML_API_SECRET_KEY"] = "S" * 30
        os.environ["CLEARML_CACHE_DIR"] = {str(tmp_path / "cache")!r}
        from otel_rl import Logger
        logger = Logger({{
            "log_dir": {str(tmp_path / "logs")!r}, "jsonl_enabled": True,
            "clearml_enabled": True, "clearml": {{"project_name": "p", "task_name": "dead"}},
            "export": {{"shutdown_timeout": 2}},
        }})
        took = []
        for step in range(200):
            began = time.perf_counter()
            logger.log_metrics({{"loss": float(step)}}, step=step)
            took.append(time.perf_counter() - began)
        began = time.perf_counter()
        logger.finish()
        finish = time.perf_counter() - began
        stats = {{e.name: dict(e.stats) for e in logger.exporters}}
        print(json.dumps({{"took": took, "finish": finish, "stats": stats}}), flush=True)
        """
    )
    # Online: none of ClearML's variables from this process (Task.set_offline(True) of an earlier
    # test sets CLEARML_OFFLINE_MODE in os.environ).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLEARML_", "TRAINS_"))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    took = sorted(result["took"][1:])  # the first call creates the instruments
    assert took[len(took) // 2] < 0.001 and took[-1] < 0.05, took
    assert result["finish"] < 10, result
    assert result["stats"]["jsonl"]["delivered"] == 200, (result, done.stderr[-3000:])
    assert result["stats"]["clearml"]["delivered"] == 0
    assert "deliver them with: otel-rl replay" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == list(range(200))


@pytest.mark.slow
def test_no_server_configured_stops_the_tracker_with_a_hint(tmp_path):
    """Online with no ClearML server or credentials (an empty HOME, none of ClearML's
    variables; a child process keeps ClearML's process-wide state out of other tests): the
    tracker stops at once, says what to do, and its rows wait in the spool."""
    script = textwrap.dedent(
        f"""
        from otel_rl import Logger
        with Logger({{"log_dir": {str(tmp_path / "logs")!r}, "jsonl_enabled": False,
                     "clearml_enabled": True, "clearml": {{"project_name": "p"}}}}) as logger:
            logger.log_metrics({{"loss": 1.0}}, step=1)
            logger.flush(timeout=60)
            (exporter,) = logger.exporters
            print(exporter.failure.kind, type(exporter.failure.error).__name__)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLEARML_", "TRAINS_"))}
    env["HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "permanent MissingConfigError"
    assert "give clearml its credentials (API key or login) or use its offline mode" in done.stderr
    assert "deliver them with: otel-rl replay" in done.stderr


def test_a_second_task_in_the_process_is_refused_with_a_reason(clearml_cache, tmp_path):
    """ClearML keeps one task per process: a second Logger asking for another task name while
    the first task is open stops with ClearML's refusal explained; the first is unaffected."""
    with Logger(_config(tmp_path, "first")) as first:
        first.log_metrics({"loss": 1.0}, step=1)
        assert first.flush(timeout=60)
        with Logger(_config(tmp_path / "second", "second")) as second:
            second.log_metrics({"loss": 2.0}, step=1)
            second.flush(timeout=60)
            (exporter,) = second.exporters
            failure = exporter.failure
        first.log_metrics({"loss": 0.5}, step=2)
    assert failure is not None and failure.kind == "permanent"
    assert type(failure.error).__name__ == "UsageError"
    assert failure.hint.startswith("ClearML keeps one task per process")
    assert read_clearml(clearml_cache, "first").scalars == {("loss", "loss"): [(1, 1.0), (2, 0.5)]}
    assert clearml_sessions(clearml_cache, "second") == []
