"""Plotly figures of epd_lab's measurements, and their export.

- `timeline`: per-request waterfalls (optionally with the request's critical path and its gaps on top) and
  per-stage distributions of the spans table (`epd_lab.trace.spans_frame`).
- `bandwidth`: GB/s against message size from `epd-lab bench transfer`'s JSON.
- `sweep`: a sweep's results table as a heatmap or lines.
- `split`: whether moving the encoder out pays, from `epd-lab bench e2e` grids (TTFT and throughput against the
  monolithic floor).
- `goodput`: `epd-lab sweep rates` runs: goodput against request rate and TTFT/TPOT Pareto fronts per topology.
- `runtime`: the model runtimes profiled (`epd-lab bench runtime`): wall against GPU busy per call.
- `report`: PNG through kaleido (local Chromium) and a self-contained offline HTML report.
- `tp`: a KV transfer plan between TP groups drawn: which prefill rank's head slice goes to which decode rank.
- `layout`: protocol structures drawn: which encoder wrote which byte range of the prefill's buffer, and
  the KV connector's block tables with their merged contiguous runs.
"""
from epd_lab.viz.bandwidth import bandwidth_curves, load_bench
from epd_lab.viz.goodput import (goodput_figure, goodput_gain, load_placements, load_rates, pareto_figure,
                                 pareto_front)
from epd_lab.viz.layout import block_runs, block_runs_frame, block_tables, buffer_layout, part_ranges
from epd_lab.viz.report import chromium_path, html_report, quantize_png, save_png, save_pngs, static_pngs
from epd_lab.viz.runtime import load_runtime, runtime_figure, runtime_frame
from epd_lab.viz.split import e2e_frame, load_e2e, split_figure, split_pays
from epd_lab.viz.sweep import sweep_heatmap, sweep_lines
from epd_lab.viz.tp import plan_figure
from epd_lab.viz.timeline import (STAGE_ORDER, critical_path_waterfall, request_spans, stage_color, stage_distributions,
                                  waterfall, waterfalls)

__all__ = ["STAGE_ORDER", "bandwidth_curves", "block_runs", "block_runs_frame", "block_tables", "buffer_layout",
           "chromium_path", "critical_path_waterfall", "e2e_frame", "goodput_figure", "goodput_gain", "html_report", "load_bench", "load_e2e",
           "load_placements", "load_rates", "load_runtime", "pareto_figure", "pareto_front", "part_ranges", "plan_figure", "request_spans", "runtime_figure", "runtime_frame", "quantize_png", "save_png", "save_pngs", "split_figure", "split_pays", "stage_color", "static_pngs",
           "stage_distributions", "sweep_heatmap", "sweep_lines", "waterfall", "waterfalls"]
