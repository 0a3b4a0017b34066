"""A campaign leg's client: the chat requests it sends through the proxy, how each one ended (`Outcome`), and
the answers judged against the expected ones."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from collections.abc import AsyncIterable
from typing import Any

import aiohttp

from epd_lab import security


@dataclass(slots=True)
class Outcome:
    """One chat request as the client saw it. `kind`: ``ok``, ``refused`` (503), ``rejected`` (another 4xx,
    expected for bad input), ``error`` (5xx, an error event in the stream, a broken connection), ``timeout``
    (the client gave up) or ``aborted`` (the client cancelled the stream on purpose)."""

    index: int
    prompt: int  # index into the prompts; -1 for a bad input
    kind: str = "error"
    status: int | None = None
    t_start: float = 0.0  # seconds since the leg began
    latency_s: float = 0.0
    text: str = ""
    error: str = ""
    clear: bool = False  # an error that says what went wrong (an OpenAI error object or a stream error event)
    matches: bool | None = None  # the answer equals its solo answer (None: not an answer)
    tag: str = ""  # what the leg made of it (bad input kind, in-flight / during-fault / after-recovery)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def auth_headers() -> dict[str, str]:
    """The bearer header when this process's environment holds the shared secret (the cluster's servers
    inherit it from here, `epd_lab.security`); none otherwise."""
    return security.bearer_header(security.load_secret())


def client_session(concurrency: int) -> aiohttp.ClientSession:
    """One aiohttp session for a leg's requests, `concurrency` connections at most."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, concurrency)), headers=auth_headers())


async def chat(session: aiohttp.ClientSession, proxy_url: str, body: dict[str, Any], timeout: float, *,
               index: int = 0, prompt: int = -1, abort_after: int | None = None, t0: float | None = None,
               tag: str = "", headers: dict[str, str] | None = None, raw: bytes | None = None) -> Outcome:
    """POST `body` to the proxy's ``/v1/chat/completions`` and read its answer (SSE when streamed).
    `abort_after`: cancel the stream after that many content chunks (a client abort). `timeout`: the
    client's own bound for the whole request. `headers`: extra request headers (a deadline); `raw`: `body`
    encoded once already (a burst of a thousand would otherwise spend seconds of the client's own loop encoding
    the same images, and count them in every latency)."""
    out = Outcome(index, prompt, tag=tag)
    start = time.monotonic()
    out.t_start = start - (t0 if t0 is not None else start)
    chunks: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            post = (session.post(proxy_url + "/v1/chat/completions", json=body, headers=headers) if raw is None else
                    session.post(proxy_url + "/v1/chat/completions", data=raw,
                                 headers={"content-type": "application/json", **(headers or {})}))
            async with post as resp:
                out.status = resp.status
                if resp.status != 200:
                    raw = await resp.read()
                    out.error, out.clear = error_of(raw)
                    out.kind = ("refused" if resp.status == 503 else
                                "rejected" if 400 <= resp.status < 500 else "error")
                elif not body.get("stream"):
                    answer = json.loads(await resp.read())
                    chunks.append(answer["choices"][0]["message"]["content"] or "")
                    out.kind = "ok"
                else:
                    out.kind = await _read_sse(resp, chunks, out, abort_after)
    except TimeoutError:
        out.kind, out.error = "timeout", f"no complete answer within the client's {timeout} s"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as exc:
        out.kind, out.error = "error", f"{type(exc).__name__}: {exc}"
    out.latency_s = time.monotonic() - start
    out.text = "".join(chunks)
    return out


async def _read_sse(resp: aiohttp.ClientResponse, chunks: list[str], out: Outcome, abort_after: int | None) -> str:
    """The stream's events into `chunks`; the outcome's kind."""
    kind = await read_events(resp.content.iter_any(), chunks, out, abort_after)
    if kind == "aborted":
        resp.close()  # the client goes away mid-stream
    return kind


async def read_events(pieces: AsyncIterable[bytes], chunks: list[str], out: Outcome, abort_after: int | None) -> str:
    """An SSE answer's events, from its body's `pieces` as they come, into `chunks` (their content) and `out`
    (an error event's message); the outcome's kind: ``ok`` at ``[DONE]`` with no error event, ``aborted`` after
    `abort_after` content chunks (the caller closes the stream), else ``error``."""
    buffer = b""
    content_chunks = 0
    async for piece in pieces:
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            if data == b"[DONE]":
                return "ok" if not out.error else "error"
            obj = json.loads(data)
            if "error" in obj:
                out.error, out.clear = error_of(data)
                continue
            for choice in obj.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    chunks.append(text)
                    content_chunks += 1
            if abort_after is not None and content_chunks >= abort_after:
                return "aborted"
    out.error = out.error or "the stream ended without [DONE]"
    return "error"


def error_of(raw: bytes) -> tuple[str, bool]:
    """An error body's message, and whether it was an OpenAI error object with a message."""
    try:
        obj = json.loads(raw)
        message = obj["error"]["message"]
        return str(message), bool(message)
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace") or "(empty body)", False


def judge(outcomes: list[Outcome], expected: list[str | None]) -> None:
    """Set `matches` of every ok answer: whether it equals `expected` for its prompt."""
    for o in outcomes:
        if o.kind == "ok" and o.prompt >= 0:
            o.matches = expected[o.prompt] is not None and o.text == expected[o.prompt]


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Outcomes by kind."""
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out
