"""A front over N monolithic replicas: each completion request passed whole to one of them (``epd-lab front``).

The issue-22 floor at equal GPUs is one monolithic replica per GPU, round-robin: this is the round-robin. Each
``POST /v1/chat/completions`` or ``/v1/completions`` body goes unchanged to one replica chosen by
`epd_lab.servers.routing`'s `Pool` (``round_robin`` or ``least_loaded``), and the replica's answer comes back
unchanged: a JSON body whole, an SSE stream event by event. The replica does all the work (parsing, media,
model); the front adds one loopback HTTP hop and nothing else, so that 2x monolithic is measured as the replicas
serve it.

Why its own module and not a mode of the proxy: the proxy is an orchestrator of two calls (prefill, then decode
with the KV's handle) with admission, deadlines and KV aborts; a pass-through shares only the pool, the probes and
the error shapes, which it takes from `routing`, `serving` and the proxy's module.

Choice and liveness as the proxy's: a replica that refuses its connection is skipped for ``--retry-after``
seconds and the request goes on to the next (it never reached the first); a replica answering 503 (it did not
take the request) is passed over too. Every replica's ``/health`` is probed every 0.5 s; one found stalled is
skipped until it answers, and its open exchanges are cut. When no replica takes a request: 503 ``no_backend``
(or the last replica's own 503). A replica's other errors pass through as it answered them; one that fails after
it took the request is 502 (504 past ``--timeout``), or, once a stream has begun, a last ``data: {"error": ...}``
event. ``--timeout`` is an idle timeout (connecting, each read), as the proxy's.

Routes: the two above, ``GET /v1/models``, ``/health`` (200 while one replica answers), ``/metrics`` (requests
and each replica's ``inflight``, ``served_total``, ``up``), ``/v1/spans`` (none of its own: the replicas' spans
are the request's), ``/v1/clock``.

Run: ``python -m epd_lab.servers.front --port 0 --replica URL,URL`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd_lab import security
from epd_lab.servers.openai_api import MODEL_ID, error_body, model_list
from epd_lab.servers.proxy import EXCHANGE_ERRORS, JSON_HEADERS
from epd_lab.servers.routing import POLICIES, Backend, Pool
from epd_lab.serving import (CLIENT_KEEPALIVE_S, PROBE_INTERVAL, PROBE_TIMEOUT, BadGateway, GatewayTimeout, Metric,
                             ServingError, Unavailable, json_response, option, read_body, role_app, serve_main)
from epd_lab.serving.settings import ServerSettings, check_at_least, check_choice, check_positive
from epd_lab.serving.stream import ClosingStreamingResponse
from epd_lab.trace import Recorder

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
PASSED_HEADERS = ("Retry-After",)  # of a replica's error answer, kept on the way back


@dataclasses.dataclass(slots=True, frozen=True)
class FrontSettings(ServerSettings):
    """What a front is started with; checked on construction (`ValueError`)."""

    replicas: tuple[str, ...] = option(help="monolithic server URL(s)", flag="--replica")
    policy: str = option("round_robin", "how a replica is chosen", choices=POLICIES)
    timeout: float = option(30.0, "seconds; idle timeout of every replica call (connect, each read)")
    retry_after: float = option(5.0, "seconds a replica that refused a connection is skipped")
    model: str = option(MODEL_ID, "the model id /v1/models lists")

    def __post_init__(self) -> None:
        ServerSettings.__post_init__(self)
        object.__setattr__(self, "replicas", tuple(u.rstrip("/") for u in self.replicas))
        if not self.replicas:
            raise ValueError("at least one replica URL is needed")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        check_choice(self, "policy", POLICIES)
        check_positive(self, "timeout")
        check_at_least(self, 0, "retry_after")


def _failed(backend: Backend, exc: BaseException) -> ServingError:
    """A failed exchange with a replica that had taken the request."""
    if isinstance(exc, asyncio.TimeoutError):
        return GatewayTimeout(f"replica {backend.url} timed out ({type(exc).__name__})")
    return BadGateway(f"replica {backend.url} failed: {type(exc).__name__}: {exc}")


class Front:
    """The front's state: the replicas' pool and the HTTP client to them."""

    def __init__(self, settings: FrontSettings) -> None:
        self.settings = settings
        self.pool = Pool("monolithic", settings.replicas, settings.policy, settings.retry_after)
        self.recorder = Recorder(node=f"front:{settings.port}")
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP client to the replicas, made on first use (on the event loop), with the proxy's options."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.timeout,
                                              sock_read=self.settings.timeout),
                skip_auto_headers=("User-Agent",), headers=security.bearer_header(security.load_secret()))
        return self._session

    async def run(self) -> None:
        """For the server's life: probe every replica's /health each `PROBE_INTERVAL`, one probe in flight each."""
        probes: dict[str, asyncio.Task] = {}
        try:
            while True:
                for backend in self.pool.backends:
                    if backend.url not in probes or probes[backend.url].done():
                        probes[backend.url] = asyncio.create_task(self._probe(backend))
                await asyncio.sleep(PROBE_INTERVAL)
        finally:
            for task in probes.values():
                task.cancel()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _probe(self, backend: Backend) -> dict[str, Any] | None:
        """GET the replica's /health: its JSON when it answers 200, else None; the pool records the probe."""
        try:
            async with self.session.get(backend.url + "/health", timeout=aiohttp.ClientTimeout(
                    total=min(self.settings.timeout, PROBE_TIMEOUT))) as response:
                status, raw = response.status, await response.read()
        except EXCHANGE_ERRORS:
            status, raw = 0, b""
        Pool.probed(backend, status == 200)
        if status != 200:
            return None
        with contextlib.suppress(msgspec.DecodeError):
            body = msgspec.json.decode(raw)
            return body if isinstance(body, dict) else {}
        return {}

    async def _choose(self, tried: set[str]) -> Backend | None:
        """The next replica by the policy; when every untried one is down, each is probed once first."""
        backend = self.pool.choose(tried)
        if backend is None:
            await asyncio.gather(*(self._probe(b) for b in self.pool.backends if b.url not in tried))
            backend = self.pool.choose(tried)
        return backend

    async def _send(self, path: str, body: bytes) -> tuple[Backend, aiohttp.ClientResponse] | Response:
        """POST `body` to one replica, going on while they refuse the connection or answer 503: its 200 response
        (body unread, counted in flight: the caller finishes it), or a replica's other error answer as it gave
        it. `Unavailable` when no replica took it."""
        tried: set[str] = set()
        busy: Response | None = None  # the last 503: what the client gets when no replica takes the request
        while (backend := await self._choose(tried)) is not None:
            tried.add(backend.url)
            backend.inflight += 1
            taken = False
            try:
                try:
                    response = await self.session.post(backend.url + path, data=body, headers=JSON_HEADERS)
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                    backend.liveness.refused()  # the request never reached it: the next one may take it
                    continue
                except EXCHANGE_ERRORS as exc:
                    raise _failed(backend, exc) from None
                backend.liveness.heard()
                if response.status == 200:
                    backend.served += 1
                    backend.streams.add(response)  # cut if the replica is found stalled
                    taken = True
                    return backend, response
                try:
                    raw = await response.read()
                except EXCHANGE_ERRORS as exc:
                    raise _failed(backend, exc) from None
                finally:
                    response.release()
            finally:
                if not taken:
                    backend.inflight -= 1
            answer = Response(raw, response.status, media_type=response.content_type,
                              headers={h: response.headers[h] for h in PASSED_HEADERS if h in response.headers})
            if response.status != 503:  # the replica's own verdict on the request (a bad image: 400)
                return answer
            busy = answer
        if busy is not None:
            return busy
        raise Unavailable(f"no monolithic replica is reachable ({', '.join(b.url for b in self.pool.backends)})",
                          code="no_backend")

    async def forward(self, request: Request, path: str) -> Response:
        """Pass one completion request to a replica and its answer back."""
        sent = await self._send(path, bytes(await read_body(request)))
        if isinstance(sent, Response):
            return sent
        backend, response = sent
        if response.content_type == "text/event-stream":
            relay = _Relay(backend, response)
            return ClosingStreamingResponse(relay.events(), relay.close, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        done = False
        try:
            raw = await response.read()
            done = True
        except EXCHANGE_ERRORS as exc:
            raise _failed(backend, exc) from None
        finally:
            backend.finish(response, reuse=done)
        return Response(raw, 200, media_type=response.content_type)

    async def health(self) -> dict[str, Any]:
        """Probe every replica; ``status`` "ok" (200) while at least one answers, else "unavailable" (503)."""
        answers = await asyncio.gather(*(self._probe(b) for b in self.pool.backends))
        replicas = [{"url": b.url, "healthy": answer is not None, "inflight": b.inflight, "served": b.served,
                     "health": answer} for b, answer in zip(self.pool.backends, answers, strict=True)]
        ok = any(r["healthy"] for r in replicas)
        return {"status": "ok" if ok else "unavailable", "role": "front", "model": self.settings.model,
                "policy": self.settings.policy, "replicas": replicas}

    def metric_families(self) -> list[Metric]:
        """Per replica: requests in flight, requests it took, whether it is up."""
        now = time.monotonic()
        return [Metric(f"backend_{name}", kind, help_, tuple(("", {"url": b.url}, value(b))
                                                             for b in self.pool.backends))
                for name, kind, help_, value in (
                    ("inflight", "gauge", "requests in flight per replica", lambda b: b.inflight),
                    ("served_total", "counter", "requests each replica took", lambda b: b.served),
                    ("up", "gauge", "1 unless the replica is skipped (a refused connection, or stalled)",
                     lambda b: int(b.up(now))))]


class _Relay:
    """A replica's SSE stream passed on whole event by whole event, so that a failure mid-stream can still end it
    with a well-formed error event."""

    def __init__(self, backend: Backend, response: aiohttp.ClientResponse) -> None:
        self.backend, self.response = backend, response
        self.done = False  # read to its end: the connection can be reused
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for piece in self.response.content.iter_any():
                self.backend.liveness.heard()
                head, sep, pending = (pending + piece).rpartition(b"\n\n")
                if sep:
                    yield head + sep
            self.done = True
            if pending.strip():
                yield pending
        except EXCHANGE_ERRORS as exc:
            error = _failed(self.backend, exc)
            yield b"data: " + msgspec.json.encode(error_body(error)) + b"\n\ndata: [DONE]\n\n"

    async def close(self) -> None:
        """Give the connection back (or close it, which stops the replica's generation); idempotent."""
        if not self.closed:
            self.closed = True
            self.backend.finish(self.response, reuse=self.done)


def create_app(settings: FrontSettings) -> FastAPI:
    """The front's app; errors, unknown routes included, are OpenAI error objects."""
    app = role_app("front", lambda: Front(settings), ROUTES, error_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await app.state.server.forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await app.state.server.forward(request, "/v1/completions")

    @app.get("/v1/models")
    async def list_models() -> Any:
        return json_response(model_list(settings.model))

    return app


def main(argv: list[str] | None = None) -> int:
    """``epd-lab front``: serve until SIGINT/SIGTERM."""
    return serve_main(FrontSettings, create_app, argv, "epd-lab front",
                      "round-robin over monolithic replicas: each request passed whole to one")


if __name__ == "__main__":
    sys.exit(main())
