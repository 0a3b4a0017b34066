"""The floor every role's app stands on: one lifespan, one error answer, one request counter, the status routes.

    app = role_app("prefill", lambda: PrefillServer(settings), routes=("/v1/prefill", "/v1/abort"))

The role object the factory builds (off the event loop: model loads, engine start-up) is kept in
``app.state.server`` and must offer `Role`'s methods. `ServingError`s raised by a route are answered with
their status and ``{"detail": ...}`` (or the role's own shape: the proxy's OpenAI error objects), and so are
unknown routes and any other exception (500, with its type and message); ``GET /health``, ``GET /metrics``,
``GET /v1/spans`` and ``GET /v1/clock`` are added. With a shared secret (``EPD_SECRET``), every route but
``/health`` needs it as a bearer token (401 otherwise); ``/health`` answers anyone whether the role is alive
(``{"status": ...}`` and 200 or 503), and its detail only with the token.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import math
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Protocol

import msgspec

from epd_lab import security
from epd_lab.serving.errors import ServingError, error_for_status
from epd_lab.serving.metrics import CountRequests, Metric, RoleMetrics, refusal_family
from epd_lab.serving.stack import http_info

__all__ = ["DirectPosts", "Gate", "RequireBearer", "Role", "error_response", "json_response", "role_app"]

STATUS_ROUTES = ("/health", "/metrics", "/v1/spans", "/v1/clock")


@functools.cache
def _no_telemetry() -> dict[str, Any]:
    """FastAPI's native OpenTelemetry off, where FastAPI has it (0.165+): it asks the global providers on every
    request, a hop on a split request's critical path, and the roles trace with their own spans."""
    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


class Role(Protocol):
    """What a role's server object offers the floor (and, optionally, ``async def run()``: work for the server's
    life, run as a task and cancelled at shutdown, such as the encoder's TTL sweep)."""

    recorder: Any  # its `epd_lab.trace.Recorder`
    metrics: RoleMetrics  # names its ``/metrics`` families and owns its histograms

    def health(self) -> dict[str, Any]:
        """``/health``'s JSON (may be a coroutine); ``"status"`` other than ``"ok"`` answers 503."""

    def metric_families(self) -> Iterable[Metric]:
        """The role's own ``/metrics`` families (the request counter and the refusals are the floor's)."""

    def refusals(self) -> dict[str, float]:
        """What the role refused, by reason (``epd_lab:refusals_total``; the floor adds ``unauthorized`` and
        ``body_too_large``)."""

    def close(self) -> None:
        """Release everything (may be a coroutine); called once, at shutdown."""


