"""The OpenAI-compatible proxy (`epd_lab.servers.proxy`) and its prompt glue (`epd_lab.servers.text`), driven by the
official `openai` client.

The prefill and decode servers here are **test doubles** (`StandIn`): small FastAPI apps, served by uvicorn in
threads of this process on OS-chosen ports, that implement the HTTP contract of the real prefill and decode
servers deterministically (prefill: the first token from the prompt's length; decode: that token, then a
fixed sequence), with slow, failing and truncating variants. They stand in for components that exist
elsewhere; the end-to-end test through the real servers is separate. The proxy runs in a thread too, except
in the CLI test, which starts ``python -m epd_lab.servers.proxy`` as a process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.proxy import ProxySettings, create_app
from epd_lab.servers.text import Detokenizer, PromptError, completion_prompt, detokenize, messages_to_prompt
from helpers import plain_metrics, read_line, wait_for

TAIL = [*"é ok".encode(), 1025]  # after the first token: a 2-byte character split over two tokens, a special id
PNG_URI = "data:image/png;base64,iVBORw0KGgo="  # the proxy passes media through; the stand-in never decodes it


def first_token(prompt: str) -> int:
    """The stand-in prefill's first token: a capital letter from the prompt's length."""
    return ord("A") + len(prompt) % 26


def decode_tokens(first: int, n: int) -> list[int]:
    """The stand-in decode's completion of `n` tokens: the prefill's token, then TAIL repeated."""
    return ([first] + TAIL * n)[:n]


# ---- the stand-in servers ----
@dataclasses.dataclass
class StandIn:
    """A stand-in prefill or decode server and what it saw (read by the test thread)."""

    name: str
    status: int = 200  # anything else: answer {"detail": ...} with this status
    delay: float = 0.0  # prefill: before answering; decode: before each token
    truncate_after: int | None = None  # decode stream: end after this many tokens, without the done line
    url: str = ""
    requests: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    active: int = 0
    closed_early: list[str] = dataclasses.field(default_factory=list)  # decode streams closed by the client
    closed: threading.Event = dataclasses.field(default_factory=threading.Event)
    aborts: list[str] = dataclasses.field(default_factory=list)  # prefill: /v1/abort's request ids
    kv_url: str | None = None  # prefill: the side channel its /health tells (a pipelined proxy pairs decode early)


class ClosingStream(StreamingResponse):
    """Close the body generator however the response ends, so `StandIn.closed_early` is recorded at once."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def prefill_app(state: StandIn) -> FastAPI:
    """Stand-in prefill: ``POST /v1/prefill``, ``POST /v1/abort`` (recorded), ``GET /health``."""
    app = FastAPI()

    @app.post("/v1/abort")
    async def abort(request: Request) -> Response:
        rid = (await request.json())["request_id"]
        state.aborts.append(rid)
        return JSONResponse({"request_id": rid, "freed_blocks": 0})

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Response:
        body = await request.json()
        state.requests.append(body)
        await asyncio.sleep(state.delay)
        if state.status != 200:
            return JSONResponse({"detail": f"{state.name} failed on purpose"}, status_code=state.status,
                                headers={"Retry-After": "2"} if state.status == 503 else None)
        assert body["kv_transfer_params"] == {"do_remote_decode": True}
        token = first_token(body["prompt"])
        prompt_len = len(body["prompt"].encode()) + 66 * len(body["images"])
        params = {"remote_url": f"tcp://{state.name}:5557", "remote_request_id": body["request_id"],
                  "prompt_len": prompt_len, "rope_delta": 0, "first_token": token, "num_blocks": 1}
        return JSONResponse({"request_id": body["request_id"], "first_token": token, "prompt_len": prompt_len,
                             "kv_transfer_params": params, "spans": []})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"} | ({"kv_url": state.kv_url} if state.kv_url else {})

    return app


