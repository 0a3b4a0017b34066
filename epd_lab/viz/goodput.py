"""Goodput against request rate, and TTFT/TPOT Pareto fronts, per topology, from `epd-lab sweep rates` runs.

- `load_rates`: a sweep's folder (``rates.csv``, one JSON per point) as one row per point, goodput recomputed for
  the SLOs asked (the JSONs keep every request's TTFT, ITLs and E2EL, so any SLO can be applied afterwards).
- `goodput_figure`: goodput (solid) and throughput (dotted) against the offered rate, one colour per topology;
  the dashed diagonal is goodput = rate (every request served within its SLOs).
- `goodput_gain`: each split topology's goodput over the monolithic floor's at the same rate.
- `load_placements`: an `epd-lab sweep rates --placements` folder (placements at equal GPUs) as `load_rates`' rows,
  one line per placement (in ``topology``), with its ``answers.json``.
- `pareto_front` / `pareto_figure`: each point a rate's (TTFT, TPOT) at a statistic (p50, p99); per topology the
  points no other point of it beats on both, joined as a step line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from epd_lab.bench.serve.metrics import calculate_metrics, outputs_from_result

_COLORS = {"monolithic": "#444444", "1e1p1d": "#1F77B4", "2e1p1d": "#FF7F0E", "1e2p1d": "#2CA02C",
           "2e2p2d": "#D62728"}


def load_rates(out: str | Path, slos: dict[str, float] | None = None, label: str | None = None) -> pd.DataFrame:
    """One row per (topology, rate) of the sweep in `out`, with ``request_goodput`` for `slos` (ms; none: the
    sweep's own) and p50/p99 TTFT, TPOT and E2EL; ``run`` is `label` (default: the folder's name), ``images`` and
    ``resolution`` what its ``sweep.json`` says each request carried.

    A point whose JSON is missing (a sweep whose per-point files did not come back) is read from its
    ``rates.csv`` row: the sweep's own goodput, p50 taken from its medians; asked for other SLOs, it raises
    `ValueError` (the per-request lists that goodput is recomputed from are in the JSON)."""
    out = Path(out)
    points = pd.read_csv(out / "rates.csv")
    meta = json.loads((out / "sweep.json").read_text())
    rows = []
    for point in points.to_dict("records"):
        path = out / point["topology"] / f"rate-{point['request_rate']:g}.json"
        if path.exists():
            result = json.loads(path.read_text())
            wanted = slos if slos is not None else (result.get("goodput") or {})
            m = calculate_metrics(outputs_from_result(result), result["duration"], wanted, ("ttft", "tpot", "e2el"),
                                  (50, 99))
        elif slos is None or slos == meta.get("goodput"):
            m = _from_row(point)
        else:
            raise ValueError(f"{path} is missing: goodput for other SLOs than the sweep's own cannot be recomputed")
        rows.append({"run": label or out.name, "images": meta.get("image_count"),
                     "resolution": meta.get("image_resolution"), "topology": point["topology"],
                     "request_rate": point["request_rate"],
                     "completed": m["completed"], "failed": m["failed"],
                     "request_throughput": m["request_throughput"], "request_goodput": m["request_goodput"],
                     **{k: m[k] for k in m if k.startswith(("p50_", "p99_"))}})
    return pd.DataFrame(rows)


def load_placements(out: str | Path, slos: dict[str, float] | None = None) -> tuple[pd.DataFrame, dict]:
    """Every placement swept into `out` (``OUT/<placement>/``, those ``answers.json`` names) as `load_rates` rows
    whose ``topology`` is the placement's name (so that `goodput_figure` draws one line per placement), and the
    ``answers.json`` itself."""
    out = Path(out)
    answers = json.loads((out / "answers.json").read_text())
    table = pd.concat([load_rates(out / name, slos, label=out.name).assign(topology=name)
                       for name in answers["placements"]], ignore_index=True)
    return table, answers


def _from_row(point: dict) -> dict:
    """A point's metrics as its ``rates.csv`` row has them (``median_*`` is p50)."""
    m = {k: point[k] for k in ("completed", "failed", "request_throughput", "request_goodput")}
    for name in ("ttft", "tpot", "e2el"):
        for stat, key in (("median", "p50"), ("p99", "p99")):
            column = f"{stat}_{name}_ms"
            if column in point:
                m[f"{key}_{name}_ms"] = point[column]
    return m


