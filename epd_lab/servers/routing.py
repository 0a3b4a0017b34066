"""Routing for the proxy: the prefill and decode servers it knows, and the policy that chooses among them.

``round_robin``, or ``least_loaded`` (fewest requests in flight as this proxy counts them; ties in round-robin
order). A backend that refused a connection is skipped for ``retry_after`` seconds; one that stopped answering
its ``/health`` probes, and answered nothing else meanwhile, is skipped until it answers again
(`epd_lab.serving.Liveness`: busy is not frozen).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp

from epd_lab.serving import Liveness

__all__ = ["POLICIES", "Backend", "Pool"]

POLICIES = ("round_robin", "least_loaded")


@dataclasses.dataclass(slots=True)
class Backend:
    """One prefill or decode server as the proxy sees it. Touched only from the event loop."""

    role: str
    url: str
    liveness: Liveness
    inflight: int = 0  # requests sent to it and not yet answered (for decode: until its stream closes)
    served: int = 0  # requests it accepted
    kv_url: str | None = None  # a prefill's KV side channel, from its /health: decode can be asked up front
    max_prompt_tokens: int | None = None  # a prefill's longest prompt, from its /health: the proxy checks it first
    workers: int | None = None  # a prefill's admission, from its /health: requests it runs at once ...
    service_s: float | None = None  # ... its measured service time ...
    rate: float | None = None  # ... and completions per second: the proxy predicts the wait from them
    probed: bool = False  # its /health has answered once
    stalls: int = 0  # times it was found stalled
    # set when it is found stalled: exchanges waiting on it give up; a fresh one once it answers again
    stall: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    streams: set[aiohttp.ClientResponse] = dataclasses.field(default_factory=set)  # open decode streams

    def up(self, now: float) -> bool:
        return self.liveness.up(now)

    def finish(self, response: aiohttp.ClientResponse, reuse: bool) -> None:
        """An exchange with it is over: the connection goes back to the pool (`reuse`: read to its end) or is
        closed (which stops the backend's work on a stream), and it counts one request fewer in flight."""
        self.streams.discard(response)
        if reuse:
            response.release()
        else:
            response.close()
        self.inflight -= 1


class Pool:
    """The backends of one role and the policy that chooses among them."""

    def __init__(self, role: str, urls: tuple[str, ...], policy: str, retry_after: float) -> None:
        self.role = role
        self.backends = [Backend(role, url.rstrip("/"), Liveness(retry_after)) for url in urls]
        self.policy = policy
        self.retry_after = retry_after
        self._next = 0  # round-robin position; also breaks least_loaded ties, so equal loads still rotate

    def choose(self, exclude: set[str]) -> Backend | None:
        """The next backend by the policy among those up and not in `exclude`; None if there is none."""
        now = time.monotonic()
        n = len(self.backends)
        ring = [self.backends[(self._next + i) % n] for i in range(n)]
        candidates = [b for b in ring if b.url not in exclude and b.up(now)]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda b: b.inflight) if self.policy == "least_loaded" else candidates[0]
        self._next = (self.backends.index(chosen) + 1) % n
        return chosen

    @staticmethod
    def probed(backend: Backend, answered: bool) -> None:
        """Record a /health probe of `backend`; the probe that finds it stalled cuts the exchanges waiting on it
        (their callers see `stall` set, its open streams are closed)."""
        if answered:
            if backend.stall.is_set():
                backend.stall = asyncio.Event()
            backend.liveness.probed(True)
            return
        if backend.liveness.probed(False):
            backend.stalls += 1
            backend.stall.set()
            for response in list(backend.streams):
                response.close()
