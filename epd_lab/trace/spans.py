"""Timed spans of protocol stages, recorded in every process.

A span is ``(req_id, part, stage, node, t_start_ns, t_end_ns, nbytes)``. Clocks are CLOCK_MONOTONIC
(`time.monotonic_ns`), which all processes of one boot and one time namespace share (`clock_id`), so spans
from the encoders and the receiver of one host line up without correction; `collect` puts other clocks'
spans on the collector's. Spans recorded by an encoder travel back to the receiver inside its notification
message.

Tracing is on unless the environment says ``EPD_TRACE=0`` (`Topology(trace=False)` sets it for a whole
cluster); `epd-lab bench epd --trace-overhead` measures what it costs.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import socket
import threading
import time
from typing import Iterable, Iterator

import msgspec

# ``intake``: a role's route took the request until its work began (admission, the body read, the hop to a
# worker thread, its decoding): the prefill's, then each encoder part's. ``store_get`` / ``store_put``: the
# encoder's global embedding cache (an item taken from Mooncake Store instead of the ViT; a put behind the send).
STAGES = ("intake", "http_encode", "load", "decode", "store_get", "vit", "store_put", "buffer_alloc", "register",
          "http_send", "transfer", "notify", "reassemble", "prefill")
# The P→D stages and the proxy's per-request spans, in the order a request meets them.
PD_STAGES = ("proxy_parse", "kv_write", "kv_query", "kv_transfer", "ttft", "decode_step", "tpot", "e2e")
# The spans that move bytes between the roles on a split request's TTFT path (the split's target leaves them
# out: "split − floor ≤ 3 ms plus the transfer spans").
TRANSFER_STAGES = ("transfer", "notify", "kv_write")


@functools.cache
def clock_id() -> str:
    """Which CLOCK_MONOTONIC this process reads: the kernel's boot id and the time namespace (which may offset
    it, ``unshare --time``). Two processes with the same id read the same clock; on a system without these
    files, the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/time')}"
    except OSError:
        return socket.gethostname()


def tracing_enabled() -> bool:
    """Whether this process records spans (``EPD_TRACE=0`` turns it off)."""
    return os.environ.get("EPD_TRACE", "1") != "0"


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


def bare_request_id(request_id: str) -> str:
    """A request's id from an OpenAI response's (``chatcmpl-``/``cmpl-`` + id), or unchanged."""
    return request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")


def of_request(spans: Iterable[Span], request_id: str | None) -> list[Span]:
    """The spans of one request (its ``_local_part_N`` parts included; a response's id names its request),
    or all of them when `request_id` is None."""
    if not request_id:
        return list(spans)
    rid = bare_request_id(request_id)
    return [s for s in spans if s.req_id == rid or s.req_id.startswith(rid + "_local_part_")]


def _owner(req_id: str) -> str:
    """The request a span's `req_id` belongs to: ``{rid}_local_part_{idx}`` belongs to ``rid``."""
    rid, sep, idx = req_id.rpartition("_local_part_")
    return rid if sep and idx.isdigit() else req_id


class Recorder:
    """A bounded in-memory buffer of spans (the oldest are dropped first; `dropped` counts them).

    Spans are indexed by request too, so that one request's spans cost a lookup, not a scan of the whole
    buffer: servers collect them on every request's critical path. With ``enabled=False`` (default:
    `tracing_enabled()`) it records nothing.
    """

    def __init__(self, node: str | None = None, capacity: int = 100_000, enabled: bool | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.node = node or f"pid{os.getpid()}"
        self.enabled = tracing_enabled() if enabled is None else enabled
        self.dropped = 0
        self.capacity = capacity
        self._spans: collections.deque[Span] = collections.deque()
        self._by_request: dict[str, collections.deque[Span]] = {}  # each in the order of `_spans`
        self._lock = threading.Lock()

    def _append(self, span: Span) -> None:
        if len(self._spans) == self.capacity:
            old = self._spans.popleft()
            owned = self._by_request[_owner(old.req_id)]
            owned.popleft()  # the oldest span overall is the oldest of its request
            if not owned:
                del self._by_request[_owner(old.req_id)]
            self.dropped += 1
        self._spans.append(span)
        self._by_request.setdefault(_owner(span.req_id), collections.deque()).append(span)

    def add(self, span: Span) -> None:
        if self.enabled:
            with self._lock:
                self._append(span)

    def extend(self, spans: list[Span]) -> None:
        if self.enabled:
            with self._lock:
                for span in spans:
                    self._append(span)

    @contextlib.contextmanager
    def span(self, stage: str, req_id: str, part: int = -1, nbytes: int = 0) -> Iterator[None]:
        """Record the time the body takes as `stage` (recorded also when it raises)."""
        if not self.enabled:
            yield
            return
        t0 = time.monotonic_ns()
        try:
            yield
        finally:
            self.add(Span(req_id, part, stage, self.node, t0, time.monotonic_ns(), nbytes))

    def spans(self, request_id: str | None = None, since_ns: int = 0) -> list[Span]:
        """A copy of the spans, optionally of one request (`of_request`) and only those that ended
        after `since_ns`."""
        rid = bare_request_id(request_id) if request_id else None
        owner = _owner(rid) if rid else None
        part = rid if rid != owner else None  # a part's own id selects that part alone, as `of_request` does
        with self._lock:
            pool = self._spans if owner is None else self._by_request.get(owner, ())
            return [s for s in pool if s.t_end_ns >= since_ns and (part is None or s.req_id == part)]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._by_request.clear()


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
