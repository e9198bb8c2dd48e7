"""Whatever a training loop logs, lenient mode never raises and strict mode raises MetricError."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_rl import Logger, MetricError
from otel_rl.exporters.base import TrackerExporter


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


@pytest.mark.slow
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


# ---- one bad key or value costs only itself (lenient) ------------------------------------------


class FloatRaisesKeyError:
    """A custom scalar whose ``__float__`` raises (seen with lazily-evaluated metric objects)."""

    def __float__(self):
        raise KeyError("missing")


class ShapeRaises:
    """An array-like whose ``.shape`` property raises (a tensor on a device that went away)."""

    @property
    def shape(self):
        raise RuntimeError("CUDA error: device-side assert triggered")

    def tolist(self):
        return [1.0]


class StrRaises:
    """A key object whose ``__str__`` raises."""

    def __str__(self):
        raise ValueError("no name")

    __repr__ = object.__repr__


def jsonl_logger(tmp_path, strict=False, **extra):
    cfg = {"log_dir": str(tmp_path / "logs"), "strict": strict,
           "export": {"spool": False, "on_full": "block"}, **extra}
    return Logger(cfg)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "otel_rl"]


def test_issue_example_keeps_loss_and_names_the_key(tmp_path, otel_rl_warnings):
    """``{"loss": 0.5, "tokens_seen": 2**1024}`` twice: ``loss`` arrives at both steps in JSONL and
    TensorBoard; one warning names ``tokens_seen`` (not ``<log_metrics>``)."""
    from testkit.readers import jsonl_rows, tensorboard_scalars

    logger = jsonl_logger(tmp_path, tensorboard_enabled=True)
    logger.log_metrics({"loss": 0.5, "tokens_seen": 2**1024}, step=0)
    logger.log_metrics({"loss": 0.25, "tokens_seen": 2**1024}, step=1)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [(0, {"loss": 0.5}), (1, {"loss": 0.25})]
    assert tensorboard_scalars(tmp_path / "logs" / "tensorboard")["loss"] == [(0, 0.5), (1, 0.25)]
    messages = warnings_of(otel_rl_warnings)
    assert messages == [
        "otel-rl: metric 'tokens_seen': value skipped: an integer of 1025 bits is too large for "
        "a float (largest about 1.8e308)"
    ]


@pytest.mark.parametrize(
    ("bad", "shown", "reason"),
    [
        ({"big": 10**400}, "'big'", "an integer of 1329 bits is too large for a float"),
        ({"neg": -(2**1024)}, "'neg'", "too large for a float"),
        ({"lazy": FloatRaisesKeyError()}, "'lazy'", "value skipped: KeyError: 'missing'"),
        ({"grad": ShapeRaises()}, "'grad'", "value skipped: RuntimeError: CUDA error"),
        ({StrRaises(): 1.0}, "'<StrRaises key>'", "key skipped: str() of the key raised"),
        ({"nested": {"ok": 2.0, "bad": 10**400}}, "'nested/bad'", "too large for a float"),
        ({"items": [1.0, 10**400]}, "'items'", "too large for a float"),
    ],
)
def test_each_bad_item_costs_only_itself(tmp_path, otel_rl_warnings, bad, shown, reason):
    from testkit.readers import jsonl_rows

    logger = jsonl_logger(tmp_path)
    for step in range(2):
        logger.log_metrics({"loss": 1.0 + step, **bad, "reward": 2.0 + step}, step=step)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    expected_extra = {"nested/ok": 2.0} if "nested" in bad else {}
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (step, {"loss": 1.0 + step, "reward": 2.0 + step, **expected_extra}) for step in range(2)
    ]
    messages = warnings_of(otel_rl_warnings)
    assert len(messages) == 1, messages  # the second call's identical problem is not repeated
    assert messages[0].startswith(f"otel-rl: metric {shown}: ") and reason in messages[0]
    assert "<log_metrics>" not in messages[0]


def test_a_second_bad_key_with_the_same_reason_still_warns(tmp_path, otel_rl_warnings):
    logger = jsonl_logger(tmp_path)
    logger.log_metrics({"a": None}, step=0)
    logger.log_metrics({"b": None}, step=1)
    logger.log_metrics({"a": None}, step=2)
    logger.finish()
    assert warnings_of(otel_rl_warnings) == [
        "otel-rl: metric 'a': value None skipped",
        "otel-rl: metric 'b': value None skipped",
    ]


# ---- strict mode --------------------------------------------------------------------------------


def test_strict_collision_refuses_the_call_and_leaves_no_empty_row(tmp_path):
    """A key that collides with an earlier one (both ``train_loss`` in Prometheus) is refused
    whole; the step it named gets no row, and what was logged before at a step stays."""
    from testkit.readers import jsonl_rows

    logger = jsonl_logger(tmp_path, strict=True)
    logger.log_metrics({"train/loss": 1.0}, step=0)
    with pytest.raises(MetricError, match="collides with 'train/loss'"):
        logger.log_metrics({"reward": 5.0, "train.loss": 2.0}, step=0)  # same step
    with pytest.raises(MetricError, match="collides with 'train/loss'"):
        logger.log_metrics({"train.loss": 3.0}, step=1)  # a new step
    logger.log_metrics({"train/loss": 4.0}, step=2)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (0, {"train/loss": 1.0}), (2, {"train/loss": 4.0}),
    ]


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"a": None}, "metric 'a': value None skipped"),
        ({"a": 2**1024}, "metric 'a': value skipped: an integer of 1025 bits is too large for a "
                         "float (largest about 1.8e308)"),
        ({"a": FloatRaisesKeyError()}, "metric 'a': value skipped: KeyError: 'missing'"),
        ({"a": {"b": None}}, "metric 'a/b': value None skipped"),
    ],
)
def test_strict_reasons_are_not_wrapped_twice(tmp_path, metrics, message):
    logger, capture = make_logger(tmp_path, strict=True)
    with pytest.raises(MetricError) as info:
        logger.log_metrics({"ok": 1.0, **metrics}, step=0)
    logger.finish()
    assert str(info.value) == message
    assert capture.rows == {}  # nothing of the refused call


@pytest.mark.parametrize(
    ("step", "reason"),
    [
        (8.9, "step must be a whole number, got 8.9"),
        (float("nan"), "step must be a whole number, got nan"),
        (True, "step must be an integer, got the boolean True"),
        ("3", "step must be an integer or None, got str '3'"),
    ],
)
def test_bad_steps_are_refused_with_a_clear_message(tmp_path, otel_rl_warnings, step, reason):
    from testkit.readers import jsonl_rows

    logger = jsonl_logger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 2.0}, step=step)  # lenient: warned, this call dropped
    logger.log_metrics({"loss": 3.0}, step=1)
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [(0, {"loss": 1.0}), (1, {"loss": 3.0})]
    (message,) = warnings_of(otel_rl_warnings)
    assert message.startswith(f"otel-rl: metric '<step>': {reason}")

    strict, capture = make_logger(tmp_path / "strict", strict=True)
    with pytest.raises(MetricError, match=reason.replace("(", r"\(")):
        strict.log_metrics({"loss": 2.0}, step=step)
    strict.finish()
    assert capture.rows == {}


def test_whole_float_and_numpy_integer_steps_are_accepted(tmp_path):
    np = pytest.importorskip("numpy")
    from testkit.readers import jsonl_rows

    logger = jsonl_logger(tmp_path, strict=True)
    logger.log_metrics({"loss": 1.0}, step=np.int64(4))
    logger.log_metrics({"loss": 2.0}, step=5.0)
    logger.log_metrics({"loss": 3.0}, step=np.float32(6.0))
    logger.log_metrics({"loss": 4.0}, step=np.uint8(7))
    logger.finish()
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["loss"]) for r in rows] == [(4, 1.0), (5, 2.0), (6, 3.0),
                                                                  (7, 4.0)]
    assert all(type(r["step"]) is int for r in rows)


def test_long_and_deep_keys_are_cut_in_messages(tmp_path, otel_rl_warnings):
    long_key = "k" * 10_000
    deep: dict = {"leaf": None}
    for _ in range(400):
        deep = {"level": deep}
    logger = jsonl_logger(tmp_path)
    logger.log_metrics({long_key: None, "deep": deep, "loss": 1.0}, step=0)
    logger.finish()
    messages = warnings_of(otel_rl_warnings)
    assert len(messages) == 2
    assert all(len(m) < 300 for m in messages), [len(m) for m in messages]
    assert messages[0] == f"otel-rl: metric {'k' * 120!r}… (10000 chars): value None skipped"
    assert "(2409 chars): value None skipped" in messages[1]  # "deep" + 400 x "/level" + "/leaf"

    strict, _ = make_logger(tmp_path / "strict", strict=True)
    with pytest.raises(MetricError) as info:
        strict.log_metrics({long_key: None}, step=0)
    strict.finish()
    assert len(str(info.value)) < 200 and info.value.key == long_key  # the key itself is whole


def test_warnings_stop_after_a_thousand_distinct_ones_and_the_values_still_arrive(
    tmp_path, otel_rl_warnings
):
    """Keys made unique per step (``sample/<uuid>``) must not grow the warning set or the log
    without bound: 1,000 distinct warnings, then one line saying the rest are silent."""
    from testkit.readers import jsonl_rows

    logger = jsonl_logger(tmp_path)
    for step in range(1005):
        logger.log_metrics({f"bad/{step}": None, "loss": float(step)}, step=step)
    logger.finish()
    messages = warnings_of(otel_rl_warnings)
    assert len(messages) == 1001
    assert messages[999] == "otel-rl: metric 'bad/999': value None skipped"
    assert messages[1000] == (
        "otel-rl: 1000 different metric warnings so far; further bad keys and values are "
        "skipped without a warning"
    )
    rows = jsonl_rows(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in rows] == [
        (step, {"loss": float(step)}) for step in range(1005)
    ]


# ---- property: good keys always arrive, whatever else is in the dict ---------------------------


BAD_VALUES = [
    2**1024, -(10**400), None, b"bytes", object(), [1.0, "x"], [], FloatRaisesKeyError(),
    ShapeRaises(), {"": 1.0},
]
good_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.booleans(),
    st.text(max_size=10),
)


def expected_row_value(value):
    return float(value) if isinstance(value, (bool, int, float)) else value


def test_lenient_good_keys_always_arrive_whatever_else_is_logged(tmp_path):
    """Property: for any dict of good and bad keys and values, in any order, lenient
    ``log_metrics`` never raises and every good key arrives with its value."""
    logger, capture = make_logger(tmp_path, strict=False)
    steps = iter(range(10**6))

    @settings(max_examples=200, deadline=None)
    @given(
        good=st.dictionaries(st.text(min_size=1, max_size=8).map(lambda s: f"good/{s}"),
                             good_values, max_size=6),
        bad=st.lists(st.sampled_from(range(len(BAD_VALUES))), max_size=5),
        bad_keys=st.integers(min_value=0, max_value=2),
        data=st.data(),
    )
    def check(good, bad, bad_keys, data):
        items = list(good.items())
        items += [(f"bad_{i}", BAD_VALUES[b]) for i, b in enumerate(bad)]
        items += [(StrRaises(), 1.0) for _ in range(bad_keys)]
        metrics = dict(data.draw(st.permutations(items)))
        step = next(steps)
        logger.log_metrics(metrics, step=step, step_finished=True)
        assert logger.flush(timeout=30)
        arrived = capture.rows.get(step, {})
        assert arrived == {k: expected_row_value(v) for k, v in good.items()}

    check()
    logger.finish()


# ---- a timer's name, a flush's timeout, the step after int64's top -----------------------------


def test_a_timer_whose_name_is_refused_costs_only_itself(tmp_path, otel_rl_warnings):
    """A timer's name is checked as a logged key's: another type becomes its text, a lone
    surrogate (no tracker can store it: TensorBoard refused the whole step) gives a timer that
    times nothing, a name whose OTel instrument is taken keeps its rows; each said, the loop
    never raises, and the step's other values arrive."""
    logger, capture = make_logger(tmp_path, strict=False)
    logger.log_metrics({"timing/z": 5.0}, step=0)  # a hand-written timing key, as NeMo RL logs
    with logger.timer(7):
        pass
    with logger.timer("bad\udc80"):
        pass
    with logger.timer("z"), logger.timer("ref-logprob"):
        pass
    with logger.timer("ref_logprob"):  # both are timing_ref_logprob to Prometheus
        pass
    with logger.timer(["unhashable"]):
        pass
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finish()
    row = capture.rows[1]
    assert row["loss"] == 1.0 and row["timing/7"] >= 0 and row["timing/['unhashable']"] >= 0
    assert all(row[f"timing/{name}"] >= 0 for name in ("z", "ref-logprob", "ref_logprob"))
    assert not any("\udc80" in key for key in row)
    said = otel_rl_warnings.text
    assert "converted to the string '7'" in said and "lone surrogate" in said
    assert "timing_ref_logprob" in said


