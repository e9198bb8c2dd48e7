"""Read vLLM (V1 and V0) and SGLang ``/metrics`` pages into per-engine samples.

A page is parsed with ``prometheus_client.parser`` and boiled down to the few series the rollout
rows need, each under an engine-neutral *role* (``gen_tokens``, ``running``, ``ttft``, ...). The
source names per engine kind come from the engines' own metric definitions:

* vLLM V1: ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py`` (every series labelled
  ``model_name`` and ``engine``; one API server may front several engines, ``engine="0"``,
  ``"1"``, ... with data parallelism, and each is an engine here);
* vLLM V0: ``Metrics`` in ``vllm/engine/metrics.py`` (labelled ``model_name`` only; names such as
  ``vllm:gpu_cache_usage_perc``, ``vllm:num_requests_swapped``,
  ``vllm:avg_generation_throughput_toks_per_s`` only exist there);
* SGLang: ``SchedulerMetricsCollector`` / ``TokenizerMetricsCollector`` in
  ``python/sglang/srt/metrics/collector.py`` (one server = one engine; scheduler gauges are
  written by the ``tp_rank="0"`` scheduler of each data-parallel rank).

Where a name changed between releases the roles list the alternatives, newest first; the first
one present on the page is used.

vLLM engines inside Ray actors can forward the same series to Ray instead
(``vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger``); :func:`parse_ray_node_page` reads them
from a Ray node's metrics page, where each is renamed ``ray_`` + the vLLM name with every character
outside ``[A-Za-z0-9_]`` turned into ``_`` (``vllm:num_requests_running`` becomes
``ray_vllm_num_requests_running``) and tagged with the recording process's ``WorkerId``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

#: Engine kinds a page can be recognised as (``auto`` picks one of these per page).
KINDS = ("vllm-v1", "vllm-v0", "sglang")
#: Accepted values of ``rollout_monitoring.engine``.
ENGINE_CHOICES = ("auto", "vllm", *KINDS)

#: Names that only vLLM's V0 engine exposes (``vllm/engine/metrics.py``); their presence makes a
#: ``vllm:`` page a V0 page.
V0_ONLY = frozenset(
    {
        "vllm:num_requests_swapped",
        "vllm:cpu_cache_usage_perc",
        "vllm:cpu_prefix_cache_hit_rate",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:avg_prompt_throughput_toks_per_s",
        "vllm:avg_generation_throughput_toks_per_s",
    }
)

_VLLM_COUNTERS: dict[str, tuple[str, ...]] = {
    "gen_tokens": ("vllm:generation_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    # Summed over every finished_reason (stop, length, abort, error, ...).
    "requests_finished": ("vllm:request_success_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    # Token-weighted prefix-cache counters; releases before ~0.10 called them gpu_prefix_cache_*.
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
}
_VLLM_GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # V0 only: a gauge of the block hit rate since the engine started.
    "prefix_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
}
_VLLM_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
}

_SGLANG_COUNTERS: dict[str, tuple[str, ...]] = {
    # Both token counters are incremented once per request, when it finishes.
    "gen_tokens": ("sglang:generation_tokens_total",),
    "prompt_tokens": ("sglang:prompt_tokens_total",),
    "requests_finished": ("sglang:num_requests_total",),
    # Newer releases only; older ones have just the per-log gauge sglang:num_retracted_reqs,
    # which is reset at every scheduler log and cannot be turned into a count per step.
    "preemptions": ("sglang:num_retracted_requests_total",),
    "prefix_hits": ("sglang:cached_tokens_total",),
    "prefix_queries": ("sglang:prompt_tokens_total",),
}
_SGLANG_GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("sglang:num_running_reqs",),
    "waiting": ("sglang:num_queue_reqs",),
    "kv_usage": ("sglang:token_usage",),
}
_SGLANG_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("sglang:time_to_first_token_seconds",),
    "e2e": ("sglang:e2e_request_latency_seconds",),
}

#: kind -> (counters, gauges, histograms): role -> source names, preferred first.
SOURCES: dict[str, tuple[dict[str, tuple[str, ...]], ...]] = {
    "vllm-v1": (_VLLM_COUNTERS, _VLLM_GAUGES, _VLLM_HISTOGRAMS),
    "vllm-v0": (_VLLM_COUNTERS, _VLLM_GAUGES, _VLLM_HISTOGRAMS),
    "sglang": (_SGLANG_COUNTERS, _SGLANG_GAUGES, _SGLANG_HISTOGRAMS),
}

#: Roles each kind is expected to have: a page lacking one gets a warning (an older engine).
EXPECTED_ROLES: dict[str, frozenset[str]] = {
    "vllm-v1": frozenset({*_VLLM_COUNTERS, "running", "waiting", "kv_usage", *_VLLM_HISTOGRAMS}),
    "vllm-v0": frozenset(
        {"gen_tokens", "prompt_tokens", "requests_finished", "preemptions", "running", "waiting"}
        | {"kv_usage", *_VLLM_HISTOGRAMS}
    ),
    "sglang": frozenset({*_SGLANG_COUNTERS, *_SGLANG_GAUGES, *_SGLANG_HISTOGRAMS}),
}


class NotAnEnginePage(ValueError):
    """The page holds no metrics of the expected inference engine."""


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram: finite upper bounds, and counts for each bound then ``+Inf``."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]  # len(bounds) + 1, the last is the +Inf bucket (= _count)


#: One labelled series of a metric: its labels, sorted.
SeriesKey = tuple[tuple[str, str], ...]


@dataclass
class EngineSample:
    """What one engine showed in one scrape, by role. ``sources`` names the metric used.

    A counter's value is the sum of its labelled series (``finished_reason``, ...);
    ``series`` keeps each one, as a counter reset shows in a series and not always in the
    sum."""

    kind: str
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    series: dict[str, dict[SeriesKey, float]] = field(default_factory=dict)

    def roles(self) -> set[str]:
        return set(self.counters) | set(self.gauges) | set(self.histograms)


def _sample_lines(text: str) -> list[tuple[str, str]]:
    """``(metric name, line)`` for every sample line of the engines' families."""
    out = []
    for line in text.splitlines():
        if not line.startswith(("vllm:", "sglang:")):
            continue  # comments, blank lines, python_*/process_*/http_* families
        cut = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < cut:
                cut = i
        out.append((line[:cut], line))
    return out


