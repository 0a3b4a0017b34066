"""Per-request waterfalls and per-stage distributions of spans (the seed's T_total decomposition, drawn).

Every function takes the table of `epd_lab.trace.spans_frame`: one row per span with ``request``, ``part``,
``stage``, ``node``, ``start_ms``/``end_ms`` (from the request's first span), ``duration_ms`` and ``nbytes``.
`critical_path_waterfall` adds the request's critical path (`epd_lab.trace.critical_path`) as a row on top.
"""
from __future__ import annotations

import math
import zlib
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from epd_lab.trace import GAP, PD_STAGES, STAGES, bare_request_id, critical_path

# Data work (vit, transfer, prefill, kv_transfer, decode) in strong colours, control-plane stages in light ones.
_COLORS = {
    "http_encode": "#9ECAE1", "load": "#6BAED6", "vit": "#1F77B4", "buffer_alloc": "#C7E9C0", "register": "#74C476",
    "http_send": "#FDAE6B", "transfer": "#FF7F0E", "notify": "#E7BA52", "reassemble": "#BCBD22", "prefill": "#2CA02C",
    "kv_write": "#9467BD", "kv_transfer": "#D62728", "decode_step": "#8C564B", "ttft": "#7F7F7F", "tpot": "#BDBDBD",
    "e2e": "#444444",
}
STAGE_ORDER: tuple[str, ...] = (*STAGES, *PD_STAGES)
# Time no span covers: light grey, hatched, so it reads as "nothing recorded" next to the stage colours.
_GAP_STYLE = dict(color="#E5E5E5", line=dict(color="#969696", width=0.5), pattern=dict(shape="/", fgcolor="#969696"))
_OFF_PATH_OPACITY = 0.3


def stage_color(stage: str) -> str:
    """The colour of `stage`: fixed for known stages, a stable pick (by crc32 of the name) for others."""
    return _COLORS.get(stage) or qualitative.Alphabet[zlib.crc32(stage.encode()) % len(qualitative.Alphabet)]


def stage_order(stages: Sequence[str]) -> list[str]:
    """`stages` (deduplicated) in protocol order; unknown stages after the known ones, by name."""
    known = {s: i for i, s in enumerate(STAGE_ORDER)}
    return sorted(set(stages), key=lambda s: (known.get(s, len(known)), s))


def span_label(stage: str, part: int, node: str) -> str:
    """A waterfall row's name, e.g. ``vit · part 1 · encoder:4321`` (decode steps count tokens, not parts)."""
    if part < 0:
        return f"{stage} · {node}"
    return f"{stage} · {'token' if stage == 'decode_step' else 'part'} {part} · {node}"


def request_spans(frame: pd.DataFrame, request: str | None = None) -> pd.DataFrame:
    """One request's rows ordered by start (then end); `None` picks the request that started first. A response's
    id (``chatcmpl-…``) names its request."""
    if frame.empty:
        raise ValueError("no spans")
    if request is None:
        request = frame.loc[frame["t_start_ns"].idxmin(), "request"]
    sub = frame[frame["request"] == bare_request_id(request)]
    if sub.empty:
        raise ValueError(f"no spans of request {request!r}; requests: {sorted(frame['request'].unique())}")
    sub = sub.sort_values(["start_ms", "end_ms"], kind="stable").copy()
    labels = [span_label(s, int(p), n) for s, p, n in zip(sub["stage"], sub["part"], sub["node"])]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):  # a stage repeated on one part and node still gets a row of its own
        seen[label] = seen.get(label, 0) + 1
        labels[i] = label if seen[label] == 1 else f"{label} ({seen[label]})"
    sub["label"] = labels
    return sub


