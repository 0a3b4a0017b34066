"""The proxy's asyncio HTTP client (`epd_lab.http.aio`) against a real HTTP/1.1 server on a socket, scripted by path
to answer, stream, stall, cut or garble; and behind the proxy against uvicorn (test_proxy, test_front)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from epd_lab.http.aio import MAX_BUFFERED, AsyncHTTPClient, BrokenAnswer, ConnectError, Disconnected


class _Server:
    """Answers ``POST /echo`` (the body back) and scripted paths; records each connection's peer and whether the
    client closed its end."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.client_gone = asyncio.Event()
        self.go_on = asyncio.Event()  # /stream's second piece waits for it
        self.server: asyncio.AbstractServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.append(writer.get_extra_info("peername"))
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split()[1]
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self.answer(path, headers, body, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, path: str, headers: dict[str, str], body: bytes, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False to close the connection after."""
        if path == "/echo":
            answer = b"echo:" + body + b"|" + headers.get("x-extra", "").encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\nX-Name: v\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
        elif path == "/drop":  # closes without a byte of an answer
            return False
        elif path == "/die":  # the whole server goes, this request unanswered
            assert self.server is not None
            self.server.close()
            for other in self.writers:
                other.transport.abort()
            return False
        elif path == "/silent":  # reads, never answers
            await asyncio.sleep(30)
        elif path == "/garbled":
            writer.write(b"HTTQ/9 ok\r\n\r\n")
        elif path == "/cut":  # half a body, then the connection ends
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
            await writer.drain()
            return False
        elif path == "/big":
            data = bytes(range(256)) * (3 * MAX_BUFFERED // 256 + 7)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        elif path == "/stream":  # chunked: a piece, then (once told) another and the end, or the client's close
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            await self.go_on.wait()
            if not reader.at_eof():
                writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
            eof = await reader.read(1)
            if eof == b"":
                self.client_gone.set()
                return False
        await writer.drain()
        return True

    async def __aenter__(self) -> "_Server":
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await asyncio.sleep(0.01)  # the handlers see their connections end


@contextlib.asynccontextmanager
async def _setup(timeout: float = 5.0, keepalive: float = 30.0) -> AsyncIterator[tuple[_Server, AsyncHTTPClient]]:
    async with _Server() as server:
        client = AsyncHTTPClient(timeout, {"Authorization": "Bearer s"}, keepalive)
        try:
            yield server, client
        finally:
            await client.close()


async def _post(client: AsyncHTTPClient, url: str, body: bytes = b"hi", **kw) -> tuple[int, bytes]:
    answer = await client.request("POST", url, body, **kw)
    raw = await answer.read()
    answer.release()
    return answer.status, raw


def test_requests_reuse_one_connection_with_nodelay_and_read_the_head():
    async def main():
        async with _setup() as (server, client):
            for i in range(3):
                answer = await client.request("POST", server.url("/echo"), b"x%d" % i, {"X-Extra": "e"})
                assert (answer.status, answer.reason, answer.content_type) == (200, "OK", "text/plain")
                assert answer.headers["x-name"] == answer.headers.get("X-NAME") == "v" and "X-Name" in answer.headers
                assert answer.complete and await answer.read() == b"echo:x%d|e" % i
                answer.release()
            assert len(server.peers) == 1 and client.connections_opened == 1
            (conn,) = client._open
            assert conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    asyncio.run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced_once():
    async def main():
        async with _setup() as (server, client):
            assert await _post(client, server.url("/echo")) == (200, b"echo:hi|")
            # the server drops the idle connection as the request goes out on it: the pool has not seen it yet
            server.writers[0].transport.abort()
            assert await _post(client, server.url("/echo")) == (200, b"echo:hi|")
            assert client.connections_opened == 2 and len(server.peers) == 2
    asyncio.run(main())


def test_a_server_that_dies_with_the_request_on_a_kept_alive_connection_is_disconnected_not_refused():
    async def main():
        async with _setup() as (server, client):
            echo, die = server.url("/echo"), server.url("/die")
            assert await _post(client, echo) == (200, b"echo:hi|")
            with pytest.raises(Disconnected):  # the resend finds nobody: the request may have reached it
                await client.request("POST", die, b"")
            with pytest.raises(ConnectError):  # from then on, nothing can have reached it
                await client.request("POST", echo, b"")
    asyncio.run(main())


def test_an_idle_connection_is_retired_after_keepalive():
    async def main():
        async with _setup(keepalive=0.05) as (server, client):
            await _post(client, server.url("/echo"))
            await asyncio.sleep(0.1)
            await _post(client, server.url("/echo"))
            assert client.connections_opened == 2 and len(client._open) == 1
    asyncio.run(main())


def test_each_failure_is_its_own_error_within_the_timeout():
    async def main():
        async with _setup(timeout=0.3) as (server, client):
            with pytest.raises(Disconnected):
                await client.request("POST", server.url("/drop"), b"")
            with pytest.raises(BrokenAnswer, match="malformed"):
                await client.request("POST", server.url("/garbled"), b"")
            answer = await client.request("POST", server.url("/cut"), b"")
            with pytest.raises(BrokenAnswer, match="before the answer's end"):
                await answer.read()
            answer.release()  # not read to its end: closed, not pooled
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await client.request("POST", server.url("/silent"), b"")
            assert time.monotonic() - t0 < 2
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]  # bound, not listening: refused
                with pytest.raises(ConnectError) as exc:
                    await client.request("GET", f"http://127.0.0.1:{port}/health")
                assert isinstance(exc.value.__cause__, ConnectionRefusedError)
            with pytest.raises(ValueError, match="not an http"):
                await client.request("GET", "https://127.0.0.1/x")
            await asyncio.sleep(0.05)
            assert not client._idle.get(("127.0.0.1", server.port))  # nothing broken went back to the pool
    asyncio.run(main())


def test_a_stream_arrives_piece_by_piece_and_closing_it_cuts_the_reader_and_tells_the_server():
    async def main():
        async with _setup() as (server, client):
            answer = await client.request("POST", server.url("/stream"), b"")
            pieces = answer.chunks()
            assert await pieces.__anext__() == b"first"  # before the server sends the rest
            server.go_on.set()
            assert [p async for p in pieces] == [b"second"] and answer.complete
            answer.release()
            server.go_on.clear()
            answer = await client.request("POST", server.url("/stream"), b"")
            reader = asyncio.ensure_future(answer.read())
            await asyncio.sleep(0.05)
            answer.close()
            with pytest.raises(BrokenAnswer):
                await asyncio.wait_for(reader, 1)
            server.go_on.set()
            await asyncio.wait_for(server.client_gone.wait(), 2)
    asyncio.run(main())


def test_a_body_larger_than_the_buffer_is_read_whole():
    async def main():
        async with _setup() as (server, client):
            status, raw = await _post(client, server.url("/big"))
            assert status == 200 and raw == bytes(range(256)) * (3 * MAX_BUFFERED // 256 + 7)
            assert await _post(client, server.url("/echo")) == (200, b"echo:hi|")  # the connection still serves
            assert client.connections_opened == 1
    asyncio.run(main())
