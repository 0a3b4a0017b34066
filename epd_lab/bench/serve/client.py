"""One streamed request of `epd-lab bench serve`, over aiohttp, timed as `vllm bench serve` times it.

The body is vLLM's for its backend (`BACKENDS`): ``openai-chat`` posts ``/v1/chat/completions`` with the text,
then the images, in one user message; ``openai`` posts ``/v1/completions`` with the text only. It is built when
the request is due, and that time is the client's own encoding cost (`RequestOutput.client_encode_s`): with data:
URIs it base64-encodes every image into the JSON, by URL it writes short strings. ``ignore_eos`` and the sampling
parameters (``temperature``, ``top_p``, ``top_k``) are sent only when given, as vLLM sends them.

Timing is vLLM's (``endpoint_request_func``): every event with ``choices`` is a chunk, whatever it carries (a
chat's role chunk and its finish chunk too); TTFT at the first, an ITL per later one, E2EL at the last; the usage
event (no choices) gives the output and prompt tokens. Unlike vLLM, an error event ends the request as failed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from epd_lab.bench.serve.datasets import SampleRequest
from epd_lab.bench.serve.metrics import RequestOutput
from epd_lab.noise import data_uri

MEDIA_MODES = ("data-uri", "url")
# vLLM's request backends that an epd_lab server (or any OpenAI-compatible one) answers, and their paths
BACKENDS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}


def image_part(url: str) -> dict:
    """An OpenAI chat ``image_url`` content part."""
    return {"type": "image_url", "image_url": {"url": url}}


def request_body(req: SampleRequest, model: str, backend: str = "openai-chat",
                 url_of: Callable[[bytes], str] | None = None, extra: dict[str, Any] | None = None) -> bytes:
    """The JSON body of `req` for `backend`, streamed with usage, ``output_len`` tokens asked, and `extra`
    (``ignore_eos``, sampling parameters) merged in. Images (chat only): URLs as they are; bytes as data: URIs, or
    through `url_of`, the media server's URL for them. `ValueError` for images on the ``openai`` backend."""
    if backend == "openai":
        if req.images:
            raise ValueError("--backend openai posts /v1/completions, which takes text only; this dataset has "
                             "images: use --backend openai-chat")
        body: dict[str, Any] = {"model": model, "prompt": req.prompt, "repetition_penalty": 1.0,
                                "max_tokens": req.output_len, "logprobs": None, "stream": True,
                                "stream_options": {"include_usage": True}}
    else:
        images = [item if isinstance(item, str) else (url_of(item) if url_of else data_uri(item))
                  for item in req.images]
        content = [{"type": "text", "text": req.prompt}, *map(image_part, images)]
        body = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_completion_tokens": req.output_len, "stream": True, "stream_options": {"include_usage": True}}
    return msgspec.json.encode(body | (extra or {}))


class _Chunk(msgspec.Struct):
    """The parts of an SSE event the bench reads (every other field is skipped by the decoder)."""

    id: str = ""
    choices: list[dict] = []
    usage: dict | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def send_request(session: aiohttp.ClientSession, url: str, body: bytes, out: RequestOutput,
                       headers: dict[str, str] | None = None) -> RequestOutput:
    """POST `body` to `url` and read its SSE stream into `out` (its ``start_time`` set here; see the module
    docstring for the timing); a failure is recorded in ``out.error``, never raised."""
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
                if event.choices:
                    choice = event.choices[0]
                    content = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                    if chunks == 0:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    chunks += 1
                    text.append(content or "")
                    last = now
                elif event.usage:
                    out.output_tokens = int(event.usage.get("completion_tokens") or 0)
                    if event.usage.get("prompt_tokens") is not None:
                        out.prompt_len = int(event.usage["prompt_tokens"])
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.generated_text = "".join(text)
    if chunks == 0:
        out.error = "Never received a valid chunk to calculate TTFT."
        return out
    out.latency = last - out.start_time
    out.success = True
    return out
