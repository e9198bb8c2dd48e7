"""The JSONL exporter, read back from disk."""

from __future__ import annotations

import math

from otel_rl import Logger
from tests.readers import jsonl_rows


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
