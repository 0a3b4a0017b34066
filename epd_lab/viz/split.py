"""Does moving the encoder out pay? `epd-lab bench e2e` grids (``data/bench/e2e-cuda-*.json``) as tables and figures.

The bench measures, per grid point (images per request x image side), the monolithic floor (one process, one
request at a time) and E→P→D through the proxy at several concurrency levels, one row per (path, level). Here:

- `e2e_frame`: every row of one or more runs, flat (run, model, path, backend, images, image_size, concurrency,
  TTFT/TPOT p50 and p90, requests/s, and at concurrency 1 the servers' own TTFT: the proxy's ``ttft`` span).
  A split is compared with the floor of its own run: runs of one model differ in host, commit and media.
- `split_pays`: per model, point and backend, what the split costs a lone request (TTFT over the floor at
  concurrency 1, and how much of the client's TTFT the servers spent: the rest is the client encoding and
  sending the request) and what it gives under load (requests/s at the highest level over the floor's).
- `split_figure`: TTFT at concurrency 1 and the throughput ratio against images per request, one panel per
  image side, one line per path.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from epd_lab.viz.bandwidth import RESULTS

MONOLITHIC = "monolithic"
_COLORS = {MONOLITHIC: "#444444", "mooncake": "#1F77B4", "zmq_to_scheduler": "#E377C2", "zmq_to_tokenizer": "#BCBD22"}


def load_e2e(paths: Iterable[str | Path] | None = None) -> list[dict[str, Any]]:
    """The runs' JSON (default: every ``e2e-cuda-*.json`` under ``data/bench``), each checked to be a grid run of
    `epd-lab bench e2e` (``grid`` and ``rows``); each carries its file's name as ``source``."""
    paths = sorted(RESULTS.glob("e2e-cuda-*.json")) if paths is None else [Path(p) for p in paths]
    runs = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        if "grid" not in run or "rows" not in run:
            raise ValueError(f"{path}: no 'grid' and 'rows'; not a grid run of `epd-lab bench e2e`")
        runs.append({**run, "source": Path(path).stem})
    return runs