def _add_bars(fig: go.Figure, sub: pd.DataFrame, legend: set[str], row: int | None = None,
              col: int | None = None, on_path: set | None = None, above: Sequence[str] = ()) -> None:
    """One bar trace per stage of `sub` (a `request_spans` table); a stage enters the legend once.

    With `on_path` (index labels of `sub`), the other spans are faded; `above` are rows drawn above the spans'.
    """
    for stage in stage_order(sub["stage"]):
        rows = sub[sub["stage"] == stage]
        opacity = None if on_path is None else [1.0 if i in on_path else _OFF_PATH_OPACITY for i in rows.index]
        fig.add_trace(go.Bar(
            orientation="h", y=rows["label"], base=rows["start_ms"], x=rows["duration_ms"], name=stage,
            legendgroup=stage, showlegend=stage not in legend, marker_color=stage_color(stage), marker_opacity=opacity,
            text=[f"{d:.2f}" for d in rows["duration_ms"]], textposition="outside", cliponaxis=False,
            textfont_size=9,  # the duration beside each bar: sub-ms stages are too thin to see
            customdata=rows[["start_ms", "end_ms", "duration_ms", "nbytes"]].to_numpy(),
            hovertemplate="%{y}<br>%{customdata[0]:.3f} → %{customdata[1]:.3f} ms<br>"
                          "duration %{customdata[2]:.3f} ms<br>%{customdata[3]:,} bytes<extra></extra>",
        ), row=row, col=col)
        legend.add(stage)
    fig.update_yaxes(categoryorder="array", categoryarray=[*above, *sub["label"]], autorange="reversed",
                     row=row, col=col)


def waterfall(frame: pd.DataFrame, request: str | None = None, title: str | None = None) -> go.Figure:
    """One request's spans as horizontal bars from its start: one row per span, ordered by start."""
    sub = request_spans(frame, request)
    fig = go.Figure()
    _add_bars(fig, sub, set())
    name = sub["request"].iloc[0]
    fig.update_layout(
        title=title or f"request {name}: {sub['end_ms'].max():.1f} ms, {len(sub)} spans",
        xaxis_title="ms from the request's first span", barmode="overlay", legend_title="stage",
        height=160 + 22 * len(sub), margin=dict(l=10, r=10, t=60, b=50),
    )
    return fig


def critical_path_waterfall(frame: pd.DataFrame, request: str | None = None, until: str | None = "ttft",
                            title: str | None = None) -> go.Figure:
    """`waterfall` with the request's critical path (`epd_lab.trace.critical_path`, same `until`) as its top row.

    The path row shows each leaf span's part on the path in its stage's colour and the time no span covers as
    hatched grey ``gap`` bars; below it, every span as in `waterfall`, those off the path faded.
    """
    sub = request_spans(frame, request)
    name = sub["request"].iloc[0]
    path = critical_path(frame, name, until)
    anchor = path.attrs["anchor"]
    row = f"critical path · {until or 'all spans'}"
    fig = go.Figure()
    legend: set[str] = set()
    spans = path[path["kind"] != GAP]
    for stage in stage_order(spans["stage"]):
        rows = spans[spans["stage"] == stage]
        fig.add_trace(go.Bar(
            orientation="h", y=[row] * len(rows), base=rows["start_ms"], x=rows["dur_ms"], name=stage,
            legendgroup=stage, marker=dict(color=stage_color(stage), line=dict(color="white", width=0.5)),
            customdata=rows[["start_ms", "end_ms", "dur_ms", "node", "part", "clock_err_ms"]].to_numpy(),
            hovertemplate=f"{stage} on the path<br>%{{customdata[3]}}, part %{{customdata[4]}}<br>"
                          "%{customdata[0]:.3f} → %{customdata[1]:.3f} ms<br>%{customdata[2]:.3f} ms "
                          "± %{customdata[5]:.3f} ms (clocks)<extra></extra>",
        ))
        legend.add(stage)
    gaps = path[path["kind"] == GAP]
    if len(gaps):
        fig.add_trace(go.Bar(
            orientation="h", y=[row] * len(gaps), base=gaps["start_ms"], x=gaps["dur_ms"], name=GAP,
            marker=_GAP_STYLE, customdata=gaps[["start_ms", "end_ms", "dur_ms", "between", "clock_err_ms"]].to_numpy(),
            hovertemplate="gap %{customdata[3]}<br>%{customdata[0]:.3f} → %{customdata[1]:.3f} ms<br>"
                          "%{customdata[2]:.3f} ms ± %{customdata[4]:.3f} ms (clocks) covered by no span"
                          "<extra></extra>",
        ))
    _add_bars(fig, sub, legend, on_path=set(spans["span"]), above=[row])
    gap_ms = gaps["dur_ms"].sum()
    # spans from other hosts' clocks: how far their placement may be off (the offsets' errors, `trace.collect`)
    clocks = f", clocks ± {path['clock_err_ms'].max():.3f} ms" if path["clock_err_ms"].any() else ""
    fig.update_layout(
        title=title or (f"request {name}: {until or 'all spans'} {anchor['ms']:.1f} ms, critical path of "
                        f"{len(spans)} spans, {gap_ms:.1f} ms ({100 * gap_ms / anchor['ms']:.0f}%) covered by no "
                        f"span{clocks}"),
        xaxis_title="ms from the request's first span", barmode="overlay", legend_title="stage",
        height=160 + 22 * (len(sub) + 1), margin=dict(l=10, r=10, t=60, b=50),
    )
    return fig


