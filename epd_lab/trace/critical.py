"""Where a request's time went: the critical path of its TTFT through the spans, and the time no span covers.

The path is cut out of one request's spans (all nodes, its ``_local_part_N`` parts included) inside an
**anchor window**: by default the proxy's ``ttft`` span; `until` names another enclosing stage (``e2e`` for a
request that was not streamed, so has no ``ttft``), or is None for the envelope of all the request's spans (an
E→P request driven in-process has no proxy span at all).

Only **leaf** spans lie on a path. A span that contains another span of the request is a **container**
(``ttft``, ``e2e``, a receiver's ``http_encode`` around the encoder's ``load``, ``http_send`` around its
``transfer``); containers are found from the nesting, not from a list of names. "Contains" means both bounds
within its own, and the outer span request-wide (``part`` -1) or of the same part: a part's span waits only on
its own part's work, so an encoder's ``vit`` is no container for the receiver's ``register`` that ran while it
did. Of spans with identical bounds the first in the order anchor, then ``(part, stage, node, req_id)`` counts
as the outermost and the last as the leaf, so the leaf does not depend on the order of the frame's rows.
Spans of zero duration cover no time and are ignored.

The walk goes backwards from the window's end. At the cursor it takes, among the leaves that start before the
cursor, the one whose end (clipped to the cursor and to the window) is latest; on a tie one that really ends
there (the cursor's predecessor) beats one still running across it, then the earlier start wins. The time
between that end and the cursor becomes a ``gap`` row and the cursor moves to the span's start; what is left
before the window's start when no leaf remains is a gap too. Clipping to the cursor means a span still running
across it counts for the part before it, so a gap is exactly time that no leaf span covers: queueing, event
loops, HTTP and serialization (time inside a container but outside its leaves is such a gap). The rows tile
the window: their ``t_end_ns - t_start_ns`` add up to the anchor's duration exactly.

Clocks: each row's two bounds were read on some node's clock (a span's own bounds on its node's; a bound
clipped to the window on the anchor's; a gap's on the spans either side of it). When both are one node's, the
row's length is exact; otherwise each clock's offset error (``frame.attrs["clock_errors"]``, from `collect`)
may add to it: ``clock_err_ms`` is their sum, 0 for everything on one clock.

Causality is inferred from the timestamps and parts only (spans carry no parent links): a request-wide leaf
(``prefill``, ``kv_write``) with a span of the same request lying inside it by chance would count as a
container.

pandas is imported inside the functions, as in `frame` (the servers import `epd_lab.trace`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterable, Mapping, NamedTuple

from epd_lab.trace.spans import bare_request_id

if TYPE_CHECKING:
    import pandas as pd

PATH_COLUMNS = ("stage", "node", "part", "req_id", "span", "t_start_ns", "t_end_ns", "start_ms", "end_ms", "dur_ms",
                "kind", "between", "clock_err_ms")
GAP = "gap"


class _Span(NamedTuple):
    t_start: int
    t_end: int
    stage: str
    node: str
    part: int
    req_id: str
    label: Hashable  # the row's index label in the caller's frame


def _leaves(spans: list[_Span], anchor: _Span | None) -> list[_Span]:
    """The spans that contain no other span, the anchor excluded.

    Sorted by start, then end descending (then the tie rule for identical bounds), every span a span contains
    comes after it; so within a group a span is a container exactly when some later one ends no later than it.
    A request-wide span (part -1) is judged against all spans, a part's span against its own part's only.
    """
    order = sorted(spans, key=lambda s: (s.t_start, -s.t_end, s is not anchor, s.part, s.stage, s.node, s.req_id))

    def containers(indices: list[int]) -> set[int]:
        found: set[int] = set()
        min_end_after: int | None = None
        for i in reversed(indices):
            if min_end_after is not None and min_end_after <= order[i].t_end:
                found.add(i)
            min_end_after = order[i].t_end if min_end_after is None else min(min_end_after, order[i].t_end)
        return found

    by_part: dict[int, list[int]] = {}
    for i, s in enumerate(order):
        by_part.setdefault(s.part, []).append(i)
    outer = {i for i in containers(list(range(len(order)))) if order[i].part < 0}
    for part, indices in by_part.items():
        if part >= 0:
            outer |= containers(indices)
    return [s for i, s in enumerate(order) if i not in outer and s is not anchor]


def _walk(leaves: list[_Span], w0: int, w1: int) -> list[tuple[_Span | None, int, int]]:
    """The path through `leaves` over the window ``[w0, w1)`` as (span or None for a gap, start, end), in time
    order."""
    clipped = [(max(s.t_start, w0), min(s.t_end, w1), s) for s in leaves if s.t_start < w1 and s.t_end > w0]
    path: list[tuple[_Span | None, int, int]] = []
    cursor = w1
    while cursor > w0:
        before = [c for c in clipped if c[0] < cursor]
        if not before:
            path.append((None, w0, cursor))
            break
        start, end, span = min(before, key=lambda c: (-min(c[1], cursor), c[1] > cursor, c[0], c[2].stage,
                                                      c[2].node, c[2].part, c[2].req_id))
        end = min(end, cursor)
        if end < cursor:
            path.append((None, end, cursor))
        path.append((span, start, end))
        cursor = start
    return path[::-1]


def _no_request(request_id: str, requests: Iterable[str]) -> ValueError:
    return ValueError(f"no spans of request {request_id!r}; requests: {sorted(set(requests))[:20]}")


def _clock_errors(walk: list[tuple[_Span | None, int, int]], first: str, last: str,
                  errors: Mapping[str, int]) -> list[float]:
    """Per row of `walk`, the bound on its length's error from clock offsets (ms): the errors of the clocks its
    two bounds were read on, when they are two. `first` and `last` own the window's bounds. A gap lies between
    two spans, and a span clipped at its end is clipped by the next span's start (no gap follows it)."""
    nodes = [first, *(span.node if span else "" for span, _, _ in walk), last]
    rows = []
    for i, (span, start, end) in enumerate(walk, start=1):
        a = span.node if span and start == span.t_start else nodes[i - 1]
        b = span.node if span and end == span.t_end else nodes[i + 1]
        rows.append(0.0 if a == b else (errors.get(a, 0) + errors.get(b, 0)) / 1e6)
    return rows


