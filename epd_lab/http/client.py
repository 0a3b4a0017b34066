"""A small kept-alive HTTP/1.1 client for the synchronous hops (the prefill's receiver → encoders).

Why not httpx: on the 2-core VM, one kept-alive POST round trip to our uvicorn servers took 0.62-0.68 ms with
`httpx.Client` and 0.26-0.33 ms with `http.client` (200 B bodies), 0.86-0.99 against 0.48-0.49 ms with a 200 KB
image body (`epd-lab bench http`, `data/bench/http.json`). Why not `http.client` either (since 6c779f6,
2026-12-03): a socket that sends each request in one call and httptools (uvicorn's parser) reading the answer took
236 against 387 µs for the same 200 B POST (medians of 10 rounds of 200, side by side, 2-vCPU AMD EPYC), as the
proxy's asyncio client (`epd_lab.http.aio`) did against aiohttp. The receiver makes two such hops per part
(`/encode`, `/send`), and the /encode one is on every request's critical path.

Connections are pooled per host:port and reused; each is used by one thread at a time, and none is reused after
`serving.CLIENT_KEEPALIVE_S` idle, before the servers' own keep-alive ends it. `TCP_NODELAY` is set on every
connection (a request is one send, but its answer's reading must not wait on Nagle either). A request that fails
on a *reused* connection before any answer came (the server closed it meanwhile) is sent once more on a fresh
one; any other failure is raised.

`interrupt(url)` cuts the exchanges in flight to a server that stopped making progress (its /health probes go
unanswered: `epd_lab.serving.Liveness`); they raise `HTTPError` at once, with `Interrupted` as the cause, instead
of waiting out their timeout.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping

import httptools

from epd_lab import security
from epd_lab.serving import CLIENT_KEEPALIVE_S


class BadAnswer(OSError):
    """The server's answer was malformed, or its connection ended before the answer's end."""


class NoAnswer(ConnectionError):
    """The connection ended before any byte of an answer (a kept-alive one the server closed while it was idle, a
    server that died, or an interrupted exchange)."""


_STALE = (NoAnswer, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class Interrupted(ConnectionAbortedError):
    """The exchange was cut by `KeepAliveClient.interrupt`: the server stopped making progress."""


class HTTPError(Exception):
    """A request got no answer: the connection failed or timed out (`__cause__` says how)."""

    @property
    def refused(self) -> bool:
        """The server refused the connection: the request never reached it (another server may take it)."""
        return isinstance(self.__cause__, ConnectionRefusedError)

    @property
    def timed_out(self) -> bool:
        """No answer within the timeout (the server may be alive and still working on the request)."""
        return isinstance(self.__cause__, TimeoutError)

    @property
    def interrupted(self) -> bool:
        """Cut by `KeepAliveClient.interrupt`: the server may have the request, and may never answer."""
        return isinstance(self.__cause__, Interrupted)


def header_lines(headers: Mapping[str, str] | None) -> str:
    """`headers` as request header lines, each ending in CRLF."""
    return "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())


def request_bytes(method: str, url: str, body: bytes | None, headers: str) -> tuple[tuple[str, int], bytes]:
    """The host:port `url` names and the HTTP/1.1 request to it, head and body in one buffer (one send);
    `headers`: `header_lines`. Raises `ValueError` for a URL that is not plain http."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    length = f"Content-Length: {len(body)}\r\n" if body is not None else ""
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{headers}{length}\r\n"
    return (parts.hostname, parts.port or 80), head.encode("latin-1") + (body or b"")


