"""Timed spans of protocol stages (DESIGN.md §5), recorded in every process.

A span is ``(req_id, part, stage, node, t_start_ns, t_end_ns, nbytes)``. Clocks are CLOCK_MONOTONIC
(`time.monotonic_ns`), which all processes of one host share, so spans from the encoders and the
receiver line up without correction. Spans recorded by an encoder travel back to the receiver inside
its notification message.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Iterator

import msgspec

STAGES = ("http_encode", "load", "vit", "buffer_alloc", "register", "http_send", "transfer", "notify", "reassemble",
          "prefill")


class Span(msgspec.Struct, array_like=True, frozen=True):
    """One timed stage of one request part on one node."""

    req_id: str
    part: int
    stage: str
    node: str
    t_start_ns: int
    t_end_ns: int
    nbytes: int = 0

    @property
    def duration_ms(self) -> float:
        return (self.t_end_ns - self.t_start_ns) / 1e6


class Recorder:
    """A bounded in-memory buffer of spans (the oldest are dropped first)."""

    def __init__(self, node: str | None = None, capacity: int = 100_000) -> None:
        self.node = node or f"pid{os.getpid()}"
        self._spans: collections.deque[Span] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    def extend(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)

    @contextlib.contextmanager
    def span(self, stage: str, req_id: str, part: int = -1, nbytes: int = 0) -> Iterator[None]:
        """Record the time the body takes as `stage` (recorded also when it raises)."""
        t0 = time.monotonic_ns()
        try:
            yield
        finally:
            self.add(Span(req_id, part, stage, self.node, t0, time.monotonic_ns(), nbytes))

    def spans(self, req_id_prefix: str | None = None) -> list[Span]:
        """A copy of the spans, optionally of one request (its parts share the rid prefix)."""
        with self._lock:
            spans = list(self._spans)
        if req_id_prefix is None:
            return spans
        return [s for s in spans if s.req_id.startswith(req_id_prefix)]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()


DATA_STAGES = ("vit", "transfer", "prefill")


def request_breakdown(spans: list[Span]) -> dict[str, float]:
    """One request's latency decomposed as in the seed's §10.1, in ms.

    Per stage: the longest part (parts run in parallel on different encoders). ``e2e``: first span
    start to last span end. ``control_plane``: ``e2e`` minus the data work on the critical path, i.e.
    minus the slowest part's ``vit + transfer`` and minus ``prefill``: HTTP, media loading (also
    reported alone as ``load``), allocation, registration, notification, reassembly and waiting.
    """
    if not spans:
        raise ValueError("no spans")
    per_stage: dict[str, dict[int, float]] = {}
    for s in spans:
        parts = per_stage.setdefault(s.stage, {})
        parts[s.part] = parts.get(s.part, 0.0) + s.duration_ms
    out = {stage: max(parts.values()) for stage, parts in per_stage.items()}
    out["e2e"] = (max(s.t_end_ns for s in spans) - min(s.t_start_ns for s in spans)) / 1e6
    part_ids = {s.part for s in spans if s.stage in ("vit", "transfer")}
    data = max((per_stage.get("vit", {}).get(p, 0.0) + per_stage.get("transfer", {}).get(p, 0.0) for p in part_ids),
               default=0.0)
    out["control_plane"] = out["e2e"] - data - out.get("prefill", 0.0)
    return out
