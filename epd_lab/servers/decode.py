"""The decode server (D of EPD): the KV consumer of seed 003, then generation.

``POST /v1/decode`` (`DecodeRequest` → `DecodeResponse`, or NDJSON with ``"stream": true``):

1. Allocate the prompt's blocks, ask the producer named by ``kv_transfer_params.remote_url`` (every rank of a
   prefill TP group: ``remote_urls``) to write its KV into them over the ZMQ side channel
   (`KVConsumer.receive_kv_group`). The KV stays in those blocks, and the generated
   tokens' KV joins it in blocks taken as needed, until the request ends: the model runtime (``--runtime``)
   attends over it where it lies, so ``--kv-blocks`` bounds decode's live KV. Every block a request takes comes
   out of its reservation (admission, below), so none finds the pool empty. ``TRANS_ERROR`` → by its reason (no such
   request on the producer 404, aborted 409, producer busy 503, else 502), no answer within ``--timeout``
   (producer dead or stuck), or by the request's deadline when that comes first (``X-EPD-KV-Deadline-Ms``, the
   proxy's: what is left of the client's deadline; at least `KV_ASK_FLOOR_S` after the ask) → 504, with the
   connector's message.
   After a timeout the blocks are quarantined for ``--kv-quarantine`` seconds before they go back to the pool:
   a producer that was only slow may still write into them.
2. Generate (`epd_lab.servers.scheduler`): token 0 is prefill's ``first_token``; token i+1 comes from the logits
   of feeding token i at ``prompt_len + rope_delta + i``, greedy at temperature 0, else sampled from
   ``softmax(logits / temperature)`` with the noise of ``seed`` and i+1 (`epd_lab.models.sampling`: prefill drew
   token 0 with the same seed, so a seeded answer equals the monolithic model's; no seed: a random one).

Concurrency: ONE scheduler thread owns the runtime's decode; each turn it steps every active request once, in
batches of at most ``--max-batch`` (one forward each). Batched logits equal single-request ones bit for bit in
bfloat16 on the CPU; in float32 they differ in the last bits (CPU GEMM sums a batch in another order); on a GPU a
request's bits depend on the batch bucket its step is replayed in (`epd_lab.models.runtime.graph`).
``--max-batch 1`` is the round-robin of single steps. KV transfers run in other threads meanwhile. A streaming
client that disconnects marks its request cancelled; the scheduler drops it (and frees its blocks) before its
next step.

Admission (`epd_lab.serving.Admission`), twice, each waiting while its predicted wait fits the request's deadline
(``X-EPD-Deadline-Ms``, else ``--timeout``, counted from arrival) and refusing with 503, ``Retry-After`` and the
predicted wait when it does not; ``--max-queued`` bounds each queue:

- ``--max-active`` requests at once, each until its stream ends; the others wait before their body is read.
- KV (``kv_admission``): once the body (and a pipelined request's prompt length) is known, the request reserves
  every block it may ever hold, ``blocks_needed(prompt_len + max_tokens - 1)`` (its prompt's KV, and that of
  each token it feeds back: the last one is never fed), and is let on to its KV transfer only when that fits
  beside the other reservations in ``--kv-blocks``; a request that needs more than the whole pool is a 400. It
  waits holding no KV (prefill keeps it) and its reservation returns when its last block does (a timed-out
  transfer's after its quarantine). Worst-case, not vLLM's grow-and-preempt: decode has no preemption (its KV
  cannot be recomputed here), so an admitted request must never meet an empty pool; the price is that a request
  asking for many more tokens than it uses holds blocks it leaves empty.

Errors, always ``{"detail": "..."}``: bad JSON / unknown field / inconsistent params / more KV than the pool 400,
body too large 413, overloaded 503, TRANS_ERROR 404/409/503/502 by its reason, timeout 504. An error after
streaming began is a last NDJSON line `StreamError` (``{"type": "error", "detail": "..."}``).

``GET /health`` (blocks free/used/quarantined/reserved, active requests, max batch, counters: ``decode_forwards`` counts
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
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd_lab import models
from epd_lab.ep.messages import DTYPES
from epd_lab.failpoints import failpoint
from epd_lab.kv import BlockManager, KVConsumer, KVTransferError, PagedKVCache, blocks_needed
from epd_lab.kv.connector import KVTransferTimeout
from epd_lab.kv.messages import TransDone
from epd_lab.kv.tp_plan import KVLayout
from epd_lab.models.runtime import open_runtime
from epd_lab.models.sampling import request_seed
from epd_lab.servers.messages import (
    DecodeRequest,
    DecodeResponse,
    KVTransferParams,
    StreamDone,
    StreamError,
    StreamToken,
    encode,
)
from epd_lab.servers.decode_tp import DecodeTPGroup
from epd_lab.servers.scheduler import DONE, DecodeScheduler, Generation
from epd_lab.serving import (KV_DEADLINE_HEADER, Admission, BadGateway, BadRequest, Conflict, Forbidden,
                             GatewayTimeout, Metric, NotFound, RoleMetrics, ServingError, Unavailable,
                             deadline_budget, engine_auth_failures, engine_metrics, option, read_struct, role_app,
                             serve_main)
from epd_lab.serving.metrics import REQUEST_BUCKETS, STAGE_BUCKETS
from epd_lab.models.catalog import use_device
from epd_lab.servers.model_settings import PagedKVSettings, check_transport, transport_option
from epd_lab.serving.settings import check_at_least, check_positive
from epd_lab.serving.stream import ClosingStreamingResponse
from epd_lab.trace import Recorder, Span
from epd_lab.transfer import open_engine

T = TypeVar("T")

# a TRANS_ERROR's reason as decode's answer (any other: 502): the producer holds no such request (never prefilled
# there, or freed after its free timeout), the request was aborted, the producer is at one of its bounds
_TRANS_ERRORS: dict[str, Callable[[str], ServingError]] = {
    "not_found": NotFound, "aborted": Conflict, "busy": lambda detail: Unavailable(detail, retry_after=1)}


# A request's KV deadline bounds decode's wait for the producer, but an ask gets at least this long: a live
# producer answers an ask for finished KV in milliseconds, so a request that reaches decode at its deadline's end
# is served late rather than failed (as the proxy's decode leg is never refused for its deadline), and one whose
# producer died fails at most this long after the ask.
KV_ASK_FLOOR_S = 1.0


class _TimedOut(GatewayTimeout):
    """The producer did not answer in time (504): blocks it was asked to write into are quarantined."""


@dataclasses.dataclass(slots=True, frozen=True)
class DecodeSettings(PagedKVSettings):
    """What a decode server is started with; checked on construction (`ValueError`)."""

    transport: str = transport_option("KV consumer")
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
    tp: int = option(1, "tensor-parallel ranks: this server is rank 0 and starts the others, each with its own KV "
                        "cache of its KV heads and its own KV consumer (servers.decode_tp); CPU (gloo) only")

    def __post_init__(self) -> None:
        PagedKVSettings.__post_init__(self)
        check_transport(self)
        check_at_least(self, 1, "max_batch", "max_active")
        check_at_least(self, 0, "max_queued")
        check_positive(self, "timeout")
        if self.kv_quarantine is not None:
            check_at_least(self, 0, "kv_quarantine")
        check_at_least(self, 1, "tp")
        if self.tp > 1 and (self.runtime != "fast" or self.device != "cpu"):
            raise ValueError(f"--tp {self.tp} needs --runtime fast on --device cpu (its ranks meet over gloo; NCCL "
                             f"needs one GPU a rank)")


class DecodeServer:
    """The decode role's state: model, registered paged cache, blocks, KV consumer, runtime, scheduler."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        models.configure_torch(threads=1)  # bit-identity with prefill
        dtype = DTYPES[settings.dtype]
        self.device = use_device(settings.device)
        self.model = models.open_model(settings.model, dtype=dtype, device=self.device)
        self.recorder = Recorder(node=f"decode:{settings.port}")
        self.node = self.recorder.node
        self.metrics = RoleMetrics("decode", settings.model_name)
        self.decode_time = self.metrics.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in "
                                                  "DECODE phase for request (token 0 emitted to the last).",
                                                  REQUEST_BUCKETS)
        self.kv_transfer_time = self.metrics.histogram("epd_lab:kv_transfer_seconds", "Histogram of the time a "
                                                       "request's KV took to arrive from prefill (asked to "
                                                       "TRANS_DONE).", STAGE_BUCKETS)
        self.engine = open_engine(settings.transport, settings.host, settings.timeout)
        self.tp_group = None
        try:
            # TP > 1: the other ranks start loading now, beside this rank's own cache
            self.tp_group = DecodeTPGroup(self.model, settings, self.node) if settings.tp > 1 else None
            self.cache = PagedKVCache.from_config(self.model.config, num_blocks=settings.kv_blocks,
                                                  block_size=settings.block_size, dtype=dtype, engine=self.engine,
                                                  device=self.device, tp_size=settings.tp)
        except BaseException:
            self._close_group()
            self.engine.close()
            raise
        try:  # the fast runtime captures decode for batches up to max_batch; hf has no buckets
            options = {"max_batch": settings.max_batch} if settings.runtime == "fast" else {}
            if self.tp_group is not None:
                options["tp"] = self.tp_group.join()
            self.runtime = open_runtime(settings.runtime, self.model, self.cache, **options)
        except BaseException:
            self._close_group()
            self.cache.close()
            self.engine.close()
            raise
        self.blocks = BlockManager(settings.kv_blocks)
        layout = KVLayout(self.model.config.text_config.num_key_value_heads, settings.tp, 0)
        self.consumer = KVConsumer(self.engine, self.cache, timeout=settings.timeout, layout=layout)
        self.quarantine_s = settings.timeout if settings.kv_quarantine is None else settings.kv_quarantine
        self.counters: collections.Counter[str] = collections.Counter()
        self._quarantined = 0
        self._timers: set[threading.Timer] = set()
        self._lock = threading.Lock()
        self.admission = Admission("decode", settings.max_active, settings.max_queued, settings.timeout)
        self.io = ThreadPoolExecutor(32, thread_name_prefix="decode-kv")  # KV transfers wait here, not the loop
        # decode's second admission, after the body: a request's reservation (`reservation`) out of the pool
        self.kv_admission = Admission("decode KV", settings.kv_blocks, settings.max_queued, settings.timeout,
                                      prefix="kv_admission_", unit="blocks")
        self.scheduler = DecodeScheduler(self.tp_group.mirrored(self.runtime) if self.tp_group else self.runtime,
                                         settings.max_batch, self.blocks.allocate, self.recorder,
                                         self._count, lambda gen: self.release(gen.block_table, gen.released))

    # ---- KV ----
    def plan_kv(self, req: DecodeRequest, due: float | None) -> tuple[int, int, list[Span]]:
        """The prompt's length and blocks (in a worker thread: a pipelined request asks its producer, which
        answers once prefill knows them, by `due`, its KV deadline: see `_ask_within`) and the spans so far;
        raises `ServingError`."""
        p = req.kv_transfer_params
        if self.settings.kv_producers and not set(_producers(p)) <= set(self.settings.kv_producers):
            # checked before any socket opens: decode never sends its cache's addresses and keys elsewhere
            self._count("kv_producers_refused")
            raise Forbidden("kv_transfer_params names a side channel that is not a producer this decode server was "
                            "told about")
        spans: list[Span] = []
        prompt_len, num_blocks = p.prompt_len, p.num_blocks
        if p.pipelined:  # the prompt's size comes from the producer, as soon as prefill knows it
            t0 = time.monotonic_ns()
            plan = self._kv_call(p, lambda: self.consumer.query(p.remote_url, p.remote_request_id,
                                                                 _ask_within(due)))
            spans.append(Span(req.request_id, -1, "kv_query", self.node, t0, time.monotonic_ns()))
            prompt_len, num_blocks = plan.prompt_len, plan.num_blocks
        n = blocks_needed(prompt_len, self.cache.block_size)
        if num_blocks != n:
            raise BadRequest(f"kv_transfer_params: {prompt_len} tokens take {n} blocks of "
                                 f"{self.cache.block_size}, not {num_blocks} (prefill's block size differs?)")
        return prompt_len, num_blocks, spans

    def reservation(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a request may ever hold: its prompt's and those its tokens after the first store (the last
        token is emitted, never fed), reserved whole at admission so that it never finds the pool empty."""
        return blocks_needed(prompt_len + max_tokens - 1, self.cache.block_size)

    def fetch_kv(self, req: DecodeRequest, prompt_len: int, num_blocks: int, spans: list[Span],
                 give_back: Callable[[], None], due: float | None) -> tuple[list[int], list[Span], KVTransferParams]:
        """Receive the request's KV (in a worker thread, by `due`: see `_ask_within`) into `num_blocks` blocks
        allocated for it, out of its reservation (`give_back` returns that, once the blocks are back); raises
        `ServingError`. Returns the blocks (the caller owns them now: `admit` them, or `release` them), the spans
        and the parameters complete (a pipelined request's learnt from the producer)."""
        p = req.kv_transfer_params
        # the reservations fit in the pool, and the quarantined blocks keep theirs: no OutOfBlocks here
        ids = self.blocks.allocate(num_blocks)
        t0 = time.monotonic_ns()
        quarantine = kept = False
        try:
            try:
                done = self._kv_call(p, lambda: self._receive_kv(p, ids, _ask_within(due)))
            except _TimedOut:
                quarantine = True  # the producer may still write into them
                raise
            if p.pipelined:
                if not done.aux:
                    raise BadGateway(f"TRANS_DONE for {p.remote_request_id!r} came without the first token")
                p = msgspec.structs.replace(p, prompt_len=prompt_len, num_blocks=num_blocks,
                                            first_token=done.aux[0].first_token, rope_delta=done.aux[0].rope_delta)
            nbytes = self.cache.nbytes(num_blocks)
            t_done = time.monotonic_ns()
            self.kv_transfer_time.observe((t_done - t0) / 1e9)
            spans.append(Span(req.request_id, -1, "kv_transfer", self.node, t0, t_done, nbytes))
            self.recorder.extend(spans)
            self._count(kv_bytes=nbytes)
            kept = True
            return ids, spans, p
        finally:
            if quarantine and self.quarantine_s > 0:
                self._quarantine(ids, give_back)
            elif not kept:
                self.release(ids, give_back)

    def _receive_kv(self, p: KVTransferParams, ids: list[int], timeout: float | None) -> TransDone:
        """The request's KV from every rank of its prefill into `ids`: on this rank alone, or on every rank of
        this decode's TP group at once."""
        if self.tp_group is None:
            return self.consumer.receive_kv_group(_producers(p), p.remote_request_id, ids, timeout)
        return self.tp_group.receive_kv(self.consumer, _producers(p), p.remote_request_id, ids, timeout)

    def _close_group(self) -> None:
        if self.tp_group is not None:
            self.tp_group.close()

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

    def _quarantine(self, ids: list[int], give_back: Callable[[], None]) -> None:
        def release() -> None:
            with self._lock:
                self._quarantined -= len(ids)
                self._timers.discard(timer)
            self.release(ids, give_back)

        timer = threading.Timer(self.quarantine_s, release)
        timer.daemon = True
        with self._lock:
            self._quarantined += len(ids)
            self._timers.add(timer)
        timer.start()

    # ---- generation ----
    def admit(self, req: DecodeRequest, block_table: list[int], spans: list[Span], emit: Callable[[Any], None],
              give_back: Callable[[], None]) -> Generation:
        """Emit token 0 and queue the rest with the scheduler, which frees `block_table` (the prompt's blocks,
        its KV in them, from `fetch_kv`) and the blocks it adds when the request ends, then calls `give_back`
        (the request's KV reservation)."""
        p = req.kv_transfer_params
        gen = Generation(req.request_id, block_table, p.prompt_len, p.prompt_len + p.rope_delta, req.max_tokens,
                         req.temperature, request_seed(req.seed), emit, [p.first_token],
                         spans,
                         [] if req.return_logits else None, released=give_back)
        self._count("requests_admitted", tokens_generated=1)
        emit(p.first_token)
        if req.max_tokens == 1:
            self._count("requests_finished")
            emit(DONE)
            self.release(block_table, give_back)
            return gen
        try:
            self.scheduler.add(gen)
        except RuntimeError as exc:  # closing
            self.release(block_table, give_back)
            emit(exc)
        return gen

    def release(self, block_table: list[int], give_back: Callable[[], None]) -> None:
        """Give back the blocks of a request that will not generate (anymore), then its reservation."""
        self.blocks.free(block_table)
        give_back()

    # ---- health, metrics, lifetime ----
    def _count(self, *names: str, **amounts: int) -> None:
        with self._lock:
            for name in names:
                self.counters[name] += 1
            for name, amount in amounts.items():
                self.counters[name] += amount

    def health(self) -> dict:
        active = self.scheduler.num_active
        with self._lock:
            quarantined, counters = self._quarantined, dict(self.counters)
        dead = self.tp_group.dead_ranks if self.tp_group is not None else []
        return {"status": "ok" if not dead else f"TP rank(s) {dead} dead", "role": "decode", "tp": self.settings.tp,
                "model": self.settings.model_name,
                "device": str(self.device), "dtype": self.settings.dtype, "session_id": self.engine.session_id,
                "num_blocks": self.blocks.num_blocks, "free_blocks": self.blocks.num_free_blocks,
                "used_blocks": self.blocks.num_used_blocks, "quarantined_blocks": quarantined,
                "block_size": self.cache.block_size, "active_requests": active, "runtime": self.settings.runtime,
                "max_batch": self.settings.max_batch, "kv_producers_guarded": bool(self.settings.kv_producers),
                "reserved_blocks": self.kv_admission.running, "admission": self.admission.stats(),
                "kv_admission": self.kv_admission.stats(), "counters": counters}

    def metric_families(self) -> list[Metric]:
        """The decode's ``/metrics`` families: vLLM's decode time, requests running and waiting, KV usage and tokens;
        the KV transfer's time; its KV blocks, requests and tokens, the consumer's counters, its two
        admissions and its engine."""
        h, m = self.health(), self.metrics
        c = collections.Counter(h["counters"])
        return [
            *m.instruments(),
            m.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    h["active_requests"]),
            m.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed (either admission's "
                    "queue).", self.admission.queued + self.kv_admission.queued),
            m.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    h["used_blocks"] / h["num_blocks"]),
            m.counter("vllm:generation_tokens", "Number of generation tokens processed.", c["tokens_generated"]),
            *(m.of(name, kind, help_, value) for name, kind, value, help_ in (
                ("kv_blocks_free", "gauge", h["free_blocks"], "KV blocks free"),
                ("kv_blocks_used", "gauge", h["used_blocks"], "KV blocks held (receiving, generating or quarantined)"),
                ("kv_blocks_quarantined", "gauge", h["quarantined_blocks"], "blocks of timed-out transfers, resting"),
                ("kv_blocks_reserved", "gauge", h["reserved_blocks"], "blocks the admitted requests may hold "
                 "(prompt + max_tokens - 1 tokens each; a quarantined request's until its blocks are back)"),
                ("active_requests", "gauge", h["active_requests"], "requests generating"),
                ("requests_finished", "counter", c["requests_finished"], "requests that got all their tokens"),
                ("requests_cancelled", "counter", c["requests_cancelled"], "requests whose client went away"),
                ("requests_failed", "counter", c["requests_failed"], "requests that failed while generating"),
                ("tokens_generated", "counter", c["tokens_generated"], "tokens emitted"),
                ("decode_forwards", "counter", c["decode_forwards"], "decode steps run (each one forward)"),
                ("tp_ranks", "gauge", self.settings.tp, "tensor-parallel ranks of this decode (rank 0 serves and "
                 "reports for the group)"),
                ("tp_dead_ranks", "gauge", len(self.tp_group.dead_ranks) if self.tp_group else 0,
                 "ranks of this decode's TP group found dead"),
                ("kv_errors", "counter", c["kv_errors"], "KV transfers answered TRANS_ERROR"),
                ("kv_timeouts", "counter", c["kv_timeouts"], "KV transfers without an answer in time"),
                ("kv_bytes", "counter", c["kv_bytes"], "KV bytes received"),
            )),
            *self.admission.metric_families(m), *self.kv_admission.metric_families(m),
            *engine_metrics(m, self.engine),
        ]

    def refusals(self) -> dict[str, float]:
        """Its two admissions' refusals (``admission_<reason>``, ``kv_admission_<reason>``), side channels it was
        not told of (``kv_producers_refused``) and peers refused at its engine's port (``transfer_auth``)."""
        return {**{f"admission_{reason}": n for reason, n in self.admission.refused.items()},
                **{f"kv_admission_{reason}": n for reason, n in self.kv_admission.refused.items()},
                "kv_producers_refused": self.counters["kv_producers_refused"],
                "transfer_auth": engine_auth_failures(self.engine)}

    def close(self) -> None:
        """Fail the active requests, stop the scheduler, free quarantined blocks, close cache and engine."""
        self.scheduler.close()
        with self._lock:
            timers = list(self._timers)
        self.io.shutdown(wait=True, cancel_futures=True)
        self.consumer.close()
        for timer in timers:
            timer.cancel()
        self._close_group()
        self.cache.close()
        self.engine.close()


