"""One self-contained HTML page of a run: opens offline, no server, no CDN.

Drawn by Apache ECharts (its ``echarts.min.js`` is inlined from ``vendor/``, with its licence
beside it). Above, every step of the run: its time, each step's anatomy phases stacked, stalls
and relaunches marked; a click on a step opens it (the step and its neighbours). Below, the
steps opened (first the window chosen): a lane per process and thread with their spans (nested
spans drawn thinner inside their parent; hover: name, duration, attributes), step boundaries,
stalls shaded with the verdict on hover, the GPU bridge's utilisation per GPU and each step's
anatomy as a stacked bar; then where the job's processes were, as the verdict says, and where
the run's time went.

The overview is per-step numbers; the page holds the spans of its window and of as many more
steps as fit in :data:`MORE_SPANS` (the slowest and their neighbours first, all of a short
run's), so that its size stays bounded however long the run. The page says what it drew on its
``<body>`` (``data-lanes``, ``data-spans``, ``data-steps``, ``data-window``,
``data-overview-steps``, ``data-places``, ``data-errors``), so that a browser test can count it
against the trace file.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

from otel_rl.timeline.run_picture import Places, RunPicture, Span
from otel_rl.timeline.window import AROUND, Window, overlapping, spans_of, stall_seconds

#: Spans the page holds beyond its window's (about 150 bytes each).
MORE_SPANS = 10_000


def _echarts() -> str:
    return (
        resources.files("otel_rl.timeline")
        .joinpath("vendor/echarts.min.js")
        .read_text(encoding="utf-8")
    )


def _r(seconds: float) -> float:
    return round(seconds, 6)


def page_data(picture: RunPicture, window: Window) -> dict[str, Any]:
    """What the page's script draws, as plain JSON."""
    more, held = _more(picture, window)
    spans = [*window.spans, *more]
    used = sorted({s.lane for s in spans})
    row_of = {lane: row for row, lane in enumerate(used)}
    depth = depths(spans)

    def span(s: Span) -> dict[str, Any]:
        return {"row": row_of[s.lane], "name": s.name, "start": _r(s.start), "end": _r(s.end),
                "depth": depth.get(s.span_id, 0), "step": s.step,
                "attributes": {str(k): v if isinstance(v, (str, int, float, bool)) else str(v)
                               for k, v in s.attributes.items()}}  # fmt: skip

    phases = sorted({p for step in picture.steps for p in step.anatomy})
    shown = overlapping([(window.start, window.end)]
                        + [(s.start, s.end) for s in picture.steps if s.step in held])
    first = picture.steps.index(window.steps[0]) if window.steps else 0
    stalls = [{"start": _r(s.start), "end": _r(s.start + stall_seconds(s, picture)),
               "verdict": s.verdict, "last_step": s.last_step}
              for s in picture.stalls]  # fmt: skip
    # every step: its number, start, end, launch, 1 when an earlier launch ran it too, 1 when
    # the page holds its spans, then its seconds in each phase
    overview = [[s.step, _r(s.start), _r(s.end), s.attempt, int(s.redone),
                 int(s.step in held or not picture.spans),
                 *(_r(s.anatomy.get(p, 0.0)) for p in phases)]
                for s in picture.steps]  # fmt: skip
    return {
        "title": f"{picture.log_dir}",
        "lanes": [picture.lanes[lane].label for lane in used],
        "spans": [span(s) for s in window.spans],
        "more": [span(s) for s in more],
        "steps": [{"step": s.step, "start": _r(s.start), "end": _r(s.end)} for s in window.steps],
        "stalls": stalls,
        "gpus": {name: [(_r(t), v) for t, v in points if shown(t, t)]
                 for name, points in picture.gpus.items()},
        "phases": phases,
        "overview": overview,
        "window": [first, first + len(window.steps) - 1] if window.steps else None,
        "start": window.start,
        "end": window.end,
    }