def _path(rows: pd.DataFrame, request: str, until: str | None, errors: Mapping[str, int]) -> pd.DataFrame:
    """`critical_path` on the rows of one request."""
    import pandas as pd

    spans = [_Span(int(r.t_start_ns), int(r.t_end_ns), r.stage, r.node, int(r.part), r.req_id, label)
             for label, r in zip(rows.index, rows.itertuples(index=False))]
    if until is None:
        anchor = None
        first = min(spans, key=lambda s: s.t_start)
        last = max(spans, key=lambda s: s.t_end)
        w0, w1, nodes = first.t_start, last.t_end, (first.node, last.node)
    else:
        named = [s for s in spans if s.stage == until]
        if not named:
            raise ValueError(f"request {request!r} has no {until!r} span (stages: {sorted(set(rows['stage']))}); "
                             f"name another enclosing stage (e.g. until='e2e') or until=None for all its spans")
        # one anchor per request is the rule; should there be two, the one that starts first (then lasts longest)
        anchor = min(named, key=lambda s: (s.t_start, -s.t_end))
        w0, w1, nodes = anchor.t_start, anchor.t_end, (anchor.node, anchor.node)
    covering = [s for s in spans if s.t_end > s.t_start]
    walk = _walk(_leaves(covering, anchor), w0, w1)
    stages = ["start", *(span.stage if span else GAP for span, _, _ in walk), "end"]
    path = pd.DataFrame({
        "stage": stages[1:-1], "node": [span.node if span else "" for span, _, _ in walk],
        "part": pd.Series([span.part if span else -1 for span, _, _ in walk], dtype="int64"),
        "req_id": [span.req_id if span else "" for span, _, _ in walk],
        "span": pd.Series([span.label if span else None for span, _, _ in walk], dtype=object),
        "t_start_ns": pd.Series([start for _, start, _ in walk], dtype="int64"),
        "t_end_ns": pd.Series([end for _, _, end in walk], dtype="int64"),
    })
    t0 = int(rows["t_start_ns"].min())
    path["start_ms"] = (path["t_start_ns"] - t0) / 1e6
    path["end_ms"] = (path["t_end_ns"] - t0) / 1e6
    path["dur_ms"] = (path["t_end_ns"] - path["t_start_ns"]) / 1e6
    path["kind"] = ["span" if span else GAP for span, _, _ in walk]
    path["between"] = [f"{stages[i]}→{stages[i + 2]}" if span is None else "" for i, (span, _, _) in enumerate(walk)]
    path["clock_err_ms"] = _clock_errors(walk, *nodes, errors)
    window_err = 0 if nodes[0] == nodes[1] else errors.get(nodes[0], 0) + errors.get(nodes[1], 0)
    path.attrs["anchor"] = {"request": request, "until": until, "t_start_ns": w0, "t_end_ns": w1,
                            "ms": (w1 - w0) / 1e6, "clock_err_ms": window_err / 1e6}
    return path


