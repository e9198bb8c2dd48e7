"""The scraper's own health as OTel metrics (``otel_rl.scrape.*``).

- ``otel_rl.scrape.duration`` (histogram, s): wall time of each round over all nodes.
- ``otel_rl.scrape.errors`` (counter, {node, reason}): failed node scrapes.
- ``otel_rl.scrape.series`` (gauge): series parsed in the latest round, all nodes together.
- ``otel_rl.scrape.nodes`` (gauge, {state="ok"|"failed"}): nodes in the latest round.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_rl.ray.scraper import Collection, RayNodeScraper

#: Round durations span a few ms (one local node) to the per-node timeout.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def install_scrape_telemetry(meter: Meter, scraper: RayNodeScraper) -> None:
    """Create the ``otel_rl.scrape.*`` instruments and record each round into them."""
    duration = meter.create_histogram(
        "otel_rl.scrape.duration",
        unit="s",
        description="wall time of one collection over all Ray nodes",
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )
    errors = meter.create_counter(
        "otel_rl.scrape.errors", unit="{error}", description="failed scrapes of a node"
    )

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

    meter.create_observable_gauge(
        "otel_rl.scrape.series", [series], unit="{series}", description="series in the last round"
    )
    meter.create_observable_gauge(
        "otel_rl.scrape.nodes", [nodes], unit="{node}", description="nodes in the last round"
    )
    scraper.add_listener(record)
