"""The scraper's own health as OTel metrics (``otel_rl.scrape.*``): each round's duration,
failed node scrapes, series parsed and nodes answering in the last round. Names, units,
descriptions and attributes: :mod:`otel_rl.core.catalogue` (docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.core import catalogue
from otel_rl.ray.scraper import Collection, RayNodeScraper

#: Round durations span a few ms (one local node) to the per-node timeout.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def install_scrape_telemetry(meter: Meter, scraper: RayNodeScraper) -> None:
    """Create the ``otel_rl.scrape.*`` instruments and record each round into them."""
    duration = catalogue.SCRAPE_DURATION.create(
        meter, explicit_bucket_boundaries_advisory=DURATION_BUCKETS
    )
    errors = catalogue.SCRAPE_ERRORS.create(meter)

    def record(collection: Collection) -> None:
        duration.record(collection.duration)
        for node, result in collection.failures.items():
            errors.add(1, {"node": node, "reason": str(result.kind)})

    def series(options: Any) -> Iterator[Observation]:
        yield Observation(scraper.stats["series"])

    def nodes(options: Any) -> Iterator[Observation]:
        last = scraper.last
        if last is not None:
            yield Observation(len(last.samples), {"state": "ok"})
            yield Observation(len(last.failures), {"state": "failed"})

    catalogue.SCRAPE_SERIES.create(meter, [series])
    catalogue.SCRAPE_NODES.create(meter, [nodes])
    scraper.add_listener(record)
