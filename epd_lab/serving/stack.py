"""How every epd_lab server starts: bind port 0 with TCP_NODELAY, serve with uvicorn, announce the URL.

Each role (encoder, prefill, decode, proxy) is a plain process; `epd_lab.launch` reads the one JSON line
``{"url", "pid"}`` it prints once serving to learn the port the OS chose.

The HTTP stack is uvloop + httptools where installed (the fastest in `epd-lab bench http`), else asyncio +
h11; ``EPD_HTTP_LOOP`` / ``EPD_HTTP_PARSER`` force one. Idle connections stay open `KEEPALIVE_S`, well past
the `CLIENT_KEEPALIVE_S` our clients keep them, so that the client always retires a connection first and
never sends a request into one the server is closing.

Bounds: at most `MAX_CONNECTIONS` connections at once (``EPD_HTTP_MAX_CONNECTIONS``); one past it is closed as
it is accepted, unanswered, and counted. A connection that sends nothing for `KEEPALIVE_S` after it opened
(``EPD_HTTP_IDLE_S``) is closed too, as uvicorn closes one idle between requests: idle sockets cannot pile up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import socket
from typing import Any, Callable

__all__ = ["CLIENT_KEEPALIVE_S", "KEEPALIVE_S", "LOOPS", "PARSERS", "bind_tcp", "http_info", "http_stack",
           "run_server", "serve_and_announce", "serve_main", "url_of"]

LOOPS = ("uvloop", "asyncio")  # preferred first
PARSERS = ("httptools", "h11")
# uvicorn's default (5 s) equals httpx's default keepalive_expiry, and the server's timer starts when it hands
# the response over, the client's once it has read it: the server closes first. httpx then reconnects if it
# saw the FIN, fails a request sent while the FIN is in flight ("Server disconnected without sending a
# response"), and a client that keeps connections longer (http.client) writes into a closed socket.
KEEPALIVE_S = 75
CLIENT_KEEPALIVE_S = 60.0  # what our clients should keep idle connections (httpx.Limits(keepalive_expiry=...))
MAX_CONNECTIONS = 1024  # per server: far above a proxy's kept-alive connections to it under 200 concurrent clients


@dataclasses.dataclass
class _Served:
    """What this process serves with, and the connections it accepted (for `http_info`)."""

    parser: str | None = None
    accepted: int = 0
    open: int = 0
    refused: int = 0  # closed at accept: `max_connections` were open
    idle_closed: int = 0  # closed before their first byte came
    max_connections: int = MAX_CONNECTIONS
    idle_s: float = KEEPALIVE_S


_served = _Served()


def http_stack(loop: str = "auto", parser: str = "auto") -> tuple[str, str]:
    """The (event loop, HTTP parser) to serve with. ``auto`` takes ``EPD_HTTP_LOOP`` / ``EPD_HTTP_PARSER``
    when set, else uvloop / httptools when importable, else asyncio / h11; a named one must be importable."""
    loop = os.environ.get("EPD_HTTP_LOOP", "auto") if loop == "auto" else loop
    parser = os.environ.get("EPD_HTTP_PARSER", "auto") if parser == "auto" else parser
    if loop not in ("auto", *LOOPS) or parser not in ("auto", *PARSERS):
        raise ValueError(f"unknown HTTP stack {loop}/{parser}: loops {LOOPS}, parsers {PARSERS}")
    return _importable(loop, LOOPS), _importable(parser, PARSERS)


def _importable(name: str, choices: tuple[str, str]) -> str:
    """`name`, or for ``auto`` the first of `choices` that imports (the last, stdlib-backed one always does)."""
    for choice in (choices if name == "auto" else (name,)):
        try:
            importlib.import_module(choice)
            return choice
        except ImportError:
            if name != "auto":
                raise
    return choices[-1]


def _counted(protocol: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP `protocol` (one instance per TCP connection) counting the connections it serves."""

    class Counted(protocol):  # type: ignore[valid-type,misc]
        _refused = False
        _first_byte: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if _served.open >= _served.max_connections:
                _served.refused += 1
                self._refused = True
                transport.close()
                return
            _served.accepted += 1
            _served.open += 1
            self._first_byte = asyncio.get_running_loop().call_later(_served.idle_s, self._idle, transport)
            super().connection_made(transport)

        def _idle(self, transport: asyncio.BaseTransport) -> None:
            _served.idle_closed += 1
            transport.close()

        def data_received(self, data: bytes) -> None:
            if self._first_byte is not None:
                self._first_byte.cancel()
                self._first_byte = None
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            if self._first_byte is not None:
                self._first_byte.cancel()
            _served.open -= 1
            super().connection_lost(exc)

    Counted.__name__ = Counted.__qualname__ = protocol.__name__
    return Counted


def http_info() -> dict[str, Any]:
    """This server's HTTP stack, as its ``/health`` shows it: the event loop (asked of the running loop),
    the parser and keep-alive it serves with, and the TCP connections it accepted and holds open (far
    fewer accepted than requests served: clients keep them alive)."""
    try:
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    except RuntimeError:
        loop = None
    return {"loop": loop, "parser": _served.parser, "keepalive_s": KEEPALIVE_S,
            "connections_accepted": _served.accepted, "connections_open": _served.open,
            "max_connections": _served.max_connections, "connections_refused": _served.refused,
            "connections_idle_closed": _served.idle_closed}


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


def serve_and_announce(app: Any, sock: socket.socket, url: str, graceful_s: float, loop: str = "auto",
                       parser: str = "auto") -> int:
    """Serve `app` on `sock` until SIGINT/SIGTERM, printing ``{"url", "pid"}`` once serving; 1 when start-up
    (the lifespan: model load, engine) failed. `loop` and `parser` as `http_stack` takes them."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    loop, _served.parser = http_stack(loop, parser)
    _served.max_connections = int(os.environ.get("EPD_HTTP_MAX_CONNECTIONS", MAX_CONNECTIONS))
    _served.idle_s = float(os.environ.get("EPD_HTTP_IDLE_S", KEEPALIVE_S))
    protocol = _counted(import_from_string(HTTP_PROTOCOLS[_served.parser]))
    # access_log off: at log_level "warning" its lines are dropped anyway, after their fields were built;
    # proxy_headers off: no server here sits behind a proxy whose X-Forwarded-For it trusts
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=protocol,
                            proxy_headers=False, timeout_keep_alive=KEEPALIVE_S,
                            timeout_graceful_shutdown=int(graceful_s) + 1)
    server = uvicorn.Server(config)

    async def run() -> bool:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:  # the launcher reads this line to learn the port
            print(json.dumps({"url": url, "pid": os.getpid()}), flush=True)
        await task
        return server.started

    if loop == "uvloop":
        import uvloop

        return 0 if uvloop.run(run()) else 1
    return 0 if asyncio.run(run()) else 1


def serve_main(cls: type, create_app: Callable[[Any], Any], argv: list[str] | None, prog: str,
               description: str) -> int:
    """A role's ``main``: its settings `cls` from the command line (errors exit with the usage), then
    `run_server`."""
    from epd_lab.serving.settings import from_argv

    return run_server(from_argv(cls, argv, prog, description), create_app)


def run_server(settings: Any, create_app: Callable[[Any], Any]) -> int:
    """Bind `settings.host:settings.port` (0: the OS picks), then serve `create_app(settings)` with the
    port filled in, until SIGINT/SIGTERM."""
    sock = bind_tcp(settings.host, settings.port)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])
    return serve_and_announce(create_app(settings), sock, url_of(settings.host, sock), settings.timeout)
