"""The model runtimes profiled (`epd-lab bench runtime`, ``data/bench/runtime-h200-full.json``): where a call's
wall time goes, against the time the GPU was busy.

- `runtime_frame`: one row per (model, runtime, call): wall p50 and range, GPU busy, their ratio, kernels, the
  host work in between (wall - busy), and the kernel that took the most GPU time.
- `runtime_figure`: wall against GPU busy per call, one panel per model, the runtimes side by side: where the
  bars differ the call is launch-bound (host work), where they match it is GPU-bound.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from epd_lab.viz.bandwidth import RESULTS

CALLS = ("vit_1x448", "vit_4x448", "prefill", "ttft", "decode_c1", "decode_c16")
_COLORS = {"hf": "#FF7F0E", "fast": "#1F77B4", "hf_batched_tower": "#7F7F7F"}


def load_runtime(path: str | Path = RESULTS / "runtime-h200-full.json") -> dict[str, Any]:
    """A `bench runtime` result (``machine``, ``results``, ``summary``)."""
    result = json.loads(Path(path).read_text())
    if "results" not in result or "summary" not in result:
        raise ValueError(f"{path}: no 'results' and 'summary'; not a result of `epd-lab bench runtime`")
    return result


def runtime_frame(result: dict[str, Any]) -> pd.DataFrame:
    """One row per measured (model, runtime, call) of a `bench runtime` result; see the module docstring."""
    records = []
    for model in result["results"]:
        for runtime, calls in model["runtimes"].items():
            for call, m in calls.items():
                top = (m.get("top_kernels") or [{}])[0]
                busy = m.get("gpu_busy_ms")
                records.append({"model": model["model"], "runtime": runtime, "call": call,
                                "wall_ms": m["median_ms"], "wall_min_ms": m["min_ms"], "wall_max_ms": m["max_ms"],
                                "gpu_busy_ms": busy, "wall_over_busy": m.get("wall_over_busy"),
                                "kernels": m.get("kernels"),
                                "host_ms": None if busy is None else m["median_ms"] - busy,
                                "top_kernel": top.get("name"), "top_kernel_ms": top.get("ms")})
    return pd.DataFrame.from_records(records)


def runtime_figure(frame: pd.DataFrame) -> go.Figure:
    """Wall (solid) and GPU busy (hatched) per call, hf beside fast, one panel per model."""
    models = list(dict.fromkeys(frame["model"]))
    fig = make_subplots(rows=len(models), cols=1, subplot_titles=models, vertical_spacing=0.12)
    for row, model in enumerate(models, start=1):
        rows = frame[(frame["model"] == model) & frame["call"].isin(CALLS) & frame["runtime"].isin(("hf", "fast"))]
        for runtime, part in rows.groupby("runtime", sort=False):
            part = part.set_index("call").reindex([c for c in CALLS if c in set(part["call"])])
            for kind, pattern in (("wall_ms", ""), ("gpu_busy_ms", "/")):
                fig.add_trace(go.Bar(
                    x=part.index, y=part[kind], name=f"{runtime}: {kind.removesuffix('_ms').replace('_', ' ')}",
                    marker=dict(color=_COLORS[runtime], pattern_shape=pattern), offsetgroup=f"{runtime}{kind}",
                    legendgroup=f"{runtime}{kind}", showlegend=row == 1,
                    hovertemplate=f"<b>{runtime}</b> %{{x}}<br>{kind}: %{{y:.2f}}<extra></extra>"), row=row, col=1)
        fig.update_yaxes(title_text="ms (log)", type="log", row=row, col=1)
    fig.update_layout(title="wall time against GPU busy time per call (median)", barmode="group",
                      height=360 * len(models), legend_title="runtime: what")
    return fig
