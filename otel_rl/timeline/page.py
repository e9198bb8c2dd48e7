"""One self-contained HTML page of a run's window: opens offline, no server, no CDN.

Drawn by Apache ECharts (its ``echarts.min.js`` is inlined from ``vendor/``, with its licence
beside it): a lane per process and thread with the window's spans (nested spans drawn thinner
inside their parent), step boundaries, stalls shaded from their start to the step that ended
them with the verdict on hover, the GPU bridge's utilisation per GPU below, and each step's
anatomy as a stacked bar. Hovering a span shows its name, duration and attributes.

The page says what it drew on its ``<body>`` (``data-lanes``, ``data-spans``, ``data-steps``,
``data-errors``), so that a browser test can count it against the trace file.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

from otel_rl.timeline.run_picture import RunPicture
from otel_rl.timeline.window import Window


def _echarts() -> str:
    return (
        resources.files("otel_rl.timeline")
        .joinpath("vendor/echarts.min.js")
        .read_text(encoding="utf-8")
    )


def page_data(picture: RunPicture, window: Window) -> dict[str, Any]:
    """What the page's script draws, as plain JSON."""
    used = sorted({s.lane for s in window.spans})
    row_of = {lane: row for row, lane in enumerate(used)}
    depth = depths(window)
    spans = [
        {
            "row": row_of[s.lane], "name": s.name, "start": s.start, "end": s.end,
            "depth": depth.get(s.span_id, 0), "step": s.step,
            "attributes": {str(k): v if isinstance(v, (str, int, float, bool)) else str(v)
                           for k, v in s.attributes.items()},
        }
        for s in window.spans
    ]  # fmt: skip
    phases = sorted({p for step in window.steps for p in step.anatomy})
    return {
        "title": f"{picture.log_dir}",
        "lanes": [picture.lanes[lane].label for lane in used],
        "spans": spans,
        "steps": [{"step": s.step, "start": s.start, "end": s.end} for s in window.steps],
        "stalls": [
            {
                "start": s.start,
                "end": s.end if s.end is not None else window.end,
                "verdict": s.verdict,
            }
            for s in window.stalls
        ],
        "gpus": window.gpus,
        "phases": phases,
        "anatomy": [[s.step, *(s.anatomy.get(p, 0.0) for p in phases)] for s in window.steps],
        "start": window.start,
        "end": window.end,
    }