def decode_app(state: StandIn) -> FastAPI:
    """Stand-in decode: ``POST /v1/decode`` (JSON, or NDJSON when streaming), ``GET /health`` with ``active``."""
    app = FastAPI()

    @app.post("/v1/decode")
    async def decode(request: Request) -> Response:
        body = await request.json()
        state.requests.append(body)
        if state.status != 200:
            return JSONResponse({"detail": f"{state.name} failed on purpose"}, status_code=state.status)
        if "first_token" not in body["kv_transfer_params"]:  # asked early (pipelined): the real decode waits for
            while not await request.is_disconnected():  # prefill's KV, this one for the proxy to drop the request
                await asyncio.sleep(0.01)
            state.closed_early.append(body["request_id"])
            return Response(status_code=499)
        tokens = decode_tokens(body["kv_transfer_params"]["first_token"], body["max_tokens"])
        rid = body["request_id"]
        if not body["stream"]:
            await asyncio.sleep(state.delay * len(tokens))
            return JSONResponse({"request_id": rid, "tokens": tokens, "finish_reason": "length", "spans": []})

        async def lines() -> AsyncIterator[bytes]:
            state.active += 1
            finished = False
            try:
                for i, token in enumerate(tokens):
                    if i == state.truncate_after:
                        finished = True
                        return
                    await asyncio.sleep(state.delay)
                    yield json.dumps({"type": "token", "token": token, "index": i}).encode() + b"\n"
                yield json.dumps({"type": "done", "finish_reason": "length", "spans": []}).encode() + b"\n"
                finished = True
            finally:
                state.active -= 1
                if not finished:
                    state.closed_early.append(rid)
                    state.closed.set()

        return ClosingStream(lines(), media_type="application/x-ndjson")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "active": state.active}

    return app


