"""The shipped Grafana dashboard read as data, its PromQL parsed, and the demo run whose
Prometheus endpoint it is checked against (with the Ray GPU bridge scraping the 8xH100 fixture)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.rollout_pages import PageServer

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "rl-training.json"
H100_FIXTURE = Path(__file__).parent / "fixtures" / "ray-2.60-8xh100-node.constructed.prom"

# Grafana leaves ``$1`` (label_replace's capture reference) alone: no variable starts with a digit.
_VARIABLE = re.compile(r"\$([A-Za-z_]\w*)|\$\{([A-Za-z_]\w*)\}")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel, rows included, and of every
    annotation (titled ``annotation: <name>``): the stalls on the time axis are queries too."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner["title"], target["expr"]
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            yield f"annotation: {annotation['name']}", annotation["expr"]


def variable_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["definition"] for v in dashboard["templating"]["list"]}


def concrete(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's variables replaced (``$__rate_interval`` and the template ones)."""

    def sub(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"unknown variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(sub, expr)


@dataclass(frozen=True)
class Selector:
    """A metric a query reads: an exact name, or a regex on ``__name__``."""

    name: str | None
    name_regex: str | None

    def matches(self, exposed: set[str]) -> bool:
        if self.name is not None:
            return self.name in exposed
        pattern = re.compile(self.name_regex or "")
        return any(pattern.fullmatch(n) for n in exposed)


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of a (concrete) PromQL expression, via a real PromQL parser."""
    import promql_parser

    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                found.append(Selector(node.name, None))
                return
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    found.append(Selector(None, matcher.value))

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


class FixtureNode(PageServer):
    """A Ray node's metrics endpoint on 127.0.0.1 serving the 8xH100 fixture text."""

    def __init__(self) -> None:
        super().__init__(H100_FIXTURE.read_text())
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"


def demo_run_config(
    log_dir: Path,
    gpu_endpoints: list[str],
    engines: list[str] = (),
    sd_file: Path | None = None,
) -> dict[str, Any]:
    """The demo's own config, serving /metrics on a free port, with GPU monitoring on; with
    ``engines``, rollout monitoring of those endpoints keeping ``sd_file`` for Prometheus."""
    from otel_rl.cli.demo import demo_config

    cfg = demo_config(log_dir, backends=["jsonl"], prometheus_port=0)
    cfg["monitor_gpus"] = True
    cfg["gpu_monitoring"] = {
        "endpoints": gpu_endpoints,
        "collection_interval": 0.2,
        "flush_interval": 1.0,
    }
    cfg["capture_global_meters"] = False
    if engines:
        cfg["rollout_monitoring"] = {
            "endpoints": list(engines),
            "collection_interval": 1.0,
            "sd_file": str(sd_file) if sd_file else None,
        }
    return cfg


def exposed_names(text: str) -> set[str]:
    """Sample names in Prometheus text (``x_bucket``, ``x_count``... as Prometheus stores them)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}
