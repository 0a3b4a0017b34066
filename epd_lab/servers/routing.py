"""Routing for the proxy: the prefill and decode servers it knows, and the policy that chooses among them.

``round_robin``, or ``least_loaded`` (fewest requests in flight as this proxy counts them; ties in round-robin
order). A backend that refused a connection is marked down and skipped for ``retry_after`` seconds.
"""
from __future__ import annotations

import dataclasses
import time

__all__ = ["POLICIES", "Backend", "Pool"]

POLICIES = ("round_robin", "least_loaded")


@dataclasses.dataclass(slots=True)
class Backend:
    """One prefill or decode server as the proxy sees it. Touched only from the event loop."""

    role: str
    url: str
    inflight: int = 0  # requests sent to it and not yet answered (for decode: until its stream closes)
    served: int = 0  # requests it accepted
    down_until: float = 0.0  # time.monotonic() before which it is skipped
    kv_url: str | None = None  # a prefill's KV side channel, from its /health: decode can be asked up front
    probed: bool = False  # its /health has answered once

    def up(self, now: float) -> bool:
        return now >= self.down_until


class Pool:
    """The backends of one role and the policy that chooses among them."""

    def __init__(self, role: str, urls: tuple[str, ...], policy: str, retry_after: float) -> None:
        self.role = role
        self.backends = [Backend(role, url.rstrip("/")) for url in urls]
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

    def mark_down(self, backend: Backend) -> None:
        backend.down_until = time.monotonic() + self.retry_after

    @staticmethod
    def mark_up(backend: Backend) -> None:
        backend.down_until = 0.0