def json_response(obj: Any, status: int = 200) -> Any:
    """A JSON answer encoded by msgspec (structs, dicts, lists)."""
    from fastapi.responses import Response

    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _detail_body(exc: ServingError) -> dict[str, Any]:
    return {"detail": exc.detail}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class RequireBearer:
    """ASGI middleware: every route but ``/health`` needs ``Authorization: Bearer <secret>``; anything else is
    answered 401 with the role's error body before the app sees it (`epd_lab.security`)."""

    OPEN_ROUTES = frozenset({"/health"})  # probes (load balancers) carry no secret: the route then shows status only

    def __init__(self, app: Any, secret: bytes, error_body: Callable[[ServingError], Any],
                 refusals: collections.Counter[str] | None = None) -> None:
        self.app, self.secret, self.error_body = app, secret, error_body
        self.refusals = collections.Counter() if refusals is None else refusals  # ``unauthorized``

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if security.check_bearer(self.secret, header):
            await self.app(scope, receive, send)
            return
        self.refusals["unauthorized"] += 1
        exc = ServingError("missing or wrong bearer token: this deployment needs its shared secret (EPD_SECRET) "
                           "in 'Authorization: Bearer ...'", status=401, code="unauthorized")
        response = json_response(self.error_body(exc), 401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class Gate:
    """ASGI middleware: `check(server, scope)` on each HTTP request before routing; the `ServingError` it returns
    is answered at once with the role's error body (and ``Retry-After``). A refusal here costs no routing, no
    body and no exception unwinding through the framework: under a burst of a thousand, what keeps each one
    cheap (`epd_lab.servers.proxy`'s admission)."""

    def __init__(self, app: Any, check: Callable[[Any, Any], ServingError | None],
                 error_body: Callable[[ServingError], Any]) -> None:
        self.app, self.check, self.error_body = app, check, error_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # the role's object, once the lifespan made it (Starlette puts itself in the scope)
        server = getattr(scope["app"].state, "server", None) if scope["type"] == "http" else None
        exc = self.check(server, scope) if server is not None else None
        if exc is None:
            if server is not None:
                # to the back of the loop's queue: the heads of a burst read in one pass of the loop start their
                # tasks in order, and the admitted ones' routing and first body read ran before the refusals
                # behind them were sent (a 1,000-burst's 600 refusals waited behind 400 admitted)
                await asyncio.sleep(0)
            await self.app(scope, receive, send)
            return
        await error_response(exc, self.error_body)(scope, receive, send)


class DirectPosts:
    """ASGI middleware: a POST to one of the app's plain routes (a static path, ``async def route(request)``)
    calls its function directly, without the framework's routing, dependency solving and exception middleware
    between: each role's request route (/v1/prefill, /encode, /v1/chat/completions...) is a hop on a split
    request's critical path, and that machinery took about a quarter of a lone POST's round trip
    (`data/bench/direct-posts-cpu-amd-epyc.json`). Answers are the framework's: a `ServingError` is answered
    here with the role's error body; any other exception goes on to the framework's outermost error middleware,
    which answers it 500 (`role_app`'s handler) and raises it on for the server's log, as before. Other methods
    and paths, and routes taking anything else, go the framework's way.

    `routes()` gives the app's routes; the table is built at the first request, once every route is added."""

    def __init__(self, app: Any, routes: Callable[[], Iterable[Any]],
                 error_body: Callable[[ServingError], Any]) -> None:
        from starlette.requests import Request  # imported with the app, not per request

        self.app, self.routes, self.error_body, self.request = app, routes, error_body, Request
        self.table: dict[str, Callable[[Any], Awaitable[Any]]] | None = None

    def _plain_posts(self) -> dict[str, Callable[[Any], Awaitable[Any]]]:
        table = {}
        for route in self.routes():
            endpoint, path = getattr(route, "endpoint", None), getattr(route, "path", "")
            if (getattr(route, "methods", None) == {"POST"} and "{" not in path
                    and inspect.iscoroutinefunction(endpoint)
                    and list(inspect.signature(endpoint).parameters) == ["request"]):
                table[path] = endpoint
        return table

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.table is None:
            self.table = self._plain_posts()
        endpoint = self.table.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await endpoint(self.request(scope, receive, send))
        except ServingError as exc:
            response = error_response(exc, self.error_body)
        await response(scope, receive, send)


def error_response(exc: ServingError, error_body: Callable[[ServingError], Any]) -> Any:
    """`exc` answered: its status, the role's error body, and ``Retry-After`` (whole seconds, at least 1) when
    it says when to retry."""
    response = json_response(error_body(exc), exc.status)
    if getattr(exc, "retry_after", None) is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return response


def role_app(role: str, factory: Callable[[], Role], routes: Iterable[str],
             error_body: Callable[[ServingError], Any] = _detail_body, secret: bytes | str | None = None,
             gate: Callable[[Any, Any], ServingError | None] | None = None) -> Any:
    """A FastAPI app for `role` (``epd_lab:{role}_...`` metrics, in a registry of its own). `factory` builds the
    role's object at start-up, in a thread; if it has ``async def run()``, that runs as a task for the server's
    life (sweepers). `routes` are the role's own paths (the request counter's labels); `error_body` shapes an
    error's JSON.
    `secret`: with one (None takes ``EPD_SECRET`` from the environment), every route but ``/health`` needs it as
    a bearer token (`RequireBearer`), and ``/health`` shows only ``status`` without it. `gate(server, scope)`: a
    refusal before routing (`Gate`), inside the secret's check and the request counter."""
    from fastapi import FastAPI, Header, Request
    from fastapi.responses import PlainTextResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    requests: collections.Counter[tuple[str, int]] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()  # the floor's own: 401s, bodies over the limit

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = await asyncio.to_thread(factory)
        app.state.server = server
        task = asyncio.create_task(server.run()) if hasattr(server, "run") else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if inspect.iscoroutinefunction(server.close):
                await server.close()
            else:
                await asyncio.to_thread(server.close)

    app = FastAPI(title=f"epd_lab {role}", lifespan=lifespan, **_no_telemetry())
    app.state.requests, app.state.refusals = requests, refusals
    app.add_middleware(DirectPosts, routes=lambda: app.router.routes, error_body=error_body)  # innermost
    if gate is not None:  # inside the secret's check and the counter: only a request with the secret is judged
        app.add_middleware(Gate, check=gate, error_body=error_body)
    secret = security.resolve(secret)
    if secret is not None:  # inside the counter (added later is outer), so refusals are counted as 401s
        app.add_middleware(RequireBearer, secret=secret, error_body=error_body, refusals=refusals)
    app.add_middleware(CountRequests, routes=(*routes, *STATUS_ROUTES), counts=requests)

    @app.exception_handler(ServingError)
    async def serving_error(request: Request, exc: ServingError) -> Any:
        return error_response(exc, error_body)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Any:  # a bug: answered, and logged by uvicorn
        return await serving_error(request, ServingError(f"{type(exc).__name__}: {exc}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:  # unknown routes and methods
        return await serving_error(request, error_for_status(exc.status_code, str(exc.detail)))

    @app.get("/health")
    async def health(authorization: str | None = Header(None)) -> Any:
        report = await _maybe_await(app.state.server.health())
        code = 200 if report.get("status") == "ok" else 503
        if secret is not None and not security.check_bearer(secret, authorization):
            # alive or not, to anyone; the rest names the topology's addresses (side channels, peers, sessions)
            return json_response({"status": report.get("status")}, code)
        report.setdefault("http", http_info())
        return json_response(report, code)

    registry = CollectorRegistry()  # this server's own: several servers may share a process (tests)
    registry.register(_FloorCollector(app, role))

    # routes are annotated `Any` (a module-level name): an annotation naming a class imported inside this
    # function cannot be resolved by FastAPI, and /openapi.json would answer 500
    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Any:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    _add_trace_routes(app, lambda: app.state.server.recorder)
    return app


class _FloorCollector:
    """The collector of a server's registry: at each scrape, the request counter, every refusal (the role's and
    the floor's) and the role's own families, read from the role's object as it stands."""

    def __init__(self, app: Any, role: str) -> None:
        self.app, self.role = app, role

    def collect(self) -> Iterator[Metric]:
        server = getattr(self.app.state, "server", None)
        if server is None:  # not started (or failed to): only the floor's counts
            metrics, own, refused = RoleMetrics(self.role, ""), [], {}
        else:
            metrics, own, refused = server.metrics, server.metric_families(), server.refusals()
        yield metrics.family("requests", "counter", "HTTP requests by route and status", ("route", "status"),
                             (((route, status), n) for (route, status), n in sorted(self.app.state.requests.items())))
        yield refusal_family(metrics, {"unauthorized": 0, "body_too_large": 0, **self.app.state.refusals, **refused})
        yield from own


def _add_trace_routes(app: Any, recorder: Callable[[], Any]) -> None:
    """``GET /v1/spans`` (the role's spans, oldest first; ``request_id`` — a request's or an OpenAI
    response's id — and ``since_ns`` filter, an unknown request gives an empty list) and ``GET /v1/clock``
    (CLOCK_MONOTONIC and host, for `epd_lab.trace.collect`'s clock offsets). `recorder` returns the role's
    `Recorder`."""
    from fastapi import Query

    from epd_lab.trace import clock_answer, spans_answer

    @app.get("/v1/spans")
    async def spans(request_id: str = "", since_ns: int = Query(0, ge=0)) -> Any:
        page = spans_answer(recorder(), request_id or None, since_ns)
        page.spans.sort(key=lambda s: (s.t_start_ns, s.t_end_ns))
        return json_response(page)

    @app.get("/v1/clock")
    async def clock() -> Any:
        return json_response(clock_answer(recorder().node))
