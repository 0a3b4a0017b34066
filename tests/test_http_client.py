"""The receiver's kept-alive HTTP client against a real HTTP/1.1 server in a thread of this process."""
from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from epd_lab.http.client import HTTPError, KeepAliveClient


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server: _Server = self.server  # type: ignore[assignment]
        server.peers.add(self.client_address)
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path in ("/cut", "/garbled"):  # half an answer, or not HTTP: then the connection ends
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf" if self.path == "/cut"
                             else b"HTTQ/9 what\r\n\r\n")
            self.close_connection = True
            return
        answer = b"echo:" + body
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(answer)))
        if self.path == "/close":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(answer)
        if self.path == "/drop-idle":  # answer, then drop the connection as an idle server would
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    peers: set[tuple[str, int]]


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.peers = set()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: _Server, path: str) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def test_posts_reuse_one_connection_and_set_nodelay(server: _Server) -> None:
    with KeepAliveClient(timeout=5) as client:
        for i in range(5):
            assert client.post(_url(server, "/x"), b"%d" % i) == (200, b"echo:%d" % i)
        assert client.connections_opened == 1 and len(server.peers) == 1
        ((conn, _),) = client._idle[("127.0.0.1", server.server_address[1])]
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert client.post(_url(server, "/missing"), b"") == (404, b"echo:")  # a status is an answer, not an error


def test_a_connection_the_server_dropped_is_replaced(server: _Server) -> None:
    with KeepAliveClient(timeout=5) as client:
        assert client.post(_url(server, "/drop-idle"), b"a") == (200, b"echo:a")
        time.sleep(0.1)  # the server has closed its end; the pooled connection does not know yet
        assert client.post(_url(server, "/x"), b"b") == (200, b"echo:b")  # sent once more, fresh
        assert client.post(_url(server, "/close"), b"c") == (200, b"echo:c")  # "Connection: close" honoured
        assert client.post(_url(server, "/x"), b"d") == (200, b"echo:d")
        assert client.connections_opened == 3


def test_errors_are_raised_within_the_timeout(server: _Server) -> None:
    with KeepAliveClient(timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(HTTPError, match="timed out"):
            client.post(_url(server, "/slow"), b"")
        assert time.monotonic() - start < 1.0
        with socket.socket() as dead:  # bound, never listening: refused
            dead.bind(("127.0.0.1", 0))
            with pytest.raises(HTTPError, match="ConnectionRefusedError"):
                client.post(f"http://127.0.0.1:{dead.getsockname()[1]}/x", b"")
        with pytest.raises(ValueError, match="not an http:// URL"):
            client.post("https://127.0.0.1/x", b"")
        with pytest.raises(HTTPError, match="BadAnswer: the connection ended before the answer's end"):
            client.post(_url(server, "/cut"), b"")
        with pytest.raises(HTTPError, match="BadAnswer: a malformed answer"):
            client.post(_url(server, "/garbled"), b"")
        assert client.post(_url(server, "/x"), b"ok") == (200, b"echo:ok")  # on a fresh connection
    with pytest.raises(HTTPError, match="closed"):
        client.post(_url(server, "/x"), b"")


def test_an_idle_connection_is_retired_before_the_servers_keep_alive(server: _Server, monkeypatch) -> None:
    import epd_lab.http.client as module

    monkeypatch.setattr(module, "CLIENT_KEEPALIVE_S", 0.1)
    with KeepAliveClient(timeout=5) as client:
        client.post(_url(server, "/x"), b"a")
        client.post(_url(server, "/x"), b"b")
        assert client.connections_opened == 1
        time.sleep(0.2)
        assert client.post(_url(server, "/x"), b"c") == (200, b"echo:c")
        assert client.connections_opened == 2  # the idle one was closed, not reused