class ThreadServer:
    """uvicorn serving an app in a thread of this process, on a port the OS picks."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 10, "the server started", interval=0.005)
        assert self.server.started, "the server's thread ended before it started"

    def stop(self) -> None:
        """Ask to stop; `join` waits (separate, so that several servers stop together)."""
        self.server.should_exit = True

    def join(self) -> None:
        self.thread.join(10)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"


@dataclasses.dataclass
class Rig:
    """Stand-ins and proxies of one test, all stopped when the test ends."""

    stack: contextlib.ExitStack
    servers: list[ThreadServer] = dataclasses.field(default_factory=list)

    def serve(self, app: FastAPI) -> str:
        self.servers.append(ThreadServer(app))
        return self.servers[-1].url

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        for server in self.servers:
            server.join()

    def prefill(self, name: str = "p0", **behaviour: Any) -> StandIn:
        state = StandIn(name, **behaviour)
        state.url = self.serve(prefill_app(state))
        return state

    def decode(self, name: str = "d0", **behaviour: Any) -> StandIn:
        state = StandIn(name, **behaviour)
        state.url = self.serve(decode_app(state))
        return state

    def dead_url(self) -> str:
        """A URL nothing listens on: a bound, never-listening socket holds the port, so connects are refused."""
        sock = self.stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def proxy(self, prefills: list[str], decodes: list[str], **settings: Any) -> tuple[str, FastAPI]:
        app = create_app(ProxySettings(tuple(prefills), tuple(decodes), **settings))
        return self.serve(app), app

    def client(self, proxy_url: str) -> openai.OpenAI:
        return self.stack.enter_context(openai.OpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0,
                                                      timeout=10))


@pytest.fixture
def rig() -> Iterator[Rig]:
    with contextlib.ExitStack() as stack:
        rig = Rig(stack)
        stack.callback(rig.stop)  # after the clients close (the stack unwinds in reverse)
        yield rig


@pytest.fixture
def basic(rig: Rig) -> tuple[Rig, StandIn, StandIn, openai.OpenAI, FastAPI]:
    """One stand-in prefill, one stand-in decode and a proxy over them, with an `openai` client."""
    p, d = rig.prefill(), rig.decode()
    url, app = rig.proxy([p.url], [d.url])
    return rig, p, d, rig.client(url), app


# ---- text.py ----
def test_detokenize() -> None:
    assert detokenize(list(b"hi \xc3\xa9")) == "hi é"
    assert detokenize([72, 1024, 105, 1026]) == "H<|1024|>i<|1026|>"
    assert detokenize([0xC3]) == "\ufffd"  # a character cut short at the end
    assert detokenize([0xC3, 1025, 0xFF]) == "\ufffd<|1025|>\ufffd"  # a special id ends a partial character
    assert detokenize([]) == ""


def test_detokenizer_streams_whole_characters() -> None:
    ids = [*"aé€😀".encode(), 1024, *b"z"]
    detok = Detokenizer()
    deltas = [detok.feed(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == detokenize(ids) == "aé€😀<|1024|>z"
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["a", "é", "€", "😀", "<|1024|>", "z"]


def test_messages_to_prompt() -> None:
    prompt, images = messages_to_prompt([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URI}},
                                     {"type": "text", "text": "what is it?"},
                                     {"type": "image_url", "image_url": {"url": "/tmp/b.png", "detail": "low"}},
                                     {"type": "text", "text": "and this?"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/c.png"}}]},
    ])
    assert prompt == ("<|im_start|>system\nbe brief<|im_end|>\n"
                      "<|im_start|>user\nwhat is it?\nand this?<|im_end|>\n"
                      "<|im_start|>assistant\na cat<|im_end|>\n"
                      "<|im_start|>user\n<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert images == [PNG_URI, "/tmp/b.png", "https://x/c.png"]
    assert completion_prompt("abc") == completion_prompt(["abc"]) == "abc"


@pytest.mark.parametrize("messages, error", [
    ([], "non-empty"),
    ("hi", "non-empty"),
    ([{"role": "tool", "content": "x"}], "role 'tool'"),
    ([{"role": "user"}], "content must be"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "'input_audio' is not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}], "non-empty string"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG_URI}}]}], "only allowed in user"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}], "tool calls"),
])
def test_messages_to_prompt_rejects(messages: Any, error: str) -> None:
    with pytest.raises(PromptError, match=error):
        messages_to_prompt(messages)
    with pytest.raises(PromptError, match="token-id prompts"):
        completion_prompt([1, 2])


# ---- the proxy through the openai client ----
def test_chat_non_streaming_text_and_images(basic: tuple) -> None:
    _, p, d, client, _ = basic
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe"},
                                             {"type": "image_url", "image_url": {"url": PNG_URI}},
                                             {"type": "image_url", "image_url": {"url": "/tmp/x.png"}}]}]
    out = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=7, temperature=0, seed=7)
    prompt, _ = messages_to_prompt(messages)
    tokens = decode_tokens(first_token(prompt), 7)
    assert out.choices[0].message.content == detokenize(tokens) == chr(first_token(prompt)) + "é ok<|1025|>"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.object == "chat.completion" and out.model == MODEL_ID and out.id.startswith("chatcmpl-")
    prompt_len = len(prompt.encode()) + 66 * 2
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (prompt_len, 7,
                                                                                               prompt_len + 7)
    # what the backends were sent: the rendered prompt and media; decode got prefill's params unchanged
    (pre,), (dec,) = p.requests, d.requests
    assert pre["prompt"] == prompt and pre["images"] == [PNG_URI, "/tmp/x.png"]
    assert dec == {"request_id": pre["request_id"], "max_tokens": 7, "temperature": 0.0, "seed": 7,
                   "stream": True, "kv_transfer_params": {"remote_url": "tcp://p0:5557",
                                                           "remote_request_id": pre["request_id"],
                                                           "prompt_len": prompt_len, "rope_delta": 0,
                                                           "first_token": first_token(prompt), "num_blocks": 1}}

    text = client.chat.completions.create(model="any-model", messages=[{"role": "user", "content": "hello"}])
    assert d.requests[-1]["max_tokens"] == 16  # the default
    assert text.usage.completion_tokens == 16 and p.requests[-1]["images"] == []


def test_chat_streaming(basic: tuple) -> None:
    _, _, d, client, app = basic
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URI}},
                                             {"type": "text", "text": "stream it"}]}]
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=11, stream=True,
                                                 stream_options={"include_usage": True}))
    prompt, _ = messages_to_prompt(messages)
    expected = detokenize(decode_tokens(first_token(prompt), 11))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == expected and all("\ufffd" not in x for x in deltas)
    assert len(deltas) == 9  # 11 tokens: "é" is one delta from two byte tokens, twice
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode()) + 66
    assert d.requests[0]["stream"] is True and len({c.id for c in chunks}) == 1
    proxy = app.state.server
    wait_for(lambda: proxy.decodes.backends[0].inflight == 0)
    assert sorted(s.stage for s in proxy.recorder.spans()) == ["e2e", "proxy_parse", "tpot", "ttft"]
    assert proxy.prefills.backends[0].inflight == 0 and proxy.streams_aborted == {}


def test_completions(basic: tuple) -> None:
    _, p, _, client, _ = basic
    out = client.completions.create(model=MODEL_ID, prompt="once upon", max_tokens=4)
    assert out.object == "text_completion" and out.choices[0].text == detokenize(decode_tokens(first_token(
        "once upon"), 4))
    assert p.requests[0]["prompt"] == "once upon"  # no chat template for completions
    chunks = list(client.completions.create(model=MODEL_ID, prompt=["once upon"], max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_health_metrics(basic: tuple) -> None:
    _, _, d, client, app = basic
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        stream=True))
    wait_for(lambda: app.state.server.decodes.backends[0].inflight == 0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=[], max_tokens=2)
    base = str(client.base_url).removesuffix("/v1/")
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["decode"] == [{"url": d.url, "healthy": True, "inflight": 0, "served": 1,
                                        "health": {"status": "ok", "active": 0}}]
    metrics = plain_metrics(httpx.get(base + "/metrics").text)
    assert 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="200"} 1' in metrics
    assert 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="400"} 1' in metrics
    assert 'epd_lab:proxy_requests_total{route="/v1/models",status="200"} 1' in metrics
    assert f'epd_lab:proxy_backend_up{{role="decode",url="{d.url}"}} 1' in metrics
    # one streamed answer of 2 tokens: vLLM's histograms with vLLM's buckets (TTFT's first bound 1 ms, last +Inf)
    assert "vllm:time_to_first_token_seconds_count 1" in metrics and "vllm:e2e_request_latency_seconds_count 1" in metrics
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001"}' in metrics
    assert 'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1' in metrics
    assert "vllm:inter_token_latency_seconds_count 1" in metrics  # its one gap between two tokens
    assert "vllm:request_time_per_output_token_seconds_count 1" in metrics
    assert 'vllm:request_success_total{finished_reason="length"} 1' in metrics
    unknown = httpx.get(base + "/v2/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, error", [
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "'video_url' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "'n' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "'stop' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, r"max_tokens must be in \[1, 4096\]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4097}, r"max_tokens must be in \[1, 4096\]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    # past int64: decode's Generator cannot take it (found by the fuzz leg: a streamed 200, then an error event)
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2**63, "stream": True}, r"seed"),
])
def test_bad_requests_are_400(basic: tuple, extra: dict[str, Any], error: str) -> None:
    _, p, d, client, _ = basic
    with pytest.raises(openai.BadRequestError, match=error) as info:
        client.chat.completions.create(model=MODEL_ID, **extra)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    assert p.requests == [] and d.requests == []  # refused before any backend saw it
    raw = httpx.post(str(client.base_url) + "chat/completions", content=b"{not json")
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "code"}


def test_no_backend_is_503(rig: Rig) -> None:
    p, d = rig.prefill(), rig.decode()
    for prefills, decodes, role in (([rig.dead_url()], [d.url], "prefill"), ([p.url], [rig.dead_url()], "decode")):
        url, _ = rig.proxy(prefills, decodes)
        client = rig.client(url)
        with pytest.raises(openai.InternalServerError, match=f"no {role} server is reachable") as info:
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 503 and info.value.code == "no_backend"
        assert httpx.get(url + "/health").status_code == 503


def test_timeout_is_504(rig: Rig) -> None:
    p, d = rig.prefill(delay=1.0), rig.decode()
    client = rig.client(rig.proxy([p.url], [d.url], timeout=0.3)[0])
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="timed out") as info:
        client.completions.create(model=MODEL_ID, prompt="slow")
    assert info.value.status_code == 504 and time.monotonic() - t0 < 2.0
    assert d.requests == []
    # the prefill took the request and may still finish it: the proxy aborts it there, so no KV is left held
    assert p.aborts == [p.requests[0]["request_id"]]


def test_a_long_non_streamed_answer_is_not_cut_at_the_timeout(rig: Rig) -> None:
    """The timeout bounds progress: a decode that keeps sending tokens, 0.1 s apart, for 1.5 s in all, serves a
    non-streamed request through a proxy whose timeout is 0.3 s (it once answered 504 at the timeout)."""
    p, d = rig.prefill(), rig.decode(delay=0.1)
    client = rig.client(rig.proxy([p.url], [d.url], timeout=0.3)[0])
    out = client.completions.create(model=MODEL_ID, prompt="long", max_tokens=15)
    assert out.usage.completion_tokens == 15
    assert out.choices[0].text == detokenize(decode_tokens(first_token("long"), 15))
    assert d.requests[0]["stream"] is True  # the proxy streams from decode for a non-streamed client too


def test_a_busy_backend_passes_the_request_on_and_503_comes_back_with_retry_after(rig: Rig) -> None:
    """A prefill at capacity answers 503 at once, holding nothing: the proxy offers the request to the next one;
    when every one is busy the client gets 503 with the backend's Retry-After, at once."""
    busy, free, d = rig.prefill("busy", status=503), rig.prefill("free"), rig.decode()
    client = rig.client(rig.proxy([busy.url, free.url], [d.url])[0])
    for _ in range(2):
        assert client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert len(free.requests) == 2 and len(busy.requests) == 2  # each offered to the busy one first, by the rotation
    url, _ = rig.proxy([busy.url], [d.url])
    raw = httpx.post(url + "/v1/completions", json={"model": MODEL_ID, "prompt": "x"}, timeout=10)
    assert raw.status_code == 503 and raw.headers["retry-after"] == "2"
    assert raw.json()["error"]["code"] == "backend_unavailable"


