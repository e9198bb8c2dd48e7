"""otel_rl/core/catalogue.py is the one list of otel-rl's own metrics, and it is what runs serve.

- docs/metrics.md's tables are the ones generated from the catalogue;
- no code creates one of otel-rl's instruments with a literal name;
- a real run with everything on that can be on here (Prometheus, OTLP to a closed port, the Ray
  GPU bridge on the 8xH100 fixture and a dead node, steps, a timer, a NaN) serves on /metrics
  exactly the catalogue's series, each with the catalogue's ``# HELP``, ``# TYPE`` and labels;
- with ``otlp.semantic_conventions`` a real OTLP receiver gets the GPU metrics under the
  conventions' names, units, instruments, attributes and converted values, and otel-rl's names
  without it; Prometheus is the same either way;
- the conventions' names, units, instruments and descriptions in the catalogue are those of the
  installed ``opentelemetry-semantic-conventions``.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_rl import Logger
from otel_rl.core import catalogue
from otel_rl.core.catalogue import CATALOGUE, NAME, prometheus_family
from testkit.gpu_nodes import NodeFarm, SimulatedNode, render, simulated_node
from testkit.otlp_receiver import OtlpHttpReceiver, attributes_of, closed_port

ROOT = Path(__file__).resolve().parents[2]
SCOPE_LABELS = {"otel_scope_name", "otel_scope_version", "otel_scope_schema_url"}


def _generator() -> Any:
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_metrics_table
    finally:
        sys.path.remove(str(ROOT / "docs"))
    return gen_metrics_table


# ---- the docs and the code ---------------------------------------------------------------------


def test_docs_tables_are_the_generated_ones():
    gen = _generator()
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    fix = (
        "docs/metrics.md differs from otel_rl/core/catalogue.py: "
        "run python docs/gen_metrics_table.py"
    )
    assert gen.table_in(text, gen.METRICS) == gen.metrics_table(), fix
    assert gen.table_in(text, gen.SEMCONV) == gen.semconv_table(), fix
    rows = gen.metrics_table().splitlines()[2:]
    assert len(rows) == len(CATALOGUE) == 24
    assert (
        "| `otel_rl.steps` | `otel_rl_steps_total` | observable counter | `{step}` | — | "
        "training steps sealed so far; rate() is the training throughput | "
        "`prometheus` or `otlp` on |"
    ) in rows
    assert any(
        r.startswith("| `timing/<name>` | `timing_<name>_seconds_bucket`, `_sum`, `_count` |")
        for r in rows
    )
    semconv = gen.semconv_table()
    assert "| `ray.node.gpu.utilization` | [`hw.gpu.utilization`](" in semconv
    assert "÷ 100 (`%` → `1`)" in semconv


def test_docs_link_the_catalogue():
    assert "docs/metrics.md" in (ROOT / "README.md").read_text()
    outputs = (ROOT / "docs" / "outputs.md").read_text()
    assert "[metrics.md](metrics.md)" in outputs
    # outputs.md points at the catalogue instead of listing otel-rl's own series again
    assert "ray_node_gpu_utilization_percent" not in outputs


def test_no_instrument_of_ours_is_created_with_a_literal_name():
    names = {m.name for m in CATALOGUE}
    creators = {f"create_{kind}" for kind in (*catalogue.KINDS, "gauge", "up_down_counter")}
    creators.add("create_observable_up_down_counter")
    literal_calls, literal_names = [], []
    for path in sorted((ROOT / "otel_rl").rglob("*.py")):
        if path.name == "catalogue.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                literal_names.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in creators
                and node.args
                and isinstance(node.args[0], ast.Constant | ast.JoinedStr)
            ):
                literal_calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not literal_calls, f"instruments created with a literal name: {literal_calls}"
    assert not literal_names, f"catalogue names written out again: {literal_names}"


def test_semconv_entries_are_the_installed_conventions():
    from opentelemetry.metrics import ObservableGauge, UpDownCounter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.semconv._incubating.metrics import hw_metrics

    provider = MeterProvider(shutdown_on_exit=False)
    meter = provider.get_meter("conventions")
    kinds = {"gauge": ObservableGauge, "updowncounter": UpDownCounter}
    mapped = [m for m in CATALOGUE if m.semconv is not None]
    assert {m.semconv.name for m in mapped} == {
        "hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.power",
    }  # fmt: skip
    for metric in mapped:
        s = metric.semconv
        create = getattr(hw_metrics, "create_" + s.name.replace(".", "_"))
        takes_callbacks = "callbacks" in inspect.signature(create).parameters
        instrument = create(meter, []) if takes_callbacks else create(meter)
        assert instrument.name == s.name
        assert (instrument.unit, instrument.description) == (s.unit, s.description), s.name
        assert isinstance(instrument, kinds[s.kind]), s.name
    provider.shutdown()


# ---- one real /metrics page --------------------------------------------------------------------


def _families(text: str) -> dict[str, dict[str, Any]]:
    """``{name as served: {"help", "type", "labels", "samples"}}`` of a Prometheus page."""
    out: dict[str, dict[str, Any]] = {}
    for kind, name, rest in re.findall(r"^# (HELP|TYPE) (\S+) ?(.*)$", text, flags=re.M):
        out.setdefault(name, {"labels": set(), "samples": []})[kind.lower()] = rest
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            out[name]["labels"] |= set(sample.labels) - SCOPE_LABELS - {"le"}
            out[name]["samples"].append(sample)
    return out


def _entry_for(served: str) -> tuple[catalogue.Metric, str] | None:
    """The catalogue entry a served family is, and the family member's name (or "")."""
    for metric in CATALOGUE:
        pattern = re.escape(prometheus_family(metric)[0]).replace(re.escape(NAME), "(.+)")
        found = re.fullmatch(pattern, served)
        if found:
            return metric, found.group(1) if metric.is_family else ""
    return None


