"""The critical path of a request's TTFT (`epd_lab.trace.critical`) on hand-made span frames.

Containers (spans holding another span of the request, same part or request-wide) are left out, spans are
clipped to the window and to the cursor, identical bounds give one leaf whatever the row order, and the time
no leaf span covers comes out as ``gap`` rows that, with the path's spans, tile the window to the nanosecond.
A seeded random check compares the gaps against a brute-force coverage of the leaves. The real request's path
and the waterfall that draws it are in tests/test_viz.py.
"""
from __future__ import annotations

import random

import pandas as pd
import pytest

from epd_lab.trace import GAP, PATH_COLUMNS, Span, critical_path, spans_frame, summarize_critical_paths

MS = 1_000_000


def _frame(*spans: tuple, rid: str = "r") -> pd.DataFrame:
    """Spans of one request from ``(stage, start_ms, end_ms[, node[, part]])``; a part's spans get its
    ``_local_part_N`` id as the encoders record them."""
    out = []
    for stage, start, end, *rest in spans:
        node = rest[0] if rest else "n"
        part = rest[1] if len(rest) > 1 else -1
        out.append(Span(rid if part < 0 else f"{rid}_local_part_{part}", part, stage, node, int(start * MS),
                        int(end * MS)))
    return spans_frame(out)


def _rows(path: pd.DataFrame) -> list[tuple]:
    """The path as ``(stage, start_ms, end_ms)`` (ms from the anchor's start), gaps with their ``between``."""
    w0 = path.attrs["anchor"]["t_start_ns"]
    return [(r.stage if r.kind == "span" else f"gap {r.between}", (r.t_start_ns - w0) / MS, (r.t_end_ns - w0) / MS)
            for r in path.itertuples()]


def _tiles(path: pd.DataFrame) -> bool:
    """The rows follow each other without hole or overlap from the anchor's start to its end."""
    a = path.attrs["anchor"]
    bounds = [a["t_start_ns"], *(x for r in path.itertuples() for x in (r.t_start_ns, r.t_end_ns)), a["t_end_ns"]]
    return all(bounds[i] == bounds[i + 1] for i in range(0, len(bounds), 2)) and (path.t_end_ns > path.t_start_ns).all()


def test_containers_are_left_out_and_gaps_fill_the_rest():
    frame = _frame(("ttft", 0, 100, "proxy"), ("e2e", 0, 150, "proxy"),
                   ("http_encode", 5, 30, "prefill", 0), ("load", 10, 15, "encoder", 0),  # load inside http_encode
                   ("vit", 16, 60, "encoder", 0), ("http_send", 31, 70, "prefill", 0),
                   ("transfer", 61, 62, "encoder", 0),  # inside http_send
                   ("prefill", 70, 95, "prefill"), ("decode_step", 120, 130, "decode", 1))
    path = critical_path(frame, "r")
    assert tuple(path.columns) == PATH_COLUMNS
    assert _rows(path) == [("gap start→load", 0, 10), ("load", 10, 15), ("gap load→vit", 15, 16), ("vit", 16, 60),
                           ("gap vit→transfer", 60, 61), ("transfer", 61, 62), ("gap transfer→prefill", 62, 70),
                           ("prefill", 70, 95), ("gap prefill→end", 95, 100)]
    assert _tiles(path) and path.attrs["anchor"]["ms"] == 100.0
    assert (path.t_end_ns - path.t_start_ns).sum() == 100 * MS and path.dur_ms.sum() == pytest.approx(100.0)
    spans = path[path.kind == "span"]
    assert list(spans.node) == ["encoder", "encoder", "encoder", "prefill"] and list(spans.part) == [0, 0, 0, -1]
    assert list(spans.req_id) == ["r_local_part_0"] * 3 + ["r"]
    # `span` names each row of the frame it came from; gaps have none
    assert [frame.loc[i, "stage"] for i in spans.span] == list(spans.stage) and path[path.kind == GAP].span.isna().all()
    assert list(path.stage[path.kind == GAP].unique()) == [GAP] and (path.node[path.kind == GAP] == "").all()
    # start_ms/end_ms count from the request's first span, as the frame's do
    assert path.start_ms.iloc[0] == 0.0 and path.end_ms.iloc[-1] == 100.0


def test_only_the_same_part_or_a_request_wide_span_contains():
    # the receiver's register (request-wide) and the other encoder's load (part 1) ran while part 0's vit did:
    # vit stays a leaf; a request-wide span (a decode's wait) holds whatever lies inside it, of any part
    frame = _frame(("ttft", 0, 50), ("vit", 0, 30, "encoder", 0), ("register", 10, 11, "prefill"),
                   ("load", 12, 14, "encoder2", 1), ("wait", 30, 50, "decode"), ("kv_transfer", 35, 45, "decode", 1),
                   ("prefill", 45, 50, "prefill"))
    assert _rows(critical_path(frame, "r")) == [("vit", 0, 30), ("gap vit→kv_transfer", 30, 35),
                                                ("kv_transfer", 35, 45), ("prefill", 45, 50)]