def test_backend_errors(rig: Rig) -> None:
    """A backend's 5xx becomes 502 and its 400 stays 400, each with the backend's detail. Both are answers: the
    request is not offered to the next prefill (only a 503, a refused connection, a stall or a connection closed
    unanswered pass it on)."""
    broken, picky, d = rig.prefill("broken", status=500), rig.prefill("picky", status=400), rig.decode()
    spare = rig.prefill("spare")
    url, _ = rig.proxy([broken.url, spare.url], [d.url])  # round robin offers broken first
    with pytest.raises(openai.InternalServerError, match="broken failed on purpose") as info:
        rig.client(url).completions.create(model=MODEL_ID, prompt="x")
    assert info.value.status_code == 502 and spare.requests == []
    assert "epd_lab:proxy_retries_total{" not in plain_metrics(httpx.get(url + "/metrics").text)
    with pytest.raises(openai.BadRequestError, match="picky failed on purpose"):
        rig.client(rig.proxy([picky.url], [d.url])[0]).completions.create(model=MODEL_ID, prompt="x")
    p = rig.prefill()
    client = rig.client(rig.proxy([p.url], [rig.decode("dfail", status=500).url])[0])
    stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], stream=True)
    # the stream began with prefill's token, so decode's failure is an event in it, with the 502's code
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.APIError, match="dfail failed on purpose") as info:
        list(stream)
    assert info.value.code == "backend_error"


