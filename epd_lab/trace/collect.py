"""Collecting every server's spans into one table, with each node's clock offset.

Every role's app answers ``GET /v1/spans`` (its recorder; ``request_id`` and ``since_ns`` filter) and
``GET /v1/clock`` (its CLOCK_MONOTONIC, which clock that is (`spans.clock_id`) and its host name). Processes
reading the collector's clock get offset exactly 0, error 0. For any other clock (another host, or another time
namespace) the offset is estimated the way NTP does: the server's reading against the midpoint of the
shortest of several round trips. The reading was taken somewhere inside that round trip, so the estimate is
off by at most half of it: that is the error recorded with it (`ClockOffset.error_ns`), which the frame, the
Chrome trace and the critical path carry along.
"""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Iterable

import httpx
import msgspec

from epd_lab import security
from epd_lab.trace.frame import spans_frame
from epd_lab.trace.spans import Recorder, Span, clock_id, of_request

if TYPE_CHECKING:
    import pandas as pd


class ClockOffset(msgspec.Struct, frozen=True):
    """A node's clock against ours: its reading minus ours (ns), the round trip it was measured over, and the
    bound on the estimate's error (half that round trip; 0 when the node reads our clock)."""

    node: str
    host: str
    offset_ns: int
    rtt_ns: int
    error_ns: int
    same_clock: bool


class SpansPage(msgspec.Struct):
    """GET /v1/spans."""

    node: str
    spans: list[Span]
    dropped: int = 0


def clock_answer(node: str) -> dict[str, Any]:
    """The body of GET /v1/clock."""
    return {"node": node, "host": socket.gethostname(), "clock": clock_id(), "monotonic_ns": time.monotonic_ns()}


def spans_answer(recorder: Recorder, request_id: str | None, since_ns: int) -> SpansPage:
    """The body of GET /v1/spans: the recorder's spans of one request (its parts included; a response's
    id names its request) or all."""
    return SpansPage(recorder.node, recorder.spans(request_id, since_ns), recorder.dropped)


def estimate_clock_offset(client: httpx.Client, url: str, samples: int = 8, force: bool = False) -> ClockOffset:
    """The clock offset of the server at `url`: exactly 0 when it reads our clock (same `clock_id`) unless
    `force`, else estimated over the shortest of `samples` round trips, with half that round trip as its error."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        t0 = time.monotonic_ns()
        answer = client.get(f"{url}/v1/clock").raise_for_status().json()
        t1 = time.monotonic_ns()
        same = answer["clock"] == clock_id()
        if same and not force:
            return ClockOffset(answer["node"], answer["host"], 0, t1 - t0, 0, True)
        if best is None or t1 - t0 < best[1]:
            best = (answer["monotonic_ns"] - (t0 + t1) // 2, t1 - t0)
    assert best is not None
    # the midpoint is rounded down: the bound takes the odd nanosecond too
    return ClockOffset(answer["node"], answer["host"], best[0], best[1], (best[1] + 1) // 2, same)


def collect(urls: Iterable[str], request_id: str | None = None, since_ns: int = 0, extra: Iterable[Span] = (),
            timeout: float = 10.0, secret: str | bytes | None = None) -> pd.DataFrame:
    """Every span the servers at `urls` hold and `extra` ones (e.g. an in-process receiver's), of one
    request only when `request_id` is given (`of_request`), in one frame, each node's timestamps brought
    onto this host's clock. ``frame.attrs``: ``clock_offsets`` and ``clock_errors`` (ns per node), ``clocks``
    (each node's `ClockOffset`, as dicts), ``dropped`` (spans each recorder had to drop) and ``unreachable`` (URL →
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
    frame = spans_frame(spans, {node: c.offset_ns for node, c in clocks.items()},
                        {node: c.error_ns for node, c in clocks.items()})
    frame.attrs["clocks"] = {node: msgspec.structs.asdict(c) for node, c in clocks.items()}
    frame.attrs["dropped"] = dropped
    frame.attrs["unreachable"] = unreachable
    return frame
