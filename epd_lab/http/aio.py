"""The proxy's and the front's HTTP/1.1 client to their backends, on asyncio: kept-alive connections, one write a
request, answers parsed by httptools (uvicorn's parser) as they arrive.

Why not aiohttp: a kept-alive POST round trip to a uvicorn server took 325 µs with aiohttp's session (median of
10 rounds of 300, range 226-440) against 148 µs (141-179) with an `asyncio.Protocol` that writes the request in
one call and parses the answer with httptools, side by side on a 2-vCPU AMD EPYC (uvloop on both ends); the proxy
makes one such round trip to the prefill on every request's critical path. This client keeps only what the proxy
and the front use: POST and GET, bodies given whole, answers read whole (`Answer.read`) or as they arrive
(`Answer.chunks`: a decode's NDJSON, a replica's SSE), per-read timeouts.

Connections are pooled per host:port, most recently used first, and none is reused after `CLIENT_KEEPALIVE_S`
idle (before the servers' own keep-alive ends it). A request that fails on a *reused* connection before any byte
of its answer came (the server closed it meanwhile) is sent once more on a fresh one, as `epd_lab.http.client`
does; on a fresh connection that is `Disconnected`: the server closed it, it did not answer. When the fresh one
cannot even connect, the server died with the request possibly on it: `Disconnected` too, not `ConnectError`
(which says the request never reached it). An answer read to
its end goes back to the pool (`Answer.release`); one cut short is closed (`Answer.close`), which the server sees
as its client gone (a decode stops generating).
"""
from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import AsyncIterator, Mapping

import httptools

from epd_lab.http.client import header_lines, request_bytes
from epd_lab.serving import CLIENT_KEEPALIVE_S

__all__ = ["Answer", "AsyncHTTPClient", "BrokenAnswer", "ClientError", "ConnectError", "Disconnected"]

MAX_BUFFERED = 1 << 20  # bytes of an answer held unread before the socket stops being read


class ClientError(Exception):
    """An exchange failed (a timeout raises `asyncio.TimeoutError` instead, `TimeoutError` from Python 3.11)."""


class ConnectError(ClientError):
    """No connection could be made (refused, unreachable, or the connect timed out: `__cause__` says which):
    the request never reached the server."""


class Disconnected(ClientError):
    """The server closed (or reset) the connection before any byte of its answer."""


class BrokenAnswer(ClientError):
    """The answer was malformed, or the connection ended (or was closed here) before its end."""


class Headers(dict[str, str]):
    """An answer's headers, by lower-cased name (the last of a repeated one)."""

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


class _Connection(asyncio.Protocol):
    """One kept-alive connection and the exchange on it (one at a time)."""

    def __init__(self, key: tuple[str, int], open_set: set[_Connection]) -> None:
        self.key = key
        self._open = open_set  # the client's: left when the connection ends
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status: int | None = None
        self.reason = ""
        self.headers = Headers()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.answered = False  # a byte of the answer came
        self.error: Exception | None = None

    # ---- asyncio ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small writes leave at once (asyncio sets it too; not trusted)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BrokenAnswer(f"a malformed answer: {exc}"))
            self.close()
            return
        if self.buffered > MAX_BUFFERED and self.transport is not None and not self.complete and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._open.discard(self)
        if not self.complete:
            if not self.answered:
                self._fail(Disconnected(f"the server closed the connection before answering ({exc or 'EOF'})"))
            else:
                self._fail(BrokenAnswer(f"the connection ended before the answer's end ({exc or 'EOF'})"))
        self._wake()

    # ---- httptools ----
    def on_status(self, status: bytes) -> None:
        self.reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # ---- the exchange ----
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until more of the answer, its end or an error came (`TimeoutError` after `timeout` s of nothing)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter, timeout)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    def take(self) -> bytes:
        """The body bytes arrived and not yet taken."""
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError(f"no answer within {timeout:g} s"))


class Answer:
    """A 2xx-5xx answer whose head came: `status`, `reason`, `headers`; its body read whole (`read`) or as it
    arrives (`chunks`), then the connection given back (`release`) or closed (`close`). Exchange failures raise
    `ClientError` or `TimeoutError`."""

    def __init__(self, client: AsyncHTTPClient, conn: _Connection, timeout: float) -> None:
        self._client, self._conn, self._timeout = client, conn, timeout
        self.status: int = conn.status or 0
        self.reason = conn.reason
        self.headers = conn.headers
        self._done = False  # given back or closed

    @property
    def content_type(self) -> str:
        """The media type, without its parameters (``application/json``)."""
        return (self.headers.get("content-type") or "application/octet-stream").split(";")[0].strip().lower()

    @property
    def complete(self) -> bool:
        """The whole body has come (a read then waits for nothing)."""
        return self._conn.complete

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in pieces as they came (each wait bounded by the client's timeout)."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            if self._done:
                raise BrokenAnswer("the answer was closed before its end")
            await conn.wait(self._timeout)

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.chunks()])

    def release(self) -> None:
        """Give the connection back to the pool when the answer was read to its end (else close it)."""
        if self._done:
            return
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self._done = True
            self._client._give_back(conn)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection: the server sees its client gone."""
        if not self._done:
            self._done = True
            self._conn.close()
            self._conn._wake()  # a reader waiting on it fails at once


class AsyncHTTPClient:
    """Requests over pooled, kept-alive connections (use from one event loop).

    Args:
        timeout: seconds for the connect and for each wait on the answer (the head, each piece of the body).
        headers: sent with every request (a bearer token).
        keepalive: seconds an idle connection may wait to be reused.
    """

    def __init__(self, timeout: float, headers: Mapping[str, str] | None = None,
                 keepalive: float = CLIENT_KEEPALIVE_S) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.keepalive = keepalive
        self._headers = header_lines(headers)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self.connections_opened = 0

    async def request(self, method: str, url: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: float | None = None) -> Answer:
        """Send a request and wait for its answer's head; the body is the `Answer`'s to read. `timeout` overrides
        the client's for this exchange. Raises `ConnectError`, `Disconnected`, `BrokenAnswer`, `TimeoutError`."""
        key, data = request_bytes(method, url, body, self._headers + header_lines(headers))
        timeout = self.timeout if timeout is None else timeout
        conn = self._reused(key)
        unanswered: Disconnected | None = None
        if conn is not None:
            try:
                return await self._exchange(conn, data, timeout)
            except Disconnected as exc:  # stale (closed while it waited here), or the server died: once more
                unanswered = exc
        try:
            fresh = await self._connect(key, timeout)
        except ConnectError:
            if unanswered is not None:  # the server is gone, and the request may have reached it before
                raise unanswered from None
            raise
        return await self._exchange(fresh, data, timeout)

    async def _exchange(self, conn: _Connection, data: bytes, timeout: float) -> Answer:
        try:
            conn.send(data)
            while conn.status is None:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(timeout)
        except BaseException:  # cancelled too: the answer may still come, on no one's behalf
            conn.close()
            raise
        return Answer(self, conn, timeout)

    def _reused(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Connection(key, self._open), *key),
                                             timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {type(exc).__name__}: {exc}") from exc
        self.connections_opened += 1
        self._open.add(conn)  # left in connection_lost
        return conn

    def _give_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