def e2e_frame(runs: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """One row per measured (run, model, path, images, image_size, concurrency) of `runs`; ``backend`` is the E→P
    backend (``monolithic`` for the floor). ``model`` names the runtime too, and images by URL
    ("qwen2-vl-2b (fast, by URL)"): runs made before those options existed ran HF's runtime ("hf") with data:
    URIs. ``run``: the run's ``source`` (its file), else its position in `runs`."""
    records = []
    for i, run in enumerate(runs):
        by_url = ", by URL" if run.get("media") == "url" else ""
        model = f"{run['model']} ({run.get('runtime', 'hf')}{by_url})"
        for r in run["rows"]:
            backend = r["path"].removeprefix("epd/")
            records.append({"run": run.get("source", str(i)), "created": run.get("created", ""), "model": model,
                            "gpu": run.get("gpu"),
                            "path": r["path"], "backend": backend,
                            "images": r["images"], "image_size": r["image_size"], "concurrency": r["concurrency"],
                            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p90_ms": r["ttft_ms"]["p90"],
                            "tpot_p50_ms": r["tpot_ms"]["p50"], "requests_per_s": r["requests_per_s"],
                            "server_ttft_p50_ms": _server_ttft(r), "answer_ok": r.get("answer_ok")})
    if not records:
        raise ValueError("no rows in the runs")
    return pd.DataFrame.from_records(records)


def _server_ttft(row: dict[str, Any]) -> float:
    """The median of the proxy's ``ttft`` span (request received to first token sent) where the row has a critical
    path (concurrency 1), else NaN."""
    stages = {p["stage"]: p["median_ms"] for p in row.get("critical_path", ())}
    return stages.get("ttft", float("nan"))


def split_pays(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (run, model, image_size, images, backend), against that run's floor: ``ttft_over_floor_ms`` and
    ``ttft_ratio`` at concurrency 1, and ``throughput_ratio``: the split's requests/s at its highest level over
    the floor's (the floor serves one request at a time, so its rate is the same at any level). A ratio above 1
    is where the split pays.
    ``server_ttft_ms``: the part of ``ttft_ms`` inside the servers; ``client_ms`` the rest (the client's JSON
    and upload of the images, which the floor does not pay)."""
    key = ["run", "model", "image_size", "images"]
    floor = frame[frame["path"] == MONOLITHIC].set_index(key)
    split = frame[frame["path"] != MONOLITHIC]
    out = []
    for (run, model, size, images, backend), rows in split.groupby([*key, "backend"], sort=True):
        base = floor.loc[(run, model, size, images)]
        lone = rows[rows["concurrency"] == 1]
        top = rows[rows["concurrency"] == rows["concurrency"].max()].iloc[0]
        ttft = float(lone["ttft_p50_ms"].iloc[0]) if len(lone) else float("nan")
        server = float(lone["server_ttft_p50_ms"].iloc[0]) if len(lone) else float("nan")
        out.append({"run": run, "created": rows["created"].iloc[0], "model": model, "image_size": size,
                    "images": images, "backend": backend,
                    "floor_ttft_ms": base["ttft_p50_ms"], "ttft_ms": ttft,
                    "ttft_over_floor_ms": ttft - base["ttft_p50_ms"], "ttft_ratio": ttft / base["ttft_p50_ms"],
                    "server_ttft_ms": server, "client_ms": ttft - server,
                    "top_concurrency": int(top["concurrency"]), "requests_per_s": top["requests_per_s"],
                    "floor_requests_per_s": base["requests_per_s"],
                    "throughput_ratio": top["requests_per_s"] / base["requests_per_s"]})
    return pd.DataFrame.from_records(out)


def split_figure(frame: pd.DataFrame, model: str | None = None) -> go.Figure:
    """Two rows of panels, one column per image side: TTFT p50 at concurrency 1 (the floor and each backend),
    and each backend's throughput ratio over the floor (dashed: 1, where the split starts to pay), against
    images per request. `model`: which model's rows (default: the only one). Where several runs measured a
    point, the newest (``created``) is drawn."""
    models = sorted(frame["model"].unique())
    if model is None:
        if len(models) != 1:
            raise ValueError(f"the frame holds several models ({', '.join(models)}): name one")
        model = models[0]
    point = ["backend", "image_size", "images"]
    frame = frame[frame["model"] == model].sort_values("created")
    pays = split_pays(frame).sort_values("created").drop_duplicates(point, keep="last")
    frame = frame.drop_duplicates([*point, "concurrency"], keep="last")
    sizes = sorted(frame["image_size"].unique())
    fig = make_subplots(rows=2, cols=len(sizes), shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[f"{s}² images: TTFT at concurrency 1" for s in sizes]
                        + [f"{s}² images: split / monolithic requests/s" for s in sizes])
    for col, size in enumerate(sizes, start=1):
        lone = frame[(frame["image_size"] == size) & (frame["concurrency"] == 1)].sort_values("images")
        for backend, rows in lone.groupby("backend", sort=False):
            fig.add_trace(go.Scatter(
                x=rows["images"], y=rows["ttft_p50_ms"], mode="lines+markers", name=backend, legendgroup=backend,
                showlegend=col == 1, line=dict(color=_COLORS.get(backend), dash="dash" if backend == MONOLITHIC
                                               else "solid"),
                hovertemplate=f"<b>{backend}</b> %{{x}} x {size}²<br>TTFT p50 %{{y:.1f}} ms<extra></extra>"),
                row=1, col=col)
        for backend, rows in pays[pays["image_size"] == size].sort_values("images").groupby("backend", sort=False):
            fig.add_trace(go.Scatter(
                x=rows["images"], y=rows["throughput_ratio"], mode="lines+markers", name=backend,
                legendgroup=backend, showlegend=False, line=dict(color=_COLORS.get(backend)),
                customdata=rows[["top_concurrency", "requests_per_s", "floor_requests_per_s"]].to_numpy(),
                hovertemplate=f"<b>{backend}</b> %{{x}} x {size}²<br>%{{customdata[1]:.2f}} req/s at concurrency "
                              "%{customdata[0]} / monolithic %{customdata[2]:.2f}<extra></extra>"),
                row=2, col=col)
        fig.add_hline(y=1.0, line=dict(color="#444444", dash="dash", width=1), row=2, col=col)
        fig.update_xaxes(title_text="images per request", row=2, col=col)
    fig.update_yaxes(title_text="TTFT p50 (ms)", row=1, col=1)
    fig.update_yaxes(title_text="throughput ratio", row=2, col=1)
    gpu = frame["gpu"].dropna().unique()
    fig.update_layout(title=f"does the split pay? {model}" + (f" on {gpu[0]}" if len(gpu) else ""),
                      height=640, legend_title="path", hovermode="closest")
    return fig
