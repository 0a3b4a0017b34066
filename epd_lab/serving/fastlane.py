"""The fast lane: uvicorn's httptools protocol with a lean request cycle for small, plain requests.

Every hop of a lone split request arrives at an idle server (the GPU works meanwhile), and a cold core pays for
the code a request runs. Cold (5 ms idle between requests), a kept-alive 200 B POST round trip took about
2x longer through uvicorn with a bare ASGI app than through an `asyncio.Protocol` that answers from httptools'
callbacks, on this 2-vCPU AMD EPYC (`data/bench/fast-lane-cpu-amd-epyc.json`): uvicorn's cycle (an
`asyncio.Event`, a header check per header, its head and body as two writes) is most of that.

A request the lane takes runs the same app, through every middleware, with a `FastCycle` in place of uvicorn's
`RequestResponseCycle`: ``receive`` hands the whole body at once, ``send`` writes the head together with the
first body part (held back at most one loop turn, so a stream whose first part comes later still shows its head
at once), and the connection's keep-alive, pipelining, flow control and shutdown stay uvicorn's.

The lane takes a GET or POST over HTTP/1.1 with keep-alive, a ``Content-Length`` body of at most
`MAX_BODY_BYTES` (no chunked body, no ``Expect``, no upgrade), with no other request in flight on its
connection. Anything else goes uvicorn's way, unchanged. ``EPD_HTTP_FAST_LANE=0`` turns the lane off (an A/B).
"""
from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any, Callable

import httptools
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

__all__ = ["MAX_BODY_BYTES", "FastCycle", "fast_lane"]

MAX_BODY_BYTES = 64 * 1024  # uvicorn's read high-water mark: a body the lane holds whole, never paused for
METHODS = frozenset({"GET", "POST"})


def _nothing() -> None:
    pass


class FastCycle:
    """One request and its answer on the fast lane: what uvicorn's protocol reads and sets on a cycle
    (``body``, ``more_body``, ``disconnected``, ``keep_alive``, ``response_complete``, ``message_event``), plus
    the ASGI ``receive`` and ``send`` the app is called with."""

    __slots__ = ("scope", "transport", "flow", "default_headers", "keep_alive", "on_response", "body",
                 "more_body", "disconnected", "response_started", "response_complete", "_received", "_head",
                 "_chunked", "_length", "_gone", "logger")

    def __init__(self, scope: dict[str, Any], transport: asyncio.Transport, flow: Any,
                 default_headers: list[tuple[bytes, bytes]], on_response: Callable[[], None], logger: Any) -> None:
        self.scope, self.transport, self.flow = scope, transport, flow
        self.default_headers, self.on_response, self.logger = default_headers, on_response, logger
        self.keep_alive = True
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._received = False
        self._head: bytes | None = None  # the answer's head, held until its first body part or the next loop turn
        self._chunked = False
        self._length = 0  # Content-Length bytes still to come
        self._gone: asyncio.Future[None] | None = None  # what `receive` waits on once the body was handed over

    @property
    def message_event(self) -> "FastCycle":
        """uvicorn's protocol calls ``message_event.set()`` on a body part, a lost connection and a finished answer:
        only the last two matter here (the body is read whole)."""
        return self

    def set(self) -> None:
        if (self.disconnected or self.response_complete) and self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    async def run_asgi(self, app: Any) -> None:
        """Run `app` for this request; a failure before any byte was written is answered 500, after, the
        connection is closed (uvicorn's rules)."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            self._fail()
        else:
            if not self.response_complete and not self.disconnected:
                self.logger.error("ASGI callable returned without completing response.")
                self._fail()
        finally:
            self.on_response = _nothing

    def _fail(self) -> None:
        if not self.response_started and not self.transport.is_closing():
            msg = b"Internal Server Error"
            self.transport.write(STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
                                 + str(len(msg)).encode() + b"\r\nconnection: close\r\n\r\n" + msg)
        self.transport.close()

    async def receive(self) -> dict[str, Any]:
        if not self._received:
            self._received = True
            return {"type": "http.request", "body": bytes(self.body), "more_body": False}
        if not self.disconnected and not self.response_complete:
            if self._gone is None:
                self._gone = asyncio.get_running_loop().create_future()
            await self._gone
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self.response_started = True
            self._head = self._head_of(message)
            asyncio.get_running_loop().call_soon(self._flush)  # a body part sent before then leaves with it
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body, more = message.get("body", b""), message.get("more_body", False)
        if self._chunked:
            parts = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more:
                parts.append(b"0\r\n\r\n")
        else:
            if len(body) > self._length:
                raise RuntimeError("Response content longer than Content-Length")
            self._length -= len(body)
            parts = [body]
        if self._head is not None:
            parts.insert(0, self._head)
            self._head = None
        self.transport.write(b"".join(parts))
        if not more:
            if self._length:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _flush(self) -> None:
        if self._head is not None and not self.disconnected:
            self.transport.write(self._head)
        self._head = None

    def _head_of(self, message: dict[str, Any]) -> bytes:
        """The status line and headers (uvicorn's checks and defaults); notes the body's framing."""
        status = message["status"]
        content = [STATUS_LINE[status]]
        has_length = has_close = False
        for name, value in (*self.default_headers, *message.get("headers", ())):
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and not self._chunked:
                self._length, has_length = int(value), True
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._length, self._chunked = 0, True
            elif name == b"connection" and b"close" in (t.strip() for t in value.lower().split(b",")):
                self.keep_alive, has_close = False, True
            content.extend((name, b": ", value, b"\r\n"))
        if not self.keep_alive and not has_close:
            content.append(b"connection: close\r\n")
        if not has_length and not self._chunked and status not in (204, 304):
            self._chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)


def fast_lane(protocol: type) -> type:
    """uvicorn's `HttpToolsProtocol` (or a subclass) whose small, plain requests run on a `FastCycle`."""

    class FastLane(protocol):  # type: ignore[valid-type,misc]
        taken = 0  # requests served on the lane, by every connection of this process

        def _takes(self) -> bool:
            parser = self.parser
            if (self.cycle is not None and not self.cycle.response_complete) or self.expect_100_continue \
                    or self.limit_concurrency is not None or parser.get_http_version() != "1.1" \
                    or not parser.should_keep_alive() or parser.should_upgrade():
                return False
            for name, value in self.headers:
                if name == b"transfer-encoding" or (
                        name == b"content-length" and (not value.isdigit() or int(value) > MAX_BODY_BYTES)):
                    return False
            return True

        def on_headers_complete(self) -> None:
            method = self.parser.get_method().decode("ascii")
            if method not in METHODS or not self._takes():
                super().on_headers_complete()
                return
            scope = self.scope
            scope["method"] = method
            url = httptools.parse_url(self.url)
            raw_path = url.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            scope["path"] = self.root_path + path
            scope["raw_path"] = self.root_path.encode("ascii") + raw_path
            scope["query_string"] = url.query or b""
            self.cycle = FastCycle(scope, self.transport, self.flow, self.server_state.default_headers,
                                   self.on_response_complete, self.logger)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if type(cycle) is not FastCycle or cycle.response_complete:
                super().on_message_complete()
                return
            cycle.more_body = False
            FastLane.taken += 1
            self._start_asgi_task(cycle, self.app)

    FastLane.__name__ = FastLane.__qualname__ = f"FastLane{protocol.__name__}"
    return FastLane
