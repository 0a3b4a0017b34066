"""Admission control shared by the roles: a request is admitted below `capacity`, else refused at once.

Refused means a 503 with ``Retry-After`` before the request's body is read, so that overload never turns into
requests waiting in a queue until their deadline. Touched only on the event loop: no lock.
"""
from __future__ import annotations

from typing import Callable

from epd_lab.serving.errors import Unavailable

__all__ = ["Admission"]


class Admission:
    """At most `capacity` requests admitted at once. `limit` names the bound in the refusal ("max_active 64");
    `on_refused` is called once per refusal (the role's counter)."""

    def __init__(self, role: str, capacity: int, limit: str, on_refused: Callable[[], None]) -> None:
        self.role, self.capacity, self.limit, self.on_refused = role, capacity, limit, on_refused
        self.admitted = 0

    def enter(self) -> None:
        """Admit one request, or raise `Unavailable` (503, ``Retry-After: 1``) when at capacity."""
        if self.admitted >= self.capacity:
            self.on_refused()
            raise Unavailable(f"{self.role} at capacity: {self.admitted} requests admitted ({self.limit})",
                              retry_after=1)
        self.admitted += 1

    def leave(self) -> None:
        """An admitted request is done."""
        self.admitted -= 1
