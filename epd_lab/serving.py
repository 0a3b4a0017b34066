"""How every epd_lab server starts: bind port 0 with TCP_NODELAY, serve with uvicorn, announce the URL.

Each role (encoder, prefill, decode, proxy) is a plain process; `epd_lab.launch` reads the one JSON line
``{"url", "pid"}`` it prints once serving to learn the port the OS chose.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
from typing import Any, AsyncIterator, Callable, Mapping, TypeVar

import msgspec

__all__ = ["add_status_routes", "add_trace_routes", "bind_tcp", "metrics_text", "run_server", "serve_and_announce",
           "server_arguments", "server_lifespan", "settings_from_args", "url_of"]

SettingsT = TypeVar("SettingsT")


def bind_tcp(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn. IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted
    sockets only when the listening socket says it is TCP (with proto 0, Nagle + delayed ACK add ~40 ms)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    """The base URL of a server listening on `sock`."""
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{sock.getsockname()[1]}"


def serve_and_announce(app: Any, sock: socket.socket, url: str, graceful_s: float) -> int:
    """Serve `app` on `sock` until SIGINT/SIGTERM, printing ``{"url", "pid"}`` once serving; 1 when start-up
    (the lifespan: model load, engine) failed."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=int(graceful_s) + 1)
    server = uvicorn.Server(config)

    async def run() -> bool:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:  # the launcher reads this line to learn the port
            print(json.dumps({"url": url, "pid": os.getpid()}), flush=True)
        await task
        return server.started

    return 0 if asyncio.run(run()) else 1


def metrics_text(prefix: str, values: list[tuple[str, str, float, str]],
                 statuses: tuple[str, Mapping[int, int]] | None = None) -> str:
    """Prometheus text exposition of (name, kind, value, help) rows, after the labelled counter
    ``{prefix}_http_requests_total{status=...}`` when `statuses` gives (route, answers by status)."""
    lines: list[str] = []
    if statuses is not None:
        route, counts = statuses
        name = f"{prefix}_http_requests_total"
        lines += [f"# HELP {name} {route} answers by status", f"# TYPE {name} counter"]
        lines += [f'{name}{{status="{s}"}} {n}' for s, n in sorted(counts.items())]
    for name, kind, value, help_ in values:
        lines += [f"# HELP {prefix}_{name} {help_}", f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {value}"]
    return "\n".join(lines) + "\n"


def server_lifespan(factory: Callable[[], Any]) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A FastAPI lifespan that builds the role's state off the event loop (model load, engine), keeps
    it in ``app.state.server`` and closes it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server = await asyncio.to_thread(factory)
        app.state.server = server
        try:
            yield
        finally:
            await asyncio.to_thread(server.close)

    return lifespan


def server_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """A role's command line, starting with ``--host`` (127.0.0.1) and ``--port`` (0: the OS picks)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: the OS picks (printed on stdout)")
    return ap


def settings_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, cls: type[SettingsT],
                       **values: Any) -> SettingsT:
    """`cls` (a settings dataclass) from the options named like its fields, `values` taking precedence;
    a value the settings refuse (`ValueError`) exits with the usage."""
    options = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(cls)}}
    try:
        return cls(**{**options, **values})
    except ValueError as exc:
        ap.error(str(exc))


def run_server(settings: Any, create_app: Callable[[Any], Any]) -> int:
    """Bind `settings.host:settings.port` (0: the OS picks), then serve `create_app(settings)` with the
    port filled in, until SIGINT/SIGTERM."""
    sock = bind_tcp(settings.host, settings.port)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])
    return serve_and_announce(create_app(settings), sock, url_of(settings.host, sock), settings.timeout)


def add_status_routes(app: Any, state: Callable[[], Any]) -> None:
    """``GET /health`` (JSON of ``state().health()``), ``GET /metrics`` (``state().metrics()``, Prometheus
    text) and the trace routes of ``state().recorder`` on a role's app; `state` returns the role's object
    once the lifespan has built it."""
    from fastapi.responses import PlainTextResponse, Response

    add_trace_routes(app, lambda: state().recorder)

    @app.get("/health")
    async def health() -> Response:
        return Response(msgspec.json.encode(state().health()), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state().metrics(), media_type="text/plain; version=0.0.4")


def add_trace_routes(app: Any, recorder: Callable[[], Any]) -> None:
    """``GET /v1/spans`` (the role's spans, oldest first; ``request_id`` — a request's or an OpenAI
    response's id — and ``since_ns`` filter, an unknown request gives an empty list) and ``GET /v1/clock``
    (CLOCK_MONOTONIC and host, for `epd_lab.trace.collect`'s clock offsets). `recorder` returns the role's
    `Recorder`."""
    from fastapi import Query
    from fastapi.responses import Response

    from epd_lab.trace import clock_answer, spans_answer

    @app.get("/v1/spans")
    async def spans(request_id: str = "", since_ns: int = Query(0, ge=0)) -> Response:
        page = spans_answer(recorder(), request_id or None, since_ns)
        page.spans.sort(key=lambda s: (s.t_start_ns, s.t_end_ns))
        return Response(msgspec.json.encode(page), media_type="application/json")

    @app.get("/v1/clock")
    async def clock() -> Response:
        return Response(msgspec.json.encode(clock_answer(recorder().node)), media_type="application/json")
