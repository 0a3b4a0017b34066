"""The prefill server (P of EPD): E→P through the encoders, then the KV producer of seed 003.

``POST /v1/prefill`` (`PrefillRequest` → `PrefillResponse`):

1. Images go through an `EmbeddingReceiver` to the encoders (`EPDPrefill.receive`). Without ``--encoders``
   images are refused (400).
2. The prompt's blocks are allocated in the paged cache (`BlockManager` + `PagedKVCache`, registered with the
   transfer engine once at start), and the model runtime's prefill (``--runtime``, `epd_lab.models.runtime`)
   writes the prompt's KV into them as it runs; ``producer.request_finished(request_id, block_ids)`` lets decode
   ask for them over the ZMQ side channel. The `KVProducer` frees the blocks after ``TRANS_DONE`` /
   ``TRANS_ERROR``, or after ``--kv-free-timeout`` if decode never asks. With ``--gated-prefill`` on a GPU (the
   fast runtime, mooncake), a request alone here has its forward queued as soon as the encoders answered
   /encode, behind a gate that the last part's notify opens (`epd_lab.models.runtime.gate`): the GPU starts
   before any thread here wakes.
3. The answer carries the first token (drawn from the last logits at the request's ``temperature`` and ``seed``
   as decode draws the others, greedy at 0: `epd_lab.models.sampling`) and the `KVTransferParams` decode needs.

``POST /v1/abort`` (`AbortRequest` → `AbortResponse`): the proxy gave up on a request (its decode failed, or its
client left before decode began). ``producer.abort`` frees its blocks now instead of after ``--kv-free-timeout``;
decode asking for it later gets ``TRANS_ERROR`` "aborted", and a prefill of it still running when the abort came
keeps nothing (answered 409). Idempotent; an unknown request_id is answered 200 with ``freed_blocks`` 0.

Admission (`epd_lab.serving.Admission`): ``--workers`` requests at once; the others wait, before their body is
read, while their predicted wait fits their deadline (``X-EPD-Deadline-Ms``, which the proxy sends, else
``--timeout``), and are refused with 503, ``Retry-After`` and the predicted wait when it does not;
``--max-queued`` bounds the queue.

Errors, always ``{"detail": "..."}``: bad JSON or an unknown field 400, a body over 64 MiB 413, an image an
encoder refuses 400 (the encoder's message), any other E→P failure 502, the KV pool exhausted until the
request's deadline (decode behind: waited on, as backpressure) 503, overloaded 503 (above), a request_id whose KV
is still waiting for decode, or that was aborted, 409.

``GET /health`` (JSON: blocks free/used, the producer's counters, ``max_prompt_tokens``, ``admission``),
``GET /metrics`` (Prometheus text).

Run: ``python -m epd_lab.servers.prefill --port 0 --encoders URL,URL`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd_lab import models
from epd_lab.ep.messages import BACKENDS, DTYPES
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.ep.receiver import (RECV_BUFFERS, EmbeddingReceiver, EPDError, Landing, ReceiverConfig,
                                 resolve_recv_buffer)
from epd_lab.kv import BlockManager, KVProducer, OutOfBlocks, PagedKVCache, blocks_needed
from epd_lab.kv.connector import AlreadyHeld, RequestAborted
from epd_lab.kv.messages import KVAux
from epd_lab.kv.tp_plan import KVLayout, side_channel_port
from epd_lab.models.runtime import Gate, PrefillOutput, PrefillPlan, open_runtime
from epd_lab.models.sampling import request_seed, sample
from epd_lab.servers.messages import (
    AbortRequest,
    AbortResponse,
    KVTransferParams,
    PrefillRequest,
    PrefillResponse,
    encode,
)
from epd_lab.servers.prefill_tp import PrefillTPGroup
from epd_lab.servers.text import prompt_tokens
from epd_lab.serving import (Admission, BadRequest, ClientClosed, Conflict, Metric, RoleMetrics, Unavailable,
                             client_gone, deadline_budget, decode_body, engine_auth_failures, engine_metrics,
                             error_for_status, option, read_body, read_struct, role_app, serve_main)
from epd_lab.serving.metrics import REQUEST_BUCKETS
from epd_lab.models.catalog import synchronize, use_device
from epd_lab.servers.model_settings import PagedKVSettings, check_transport, transport_option
from epd_lab.serving.settings import check_at_least, check_choice, check_positive, check_urls
from epd_lab.trace import Recorder, Span

KV_WAIT_POLL_S = 0.01  # how often a worker whose KV pool is exhausted looks again
from epd_lab.transfer import open_engine


@dataclasses.dataclass(slots=True, frozen=True)
class PrefillSettings(PagedKVSettings):
    """What a prefill server is started with; checked on construction (`ValueError`)."""

    encoders: tuple[str, ...] = option((), "encode servers' base URLs (none: text-only prompts)")
    backend: str = option("mooncake", "the E→P backend", choices=BACKENDS)
    transport: str = transport_option("E→P receiver and KV producer, an engine each")
    recv_buffer: str = option("auto", "where the E→P receiver's buffer for a request's embeddings lives: host, "
                                      "pinned (page-locked host memory, as the seed) or device (GPU memory); auto: "
                                      "pinned on CUDA, host on the CPU", choices=RECV_BUFFERS)
    gated_prefill: bool = option(False, "on a GPU, queue a lone request's forward before its embeddings land, behind a "
                                        "gate that its last notify opens (models.runtime.gate), when no other request "
                                        "is in flight here: 0.40-0.71 ms off a lone split request's TTFT on an H200; "
                                        "under load it keeps the requests/s but raised the TTFT p50 by 11-13 percent "
                                        "at 4 in flight (a forward queued behind a gate waits for that request's "
                                        "embeddings), hence off by default")
    timeout: float = option(10.0, "seconds: E→P per request, and the side channel's wait for a request not yet "
                                  "ready")
    kv_free_timeout: float = option(30.0, "seconds a prefilled KV waits for decode before its blocks are freed")
    workers: int = option(4, "prefills in flight at once")
    max_queued: int = option(1024, "requests waiting for a worker at most (a memory backstop): a request waits while "
                                   "its predicted wait fits its deadline (X-EPD-Deadline-Ms, else --timeout), and is "
                                   "refused with 503 at once when it does not (serving.admission)")
    service_prior: float = option(0.1, "seconds a prefill is assumed to take with every worker busy until one is "
                                       "measured: the admission's (and the proxy's) rate on a fresh server, "
                                       "which served requests only one at a time if at all (serving.admission)")
    tp: int = option(1, "tensor-parallel ranks: this server is rank 0 and starts the others, each with its own KV "
                        "cache of its KV heads and its own side channel (servers.prefill_tp); CPU (gloo) only")
    dp_rank: int = option(0, "this server's data-parallel rank among the prefills: its side channels' ports")
    side_channel_base: int = option(0, "the KV side channels' port base: rank r listens on base + dp_rank * tp + r "
                                       "(vLLM's VLLM_MOONCAKE_SIDE_CHANNEL_PORT, 6557 there); 0: ports from the OS")

    def __post_init__(self) -> None:
        PagedKVSettings.__post_init__(self)
        check_urls(self, "encoders", "encoder", required=False)  # none: text-only prompts
        check_choice(self, "backend", BACKENDS)
        check_transport(self)
        object.__setattr__(self, "recv_buffer", resolve_recv_buffer(self.recv_buffer, self.device))
        check_at_least(self, 0, "max_queued")
        check_at_least(self, 1, "workers")
        check_positive(self, "timeout", "kv_free_timeout", "service_prior")
        check_at_least(self, 1, "tp")
        check_at_least(self, 0, "dp_rank", "side_channel_base")
        if self.tp > 1 and (self.runtime != "fast" or self.device != "cpu" or self.gated_prefill):
            raise ValueError(f"--tp {self.tp} needs --runtime fast on --device cpu without --gated-prefill (its ranks "
                             f"meet over gloo; NCCL needs one GPU a rank)")
        side_channel_port(self.dp_rank, self.tp, self.tp - 1, self.side_channel_base)  # every rank's port in range


class _KeptKV:
    """One request's KV blocks on the prefill side: allocated (and, for remote decode, announced) before the
    forward, so that a pipelined decode allocates its own meanwhile; the forward writes the prompt's KV straight
    into them; then handed to the producer (remote decode), or given back (no remote decode, or the request
    failed: a decode waiting on the side channel is then answered ``TRANS_ERROR`` at once)."""

    def __init__(self, server: "PrefillServer", rid: str, remote: bool, deadline: float) -> None:
        self.server, self.rid, self.remote, self.deadline = server, rid, remote, deadline
        self.ids: list[int] | None = None
        self.readied = False
        self.conflict = False  # another request with this id holds KV on the producer: never abort that one

    def announce(self, input_ids: torch.Tensor) -> list[int]:
        """Allocate the prompt's blocks, announce its plan to the producer when decode is remote; returns the
        blocks (the forward's block table). A pool exhausted by KV that waits for decode is waited on until the
        request's deadline (503 then): decode behind is backpressure, which slows the workers, and with them the
        admission's measured rate, instead of failing requests already encoded."""
        server, prompt_len = self.server, input_ids.shape[1]
        n = blocks_needed(prompt_len, server.cache.block_size)
        while self.ids is None:
            try:
                self.ids = server.blocks.allocate(n)
            except OutOfBlocks as exc:
                if time.monotonic() >= self.deadline:
                    server.counters["kv_pool_exhausted"] += 1
                    raise Unavailable(f"KV pool exhausted: {exc}") from None
                time.sleep(KV_WAIT_POLL_S)
        if not self.remote:
            return self.ids
        try:
            server.producer.announce(self.rid, prompt_len, n)
        except RequestAborted:
            raise self._aborted() from None
        except AlreadyHeld:
            self.conflict = True
            raise Conflict(f"request_id {self.rid!r}: its KV is still waiting for decode") from None
        return self.ids

    def keep(self, result: PrefillOutput, first_token: int) -> KVTransferParams:
        """Hand the blocks, which the forward wrote, to the producer; the parameters decode needs."""
        server, ids = self.server, self.ids
        assert ids is not None, "announce() first"
        with server.recorder.span("kv_write", self.rid, nbytes=server.cache.nbytes(len(ids))):
            synchronize(server.device)  # the forward's writes into the blocks are done before a peer reads them
            try:
                server.producer.request_finished(self.rid, ids, KVAux(first_token, result.rope_delta))
            except RequestAborted:
                raise self._aborted() from None
        self.readied = True  # the producer frees the blocks from here on
        return KVTransferParams(server.producer.url, self.rid, result.prompt_len, result.rope_delta, first_token,
                                len(ids), server.kv_urls if server.tp_group is not None else None)

    def _aborted(self) -> Conflict:
        """The 409 for a request the proxy aborted (`/v1/abort`) while it was being prefilled, counted."""
        self.server.counters["aborted_while_prefilling"] += 1
        return Conflict(f"request_id {self.rid!r} was aborted while it was being prefilled")

    def drop(self) -> None:
        """Give the blocks back unless the producer holds them; for remote decode, abort the request on the
        producer, so that a pipelined decode already waiting for it hears at once (not at its timeout)."""
        if self.readied:
            return
        if self.ids is not None:
            self.server.blocks.free(self.ids)
            self.ids = None
        if self.remote and not self.conflict:
            self.server.abort_kv(self.rid)


class PrefillServer:
    """The prefill role's state: model, receiver, paged KV cache, block manager, KV producer, counters."""

    def __init__(self, settings: PrefillSettings) -> None:
        self.settings = settings
        models.configure_torch(threads=1)  # bit-identity with the encoders and decode
        dtype = DTYPES[settings.dtype]
        self.device = use_device(settings.device)
        self.model = models.open_model(settings.model, dtype=dtype, device=self.device)
        self.max_positions = self.model.config.text_config.max_position_embeddings
        self.recorder = Recorder(node=f"prefill:{settings.port}")
        self.metrics = RoleMetrics("prefill", settings.model_name)
        self.queue_time = self.metrics.histogram("vllm:request_queue_time_seconds", "Histogram of time spent "
                                                 "waiting for a prefill worker (admission's queue).", REQUEST_BUCKETS)
        self.prefill_time = self.metrics.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent "
                                                   "in PREFILL phase for request (the forward, once the embeddings "
                                                   "are in).", REQUEST_BUCKETS)
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self.engine = open_engine(settings.transport, settings.host, settings.timeout)
        self.cache = self.receiver = self.producer = self.tp_group = None
        try:
            # TP > 1: the other ranks start loading now, beside this rank's own cache and side channel
            self.tp_group = PrefillTPGroup(self.model, settings, self.recorder.node) if settings.tp > 1 else None
            self.cache = PagedKVCache.from_config(self.model.config, num_blocks=settings.kv_blocks,
                                                  block_size=settings.block_size, dtype=dtype, engine=self.engine,
                                                  device=self.device, tp_size=settings.tp)
            self.blocks = BlockManager(settings.kv_blocks)
            layout = KVLayout(self.model.config.text_config.num_key_value_heads, settings.tp, 0)
            self.producer = KVProducer(self.engine, self.cache, free_blocks=self.blocks.free, host=settings.host,
                                       port=side_channel_port(settings.dp_rank, settings.tp, 0,
                                                              settings.side_channel_base),
                                       timeout=settings.timeout, free_timeout=settings.kv_free_timeout, layout=layout)
            tp = self.tp_group.join() if self.tp_group is not None else None
            self.runtime = open_runtime(settings.runtime, self.model, self.cache, tp=tp)
            if settings.encoders:
                self.receiver = EmbeddingReceiver(
                    ReceiverConfig(settings.encoders, settings.backend, settings.timeout,
                                   host=settings.host, transport=settings.transport, buffer=settings.recv_buffer,
                                   device=str(self.device)), self.recorder)
        except BaseException:
            self.close()
            raise
        self.epd = EPDPrefill(self.receiver, self.model) if self.receiver is not None else None
        self.pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="prefill")
        self.admission = Admission("prefill", settings.workers, settings.max_queued, settings.timeout,
                                   settings.service_prior)

    # ---- /v1/prefill ----
    def prefill(self, req: PrefillRequest, deadline: float | None = None,
                t_in: int | None = None) -> PrefillResponse:
        """Run one request (in a worker thread); raises `ServingError`. `t_in`: when the route took it
        (``monotonic_ns``): its ``intake`` span runs from there to here."""
        rid = req.request_id
        with self._lock:
            if rid in self._inflight:
                raise Conflict(f"request_id {rid!r} is already being prefilled")
            self._inflight.add(rid)
        try:
            return self._prefill(req, rid, time.monotonic() if deadline is None else deadline, t_in)
        finally:
            with self._lock:
                self._inflight.discard(rid)

    def _prefill(self, req: PrefillRequest, rid: str, deadline: float, t_in: int | None) -> PrefillResponse:
        t0 = time.monotonic_ns()
        if t_in is not None:
            self.recorder.add(Span(rid, -1, "intake", self.recorder.node, t_in, t0))
            t0 = t_in  # the answer carries the intake too
        kv = _KeptKV(self, rid, req.kv_transfer_params.do_remote_decode, deadline)
        try:
            # the text alone, before E→P, measured without building its ids (50 MB of them hold a worker, GIL and
            # all, for seconds: the event loop, and /health with it, would stop answering)
            self._check_length(prompt_tokens(req.prompt))
            queued = None
            if req.images:  # KV held, forward planned (--gated-prefill on a GPU: queued) while the embeddings come
                input_ids, embeds, grid, plan, queued = self._receive(req, rid, kv)
            else:
                input_ids, embeds, grid, plan = models.build_input_ids(req.prompt, []), None, None, None
                if input_ids.shape[1] == 0:
                    raise BadRequest("empty prompt and no images: nothing to prefill")
                self._hold(kv, input_ids)
            if queued is not None:  # the GPU started it as the embeddings landed: its span starts there
                result, gate = queued
                result.wait()
                first_token = self._first_token(req, result)
                t_done = time.monotonic_ns()
                self.prefill_time.observe((t_done - gate.opened_ns) / 1e9)
                self.recorder.add(Span(rid, -1, "prefill", self.recorder.node, gate.opened_ns, t_done))
            else:
                t_forward = time.monotonic()
                with self.recorder.span("prefill", rid):
                    try:
                        result = self._forward(rid, input_ids, embeds, grid, kv, plan, deadline)
                    except ValueError as exc:  # the prompt and the embeddings disagree
                        raise BadRequest(f"prefill failed: {exc}") from None
                    first_token = self._first_token(req, result)  # read back: the span ends when the GPU's did
                self.prefill_time.observe(time.monotonic() - t_forward)
            params = kv.keep(result, first_token) if kv.remote else None
        finally:
            kv.drop()  # a no-op once the producer holds the blocks
        self.counters["requests_ok"] += 1
        self.counters["prompt_tokens"] += result.prompt_len
        spans = [s for s in self.recorder.spans(rid) if s.t_start_ns >= t0]
        return PrefillResponse(rid, first_token, result.prompt_len, params, spans)

    def _forward(self, rid: str, input_ids: torch.Tensor, embeds: torch.Tensor | None, grid: torch.Tensor | None,
                 kv: _KeptKV, plan: PrefillPlan | None, deadline: float) -> PrefillOutput:
        """The forward into the request's blocks: this process's alone, or with TP every rank's at once."""
        if self.tp_group is None:
            return self.runtime.prefill(input_ids, embeds, grid, kv.ids, plan=plan)
        result, spans = self.tp_group.prefill(self.runtime, rid, input_ids, embeds, grid, kv.ids, plan, kv.remote,
                                              deadline)
        self.recorder.extend(spans)
        return result

    @staticmethod
    def _first_token(req: PrefillRequest, result: PrefillOutput) -> int:
        return int(sample(result.logits[None], [req.temperature], [request_seed(req.seed)], [0]))

    def _receive(self, req: PrefillRequest, rid: str, kv: _KeptKV) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, PrefillPlan, tuple[PrefillOutput, Gate] | None]:
        """E→P: the request's images through the encoders; the prompt's ids, embeddings, grids, forward's plan,
        and the forward itself where it was queued. Once the encoders answered the sizes, while the embeddings
        are on their way, the whole prompt's length is checked, its KV blocks held (`kv`) and its forward's host
        inputs made (`plan_prefill`): off the critical path, where the thread that wakes when the embeddings
        land would make them cold. With ``--gated-prefill``, for a request alone here, where the runtime gives a
        gate (a GPU, mooncake, a pinned or GPU buffer), the forward is queued there too, behind it, and the
        receiver's `Landing` opens it: the GPU starts the moment the last notify arrives, before this thread
        wakes."""
        if self.epd is None:
            raise BadRequest("this prefill server has no encoders (started without --encoders): "
                             "images are not allowed, text-only prompts are")
        planned: list[PrefillPlan] = []
        queued: list[tuple[PrefillOutput, Gate]] = []

        def on_prompt(input_ids: torch.Tensor, grid: torch.Tensor, landing: Landing | None) -> None:
            table = self._hold(kv, input_ids)
            try:
                planned.append(self.runtime.plan_prefill(input_ids, grid, table))
            except ValueError as exc:  # the prompt and the grids disagree
                raise BadRequest(f"prefill failed: {exc}") from None
            embeds = None if landing is None or landing.embeddings is None else landing.embeddings.get("image")
            # alone only: a request queued behind a gate waits for that request's embeddings (measured under load)
            alone = self.settings.gated_prefill and len(self._inflight) == 1
            gate = self.runtime.prefill_gate(input_ids.shape[1], embeds) if alone and embeds is not None else None
            if gate is None:
                return
            try:
                queued.append((self.runtime.prefill(input_ids, embeds, grid, table, plan=planned[0], gate=gate),
                               gate))
            except ValueError as exc:  # the prompt and the announced embeddings disagree
                raise BadRequest(f"prefill failed: {exc}") from None
            finally:
                landing.when_landed(gate.open)  # opened on every path, or the prefill stream stays blocked

        try:
            prompt = self.epd.receive(req.prompt, req.images, rid, on_prompt)
        except EPDError as exc:
            # an encoder that refused the input (an image that does not decode, ...) is the client's error
            if exc.status == 503:  # every encoder at capacity: so is this request's prefill, for now
                raise Unavailable(f"E→P failed: {exc}", retry_after=1) from None
            status = exc.status if exc.status in (400, 409, 413) else 502
            raise error_for_status(status, f"E→P failed: {exc}") from None
        return prompt.input_ids, prompt.image_embeds, prompt.image_grid_thw, planned[0], \
            queued[0] if queued else None

    def _hold(self, kv: _KeptKV, input_ids: torch.Tensor) -> list[int]:
        """The whole prompt is known: check its length, then hold its KV (`_KeptKV.announce`); its block table."""
        self._check_length(input_ids.shape[1])
        return kv.announce(input_ids)

    def _check_length(self, prompt_len: int) -> None:
        """A prompt the model cannot hold with one generated token, or whose KV outgrows the whole cache, is the
        client's error, found before any compute (a 72k-byte prompt once took a worker 64 s before its 503)."""
        if prompt_len >= self.max_positions:
            raise BadRequest(f"the prompt is {prompt_len} tokens; this model takes at most {self.max_positions - 1} "
                             f"(max_position_embeddings {self.max_positions}, one token to generate)")
        if blocks_needed(prompt_len, self.cache.block_size) > self.blocks.num_blocks:
            raise BadRequest(f"the prompt's KV ({prompt_len} tokens) needs more than the "
                             f"{self.blocks.num_blocks} blocks of {self.cache.block_size} tokens this server has")

    def abort(self, req: AbortRequest) -> AbortResponse:
        """Drop a request's KV: decode will never ask for it."""
        return AbortResponse(req.request_id, self.abort_kv(req.request_id))

    def abort_kv(self, request_id: str) -> int:
        """Free `request_id`'s KV on every rank's producer; the blocks freed here (rank 0's)."""
        if self.tp_group is not None:
            self.tp_group.abort(request_id)
        return self.producer.abort(request_id)

    @property
    def kv_urls(self) -> list[str]:
        """Every rank's KV side channel, in rank order (decode asks them all)."""
        return [self.producer.url, *(self.tp_group.kv_urls if self.tp_group is not None else [])]

    # ---- health, metrics, lifetime ----
    def health(self) -> dict:
        producer = self.producer.stats()
        dead = self.tp_group.dead_ranks if self.tp_group is not None else []
        return {"status": "ok" if not dead else f"TP rank(s) {dead} dead", "role": "prefill", "tp": self.settings.tp,
                "dp_rank": self.settings.dp_rank, "kv_urls": self.kv_urls, "model": self.settings.model_name,
                "device": str(self.device), "dtype": self.settings.dtype, "recv_buffer": self.settings.recv_buffer,
                "kv_url": self.producer.url, "session_id": self.engine.session_id,
                "encoders": list(self.settings.encoders), "num_blocks": self.blocks.num_blocks,
                "free_blocks": self.blocks.num_free_blocks, "used_blocks": self.blocks.num_used_blocks,
                "block_size": self.cache.block_size, "inflight": len(self._inflight), "producer": producer,
                "max_prompt_tokens": self.max_prompt_tokens, "admission": self.admission.stats(),
                "counters": dict(self.counters)}

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this server takes (`_check_length`'s bound); the proxy learns it from /health and
        refuses longer ones itself, before they travel."""
        return min(self.max_positions - 1, self.blocks.num_blocks * self.cache.block_size)

    def metric_families(self) -> list[Metric]:
        """The prefill's ``/metrics`` families: vLLM's queue and prefill times, prompt tokens, requests running and
        waiting; its KV blocks, the producer's counters, its admission and engines."""
        p, m = self.producer.stats(), self.metrics
        return [
            *m.instruments(),
            m.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.counters["prompt_tokens"]),
            m.gauge("vllm:num_requests_running", "Number of requests in model execution batches (prefills "
                    "running).", len(self._inflight)),
            m.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed (admission's queue).",
                    self.admission.queued),
            m.gauge("vllm:kv_cache_usage_perc", "KV-cache usage (blocks held until decode takes them). 1 means 100 "
                    "percent usage.", self.blocks.num_used_blocks / self.blocks.num_blocks),
            *(m.of(name, kind, help_, value) for name, kind, value, help_ in (
                ("kv_blocks_free", "gauge", self.blocks.num_free_blocks, "KV blocks free"),
                ("kv_blocks_used", "gauge", self.blocks.num_used_blocks, "KV blocks held (waiting for decode)"),
                ("inflight", "gauge", len(self._inflight), "prefills running"),
                ("prompt_tokens", "counter", self.counters["prompt_tokens"], "prompt tokens prefilled"),
                ("kv_pool_exhausted", "counter", self.counters["kv_pool_exhausted"], "requests refused with 503"),
                ("kv_requests_held", "gauge", p["requests_held"], "requests whose KV waits for decode"),
                ("kv_transfers_done", "counter", p["transfers_done"], "side-channel asks answered TRANS_DONE"),
                ("kv_transfers_failed", "counter", p["transfers_failed"], "side-channel asks answered TRANS_ERROR"),
                ("kv_requests_expired", "counter", p["requests_expired"], "KV freed unasked after the free timeout"),
                ("kv_requests_aborted", "counter", p["requests_aborted"], "KV freed unasked by /v1/abort"),
                ("kv_bytes_sent", "counter", p["bytes_sent"], "KV bytes written to decode"),
                ("tp_ranks", "gauge", self.settings.tp, "tensor-parallel ranks of this prefill (rank 0 serves and "
                 "reports for the group)"),
                ("tp_dead_ranks", "gauge", len(self.tp_group.dead_ranks) if self.tp_group else 0,
                 "ranks of this prefill's TP group found dead"),
            )),
            *self.admission.metric_families(m),
            *engine_metrics(m, self.engine, self.receiver.engine if self.receiver is not None else None),
        ]

    def refusals(self) -> dict[str, float]:
        """Its admission's refusals (``admission_<reason>``), a full KV pool, and every unauthenticated peer: at
        the engines' port (``transfer_auth``), the E→P receiver's ZMQ socket (``ep_unauthenticated``) and the KV
        side channel (``kv_unauthenticated``)."""
        p = self.producer.stats()
        return {**{f"admission_{reason}": n for reason, n in self.admission.refused.items()},
                "kv_pool_exhausted": self.counters["kv_pool_exhausted"],
                "kv_asks_refused": p["asks_refused"],
                "transfer_auth": engine_auth_failures(self.engine,
                                                      self.receiver.engine if self.receiver is not None else None),
                "ep_unauthenticated": self.receiver.counters["unauthenticated_messages"] if self.receiver else 0,
                "kv_unauthenticated": p["unauthenticated"]}

    def close(self) -> None:
        """Stop the workers, answer waiting asks, free and deregister the cache, close the engines."""
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.receiver is not None:
            self.receiver.close()
        if self.tp_group is not None:
            self.tp_group.close()
        if self.producer is not None:
            self.producer.close()
        if self.cache is not None:
            self.cache.close()
        self.engine.close()