def detect_kind(names: Iterable[str]) -> str | None:
    """``vllm-v1``, ``vllm-v0`` or ``sglang`` from the sample names on a page; ``None`` if
    neither engine's names are there."""
    vllm = sglang = False
    v0 = False
    for name in names:
        if name.startswith("vllm:"):
            vllm = True
            if name in V0_ONLY:
                v0 = True
        elif name.startswith("sglang:"):
            sglang = True
    if vllm:
        return "vllm-v0" if v0 else "vllm-v1"
    if sglang:
        return "sglang"
    return None


def parse_engine_page(text: str, engine: str = "auto") -> dict[str | None, EngineSample]:
    """The engines on one ``/metrics`` page, keyed by their ``engine`` label (vLLM V1 with
    several engines behind one server) or ``None`` (one engine per page).

    ``engine`` is ``auto`` (recognise the kind from the names), ``vllm`` (V1 or V0 by the names),
    or one of :data:`KINDS`. Raises :class:`NotAnEnginePage` when the page has none of the
    expected names and ``ValueError`` when it is not Prometheus text.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, not {engine!r}")
    lines = _sample_lines(text)
    found = detect_kind(name for name, _ in lines)
    if engine in ("auto", "vllm"):
        kind = found
        if kind is None or (engine == "vllm" and not kind.startswith("vllm")):
            wanted = "vLLM or SGLang" if engine == "auto" else "vLLM"
            raise NotAnEnginePage(f"no {wanted} metrics on the page")
    else:
        kind = engine
        if found is None or found.split("-")[0] != kind.split("-")[0]:
            raise NotAnEnginePage(f"no {kind} metrics on the page (found: {found or 'none'})")
    counters, gauges, histograms = SOURCES[kind]
    wanted_names = {n for table in (counters, gauges) for names in table.values() for n in names}
    hist_names = {n for names in histograms.values() for n in names}
    # Only the sample lines of the series used go to the parser, without their # HELP/# TYPE
    # lines: each then parses as an untyped one-sample family under its own sample name, which
    # is all that is read below. A vLLM page has ~360 engine samples and ~1,000 lines; this
    # leaves ~70, and label parsing dominates the cost of a round.
    keep = wanted_names | {n + "_bucket" for n in hist_names}
    picked = "\n".join(line for name, line in lines if name in keep) + "\n"
    samples = [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(picked)
        for s in f.samples
    ]  # fmt: skip

    def key_of(labels: Mapping[str, str]) -> str | None:
        return labels.get("engine") if kind == "vllm-v1" else None

    result = _engine_samples(kind, samples, key_of)
    if not result:
        raise NotAnEnginePage(f"no {kind} series the rollout rows use on the page")
    return result


def ray_series_name(name: str) -> str:
    """The name a vLLM series gets on a Ray node's page when vLLM's Ray stat logger forwards it:
    the logger replaces what OpenTelemetry refuses in a name (``:``) by ``_`` and Ray prefixes
    ``ray_``; a counter keeps its ``_total``."""
    return "ray_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _ray_names() -> dict[str, str]:
    """Ray-forwarded name -> vLLM name, for every series the rows use (histograms by their
    ``_bucket`` series). Ray releases before its OpenTelemetry recorder exported a counter
    without the ``_total`` suffix; both spellings are read."""
    counters, gauges, histograms = SOURCES["vllm-v1"]
    names: dict[str, str] = {}
    for table in (counters, gauges):
        for alternatives in table.values():
            for name in alternatives:
                names[ray_series_name(name)] = name
                if table is counters and name.endswith("_total"):
                    names[ray_series_name(name[: -len("_total")])] = name
    for alternatives in histograms.values():
        for name in alternatives:
            names[ray_series_name(name) + "_bucket"] = name + "_bucket"
    return names


_RAY_NAMES = _ray_names()


def ray_engine_key(labels: Mapping[str, str]) -> str:
    """Which engine a Ray-forwarded series belongs to on one node: the Ray worker process that
    recorded it (``WorkerId``; an actor restarted by Ray gets a new one), vLLM's own ``engine``
    label (several engines behind one ``AsyncLLM`` with data parallelism), and Ray Serve's
    ``ReplicaId`` when set."""
    parts = [f"worker={labels.get('WorkerId', '')[:12]}", f"engine={labels.get('engine', '')}"]
    if labels.get("ReplicaId"):
        parts.append(f"replica={labels['ReplicaId']}")
    return " ".join(parts)


def parse_ray_node_page(text: str) -> dict[str, EngineSample]:
    """The vLLM engines whose metrics a Ray node's ``/metrics`` page carries, keyed by
    :func:`ray_engine_key`; ``{}`` when it carries none (a node without engines, or engines
    without the Ray stat logger). Raises ``ValueError`` when the page is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    picked = []
    for line in text.splitlines():
        if not line.startswith("ray_vllm"):
            continue
        cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        if line[:cut] in _RAY_NAMES:
            picked.append(line)
    if not picked:
        return {}
    samples = [
        (_RAY_NAMES[s.name], s.labels, s.value)
        for f in text_string_to_metric_families("\n".join(picked) + "\n")
        for s in f.samples
        if s.name in _RAY_NAMES
    ]
    return {
        str(key): sample
        for key, sample in _engine_samples("vllm-v1", samples, ray_engine_key).items()
    }