def test_partial_overlaps_and_spans_past_the_window_are_clipped():
    frame = _frame(("ttft", 10, 110), ("early", 0, 20), ("a", 15, 60), ("b", 50, 80), ("c", 90, 130))
    # c runs past the end, early began before the start; a still runs when b starts, so a counts until then
    assert _rows(critical_path(frame, "r")) == [("early", 0, 5), ("a", 5, 40), ("b", 40, 70),
                                                ("gap b→c", 70, 80), ("c", 80, 100)]


def test_a_predecessor_that_ends_at_the_cursor_beats_one_running_across_it():
    # (three parts, so that no span holds another)
    frame = _frame(("ttft", 0, 40), ("long", 0, 35, "x", 1), ("short", 10, 30, "y", 0), ("next", 30, 40, "y", 0),
                   ("same_end", 20, 30, "z", 2))
    # at 30: long runs across, short and same_end end there; short wins (it started earlier)
    assert _rows(critical_path(frame, "r")) == [("long", 0, 10), ("short", 10, 30), ("next", 30, 40)]


@pytest.mark.parametrize("seed", range(4))
def test_identical_bounds_give_one_leaf_whatever_the_row_order(seed):
    spans = [("ttft", 0, 30, "proxy"), ("same_a", 0, 30, "n1"), ("b", 10, 20, "n1"), ("b2", 10, 20, "n2"),
             ("c", 20, 25, "n2"), ("c_twin", 20, 25, "n1")]
    random.Random(seed).shuffle(spans)
    path = critical_path(_frame(*spans), "r")
    # same_a has the anchor's bounds and holds b: a container; of b/b2 and c/c_twin the last by stage is a leaf
    assert _rows(path) == [("gap start→b2", 0, 10), ("b2", 10, 20), ("c_twin", 20, 25), ("gap c_twin→end", 25, 30)]


def test_zero_length_spans_cover_nothing_and_contain_nothing():
    frame = _frame(("ttft", 0, 10), ("vit", 0, 8, "encoder", 0), ("notify", 4, 4, "encoder", 0))
    assert _rows(critical_path(frame, "r")) == [("vit", 0, 8), ("gap vit→end", 8, 10)]


def test_no_spans_in_the_window_is_one_gap():
    frame = _frame(("ttft", 0, 10, "proxy"), ("e2e", 0, 20, "proxy"), ("decode_step", 12, 15, "decode", 1))
    path = critical_path(frame, "r")
    assert _rows(path) == [("gap start→end", 0, 10)] and _tiles(path)


def test_which_request_and_which_window():
    frame = pd.concat([_frame(("e2e", 0, 30, "proxy"), ("vit", 5, 12, "encoder", 0), ("prefill", 14, 25, "prefill"),
                              rid="abc"),
                       _frame(("ttft", 0, 5), ("vit", 1, 2, "encoder", 0), rid="abc1")], ignore_index=True)
    # a response's id names its request; its parts are in, a request whose id merely starts with it is not
    path = critical_path(frame, "chatcmpl-abc", until="e2e")
    assert _rows(path) == [("gap start→vit", 0, 5), ("vit", 5, 12), ("gap vit→prefill", 12, 14),
                           ("prefill", 14, 25), ("gap prefill→end", 25, 30)]
    assert path.attrs["anchor"]["request"] == "abc" and path.attrs["anchor"]["until"] == "e2e"
    # until=None: the envelope of the request's spans (from the first span's start to the last one's end)
    envelope = critical_path(frame, "abc", until=None)
    assert envelope.attrs["anchor"]["ms"] == 30.0 and _rows(envelope) == _rows(path)
    with pytest.raises(ValueError, match=r"no 'ttft' span \(stages: \['e2e', 'prefill', 'vit'\]\).*until='e2e'"):
        critical_path(frame, "abc")
    with pytest.raises(ValueError, match="no spans of request 'nope'.*'abc', 'abc1'"):
        critical_path(frame, "nope")


def test_two_anchor_spans_take_the_first():
    frame = _frame(("ttft", 0, 10), ("ttft", 2, 30), ("a", 1, 4), ("b", 12, 20))
    path = critical_path(frame, "r")
    assert path.attrs["anchor"]["ms"] == 10.0 and _rows(path) == [("gap start→a", 0, 1), ("a", 1, 4),
                                                                   ("gap a→end", 4, 10)]


