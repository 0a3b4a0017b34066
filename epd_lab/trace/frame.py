"""Spans as one table (pandas), and its exports: Chrome/Perfetto trace JSON, parquet and CSV.

pandas is imported inside the functions: the servers import `epd_lab.trace` for `Span` and should not
pay for pandas at start-up.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from epd_lab.trace.spans import Span

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ("req_id", "request", "part", "stage", "node", "t_start_ns", "t_end_ns", "nbytes", "start_ms", "end_ms",
           "duration_ms")
_CLOCK_ATTRS = ("clock_offsets", "clock_errors")
_PART_SUFFIX = re.compile(r"_local_part_\d+$")


def request_of(req_id: str) -> str:
    """The request a span belongs to: its req_id without the seed's ``_local_part_N`` suffix."""
    return _PART_SUFFIX.sub("", req_id)


def spans_frame(spans: Iterable[Span], clock_offsets: Mapping[str, int] | None = None,
                clock_errors: Mapping[str, int] | None = None) -> pd.DataFrame:
    """One row per span, ordered by start.

    A span held by two recorders (the encoder's own ``notify`` and the copy its receiver ended on
    arrival; the proxy's copies of the prefill's and decode's spans) appears once, with the later end.

    `clock_offsets` maps a node to the ns to subtract from its timestamps to bring them onto this
    host's CLOCK_MONOTONIC (zero for nodes on this host); it is kept in ``frame.attrs["clock_offsets"]``, and
    `clock_errors` (ns per node: how far each offset may be off, `collect.ClockOffset.error_ns`) in
    ``frame.attrs["clock_errors"]``.
    ``start_ms``/``end_ms`` count from the first span of the same ``request``.
    """
    import pandas as pd

    offsets = dict(clock_offsets or {})
    unique: dict[tuple, Span] = {}
    for s in spans:
        key = (s.req_id, s.part, s.stage, s.node, s.t_start_ns)
        if key not in unique or s.t_end_ns > unique[key].t_end_ns:
            unique[key] = s
    rows = [(s.req_id, request_of(s.req_id), s.part, s.stage, s.node, s.t_start_ns - offsets.get(s.node, 0),
             s.t_end_ns - offsets.get(s.node, 0), s.nbytes) for s in unique.values()]
    frame = pd.DataFrame(rows, columns=list(COLUMNS[:8])).astype(
        {"part": "int64", "t_start_ns": "int64", "t_end_ns": "int64", "nbytes": "int64"})
    t0 = frame.groupby("request")["t_start_ns"].transform("min")
    frame["start_ms"] = (frame["t_start_ns"] - t0) / 1e6
    frame["end_ms"] = (frame["t_end_ns"] - t0) / 1e6
    frame["duration_ms"] = (frame["t_end_ns"] - frame["t_start_ns"]) / 1e6
    frame = frame.sort_values(["t_start_ns", "t_end_ns"], kind="stable").reset_index(drop=True)
    frame.attrs["clock_offsets"] = offsets
    frame.attrs["clock_errors"] = dict(clock_errors or {})
    return frame


def frame_spans(frame: pd.DataFrame) -> list[Span]:
    """The spans of a frame (the inverse of `spans_frame`, on the corrected clock)."""
    return [Span(r.req_id, int(r.part), r.stage, r.node, int(r.t_start_ns), int(r.t_end_ns), int(r.nbytes))
            for r in frame.itertuples(index=False)]


def clock_label(node: str, offsets: Mapping[str, int], errors: Mapping[str, int]) -> str:
    """`node`, with the offset its spans were moved by and that offset's error when it is not the collector's
    own clock (a nonzero offset or error)."""
    offset, error = int(offsets.get(node, 0)), int(errors.get(node, 0))
    if not offset and not error:
        return node
    return f"{node} · clock {offset / 1e6:+.3f} ms ± {error / 1e6:.3f} ms"


def to_chrome_trace(frame: pd.DataFrame, path: str | Path | None = None) -> dict[str, Any]:
    """The frame as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

    One process track per node, one thread per request part; complete (``"X"``) events in µs from the
    frame's first span, with the bytes and request in ``args``. A node whose spans were moved onto this
    clock has its offset and error in its track's name (``encoder:1 · clock -3000.000 ms ± 0.150 ms``); all
    offsets and errors are in ``otherData``. Written to `path` when given.
    """
    t0 = int(frame["t_start_ns"].min()) if len(frame) else 0
    nodes = {node: pid for pid, node in enumerate(sorted(frame["node"].unique()), start=1)}
    tracks: dict[tuple[str, str, int], int] = {}
    offsets, errors = frame.attrs.get("clock_offsets", {}), frame.attrs.get("clock_errors", {})
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": clock_label(node, offsets, errors)}}
        for node, pid in nodes.items()]
    for r in frame.itertuples(index=False):
        pid = nodes[r.node]
        key = (r.node, r.request, int(r.part))
        if key not in tracks:
            tracks[key] = len(tracks) + 1
            label = r.request if r.part < 0 else f"{r.request} part {r.part}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tracks[key], "args": {"name": label}})
        events.append({"ph": "X", "name": r.stage, "cat": "epd", "pid": pid, "tid": tracks[key],
                       "ts": (r.t_start_ns - t0) / 1e3, "dur": (r.t_end_ns - r.t_start_ns) / 1e3,
                       "args": {"req_id": r.req_id, "part": int(r.part), "nbytes": int(r.nbytes)}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"clock": "CLOCK_MONOTONIC", "t0_ns": t0,
                           "clock_offsets_ns": {k: int(v) for k, v in offsets.items()},
                           "clock_errors_ns": {k: int(v) for k, v in errors.items()}}}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def save_frame(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write the frame as parquet (``.parquet``) or CSV (``.csv``); the clock offsets and errors go along
    (parquet keeps ``attrs``; CSV gets them in a ``<name>.offsets.json`` beside it)."""
    path = Path(path)
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
        path.with_suffix(".offsets.json").write_text(json.dumps({k: frame.attrs.get(k, {}) for k in _CLOCK_ATTRS}))
    else:
        raise ValueError(f"unknown span table format {path.suffix!r}: use .parquet or .csv")
    return path


def load_frame(path: str | Path) -> pd.DataFrame:
    """Read a frame written by `save_frame`."""
    import pandas as pd

    path = Path(path)
    if path.suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif path.suffix == ".csv":
        frame = pd.read_csv(path, dtype={"req_id": str, "request": str, "stage": str, "node": str})
        offsets = path.with_suffix(".offsets.json")
        if offsets.exists():
            frame.attrs.update(json.loads(offsets.read_text()))
    else:
        raise ValueError(f"unknown span table format {path.suffix!r}: use .parquet or .csv")
    for key in _CLOCK_ATTRS:
        frame.attrs.setdefault(key, {})
    return frame
