"""An OpenAI-compatible server that answers at once, for measuring the bench's own cost (`epd-lab bench serve
--instant`): every POST gets a fixed SSE stream of `tokens` one-character chunks and usage, written in one piece,
without reading what was asked. A process of its own (``python -m epd_lab.bench.serve.instant --tokens 16``), so
that its work is not counted in the bench's CPU time; `InstantServer` starts and stops it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

from epd_lab.serving.stack import bind_tcp


def stream_body(tokens: int) -> bytes:
    """The SSE events of one answer: `tokens` content chunks, the finish chunk, usage, [DONE]."""
    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    base = {"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0, "model": "instant"}
    events = [event(base | {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
              for _ in range(tokens)]
    events.append(event(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events.append(event(base | {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                                         "total_tokens": tokens + 1}}))
    return b"".join(events) + b"data: [DONE]\n\n"


class _Answer(asyncio.Protocol):
    """HTTP/1.1 kept alive: each request (headers, then Content-Length bytes of body) gets the same answer."""

    def __init__(self, answer: bytes) -> None:
        self.answer, self.buffer, self.transport = answer, b"", None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(self.answer)


def main(argv: list[str] | None = None) -> int:
    """Serve on 127.0.0.1 (a port the OS picks, printed as ``{"url", "pid"}``) until killed."""
    ap = argparse.ArgumentParser(prog="python -m epd_lab.bench.serve.instant", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    body = stream_body(args.tokens)
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    sock = bind_tcp("127.0.0.1", 0)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _Answer(answer), sock=sock)
        print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}", "pid": os.getpid()}), flush=True)
        await server.serve_forever()

    asyncio.run(serve())
    return 0


class InstantServer:
    """The instant server in a child process; a context manager (`close` stops it)."""

    def __init__(self, tokens: int = 16) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "epd_lab.bench.serve.instant", "--tokens", str(tokens)],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the instant server did not start")
        self.url = json.loads(line)["url"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self.proc.stdout.close()

    def __enter__(self) -> "InstantServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
