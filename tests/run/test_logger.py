"""Logger semantics: steps, merging, timers, plain OTel meters, bad input, lifecycle."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from opentelemetry import metrics

from otel_rl import Logger, MetricError
from otel_rl.core.records import StepBatch
from testkit.readers import jsonl_rows, tensorboard_scalars


def rows_by_step(log_dir) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for row in jsonl_rows(log_dir / "metrics.jsonl"):
        out.setdefault(row["step"], {}).update(row["metrics"])
    return out


def test_calls_for_one_step_merge_into_one_row(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_metrics({"loss": 1.0}, step=0, prefix="train")
        logger.log_metrics({"generation": 2.5}, step=0, prefix="timing/train")
        logger.log_metrics({"loss": 0.5}, step=1, prefix="train")
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (0, {"train/loss": 1.0, "timing/train/generation": 2.5}),
        (1, {"train/loss": 0.5}),
    ]


def test_step_none_continues_the_current_step_or_the_next(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_metrics({"a": 1}, step=None)  # no step yet → 0
        logger.log_metrics({"b": 2}, step=None)  # merges into 0
        logger.log_metrics({"c": 3}, step=5, step_finished=True)
        logger.log_metrics({"d": 4}, step=None)  # after 5 → 6
    assert rows_by_step(log_dir) == {0: {"a": 1.0, "b": 2.0}, 5: {"c": 3.0}, 6: {"d": 4.0}}


def test_backwards_step_warns_and_is_still_delivered(log_dir, otel_rl_warnings):
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in (0, 1, 2, 1):
            logger.log_metrics({"x": step * 10}, step=step)
        assert logger.stats["backwards_steps"] == 1
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["x"]) for r in rows] == [(0, 0), (1, 10), (2, 20), (1, 10)]
    assert any("went backwards (2 -> 1)" in r.getMessage() for r in otel_rl_warnings.records)


def test_timer_lands_on_the_step_it_ran_in(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        gen = logger.timer("generation")
        for step in range(4):
            for _ in range(step + 1):  # repeated timers in a step add up
                with gen:
                    time.sleep(0.01 * (step + 1))
            logger.log_metrics({"loss": float(step)}, step=step)

        @logger.timer("decorated")
        def work():
            time.sleep(0.005)

        work()
        logger.log_metrics({"loss": 9.0}, step=4)
    rows = rows_by_step(log_dir)
    for step in range(4):
        expected = (step + 1) * 0.01 * (step + 1)
        assert expected <= rows[step]["timing/generation"] < expected + 0.05 * (step + 1)
        assert "timing/decorated" not in rows[step]
    assert 0.005 <= rows[4]["timing/decorated"] < 0.1
    assert "timing/generation" not in rows[4]


def test_library_histogram_through_plain_otel_reaches_tensorboard(log_dir):
    """Code that only knows the OTel API (no otel-rl import) is routed to the trackers."""
    meter = metrics.get_meter("some_library")  # obtained before the Logger exists
    latency = meter.create_histogram("some_library.latency", unit="s")
    cache_hits = meter.create_counter("some_library.cache_hits")
    with Logger({"log_dir": str(log_dir), "tensorboard_enabled": True}) as logger:
        for step in range(3):
            for value in range(step + 1):
                latency.record(0.25 * (value + 1))
            cache_hits.add(step * 2)
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert scalars["some_library.latency/count"] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert scalars["some_library.latency/sum"] == [(0, 0.25), (1, 0.75), (2, 1.5)]
    assert scalars["some_library.latency/max"] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert scalars["some_library.cache_hits"] == [(0, 0.0), (1, 2.0), (2, 4.0)]


def test_library_meters_follow_the_newest_logger(tmp_path):
    meter = metrics.get_meter("lib2")
    gauge = meter.create_gauge("lib2.queue_depth")
    for run in range(2):
        log_dir = tmp_path / f"run{run}"
        with Logger({"log_dir": str(log_dir)}) as logger:
            gauge.set(10.0 + run)
            logger.log_metrics({"x": 1}, step=0)
        assert rows_by_step(log_dir)[0]["lib2.queue_depth"] == 10.0 + run
    gauge.set(99.0)  # no live Logger: dropped by design, never an error


def test_value_kinds(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_metrics(
            {
                "np_float": np.float32(0.5),
                "np_int": np.int64(7),
                "np_0d": np.array(2.5),
                "np_1elem": np.array([3.5]),
                "torch_scalar": torch.tensor(4.5),
                "torch_1elem": torch.tensor([5.5]),
                "bool": True,
                "nested": {"a": 1, "b": {"c": 2}},
                "lengths": [1, 2, 3, 4],
                "np_vec": np.array([10.0, 20.0]),
                "torch_vec": torch.tensor([1.0, 3.0]),
                "text": "hello",
                "big_int": 2**70,
            },
            step=0,
            prefix="p",
        )
    row = rows_by_step(log_dir)[0]
    assert row["p/np_float"] == 0.5 and row["p/np_int"] == 7.0
    assert row["p/np_0d"] == 2.5 and row["p/np_1elem"] == 3.5
    assert row["p/torch_scalar"] == 4.5 and row["p/torch_1elem"] == 5.5
    assert row["p/bool"] == 1.0
    assert row["p/nested/a"] == 1.0 and row["p/nested/b/c"] == 2.0
    assert row["p/text"] == "hello"
    assert row["p/big_int"] == float(2**70)
    assert {k: row[f"p/lengths/{k}"] for k in ("count", "mean", "min", "max", "p50")} == {
        "count": 4.0, "mean": 2.5, "min": 1.0, "max": 4.0, "p50": 2.5,
    }
    assert row["p/lengths/std"] == pytest.approx(np.std([1, 2, 3, 4]))
    assert row["p/lengths/p90"] == pytest.approx(np.percentile([1, 2, 3, 4], 90))
    assert row["p/np_vec/mean"] == 15.0 and row["p/torch_vec/max"] == 3.0


def test_bad_values_are_reported_once_and_never_raise(log_dir, otel_rl_warnings):
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(3):
            logger.log_metrics(
                {"none": None, "obj": object(), 7: 1.5, "": 2.0, "ok": 1.0, "mixed": [1, "a"]},
                step=step,
            )
        logger.log_metrics("not a dict", step=3)  # type: ignore[arg-type]
    rows = rows_by_step(log_dir)
    assert rows[0] == {"7": 1.5, "ok": 1.0}
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert sum("'none'" in m and "None skipped" in m for m in messages) == 1
    assert sum("'obj'" in m and "not a number" in m for m in messages) == 1
    assert sum("converted to the string '7'" in m for m in messages) == 1
    assert any("'mixed'" in m for m in messages)
    assert any("must be a mapping" in m for m in messages)


def test_strict_mode_raises_metric_error(log_dir):
    with Logger({"log_dir": str(log_dir), "strict": True}) as logger:
        with pytest.raises(MetricError) as info:
            logger.log_metrics({"ok": 1.0, "bad": None}, step=0)
        assert info.value.key == "bad" and "None" in info.value.reason
        with pytest.raises(MetricError):
            logger.log_metrics({"x": 1}, step="seven")
        logger.log_metrics({"ok": 2.0}, step=1)
    # the call that raised logged nothing, not half of its dict
    assert rows_by_step(log_dir) == {1: {"ok": 2.0}}


def test_colliding_keys(log_dir, otel_rl_warnings):
    with Logger({"log_dir": str(log_dir)}) as logger:
        logger.log_metrics({"train/loss": 1.0, "train.loss": 2.0}, step=0)
    assert rows_by_step(log_dir)[0] == {"train/loss": 1.0, "train.loss": 2.0}
    assert any("both become the metric 'train_loss'" in r.getMessage()
               for r in otel_rl_warnings.records)
    with Logger({"log_dir": str(log_dir), "strict": True}) as logger:
        logger.log_metrics({"Train_Loss": 1.0}, step=0)
        with pytest.raises(MetricError, match="train_loss"):
            logger.log_metrics({"train/loss": 1.0}, step=0)


def test_finish_is_idempotent_and_later_calls_are_harmless(log_dir, otel_rl_warnings):
    logger = Logger({"log_dir": str(log_dir)})
    logger.log_metrics({"x": 1}, step=0)
    logger.finish()
    logger.finish()
    logger.log_metrics({"x": 2}, step=1)
    assert rows_by_step(log_dir) == {0: {"x": 1.0}}
    assert any("after finish()" in r.getMessage() for r in otel_rl_warnings.records)


def test_batches_reaching_exporters_are_immutable_snapshots(log_dir):
    from otel_rl.exporters.base import TrackerExporter

    seen: list[StepBatch] = []

    class Capture(TrackerExporter):
        name = "capture"

        def write_step(self, step, rows, batch):
            seen.append(batch)

    metrics_dict = {"a": 1.0}
    with Logger({"log_dir": str(log_dir)}, exporters=[Capture()]) as logger:
        logger.log_metrics(metrics_dict, step=0)
        metrics_dict["a"] = 2.0  # the caller reuses its dict
        logger.log_metrics(metrics_dict, step=1)
    assert [(b.step, dict(b.rows)) for b in seen] == [(0, {"a": 1.0}), (1, {"a": 2.0})]


def test_backwards_steps_warn_once_then_count(log_dir, otel_rl_warnings):
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in (5, 1, 6, 2, 7, 3):
            logger.log_metrics({"x": step}, step=step)
        assert logger.stats["backwards_steps"] == 3
    warnings = [r.getMessage() for r in otel_rl_warnings.records]
    assert sum("went backwards (5 -> 1)" in m for m in warnings) == 1  # the Logger, once
    assert sum("jsonl: step went backwards" in m for m in warnings) == 1  # each tracker, once
    assert sum("went backwards" in m for m in warnings) == 2
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [5, 1, 6, 2, 7, 3]


def test_changing_directory_after_logger_keeps_every_output_where_the_config_meant(
    tmp_path, monkeypatch
):
    """Relative paths of the config are taken from the directory ``Logger()`` ran in: a script
    that changes directory afterwards (a launcher moving into a run folder) still finds its
    rows, event files and spool there (before, trackers opened on their own thread later wrote
    under the new directory)."""
    monkeypatch.chdir(tmp_path)
    logger = Logger({"log_dir": "logs", "jsonl_enabled": True, "tensorboard_enabled": True,
                     "tensorboard": {"log_dir": "tb"}})  # fmt: skip
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert tensorboard_scalars(tmp_path / "tb")["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert (tmp_path / "logs" / ".otel-rl" / "spool").is_dir()
    assert list((tmp_path / "elsewhere").iterdir()) == []