def _page(url: str, ready: Any, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        if ready(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"the page never got ready:\n{text}")


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_a_real_page_serves_exactly_the_catalogue(tmp_path):
    node = simulated_node(2)
    with NodeFarm() as farm:
        alive = farm.add(render(node))
        dead = farm.add(mode="refused")
        logger = Logger(
            {
                "log_dir": str(tmp_path),
                "capture_global_meters": False,
                "prometheus": {"enabled": True, "port": 0},
                "otlp": {
                    "enabled": True,
                    "endpoint": f"http://127.0.0.1:{closed_port()}",
                    "interval": 0.2,
                    "timeout": 0.5,
                },
                "monitor_gpus": True,
                "gpu_monitoring": {"endpoints": [alive, dead], "collection_interval": 0.2},
            }
        )
        try:
            for step in range(3):
                with logger.timer("generation"):
                    pass
                logger.log_metrics({"loss": 0.5, "kl": float("nan")}, step=step, prefix="train")
            logger.flush()

            def ready(text: str) -> bool:
                return all(
                    re.search(rf"^{name}(\{{[^}}]*\}})? [1-9]", text, flags=re.M)
                    for name in (
                        "otel_rl_otlp_export_failures_total", "otel_rl_scrape_errors_total",
                        "ray_node_gpu_power_watts", "otel_rl_step",
                    )
                )  # fmt: skip

            text = _page(logger.prometheus_url, ready)
        finally:
            logger.finish()

    families = _families(text)
    ours = {
        name: family
        for name, family in families.items()
        if any(s.labels.get("otel_scope_name", "").startswith("otel_rl") for s in family["samples"])
        and name != "train_loss"  # a logged key: the application's metric, not otel-rl's
    }
    seen: set[str] = set()
    for served, family in sorted(ours.items()):
        found = _entry_for(served)
        assert found is not None, f"{served} is served but not in otel_rl/core/catalogue.py"
        metric, member = found
        description = metric.member(member)[1] if metric.is_family else metric.description
        # a member's name is folded on the page ("/" → "_"); its description keeps the "/"
        assert family["help"].replace("/", "_") == description.replace("/", "_"), served
        assert family["type"] == prometheus_family(metric)[1], served
        optional = {a for a, _ in metric.optional_attributes}
        assert set(metric.attributes) <= family["labels"] <= set(metric.attributes) | optional, (
            served
        )
        seen.add(metric.name)
    missing = sorted({m.name for m in CATALOGUE} - seen)
    assert not missing, f"in the catalogue, not on the page of a run with everything on: {missing}"

    # The page's values are the run's, in the catalogue's units.
    assert _value(text, "otel_rl_steps_total") >= 2
    assert _value(text, "otel_rl_values_nonfinite_total") == 3
    assert _value(text, "timing_generation_seconds_count") == 3
    assert _value(text, "otel_rl_scrape_nodes", state="failed") == 1
    gpu = node.gpus[5]
    assert _value(text, "ray_node_gpu_utilization_percent", gpu="5") == gpu.utilization
    assert _value(text, "ray_node_gpu_power_watts", gpu="5") == gpu.power_mw / 1000
    assert families["otel_rl_exporter_dropped_total"]["help"].startswith("records lost for good")


# ---- semantic conventions on OTLP --------------------------------------------------------------

GPU_RENAMES = {
    "ray.node.gpu.utilization": "hw.gpu.utilization",
    "ray.node.gpu.memory.used": "hw.gpu.memory.usage",
    "ray.node.gpu.memory.total": "hw.gpu.memory.limit",
    "ray.node.gpu.power": "hw.power",
}


def _gpu_run(tmp_path: Path, node: SimulatedNode, semantic_conventions: bool) -> tuple[Any, str]:
    """A run with the GPU bridge on ``node``'s page, OTLP to a real receiver and Prometheus;
    returns the receiver (closed) and the last /metrics page."""
    receiver = OtlpHttpReceiver()
    names = ("hw.power", "ray.node.gpu.temperature") if semantic_conventions else GPU_RENAMES
    try:
        with NodeFarm() as farm:
            logger = Logger(
                {
                    "log_dir": str(tmp_path),
                    "capture_global_meters": False,
                    "prometheus": {"enabled": True, "port": 0},
                    "otlp": {
                        "enabled": True,
                        "endpoint": receiver.endpoint,
                        "interval": 0.2,
                        "semantic_conventions": semantic_conventions,
                    },
                    "monitor_gpus": True,
                    "gpu_monitoring": {
                        "endpoints": [farm.add(render(node))],
                        "collection_interval": 0.2,
                    },
                }
            )
            try:
                text = _page(logger.prometheus_url, lambda t: "ray_node_gpu_power_watts{" in t)
                deadline = time.monotonic() + 20
                while not set(names) <= receiver.names() and time.monotonic() < deadline:
                    time.sleep(0.1)
            finally:
                logger.finish()
    finally:
        receiver.close()
    return receiver, text


def _points(receiver: Any, name: str) -> dict[int, tuple[Any, Any]]:
    """``{gpu: (metric, point)}`` of the last point received for each GPU."""
    out: dict[int, tuple[Any, Any]] = {}
    for _, received, metric, point in receiver.points():
        if received == name:
            out[attributes_of(point.attributes)["gpu"]] = (metric, point)
    return out


def _prometheus_gpu(text: str) -> dict[str, dict[str, float]]:
    return {
        name: {labels["gpu"]: value for labels, value in _samples(text, name)}
        for name in ("ray_node_gpu_utilization_percent", "ray_node_gpu_memory_used_bytes")
    }


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def test_semantic_conventions_on_otlp_only(tmp_path):
    from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

    node = simulated_node(7)
    receiver, text = _gpu_run(tmp_path / "on", node, semantic_conventions=True)
    names = receiver.names()
    assert set(GPU_RENAMES.values()) <= names
    assert not set(GPU_RENAMES) & names  # renamed, not sent twice
    # what no convention defines keeps its name
    assert {"ray.node.gpu.temperature", "ray.node.memory.used", "otel_rl.scrape.nodes"} <= names

    utilization = _points(receiver, "hw.gpu.utilization")
    usage = _points(receiver, "hw.gpu.memory.usage")
    limit = _points(receiver, "hw.gpu.memory.limit")
    power = _points(receiver, "hw.power")
    assert sorted(utilization) == sorted(usage) == sorted(limit) == sorted(power) == list(range(8))
    for i, gpu in node.gpus.items():
        metric, point = utilization[i]
        assert (metric.unit, metric.WhichOneof("data")) == ("1", "gauge")
        assert metric.description == "Fraction of time spent in a specific task."
        assert point.as_double == gpu.utilization / 100
        assert attributes_of(point.attributes) == {
            "hw.id": f"node0.gpu{i}", "hw.model": gpu.device, "hw.gpu.task": "general",
            "node": 0, "host": "127.0.0.1", "gpu": i,
        }  # fmt: skip

        metric, point = usage[i]
        assert (metric.unit, metric.WhichOneof("data")) == ("By", "sum")
        assert metric.sum.is_monotonic is False
        assert metric.sum.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
        assert 0 < point.start_time_unix_nano < point.time_unix_nano
        assert point.as_double == gpu.used_mib * 2**20
        assert attributes_of(point.attributes)["hw.id"] == f"node0.gpu{i}"

        metric, point = limit[i]
        assert (metric.unit, metric.WhichOneof("data")) == ("By", "sum")
        assert point.as_double == (gpu.used_mib + gpu.available_mib) * 2**20

        metric, point = power[i]
        assert (metric.unit, metric.WhichOneof("data")) == ("W", "gauge")
        assert point.as_double == gpu.power_mw / 1000
        attributes = attributes_of(point.attributes)
        assert (attributes["hw.type"], attributes["hw.id"]) == ("gpu", f"node0.gpu{i}")
        assert "device" not in attributes

    # Prometheus keeps otel-rl's names, units and labels.
    served = _prometheus_gpu(text)
    assert served["ray_node_gpu_utilization_percent"] == {
        str(i): g.utilization for i, g in node.gpus.items()
    }
    assert served["ray_node_gpu_memory_used_bytes"]["3"] == node.gpus[3].used_mib * 2**20
    assert "hw_gpu" not in text and "hw_power" not in text and "hw_id" not in text


def test_without_semantic_conventions_otlp_keeps_otel_rl_names(tmp_path):
    node = simulated_node(7)
    receiver, text = _gpu_run(tmp_path / "off", node, semantic_conventions=False)
    names = receiver.names()
    assert set(GPU_RENAMES) <= names
    assert not {n for n in names if n.startswith("hw.")}
    metric, point = _points(receiver, "ray.node.gpu.utilization")[4]
    assert (metric.unit, metric.description) == ("%", "GPU utilization")
    assert point.as_double == node.gpus[4].utilization
    assert attributes_of(point.attributes)["device"] == node.gpus[4].device
    served = _prometheus_gpu(text)
    assert served["ray_node_gpu_utilization_percent"]["4"] == node.gpus[4].utilization


def test_semantic_conventions_is_a_bool_config_key():
    from otel_rl.config.loading import resolve_config
    from otel_rl.core.errors import ConfigError
    from otel_rl.telemetry.otlp import resolve_otlp

    assert resolve_config({})["otlp"]["semantic_conventions"] is False
    assert resolve_otlp({"semantic_conventions": True}, environ={}).semantic_conventions is True
    with pytest.raises(ConfigError, match="semantic_conventions"):
        resolve_config({"otlp": {"semantic_conventions": "yes"}})