def depths(window: Window) -> dict[str, int]:
    """Nesting depth of each span within its lane (a child's parent is in the same trace)."""
    parent = {s.span_id: s.parent_id for s in window.spans}
    lane = {s.span_id: s.lane for s in window.spans}
    depths: dict[str, int] = {}
    for span in window.spans:
        depth, up, seen = 0, span.parent_id, set()
        while up in parent and lane.get(up) == span.lane and up not in seen:
            seen.add(up)
            depth += 1
            up = parent[up]
        depths[span.span_id] = depth
    return depths


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
        title=title, echarts=_echarts(), data=data, script=_SCRIPT, time_spent=summary
    )


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 12px; color: #222; }}
h1 {{ font-size: 15px; margin: 0 0 8px; }}
.chart {{ width: 100%; }}
#legend {{ color: #555; margin: 4px 0 10px; }}
#time-spent {{ font: 12px ui-monospace, monospace; color: #333; margin-left: 12px; }}
</style></head>
<body data-lanes="0" data-spans="0" data-steps="0" data-errors="0">
<h1>{title}</h1>
<div id="legend"></div>
<div id="timeline" class="chart"></div>
<div id="gpus" class="chart"></div>
<div id="anatomy" class="chart" style="height:260px"></div>
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
  const rowHeight = 34;
  const timeline = document.getElementById("timeline");
  timeline.style.height = (RUN.lanes.length * rowHeight + 110) + "px";
  const last = RUN.steps.length ? RUN.steps[RUN.steps.length - 1].step : null;
  document.getElementById("legend").textContent =
    RUN.steps.length ? "steps " + RUN.steps[0].step + "\u2013" + last +
      " · " + RUN.spans.length + " spans on " + RUN.lanes.length + " lanes" +
      (RUN.stalls.length ? " · " + RUN.stalls.length + " stall(s), shaded" : "")
    : RUN.spans.length + " spans on " + RUN.lanes.length + " lanes";
  // One colour per name, the same for a span and the anatomy phase of that name.
  const names = Array.from(new Set(RUN.spans.map((s) => s.name).concat(RUN.phases)));
  const palette = ["#5470c6", "#91cc75", "#fac858", "#ee6666", "#73c0de", "#3ba272", "#fc8452",
                   "#9a60b4", "#ea7ccc", "#4b6584"];
  // A phase "train/worker_step" is the span "worker_step": coloured by the last part.
  const leaves = Array.from(new Set(names.map((n) => n.split("/").pop())));
  const colour = (name) => palette[leaves.indexOf(name.split("/").pop()) % palette.length];
  const digits = RUN.end - RUN.start < 1 ? 3 : 2;
  const drawn = new Set();
  const chart = echarts.init(timeline, null, {renderer: "canvas"});
  chart.setOption({
    animation: false,
    tooltip: {formatter: (p) => {
      if (p.seriesName === "stalls") return "<b>stall</b><br>" + esc(p.data.verdict);
      if (p.seriesName !== "spans") return "";
      const s = RUN.spans[p.dataIndex];
      let text = "<b>" + esc(s.name) + "</b> " + fmt(s.end - s.start) +
        (s.step === null ? "" : " · step " + s.step);
      for (const [k, v] of Object.entries(s.attributes)) text += "<br>" + esc(k) + ": " + esc(v);
      return text;
    }},
    dataZoom: [{type: "slider", filterMode: "weakFilter", height: 18, bottom: 8},
               {type: "inside", filterMode: "weakFilter"}],
    grid: {left: 280, right: 30, top: 30, bottom: 60},
    xAxis: {type: "value", min: RUN.start, max: RUN.end, name: "s",
            axisLabel: {formatter: (v) => v.toFixed(digits)}},
    yAxis: {type: "category", data: RUN.lanes, inverse: true,
            axisLabel: {width: 270, overflow: "truncate"}},
    series: [
      {name: "spans", type: "custom", encode: {x: [1, 2], y: 0}, progressive: 0,
       data: RUN.spans.map((s) => [s.row, s.start, s.end, s.depth]),
       renderItem: (params, api) => {
         drawn.add(params.dataIndex);
         const s = RUN.spans[params.dataIndex];
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
      {name: "steps", type: "line", data: [], markLine: {symbol: "none", silent: true, precision: 6,
        lineStyle: {color: "#888", type: "dashed"},
        label: {formatter: "{b}", position: "insideEndTop", fontSize: 10},
        data: RUN.steps.map((s) => ({name: "step " + s.step, xAxis: s.start}))}},
      {name: "stalls", type: "line", data: [], markArea: {
        itemStyle: {color: "rgba(220, 40, 40, 0.16)"}, label: {color: "#b00"},
        data: RUN.stalls.map((s) => [{name: "stall", xAxis: s.start, verdict: s.verdict},
                                     {xAxis: s.end}])}},
    ],
  });
  const gpuNames = Object.keys(RUN.gpus);
  const gpus = document.getElementById("gpus");
  if (gpuNames.length) {
    gpus.style.height = "220px";
    echarts.init(gpus).setOption({
      animation: false, title: {text: "GPU utilisation (%)", textStyle: {fontSize: 13}},
      tooltip: {trigger: "axis"}, legend: {top: 0, right: 0},
      grid: {left: 280, right: 30, top: 40, bottom: 30},
      xAxis: {type: "value", min: RUN.start, max: RUN.end,
              axisLabel: {formatter: (v) => v.toFixed(digits)}},
      yAxis: {type: "value", min: 0, max: 100},
      series: gpuNames.map((n) => ({name: n, type: "line", showSymbol: false,
                                    data: RUN.gpus[n]})),
    });
  }
  const anatomy = document.getElementById("anatomy");
  if (RUN.phases.length) {
    echarts.init(anatomy).setOption({
      animation: false, title: {text: "each step's anatomy (s)", textStyle: {fontSize: 13}},
      tooltip: {trigger: "axis", valueFormatter: (v) => fmt(v)}, legend: {top: 0, right: 0},
      grid: {left: 280, right: 30, top: 40, bottom: 30},
      dataset: {source: RUN.anatomy},
      xAxis: {type: "category", name: "step"}, yAxis: {type: "value"},
      series: RUN.phases.map((p, i) => ({name: p, type: "bar", stack: "phases",
                                         itemStyle: {color: colour(p)},
                                         encode: {x: 0, y: i + 1}})),
    });
  } else {
    anatomy.style.display = "none";
  }
  body.dataset.lanes = String(RUN.lanes.length);
  body.dataset.spans = String(drawn.size);
  body.dataset.steps = String(RUN.steps.length);
  body.dataset.stalls = String(RUN.stalls.length);
  body.dataset.gpus = String(gpuNames.length);
})();
"""