def test_strict_refuses_a_timer_name_that_lenient_mode_converts(tmp_path):
    logger, _ = make_logger(tmp_path, strict=True)
    with pytest.raises(MetricError, match="converted to the string '7'"):
        logger.timer(7)
    with pytest.raises(MetricError, match="lone surrogate"):
        logger.timer("bad\udc80")
    logger.finish()


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_flush_with_no_end_in_sight_waits_as_long_as_it_takes_and_the_run_goes_on(
    tmp_path, delivery
):
    """``flush(float("inf"))`` is "as long as it takes" (it overflowed the clock: the delivery
    process died of it, thread mode raised it); NaN is no wait at all."""
    cfg = {"log_dir": str(tmp_path), "export": {"delivery": delivery}}
    with Logger(cfg) as logger:
        logger.log_metrics({"a": 0.0}, step=0)
        assert logger.flush(float("inf")) is True
        assert logger.flush(1e300) is True
        logger.flush(float("nan"))
        for step in range(1, 5):
            logger.log_metrics({"a": float(step)}, step=step)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["metrics"]["a"]) for r in rows] == [(s, float(s)) for s in range(5)]


@pytest.mark.parametrize("strict", [False, True])
def test_the_step_after_the_top_of_int64_is_refused_like_any_step_past_it(tmp_path, strict):
    logger, capture = make_logger(tmp_path, strict=strict)
    top = 2**63 - 1
    logger.log_metrics({"a": 1.0}, step=top, step_finished=True)
    if strict:
        with pytest.raises(MetricError, match="outside the signed 64-bit range"):
            logger.log_metrics({"b": 2.0})
    else:
        logger.log_metrics({"b": 2.0})
    logger.finish()
    assert capture.rows == {top: {"a": 1.0}}
