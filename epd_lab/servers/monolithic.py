"""The monolithic floor as a server: the whole model in one process behind OpenAI's chat API (``epd-lab monolithic``).

It is what E→P→D is compared against under load (`epd-lab bench serve`, `epd-lab sweep rates`): the same model,
runtime and decode scheduler as the roles, with no process boundary, no HTTP hop and no transfer. One thread reads
each request's images (under the same `MediaPolicy` as an encoder), runs the ViT and the prefill into the paged
cache's blocks, one request at a time; `DecodeScheduler` steps every admitted request in batches on another thread,
as the decode server does. So the floor overlaps one prefill with the decode batch, as an engine without chunked
prefill does, and spends its two threads where E→P→D spreads over processes.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed or not; greedy at temperature 0, else
sampled), ``GET /v1/models``,
``/health``, ``/metrics``, ``/v1/spans``, ``/v1/clock``. Spans per request: ``proxy_parse``, ``load`` (media read and
headers parsed), ``vit`` (pixels decoded, preprocessed, encoded), ``prefill``, ``ttft``, ``decode_step``s, ``e2e``.

Run: ``python -m epd_lab.servers.monolithic --port 0`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from epd_lab import models
from epd_lab.ep.media import MAX_MEDIA_BYTES, MediaError, MediaPolicy, fetch_media, load_rgb, open_image
from epd_lab.ep.messages import DTYPES
from epd_lab.kv import BlockManager, OutOfBlocks, PagedKVCache, blocks_needed
from epd_lab.models.runtime import open_runtime
from epd_lab.models.sampling import request_seed, sample
from epd_lab.servers.openai_api import MODEL_ID, Job, chunk, completion, error_body, model_list, parse_request, usage
from epd_lab.servers.scheduler import DONE, DecodeScheduler, Generation
from epd_lab.servers.text import Detokenizer, detokenize
from epd_lab.serving import (BadRequest, Metric, RoleMetrics, ServingError, Unavailable, decode_body, json_response,
                             option, read_body, role_app, serve_main)
from epd_lab.serving.metrics import REQUEST_BUCKETS, request_histograms
from epd_lab.models.catalog import use_device
from epd_lab.servers.model_settings import PagedKVSettings
from epd_lab.serving.settings import check_at_least, check_positive
from epd_lab.trace import Recorder, Span


@dataclasses.dataclass(slots=True, frozen=True)
class MonolithicSettings(PagedKVSettings):
    """What the monolithic server is started with; checked on construction (`ValueError`)."""

    timeout: float = option(10.0, "seconds a media item may take to fetch")
    max_batch: int = option(16, "requests per decode forward")
    media_roots: tuple[str, ...] = option((), "folders whose files clients may name as media items")
    media_private_hosts: bool = option(False, "fetch http(s) media items from loopback and private addresses too")

    def __post_init__(self) -> None:
        PagedKVSettings.__post_init__(self)
        check_at_least(self, 1, "max_batch")
        check_positive(self, "timeout")


class MonolithicServer:
    """The model, its paged cache and runtime, the prefill thread and the decode scheduler."""

    def __init__(self, settings: MonolithicSettings) -> None:
        self.settings = settings
        models.configure_torch(threads=1)  # the roles' kernels, so answers equal theirs
        dtype = DTYPES[settings.dtype]
        self.device = use_device(settings.device)
        self.model = models.open_model(settings.model, dtype=dtype, device=self.device)
        self.recorder = Recorder(node=f"monolithic:{settings.port}")
        self.metrics = RoleMetrics("monolithic", MODEL_ID)
        self.latency = request_histograms(self.metrics)  # vLLM's, and the engine's phases below
        self.queue_time = self.metrics.histogram("vllm:request_queue_time_seconds", "Histogram of time spent "
                                                 "waiting for the prefill thread.", REQUEST_BUCKETS)
        self.prefill_time = self.metrics.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent "
                                                   "in PREFILL phase for request (media, ViT, forward).",
                                                   REQUEST_BUCKETS)
        self.decode_time = self.metrics.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in "
                                                  "DECODE phase for request.", REQUEST_BUCKETS)
        self.tokens: collections.Counter[str] = collections.Counter()  # prompt, generation
        self.waiting = 0  # requests handed to the prefill thread and not started (touched on the event loop)
        self.kv_pool_exhausted = 0  # requests refused (503): their prompt's KV blocks were not free
        self.cache = PagedKVCache.from_config(self.model.config, num_blocks=settings.kv_blocks,
                                              block_size=settings.block_size, dtype=dtype, device=self.device)
        options = {"max_batch": settings.max_batch} if settings.runtime == "fast" else {}
        self.runtime = open_runtime(settings.runtime, self.model, self.cache, **options)
        self.blocks = BlockManager(settings.kv_blocks)
        self.policy = MediaPolicy(settings.media_roots, settings.media_private_hosts)
        self.prefills = ThreadPoolExecutor(1, thread_name_prefix="monolithic-prefill")
        self.served = 0
        self.scheduler = DecodeScheduler(self.runtime, settings.max_batch, self.blocks.allocate, self.recorder,
                                         lambda *names, **amounts: None, lambda gen: self.blocks.free(gen.block_table))

    def start(self, job: Job, prompt: str, items: list[str], emit: Callable[[Any], None]) -> Generation:
        """In the prefill thread: read the images, encode, prefill, emit the first token and hand the rest to the
        scheduler. `BadRequest` for an unusable image, `Unavailable` when the KV pool is full."""
        node, t0 = self.recorder.node, time.monotonic_ns()
        self.queue_time.observe((t0 - job.t0) / 1e9)
        try:
            images = [open_image(fetch_media(item, self.settings.timeout, MAX_MEDIA_BYTES, self.policy), item)
                      for item in items]
            t1 = time.monotonic_ns()
            pixels = grid = embeds = None
            if images:
                # rescaled, normalised and patchified where the tower runs, as the encoder does (the same bits)
                pixels, grid = models.preprocess([load_rgb(img, item) for img, item in zip(images, items)],
                                                 self.device)
                with torch.inference_mode():
                    embeds = self.runtime.encode(pixels, grid)
        except MediaError as exc:
            raise BadRequest(str(exc)) from None
        t2 = time.monotonic_ns()
        input_ids = models.build_input_ids(prompt, [] if grid is None else grid.tolist())
        prompt_len = input_ids.shape[-1]
        try:
            table = self.blocks.allocate(blocks_needed(prompt_len, self.settings.block_size))
        except OutOfBlocks as exc:
            self.kv_pool_exhausted += 1
            raise Unavailable(f"KV pool exhausted: {exc}") from None
        try:
            with torch.inference_mode():
                out = self.runtime.prefill(input_ids, embeds, grid, table)
            seed = request_seed(job.seed)
            first = int(sample(out.logits[None], [job.temperature], [seed], [0]))
        except BaseException:
            self.blocks.free(table)
            raise
        t3 = time.monotonic_ns()
        job.prompt_len = prompt_len
        self.prefill_time.observe((t3 - t0) / 1e9)
        self.tokens["prompt"] += prompt_len
        if not job.stream:  # a stream's first token is timed as it is sent
            self.latency["ttft"].observe((t3 - job.t0) / 1e9)
        spans = [Span(job.rid, -1, "load", node, t0, t1), Span(job.rid, -1, "vit", node, t1, t2),
                 Span(job.rid, -1, "prefill", node, t2, t3), Span(job.rid, -1, "ttft", node, job.t0, t3)]
        self.recorder.extend(spans if images else spans[2:])
        gen = Generation(job.rid, table, prompt_len, out.next_position, job.max_tokens, job.temperature, seed,
                         emit, [first], [])
        emit(first)
        if job.max_tokens == 1:
            emit(DONE)
            self.blocks.free(table)
            return gen
        try:
            self.scheduler.add(gen)
        except RuntimeError as exc:  # the scheduler is closing: the server shuts down
            self.blocks.free(table)
            emit(exc)
        return gen

    def health(self) -> dict:
        """``/health``: the model, the free KV blocks, the requests generating and those served."""
        return {"status": "ok", "role": "monolithic", "model": self.settings.model_name,
                "device": str(self.device), "runtime": self.settings.runtime,
                "free_blocks": self.blocks.num_free_blocks,
                "active_requests": self.scheduler.num_active, "served": self.served}

    def finished(self, job: Job, tokens: int, t_first: int | None, t_last: int) -> None:
        """A request answered whole (on the event loop): its tokens, its decode time and its end to end."""
        self.served += 1
        self.tokens["generation"] += tokens
        if t_first is not None:
            self.decode_time.observe((t_last - t_first) / 1e9)
        self.latency["e2e"].observe((time.monotonic_ns() - job.t0) / 1e9)

    def metric_families(self) -> list[Metric]:
        """``/metrics``: vLLM's latency histograms, requests running and waiting, KV usage, tokens; the free KV
        blocks and the requests generating."""
        h, m = self.health(), self.metrics
        return [*m.instruments(),
                m.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                        h["active_requests"]),
                m.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", self.waiting),
                m.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                        self.blocks.num_used_blocks / self.blocks.num_blocks),
                m.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.tokens["prompt"]),
                m.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                          self.tokens["generation"]),
                m.counter("vllm:request_success", "Count of successfully processed requests.",
                          {"length": self.served}, "finished_reason"),
                m.gauge("kv_blocks_free", "KV blocks free", h["free_blocks"]),
                m.gauge("active_requests", "requests generating", h["active_requests"])]

    def refusals(self) -> dict[str, float]:
        """``kv_pool_exhausted``: a prompt whose KV blocks were not free (503)."""
        return {"kv_pool_exhausted": self.kv_pool_exhausted}

    def close(self) -> None:
        """Stop the prefill thread and the scheduler (failing what it holds), then the runtime and the cache."""
        self.prefills.shutdown(wait=True, cancel_futures=True)
        self.scheduler.close()
        self.runtime.close()
        self.cache.close()


def create_app(settings: MonolithicSettings) -> FastAPI:
    """The monolithic server's app; the model loads in its lifespan."""
    app = role_app("monolithic", lambda: MonolithicServer(settings),
                   ("/v1/chat/completions", "/v1/completions", "/v1/models"), error_body=error_body)

    @app.get("/v1/models")
    async def list_models() -> Any:
        return json_response(model_list(MODEL_ID, root=MODEL_ID))

    async def complete(request: Request, kind: str) -> Response:
        """A chat (`kind` "chat") or text completion (`kind` "text"), whole or streamed."""
        server: MonolithicServer = app.state.server
        t0 = time.monotonic_ns()
        job, prompt, items = parse_request(decode_body(await read_body(request)), kind, t0)
        server.recorder.add(Span(job.rid, -1, "proxy_parse", server.recorder.node, t0, time.monotonic_ns()))
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        server.waiting += 1
        try:
            gen = await asyncio.wrap_future(server.prefills.submit(server.start, job, prompt, items, emit))
        finally:
            server.waiting -= 1
        if job.stream:
            return StreamingResponse(_events(server, job, gen, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        t_first = time.monotonic_ns()  # its first token is made: the rest is decode
        try:
            tokens = [item async for item in _tokens(queue)]
        finally:
            gen.cancelled = True
        server.recorder.add(Span(job.rid, -1, "e2e", server.recorder.node, job.t0, time.monotonic_ns()))
        server.finished(job, len(tokens), t_first, time.monotonic_ns())
        return json_response(completion(job, MODEL_ID, detokenize(tokens), "length", len(tokens)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "text")

    return app


async def _tokens(queue: asyncio.Queue) -> AsyncIterator[int]:
    """A request's tokens as the threads emit them, until `DONE`; a failure raises `ServingError`."""
    while (item := await queue.get()) is not DONE:
        if isinstance(item, Exception):
            raise ServingError(f"generation failed: {type(item).__name__}: {item}")
        yield item


async def _events(server: MonolithicServer, job: Job, gen: Generation, queue: asyncio.Queue) -> AsyncIterator[bytes]:
    """OpenAI's SSE events of a streamed request: the role chunk, text deltas, the finish chunk, usage, [DONE]."""
    detok, count, latency = Detokenizer(), 0, server.latency
    t_first = t_last = 0
    try:
        if job.kind == "chat":  # the role chunk is chat's only
            yield chunk(job, MODEL_ID, "", role=True)
        try:
            async for token in _tokens(queue):
                now = time.monotonic_ns()
                if count:
                    latency["itl"].observe((now - t_last) / 1e9)
                else:
                    t_first = now
                    latency["ttft"].observe((now - job.t0) / 1e9)
                count, t_last = count + 1, now
                if text := detok.feed(token):
                    yield chunk(job, MODEL_ID, text)
        except ServingError as exc:  # after the stream began: an error event, as the proxy sends
            yield b"data: " + json_response(error_body(exc)).body + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if tail := detok.flush():
            yield chunk(job, MODEL_ID, tail)
        yield chunk(job, MODEL_ID, None if job.kind == "chat" else "", "length")
        if job.include_usage:
            yield chunk(job, MODEL_ID, None, usage=usage(job, count))
        yield b"data: [DONE]\n\n"
        if count >= 2:
            latency["tpot"].observe((t_last - t_first) / (count - 1) / 1e9)
        server.finished(job, count, t_first or None, t_last)
    finally:
        gen.cancelled = True  # a client gone mid-stream: the scheduler drops it before its next step
        server.recorder.add(Span(job.rid, -1, "e2e", server.recorder.node, job.t0, time.monotonic_ns()))


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM."""
    return serve_main(MonolithicSettings, create_app, argv, "python -m epd_lab.servers.monolithic",
                      "the monolithic floor: the whole model behind OpenAI's chat API")


if __name__ == "__main__":
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
