"""The HTTP fast lane (`epd_lab.serving.fastlane`) on a real uvicorn server, through raw sockets: what it takes,
what it leaves to uvicorn, and that both answer the same."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from epd_lab import serving
from epd_lab.serving.fastlane import MAX_BODY_BYTES, fast_lane
from epd_lab.serving.stream import ClosingStreamingResponse
from helpers import wait_for

LANE = fast_lane(HttpToolsProtocol)
seen: list[bool] = []
closed: list[str] = []


def make_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        body = await serving.read_body(request)
        return Response(b"%d:%s" % (len(body), request.url.query.encode()), headers={"x-lane": "yes"})

    @app.get("/hello")
    async def hello() -> Response:
        return Response(b"hi")

    @app.post("/boom")
    async def boom(request: Request) -> Response:
        raise RuntimeError("a bug")

    @app.post("/stream")
    async def stream(request: Request) -> Response:
        delay = float(request.url.query or 0)

        async def parts():
            if delay:
                await asyncio.sleep(delay)
            yield b"first"
            yield b"second"

        async def on_close() -> None:
            closed.append("stream")

        return ClosingStreamingResponse(parts(), on_close, media_type="text/plain")

    @app.post("/watch")
    async def watch(request: Request) -> Response:
        await serving.read_body(request)
        for _ in range(1000):  # at most 5 s: the client closes at once
            if serving.client_gone(request):
                break
            await asyncio.sleep(0.005)
        seen.append(serving.client_gone(request))
        return Response(b"{}")

    return app


@pytest.fixture(scope="module")
def addr() -> Iterator[tuple[str, int]]:
    sock = serving.bind_tcp("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(), loop="uvloop", http=LANE, log_level="critical",
                                           lifespan="off", proxy_headers=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, "uvicorn did not start")
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)


def read_answers(conn: socket.socket, n: int, timeout: float = 10.0) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """`n` whole answers from `conn` (Content-Length or chunked bodies): status, headers, body."""
    conn.settimeout(timeout)
    buf, answers = b"", []
    while len(answers) < n:
        while b"\r\n\r\n" not in buf:
            buf += conn.recv(65536) or pytest.fail("connection closed")
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        if lines[0].startswith(b"HTTP/1.1 1"):  # 100 Continue: the answer follows
            continue
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        if b"content-length" in headers:
            size = int(headers[b"content-length"])
            while len(buf) < size:
                buf += conn.recv(65536) or pytest.fail("connection closed")
            body, buf = buf[:size], buf[size:]
        else:
            assert headers[b"transfer-encoding"] == b"chunked"
            body = b""
            while True:
                while b"\r\n" not in buf:
                    buf += conn.recv(65536) or pytest.fail("connection closed")
                size_line, rest = buf.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(rest) < size + 2:
                    rest += conn.recv(65536) or pytest.fail("connection closed")
                body, buf = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
        answers.append((int(lines[0].split()[1]), headers, body))
    return answers


def test_small_posts_and_gets_take_the_lane_and_keep_the_connection(addr):
    taken = LANE.taken
    with socket.create_connection(addr) as conn:
        for i in range(3):
            conn.sendall(post(f"/echo?i={i}", b"x" * 100))
            [(status, headers, body)] = read_answers(conn, 1)
            assert (status, body, headers[b"x-lane"]) == (200, b"100:i=%d" % i, b"yes")
        conn.sendall(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_answers(conn, 1)[0][2] == b"hi"
    assert LANE.taken == taken + 4


@pytest.mark.parametrize("request_bytes", [
    post("/echo", b"y" * (MAX_BODY_BYTES + 1)),  # a body over the lane's bound
    b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    post("/echo", b"z" * 10, b"expect: 100-continue\r\n"),
    b"PUT /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc",
], ids=["large", "chunked", "expect", "put"])
def test_what_the_lane_does_not_take_goes_uvicorns_way(addr, request_bytes):
    taken = LANE.taken
    with socket.create_connection(addr) as conn:
        conn.sendall(request_bytes)
        [(status, _, body)] = read_answers(conn, 1)
    assert LANE.taken == taken
    if request_bytes.startswith(b"PUT"):
        assert status == 405
    else:
        assert status == 200 and int(body.split(b":")[0]) in (MAX_BODY_BYTES + 1, 5, 10)


def test_pipelined_requests_are_answered_in_order(addr):
    """Three requests in one write: the first on the lane, those behind it queued by uvicorn, answers in order."""
    with socket.create_connection(addr) as conn:
        conn.sendall(post("/stream?0.2", b"") + post("/echo?b", b"ab") + post("/echo?c", b"abc"))
        answers = read_answers(conn, 3)
    assert [a[2] for a in answers] == [b"firstsecond", b"2:b", b"3:c"]


def test_a_stream_shows_its_head_before_a_late_first_part(addr):
    """The head is held for a first part sent at once (one write), not for one that comes later."""
    with socket.create_connection(addr) as conn:
        conn.sendall(post("/stream?1.0", b""))
        conn.settimeout(10)
        t0, got = time.monotonic(), b""
        while b"\r\n\r\n" not in got:
            got += conn.recv(65536)
        assert time.monotonic() - t0 < 0.9 and got.endswith(b"\r\n\r\n")  # the head alone, before the part
        conn.sendall(post("/stream", b""))  # pipelined behind the stream: answered after it
        rest = got + b""
        conn.settimeout(10)
        while rest.count(b"0\r\n\r\n") < 2:
            rest += conn.recv(65536)
    assert rest.count(b"first") == 2 and rest.count(b"HTTP/1.1 200") == 2


def test_an_error_is_answered_500_and_closes(addr):
    """The app's 500 (Starlette's outermost middleware) is written, then the connection closed, as uvicorn does
    for an exception raised on after an answer."""
    with socket.create_connection(addr) as conn:
        conn.sendall(post("/boom", b"{}"))
        [(status, _, body)] = read_answers(conn, 1)
        assert (status, body) == (500, b"Internal Server Error")
        assert conn.recv(1) == b""


def test_client_gone_and_the_stream_close_see_the_client_leave(addr):
    seen.clear()
    closed.clear()
    with socket.create_connection(addr) as conn:
        conn.sendall(post("/watch", b"{}"))
    wait_for(lambda: seen, 10, "the route did not finish")
    assert seen == [True]
    with socket.create_connection(addr) as conn:
        conn.sendall(post("/stream?5", b""))
        conn.settimeout(10)
        assert b"200" in conn.recv(65536)  # the head, then the client leaves before the parts
    wait_for(lambda: closed, 10, "the stream was not closed")
    assert closed == ["stream"]
