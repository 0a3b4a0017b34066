"""One streamed chat request of `epd-lab bench serve`, over aiohttp, timed as `vllm bench serve` times it.

The body is built when the request is due, and that time is the client's own encoding cost
(`RequestOutput.client_encode_s`): with data: URIs it base64-encodes every image into the JSON, by URL it writes
short strings. Then: TTFT at the first chunk with content, an ITL per later content chunk, E2EL at the stream's
last event, output tokens from the server's ``usage`` (``stream_options.include_usage``; the content chunks
counted when the server gives none).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
import msgspec

from epd_lab.bench.serve.datasets import SampleRequest
from epd_lab.bench.serve.metrics import RequestOutput
from epd_lab.noise import data_uri

MEDIA_MODES = ("data-uri", "url")


def image_part(url: str) -> dict:
    """An OpenAI chat ``image_url`` content part."""
    return {"type": "image_url", "image_url": {"url": url}}


def chat_body(req: SampleRequest, model: str, url_of: Callable[[bytes], str] | None = None) -> bytes:
    """The JSON body of `req`: its images (URLs as they are; bytes as data: URIs, or through `url_of`, the media
    server's URL for them), then its text; greedy, streamed, with usage, exactly ``output_len`` tokens asked."""
    images = [item if isinstance(item, str) else (url_of(item) if url_of else data_uri(item)) for item in req.images]
    content = [*map(image_part, images), {"type": "text", "text": req.prompt}]
    return msgspec.json.encode({
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": req.output_len,
        "max_completion_tokens": req.output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True})


class _Chunk(msgspec.Struct):
    """The parts of an SSE event the bench reads (every other field is skipped by the decoder)."""

    id: str = ""
    choices: list[dict] = []
    usage: dict | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def send_chat(session: aiohttp.ClientSession, url: str, body: bytes, out: RequestOutput,
                    headers: dict[str, str] | None = None) -> RequestOutput:
    """POST `body` to `url` (``.../v1/chat/completions``) and read its SSE stream into `out` (its ``start_time``
    set here); a failure is recorded in ``out.error``, never raised."""
    text: list[str] = []
    chunks = 0
    out.start_time = last = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                event = _decode_chunk(payload)
                if event.error is not None:
                    out.error = f"error event: {event.error.get('message', event.error)}"
                    return out
                out.response_id = out.response_id or event.id
                if event.usage:
                    out.output_tokens = int(event.usage.get("completion_tokens") or 0)
                    out.prompt_len = int(event.usage.get("prompt_tokens") or 0)
                    last = now
                content = event.choices[0].get("delta", {}).get("content") if event.choices else None
                if content:
                    if chunks == 0:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    chunks += 1
                    text.append(content)
                    last = now
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if chunks == 0:
        out.error = "the stream carried no content"
        return out
    out.latency = last - out.start_time
    out.output_tokens = out.output_tokens or chunks
    out.generated_text = "".join(text)
    out.success = True
    return out