class Connection:
    """One kept-alive connection (connected on first use): a socket and httptools' parser. Used by one thread at a
    time; `KeepAliveClient` pools them, `bench e2e`'s streaming client keeps one per thread."""

    def __init__(self, key: tuple[str, int], timeout: float) -> None:
        self.key, self.timeout = key, timeout
        self.sock: socket.socket | None = None
        self._body: list[bytes] = []
        self._on_body: Callable[[bytes], None] = self._body.append
        self._status, self._keep_alive, self._complete = 0, False, False

    def connect(self) -> None:
        sock = socket.create_connection(self.key, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._parser = sock, httptools.HttpResponseParser(self)

    def round_trip(self, request: bytes, on_body: Callable[[bytes], None] | None = None) -> tuple[int, bytes, bool]:
        """Send `request` whole and read its answer: (status, body, whether the connection stays open). With
        `on_body`, each piece of the body goes to it as soon as it is parsed (a stream), and the body returned is
        empty."""
        assert self.sock is not None
        self._body, self._complete = [], False
        self._on_body = on_body or self._body.append
        self.sock.sendall(request)
        answered = False
        while not self._complete:
            data = self.sock.recv(1 << 16)
            if not data:
                if answered:
                    raise BadAnswer("the connection ended before the answer's end")
                raise NoAnswer("the server closed the connection before answering")
            answered = True
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise BadAnswer(f"a malformed answer: {exc}") from None
        return self._status, b"".join(self._body), self._keep_alive

    def on_body(self, body: bytes) -> None:  # httptools
        self._on_body(body)

    def on_message_complete(self) -> None:  # httptools; read here: the parser resets for the next answer after
        self._status, self._keep_alive, self._complete = (self._parser.get_status_code(),
                                                          self._parser.should_keep_alive(), True)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class KeepAliveClient:
    """Thread-safe POSTs over pooled, kept-alive HTTP/1.1 connections.

    Args:
        timeout: seconds for the connect and for each socket read or write.
        max_idle: idle connections kept per host:port (more are closed when they come back).
        secret: the deployment's shared secret, sent as ``Authorization: Bearer`` (`epd_lab.security`); None
            takes ``EPD_SECRET`` from the environment.
    """

    def __init__(self, timeout: float, max_idle: int = 64, secret: bytes | str | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._auth = header_lines(security.bearer_header(security.resolve(secret)))
        self.timeout = timeout
        self.max_idle = max_idle
        self.connections_opened = 0
        # host:port -> (connection, when it went idle), the most recently used last
        self._idle: dict[tuple[str, int], list[tuple[Connection, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._busy: dict[tuple[str, int], set[Connection]] = {}  # in use, per host:port
        self._cut: set[Connection] = set()  # in use, and interrupted

    def post(self, url: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        """POST `body` to `url` (``http://host:port/path``); returns (status, the answer's body).

        Raises `HTTPError` when no answer came, `ValueError` for a URL that is not plain http.
        """
        key, request = request_bytes("POST", url, body, f"Content-Type: {content_type}\r\n{self._auth}")
        conn, reused = self._take(key)
        with self._lock:
            self._busy.setdefault(key, set()).add(conn)
        try:
            try:
                status, data = self._round_trip(conn, request)
            except _STALE:
                conn.close()
                if not reused or conn in self._cut:
                    raise
                reused = False  # the server closed it while it was idle: once more, on a fresh connection
                status, data = self._round_trip(conn, request)
        except OSError as exc:
            conn.close()
            if self._done(key, conn):
                raise HTTPError(f"interrupted: {url} stopped making progress") from Interrupted()
            raise HTTPError(f"{type(exc).__name__}: {exc}") from exc
        if self._done(key, conn):
            conn.close()  # answered just as it was cut: its socket is shut down
        else:
            self._give_back(key, conn)
        return status, data

    def _done(self, key: tuple[str, int], conn: Connection) -> bool:
        """`conn` is no longer in use; whether it was interrupted."""
        with self._lock:
            self._busy[key].discard(conn)
            cut = conn in self._cut
            self._cut.discard(conn)
        return cut

    def interrupt(self, url: str) -> int:
        """Cut every exchange in flight to `url`'s host:port (each raises `HTTPError`, `interrupted`); returns
        how many were cut."""
        parts = urllib.parse.urlsplit(url)
        key = (parts.hostname or "", parts.port or 80)
        with self._lock:
            conns = list(self._busy.get(key, ()))
            self._cut.update(conns)
        for conn in conns:
            with contextlib.suppress(OSError, AttributeError):  # AttributeError: not connected yet or any more
                conn.sock.shutdown(socket.SHUT_RDWR)  # the blocked read or write returns at once
        return len(conns)

    def _round_trip(self, conn: Connection, request: bytes) -> tuple[int, bytes]:
        if conn.sock is None:  # new, or closed by the server's last answer
            conn.connect()
            with self._lock:
                self.connections_opened += 1
        status, data, keep_alive = conn.round_trip(request)
        if not keep_alive:
            conn.close()  # the server ends it: the next request on it reconnects
        return status, data

    def _take(self, key: tuple[str, int]) -> tuple[Connection, bool]:
        with self._lock:
            if self._closed:
                raise HTTPError("the client is closed")
            idle = self._idle.get(key, [])
            fresh_since = time.monotonic() - CLIENT_KEEPALIVE_S
            expired = [conn for conn, since in idle if since <= fresh_since]
            idle[:] = [(conn, since) for conn, since in idle if since > fresh_since]
            taken = idle.pop()[0] if idle else None
        for conn in expired:
            conn.close()
        if taken is not None:
            return taken, True
        return Connection(key, self.timeout), False  # connected on first use

    def _give_back(self, key: tuple[str, int], conn: Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Close every idle connection; later posts raise `HTTPError`."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c, _ in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()

    def __enter__(self) -> "KeepAliveClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
