"""Deadline-aware admission, shared by the roles: queue a request while its predicted wait fits its deadline.

    ticket = await admission.enter(deadline_budget(request.headers, settings.timeout))
    try: ... finally: ticket.leave()

`workers` requests run at once; the next ones wait in a FIFO queue (on the event loop, before their body is
read: a queued request holds no body beyond the server's socket buffer, no KV blocks and no embedding). A
newcomer is queued only when its predicted wait plus its own service fits its deadline; otherwise it is refused
at once with 503 and ``Retry-After``, the detail stating the predicted wait. The prediction comes from measured
service times, not from a count: with `position` requests queued ahead, the newcomer starts after
``position + 1`` completions, which come at `rate` per second, so

    predicted wait = (position + 1) / rate        (0 while a worker is free)

``rate = workers / loaded_service`` (Little's law with every worker busy, which is when anyone waits),
`loaded_service` the median of the last `SERVICE_WINDOW` times from admission to `leave` of requests that
started with every worker busy: contention is in it. A request served alone says nothing about that (on a
shared 2-vCPU host four prefills at once take ~3 times one alone), so those only feed `service` (the median of
every request's time, the "its own service fits" check). Until `PRIOR_SAMPLES` loaded times are measured,
`prior_s` fills the window in for the missing ones: a fresh cluster that served requests one at a time would otherwise predict several times the rate it has,
admit a whole burst at the proxy, and refuse the excess only at the prefill, seconds later, after the proxy
read every body. A median, not a weighted mean: a cold first request (a process's first transfer calibrates
its copy path, ~1 s) made the mean's starting point and refused most of the next burst. Each completion
rechecks the queue from its back: a waiter the prediction no longer fits (the service time rose: a burst's own
intake, the proxy reading a thousand bodies, slows every role on a shared host) is refused then, not at its
deadline.

The judgment call: a service time measured one request at a time promises a burst more than it gets where
the roles share a few cores (four workers are not four times one), and the median catches up only as the
burst's own requests finish. The other ways tried erred the other way, and worse: the throughput measured one
at a time (``1 / service``) refused most of a 200-burst the host serves in 3 s (a prefill's time is partly
waiting for its encoder and decode, which overlap), and the rate the queue drained at during a burst's intake
(a few per second while the proxy reads a thousand bodies) refused nine in ten of a burst the host served half
of. Optimistic is the lesser error: waiters are rechecked, a request whose deadline passes while it waits is
refused then (``expired``), never run late, and the proxy keeps back what the request's decode is expected to
take.

The proxy in front (`epd_lab.servers.proxy`, judging before the body) plans pessimistically instead, so that it
is the one that refuses: by the prefills' lowest rate told lately (`RecentLow`; their median of 32 swings by a
quarter within a burst, and a prefill rechecks its queue by those swings: planned at the median, 40-111 of a
second 1,000-burst were refused by the prefill seconds in, after the proxy had read their bodies), or by its own
end-to-end measure where that is slower (`Drain`: seconds per request pending, from a request's arrival to its
prefill's answer, the proxy's own intake included).

Weighted requests (decode's KV admission, `Admission.enter`'s `units`): `workers` is then a capacity (the KV
pool's blocks), a request takes `units` of it (its reservation), `rate` counts units coming back per second, and
a request waits until the units of those queued ahead of it and its own, less those free now, have come back.

Refusal reasons (``refused_total{reason}``): ``deadline`` (the prediction does not fit), ``queue_full``
(`max_queued` waiting already: the memory backstop, a large bound), ``expired`` (the deadline passed while the
request waited: answered then, never run late). The deadline is the request's ``X-EPD-Deadline-Ms`` header (the
milliseconds its sender will still wait: a budget, not a clock time, so hosts need no common clock) or the role's
own timeout. Touched only on the event loop: no lock.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import statistics
import time
from typing import Any, Mapping

from epd_lab.serving.errors import BadRequest, Unavailable
from epd_lab.serving.metrics import Metric, RoleMetrics

__all__ = ["DEADLINE_HEADER", "KV_DEADLINE_HEADER", "Admission", "Drain", "RecentLow", "Ticket", "deadline_budget"]

DEADLINE_HEADER = "X-EPD-Deadline-Ms"  # the milliseconds the sender will still wait for the whole answer
# to decode: the milliseconds the sender (the proxy) leaves for the request's KV to arrive, what is left of the
# request's deadline; it bounds decode's wait for a producer that died or froze mid-transfer
KV_DEADLINE_HEADER = "X-EPD-KV-Deadline-Ms"
EWMA_WEIGHT = 0.2  # weight of the newest sample in the proxy's weighted means (decode per token, intake)
SERVICE_WINDOW = 32  # service times the median is taken over (loaded ones too: a window of a whole burst, 256,
# moved too slowly to guard the deadline; the prefill then admitted what finished late)
# the prior counts as this many samples until as many are measured: a burst's first ones run during its intake,
# several times slower than the burst goes on, and alone they predicted a rate that refused most of a burst served
# at 4 times it
PRIOR_SAMPLES = 16
REASONS = ("deadline", "queue_full", "expired")
MAX_BUDGET_S = 86400.0  # a longer deadline is read as this one (a timer needs a finite time)


def deadline_budget(headers: Mapping[str, str], default_s: float, header: str = DEADLINE_HEADER) -> float:
    """Seconds the request's sender will wait for its whole answer: its ``X-EPD-Deadline-Ms`` header (or
    `header`; at most a day), else `default_s` (the role's own timeout). `BadRequest` when the header is not a
    number."""
    raw = headers.get(header.lower())
    if raw is None:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if math.isnan(ms):
        raise BadRequest(f"{header} must be a number of milliseconds, got {raw[:40]!r}")
    return min(ms / 1000.0, MAX_BUDGET_S)


@dataclasses.dataclass(slots=True)
class _Waiter:
    """A queued request: granted (result) or refused (exception) through `future`."""

    future: asyncio.Future
    units: int  # of the capacity it takes once granted
    deadline: float  # time.monotonic() by which its answer is due
    queued_at: float


class Ticket:
    """One admitted request's units: `leave` (idempotent) hands them to the next waiters and records the service
    time."""

    __slots__ = ("_admission", "_started", "_left", "_loaded", "units")

    def __init__(self, admission: "Admission", units: int) -> None:
        self._admission, self._started, self._left, self.units = admission, time.monotonic(), False, units
        # it started with too few units left for another like it: every worker busy, when a request takes one
        self._loaded = admission.workers - admission.running < units

    def leave(self) -> None:
        """The request is done (answered, failed, or its stream ended; decode: its KV blocks are back)."""
        if not self._left:
            self._left = True
            self._admission._finished(time.monotonic() - self._started, self._loaded, self.units)


class Admission:
    """`workers` requests at once, a deadline-aware FIFO queue of at most `max_queued` behind them. `timeout`
    is the deadline of a request that names none; `prior_s` the service time, with every worker busy, assumed
    until one is measured (the module's docstring). `prefix` names its ``/metrics`` families (a role with two:
    decode's ``kv_admission_``); `unit` names the capacity in its refusals.

    Weighted: a request may take several `units` of the `workers` capacity (decode's KV admission: `workers` the
    pool's blocks, `units` a request's reservation); ``running`` then counts units. The queue stays FIFO: the head
    waits until its units are free, and those behind it wait behind it (no starvation of large requests)."""

    def __init__(self, role: str, workers: int, max_queued: int, timeout: float, prior_s: float = 0.1,
                 prefix: str = "", unit: str = "workers") -> None:
        if workers < 1 or max_queued < 0 or not timeout > 0 or not prior_s >= 0:
            raise ValueError(f"admission needs workers >= 1, max_queued >= 0, timeout > 0, prior_s >= 0; got "
                             f"{workers}, {max_queued}, {timeout}, {prior_s}")
        self.role, self.workers, self.max_queued, self.timeout = role, workers, max_queued, timeout
        self.prior_s, self.prefix, self.unit = prior_s, prefix, unit
        self.service_s = prior_s  # every request's (median)
        self.loaded_service_s = prior_s  # with every worker busy (median): the rate's base
        self._recent: collections.deque[float] = collections.deque(maxlen=SERVICE_WINDOW)
        self._recent_loaded: collections.deque[float] = collections.deque(maxlen=SERVICE_WINDOW)
        self.measured = 0  # service times measured
        self.measured_loaded = 0  # of them, with every worker busy
        self.running = 0
        self._queue: collections.deque[_Waiter] = collections.deque()
        self.refused: collections.Counter[str] = collections.Counter({r: 0 for r in REASONS})
        self.queued_total = 0  # requests that waited in the queue
        self.waited_s = 0.0  # their summed waits

    @property
    def rate(self) -> float:
        """Completions per second with every worker busy: ``workers / loaded_service``."""
        return self.workers / self.loaded_service_s if self.loaded_service_s > 0 else math.inf

    @property
    def best_case_s(self) -> float:
        """The fastest service measured lately, or the prior if faster: what an idle role judges a deadline by."""
        return min([self.prior_s, *self._recent])

    @property
    def queued(self) -> int:
        """Requests waiting for a worker."""
        return len(self._queue)

    @property
    def admitted(self) -> int:
        """Units running or waiting (requests, where each takes one; 0 at idle: what a leak check reads)."""
        return self.running + sum(w.units for w in self._queue)

    def predicted_wait(self, position: int | None = None, units: int = 1) -> float:
        """Seconds a request of `units` queued behind `position` others (default: all those waiting now) would
        wait: until the units of those ahead and its own, less those free now, come back at `rate`."""
        position = len(self._queue) if position is None else position
        if position == 0 and self.running + units <= self.workers:
            return 0.0
        ahead = sum(self._queue[i].units for i in range(min(position, len(self._queue))))
        return max(ahead + units - (self.workers - self.running), 1) / self.rate

    def _refuse(self, reason: str, detail: str, retry_after: float) -> Unavailable:
        self.refused[reason] += 1
        return Unavailable(f"{self.role} {detail}", code=f"overloaded_{reason}", retry_after=retry_after)

    async def enter(self, budget_s: float | None = None, units: int = 1) -> Ticket:
        """Admit one request of `units` that may wait `budget_s` seconds (default: `timeout`) for its whole
        answer: at once while its units are free and nobody waits, else after its turn in the queue. Raises
        `Unavailable` (503, ``Retry-After``) when its predicted wait and service do not fit its budget, when
        `max_queued` wait already, or when its budget runs out while it waits; `BadRequest` when it asks for
        more units than there are (it could never run)."""
        budget = self.timeout if budget_s is None else budget_s
        if not 1 <= units <= self.workers:
            raise BadRequest(f"{self.role}: the request needs {units} {self.unit} of a capacity of {self.workers}")
        wait = self.predicted_wait(units=units)
        # an idle role judges by its best case: by the median, nothing would ever measure a service time again once
        # one median passed the deadline, and every later request would be refused for good
        service = self.service_s if self.admitted else self.best_case_s
        if wait + service > budget:  # even with a worker free: it could not be answered in time
            raise self._refuse("deadline", f"overloaded: predicted wait {wait:.2f} s ({len(self._queue)} queued, "
                                           f"{self.running} running on {self.workers} {self.unit}, "
                                           f"{self.rate:.1f} done per s, {service:.3f} s each) plus its "
                                           f"service does not fit "
                                           f"the request's deadline of {max(budget, 0.0):.2f} s",
                               wait + service - max(budget, 0.0))
        if self.running + units <= self.workers and not self._queue:
            self.running += units
            return Ticket(self, units)
        if len(self._queue) >= self.max_queued:
            raise self._refuse("queue_full", f"at capacity: {self.running} running on {self.workers} {self.unit}, "
                                             f"{len(self._queue)} waiting (max_queued {self.max_queued}); "
                                             f"predicted wait {wait:.2f} s", max(1.0, wait))
        t0 = time.monotonic()
        waiter = _Waiter(asyncio.get_running_loop().create_future(), units, t0 + budget, t0)
        future = waiter.future
        self._queue.append(waiter)
        try:
            await asyncio.wait_for(future, budget)  # or `_recheck` refuses it (raised here)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():  # granted just as it timed out or was cancelled
                self._finished(None, units=units)
            else:
                future.cancel()
                try:
                    self._queue.remove(waiter)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._refuse("expired", f"deadline of {budget:.2f} s passed while the request waited in the "
                                          f"queue (predicted wait was {wait:.2f} s)", self.predicted_wait()) from None
        self.queued_total += 1
        self.waited_s += time.monotonic() - t0
        return Ticket(self, units)

    def _finished(self, service_s: float | None, loaded: bool = False, units: int = 1) -> None:
        """`units` are free: record their service time (None: a grant never used; `loaded`: it started with
        every worker busy), then hand them to the next waiters."""
        if service_s is not None:
            self._recent.append(service_s)
            self.service_s = statistics.median(self._recent)
            self.measured += 1
            if loaded:
                self._recent_loaded.append(service_s)
                prior = [self.prior_s] * max(0, PRIOR_SAMPLES - len(self._recent_loaded))
                self.loaded_service_s = statistics.median([*self._recent_loaded, *prior])
                self.measured_loaded += 1
        self.running -= units
        while self._queue:  # FIFO: the head is granted once its units are free, the others wait behind it
            waiter = self._queue[0]
            if not waiter.future.done():
                if self.running + waiter.units > self.workers:
                    break
                self.running += waiter.units
                waiter.future.set_result(None)
            self._queue.popleft()
        self._recheck()

    def _recheck(self) -> None:
        """Refuse now, from the back of the queue, the waiters whose deadline the prediction no longer fits (the
        rate fell since they were queued: a burst's intake slows the host), rather than at their deadline."""
        now = time.monotonic()
        while self._queue:
            waiter = self._queue[-1]
            if waiter.future.done():
                self._queue.pop()
                continue
            ahead = len(self._queue) - 1
            wait = self.predicted_wait(ahead, waiter.units)
            left = waiter.deadline - now
            if wait + self.service_s <= left:
                return
            self._queue.pop()
            waiter.future.set_exception(self._refuse(
                "deadline", f"overloaded: predicted wait now {wait:.2f} s ({ahead} queued ahead, "
                            f"{self.rate:.1f} done per s, {self.service_s:.3f} s each) plus its service does not "
                            f"fit the {max(left, 0.0):.2f} s left of the request's deadline (it waited "
                            f"{now - waiter.queued_at:.2f} s)", wait + self.service_s - max(left, 0.0)))

    def stats(self) -> dict[str, Any]:
        """For ``/health``: workers, running, queued, the service times (median, best case) and predicted wait,
        refusals by reason."""
        return {"workers": self.workers, "running": self.running, "queued": len(self._queue),
                "max_queued": self.max_queued, "service_s": round(self.service_s, 4),
                "best_case_s": round(self.best_case_s, 4),
                "loaded_service_s": round(self.loaded_service_s, 4), "loaded_measured": self.measured_loaded > 0,
                "rate_per_s": round(self.rate, 3),
                "predicted_wait_s": round(self.predicted_wait(), 4), "refused": dict(self.refused)}

    def metric_families(self, metrics: RoleMetrics) -> list[Metric]:
        """Named by `metrics` after `prefix`: ``admitted``, ``running``, ``queue_length``, ``workers``,
        ``max_queued``, ``service_seconds``, ``predicted_wait_seconds``, ``queued_total``,
        ``queue_wait_seconds_total`` and ``refused_total{reason}``."""
        return [metrics.of(self.prefix + name.removesuffix("_total"), kind, help_, value)
                for name, kind, value, help_ in (
            ("admitted", "gauge", self.admitted, "requests running or waiting for a worker"),
            ("running", "gauge", self.running, "requests running (at most workers)"),
            ("queue_length", "gauge", len(self._queue), "requests waiting for a worker"),
            ("workers", "gauge", self.workers, "requests run at once"),
            ("max_queued", "gauge", self.max_queued, "requests waiting at most (memory backstop)"),
            ("service_seconds", "gauge", round(self.service_s, 6),
             "time from admission to done (median of the last 32)"),
            ("loaded_service_seconds", "gauge", round(self.loaded_service_s, 6),
             "the same, of requests started with every worker busy (the prior until one is measured)"),
            ("rate_per_second", "gauge", round(self.rate, 6),
             "completions per second with every worker busy (workers / service): the prediction's base"),
            ("predicted_wait_seconds", "gauge", round(self.predicted_wait(), 6),
             "the wait a request arriving now is predicted"),
            ("queued_total", "counter", self.queued_total, "requests that waited in the queue"),
            ("queue_wait_seconds_total", "counter", round(self.waited_s, 6), "seconds they waited, summed"),
        )] + [metrics.counter(self.prefix + "refused", "requests refused with 503 at once, by reason: deadline (the "
                              "predicted wait does not fit), queue_full (max_queued), expired (the deadline passed "
                              "in the queue)", dict(self.refused), "reason")]


class Drain:
    """The drain behind a sender that keeps no queue of its own (the proxy, in front of the prefills), as the
    sender measures it end to end: a request that found `ahead` others on their way when it arrived and had its
    answer `seconds` later took ``seconds / (ahead + 1)`` per request, or ``seconds / workers`` when it found a
    worker free (it says no more than that they run `workers` at once, and so light traffic replaces a slow
    burst's samples: they never refuse for good). `per_request_s` is the median of the last `SERVICE_WINDOW`."""

    def __init__(self) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=SERVICE_WINDOW)

    def add(self, seconds: float, ahead: int, workers: int) -> None:
        """A request that arrived behind `ahead` others, `workers` running at once, had its answer `seconds` later."""
        self._recent.append(seconds / max(ahead + 1, workers))

    @property
    def per_request_s(self) -> float | None:
        """Seconds per request ahead (median of the last `SERVICE_WINDOW`), None before one is measured."""
        return statistics.median(self._recent) if self._recent else None

    def predicted_s(self, ahead: int) -> float | None:
        """Seconds until the answer of a request arriving now behind `ahead` others, None before one is measured."""
        per = self.per_request_s
        return None if per is None else (ahead + 1) * per


class RecentLow:
    """The lowest of the last `count` values `seen`, a value noted only when it differs from the one before: what a
    sender (the proxy) plans with when the value it is told (a prefill's rate, the median of its last few dozen
    service times) swings by a quarter within a burst and the teller rechecks its queue by its own swings. Idle,
    the value does not change, so the last burst's swings are remembered however long ago it ran."""

    def __init__(self, count: int) -> None:
        self._seen: collections.deque[float] = collections.deque(maxlen=count)

    def seen(self, value: float) -> float:
        """Note `value` (told now); returns the lowest of the last `count` noted."""
        if not self._seen or self._seen[-1] != value:
            self._seen.append(value)
        return min(self._seen)