def _producers(p: KVTransferParams) -> list[str]:
    """The side channels to ask for a request's KV: every rank of a prefill TP group, or its one producer."""
    return p.remote_urls or [p.remote_url]


def _ask_within(due: float | None) -> float | None:
    """How long an ask to the producer may wait for its answer: until `due` (a `time.monotonic()`, the request's
    KV deadline), but at least `KV_ASK_FLOOR_S`; None (no deadline sent): the consumer's own timeout."""
    return None if due is None else max(due - time.monotonic(), KV_ASK_FLOOR_S)


def _line(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg) + b"\n"


def create_app(settings: DecodeSettings) -> FastAPI:
    """The decode server's app; the model loads and the cache registers in its lifespan."""

    app = role_app("decode", lambda: DecodeServer(settings), ("/v1/decode",))

    @app.post("/v1/decode")
    async def decode(request: Request) -> Response:
        server: DecodeServer = app.state.server
        # queued, or refused, before its body is read; a waiting request holds no KV (prefill keeps it meanwhile)
        arrived = time.monotonic()
        budget = deadline_budget(request.headers, server.settings.timeout)
        due = arrived + budget
        # its KV is due by the sender's KV deadline, counted from arrival (a little early, never late)
        kv_due = (arrived + deadline_budget(request.headers, 0.0, KV_DEADLINE_HEADER)
                  if KV_DEADLINE_HEADER.lower() in request.headers else None)
        ticket = await server.admission.enter(budget)
        streaming = False
        try:
            response = await _decode(server, request, ticket.leave, due, kv_due)
            streaming = isinstance(response, ClosingStreamingResponse)  # admitted until its stream ends
            return response
        finally:
            if not streaming:
                ticket.leave()

    async def _decode(server: DecodeServer, request: Request, _stream_ended: Callable[[], None],
                      due: float, kv_due: float | None) -> Response:
        req = await read_struct(request, DecodeRequest)
        loop = asyncio.get_running_loop()
        prompt_len, num_blocks, spans = await loop.run_in_executor(server.io, server.plan_kv, req, kv_due)
        # the second admission: its whole reservation fits in the pool, or it waits (holding no KV: prefill keeps
        # it) while that is predicted within its deadline, else 503 now
        kv_ticket = await server.kv_admission.enter(due - time.monotonic(),
                                                    server.reservation(prompt_len, req.max_tokens))

        def give_back() -> None:  # from whichever thread frees the request's last blocks
            try:
                loop.call_soon_threadsafe(kv_ticket.leave)
            except RuntimeError:  # the loop is gone (shutdown): nobody is waiting
                pass

        try:
            fetch = server.io.submit(server.fetch_kv, req, prompt_len, num_blocks, spans, give_back, kv_due)
        except RuntimeError:  # the pool is shut down (closing)
            kv_ticket.leave()
            raise
        try:
            block_table, kv_spans, params = await asyncio.wrap_future(fetch)
        except asyncio.CancelledError:  # the client left: blocks the transfer still fills are given back after
            def settle(f: Any) -> None:  # a failed fetch gave its blocks and reservation back already
                if f.cancelled():
                    give_back()
                elif f.exception() is None:
                    server.release(f.result()[0], give_back)

            fetch.add_done_callback(settle)
            raise
        req = msgspec.structs.replace(req, kv_transfer_params=params)  # a pipelined one's, completed
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        t_first = time.monotonic()  # token 0 is emitted at admission: decode's phase starts
        gen = server.admit(req, block_table, kv_spans, emit, give_back)
        if req.stream:
            async def ended() -> None:  # also when the client left before the body generator ever started
                gen.cancelled = True
                _stream_ended()
            return ClosingStreamingResponse(_stream(gen, queue, t_first), ended, media_type="application/x-ndjson")
        try:
            while (item := await queue.get()) is not DONE:
                if isinstance(item, Exception):
                    raise ServingError(f"decode failed: {type(item).__name__}: {item}")
        finally:
            gen.cancelled = True  # a no-op once it finished; stops it if this handler was cancelled
        server.decode_time.observe(time.monotonic() - t_first)
        logits = [row.tolist() for row in gen.logits] if gen.logits is not None else None
        return Response(encode(DecodeResponse(req.request_id, list(gen.tokens), "length", gen.spans, logits)),
                        media_type="application/json")

    async def _stream(gen: Generation, queue: asyncio.Queue, t_first: float) -> AsyncIterator[bytes]:
        # A client that goes away cancels this generator (Starlette listens for http.disconnect): the finally
        # marks the request cancelled and the scheduler drops it before its next step.
        try:
            index = 0
            while (item := await queue.get()) is not DONE:
                if isinstance(item, Exception):
                    yield _line(StreamError(f"decode failed: {type(item).__name__}: {item}"))
                    return
                yield _line(StreamToken(item, index))
                failpoint("decode.mid_stream")
                index += 1
            app.state.server.decode_time.observe(time.monotonic() - t_first)
            yield _line(StreamDone("length", gen.spans))
        finally:
            gen.cancelled = True

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM."""
    return serve_main(DecodeSettings, create_app, argv, "python -m epd_lab.servers.decode",
                      "the EPD decode server")


if __name__ == "__main__":
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
