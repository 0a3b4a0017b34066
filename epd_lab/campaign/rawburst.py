"""A burst client whose latencies are the server's, not its own: `burst`.

aiohttp needs ~0.6 s of this 2-vCPU host to start 1,000 requests (a connection each, the request built and
written one task at a time), so a server that refuses each request at once was measured refusing in 0.35-1.3 s
(`data/bench/overload-lowest-told-rate.json`, ``floor``). Here every connection is opened (and kept alive) before the burst,
every request's bytes are built before it, and all are written back to back, in one pass of the event loop: a
request's latency is counted from the moment its own bytes were handed to the kernel (``Outcome.latency_s``),
and ``Outcome.t_start`` is that moment in seconds after the burst began, so ``t_start + latency_s`` is the same
latency counted from the burst's start.

HTTP/1.1 only as far as the servers here answer it: a response with ``content-length`` or chunked transfer
encoding; a 200 whose content type is ``text/event-stream`` is read as the chat stream
(`epd_lab.campaign.client.read_events`), any other status as an error body (`error_of`).
"""
from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import AsyncIterator, Sequence

from epd_lab.campaign.client import Outcome, auth_headers, error_of, read_events

__all__ = ["burst"]

CONNECT_AT_ONCE = 64  # connections opened concurrently before the burst (the listen backlog is far larger)


def request_bytes(method: str, host: str, path: str, headers: dict[str, str], body: bytes | None = None) -> bytes:
    """A whole HTTP/1.1 request as written on the wire: head, then the JSON `body` if any."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}"]
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


async def _connect(host: str, port: int, count: int,
                   prime: bytes) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` connections to `host`:`port`, `CONNECT_AT_ONCE` being opened at a time, each of which has
    answered `prime` (a whole request): the kernel completes a connection before the server accepts it, and a
    server still accepting a thousand when the burst begins counts that in the first requests' latency."""
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)

    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with gate:
            reader, writer = await asyncio.open_connection(host, port)  # asyncio sets TCP_NODELAY on TCP sockets
            writer.write(prime)
            _, headers = await _head(reader)  # any answer will do: the server has the connection
            async for _ in _body(reader, headers):
                pass
            return reader, writer

    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    opened = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for _, writer in opened:
            writer.close()
        raise ConnectionError(f"{len(failed)} of {count} connections to {host}:{port} failed before the burst: "
                              f"{type(failed[0]).__name__}: {failed[0]}")
    return opened


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """A response body's pieces as they come: by ``content-length``, else chunked, else until the server closes."""
    if "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers are sent here: the empty line
                return
            piece = await reader.readexactly(size + 2)
            yield piece[:-2]
    else:
        while piece := await reader.read(65536):
            yield piece


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status and headers (names lower-cased)."""
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    return (int(status_line.split(" ", 2)[1]),
            {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)})


async def _answer(reader: asyncio.StreamReader, out: Outcome) -> str:
    """Read one response into `out` (status, error, text); the outcome's kind."""
    out.status, headers = await _head(reader)
    if out.status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        chunks: list[str] = []
        kind = await read_events(_body(reader, headers), chunks, out, None)
        out.text = "".join(chunks)
        return kind
    raw = b"".join([piece async for piece in _body(reader, headers)])
    if out.status == 200:
        out.error = "a 200 that is not an event stream"
        return "error"
    out.error, out.clear = error_of(raw)
    return "refused" if out.status == 503 else "rejected" if 400 <= out.status < 500 else "error"


async def burst(url: str, bodies: Sequence[bytes], prompts: Sequence[int], timeout: float,
                headers: dict[str, str] | None = None, path: str = "/v1/chat/completions",
                prime_path: str = "/v1/models") -> list[Outcome]:
    """POST each of `bodies` (JSON, encoded) to `url` + `path` at once, on a connection of its own opened
    beforehand (each has answered a ``GET`` of `prime_path`), with `headers` (and the bearer header
    `auth_headers` gives): their outcomes, in order, each
    request's `prompts` entry as its ``prompt``. Latency from the moment a request's bytes were written
    (``t_start``: that moment after the burst began). `timeout`: the client's bound on each answer, from the
    burst's start. Raises `ConnectionError` when a connection cannot be opened before the burst."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ValueError(f"the burst client takes http://host:port URLs, got {url!r}")
    extra = {**auth_headers(), **(headers or {})}
    wire = [request_bytes("POST", parts.netloc, path, extra, body) for body in bodies]
    prime = request_bytes("GET", parts.netloc, prime_path, auth_headers())
    outcomes = [Outcome(i, prompts[i]) for i in range(len(bodies))]
    conns = await _connect(parts.hostname, parts.port, len(bodies), prime)
    sent = [0.0] * len(bodies)

    async def one(i: int, reader: asyncio.StreamReader) -> None:
        out = outcomes[i]
        try:
            out.kind = await _answer(reader, out)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            out.kind, out.error = "error", f"{type(exc).__name__}: {exc}"
        out.latency_s = time.monotonic() - sent[i]

    # the readers wait on their sockets before the first byte is written, so an answer is read as soon as it comes
    tasks = [asyncio.create_task(one(i, reader)) for i, (reader, _) in enumerate(conns)]
    await asyncio.sleep(0)
    t0 = time.monotonic()
    for i, (_, writer) in enumerate(conns):
        writer.write(wire[i])  # sent now as far as the socket's buffer takes it (the head, at least); the rest
        sent[i] = time.monotonic()  # as the server reads
    for i in range(len(bodies)):
        outcomes[i].t_start = sent[i] - t0
    done, late = await asyncio.wait(tasks, timeout=timeout)
    end = time.monotonic()
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    for i, task in enumerate(tasks):
        if task in late:
            outcomes[i].kind = "timeout"
            outcomes[i].error = f"no complete answer within the client's {timeout} s"
            outcomes[i].latency_s = end - sent[i]
    for _, writer in conns:
        writer.close()
    await asyncio.gather(*(writer.wait_closed() for _, writer in conns), return_exceptions=True)
    return outcomes
