"""A front over N monolithic replicas: each completion request passed whole to one of them (``epd-lab front``).

The floor that EPD placements are measured against at equal GPUs is one monolithic replica per GPU, round-robin
(docs/gpu.md, "Two GPUs: placements at equal GPUs"): this is the round-robin. Each
``POST /v1/chat/completions`` or ``/v1/completions`` body goes unchanged to one replica chosen by
`epd_lab.servers.routing`'s `Pool` (``round_robin`` or ``least_loaded``), and the replica's answer comes back
unchanged: a JSON body whole, an SSE stream event by event. The replica does all the work (parsing, media,
model); the front adds one loopback HTTP hop and nothing else, so that 2x monolithic is measured as the replicas
serve it.

Why its own module and not a mode of the proxy: the proxy is an orchestrator of two calls (prefill, then decode
with the KV's handle) with admission, deadlines and KV aborts; a pass-through shares only the pool, the probes, the
POST passed on to the next replica (`routing.PoolClient`) and the error shapes (`serving`).

Choice and liveness as the proxy's: a replica that refuses its connection is skipped for ``--retry-after``
seconds and the request goes on to the next (it never reached the first); a replica answering 503 (it did not
take the request) is passed over too. Every replica's ``/health`` is probed every 0.5 s; one found stalled is
skipped until it answers, and its open exchanges are cut. When no replica takes a request: 503 ``no_backend``
(or the last replica's own 503). A replica's other errors pass through as it answered them; one that fails after
it took the request is 502 (504 past ``--timeout``), or, once a stream has begun, a last ``data: {"error": ...}``
event. ``--timeout`` is an idle timeout (connecting, each read), as the proxy's.

Routes: the two above, ``GET /v1/models``, ``/health`` (200 while one replica answers), ``/metrics`` (requests
and each replica's ``inflight``, ``served_total``, ``up``, ``stalls_total``), ``/v1/spans`` (none of its own:
the replicas' spans are the request's), ``/v1/clock``.

Run: ``python -m epd_lab.servers.front --port 0 --replica URL,URL`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd_lab.http.aio import Answer
from epd_lab.servers.openai_api import MODEL_ID, error_body, model_list
from epd_lab.servers.routing import (EXCHANGE_ERRORS, POLICIES, Backend, Pool, PoolClient, backend_health,
                                     backend_metrics)
from epd_lab.serving import (BadGateway, GatewayTimeout, Metric, RoleMetrics, ServingError, Unavailable,
                             json_response, option, read_body, role_app, serve_main)
from epd_lab.serving.settings import ServerSettings, check_at_least, check_choice, check_positive, check_urls
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
        check_urls(self, "replicas", "replica")
        check_choice(self, "policy", POLICIES)
        check_positive(self, "timeout")
        check_at_least(self, 0, "retry_after")


def _failed(backend: Backend, exc: BaseException) -> ServingError:
    """A failed exchange with a replica that had taken the request."""
    if isinstance(exc, asyncio.TimeoutError):
        return GatewayTimeout(f"replica {backend.url} timed out ({type(exc).__name__})")
    return BadGateway(f"replica {backend.url} failed: {type(exc).__name__}: {exc}")


class _Answered(Exception):
    """A replica's own non-200 answer, which goes back to the client as it gave it."""

    def __init__(self, backend: Backend, response: Answer, raw: bytes) -> None:
        super().__init__(f"replica {backend.url} answered {response.status}")
        self.response = Response(raw, response.status, media_type=response.content_type,
                                 headers={h: response.headers[h] for h in PASSED_HEADERS if h in response.headers})


class Front:
    """The front's state: the replicas' pool and the HTTP client to them."""

    def __init__(self, settings: FrontSettings) -> None:
        self.settings = settings
        self.pool = Pool("monolithic", settings.replicas, settings.policy, settings.retry_after)
        self.client = PoolClient((self.pool,), settings.timeout, failed=_failed, answered=_Answered, noun="replica")
        self.recorder = Recorder(node=f"front:{settings.port}")
        self.metrics = RoleMetrics("front", settings.model)
        self.refused: collections.Counter[str] = collections.Counter()  # its own 503s, by code

    async def run(self) -> None:
        """For the server's life: probe every replica (`PoolClient.probe_forever`)."""
        await self.client.probe_forever()

    async def close(self) -> None:
        await self.client.close()

    async def forward(self, request: Request, path: str) -> Response:
        """Pass one completion request to a replica and its answer back: its 200 answer, or a replica's other
        answer as it gave it (its 503 only when no replica took the request). `Unavailable` when none answered."""
        try:
            backend, response = await self.client.post(self.pool, path, bytes(await read_body(request)))
        except _Answered as answered:
            return answered.response
        except Unavailable as exc:  # no replica took it (a replica's own 503 is its refusal, counted there)
            self.refused[exc.code] += 1
            raise
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
        replicas = await backend_health(self.client, self.pool.backends)
        ok = any(r["healthy"] for r in replicas)
        return {"status": "ok" if ok else "unavailable", "role": "front", "model": self.settings.model,
                "policy": self.settings.policy, "replicas": replicas}

    def metric_families(self) -> list[Metric]:
        """Per replica (labelled by its URL): requests in flight, requests it took, whether it is up, its stalls."""
        return backend_metrics(self.metrics, self.pool.backends, "replica", ("url",))

    def refusals(self) -> dict[str, float]:
        """Its 503s by code (``no_backend``: no replica reachable); a replica's 503 passed on is the replica's."""
        return dict(self.refused)


class _Relay:
    """A replica's SSE stream passed on whole event by whole event, so that a failure mid-stream can still end it
    with a well-formed error event."""

    def __init__(self, backend: Backend, response: Answer) -> None:
        self.backend, self.response = backend, response
        self.done = False  # read to its end: the connection can be reused
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for piece in self.response.chunks():
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
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