@pytest.mark.parametrize("behaviour, error", [({"truncate_after": 3}, "ended its stream before its done line"),
                                              ({"delay": 2.0}, "timed out")])
def test_stream_failure_after_start(rig: Rig, behaviour: dict[str, Any], error: str) -> None:
    """A decode stream that breaks after the response began reaches the client as an error event."""
    p, d = rig.prefill(), rig.decode(**behaviour)
    url, app = rig.proxy([p.url], [d.url], timeout=0.5)
    stream = rig.client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=8, stream=True)
    with pytest.raises(openai.APIError, match=error):
        list(stream)
    proxy = app.state.server
    wait_for(lambda: proxy.decodes.backends[0].inflight == 0)
    assert sum(proxy.streams_aborted.values()) == 1 and "client_disconnect" not in proxy.streams_aborted


def test_round_robin(rig: Rig) -> None:
    prefills, decodes = [rig.prefill(f"p{i}") for i in range(2)], [rig.decode(f"d{i}") for i in range(2)]
    client = rig.client(rig.proxy([p.url for p in prefills], [d.url for d in decodes])[0])
    rids = [client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2).id.removeprefix("cmpl-")
            for _ in range(4)]
    for servers in (prefills, decodes):
        assert [r["request_id"] for r in servers[0].requests] == rids[0::2]
        assert [r["request_id"] for r in servers[1].requests] == rids[1::2]


@pytest.mark.parametrize("policy, expected", [("least_loaded", [0, 3]), ("round_robin", [1, 2])])
def test_policy_with_a_busy_decode(rig: Rig, policy: str, expected: list[int]) -> None:
    """While d0 streams a long answer, least_loaded sends every other request to d1; round_robin alternates."""
    p, decodes = rig.prefill(), [rig.decode(f"d{i}", delay=0.05) for i in range(2)]
    client = rig.client(rig.proxy([p.url], [d.url for d in decodes], policy=policy)[0])
    with client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "long"}],
                                        max_tokens=200, stream=True) as busy:
        next(iter(busy))
        for _ in range(3):
            client.completions.create(model=MODEL_ID, prompt="short", max_tokens=2)
    assert [len(d.requests) - (i == 0) for i, d in enumerate(decodes)] == expected


def test_refusing_backend_is_skipped(rig: Rig) -> None:
    """A decode that refuses connections is marked down; requests go to the other one, without failing."""
    p, d = rig.prefill(), rig.decode()
    dead = rig.dead_url()
    url, _ = rig.proxy([p.url], [dead, d.url], retry_after=60)
    client = rig.client(url)
    for _ in range(3):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
    assert len(d.requests) == 3
    assert f'epd_lab:proxy_backend_up{{role="decode",url="{dead}"}} 0' in plain_metrics(httpx.get(url + "/metrics").text)
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and [e["healthy"] for e in health["decode"]] == [False, True]