@pytest.mark.parametrize("seed", range(25))
def test_gaps_are_exactly_the_time_no_leaf_covers(seed):
    rng = random.Random(seed)
    spans = [("ttft", 0, 1000, "proxy")]
    for i in range(rng.randint(1, 25)):
        start = rng.randint(-100, 1050)
        spans.append((f"s{i % 7}", start, start + rng.choice([0, 1, rng.randint(1, 400)]),
                      f"node{rng.randint(0, 2)}", rng.choice([-1, 0, 1])))
    frame = _frame(*spans)
    path = critical_path(frame, "r")
    assert _tiles(path) and (path.t_end_ns - path.t_start_ns).sum() == 1000 * MS

    # brute force: a leaf has positive duration and holds no other span (itself request-wide or of its part);
    # of spans with identical bounds all are kept here (they cover the same time; the tie rule has its own test)
    rows = [r for r in frame.itertuples() if r.t_end_ns > r.t_start_ns]

    def holds(a, b) -> bool:
        return (a.t_start_ns <= b.t_start_ns and b.t_end_ns <= a.t_end_ns and (a.part < 0 or a.part == b.part)
                and (a.t_start_ns, a.t_end_ns) != (b.t_start_ns, b.t_end_ns))

    leaves = [r for r in rows if r.stage != "ttft" and not any(holds(r, o) for o in rows)]
    on_path = path[path.kind == "span"]
    assert set(on_path.span) <= {r.Index for r in leaves}
    for r in on_path.itertuples():  # each path row lies inside its span
        assert frame.loc[r.span, "t_start_ns"] <= r.t_start_ns and r.t_end_ns <= frame.loc[r.span, "t_end_ns"]
    # every ms of the window is covered by some leaf exactly when it is not in a gap
    gaps = [(r.t_start_ns, r.t_end_ns) for r in path.itertuples() if r.kind == GAP]
    for t in range(0, 1000):
        mid = t * MS + MS // 2
        covered = any(r.t_start_ns <= mid < r.t_end_ns for r in leaves)
        assert covered != any(start <= mid < end for start, end in gaps), t


def test_summary_over_requests():
    def request(rid, vit, gap_mid, prefill, end_gap):
        t = 0.0
        spans = []
        for stage, dur in (("vit", vit), (None, gap_mid), ("prefill", prefill), (None, end_gap)):
            if stage:
                spans.append((stage, t, t + dur, stage, 0 if stage == "vit" else -1))
            t += dur
        return _frame(("ttft", 0, t, "proxy"), *spans, rid=rid)

    frame = pd.concat([request("a", 10, 0, 8, 0), request("b", 20, 0, 15, 5), request("c", 30, 4, 6, 0),
                       _frame(("e2e", 0, 5), ("vit", 0, 5, "x", 0), rid="no-ttft")], ignore_index=True)
    summary = summarize_critical_paths(frame)
    assert summary.attrs == {"until": "ttft", "requests": ["a", "b", "c"]}  # no-ttft has no anchor: left out
    assert list(summary.index) == ["vit", "prefill", "gap", "ttft"]  # in path order, gap and the window last
    assert list(summary.on_path) == [3, 3, 2, 3]
    assert summary.loc["vit", ["median_ms", "min_ms", "max_ms"]].tolist() == [20, 10, 30]
    assert summary.loc["ttft", ["median_ms", "min_ms", "max_ms"]].tolist() == [40, 18, 40]
    # gap: a none (counts 0) of 18 ms, b 5 of 40, c 4 of 40
    assert summary.loc["gap", ["median_ms", "min_ms", "max_ms"]].tolist() == [4, 0, 5]
    assert summary.loc["gap", ["median_pct", "min_pct", "max_pct"]].tolist() == pytest.approx([10, 0, 12.5])
    assert summary.loc["ttft", ["median_pct", "min_pct", "max_pct"]].tolist() == [100, 100, 100]
    one = summarize_critical_paths(frame, ["chatcmpl-b"])
    assert one.loc["gap", "median_ms"] == 5 and one.loc["gap", "median_pct"] == 12.5 and one.attrs["requests"] == ["b"]
    whole = summarize_critical_paths(frame, until=None)
    assert whole.attrs["requests"] == ["a", "b", "c", "no-ttft"] and whole.index[-1] == "window"
    with pytest.raises(ValueError, match="no 'ttft' span"):
        summarize_critical_paths(frame, ["a", "no-ttft"])
    with pytest.raises(ValueError, match="no spans of request 'zz'"):
        summarize_critical_paths(frame, ["zz"])
    with pytest.raises(ValueError, match="no request with a 'tpot' span"):
        summarize_critical_paths(frame, until="tpot")


def test_clock_errors_count_where_a_row_spans_two_clocks():
    # the encoder's spans came from another clock (error ±0.2 ms); proxy and prefill read the collector's
    spans = [Span("r", -1, "ttft", "proxy", 0, 100 * MS), Span("r_local_part_0", 0, "vit", "enc", 10 * MS, 40 * MS),
             Span("r_local_part_0", 0, "transfer", "enc", 40 * MS, 50 * MS),
             Span("r", -1, "prefill", "prefill", 60 * MS, 120 * MS)]
    frame = spans_frame(spans, {"enc": 0}, {"enc": MS // 5})
    path = critical_path(frame, "r")
    assert [(r[0], r[1]) for r in zip(path.stage, path.clock_err_ms)] == [
        ("gap", 0.2),  # ttft's start (proxy) → vit's start (enc)
        ("vit", 0.0), ("transfer", 0.0),  # both bounds on the encoder's clock
        ("gap", 0.2),  # transfer's end (enc) → prefill's start
        ("prefill", 0.0)]  # clipped to ttft's end: proxy and prefill read one clock
    assert path.attrs["anchor"]["clock_err_ms"] == 0.0
    assert critical_path(frame, "r", until=None).attrs["anchor"]["clock_err_ms"] == 0.0  # prefill → prefill
