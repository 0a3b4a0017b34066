"""Drawings of the memory the protocols write into: the prefill's embedding buffer (E→P) and the KV block
tables with their merged runs (P→D).

Each figure is drawn from a small DataFrame that a notebook can print and a test can compare with the
protocol's own numbers: `part_ranges` (which encoder writes which byte range of the buffer the receiver
registered) and `block_runs_frame` (the runs `group_concurrent_contiguous` merges block tables into).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from epd_lab.ep.receiver import ReceivedEmbeddings
from epd_lab.kv.runs import group_concurrent_contiguous

COLORS = qualitative.Plotly
POOL_COLOR = "rgba(180, 180, 180, 0.35)"


def _item_name(item: str) -> str:
    """A media item as a short label: a file's name, or the head of a data: URI or URL."""
    if item.startswith(("data:", "http://", "https://")):
        return item if len(item) <= 40 else item[:37] + "…"
    return os.path.basename(item)


def part_ranges(received: ReceivedEmbeddings) -> pd.DataFrame:
    """One row per part of a ``mooncake`` request: ``part_idx, encoder, modality, items, offset, nbytes, end``,
    the byte range of the registered buffer that the part's encoder wrote."""
    if not received.part_ranges or len(received.part_ranges) != len(received.parts):
        raise ValueError(f"request {received.rid} has no buffer layout (only the mooncake backend registers one)")
    rows = [{"part_idx": plan.part_idx, "encoder": plan.encoder, "modality": plan.modality,
             "items": [_item_name(item) for item in plan.items], "offset": offset, "nbytes": nbytes,
             "end": offset + nbytes}
            for plan, (offset, nbytes) in zip(received.parts, received.part_ranges, strict=True)]
    return pd.DataFrame(rows)


def buffer_layout(received: ReceivedEmbeddings, encoder_urls: Sequence[str] | None = None,
                  title: str | None = None) -> go.Figure:
    """The request's registered buffer as bytes ``[0, nbytes)``: a row per encoder, a bar per part at the
    byte range that encoder's one-sided write filled (``buffer_address = base + offset``). With
    `encoder_urls` (the receiver's), rows also name each encoder's port, as span nodes do."""
    frame = part_ranges(received)
    fig = go.Figure()
    total = int(frame["end"].max())
    for row in frame.itertuples():
        name = f"encoder {row.encoder}"
        if encoder_urls is not None:
            name += f" (:{encoder_urls[row.encoder].rsplit(':', 1)[-1]})"
        fig.add_bar(
            name=f"part {row.part_idx}", orientation="h", y=[name], base=[row.offset], x=[row.nbytes],
            marker_color=COLORS[row.part_idx % len(COLORS)], textposition="inside", insidetextanchor="middle",
            text=[f"part {row.part_idx} · {len(row.items)} item(s) · {row.nbytes / 1024:.0f} KiB"],
            hovertemplate=(f"part {row.part_idx} ({row.modality}): bytes [{row.offset}, {row.end})<br>"
                           f"items: {', '.join(row.items)}<extra>{name}</extra>"))
    fig.add_vline(x=total, line_dash="dot")  # the end of the registration
    fig.update_layout(barmode="overlay", uniformtext={"minsize": 10, "mode": "hide"},
                      title=title or f"request {received.rid}: who writes where in its {total}-byte buffer",
                      xaxis_title="byte offset in the prefill's registered buffer", yaxis_title=None,
                      yaxis={"categoryorder": "category descending"}, height=160 + 45 * frame["encoder"].nunique())
    return fig


def block_runs_frame(src_ids: Sequence[int], dst_ids: Sequence[int]) -> pd.DataFrame:
    """The merged runs of two block tables (`group_concurrent_contiguous`), one row per run:
    ``run, first_block`` (index in the request's table), ``num_blocks, src_block_ids, dst_block_ids``."""
    src_groups, dst_groups = group_concurrent_contiguous(src_ids, dst_ids)
    rows, first = [], 0
    for run, (src, dst) in enumerate(zip(src_groups, dst_groups)):
        rows.append({"run": run, "first_block": first, "num_blocks": len(src), "src_block_ids": src,
                     "dst_block_ids": dst})
        first += len(src)
    return pd.DataFrame(rows, columns=["run", "first_block", "num_blocks", "src_block_ids", "dst_block_ids"])