def test_client_disconnect_closes_upstream(rig: Rig) -> None:
    p, d = rig.prefill(), rig.decode(delay=0.02)
    url, app = rig.proxy([p.url], [d.url])
    stream = rig.client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=1000, stream=True)
    chunks = iter(stream)
    for _ in range(4):
        next(chunks)
    stream.close()
    assert d.closed.wait(5), "the stand-in decode's stream was not closed"
    assert d.closed_early == [d.requests[0]["request_id"]]
    proxy = app.state.server
    wait_for(lambda: proxy.decodes.backends[0].inflight == 0 and proxy.streams_aborted)
    assert proxy.streams_aborted == {"client_disconnect": 1}
    assert {s.stage for s in proxy.recorder.spans()} == {"proxy_parse", "ttft", "tpot", "e2e"}


def test_cli(rig: Rig) -> None:
    p, d = rig.prefill(), rig.decode()
    cmd = [sys.executable, "-m", "epd_lab.servers.proxy", "--port", "0", "--prefill", p.url, "--decode", f"{d.url},{d.url}",
           "--policy", "least_loaded", "--timeout", "5"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        try:
            info = json.loads(read_line(proc, 30, "the proxy printed its URL"))
            assert info["pid"] == proc.pid and info["url"].startswith("http://127.0.0.1:")
            client = rig.client(info["url"])
            out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
            assert out.choices[0].message.content == detokenize(decode_tokens(first_token(
                messages_to_prompt([{"role": "user", "content": "hi"}])[0]), 3))
            assert httpx.get(info["url"] + "/health").json()["policy"] == "least_loaded"
        finally:
            proc.terminate()
            assert proc.wait(10) == -signal.SIGTERM  # uvicorn shuts down, then re-raises the signal
    bad = subprocess.run([sys.executable, "-m", "epd_lab.servers.proxy", "--prefill", p.url, "--decode", d.url,
                          "--policy", "random"], capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_pipelined_proxy_goes_the_serial_way_when_prefill_tells_no_side_channel(rig: Rig) -> None:
    """A prefill whose /health names no kv_url cannot be paired with an early decode: the streamed request goes
    the serial way, decode asked with prefill's answer, and the client sees no difference."""
    p, d = rig.prefill(), rig.decode()
    url, app = rig.proxy([p.url], [d.url], pipelined=True)
    chunks = list(rig.client(url).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert d.requests[0]["kv_transfer_params"]["prompt_len"] is not None  # prefill's own answer, not the early one
    assert app.state.server.prefills.backends[0].probed and app.state.server.prefills.backends[0].kv_url is None


def test_pipelined_proxy_passes_a_busy_prefill_on(rig: Rig) -> None:
    """A pipelined streamed request whose chosen prefill answers 503 (at capacity: it holds nothing) goes the serial
    way to the next prefill, as a serial request does; the decode asked early is dropped (it once answered 503)."""
    busy = rig.prefill("busy", status=503, kv_url="tcp://127.0.0.1:1")
    free, d = rig.prefill("free", kv_url="tcp://127.0.0.1:2"), rig.decode()
    url, _ = rig.proxy([busy.url, free.url], [d.url], pipelined=True)
    chunks = list(rig.client(url).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(busy.requests) == 1 and len(free.requests) == 1 and busy.aborts == []
    assert d.requests[-1]["kv_transfer_params"]["prompt_len"] is not None  # the serial way: prefill's own answer
    wait_for(lambda: d.closed_early == [d.requests[0]["request_id"]])  # the one asked early was dropped


def test_a_proxy_cancelled_mid_prefill_aborts_the_request_there(rig: Rig) -> None:
    """The proxy's handler cancelled while its prefill call is in flight (here: the proxy shuts down, and uvicorn
    cancels the requests still running after its graceful timeout): the prefill, which may finish the request and
    hold its KV, is told to abort it."""
    p, d = rig.prefill(delay=5.0), rig.decode()
    url, _ = rig.proxy([p.url], [d.url])
    proxy_server = rig.servers[-1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + "/v1/completions", json={"model": MODEL_ID, "prompt": "x"}, timeout=20)
        wait_for(lambda: p.requests)
        proxy_server.stop()
        proxy_server.join()
        with contextlib.suppress(httpx.HTTPError):
            pending.result(20)
    assert p.aborts == [p.requests[0]["request_id"]]
