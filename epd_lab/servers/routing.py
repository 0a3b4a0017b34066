"""Routing for the proxy and the front: the backends they know, the policy that chooses among them, and the one
HTTP client that calls them (`PoolClient`).

``round_robin``, or ``least_loaded`` (fewest requests in flight as this server counts them; ties in round-robin
order). A backend that refused a connection is skipped for ``retry_after`` seconds; one that stopped answering
its ``/health`` probes, and answered nothing else meanwhile, is skipped until it answers again
(`epd_lab.serving.Liveness`: busy is not frozen). Which backends are up, and when each is probed, is
`epd_lab.serving.Circuits`, shared with the prefill's receiver (`epd_lab.ep.receiver`); this module does the I/O
over it, with `epd_lab.http.aio`.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from epd_lab import security
from epd_lab.http.aio import Answer, AsyncHTTPClient, ClientError, ConnectError, Disconnected
from epd_lab.serving import (CLIENT_KEEPALIVE_S, PROBE_INTERVAL, PROBE_TIMEOUT, Circuits, Liveness, Metric,
                             RoleMetrics, ServingError, Unavailable)

__all__ = ["EXCHANGE_ERRORS", "JSON_HEADERS", "POLICIES", "UNANSWERED_ERRORS", "Backend", "Pool", "PoolClient",
           "Stalled", "backend_health", "backend_metrics", "progressing"]

POLICIES = ("round_robin", "least_loaded")
JSON_HEADERS = {"content-type": "application/json"}
# what a failed exchange with a backend raises: the client's errors, and its timeouts (asyncio's TimeoutError)
EXCHANGE_ERRORS = (ClientError, asyncio.TimeoutError)
# the connection closed or reset before any byte of an answer (on a kept-alive connection that went stale, the
# client has sent the request once more on a fresh one already): the backend died
UNANSWERED_ERRORS = (Disconnected,)
T = TypeVar("T")
EAGER_TASKS = sys.version_info >= (3, 12)


@dataclasses.dataclass(slots=True)
class Backend:
    """One backend (a prefill, a decode, a monolithic replica) as the proxy or the front sees it. Touched only from
    the event loop."""

    role: str
    url: str
    liveness: Liveness
    inflight: int = 0  # requests sent to it and not yet answered (for decode: until its stream closes)
    served: int = 0  # requests it accepted
    kv_url: str | None = None  # a prefill's KV side channel, from its /health: decode can be asked up front
    kv_urls: list[str] | None = None  # a prefill TP group's side channels, rank 0's first (its /health)
    max_prompt_tokens: int | None = None  # a prefill's longest prompt, from its /health: the proxy checks it first
    workers: int | None = None  # a prefill's admission, from its /health: requests it runs at once ...
    service_s: float | None = None  # ... its measured service time (median; `best_case_s`: idle) ...
    best_case_s: float | None = None
    rate: float | None = None  # ... and completions per second: the proxy predicts the wait from them ...
    rate_measured: bool = False  # ... once measured with every worker busy (till then its prior, a guess)
    probed: bool = False  # its /health has answered once
    stalls: int = 0  # times it was found stalled
    # set when it is found stalled: exchanges waiting on it give up; a fresh one once it answers again
    stall: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    streams: set[Answer] = dataclasses.field(default_factory=set)  # open decode streams

    def up(self, now: float) -> bool:
        return self.liveness.up(now)

    def learn(self, health: dict[str, Any]) -> None:
        """Keep what a prefill tells in its /health answer: its KV side channel, its longest prompt, its admission."""
        if self.role != "prefill":
            return
        if isinstance(health.get("kv_url"), str):
            self.kv_url = health["kv_url"]
        urls = health.get("kv_urls")
        if isinstance(urls, list) and len(urls) > 1 and all(isinstance(u, str) for u in urls):
            self.kv_urls = urls
        if isinstance(health.get("max_prompt_tokens"), int):
            self.max_prompt_tokens = health["max_prompt_tokens"]
        admission = health.get("admission")
        if isinstance(admission, dict):
            self.workers, self.service_s = admission.get("workers"), admission.get("service_s")
            self.best_case_s = admission.get("best_case_s")
            self.rate = admission.get("rate_per_s")
            self.rate_measured = admission.get("loaded_measured") is True

    def finish(self, response: Answer, reuse: bool) -> None:
        """An exchange with it is over: the connection goes back to the pool (`reuse`: read to its end) or is
        closed (which stops the backend's work on a stream), and it counts one request fewer in flight."""
        self.streams.discard(response)
        if reuse:
            response.release()
        else:
            response.close()
        self.inflight -= 1


class Pool:
    """The backends of one role, their circuits, and the policy that chooses among them."""

    def __init__(self, role: str, urls: tuple[str, ...], policy: str, retry_after: float) -> None:
        self.role = role
        self.circuits = Circuits(len(urls), retry_after)
        self.backends = [Backend(role, url.rstrip("/"), liveness)
                         for url, liveness in zip(urls, self.circuits.liveness, strict=True)]
        self.policy = policy
        self._next = 0  # round-robin position; also breaks least_loaded ties, so equal loads still rotate

    def choose(self, exclude: set[str]) -> Backend | None:
        """The next backend by the policy among those up and not in `exclude` (URLs); None if there is none."""
        up = self.circuits.up({i for i, b in enumerate(self.backends) if b.url in exclude}, self._next)
        if not up:
            return None
        chosen = min(up, key=lambda i: self.backends[i].inflight) if self.policy == "least_loaded" else up[0]
        self._next = (chosen + 1) % len(self.backends)
        return self.backends[chosen]

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


class Stalled(Exception):
    """The backend was found stalled while an exchange waited on it."""


def _started(aw: Awaitable[T]) -> asyncio.Future[T]:
    """`aw` as a task, run at once up to its first wait where the loop can (Python 3.12+: a POST's bytes leave
    now, ahead of any task made before it, such as the decode the proxy asks alongside a prefill), else from the
    loop's next turn."""
    if EAGER_TASKS and asyncio.iscoroutine(aw):
        return asyncio.Task(aw, loop=asyncio.get_running_loop(), eager_start=True)  # type: ignore[call-arg]
    return asyncio.ensure_future(aw)


async def progressing(backend: Backend, aw: Awaitable[T], timeout: float | None = None) -> T:
    """`aw`'s result, unless `backend` is found stalled first (then `aw` is cancelled and `Stalled` raised) or
    `timeout` seconds pass (`asyncio.TimeoutError`)."""
    task = _started(aw)
    if task.done():  # it needed no wait (a body that had come whole)
        return task.result()
    stall = asyncio.ensure_future(backend.stall.wait())
    try:
        done, _ = await asyncio.wait((task, stall), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stall.cancel()
        if not task.done():
            task.cancel()  # stalled, timed out, or this caller cancelled
    if task in done:
        return task.result()
    if stall in done:
        raise Stalled()
    raise asyncio.TimeoutError()


class PoolClient:
    """The HTTP client of a server in front of pools of backends (the proxy, the front): every backend's /health
    probed, the choice among a pool's, and a POST passed on to the next backend while one does not take it.

    What the client is told of a failure is the server's to word: `failed(backend, exc)` for an exchange that
    failed after connecting; `answered(backend, response, raw)` for a non-200 answer, the exception raised (on
    503 kept while the next backend is tried: it did not take the request). `stalled(backend)`, where given, has
    a POST wait on a backend only while it is not found stalled and the answer within one `timeout` however many
    backends are tried (one passed over as stalled after 2.5 s does not give the next a whole `timeout` more); one
    found stalled is passed over with that error kept. `disconnected(backend, exc)`, where given, marks down a
    backend that closed the connection before answering (else that is a failure as any other); its error is
    raised, or kept while the next is tried (`post`'s `resend`). Each pass to the next backend is counted in
    `retries` by (role, reason). When no backend takes a request: the last error kept, else 503 ``no_backend``
    "no {role} {noun} is reachable".
    """

    def __init__(self, pools: Sequence[Pool], timeout: float, *,
                 failed: Callable[[Backend, BaseException], ServingError],
                 answered: Callable[[Backend, Answer, bytes], Exception],
                 stalled: Callable[[Backend], ServingError] | None = None,
                 disconnected: Callable[[Backend, BaseException], ServingError] | None = None,
                 noun: str = "server") -> None:
        self.pools = tuple(pools)
        self.timeout = timeout  # idle: connecting, and each read
        self.failed, self.answered, self.stalled, self.disconnected = failed, answered, stalled, disconnected
        self.noun = noun
        self.retries: collections.Counter[tuple[str, str]] = collections.Counter()  # passed on, by (role, reason)
        # kept-alive connections; `timeout` bounds the connect and each wait on an answer
        self.http = AsyncHTTPClient(timeout, security.bearer_header(security.load_secret()), CLIENT_KEEPALIVE_S)

    async def close(self) -> None:
        """Close the HTTP client and its kept-alive connections (the server's end)."""
        await self.http.close()

    async def probe_forever(self) -> None:
        """For the server's life: probe every backend's /health on the pools' schedule (`Circuits.probe_due`),
        each probe a task."""
        try:
            while True:
                for pool in self.pools:
                    pool.circuits.probe_due(lambda i, pool=pool: asyncio.create_task(self.probe(pool.backends[i])))
                await asyncio.sleep(PROBE_INTERVAL)
        finally:
            for pool in self.pools:
                pool.circuits.cancel_probes()

    async def short(self, method: str, url: str, body: bytes | None = None) -> tuple[int, bytes] | None:
        """A short exchange (a probe, an abort): (status, body), or None when the backend does not answer
        within `PROBE_TIMEOUT`."""
        try:
            async with asyncio.timeout(min(self.timeout, PROBE_TIMEOUT)):
                response = await self.http.request(method, url, body, JSON_HEADERS if body else None)
                try:
                    raw = await response.read()
                except BaseException:
                    response.close()
                    raise
                response.release()
                return response.status, raw
        except EXCHANGE_ERRORS:
            return None

    async def probe(self, backend: Backend) -> dict[str, Any] | None:
        """GET the backend's /health: its JSON (or {}) when it answers 200, else None. The pool records the probe
        and the backend learns what it told (`Backend.learn`)."""
        answer = await self.short("GET", backend.url + "/health")
        Pool.probed(backend, answer is not None and answer[0] == 200)
        if answer is None or answer[0] != 200:
            return None
        backend.probed = True
        body: dict[str, Any] = {}
        with contextlib.suppress(msgspec.DecodeError):
            decoded = msgspec.json.decode(answer[1])
            body = decoded if isinstance(decoded, dict) else {}
        backend.learn(body)
        return body

    async def choose(self, pool: Pool, tried: set[str], only: Backend | None = None) -> Backend | None:
        """The next backend of `pool` to try (`only`: that one, once); when all untried ones are down, each is
        probed once first."""
        if only is not None:
            return None if only.url in tried else only
        backend = pool.choose(tried)
        if backend is None:
            await asyncio.gather(*(self.probe(b) for b in pool.backends if b.url not in tried))
            backend = pool.choose(tried)
        return backend

    async def post(self, pool: Pool, path: str, payload: bytes, *, only: Backend | None = None,
                   lost: list[Backend] | None = None, headers: dict[str, str] | None = None,
                   resend: bool = False) -> tuple[Backend, Answer]:
        """POST `payload` (JSON) to a backend of `pool` (`only` that one), going on to the next while connections
        are refused, it answers 503 (at capacity: it did not take the request), it is found stalled before it
        answered (with `stalled`), or, with `resend`, it closed the connection before answering (with
        `disconnected`). Each backend is tried once. `lost` collects a backend the request reached whose answer
        was lost (timed out, cut, stalled, closed, this caller cancelled): it may still be working on it.
        `headers` go with the JSON content type (a deadline).

        Returns a 200 response, its body not read yet, with the backend's ``inflight`` counted up: the caller
        counts it down and reads the body, then releases the response (or closes it, to stop the backend)
        (`Backend.finish`). Raises what the class docstring says.
        """
        tried: set[str] = set()
        deadline = time.monotonic() + self.timeout  # one bound for the answer, when stalls are watched
        busy: Exception | None = None  # the last 503, stall or close: what the caller gets when none takes it
        while (backend := await self.choose(pool, tried, only)) is not None:
            tried.add(backend.url)
            backend.inflight += 1
            ok = False
            try:
                try:
                    post = self.http.request("POST", backend.url + path, payload, {**JSON_HEADERS, **(headers or {})})
                    if self.stalled is None:
                        response = await post
                    else:
                        response = await progressing(backend, post, max(0.0, deadline - time.monotonic()))
                except ConnectError:
                    backend.liveness.refused()  # the request never reached it: the next one may take it
                    self.retries[pool.role, "refused"] += 1
                    continue
                except UNANSWERED_ERRORS as exc:
                    if self.disconnected is None:
                        raise self.failed(backend, exc) from None
                    backend.liveness.refused()  # down until a probe answers (a live one's next probe, 0.5 s)
                    if not resend:  # e.g. a decode, which may have taken the prefill's KV already
                        raise self.disconnected(backend, exc) from None
                    if lost is not None:  # if it lives after all, it may still hold the request
                        lost.append(backend)
                    busy = self.disconnected(backend, exc)
                    self.retries[pool.role, "disconnected"] += 1
                    continue
                except (*EXCHANGE_ERRORS, Stalled, asyncio.CancelledError) as exc:
                    if lost is not None:
                        lost.append(backend)
                    if isinstance(exc, Stalled) and self.stalled is not None:
                        busy = self.stalled(backend)  # it may wake and serve it later; the next one serves it now
                        self.retries[pool.role, "stalled"] += 1
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    raise self.failed(backend, exc) from None
                backend.liveness.heard()  # it answered: busy maybe, not frozen
                if response.status != 200:
                    try:
                        raw = await response.read()
                    except EXCHANGE_ERRORS as exc:
                        raise self.failed(backend, exc) from None
                    finally:
                        response.release()
                    error = self.answered(backend, response, raw)
                    if response.status == 503:  # refused at once, so it holds nothing: the next one may take it
                        busy = error
                        self.retries[pool.role, "busy"] += 1
                        continue
                    raise error
                backend.served += 1
                backend.streams.add(response)  # cut if the backend is found stalled
                ok = True
                return backend, response
            finally:
                if not ok:
                    backend.inflight -= 1
        if busy is not None:
            raise busy
        urls = ", ".join(b.url for b in pool.backends)
        raise Unavailable(f"no {pool.role} {self.noun} is reachable ({urls})", code="no_backend")


async def backend_health(client: PoolClient, backends: Sequence[Backend]) -> list[dict[str, Any]]:
    """Probe `backends` at once; each one's entry of the server's /health: its view (``healthy``, ``inflight``,
    ``served``) and, under ``health``, the JSON the backend's own /health answered (None when not 200)."""
    answers = await asyncio.gather(*(client.probe(b) for b in backends))
    return [{"url": b.url, "healthy": answer is not None, "inflight": b.inflight, "served": b.served,
             "health": answer} for b, answer in zip(backends, answers, strict=True)]


def backend_metrics(metrics: RoleMetrics, backends: Sequence[Backend], noun: str,
                    labels: tuple[str, ...]) -> list[Metric]:
    """The per-backend ``/metrics`` families, named by `metrics` (``backend_inflight``, ``backend_served_total``,
    ``backend_up``, ``backend_stalls_total``), each sample labelled by the `Backend` fields named in `labels`;
    `noun` names a backend in the help text."""
    now = time.monotonic()
    return [metrics.family(f"backend_{name}", kind, help_, labels,
                           ((tuple(getattr(b, k) for k in labels), value(b)) for b in backends))
            for name, kind, help_, value in (
                ("inflight", "gauge", f"requests in flight per {noun}", lambda b: b.inflight),
                ("served", "counter", f"requests each {noun} accepted", lambda b: b.served),
                ("up", "gauge", f"1 unless the {noun} is skipped (a refused connection, or stalled)",
                 lambda b: int(b.up(now))),
                ("stalls", "counter", f"times the {noun} was found stalled (probes unanswered)",
                 lambda b: b.stalls))]