def create_app(settings: PrefillSettings) -> FastAPI:
    """The prefill server's app; the model loads and the cache registers in its lifespan."""
    app = role_app("prefill", lambda: PrefillServer(settings), ("/v1/prefill", "/v1/abort"))

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Response:
        t_in = time.monotonic_ns()  # the request's `intake` starts: admission, its body, the hop to a worker
        server: PrefillServer = app.state.server
        # queued, or refused, before its body is read: a waiting request holds no body, KV or embedding
        t0, budget = time.monotonic(), deadline_budget(request.headers, server.settings.timeout)
        ticket = await server.admission.enter(budget)
        server.queue_time.observe(time.monotonic() - t0)
        try:
            return await _prefill(server, request, t0 + budget, t_in)
        finally:
            ticket.leave()

    async def _prefill(server: PrefillServer, request: Request, deadline: float, t_in: int) -> Response:
        body = await read_body(request)
        if client_gone(request):  # e.g. read on waking from a freeze the proxy passed over: no compute
            raise ClientClosed("the client closed the request before its prefill began")

        def run() -> bytes:  # one hop off the loop: the body (data: URIs, MiBs) decodes in the worker too
            return encode(server.prefill(decode_body(body, PrefillRequest), deadline, t_in))

        answer = await asyncio.get_running_loop().run_in_executor(server.pool, run)
        return Response(answer, media_type="application/json")

    @app.post("/v1/abort")
    async def abort(request: Request) -> Response:
        # freeing takes the block manager's lock only: no need to leave the event loop
        req = await read_struct(request, AbortRequest)
        return Response(encode(app.state.server.abort(req)), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM."""
    return serve_main(PrefillSettings, create_app, argv, "python -m epd_lab.servers.prefill",
                      "the EPD prefill server")


if __name__ == "__main__":
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