def _engine_samples(
    kind: str,
    samples: Iterable[tuple[str, Mapping[str, str], float]],
    key_of: Callable[[Mapping[str, str]], str | None],
) -> dict[str | None, EngineSample]:
    """``(name, labels, value)`` samples of ``kind``'s series, summed per engine key into
    one :class:`EngineSample` per engine."""
    counters, gauges, histograms = SOURCES[kind]
    wanted_names = {n for table in (counters, gauges) for names in table.values() for n in names}
    counter_names = {n for names in counters.values() for n in names}
    hist_names = {n for names in histograms.values() for n in names}
    # name -> engine key -> summed value (counters/gauges) or le -> summed cumulative count.
    scalar: dict[str, dict[str | None, float]] = {}
    buckets: dict[str, dict[str | None, dict[float, float]]] = {}
    # counter name -> engine key -> series -> value
    series: dict[str, dict[str | None, dict[SeriesKey, float]]] = {}
    order: list[str | None] = []
    for name, labels, value in samples:
        key = key_of(labels)
        if kind == "sglang" and (
            labels.get("tp_rank", "0") != "0" or labels.get("pp_rank", "0") != "0"
        ):
            continue  # other TP/PP ranks repeat or split rank 0's view; see docs
        if name in wanted_names:
            if not _finite(value):
                continue
            per = scalar.setdefault(name, {})
            per[key] = per.get(key, 0.0) + float(value)
            if name in counter_names:
                one = series.setdefault(name, {}).setdefault(key, {})
                labelled = tuple(sorted(labels.items()))
                one[labelled] = one.get(labelled, 0.0) + float(value)
        elif name.endswith("_bucket") and name[: -len("_bucket")] in hist_names:
            le = _le(labels.get("le"))
            if le is None or not _finite(value, allow_inf=False):
                continue
            per_engine = buckets.setdefault(name[: -len("_bucket")], {}).setdefault(key, {})
            per_engine[le] = per_engine.get(le, 0.0) + float(value)
        else:
            continue
        if key not in order:
            order.append(key)

    result: dict[str | None, EngineSample] = {}
    for key in order:
        sample = EngineSample(kind)
        for target, table in ((sample.counters, counters), (sample.gauges, gauges)):
            for role, names in table.items():
                for name in names:
                    if key in scalar.get(name, {}):
                        target[role] = scalar[name][key]
                        sample.sources[role] = name
                        if name in series:
                            sample.series[role] = series[name][key]
                        break
        for role, names in histograms.items():
            for name in names:
                by_le = buckets.get(name, {}).get(key)
                if by_le and math.inf in by_le:
                    bounds = tuple(sorted(le for le in by_le if le != math.inf))
                    counts = (*(by_le[le] for le in bounds), by_le[math.inf])
                    sample.histograms[role] = Histogram(bounds, counts)
                    sample.sources[role] = name
                    break
        result[key] = sample
    return result


def _le(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)  # "+Inf" parses to inf
    except ValueError:
        return None


def _finite(value: float, allow_inf: bool = False) -> bool:
    return not math.isnan(value) and (allow_inf or not math.isinf(value))
