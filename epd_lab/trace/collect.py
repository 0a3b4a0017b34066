"""Collecting every server's spans into one table, with each node's clock offset.

Every role's app answers ``GET /v1/spans`` (its recorder; ``request_id`` and ``since_ns`` filter) and
``GET /v1/clock`` (its CLOCK_MONOTONIC and host name). Processes on this host share CLOCK_MONOTONIC, so
their offset is exactly 0. For a server on another host the offset is estimated the way NTP does: the
server's clock reading against the midpoint of the shortest of several round trips; the error is at most
half that round trip, which is recorded with it.
"""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Iterable

import httpx
import msgspec

from epd_lab import security
from epd_lab.trace.frame import spans_frame
from epd_lab.trace.spans import Recorder, Span, of_request

if TYPE_CHECKING:
    import pandas as pd


class ClockOffset(msgspec.Struct, frozen=True):
    """A node's clock against ours: its reading minus ours (ns), and the round trip it was measured over."""

    node: str
    host: str
    offset_ns: int
    rtt_ns: int
    same_host: bool


class SpansPage(msgspec.Struct):
    """GET /v1/spans."""

    node: str
    spans: list[Span]
    dropped: int = 0


def clock_answer(node: str) -> dict[str, Any]:
    """The body of GET /v1/clock."""
    return {"node": node, "host": socket.gethostname(), "monotonic_ns": time.monotonic_ns()}


def spans_answer(recorder: Recorder, request_id: str | None, since_ns: int) -> SpansPage:
    """The body of GET /v1/spans: the recorder's spans of one request (its parts included; a response's
    id names its request) or all."""
    return SpansPage(recorder.node, recorder.spans(request_id, since_ns), recorder.dropped)


def estimate_clock_offset(client: httpx.Client, url: str, samples: int = 8, force: bool = False) -> ClockOffset:
    """The clock offset of the server at `url`: exactly 0 on this host (shared CLOCK_MONOTONIC) unless
    `force`, else estimated over the shortest of `samples` round trips."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        t0 = time.monotonic_ns()
        answer = client.get(f"{url}/v1/clock").raise_for_status().json()
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[1]:
            best = (answer["monotonic_ns"] - (t0 + t1) // 2, t1 - t0)
        if answer["host"] == socket.gethostname() and not force:
            return ClockOffset(answer["node"], answer["host"], 0, t1 - t0, True)
    assert best is not None
    return ClockOffset(answer["node"], answer["host"], best[0], best[1], answer["host"] == socket.gethostname())


def collect(urls: Iterable[str], request_id: str | None = None, since_ns: int = 0, extra: Iterable[Span] = (),
            timeout: float = 10.0, secret: str | bytes | None = None) -> pd.DataFrame:
    """Every span the servers at `urls` hold and `extra` ones (e.g. an in-process receiver's), of one
    request only when `request_id` is given (`of_request`), in one frame, each node's timestamps brought
    onto this host's clock. ``frame.attrs``: ``clock_offsets`` (ns per node), ``clocks`` (each node's
    `ClockOffset`, as dicts), ``dropped`` (spans each recorder had to drop) and ``unreachable`` (URL →
    error, for servers that did not answer within `timeout`: the others are still collected). `secret`: the
    deployment's shared secret, sent as the bearer token (default: the environment's, `epd_lab.security`)."""
    spans = of_request(extra, request_id)
    clocks: dict[str, ClockOffset] = {}
    dropped: dict[str, int] = {}
    params: dict[str, Any] = {"since_ns": since_ns, **({"request_id": request_id} if request_id else {})}
    unreachable: dict[str, str] = {}
    with httpx.Client(timeout=timeout, headers=security.bearer_header(security.resolve(secret))) as client:
        for url in urls:
            try:
                page = msgspec.json.decode(client.get(f"{url}/v1/spans", params=params).raise_for_status().content,
                                           type=SpansPage)
                clocks[page.node] = estimate_clock_offset(client, url)
            except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                unreachable[url] = f"{type(exc).__name__}: {exc}"  # a dead server's spans are lost, not the rest
                continue
            dropped[page.node] = page.dropped
            spans.extend(page.spans)
    # A span's node may differ from the server that held it (the proxy keeps the prefill's and decode's).
    frame = spans_frame(spans, {node: c.offset_ns for node, c in clocks.items()})
    frame.attrs["clocks"] = {node: msgspec.structs.asdict(c) for node, c in clocks.items()}
    frame.attrs["dropped"] = dropped
    frame.attrs["unreachable"] = unreachable
    return frame