def waterfalls(frame: pd.DataFrame, requests: Sequence[str] | None = None, cols: int = 2,
               titles: Sequence[str] | None = None, shared_x: bool = True) -> go.Figure:
    """Waterfalls of several requests as small multiples, `cols` per row (e.g. one per backend).

    `requests` defaults to every request, in order of start; `titles` (one per request) default to the ids.
    With `shared_x` every panel has the same time axis, so lengths compare across panels.
    """
    if requests is None:
        requests = list(frame.sort_values("t_start_ns")["request"].unique())
    if not requests:
        raise ValueError("no requests")
    titles = list(titles) if titles is not None else [str(r) for r in requests]
    if len(titles) != len(requests):
        raise ValueError(f"{len(titles)} titles for {len(requests)} requests")
    cols = max(1, min(cols, len(requests)))
    nrows = math.ceil(len(requests) / cols)
    subs = [request_spans(frame, r) for r in requests]
    longest = max(len(label) for sub in subs for label in sub["label"])
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=titles, shared_xaxes="all" if shared_x else False,
                        horizontal_spacing=min(0.4, 0.05 + longest * 0.006) if cols > 1 else 0.1,  # room for labels
                        vertical_spacing=0.12 / nrows)
    legend: set[str] = set()
    for i, sub in enumerate(subs):
        _add_bars(fig, sub, legend, row=i // cols + 1, col=i % cols + 1)
    fig.update_xaxes(showticklabels=True)
    fig.update_layout(barmode="overlay", legend_title="stage", margin=dict(l=10, r=10, t=60, b=40),
                      height=nrows * (100 + 20 * max(len(s) for s in subs)) + 60)
    return fig


def stage_distributions(frame: pd.DataFrame, by: str = "stage", color: str | None = None,
                        kind: str = "box", log_y: bool = False) -> go.Figure:
    """`duration_ms` per value of `by` as a box (or ``kind="violin"``) with every point, optionally split by
    the column `color` (e.g. ``backend``); without `color`, stages keep their waterfall colours."""
    if kind not in ("box", "violin"):
        raise ValueError(f"kind must be 'box' or 'violin', not {kind!r}")
    for column in (by, color):
        if column is not None and column not in frame.columns:
            raise ValueError(f"no column {column!r}; columns: {list(frame.columns)}")
    order = stage_order(frame[by]) if by == "stage" else sorted(frame[by].unique())
    split = color or by
    trace = go.Box if kind == "box" else go.Violin
    points = dict(boxpoints="all") if kind == "box" else dict(points="all", box_visible=True)
    fig = go.Figure()
    for key, rows in frame.groupby(split, sort=True):
        marker = dict(marker_color=stage_color(key)) if split == "stage" else {}
        fig.add_trace(trace(x=rows[by], y=rows["duration_ms"], name=str(key), showlegend=color is not None,
                            hovertext=rows.get("request"), **points, **marker))
    fig.update_xaxes(categoryorder="array", categoryarray=order, title=by)
    fig.update_layout(yaxis_title="duration (ms)", yaxis_type="log" if log_y else "linear", legend_title=color,
                      boxmode="group" if color else "overlay", violinmode="group" if color else "overlay",
                      title=f"duration per {by}" + (f", by {color}" if color else ""))
    return fig
