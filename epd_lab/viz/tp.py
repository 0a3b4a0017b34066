"""A KV transfer plan between TP groups drawn: prefill ranks' KV heads on the left, decode ranks' on the right, an
arrow per head slice (`epd_lab.kv.tp_plan.KVTransferPlan`), a replicated head shown on every rank that holds it."""
from __future__ import annotations

import plotly.graph_objects as go

from epd_lab.kv.tp_plan import KVTransferPlan, kv_head_range

_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6")


def _column(num_kv_heads: int, tp: int) -> list[tuple[int, int, float]]:
    """(rank, global head, y) of every head every rank holds, top to bottom, a gap between ranks."""
    out, y = [], 0.0
    for rank in range(tp):
        start, stop = kv_head_range(num_kv_heads, tp, rank)
        for head in range(start, stop):
            out.append((rank, head, -y))
            y += 1
        y += 0.6
    return out


def plan_figure(plan: KVTransferPlan, title: str | None = None) -> go.Figure:
    """The plan as boxes (a rank's local heads, colored by global head) and arrows (its slices), left to right."""
    left, right = _column(plan.num_kv_heads, plan.src_tp), _column(plan.num_kv_heads, plan.dst_tp)
    fig = go.Figure()
    for x, side, tp, name in ((0.0, left, plan.src_tp, "prefill"), (1.0, right, plan.dst_tp, "decode")):
        for rank, head, y in side:
            fig.add_shape(type="rect", x0=x - 0.16, x1=x + 0.16, y0=y - 0.4, y1=y + 0.4, line={"width": 1},
                          fillcolor=_COLORS[head % len(_COLORS)], opacity=0.85)
            fig.add_annotation(x=x, y=y, text=f"{name} rank {rank} · head {head}", showarrow=False,
                               font={"color": "white", "size": 11})
    for s in plan.slices:
        src_start = kv_head_range(plan.num_kv_heads, plan.src_tp, s.src_rank)[0]
        for i in range(s.num_heads):
            head = src_start + s.src_head + i
            y0 = next(y for rank, h, y in left if rank == s.src_rank and h == head)
            y1 = next(y for rank, h, y in right if rank == s.dst_rank and h == head)
            fig.add_annotation(x=0.84, y=y1, ax=0.16, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                               showarrow=True, arrowhead=3, arrowwidth=1.6, arrowcolor="#444", text="")
    lowest = min(y for *_, y in left + right)
    fig.update_xaxes(visible=False, range=[-0.22, 1.22])
    fig.update_yaxes(visible=False, range=[lowest - 0.8, 0.8])
    fig.update_layout(title=title or f"KV heads: prefill tp {plan.src_tp} → decode tp {plan.dst_tp} "
                                     f"({plan.num_kv_heads} KV heads)",
                      height=140 + 60 * max(len(left), len(right)), width=760, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig
