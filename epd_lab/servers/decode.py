"""The decode server (D of EPD): the KV consumer of seed 003, then generation.

``POST /v1/decode`` (`DecodeRequest` → `DecodeResponse`, or NDJSON with ``"stream": true``):

1. Allocate the request's blocks, ask the producer named by ``kv_transfer_params.remote_url`` for them over the
   ZMQ side channel (`KVConsumer.receive_kv`), gather them into a `DynamicCache` and free the blocks at once
   (the cache is a copy). ``TRANS_ERROR`` → by its reason (no such request on the producer 404, aborted 409,
   producer busy 503, else 502), no answer within ``--timeout`` (producer dead or stuck) → 504,
   with the connector's message. After a timeout the blocks are quarantined for ``--kv-quarantine`` seconds
   before they go back to the pool: a producer that was only slow may still write into them.
2. Generate: token 0 is prefill's ``first_token``; token i+1 comes from the logits of feeding token i at
   ``prompt_len + rope_delta + i``, greedy at temperature 0, else sampled from ``softmax(logits / temperature)``
   with a ``torch.Generator`` seeded by ``seed``.

Concurrency: ONE scheduler thread owns the model. Each turn it steps every active request once, in batches of
at most ``--max-batch``: one `DecodeRunner.step_batch` forward per batch (its requests' caches differ in
length and stay separate), `DecodeRunner.step` for a batch of one. Batched logits are bit-identical to the
single-request ones in bfloat16 (measured on AVX-512 BF16); in float32 they differ in the last bits (CPU GEMM
sums a batch in another order), see `DecodeRunner.step_batch`. ``--max-batch 1`` is the round-robin of single
steps. KV transfers run in other threads meanwhile. A streaming client that disconnects marks its request
cancelled; the scheduler drops it (and its cache) before its next step.

Admission (`epd_lab.serving.Admission`): ``--max-active`` requests at once, each until its stream ends; the
others wait, before their body is read and holding no KV, while their predicted wait fits their deadline
(``X-EPD-Deadline-Ms``, else ``--timeout``), and are refused with 503, ``Retry-After`` and the predicted wait
when it does not; ``--max-queued`` bounds the queue.

Errors, always ``{"detail": "..."}``: bad JSON / unknown field / inconsistent params 400, body too large 413,
KV pool exhausted 503, overloaded 503, TRANS_ERROR 404/409/503/502 by its reason, timeout 504. An error after
streaming began is a last NDJSON line `StreamError` (``{"type": "error", "detail": "..."}``).

``GET /health`` (blocks free/used/quarantined, active requests, max batch, counters: ``decode_forwards`` counts
batched steps, so ``tokens_generated`` over it is about the mean batch), ``GET /metrics`` (Prometheus).

Run: ``python -m epd_lab.servers.decode --port 0`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import torch
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from transformers import DynamicCache

from epd_lab import models
from epd_lab.ep.messages import DTYPES
from epd_lab.faults import failpoint
from epd_lab.kv import BlockManager, KVConsumer, KVTransferError, OutOfBlocks, PagedKVCache, blocks_needed
from epd_lab.kv.connector import KVTransferTimeout
from epd_lab.servers.messages import (
    DecodeRequest,
    DecodeResponse,
    KVTransferParams,
    StreamDone,
    StreamError,
    StreamToken,
    encode,
)
from epd_lab.serving import (Admission, BadGateway, BadRequest, Conflict, Forbidden, GatewayTimeout, Metric, NotFound,
                             ServingError, Unavailable, deadline_budget, engine_metrics, option, read_struct,
                             role_app, serve_main)
from epd_lab.serving.placement import (DEVICE_HELP, DTYPE_HELP, DTYPE_NAMES, MODEL_HELP, check_placement,
                                       use_device)
from epd_lab.trace import Recorder, Span
from epd_lab.transfer import open_engine
from epd_lab.transfer.engine import ENGINES

T = TypeVar("T")

_DONE = object()  # the queue's end marker
# a TRANS_ERROR's reason as decode's answer (any other: 502): the producer holds no such request (never prefilled
# there, or freed after its free timeout), the request was aborted, the producer is at one of its bounds
_TRANS_ERRORS: dict[str, Callable[[str], ServingError]] = {
    "not_found": NotFound, "aborted": Conflict, "busy": lambda detail: Unavailable(detail, retry_after=1)}


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` for any temperature > 0: in float64 and shifted by the largest logit
    first, so that a tiny temperature (1e-198) gives the argmax's one-hot instead of inf/inf = NaN."""
    scaled = logits.double()
    return torch.softmax((scaled - scaled.max()) / temperature, dim=-1)


class _TimedOut(GatewayTimeout):
    """The producer did not answer in time (504): blocks it was asked to write into are quarantined."""


@dataclasses.dataclass(slots=True, frozen=True)
class DecodeSettings:
    """What a decode server is started with; checked on construction (`ValueError`)."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "0: the OS picks (printed on stdout)")
    transport: str = option("auto", "the transfer engine's protocol", choices=ENGINES)
    model: str | None = option(None, MODEL_HELP)
    device: str = option("cpu", DEVICE_HELP)
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPE_NAMES)
    kv_blocks: int = option(512, "blocks in the paged KV cache")
    block_size: int = option(16, "tokens per KV block")
    timeout: float = option(10.0, "seconds the side channel waits for the producer's answer")
    kv_quarantine: float | None = option(None, "seconds the blocks of a timed-out transfer rest before reuse "
                                               "(default: --timeout)")
    max_batch: int = option(16, "requests per decode forward (1: round-robin single steps)")
    max_active: int = option(64, "requests at once (receiving their KV or generating); more wait, holding no KV, "
                                 "while their predicted wait fits their deadline (X-EPD-Deadline-Ms, else "
                                 "--timeout), and are refused with 503 at once when it does not")
    max_queued: int = option(1024, "requests waiting for a place among max_active at most (a memory backstop)")
    kv_producers: tuple[str, ...] = option((), "the prefills' KV side channels (tcp://host:port) this decode may "
                                               "ask; a request naming another is refused (none: any, unguarded)")

    def __post_init__(self) -> None:
        check_placement(self)
        for name in ("kv_blocks", "block_size", "max_batch", "max_active"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.kv_quarantine is not None and self.kv_quarantine < 0:
            raise ValueError(f"kv_quarantine must be >= 0, got {self.kv_quarantine}")


@dataclasses.dataclass(slots=True, eq=False)
class _Generation:
    """One admitted request: its private cache and where its tokens go."""

    rid: str
    cache: DynamicCache
    next_position: int  # mrope position of token 0 (prompt_len + rope_delta)
    max_tokens: int
    temperature: float
    generator: torch.Generator | None
    emit: Callable[[Any], None]  # thread-safe: an int token, _DONE, or an Exception
    tokens: list[int]
    spans: list[Span]
    logits: list[torch.Tensor] | None = None  # kept only when the request asked for them
    cancelled: bool = False


class DecodeServer:
    """The decode role's state: model, registered paged cache, blocks, KV consumer, the scheduler thread."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        models.configure_torch(threads=1)  # bit-identity with prefill
        dtype = DTYPES[settings.dtype]
        self.device = use_device(settings.device)
        self.model = models.open_model(settings.model, dtype=dtype, device=self.device)
        self.runner = models.DecodeRunner(self.model)
        self.recorder = Recorder(node=f"decode:{settings.port}")
        self.node = self.recorder.node
        self.engine = open_engine(settings.transport, settings.host, settings.timeout)
        try:
            self.cache = PagedKVCache.from_config(self.model.config, num_blocks=settings.kv_blocks,
                                                  block_size=settings.block_size, dtype=dtype, engine=self.engine,
                                                  device=self.device)
        except BaseException:
            self.engine.close()
            raise
        self.blocks = BlockManager(settings.kv_blocks)
        self.consumer = KVConsumer(self.engine, self.cache, timeout=settings.timeout)
        self.quarantine_s = settings.timeout if settings.kv_quarantine is None else settings.kv_quarantine
        self.counters: collections.Counter[str] = collections.Counter()
        self._quarantined = 0
        self._timers: set[threading.Timer] = set()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active: list[_Generation] = []
        self._closed = False
        self.admission = Admission("decode", settings.max_active, settings.max_queued, settings.timeout)
        self.io = ThreadPoolExecutor(32, thread_name_prefix="decode-kv")  # KV transfers wait here, not the loop
        self._thread = threading.Thread(target=self._schedule, name="decode-scheduler", daemon=True)
        self._thread.start()

    # ---- KV ----
    def fetch_kv(self, req: DecodeRequest) -> tuple[DynamicCache, list[Span], KVTransferParams]:
        """Receive the request's KV (in a worker thread) and gather it; raises `ServingError`. Returns the cache,
        the spans and the parameters complete (a pipelined request's learnt from the producer)."""
        p = req.kv_transfer_params
        if self.settings.kv_producers and p.remote_url not in self.settings.kv_producers:
            # checked before any socket opens: decode never sends its cache's addresses and keys elsewhere
            self._count("kv_producers_refused")
            raise Forbidden("kv_transfer_params.remote_url is not a producer this decode server was told about")
        spans: list[Span] = []
        prompt_len, num_blocks = p.prompt_len, p.num_blocks
        if p.pipelined:  # the prompt's size comes from the producer, as soon as prefill knows it
            t0 = time.monotonic_ns()
            plan = self._kv_call(p, lambda: self.consumer.query(p.remote_url, p.remote_request_id))
            spans.append(Span(req.request_id, -1, "kv_query", self.node, t0, time.monotonic_ns()))
            prompt_len, num_blocks = plan.prompt_len, plan.num_blocks
        n = blocks_needed(prompt_len, self.cache.block_size)
        if num_blocks != n:
            raise BadRequest(f"kv_transfer_params: {prompt_len} tokens take {n} blocks of "
                                 f"{self.cache.block_size}, not {num_blocks} (prefill's block size differs?)")
        try:
            ids = self.blocks.allocate(n)
        except OutOfBlocks as exc:
            self._count("kv_pool_exhausted")
            raise Unavailable(f"KV pool exhausted: {exc}") from None
        t0 = time.monotonic_ns()
        quarantine = False
        try:
            try:
                done = self._kv_call(p, lambda: self.consumer.receive_kv(p.remote_url, p.remote_request_id, ids))
            except _TimedOut:
                quarantine = True  # the producer may still write into them
                raise
            if p.pipelined:
                if not done.aux:
                    raise BadGateway(f"TRANS_DONE for {p.remote_request_id!r} came without the first token")
                p = msgspec.structs.replace(p, prompt_len=prompt_len, num_blocks=num_blocks,
                                            first_token=done.aux[0].first_token, rope_delta=done.aux[0].rope_delta)
            nbytes = self.cache.nbytes(n)
            spans.append(Span(req.request_id, -1, "kv_transfer", self.node, t0, time.monotonic_ns(), nbytes))
            self.recorder.extend(spans)
            cache = self.cache.read_to_dynamic_cache(ids, prompt_len, self.model.config)
            self._count(kv_bytes=nbytes)
            return cache, spans, p
        finally:
            if quarantine and self.quarantine_s > 0:
                self._quarantine(ids)
            else:
                self.blocks.free(ids)

    def _kv_call(self, p: KVTransferParams, call: Callable[[], T]) -> T:
        """One side-channel exchange; its failures as `ServingError`s: TRANS_ERROR by its reason (the producer
        holds no such request 404, aborted 409, busy 503, else 502), no answer 504 (`_TimedOut`), an unusable
        `remote_url` 400."""
        try:
            return call()
        except KVTransferTimeout as exc:
            self._count("kv_timeouts")
            raise _TimedOut(str(exc)) from None
        except KVTransferError as exc:
            self._count("kv_errors")
            raise _TRANS_ERRORS.get(exc.reason, BadGateway)(str(exc)) from None
        except zmq.ZMQError as exc:
            raise BadRequest(f"kv_transfer_params.remote_url {p.remote_url!r}: {exc}") from None

    def _quarantine(self, ids: list[int]) -> None:
        def release() -> None:
            with self._lock:
                self._quarantined -= len(ids)
                self._timers.discard(timer)
            self.blocks.free(ids)

        timer = threading.Timer(self.quarantine_s, release)
        timer.daemon = True
        with self._lock:
            self._quarantined += len(ids)
            self._timers.add(timer)
        timer.start()

    # ---- generation ----
    def admit(self, req: DecodeRequest, cache: DynamicCache, spans: list[Span],
              emit: Callable[[Any], None]) -> _Generation:
        """Emit token 0 and queue the rest with the scheduler."""
        p = req.kv_transfer_params
        generator = None
        if req.temperature > 0:
            generator = torch.Generator()
            if req.seed is None:
                generator.seed()
            else:
                generator.manual_seed(req.seed)
        gen = _Generation(req.request_id, cache, p.prompt_len + p.rope_delta, req.max_tokens, req.temperature,
                          generator, emit, [p.first_token], spans, [] if req.return_logits else None)
        self._count("requests_admitted", tokens_generated=1)
        emit(p.first_token)
        if req.max_tokens == 1:
            self._count("requests_finished")
            emit(_DONE)
            return gen
        with self._cond:
            self._active.append(gen)
            self._cond.notify()
        return gen

    def _schedule(self) -> None:
        """One step of every active request per turn, in batches of at most `max_batch`."""
        while True:
            with self._cond:
                while not self._active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    batch, self._active = self._active, []
                    for gen in batch:
                        gen.emit(RuntimeError("the decode server is shutting down"))
                    return
                batch = list(self._active)
            finished = [gen for gen in batch if gen.cancelled]
            self._count(requests_cancelled=len(finished))
            live = [gen for gen in batch if not gen.cancelled]
            for start in range(0, len(live), self.settings.max_batch):
                finished += self._step(live[start:start + self.settings.max_batch])
            if finished:
                with self._cond:
                    self._active = [g for g in self._active if g not in finished]
                for gen in finished:
                    gen.cache = None  # the KV copy goes now, not when the handler's frame does

    def _step(self, batch: list[_Generation]) -> list[_Generation]:
        """One decode step of every request in `batch` (one forward): feed each its last token, emit the next.

        Returns the requests that ended: those with all their tokens, and failed ones (all of them when the
        forward fails). Their decode_step spans share the forward's start.
        """
        t0 = time.monotonic_ns()
        try:
            if len(batch) == 1:  # `step`: a lone request's logits stay exactly the single-request ones
                gen = batch[0]
                logits = self.runner.step(gen.tokens[-1], gen.cache, gen.next_position + len(gen.tokens) - 1)
            else:
                logits = self.runner.step_batch([gen.tokens[-1] for gen in batch], [gen.cache for gen in batch],
                                                [gen.next_position + len(gen.tokens) - 1 for gen in batch])
            # one copy off the GPU per forward (none for float32 on the CPU): the tokens are chosen on the host,
            # where the requests' seeded generators are; float32 holds float32 and bfloat16 logits exactly
            logits = logits.float().cpu()
        except Exception as exc:  # noqa: BLE001 - its requests fail, the scheduler keeps going
            self._count(requests_failed=len(batch))
            for gen in batch:
                gen.emit(exc)
            return batch
        self._count("decode_forwards")
        ended: list[_Generation] = []
        for gen, row in zip(batch, logits):
            try:
                token = self._choose(gen, row)
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                ended.append(gen)
                self._count("requests_failed")
                gen.emit(exc)
                continue
            gen.tokens.append(token)
            if gen.logits is not None:
                gen.logits.append(row)
            gen.spans.append(Span(gen.rid, len(gen.tokens) - 1, "decode_step", self.node, t0, time.monotonic_ns()))
            self.recorder.add(gen.spans[-1])
            self._count(tokens_generated=1)
            gen.emit(token)
            if len(gen.tokens) >= gen.max_tokens:
                ended.append(gen)
                self._count("requests_finished")
                gen.emit(_DONE)
        return ended

    @staticmethod
    def _choose(gen: _Generation, logits: torch.Tensor) -> int:
        """The next token from one request's logits [vocab]: argmax, or a draw from its seeded generator."""
        if gen.generator is None:
            return int(logits.argmax(-1))
        return int(torch.multinomial(sampling_probs(logits, gen.temperature), 1, generator=gen.generator))

    # ---- health, metrics, lifetime ----
    def _count(self, *names: str, **amounts: int) -> None:
        with self._lock:
            for name in names:
                self.counters[name] += 1
            for name, amount in amounts.items():
                self.counters[name] += amount

    def health(self) -> dict:
        with self._lock:
            active, quarantined, counters = len(self._active), self._quarantined, dict(self.counters)
        return {"status": "ok", "role": "decode", "model": self.settings.model or "tiny-qwen2-vl",
                "device": str(self.device), "dtype": self.settings.dtype, "session_id": self.engine.session_id,
                "num_blocks": self.blocks.num_blocks, "free_blocks": self.blocks.num_free_blocks,
                "used_blocks": self.blocks.num_used_blocks, "quarantined_blocks": quarantined,
                "block_size": self.cache.block_size, "active_requests": active,
                "max_batch": self.settings.max_batch, "kv_producers_guarded": bool(self.settings.kv_producers),
                "admission": self.admission.stats(), "counters": counters}

    def metric_families(self) -> list[Metric]:
        """The decode's ``/metrics`` families: its KV blocks, requests and tokens, the consumer's counters."""
        h = self.health()
        c = collections.Counter(h["counters"])
        return [Metric.of(name, kind, help_, value) for name, kind, value, help_ in (
            ("kv_blocks_free", "gauge", h["free_blocks"], "KV blocks free"),
            ("kv_blocks_used", "gauge", h["used_blocks"], "KV blocks held (receiving or quarantined)"),
            ("kv_blocks_quarantined", "gauge", h["quarantined_blocks"], "blocks of timed-out transfers, resting"),
            ("active_requests", "gauge", h["active_requests"], "requests generating"),
            ("requests_finished_total", "counter", c["requests_finished"], "requests that got all their tokens"),
            ("requests_cancelled_total", "counter", c["requests_cancelled"], "requests whose client went away"),
            ("requests_failed_total", "counter", c["requests_failed"], "requests that failed while generating"),
            ("tokens_generated_total", "counter", c["tokens_generated"], "tokens emitted"),
            ("decode_forwards_total", "counter", c["decode_forwards"], "decode steps run (each one forward)"),
            ("kv_errors_total", "counter", c["kv_errors"], "KV transfers answered TRANS_ERROR"),
            ("kv_timeouts_total", "counter", c["kv_timeouts"], "KV transfers without an answer in time"),
            ("kv_bytes_total", "counter", c["kv_bytes"], "KV bytes received"),
        )] + self.admission.metric_families() + engine_metrics(self.engine)

    def close(self) -> None:
        """Fail the active requests, stop the scheduler, free quarantined blocks, close cache and engine."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            timers = list(self._timers)
        self._thread.join()
        self.io.shutdown(wait=True, cancel_futures=True)
        self.consumer.close()
        for timer in timers:
            timer.cancel()
        self.cache.close()
        self.engine.close()


def _line(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg) + b"\n"


class _GenerationStream(StreamingResponse):
    """A streaming response that cancels its generation however the response ends: also when the client went
    away before the body generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, gen: _Generation, content: AsyncIterator[bytes], on_end: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._gen, self._on_end = gen, on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.cancelled = True
            self._on_end()


def create_app(settings: DecodeSettings) -> FastAPI:
    """The decode server's app; the model loads and the cache registers in its lifespan."""

    app = role_app("decode", lambda: DecodeServer(settings), ("/v1/decode",))

    @app.post("/v1/decode")
    async def decode(request: Request) -> Response:
        server: DecodeServer = app.state.server
        # queued, or refused, before its body is read; a waiting request holds no KV (prefill keeps it meanwhile)
        ticket = await server.admission.enter(deadline_budget(request.headers, server.settings.timeout))
        streaming = False
        try:
            response = await _decode(server, request, ticket.leave)
            streaming = isinstance(response, _GenerationStream)  # admitted until its stream ends
            return response
        finally:
            if not streaming:
                ticket.leave()

    async def _decode(server: DecodeServer, request: Request, _stream_ended: Callable[[], None]) -> Response:
        req = await read_struct(request, DecodeRequest)
        loop = asyncio.get_running_loop()
        cache, kv_spans, params = await loop.run_in_executor(server.io, server.fetch_kv, req)
        req = msgspec.structs.replace(req, kv_transfer_params=params)  # a pipelined one's, completed
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        gen = server.admit(req, cache, kv_spans, emit)
        del cache
        if req.stream:
            return _GenerationStream(gen, _stream(gen, queue), _stream_ended, media_type="application/x-ndjson")
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise ServingError(f"decode failed: {type(item).__name__}: {item}")
        finally:
            gen.cancelled = True  # a no-op once it finished; stops it if this handler was cancelled
        logits = [row.tolist() for row in gen.logits] if gen.logits is not None else None
        return Response(encode(DecodeResponse(req.request_id, list(gen.tokens), "length", gen.spans, logits)),
                        media_type="application/json")

    async def _stream(gen: _Generation, queue: asyncio.Queue) -> AsyncIterator[bytes]:
        # A client that goes away cancels this generator (Starlette listens for http.disconnect): the finally
        # marks the request cancelled and the scheduler drops it before its next step.
        try:
            index = 0
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, Exception):
                    yield _line(StreamError(f"decode failed: {type(item).__name__}: {item}"))
                    return
                yield _line(StreamToken(item, index))
                failpoint("decode.mid_stream")
                index += 1
            yield _line(StreamDone("length", gen.spans))
        finally:
            gen.cancelled = True

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM."""
    return serve_main(DecodeSettings, create_app, argv, "python -m epd_lab.servers.decode",
                      "the EPD decode server")


if __name__ == "__main__":
    sys.exit(main())
