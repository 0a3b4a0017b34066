"""A small kept-alive HTTP/1.1 client for the synchronous hops (the prefill's receiver → encoders).

Why not httpx: on the 2-core VM, one kept-alive POST round trip to our uvicorn servers took 0.62-0.68 ms with
`httpx.Client` and 0.26-0.33 ms with `http.client` (200 B bodies), 0.86-0.99 against 0.48-0.49 ms with a 200 KB
image body (`epd-lab bench http`, `data/bench/http.json`). The receiver makes two such hops per part (`/encode`,
`/send`) on every request's critical path.

Connections are pooled per host:port and reused; each is used by one thread at a time, and none is reused after
`serving.CLIENT_KEEPALIVE_S` idle, before the servers' own keep-alive ends it. `TCP_NODELAY` must be on:
`http.client` writes the headers and the body in two sends, which Nagle and delayed ACK hold back ~44 ms
(measured); CPython 3.11's `connect` sets it, and it is set here again rather than trusted. A request that fails
on a *reused* connection before any answer came (the server closed it meanwhile) is sent once more on a fresh
one; any other failure is raised.

`interrupt(url)` cuts the exchanges in flight to a server that stopped making progress (its /health probes go
unanswered: `epd_lab.serving.Liveness`); they raise `HTTPError` at once, with `Interrupted` as the cause, instead
of waiting out their timeout.
"""
from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse

from epd_lab import security
from epd_lab.serving import CLIENT_KEEPALIVE_S

_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


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
        self._auth = security.bearer_header(security.resolve(secret))
        self.timeout = timeout
        self.max_idle = max_idle
        self.connections_opened = 0
        # host:port -> (connection, when it went idle), the most recently used last
        self._idle: dict[tuple[str, int], list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._busy: dict[tuple[str, int], set[http.client.HTTPConnection]] = {}  # in use, per host:port
        self._cut: set[http.client.HTTPConnection] = set()  # in use, and interrupted

    def post(self, url: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        """POST `body` to `url` (``http://host:port/path``); returns (status, the answer's body).

        Raises `HTTPError` when no answer came, `ValueError` for a URL that is not plain http.
        """
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        key = (parts.hostname, parts.port or 80)
        path = parts.path or "/"
        headers = {"Content-Type": content_type, "Content-Length": str(len(body)), **self._auth}
        conn, reused = self._take(key)
        with self._lock:
            self._busy.setdefault(key, set()).add(conn)
        try:
            try:
                status, data = self._round_trip(conn, path, body, headers)
            except _STALE:
                conn.close()
                if not reused or conn in self._cut:
                    raise
                reused = False  # the server closed it while it was idle: once more, on a fresh connection
                status, data = self._round_trip(conn, path, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if self._done(key, conn):
                raise HTTPError(f"interrupted: {url} stopped making progress") from Interrupted()
            raise HTTPError(f"{type(exc).__name__}: {exc}") from exc
        if self._done(key, conn):
            conn.close()  # answered just as it was cut: its socket is shut down
        else:
            self._give_back(key, conn)
        return status, data

    def _done(self, key: tuple[str, int], conn: http.client.HTTPConnection) -> bool:
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

    def _round_trip(self, conn: http.client.HTTPConnection, path: str, body: bytes,
                    headers: dict[str, str]) -> tuple[int, bytes]:
        if conn.sock is None:  # new, or closed by the server's last answer
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections_opened += 1
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        if response.will_close:
            conn.close()  # the server ends it: the next request on it reconnects
        return response.status, data

    def _take(self, key: tuple[str, int]) -> tuple[http.client.HTTPConnection, bool]:
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
        return http.client.HTTPConnection(*key, timeout=self.timeout), False  # connected on first use

    def _give_back(self, key: tuple[str, int], conn: http.client.HTTPConnection) -> None:
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
