"""The JSONL exporter, read back from disk."""

from __future__ import annotations

import math

from otel_rl import Logger
from testkit.readers import jsonl_rows


def test_rows_in_step_order_with_exact_values(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:  # JSONL is on by default
        for step in range(10):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step, prefix="train")
            logger.log_metrics({"lr": 1e-6 * step}, step=step, prefix="train")
            logger.log_metrics({"note": f"step {step}"}, step=step)

    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    for step, row in enumerate(rows):
        assert row["metrics"] == {
            "train/loss": 1.0 / (step + 1),
            "train/lr": 1e-6 * step,
            "note": f"step {step}",
        }
        assert isinstance(row["time"], float)
    assert rows == sorted(rows, key=lambda r: r["time"])


def test_second_run_appends_never_truncates(log_dir):
    for run in range(2):
        with Logger({"log_dir": str(log_dir)}) as logger:
            for step in range(3):
                logger.log_metrics({"run": float(run)}, step=step)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["run"]) for r in rows] == [
        (0, 0.0), (1, 0.0), (2, 0.0), (0, 1.0), (1, 1.0), (2, 1.0),
    ]


def test_nan_round_trips_and_hyperparams_file(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_hyperparams({"policy": {"lr": 1e-6, "name": "m"}, "wandb_api_key": "abcdef"})
        logger.log_metrics({"loss": float("nan"), "up": float("inf")}, step=0)
    (row,) = jsonl_rows(log_dir / "metrics.jsonl")
    assert math.isnan(row["metrics"]["loss"]) and row["metrics"]["up"] == math.inf
    import json

    params = json.loads((log_dir / "hyperparams.json").read_text())
    assert params == {"policy.lr": 1e-6, "policy.name": "m", "wandb_api_key": "***REDACTED***"}


def test_custom_path(tmp_path):
    target = tmp_path / "sub" / "rows.jsonl"
    with Logger({"log_dir": str(tmp_path / "logs"), "jsonl": {"path": str(target)}}) as logger:
        logger.log_metrics({"x": 1}, step=7)
    assert [(r["step"], r["metrics"]) for r in jsonl_rows(target)] == [(7, {"x": 1.0})]


def test_plots_and_tables_beside_the_rows(log_dir):
    import json

    matplotlib = __import__("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in (1, 2):
            fig, ax = plt.subplots()
            ax.plot([0, step])
            logger.log_plot(fig, step=step, name="train/curve")
            plt.close(fig)
        logger.log_table("val/samples", ["input", "output", "score"], [["2+2", "4", 1.0]], step=2)
    for step in (1, 2):
        png = (log_dir / "plots" / "train/curve" / f"step_{step}.png").read_bytes()
        assert png.startswith(b"\x89PNG")
    (table,) = [json.loads(line) for line in (log_dir / "tables.jsonl").read_text().splitlines()]
    assert table == {"step": 2, "table": "val/samples", "columns": ["input", "output", "score"],
                     "rows": [["2+2", "4", 1.0]]}


def _other_run_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "already holds rows of" in r.getMessage()]


def test_rows_carry_the_run_id(log_dir):
    with Logger({"log_dir": str(log_dir), "run_id": "grpo-7b-a"}) as logger:
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.log_metrics({"loss": 0.5}, step=1)
    with Logger({"log_dir": str(log_dir / "auto")}) as auto:
        auto.log_metrics({"loss": 2.0}, step=0)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["run_id"], r["step"]) for r in rows] == [("grpo-7b-a", 0), ("grpo-7b-a", 1)]
    assert [r["run_id"] for r in jsonl_rows(log_dir / "auto" / "metrics.jsonl")] == [auto.run_id]
    assert len(auto.run_id) == 12


def test_a_second_run_into_the_same_log_dir_says_so_once(log_dir, otel_rl_warnings):
    """The demo rerun into one log_dir: the second Logger warns once, naming the file and the
    other run, and suggesting a fresh log_dir; its rows are still appended, with its run id."""
    with Logger({"log_dir": str(log_dir), "run_id": "first"}) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
    assert _other_run_warnings(otel_rl_warnings) == []
    with Logger({"log_dir": str(log_dir), "run_id": "second"}) as logger:
        for step in range(3):
            logger.log_metrics({"loss": float(step)}, step=step)
            logger.flush()  # reopening after each flush must not warn again
    (message,) = _other_run_warnings(otel_rl_warnings)
    assert str(log_dir / "metrics.jsonl") in message
    assert "run 'first'" in message and "('second')" in message
    assert "fresh log_dir" in message
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["run_id"], r["step"]) for r in rows] == [
        ("first", 0), ("first", 1), ("first", 2), ("second", 0), ("second", 1), ("second", 2),
    ]


def test_the_same_run_continuing_does_not_warn(log_dir, otel_rl_warnings):
    for _ in range(2):  # a resumed run that keeps its run_id
        with Logger({"log_dir": str(log_dir), "run_id": "resumed"}) as logger:
            logger.log_metrics({"loss": 1.0}, step=0)
    assert _other_run_warnings(otel_rl_warnings) == []


def test_a_file_from_before_run_ids_and_a_long_last_row(log_dir, otel_rl_warnings):
    """Rows without run_id (an older otel-rl) are another run; the last row is read from its
    start even when it is far longer than the tail chunk (100,000 keys, about 3 MB)."""
    log_dir.mkdir(parents=True)
    path = log_dir / "metrics.jsonl"
    path.write_text('{"step":0,"time":1.0,"metrics":{"loss":1.0}}\n')
    with Logger({"log_dir": str(log_dir), "run_id": "wide"}) as logger:
        logger.log_metrics({f"layer_{i}/grad_norm": float(i) for i in range(100_000)}, step=0)
    (message,) = _other_run_warnings(otel_rl_warnings)
    assert "a run that wrote no run_id" in message
    assert path.stat().st_size > 1_000_000
    otel_rl_warnings.clear()
    with Logger({"log_dir": str(log_dir), "run_id": "wide"}) as logger:
        logger.log_metrics({"loss": 2.0}, step=1)
    assert _other_run_warnings(otel_rl_warnings) == []  # the long last row was found to be ours
    with Logger({"log_dir": str(log_dir), "run_id": "next"}) as logger:
        logger.log_metrics({"loss": 3.0}, step=0)
    (message,) = _other_run_warnings(otel_rl_warnings)
    assert "run 'wide'" in message