def _more(picture: RunPicture, window: Window) -> tuple[list[Span], set[int]]:
    """The spans of the run's other steps the page holds (the slowest steps and their neighbours
    first, while they fit in :data:`MORE_SPANS`), and every step whose spans it holds."""
    steps = picture.steps
    held = {s.step for s in window.steps}
    of_step: dict[int | None, list[Span]] = {}
    for span in spans_of(picture, [s for s in steps if s.step not in held]):
        of_step.setdefault(span.step, []).append(span)
    slowest = sorted(range(len(steps)), key=lambda i: -steps[i].seconds)
    nearby = (steps[j] for i in slowest
              for j in range(max(0, i - AROUND), min(len(steps), i + AROUND + 1)))  # fmt: skip
    more: list[Span] = []
    for step in nearby:
        if step.step in held:
            continue
        spans = of_step.get(step.step, [])
        if len(more) + len(spans) > MORE_SPANS:
            break
        held.add(step.step)
        more += spans
    return more, held


def depths(spans: Sequence[Span]) -> dict[str, int]:
    """Nesting depth of each span within its lane (a child's parent is in the same trace)."""
    parent = {s.span_id: s.parent_id for s in spans}
    lane = {s.span_id: s.lane for s in spans}
    depths: dict[str, int] = {}
    for span in spans:
        depth, up, seen = 0, span.parent_id, set()
        while up in parent and lane.get(up) == span.lane and up not in seen:
            seen.add(up)
            depth += 1
            up = parent[up]
        depths[span.span_id] = depth
    return depths


def _places_html(places: Sequence[Places]) -> str:
    """Where the job's processes were, a table for each time it is known."""
    tables = []
    for found in places:
        said = f"{found.when}: {found.sentence}" if found.sentence else found.when
        rows = "".join(f"<tr{' class=odd' if odd else ''}><td>{html.escape(name)}</td>"
                       f"<td>{html.escape(step)}</td><td>{html.escape(where)}</td></tr>"
                       for name, step, where, odd in found.processes)  # fmt: skip
        tables.append(f"<table><caption>where the job's processes were, {html.escape(said)}"
                      f"</caption><tr><th>process</th><th>last step</th><th>where</th></tr>"
                      f"{rows}</table>")  # fmt: skip
    return "\n".join(tables)