def _color(topology: str) -> str | None:
    return _COLORS.get(topology)


def goodput_figure(table: pd.DataFrame, title: str = "goodput against request rate") -> go.Figure:
    """Goodput and throughput against the offered rate, one line pair per topology (`load_rates`' rows)."""
    if table["request_goodput"].isna().all():
        raise ValueError("no goodput in the table: load it with SLOs")
    fig = go.Figure()
    for topology, rows in table.sort_values("request_rate").groupby("topology", sort=False):
        color = _color(topology)
        fig.add_trace(go.Scatter(x=rows["request_rate"], y=rows["request_goodput"], mode="lines+markers",
                                 name=f"{topology} goodput", legendgroup=topology, line=dict(color=color),
                                 hovertemplate=f"<b>{topology}</b> %{{x}} req/s offered<br>goodput %{{y:.2f}} req/s"
                                               "<extra></extra>"))
        fig.add_trace(go.Scatter(x=rows["request_rate"], y=rows["request_throughput"], mode="lines",
                                 name=f"{topology} throughput", legendgroup=topology,
                                 line=dict(color=color, dash="dot", width=1)))
    top = float(table["request_rate"].max())
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="goodput = rate",
                             line=dict(color="#999999", dash="dash", width=1)))
    fig.update_layout(title=title, xaxis_title="offered request rate (req/s)", yaxis_title="req/s",
                      legend_title="topology")
    return fig


def pareto_front(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The rows of `points` that no other row beats on both `x` and `y` (lower is better), sorted by `x`."""
    ordered = points.sort_values([x, y])
    keep, best = [], float("inf")
    for index, value in zip(ordered.index, ordered[y]):
        if value < best:
            keep.append(index)
            best = value
    return ordered.loc[keep]


def pareto_figure(table: pd.DataFrame, stat: str = "p50") -> go.Figure:
    """TTFT against TPOT at `stat` (p50 or p99), every rate a marker labelled with it, each topology's front a
    step line."""
    x, y = f"{stat}_ttft_ms", f"{stat}_tpot_ms"
    fig = go.Figure()
    for topology, rows in table.groupby("topology", sort=False):
        color = _color(topology)
        fig.add_trace(go.Scatter(x=rows[x], y=rows[y], mode="markers+text",
                                 text=[f"{r:g}" for r in rows["request_rate"]],
                                 textposition="top center", name=topology, legendgroup=topology,
                                 marker=dict(color=color, size=9),
                                 hovertemplate=f"<b>{topology}</b> rate %{{text}} req/s<br>TTFT {stat} %{{x:.1f}} ms"
                                               f"<br>TPOT {stat} %{{y:.2f}} ms<extra></extra>"))
        front = pareto_front(rows, x, y)
        fig.add_trace(go.Scatter(x=front[x], y=front[y], mode="lines", line=dict(color=color, shape="hv"),
                                 legendgroup=topology, showlegend=False, hoverinfo="skip"))
    fig.update_layout(title=f"TTFT / TPOT ({stat}) per topology; labels: offered req/s",
                      xaxis_title=f"TTFT {stat} (ms)",
                      yaxis_title=f"TPOT {stat} (ms)", xaxis_type="log", legend_title="topology")
    return fig


def goodput_gain(table: pd.DataFrame, floor: str = "monolithic") -> pd.DataFrame:
    """Per run, rate and split topology: its goodput, the floor's at the same rate, and their ratio (above 1: moving
    the encoder out raised goodput there; NaN where the floor's goodput is 0)."""
    base = table[table["topology"] == floor].set_index(["run", "request_rate"])["request_goodput"]
    split = table[table["topology"] != floor]
    gain = split[["run", "images", "resolution", "request_rate", "topology", "request_goodput"]].copy()
    gain["floor_goodput"] = [base.get((r, q), float("nan")) for r, q in zip(split["run"], split["request_rate"])]
    gain["ratio"] = gain["request_goodput"] / gain["floor_goodput"].where(gain["floor_goodput"] > 0)
    return gain.reset_index(drop=True)