def critical_path(frame: pd.DataFrame, request_id: str, until: str | None = "ttft") -> pd.DataFrame:
    """The critical path of one request through the spans of `frame` (`spans_frame`, `Cluster.spans`).

    `request_id` may be a response's id (``chatcmpl-…``). The window is the request's `until` span (the
    proxy's ``ttft`` by default; a ValueError names the stages there are when it has none), or with
    ``until=None`` the envelope of all its spans. The rows tile the window in time order (columns
    `PATH_COLUMNS`): ``kind`` is ``"span"`` for a leaf span's part on the path (``stage``, ``node``,
    ``part``, ``req_id``, and ``span``, the span's index label in `frame`) or ``"gap"`` for time no leaf span
    covers (``stage`` ``"gap"``, ``between`` e.g. ``"load→vit"``, ``"start→…"``, ``"…→end"``). ``start_ms``/
    ``end_ms`` count from the request's first span, as in the frame; ``t_end_ns - t_start_ns`` add up to the
    window exactly. ``clock_err_ms``: how far a row's length may be off from clock offsets between hosts (0 on
    one clock). ``attrs["anchor"]``: ``request``, ``until``, ``t_start_ns``, ``t_end_ns``, ``ms``,
    ``clock_err_ms``.
    The rules (leaves, ties, clipping) are in this module's docstring.
    """
    request = bare_request_id(request_id)
    rows = frame[frame["request"] == request]
    if rows.empty:
        raise _no_request(request_id, frame["request"])
    return _path(rows, request, until, frame.attrs.get("clock_errors", {}))


def summarize_critical_paths(frame: pd.DataFrame, request_ids: Iterable[str] | None = None,
                             until: str | None = "ttft") -> pd.DataFrame:
    """Per stage, the time on the critical paths of several requests, for a benchmark's printout.

    `request_ids` default to every request of `frame` that has an `until` span (all with ``until=None``).
    One row per stage that lies on some path, in the order they come along the paths (median first offset
    from the window's start), then ``gap`` (all of a path's gaps together), then the window itself (named
    `until`, or ``window``). Columns: ``on_path`` (requests whose path has the stage), ``median_ms``,
    ``min_ms``, ``max_ms`` and ``median_pct``, ``min_pct``, ``max_pct`` (share of each request's window); a
    request whose path lacks a stage counts 0 for it. ``attrs``: ``until``, ``requests``.
    """
    import pandas as pd

    groups = dict(tuple(frame.groupby("request", sort=False)))
    if request_ids is None:
        ids = [r for r, rows in groups.items() if until is None or (rows["stage"] == until).any()]
    else:
        ids = [bare_request_id(r) for r in request_ids]
    if not ids:
        raise ValueError(f"no request with a {until!r} span" if request_ids is None else "no requests")
    per_request, offsets, windows = {}, {}, {}
    for rid in ids:
        if rid not in groups:
            raise _no_request(rid, groups)
        path = _path(groups[rid], rid, until, frame.attrs.get("clock_errors", {}))
        w0, windows[rid] = path.attrs["anchor"]["t_start_ns"], path.attrs["anchor"]["ms"]
        per_request[rid] = path.groupby("stage")["dur_ms"].sum()
        offsets[rid] = path[path["kind"] == "span"].groupby("stage")["t_start_ns"].min().sub(w0)
    ms = pd.DataFrame(per_request).T
    first = pd.DataFrame(offsets).T
    stages = sorted(first.columns, key=lambda s: (first[s].median(), s))
    window = until or "window"
    ms = ms.reindex(columns=[*stages, GAP]).assign(**{window: pd.Series(windows)})
    on_path = ms.notna().sum()
    ms = ms.fillna(0.0)
    pct = ms.div(ms[window], axis=0) * 100
    summary = pd.DataFrame({"on_path": on_path, "median_ms": ms.median(), "min_ms": ms.min(), "max_ms": ms.max(),
                            "median_pct": pct.median(), "min_pct": pct.min(), "max_pct": pct.max()})
    summary.index.name = "stage"
    summary.attrs.update(until=until, requests=ids)
    return summary
