"""A backend's liveness as its caller sees it: up, left out for a while after a refused connection, or stalled.

A refused connection only catches a process that is gone. A frozen one (SIGSTOP, a wedged event loop, a host
whose link is down) still accepts connections into its kernel backlog, so every caller also probes the
backend's ``/health`` every `PROBE_INTERVAL` s, each probe bounded by `PROBE_TIMEOUT` s (a frozen backend is
found within ``PROBE_INTERVAL + STALL_MISSES * PROBE_TIMEOUT`` = 2.5 s). After `STALL_MISSES`
probes in a row go unanswered the backend is *stalled*: new requests skip it and the exchanges in flight to
it are abandoned at once instead of waiting out their timeout (a progress timeout, not a deadline). The first
probe that answers closes the circuit again.

Two misses, not one: a probe that loses one second to a busy host is not a dead backend (a false stall moves
work elsewhere; it loses none).

Busy is not frozen: a backend that answers slowly still answers something. Its caller tells the circuit whenever
the backend answers anything else (`heard`: a request's answer, a streamed token), and missed probes make it
stalled only when nothing at all was heard from it for `STALL_SILENCE` s: a decode streaming tokens to many
clients while its ``/health`` queues behind them is busy, not frozen. (The roles keep ``/health`` answering
within `PROBE_TIMEOUT` while they work, however large the request: big bodies are parsed off the event loop
and a prompt's length is checked before its ids are built.)

`Circuits` holds a caller's backends' circuits, and is the one definition of what the callers share: which
backends are up, in the caller's order (the proxy's and the front's round-robin ring, the receiver's encoder
order), and the probe schedule (each `PROBE_INTERVAL`, every backend whose last probe is over). It does no I/O:
the proxy and the front (`epd_lab.servers.routing`, asyncio) and the prefill's `EmbeddingReceiver` (threads) do
the exchanges and probes, and tell each backend's `Liveness` what came of them.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Container
from typing import Protocol

__all__ = ["PROBE_INTERVAL", "PROBE_TIMEOUT", "STALL_MISSES", "STALL_SILENCE", "Circuits", "Liveness", "Probe"]

PROBE_INTERVAL = 0.5  # seconds between two probes of a backend (one in flight at a time)
PROBE_TIMEOUT = 1.0  # seconds a probe waits for /health to answer
STALL_MISSES = 2  # unanswered probes in a row that make a backend stalled
STALL_SILENCE = STALL_MISSES * PROBE_TIMEOUT  # ... when nothing else was heard from it for this long either


@dataclasses.dataclass(slots=True)
class Liveness:
    """One backend's circuit. `retry_after`: seconds it is left out after a refused connection."""

    retry_after: float
    down_until: float = 0.0  # time.monotonic() before which it is left out (it refused a connection)
    misses: int = 0  # probes in a row that went unanswered
    heard_at: float = dataclasses.field(default_factory=time.monotonic)  # it last answered anything
    frozen: bool = False  # found stalled; until a probe answers

    @property
    def stalled(self) -> bool:
        """It accepts connections but stopped answering anything: left out until a probe answers."""
        return self.frozen

    def heard(self, now: float | None = None) -> None:
        """It answered something other than a probe (a request's answer, a streamed token): alive, maybe busy."""
        self.heard_at = time.monotonic() if now is None else now

    def up(self, now: float | None = None) -> bool:
        """Whether new requests may go to it."""
        return not self.stalled and (time.monotonic() if now is None else now) >= self.down_until

    def refused(self) -> None:
        """It refused a connection: left out for `retry_after` seconds."""
        self.down_until = time.monotonic() + self.retry_after

    def probed(self, answered: bool, now: float | None = None) -> bool:
        """Record one probe; True when this probe is the one that made the backend stalled (the caller then
        abandons the exchanges in flight to it): `STALL_MISSES` or more in a row, and nothing heard from it for
        `STALL_SILENCE` s."""
        now = time.monotonic() if now is None else now
        if answered:
            self.misses, self.down_until, self.heard_at, self.frozen = 0, 0.0, now, False
            return False
        self.misses += 1
        if not self.frozen and self.misses >= STALL_MISSES and now - self.heard_at >= STALL_SILENCE:
            self.frozen = True
            return True
        return False


class Probe(Protocol):
    """A probe under way, as its caller runs it: an asyncio task, a thread's future."""

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


class Circuits:
    """The circuits of one caller's backends, by index (the order of their URLs). Not locked: the schedule is
    ticked by one task or thread, a backend is probed by one probe at a time, and what races with its probe (a
    refused connection, something heard) sets one field."""

    def __init__(self, count: int, retry_after: float) -> None:
        self.liveness = [Liveness(retry_after) for _ in range(count)]  # each backend's, told what its I/O met
        self._probes: list[Probe | None] = [None] * count  # each backend's last scheduled probe

    def __len__(self) -> int:
        return len(self.liveness)

    def up(self, exclude: Container[int] = (), start: int = 0, now: float | None = None) -> list[int]:
        """The backends new requests may go to, less those in `exclude` (tried already), in ring order from
        `start` (a rotating caller's next position)."""
        now = time.monotonic() if now is None else now
        ring = ((start + k) % len(self.liveness) for k in range(len(self.liveness)))
        return [i for i in ring if i not in exclude and self.liveness[i].up(now)]

    def probe_due(self, start: Callable[[int], Probe]) -> None:
        """One tick of the probe schedule, every `PROBE_INTERVAL`: `start(i)` probes backend ``i`` (its outcome
        goes to ``liveness[i].probed``) for each backend whose last probe is over, so that a frozen one is not
        piled with probes and one frozen backend delays no other's."""
        for i, probe in enumerate(self._probes):
            if probe is None or probe.done():
                self._probes[i] = start(i)

    def cancel_probes(self) -> None:
        """The caller stops probing: the probes under way are cancelled."""
        for probe in self._probes:
            if probe is not None:
                probe.cancel()