def _run_bar(run: int, n: int, y: Sequence[str], base: Sequence[int], text: str) -> go.Bar:
    return go.Bar(name=f"run {run}", legendgroup=f"run {run}", orientation="h", y=list(y), base=list(base),
                  x=[n] * len(y), marker_color=COLORS[run % len(COLORS)], marker_line_width=1,
                  marker_line_color="white", hovertemplate=f"run {run}: {text}<extra></extra>")


def block_tables(src_ids: Sequence[int], dst_ids: Sequence[int], src_name: str = "prefill",
                 dst_name: str = "decode") -> go.Figure:
    """A request's two block tables side by side: entry i of each table (x) holds the physical block id
    written in it; entries of one colour form one merged run (consecutive ids on both sides)."""
    runs = block_runs_frame(src_ids, dst_ids)
    fig = go.Figure()
    for r in runs.itertuples():
        fig.add_trace(_run_bar(r.run, r.num_blocks, [src_name, dst_name], [r.first_block] * 2,
                               f"table entries [{r.first_block}, {r.first_block + r.num_blocks})"))
    n = len(src_ids)
    fig.add_scatter(name="block ids", mode="text", showlegend=False, hoverinfo="skip",
                    x=[i + 0.5 for i in range(n)] * 2, y=[src_name] * n + [dst_name] * n,
                    text=[str(b) for b in [*src_ids, *dst_ids]], textfont_color="white")
    fig.update_layout(barmode="overlay", height=260,
                      title=f"block tables: {n} blocks, {len(runs)} runs that are consecutive on both sides",
                      xaxis_title="entry of the request's block table (16 tokens each by default)",
                      xaxis={"dtick": 1, "range": [0, max(n, 1)]}, yaxis={"categoryorder": "array",
                                                                          "categoryarray": [dst_name, src_name]})
    return fig


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int], src_num_blocks: int, dst_num_blocks: int,
               src_name: str = "prefill", dst_name: str = "decode") -> go.Figure:
    """The merged runs in each side's cache (x: physical block id, i.e. ``(address - base) / block_len`` in every
    K and V region): each run is one write per region, from its place in prefill's cache to its place in
    decode's. The grey bar is the whole pool."""
    runs = block_runs_frame(src_ids, dst_ids)
    fig = go.Figure()
    fig.add_bar(name="pool", orientation="h", y=[src_name, dst_name], base=[0, 0], x=[src_num_blocks, dst_num_blocks],
                marker_color=POOL_COLOR, hoverinfo="skip")
    for r in runs.itertuples():
        src0, dst0 = r.src_block_ids[0], r.dst_block_ids[0]
        last = r.num_blocks - 1
        text = f"{src_name} blocks {src0}–{src0 + last} → {dst_name} blocks {dst0}–{dst0 + last}"
        fig.add_trace(_run_bar(r.run, r.num_blocks, [src_name, dst_name], [src0, dst0], text))
        fig.add_scatter(x=[src0 + r.num_blocks / 2, dst0 + r.num_blocks / 2], y=[src_name, dst_name], mode="lines",
                        line={"color": COLORS[r.run % len(COLORS)], "dash": "dot"}, legendgroup=f"run {r.run}",
                        showlegend=False, hoverinfo="skip")
    fig.update_layout(barmode="overlay", height=300, xaxis_title="physical block id (address = base + id × block_len)",
                      title=f"{len(src_ids)} blocks move as {len(runs)} writes per K/V region",
                      yaxis={"categoryorder": "array", "categoryarray": [dst_name, src_name]})
    return fig
