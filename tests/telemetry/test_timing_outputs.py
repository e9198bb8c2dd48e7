"""Timings reach OTLP and Prometheus as the values the trackers get, at the same steps.

A real Logger with the JSONL tracker, Prometheus on a free port and OTLP/HTTP to a receiver on
127.0.0.1 that decodes with opentelemetry-proto, runs 20 steps of timers and logged keys. A step's
``timing/<name>`` row holds the step's total seconds of that timer (one value per step, however
many times it ran in it), while OTLP and Prometheus get the histogram of every single use. So,
for each timer: the histogram's count is the uses per step times the steps whose row has the key,
its sum the sum of those rows; for a timer used once a step, the rows are the single durations
themselves: the histogram's min, max and buckets are theirs too. ``/metrics`` is scraped twice
before ``finish()``, each time after a step was logged and the run flushed: mid-run, where it
holds the rows up to that step (a timing counted at another step would show there), and after
the last step. The logged keys reach Prometheus (and OTLP) as gauges holding their last value.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from prometheus_client.parser import text_string_to_metric_families

from otel_rl import Logger
from testkit.otlp_receiver import OtlpHttpReceiver
from testkit.readers import rows_by_step

STEPS = 20
#: Steps after which ``/metrics`` is scraped (the run flushed first): one mid-run, the last.
SCRAPED_AT = (9, STEPS - 1)
#: Times each timer runs in a step where it runs at all.
USES = {"generation": 1, "train": 1, "forward": 1, "reward": 2, "eval": 1}
#: The logged keys checked as gauges: their OTLP name, and their Prometheus name.
GAUGES = ("train/loss", "train/kl", "train/reward/mean", "train/reward/min", "train/reward/max")


def eval_step(step: int) -> bool:
    """``eval`` runs in some steps only, the last one among them."""
    return step % 4 == 3


def pause(step: int, scale: float = 1.0) -> None:
    """0.5 to 3 ms, varying with the step: the durations fall into several buckets."""
    time.sleep(0.0005 * scale * (1 + step % 6))


def one_step(logger: Logger, step: int) -> None:
    with logger.timer("generation"):
        pause(step)
    with logger.timer("train"):
        with logger.timer("forward"):  # nested
            pause(step, 0.5)
        pause(step, 0.2)
    for _ in range(USES["reward"]):  # twice in every step
        with logger.timer("reward"):
            pause(step + 3, 0.3)
    if eval_step(step):
        with logger.timer("eval"):
            pause(step, 0.4)
    logger.log_metrics(
        {"loss": 1.0 / (step + 1), "kl": 0.01 * step, "reward": [float(step), -1.0, 2.0 * step]},
        step=step,
        prefix="train",
    )


@dataclass(frozen=True)
class Histogram:
    """One timer's histogram as an output holds it: totals and per-bucket counts (``bounds``
    are the upper bounds of all buckets but the last, which is unbounded)."""

    count: int
    sum: float
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    min: float = math.nan
    max: float = math.nan


def otlp_histogram(receiver: OtlpHttpReceiver, name: str, temporality: int) -> Histogram:
    """The metric ``name``'s histogram over every export: the last point of a cumulative
    series, the points of a delta one added up."""
    points = []
    for _, metric_name, metric, point in receiver.points():
        if metric_name == name:
            assert metric.WhichOneof("data") == "histogram"
            assert metric.histogram.aggregation_temporality == temporality
            points.append(point)
    assert points, f"no OTLP point for {name!r}"
    if temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE:
        points = [max(points, key=lambda p: p.time_unix_nano)]
    bounds = {tuple(p.explicit_bounds) for p in points}
    assert len(bounds) == 1
    return Histogram(
        count=sum(p.count for p in points),
        sum=math.fsum(p.sum for p in points),
        bounds=bounds.pop(),
        counts=tuple(map(sum, zip(*(p.bucket_counts for p in points), strict=True))),
        min=min(p.min for p in points),
        max=max(p.max for p in points),
    )


def prometheus_histogram(text: str, family_name: str) -> Histogram:
    """The histogram ``family_name`` of a ``/metrics`` page (one series)."""
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        samples = {s.name: s for s in family.samples if not s.name.endswith("_bucket")}
        buckets = sorted(
            (float(s.labels["le"]), s.value)
            for s in family.samples
            if s.name == f"{family_name}_bucket"
        )
        assert buckets[-1][0] == math.inf
        cumulative = [int(v) for _, v in buckets]
        return Histogram(
            count=int(samples[f"{family_name}_count"].value),
            sum=samples[f"{family_name}_sum"].value,
            bounds=tuple(b for b, _ in buckets[:-1]),
            counts=tuple(b - a for a, b in itertools.pairwise([0, *cumulative])),
        )
    raise AssertionError(f"{family_name} is not on the /metrics page")


def prometheus_gauges(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        if family.type == "gauge"
        for sample in family.samples
    }


def binned(values: list[float], bounds: tuple[float, ...]) -> tuple[int, ...]:
    """OTel's explicit buckets of ``values``: ``(-inf, b0], (b0, b1], ..., (b_last, +inf)``."""
    counts = [0] * (len(bounds) + 1)
    for value in values:
        counts[next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
    return tuple(counts)


@pytest.fixture
def receiver() -> Iterator[OtlpHttpReceiver]:
    receiver = OtlpHttpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``OTEL_*`` variable of the machine's: the config and the test's own decide."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    return monkeypatch


TEMPORALITIES = {
    "cumulative": AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE,
    "delta": AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA,
}


@pytest.mark.parametrize(
    ("temporality", "delivery"), [("cumulative", "thread"), ("delta", "process")]
)
def test_timings_reach_otlp_and_prometheus_as_the_trackers_rows_add_up(
    tmp_path: Path,
    receiver: OtlpHttpReceiver,
    otel_env: pytest.MonkeyPatch,
    temporality: str,
    delivery: str,
) -> None:
    # The OTLP exporter's temporality is the standard variable's (cumulative when unset).
    otel_env.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", temporality)
    logger = Logger({
        "log_dir": str(tmp_path),
        "jsonl_enabled": True,
        "capture_global_meters": False,
        "prometheus": {"enabled": True, "port": 0},
        # Several exports within the run: the histograms are merged over them.
        "otlp": {"enabled": True, "endpoint": receiver.endpoint, "interval": 0.05,
                 "timeout": 2.0},
        "export": {"delivery": delivery},
    })  # fmt: skip
    scraped: dict[int, str] = {}
    try:
        url = logger.prometheus_url
        assert url is not None
        for step in range(STEPS):
            one_step(logger, step)
            if step in SCRAPED_AT:
                assert logger.flush(timeout=30)
                with urllib.request.urlopen(url, timeout=5) as page:
                    scraped[step] = page.read().decode()
    finally:
        logger.finish()

    rows = rows_by_step(tmp_path / "metrics.jsonl")
    assert sorted(rows) == list(range(STEPS))
    timed_exports = [
        item
        for item in receiver.received
        if any(
            metric.name == "timing/generation"
            for rm in item.request.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        )
    ]
    assert len(timed_exports) >= 2  # exports during the run, and the last at finish()
    for name, uses in USES.items():
        key = f"timing/{name}"
        # The trackers' rows: one value per step, at the steps the timer ran in.
        at = [s for s in range(STEPS) if key in rows[s]]
        assert at == [s for s in range(STEPS) if name != "eval" or eval_step(s)], name
        values = [rows[s][key] for s in at]
        assert all(type(v) is float and v > 0 for v in values), (name, values)

        otlp = otlp_histogram(receiver, key, TEMPORALITIES[temporality])
        assert otlp.count == uses * len(values), name
        assert otlp.sum == pytest.approx(math.fsum(values), rel=1e-9, abs=0), name
        if uses == 1:  # each row is one duration: the histogram is exactly theirs
            assert (otlp.min, otlp.max) == (min(values), max(values)), name
            assert otlp.counts == binned(values, otlp.bounds), name

        for last, text in scraped.items():
            up_to = [rows[s][key] for s in at if s <= last]
            prometheus = prometheus_histogram(text, f"timing_{name}_seconds")
            assert prometheus.count == uses * len(up_to), (name, last)
            assert prometheus.sum == pytest.approx(math.fsum(up_to), rel=1e-9, abs=0), (name, last)
            assert prometheus.bounds == otlp.bounds, name
            if last == STEPS - 1:  # nothing was recorded after the last scrape
                assert prometheus.counts == otlp.counts, name
            elif uses == 1:
                assert prometheus.counts == binned(up_to, otlp.bounds), (name, last)

    # Logged keys: gauges with the last value logged, on both outputs.
    last_row: dict[str, Any] = rows[STEPS - 1]
    assert last_row["train/loss"] == 1.0 / STEPS
    assert last_row["train/reward/max"] == 2.0 * (STEPS - 1)
    for when, text in scraped.items():
        gauges = prometheus_gauges(text)
        for key in GAUGES:
            assert gauges[key.replace("/", "_")] == rows[when][key], (key, when)
    for key in GAUGES:
        assert receiver.last_point(key).as_double == last_row[key], key
