"""Whatever a training loop logs, lenient mode never raises and strict mode raises MetricError."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from otel_rl.exporters.base import TrackerExporter

from otel_rl import Logger, MetricError


class Capture(TrackerExporter):
    name = "capture"

    def __init__(self, **kwargs):
        self.rows: dict[int, dict] = {}
        super().__init__(**kwargs)

    def write_step(self, step, rows, batch):
        self.rows.setdefault(step, {}).update(rows)


def make_logger(tmp_path, strict: bool) -> tuple[Logger, Capture]:
    capture = Capture()
    cfg = {"log_dir": str(tmp_path), "jsonl_enabled": False, "strict": strict,
           "export": {"spool": False, "on_full": "block"}}
    return Logger(cfg, exporters=[capture]), capture


keys = st.one_of(
    st.text(max_size=300),
    st.integers(),
    st.none(),
    st.tuples(st.integers(), st.text(max_size=3)),
)
values = st.recursive(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.booleans(),
        st.none(),
        st.text(max_size=20),
        st.binary(max_size=5),
        st.lists(st.floats(allow_nan=False), max_size=5),
    ),
    lambda children: st.dictionaries(st.text(min_size=1, max_size=5), children, max_size=3),
    max_leaves=6,
)
steps = st.one_of(st.none(), st.integers(min_value=-5, max_value=50), st.text(max_size=3))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=st.lists(st.tuples(st.dictionaries(keys, values, max_size=6), steps), max_size=6))
def test_lenient_never_raises_and_finite_values_arrive(tmp_path, batches):
    logger, capture = make_logger(tmp_path, strict=False)
    for metrics, step in batches:
        logger.log_metrics(metrics, step=step)  # must not raise, whatever it is
    logger.finish()
    # Every finite float logged at an explicit step arrives unchanged, unless a later call
    # logged the same key again (the last value of a step wins).
    for index, (metrics, step) in enumerate(batches):
        if type(step) is not int:
            continue
        for key, value in metrics.items():
            if not (isinstance(key, str) and key and "/" not in key and type(value) is float):
                continue  # keys with "/" may also come out of a flattened nested dict
            if not math.isfinite(value):
                continue
            later = [m for m, _ in batches[index + 1 :] if key in {str(k) for k in m}]
            same_call = [k for k in metrics if k is not key and str(k) == key]
            if later or same_call:
                continue
            assert capture.rows[step][key] == value


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(metrics=st.dictionaries(keys, values, max_size=6), step=steps)
def test_strict_raises_only_metric_error(tmp_path, metrics, step):
    logger, _ = make_logger(tmp_path, strict=True)
    try:
        logger.log_metrics(metrics, step=step)
    except MetricError as exc:
        assert exc.reason
    finally:
        logger.finish()


def test_huge_dict_and_long_keys(tmp_path):
    logger, capture = make_logger(tmp_path, strict=False)
    huge = {f"layer_{i}/grad_norm": float(i) for i in range(100_000)}
    long_key = "a/" + "x" * 400
    logger.log_metrics(huge, step=0)
    logger.log_metrics({long_key: 1.5}, step=1)
    logger.finish()
    assert len(capture.rows[0]) == 100_000 and capture.rows[0]["layer_99999/grad_norm"] == 99999.0
    assert capture.rows[1] == {long_key: 1.5}  # trackers get the key unchanged


def test_same_key_as_scalar_then_string(tmp_path, otel_rl_warnings):
    logger, capture = make_logger(tmp_path, strict=False)
    logger.log_metrics({"status": 1.0}, step=0)
    logger.log_metrics({"status": "diverged"}, step=1)
    logger.log_metrics({"status": 2.0}, step=2)
    logger.finish()
    assert [capture.rows[s]["status"] for s in range(3)] == [1.0, "diverged", 2.0]


def test_strict_rejects_bad_step_and_none(tmp_path):
    logger, capture = make_logger(tmp_path, strict=True)
    with pytest.raises(MetricError, match="step must be an integer"):
        logger.log_metrics({"x": 1.0}, step="abc")
    with pytest.raises(MetricError, match="None skipped"):
        logger.log_metrics({"x": None}, step=0)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finish()
    assert capture.rows == {0: {"x": 1.0}}
