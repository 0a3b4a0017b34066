"""Bandwidth against message size, from `epd-lab bench transfer`'s JSON (``data/bench/transfer.json``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import plotly.graph_objects as go

from epd_lab.viz.timeline import stage_color

RESULTS = Path(__file__).resolve().parents[2] / "data" / "bench"  # the committed benchmark JSON
BENCH_JSON = RESULTS / "transfer.json"
LIMIT_PATH = "memcpy"  # one thread copying within one process: the ceiling for every path on this host
# The engine's paths first, then the baselines it is measured against.
_COLORS = {"shm": "#FF7F0E", "shm_registered": "#D62728", "tcp": "#2CA02C", "verbs": "#9467BD",
           "mooncake": "#1F77B4", "socket": "#8C564B", "zmq": "#E377C2", "zmq_pickle": "#BCBD22"}


def load_bench(path: str | Path = BENCH_JSON) -> dict[str, Any]:
    """The benchmark's JSON: ``machine``, ``created``, ``rows`` (path/size/blocks/gbps/gbps_min/gbps_max...)."""
    bench = json.loads(Path(path).read_text())
    if "rows" not in bench:
        raise ValueError(f"{path}: no 'rows'; not the output of `epd-lab bench transfer`")
    return bench


def _size_label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def bandwidth_curves(bench: Mapping[str, Any], log_y: bool = True, limit: str = LIMIT_PATH) -> go.Figure:
    """GB/s against message size (log x), one line per path of contiguous writes (``blocks == 1``), error
    bars from the fastest to the slowest repeat, and the `limit` path drawn dashed (memcpy; ``d2d``, the
    in-process device-to-device copy, for `bench transfer --device cuda`)."""
    rows = [r for r in bench["rows"] if r.get("blocks", 1) == 1 and r.get("gbps") is not None]
    if not rows:
        raise ValueError("no contiguous rows (blocks == 1) with a gbps in the benchmark")
    paths = list(dict.fromkeys(r["path"] for r in rows))  # in the benchmark's order
    fig = go.Figure()
    for path in paths:
        pts = sorted((r for r in rows if r["path"] == path), key=lambda r: r["size"])
        gbps = [r["gbps"] for r in pts]
        lo, hi = [r.get("gbps_min", r["gbps"]) for r in pts], [r.get("gbps_max", r["gbps"]) for r in pts]
        is_limit = path == limit
        fig.add_trace(go.Scatter(
            x=[r["size"] for r in pts], y=gbps, mode="lines+markers", name=f"{path} (limit)" if is_limit else path,
            line=dict(color="#444444", dash="dash", width=2) if is_limit else
            dict(color=_COLORS.get(path) or stage_color(path), width=2),
            marker=dict(symbol="diamond-open" if is_limit else "circle", size=7),
            error_y=dict(type="data", symmetric=False, thickness=1, array=[h - g for h, g in zip(hi, gbps)],
                         arrayminus=[g - m for g, m in zip(gbps, lo)]),
            customdata=[[_size_label(r["size"]), m, h, r.get("repeats")] for r, m, h in zip(pts, lo, hi)],
            hovertemplate=f"<b>{path}</b> %{{customdata[0]}}<br>median %{{y:.2f}} GB/s<br>"
                          "min %{customdata[1]:.2f}, max %{customdata[2]:.2f} over %{customdata[3]} repeats"
                          "<extra></extra>",
        ))
    sizes = sorted({r["size"] for r in rows})
    machine = bench.get("machine", {})
    if machine.get("gpu"):
        where = [f"{machine.get('gpu_count', 1)} x {machine['gpu']}"]
    else:
        where = [str(machine["cpu"])] if "cpu" in machine else []
        where += [f"{machine['cores']} cores"] if "cores" in machine else []
    fig.update_layout(
        title="one-sided write bandwidth by message size" + (f" ({', '.join(where)})" if where else ""),
        xaxis=dict(type="log", title="message size", tickvals=sizes, ticktext=[_size_label(s) for s in sizes]),
        yaxis=dict(type="log" if log_y else "linear", title="GB/s (median; bars: min–max)"),
        legend_title="path", hovermode="closest", height=520,
    )
    return fig