def render(picture: RunPicture, window: Window, time_spent: Sequence[str] = ()) -> str:
    """The page; ``time_spent``: lines on where the whole run's time went (``otel-rl why``'s),
    shown under the charts."""
    data = json.dumps(page_data(picture, window), separators=(",", ":"))
    # No "<" at all inside the script that holds the data ("</script>", "<!--<script>" and the
    # like change how HTML reads a script), whatever a span or a thread is called.
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(f"otel-rl timeline · {picture.log_dir}")
    summary = html.escape("\n".join(time_spent))
    return _TEMPLATE.format(
        title=title, echarts=_echarts(), data=data, script=_SCRIPT, time_spent=summary,
        places=_places_html(picture.places), count=sum(len(p.processes) for p in picture.places),
    )


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 12px; color: #222; }}
h1 {{ font-size: 15px; margin: 0 0 8px; }}
.chart {{ width: 100%; }}
#legend {{ color: #555; margin: 4px 0 10px; }}
#time-spent {{ font: 12px ui-monospace, monospace; color: #333; margin-left: 12px; }}
table {{ border-collapse: collapse; margin: 10px 12px; }}
caption {{ text-align: left; padding-bottom: 4px; }}
td, th {{ padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }}
tr.odd td {{ color: #b00; }}
</style></head>
<body data-lanes="0" data-spans="0" data-steps="0" data-errors="0" data-overview-steps="0"
 data-places="{count}">
<h1>{title}</h1>
<div id="overview" class="chart" style="height:200px"></div>
<div id="legend"></div>
<div id="timeline" class="chart"></div>
<div id="gpus" class="chart"></div>
<div id="anatomy" class="chart" style="height:260px"></div>
{places}
<pre id="time-spent">{time_spent}</pre>
<script>window.addEventListener("error", function () {{
  document.body.dataset.errors = String(Number(document.body.dataset.errors) + 1); }});</script>
<script>{echarts}</script>
<script>const RUN = {data};</script>
<script>{script}</script>
</body></html>
"""

_SCRIPT = r"""
(function () {
  const body = document.body;
  const fmt = (s) => s >= 1 ? s.toFixed(3) + " s" : (s * 1000).toFixed(2) + " ms";
  const entities = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"};
  const esc = (t) => String(t).replace(/[&<>"]/g, (c) => entities[c]);
  const rowHeight = 34, around = 2, phase = 6;  // phase: the first phase's column of a step
  const rows = RUN.overview, held = RUN.spans.concat(RUN.more);
  const at = (r) => String(r[0]);
  const range = (rs) => !rs.length ? "" : rs.length === 1 ? at(rs[0])
    : at(rs[0]) + "\u2013" + at(rs[rs.length - 1]);
  // One colour per name, the same for a span and the anatomy phase of that name.
  const names = Array.from(new Set(held.map((s) => s.name).concat(RUN.phases)));
  const palette = ["#5470c6", "#91cc75", "#fac858", "#ee6666", "#73c0de", "#3ba272", "#fc8452",
                   "#9a60b4", "#ea7ccc", "#4b6584"];
  // A phase "train/worker_step" is the span "worker_step": coloured by the last part.
  const leaves = Array.from(new Set(names.map((n) => n.split("/").pop())));
  const colour = (name) => palette[leaves.indexOf(name.split("/").pop()) % palette.length];
  const grid = {left: 280, right: 30, top: 40, bottom: 30};

  // Every step of the run, its phases stacked; a stall marked at the step it held up (one the
  // run died in: at its last step), a relaunch at the first step of the launch after it.
  const overview = echarts.init(document.getElementById("overview"));
  const marks = [];
  for (const s of RUN.stalls) {
    const r = rows.find((r) => s.last_step === null || r[0] > s.last_step) || rows[rows.length - 1];
    if (r) marks.push({name: "stall", xAxis: at(r), lineStyle: {color: "#d62728"}});
  }
  rows.forEach((r, i) => {
    if (i && r[3] !== rows[i - 1][3])
      marks.push({name: "relaunch", xAxis: at(r), lineStyle: {color: "#333"}});
  });
  const bars = RUN.phases.length
    ? RUN.phases.map((p, i) => ({name: p, type: "bar", stack: "step", large: true,
                                 itemStyle: {color: colour(p)},
                                 data: rows.map((r) => r[phase + i])}))
    : [{name: "step", type: "bar", large: true, data: rows.map((r) => r[2] - r[1])}];
  overview.setOption({
    animation: false,
    title: {text: "every step of the run (s): click one to open it", textStyle: {fontSize: 13}},
    tooltip: {trigger: "axis", formatter: (ps) => {
      const r = rows[ps[0].dataIndex];
      let text = "<b>step " + r[0] + "</b> " + fmt(r[2] - r[1]) +
        (r[3] > 1 ? " · launch " + r[3] : "") + (r[4] ? " (an earlier launch ran it too)" : "");
      for (const p of ps)
        if (p.seriesName !== "marks") text += "<br>" + esc(p.seriesName) + ": " + fmt(p.value);
      return text;
    }},
    legend: {top: 0, right: 0, data: bars.map((b) => b.name)},
    grid: {left: 280, right: 30, top: 40, bottom: 40},
    dataZoom: [{type: "inside"}, {type: "slider", height: 14, bottom: 4}],
    xAxis: {type: "category", name: "step", data: rows.map(at)},
    yAxis: {type: "value"},
    series: bars.concat([{id: "marks", name: "marks", type: "line", data: [],
      markLine: {symbol: "none", silent: true, label: {formatter: "{b}", fontSize: 10},
                 data: marks},
      markArea: {silent: true, itemStyle: {color: "rgba(84, 112, 198, 0.15)"}, data: []}}]),
  });
  body.dataset.overviewSteps = String(rows.length);

  const timeline = document.getElementById("timeline");
  const chart = echarts.init(timeline, null, {renderer: "canvas"});
  const gpuNames = Object.keys(RUN.gpus);
  const gpuBox = document.getElementById("gpus");
  if (gpuNames.length) gpuBox.style.height = "220px";
  const gpus = gpuNames.length ? echarts.init(gpuBox) : null;
  const anatomyBox = document.getElementById("anatomy");
  if (!RUN.phases.length) anatomyBox.style.display = "none";
  const anatomy = RUN.phases.length ? echarts.init(anatomyBox) : null;

  // The steps rows[lo..hi] (none: null), their spans, from start to end (seconds).
  function draw(lo, hi, spans, start, end) {
    const shown = lo === null ? [] : rows.slice(lo, hi + 1);
    const lanes = Array.from(new Set(spans.map((s) => s.row))).sort((a, b) => a - b);
    const rowOf = new Map(lanes.map((lane, i) => [lane, i]));
    const stalls = RUN.stalls.filter((s) => s.start <= end && s.end >= start);
    const digits = Math.min(6, Math.max(2, 2 - Math.floor(Math.log10(end - start || 1))));
    const axis = {type: "value", min: start, max: end,
                  axisLabel: {formatter: (v) => v.toFixed(digits)}};
    timeline.style.height = (lanes.length * rowHeight + 110) + "px";
    chart.resize();
    const drawn = new Set();
    chart.setOption({
      animation: false,
      tooltip: {formatter: (p) => {
        if (p.seriesName === "stalls") return "<b>stall</b><br>" + esc(p.data.verdict);
        if (p.seriesName !== "spans") return "";
        const s = spans[p.dataIndex];
        let text = "<b>" + esc(s.name) + "</b> " + fmt(s.end - s.start) +
          (s.step === null ? "" : " · step " + s.step);
        for (const [k, v] of Object.entries(s.attributes)) text += "<br>" + esc(k) + ": " + esc(v);
        return text;
      }},
      dataZoom: [{type: "slider", filterMode: "weakFilter", height: 18, bottom: 8},
                 {type: "inside", filterMode: "weakFilter"}],
      grid: {left: 280, right: 30, top: 30, bottom: 60},
      xAxis: Object.assign({name: "s"}, axis),
      yAxis: {type: "category", data: lanes.map((lane) => RUN.lanes[lane]), inverse: true,
              axisLabel: {width: 270, overflow: "truncate"}},
      series: [
        {name: "spans", type: "custom", encode: {x: [1, 2], y: 0}, progressive: 0,
         data: spans.map((s) => [rowOf.get(s.row), s.start, s.end, s.depth]),
         renderItem: (params, api) => {
           drawn.add(params.dataIndex);
           const s = spans[params.dataIndex];
           const a = api.coord([api.value(1), api.value(0)]);
           const b = api.coord([api.value(2), api.value(0)]);
           const full = api.size([0, 1])[1] * 0.8;
           const h = full * Math.pow(0.72, s.depth);
           const shape = echarts.graphic.clipRectByRect(
             {x: a[0], y: a[1] - h / 2, width: Math.max(1, b[0] - a[0]), height: h},
             {x: params.coordSys.x, y: params.coordSys.y,
              width: params.coordSys.width, height: params.coordSys.height});
           return shape && {type: "rect", shape: shape,
                            style: {fill: colour(s.name), stroke: "#fff", lineWidth: 0.5}};
         }},
        {name: "steps", type: "line", data: [], markLine: {
          symbol: "none", silent: true, precision: 6, lineStyle: {color: "#888", type: "dashed"},
          label: {formatter: "{b}", position: "insideEndTop", fontSize: 10},
          data: shown.map((r) => ({name: "step " + r[0], xAxis: r[1]}))}},
        {name: "stalls", type: "line", data: [], markArea: {
          itemStyle: {color: "rgba(220, 40, 40, 0.16)"}, label: {color: "#b00"},
          data: stalls.map((s) => [{name: "stall", xAxis: s.start, verdict: s.verdict},
                                   {xAxis: s.end}])}},
      ],
    }, true);
    if (gpus) gpus.setOption({
      animation: false, title: {text: "GPU utilisation (%)", textStyle: {fontSize: 13}},
      tooltip: {trigger: "axis"}, legend: {top: 0, right: 0}, grid: grid, xAxis: axis,
      yAxis: {type: "value", min: 0, max: 100},
      series: gpuNames.map((n) => ({name: n, type: "line", showSymbol: false,
        data: RUN.gpus[n].filter((p) => p[0] >= start && p[0] <= end)})),
    }, true);
    if (anatomy) anatomy.setOption({
      animation: false, title: {text: "each step's anatomy (s)", textStyle: {fontSize: 13}},
      tooltip: {trigger: "axis", valueFormatter: (v) => fmt(v)}, legend: {top: 0, right: 0},
      grid: grid, dataset: {source: shown.map((r) => [at(r)].concat(r.slice(phase)))},
      xAxis: {type: "category", name: "step"}, yAxis: {type: "value"},
      series: RUN.phases.map((p, i) => ({name: p, type: "bar", stack: "phases",
                                         itemStyle: {color: colour(p)}, encode: {x: 0, y: i + 1}})),
    }, true);
    overview.setOption({series: [{id: "marks", markArea: {data: shown.length
      ? [[{xAxis: at(shown[0])}, {xAxis: at(shown[shown.length - 1])}]] : []}}]});
    const redone = shown.filter((r) => r[4]), missing = shown.filter((r) => !r[5]);
    document.getElementById("legend").textContent =
      (shown.length ? "steps " + range(shown) + " · " : "") + spans.length + " spans on " +
      lanes.length + " lanes" + (stalls.length ? " · " + stalls.length + " stall(s), shaded" : "") +
      (redone.length ? " · an earlier launch ran steps " + range(redone) +
        " too: drawn as launch " + redone[redone.length - 1][3] + " ran them" : "") +
      (missing.length ? " · the spans of steps " + range(missing) + " are not in this page: " +
        "otel-rl timeline " + RUN.title + " --steps " + range(missing).replace("\u2013", "-") +
        " draws them" : "");
    body.dataset.lanes = String(lanes.length);
    body.dataset.spans = String(drawn.size);
    body.dataset.steps = String(shown.length);
    body.dataset.window = range(shown).replace("\u2013", "-");
    body.dataset.stalls = String(stalls.length);
    body.dataset.gpus = String(gpuNames.length);
  }

  // Step i and its neighbours, with a stall after the last of them (or, at the run's end, any
  // stall after it: the run died in it).
  function open(i) {
    const lo = Math.max(0, i - around), hi = Math.min(rows.length - 1, i + around);
    const last = rows[hi][0], start = rows[lo][1];
    const numbers = new Set(rows.slice(lo, hi + 1).map((r) => r[0]));
    let end = rows[hi][2];
    for (const s of RUN.stalls)
      if (s.last_step === last || (hi === rows.length - 1 && s.last_step > last) ||
          (s.start >= start && s.start <= end)) end = Math.max(end, s.end);
    draw(lo, hi, held.filter((s) => numbers.has(s.step)), start, end);
  }
  overview.getZr().on("click", (e) => {
    const point = [e.offsetX, e.offsetY];
    if (!overview.containPixel({gridIndex: 0}, point)) return;
    const i = Math.round(overview.convertFromPixel({gridIndex: 0}, point)[0]);
    if (i >= 0 && i < rows.length) open(i);
  });
  const [lo, hi] = RUN.window || [null, null];
  draw(lo, hi, RUN.spans, RUN.start, RUN.end);
})();
"""
