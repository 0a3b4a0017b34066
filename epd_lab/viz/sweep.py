"""A sweep's results table drawn: a heatmap over two swept parameters, lines over one.

The table has one row per request or per point; rows sharing the swept values are aggregated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

if TYPE_CHECKING:
    from pandas.api.typing import SeriesGroupBy

AGGS = ("median", "mean", "min", "max", "p90", "p99", "count")


def _aggregate(groups: SeriesGroupBy, agg: str) -> pd.Series:
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; one of {AGGS}")
    if agg.startswith("p"):
        return groups.quantile(int(agg[1:]) / 100)
    return getattr(groups, agg)()


def _check_columns(table: pd.DataFrame, *columns: str | None) -> None:
    missing = [c for c in columns if c is not None and c not in table.columns]
    if missing:
        raise ValueError(f"no column {missing[0]!r}; columns: {list(table.columns)}")


def sweep_heatmap(table: pd.DataFrame, x: str, y: str, value: str, agg: str = "median",
                  fmt: str = ".3g") -> go.Figure:
    """`agg` of `value` over the grid of `x` × `y` (both axes discrete: the swept values only), each cell labelled
    with its number (empty where no row); a cell of several rows shows their spread, smallest to largest, under it
    and in its hover."""
    _check_columns(table, x, y, value)
    groups = table.groupby([y, x])[value]
    grid = _aggregate(groups, agg).unstack(x).sort_index().sort_index(axis=1)
    counts = groups.count().unstack(x).reindex_like(grid)
    lo, hi = groups.min().unstack(x).reindex_like(grid), groups.max().unstack(x).reindex_like(grid)
    spread = [[f"{a:{fmt}}–{b:{fmt}}" if n > 1 else "" for a, b, n in zip(row_lo, row_hi, row_n)]
              for row_lo, row_hi, row_n in zip(lo.to_numpy(), hi.to_numpy(), counts.fillna(0).to_numpy())]
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(), x=[str(v) for v in grid.columns], y=[str(v) for v in grid.index],
        text=counts.fillna(0).astype(int).to_numpy(), customdata=spread,
        texttemplate=f"%{{z:{fmt}}}<br>%{{customdata}}", colorscale="Viridis", colorbar_title=value,
        hovertemplate=f"{x}=%{{x}}<br>{y}=%{{y}}<br>{agg} {value}=%{{z:{fmt}}}"
                      "<br>%{text} rows, %{customdata}<extra></extra>",
    ))
    fig.update_layout(title=f"{agg} {value} by {x} and {y}", xaxis=dict(title=x, type="category"),
                      yaxis=dict(title=y, type="category"))
    return fig


def sweep_lines(table: pd.DataFrame, x: str, value: str, color: str | None = None, agg: str = "median",
                spread: bool = True, log_x: bool = False, log_y: bool = False) -> go.Figure:
    """`agg` of `value` against `x`, one line per value of `color`; with `spread`, bars from the smallest to
    the largest row at each point (when a point has several rows)."""
    _check_columns(table, x, value, color)
    groups = [(None, table)] if color is None else list(table.groupby(color, sort=True))
    fig = go.Figure()
    for i, (key, rows) in enumerate(groups):
        by_x = rows.groupby(x)[value]
        mid, lo, hi = _aggregate(by_x, agg), by_x.min(), by_x.max()
        fig.add_trace(go.Scatter(
            x=list(mid.index), y=list(mid), mode="lines+markers", name=value if key is None else str(key),
            line_color=qualitative.Plotly[i % len(qualitative.Plotly)], showlegend=key is not None,
            error_y=dict(type="data", symmetric=False, array=list(hi - mid), arrayminus=list(mid - lo),
                         visible=spread and bool((hi > lo).any()), thickness=1),
            customdata=by_x.count().to_numpy(),
            hovertemplate=f"{x}=%{{x}}<br>{agg} {value}=%{{y:.3g}}<br>%{{customdata}} rows<extra></extra>",
        ))
    swept = sorted(table[x].dropna().unique())
    ticks = swept if len(swept) <= 12 else None  # a swept parameter's axis names its values, not a linear scale's
    fig.update_layout(title=f"{agg} {value} by {x}" + (f", per {color}" if color else ""), legend_title=color,
                      xaxis=dict(title=x, type="log" if log_x else None, tickvals=ticks),
                      yaxis=dict(title=value, type="log" if log_y else None))
    return fig
