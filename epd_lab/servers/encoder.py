"""The encode server (E of EPD): SGLang's ``encode_server.py`` (seed 000) as a FastAPI app.

Routes:

- ``POST /encode`` (`EncodeRequest` → `EncodeResponse`): read each item's bytes and parse the image header only;
  answer the sizes, computed from the image sizes alone, while the bytes are hashed (the cache key). Only images
  not in the cache go through the ViT; their pixels are decoded in the ViT's thread, or, when no other ViT runs
  or waits, in a decoder thread while they are hashed (a cached one's decode is then dropped unused). The
  modality is matched by its `Modality` name in any case; this encoder serves ``IMAGE`` only. Per backend:
  ``mooncake``: answer at once; the ViT runs in a background worker and the embedding is held under
  ``req_id`` until ``/send`` comes (or its TTL passes).
  ``zmq_to_tokenizer``: run the ViT, PUSH an `EmbeddingData` (bytes inside) to
  ``tcp://prefill_host:embedding_port``, then answer.
  ``zmq_to_scheduler``: the same, to each of the ``receive_count`` URLs given by ``/scheduler_receive_url``
  for that ``req_id`` (sent once all are known).
- ``POST /send`` (mooncake; `SendRequest` → `SendResponse`): one-sided write of the held embedding to
  ``buffer_address`` in engine ``session_id``, then PUSH a metadata-only `EmbeddingNotify`. The body may be
  the `/encode` answer itself plus ``session_id`` and ``buffer_address`` (the seed's). Once a /send is
  accepted, the receiver always gets a notify, with ``error`` set when the write could not be done.
- ``POST /release`` (mooncake; `ReleaseRequest`, epd_lab's): drop a held embedding whose /send will not come
  (the receiver's request failed elsewhere) now, not after its TTL; a part not held yet is remembered for the
  TTL, and its /encode, should it still come (a freeze, a cut link), is refused (409).
- ``POST /scheduler_receive_url`` (zmq_to_scheduler; `SchedulerReceiveUrl`), ``GET /health``, ``GET /metrics``.

Admission (`epd_lab.serving.Admission` with no queue): at most ``--max-parts`` parts at once, from /encode until
sent (mooncake: held for /send, released or expired), and at most ``--max-held-bytes`` of embeddings held for
/send. Past either an /encode is refused at once with 503 and ``Retry-After`` (before its body is read, for the
part count), holding nothing: the receiver offers the part to another encoder. An /encode does not queue here,
unlike a prefill or decode request: a part's slot is held until its /send, which the prefill sends only once
every part of the request is answered, so a part waiting for a slot held by its own request's sibling would wait
for its deadline. The deadline-aware queue stands before it, at the prefill; the ViT worker's backlog is
bounded by ``--max-parts``.

ZMQ messages only go to hosts `check_host` accepts (an IP address or a DNS name) and ports 1..65535.

A media item that cannot be read, or whose header PIL cannot parse, is a 400 from /encode naming
``mm_items[i]``. Pixel data found corrupt or truncated when the worker decodes it is the same 400, answered
by /send with an error notify (mooncake), or by /encode with the error pushed to the receivers (zmq backends).

Global embedding cache (``--mm-global-cache``, `epd_lab.ep.global_cache`): after its own cache (L1) an image is
looked up in a host pool (L2) and in Mooncake Store (L3, ``--store-master``) before the ViT runs; L3's lookup runs
once the part's items are hashed, its prefetches while the ViT waits or runs; what the ViT makes is put into L3
in the background. With TP ranks only the misses reach the other ranks.

Spans (`epd_lab.trace`): ``load`` (read, header and hash of the part's media; nbytes: their bytes), ``decode``
(the pixels, from the first decode's start, which may lie inside ``load``, to the last image in hand; absent
when every image came from the cache; nbytes: the RGB bytes), ``store_get`` (when any item came from L3: from
its lookup to the embedding assembled; nbytes: the bytes fetched), ``vit`` (absent when L3 answered every item
the other levels did not), ``store_put`` (an L3 put, after the part was sent: in the encoder's recorder only),
``transfer`` (the one-sided write, or the ZMQ send of the bytes) and ``notify`` travel in the message's
``spans``. The message cannot carry the duration of its own sending, so its last span (``notify`` for
mooncake, ``transfer`` for the zmq backends) has ``t_end_ns == t_start_ns``, the moment the send began; the
receiver closes it with its receipt time (one host shares CLOCK_MONOTONIC).
The encoder's own `Recorder` keeps the full spans.

Threads: the event loop only routes and keeps the state. Whatever costs more than microseconds runs elsewhere,
in as few hops as the work allows: /encode parses its body (megabytes with data: URIs), reads, base64-decodes
and opens the media in one thread, which hands the sizes back to the loop, hashes the media and then runs the
ViT itself when no other ViT runs or waits (the decoder thread decoding the pixels beside the hash), else hands
them to the worker, behind the others (one ViT at a time, in order); /send's write and notify, and the zmq
backends' message and push, run as soon as the ViT ends
(`_after_vit`: no hop through the event loop between), in the thread that ran it when no other ViT waits, else
in a sender thread. At one request in flight a part thus crosses no thread between its media and its notify:
each hop spared is a thread wake-up (56-83 µs after an idle spell on the H200's host, `data/bench/hops-wakeup-h200/`).

Media items are ``data:`` URIs, http(s) URLs and local file paths (as in SGLang), under a `MediaPolicy`:
local paths only inside ``--media-roots`` (none by default), http(s) only to public addresses unless
``--media-private-hosts``; a refusal never says whether the file or port exists.

Run: ``python -m epd_lab.servers.encoder --port 0 --backend mooncake`` prints ``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
import torch
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import Response
from PIL import Image

from epd_lab import models
from epd_lab.ep.cache import EmbeddingCache
from epd_lab.ep.global_cache import Found, GlobalEmbeddingCache, Lookup, embedding_key
from epd_lab.ep.media import (MAX_MEDIA_BYTES, MediaError, MediaPolicy, content_hash, fetch_media, load_rgb,
                              open_image)
from epd_lab.ep.messages import (
    BACKENDS,
    DTYPES,
    EmbeddingData,
    EmbeddingNotify,
    EncodeRequest,
    EncodeResponse,
    Modality,
    SchedulerReceiveUrl,
    ReleaseRequest,
    SendRequest,
    SendResponse,
    encode_zmq,
    receive_url_endpoint,
    zmq_url,
)
from epd_lab.ep.push import PushSockets
from epd_lab.ep.store import MIN_SEGMENT_BYTES, SEGMENT_BYTES, StoreClient, StoreUnavailable, local_hostname_for
from epd_lab.failpoints import failpoint
from epd_lab.serving import (Admission, BadGateway, BadRequest, ClientClosed, Conflict, Forbidden, GatewayTimeout,
                             Metric, NotFound, RoleMetrics, ServingError, Ticket, Unavailable, client_gone,
                             decode_body, engine_auth_failures, engine_metrics, json_response, option, read_body,
                             read_struct, role_app, serve_main)
from epd_lab.serving.metrics import STAGE_BUCKETS
from epd_lab.models import processor
from epd_lab.models.runtime import open_runtime
from epd_lab.servers.encoder_tp import EncoderTPGroup
from epd_lab.models.catalog import synchronize, use_device
from epd_lab.servers.model_settings import ModelSettings, check_transport, transport_option
from epd_lab.serving.settings import check_at_least, check_choice, check_positive
from epd_lab.trace import Recorder, Span, clock_id
from epd_lab.transfer import (
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
    open_engine,
    parse_session_id,
)

SERVED_MODALITIES = (Modality.IMAGE,)  # what the ViT takes
ROUTES = ("/encode", "/send", "/release", "/scheduler_receive_url")
MAX_RELEASED_IDS = 65536  # /release calls remembered for parts not held (yet)

T = TypeVar("T", bound=msgspec.Struct)


@dataclasses.dataclass(slots=True, frozen=True)
class EncoderSettings(ModelSettings):
    """What an encode server is started with; checked on construction (`ValueError`)."""

    backend: str = option("mooncake", "the E→P backend", choices=BACKENDS)
    transport: str = transport_option("mooncake backend")
    timeout: float = option(10.0, "seconds; bounds every wait: media fetch, embedding, receive URL, transfer, "
                                  "ZMQ send")
    embedding_ttl: float = option(10.0, "seconds a held embedding waits for /send before it is released (a /send "
                                        "comes within milliseconds; past the receiver's timeout, never)")
    cache_bytes: int = option(256 << 20, "embedding cache capacity in bytes (0: off)")
    max_parts: int = option(64, "parts admitted at once, from /encode until sent, released or expired; more are "
                                "refused with 503")
    max_held_bytes: int = option(512 << 20, "embedding bytes held for /send at once (mooncake); a part past it is "
                                            "refused with 503")
    media_roots: tuple[str, ...] = option((), "folders whose files clients may name as media items (none: no "
                                              "local paths)")
    media_private_hosts: bool = option(False, "fetch http(s) media items from loopback and private addresses too")
    tp: int = option(1, "tensor-parallel ranks: this server is rank 0 and starts the others, which run their shard "
                        "of the vision tower; only rank 0 writes and notifies (--runtime fast)")
    mm_global_cache: bool = option(False, "the global embedding cache: after its own cache (L1) the encoder looks an "
                                          "image up in a host pool (L2, --host-pool-bytes) and in Mooncake Store (L3, "
                                          "--store-master), shared by every encoder of the model")
    store_master: str | None = option(None, "HOST:PORT of the mooncake_master the global cache's L3 uses (none: "
                                            "no L3); unreachable at start: a warning, and serving on without L3")
    host_pool_bytes: int = option(1 << 30, "the global cache's host pool (L2) in bytes (0: no L2)")
    store_segment_bytes: int = option(SEGMENT_BYTES, "host memory in bytes this encoder gives to Mooncake Store's "
                                                     "pool (L3; at least 16 MiB)")
    store_timeout: float = option(1.0, "seconds an L3 lookup and its prefetches may take before the ViT encodes "
                                       "the item instead")

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        check_choice(self, "backend", BACKENDS)
        check_transport(self)
        check_positive(self, "timeout", "embedding_ttl")
        check_at_least(self, 0, "cache_bytes", "host_pool_bytes")
        check_positive(self, "store_timeout")
        check_at_least(self, MIN_SEGMENT_BYTES, "store_segment_bytes")
        if self.store_master is not None:
            host, _, port = self.store_master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--store-master must be HOST:PORT, got {self.store_master!r}")
        check_at_least(self, 1, "max_parts", "max_held_bytes", "tp")
        if self.tp > 1 and self.runtime != "fast":
            raise ValueError(f"--tp {self.tp} needs --runtime fast (the hf runtime runs HF's whole model in one "
                             f"process)")


@dataclasses.dataclass(slots=True)
class _Item:
    """One media item of a part, as /encode leaves it for the ViT."""

    idx: int  # its place in the part's mm_items: errors name it
    name: str  # the item as the request gave it
    raw: bytes  # its bytes, hashed into `key` once its sizes are answered
    image: Image.Image  # opened from the header only: its size is known, its pixels are not decoded yet
    key: str = ""  # the embedding cache's key
    decoded: concurrent.futures.Future | None = None  # -> (RGB image, decode start): started beside the hash


@dataclasses.dataclass(slots=True)
class _Held:
    """A mooncake part between /encode and /send: what /encode answered, where to notify, the ViT's future."""

    answer: EncodeResponse
    modality: Modality
    prefill_host: str
    embedding_port: int | None
    future: concurrent.futures.Future  # -> (embedding tensor, vit span)
    created: float
    ticket: Ticket  # its admission, left once it is sent, released or expired


@dataclasses.dataclass(slots=True)
class _ReceiveUrls:
    """zmq_to_scheduler: where a req_id's embedding goes; `event` is set once all `count` URLs are known."""

    created: float
    urls: list[str] = dataclasses.field(default_factory=list)  # ZMQ URLs, in the order they came
    count: int | None = None  # the seed's receive_count, set by the first URL
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    awaited: bool = False  # an /encode waits on it and removes it; the TTL sweep leaves it alone


class MMEncoder:
    """The encoder's state: model, worker, transfer engine, held embeddings, cache, sockets, counters.

    All dictionaries are touched only from the event loop; one thread at a time (the worker, or the one that read
    the part's media) decodes the images and runs the ViT and the cache, other threads read media and do blocking
    transfers and sends.
    """

    def __init__(self, settings: EncoderSettings) -> None:
        self.settings = settings
        self.dtype = DTYPES[settings.dtype]
        self.device = use_device(settings.device)
        models.configure_torch(threads=1)  # the same kernels, hence the same bits, as every other role
        self.model = models.open_model(settings.model, dtype=self.dtype, device=self.device)
        self.recorder = Recorder(node=f"encoder:{settings.port}")
        self.metrics = RoleMetrics("encoder", settings.model_name)
        self.queue_time = self.metrics.histogram("epd_lab:encoder_queue_seconds", "Histogram of the time an /encode "
                                                 "waited for admission (max_parts).", STAGE_BUCKETS)
        self.vit_time = self.metrics.histogram("epd_lab:encoder_vit_seconds", "Histogram of the ViT's time per "
                                               "part (the images' decode and the forward).", STAGE_BUCKETS)
        self.transfer_time = self.metrics.histogram("epd_lab:ep_transfer_seconds", "Histogram of the time one "
                                                    "part's embedding took to go E→P (one-sided write, or ZMQ send).",
                                                    STAGE_BUCKETS)
        # TP > 1: rank 0's shard, the other ranks started and met here (seed 000's encoder TP)
        self.tp_group = EncoderTPGroup(self.model, settings, self.recorder.node) if settings.tp > 1 else None
        self.runtime = open_runtime(settings.runtime, self.model) if self.tp_group is None else None  # no KV cache
        self.embedding_dim = self.model.config.vision_config.hidden_size
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.cache = EmbeddingCache(settings.cache_bytes)
        host_pool = settings.host_pool_bytes if settings.mm_global_cache else 0
        self.global_cache = GlobalEmbeddingCache(self.cache, host_pool, self._open_store(), self.device,
                                                 settings.store_timeout)
        self._vision_config = self.model.config.vision_config.to_dict()  # part of every cache key
        self.media_policy = MediaPolicy(settings.media_roots, settings.media_private_hosts)
        self.engine = (open_engine(settings.transport, settings.host, settings.timeout)
                       if settings.backend == "mooncake" else None)
        self.pushers = PushSockets(settings.timeout)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-vit")
        # decodes started while their items are hashed, when no other ViT runs or waits (`_read_and_start`)
        self.decoder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-decode")
        self._vits = 0  # ViTs started or waiting, not done: with none, the next one runs where its media were read
        self._vits_lock = threading.Lock()
        self._vit_running = threading.Lock()  # one ViT at a time, whichever thread runs it
        self.sender = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="epd-send")
        self.held: dict[str, _Held] = {}
        self.receive_urls: dict[str, _ReceiveUrls] = {}
        self.encoder_idx: int | None = None  # the latest /encode's encoder_idx: this server's place in its list
        self.bytes_sent = 0
        self.embeddings_expired = 0
        self.embeddings_released = 0
        self.held_bytes = 0  # Σ embedding_size of `held`
        self.released_ids: dict[str, float] = {}  # /release for a part not held: when (kept for the TTL)
        self.refused = {"held_bytes": 0}  # the part count's refusals are the admission's own
        self.admission = Admission("encoder", settings.max_parts, 0, settings.timeout)

    def _open_store(self) -> StoreClient | None:
        """The global cache's L3 client, when asked for; a master that cannot be reached is a warning: the encoder
        serves on, its L3 off."""
        s = self.settings
        if not (s.mm_global_cache and s.store_master):
            return None
        try:
            return StoreClient(s.store_master, s.store_timeout, local_hostname_for(s.store_master),
                               s.store_segment_bytes)
        except (StoreUnavailable, OSError) as exc:
            print(f"warning: the global embedding cache's L3 is off: {exc}; serving on without it", file=sys.stderr,
                  flush=True)
            return None

    # ---- /encode ----
    async def encode(self, body: Awaitable[bytes | bytearray], ticket: Ticket,
                     t_in: int | None = None) -> EncodeResponse:
        """/encode's JSON body (`EncodeRequest`, awaited here): read the media and answer the sizes; run
        (mooncake: start) the ViT and send per backend. A bad request or item is a 400 (`BadRequest`). `t_in`:
        when the route took the request (``monotonic_ns``), the start of its ``intake`` span.

        The caller admitted the part (`admission.enter`: `ticket`); it leaves when this returns, or for mooncake
        once held and then sent, released or expired."""
        held = False
        try:
            body = await body
            try:  # one thread hop for the body and the media: megabytes of JSON and base64 with data: URIs
                req, modality, items, future = await self._read_and_start(body, t_in)
            except MediaError as exc:
                raise BadRequest(str(exc)) from None
            try:
                if req.encoder_idx is not None:
                    self.encoder_idx = req.encoder_idx
                sizes = [item.image.size for item in items]
                n_tokens = sum(models.num_image_tokens(size) for size in sizes)
                resp = EncodeResponse(req.req_id, req.part_idx, n_tokens * self.embedding_dim * self.itemsize,
                                      n_tokens, self.embedding_dim, self.settings.dtype,
                                      [list(models.image_grid(s)) for s in sizes])
                if req.req_id in self.held:  # checked after the load: another /encode may have come meanwhile
                    raise Conflict(f"req_id {req.req_id!r} is already held here, waiting for /send")
                if req.req_id in self.released_ids:  # its /release overtook it (a cut link, a freeze): hold nothing
                    raise Conflict(f"req_id {req.req_id!r} was released before its /encode was read")
                if self.settings.backend == "mooncake":
                    self._check_held_bytes(resp.embedding_size)
                failpoint("encoder.before_encode_reply")
            except BaseException:
                future.cancel()  # not started yet: it never runs (started: its embedding is dropped)
                raise
            if self.settings.backend == "mooncake":
                self.held[req.req_id] = _Held(resp, modality, req.prefill_host, req.embedding_port, future,
                                              time.monotonic(), ticket)
                self.held_bytes += resp.embedding_size
                held = True
                return resp
            await self._encode_and_push(req, modality, resp, future)
            return resp
        finally:
            if not held:
                ticket.leave()

    def _check_held_bytes(self, nbytes: int) -> None:
        """503 when holding `nbytes` more for /send would pass ``max_held_bytes``."""
        cap = self.settings.max_held_bytes
        if self.held_bytes + nbytes > cap:
            self._count_refused("held_bytes")
            raise Unavailable(f"encoder at capacity: {self.held_bytes} embedding bytes held for /send, {nbytes} "
                              f"more would pass max_held_bytes {cap}", retry_after=1)

    def _count_refused(self, why: str) -> None:
        self.refused[why] += 1

    def _release(self, req_id: str) -> _Held | None:
        """Stop holding `req_id` (sent, released or expired): its bytes and its admission go back."""
        held = self.held.pop(req_id, None)
        if held is not None:
            self.held_bytes -= held.answer.embedding_size
            held.ticket.leave()
        return held

    def release(self, req: ReleaseRequest) -> dict:
        """/release: drop a held embedding whose /send will not come (a ViT not yet started does not run)."""
        held = self._release(req.req_id)
        if held is not None:
            held.future.cancel()
            self.embeddings_released += 1
        else:  # not held (yet): an /encode of it still in flight is refused when it is read
            self.released_ids[req.req_id] = time.monotonic()
            while len(self.released_ids) > MAX_RELEASED_IDS:  # oldest first: a flood cannot grow it
                del self.released_ids[next(iter(self.released_ids))]
        return {"req_id": req.req_id, "released": held is not None}

    async def _read_and_start(self, body: bytes | bytearray, t_in: int | None
                              ) -> tuple[EncodeRequest, Modality, list[_Item], concurrent.futures.Future]:
        """`_read_request` in a thread, which then hashes the items (their cache keys) and starts the part's ViT
        (the future returned: the caller cancels it when it refuses the part) without a hop through this loop: in
        the same thread when no other ViT runs or waits (one thread wake-up less before it), else behind them on
        the worker. The part's sizes come back here as soon as its media are read and their headers parsed, while
        the items are hashed and the ViT runs.

        When no other ViT runs or waits, the items' decoding starts in the decoder thread before they are hashed
        (a 448² PNG's sha256 is 0.35 ms, its decode 2-3 ms, both outside the GIL): a miss then waits for the
        longer of the two, not their sum. A cached item's decode is dropped unused (cancelled if not started).
        Busy, the worker decodes only what misses, as the ViT's turn comes; a part whose every item the cache
        levels hold (L3: found by the lookup) is assembled here at once, never queued behind another part's ViT
        (should a prefetch fail, its item waits for the ViT here)."""
        loop = asyncio.get_running_loop()
        read: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                req, modality, items, spans = self._read_request(body, t_in)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, read, None, exc)
                return
            vit: concurrent.futures.Future = concurrent.futures.Future()
            with self._vits_lock:
                idle = not self._vits
                self._vits += 1
            vit.add_done_callback(self._vit_done)  # first: counted down before `_after_vit`'s callback looks
            loop.call_soon_threadsafe(_settle, read, (req, modality, items, vit), None)
            if idle:
                for item in items:
                    item.decoded = self.decoder.submit(_timed_decode, item)
            lookup = self._hash(items, spans)
            args = (vit, req.req_id, req.part_idx, items, spans, lookup)
            # a part the cache levels answer whole needs no ViT: it runs here, never behind another part's ViT
            if idle or (lookup is not None and lookup.found_all):
                self._run_vit_into(*args)
            else:
                self.worker.submit(self._run_vit_into, *args)

        loop.run_in_executor(None, run)
        return await read

    def _vit_done(self, _: concurrent.futures.Future) -> None:
        with self._vits_lock:
            self._vits -= 1

    def _run_vit_into(self, vit: concurrent.futures.Future, *args: Any) -> None:
        """`_run_vit(*args)` into `vit`, unless it was cancelled before it started (the part refused or released)."""
        if not vit.set_running_or_notify_cancel():
            for item in args[2]:  # the items: their decodes started beside the hash are not needed
                if item.decoded is not None:
                    item.decoded.cancel()
            return
        # a CUDA device is current per thread: this one may never have had the role's made current
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with on_device:
                result = self._run_vit(*args)
        except BaseException as exc:
            vit.set_exception(exc)
            return
        _ending_vit.here = True  # `_after_vit`'s callback may write and notify from this thread
        try:
            vit.set_result(result)
        finally:
            _ending_vit.here = False

    def _read_request(self, body: bytes | bytearray,
                      t_in: int | None) -> tuple[EncodeRequest, Modality, list[_Item], list[Span]]:
        """In a thread: the request, checked, and its media items, read and opened from their headers; with the
        spans the ViT takes on: ``intake`` (from `t_in`, when given: admission, the body, the hop here, its
        decoding) and ``load`` (open: `_hash` ends it). A bad item raises `MediaError` naming it."""
        req = decode_body(body, EncodeRequest)
        modality = self._check_encode(req)
        t0 = time.monotonic_ns()
        node = self.recorder.node
        spans = [] if t_in is None else [Span(req.req_id, req.part_idx, "intake", node, t_in, t0, len(body))]
        items, nbytes = [], 0
        for idx, name in enumerate(req.mm_items):
            try:
                raw = fetch_media(name, self.settings.timeout, MAX_MEDIA_BYTES, self.media_policy)
                items.append(_Item(idx, name, raw, open_image(raw, name)))
            except MediaError as exc:
                raise _item_error(idx, exc) from None
            nbytes += len(raw)
        spans.append(Span(req.req_id, req.part_idx, "load", node, t0, t0, nbytes))
        return req, modality, items, spans

    def _hash(self, items: list[_Item], spans: list[Span]) -> Lookup | None:
        """Each item's cache key and their L3 lookup, whose prefetches start now (none with every cache level
        off: no key could hit); the ``load`` span (the last of `spans`) ends once the items are hashed."""
        if not self.global_cache.enabled:
            spans[-1] = msgspec.structs.replace(spans[-1], t_end_ns=time.monotonic_ns())
            return None
        for item in items:
            item.key = item_key(item.raw, self.settings.model_name, self.settings.dtype, self._vision_config)
        spans[-1] = msgspec.structs.replace(spans[-1], t_end_ns=time.monotonic_ns())
        # each object L3 gives must also be of its image's shape and this encoder's dtype
        shapes = [(models.num_image_tokens(item.image.size), self.embedding_dim) for item in items]
        return self.global_cache.lookup([item.key for item in items], shapes, self.dtype)

    def _check_encode(self, req: EncodeRequest) -> Modality:
        """The request's modality, once the request is known to be servable (a 400 otherwise)."""
        try:
            modality = Modality.from_str(req.modality)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if modality not in SERVED_MODALITIES:
            raise BadRequest(f"modality {modality.name} is not served by this encoder")
        if not req.mm_items:
            raise BadRequest("mm_items is empty")
        if not req.req_id:
            raise BadRequest("req_id is empty")
        if not 0 <= req.part_idx < req.num_parts:
            raise BadRequest(f"part_idx {req.part_idx} is not in 0..num_parts-1 ({req.num_parts})")
        if self.settings.backend == "zmq_to_tokenizer" and req.embedding_port is None:
            raise BadRequest("the zmq_to_tokenizer backend needs embedding_port")
        return modality

    def _run_vit(self, req_id: str, part_idx: int, items: list[_Item], spans: list[Span],
                 lookup: Lookup | None) -> tuple[torch.Tensor, list[Span]]:
        """In the thread that read the part or the ViT worker (`_run_vit_into`): the embedding of all items, from
        the cache levels where possible (`GlobalEmbeddingCache.collect`: L1, L2, then L3's prefetches), else
        decoded and encoded (only what no level gave goes to the ViT, one ViT at a time whichever thread runs it;
        a decode started beside the hash of an item found cached is dropped); with the spans so far (`intake`,
        `load`), then ``store_get`` when any item came from L3 (from the lookup to the embedding assembled),
        ``decode`` when anything was decoded, and ``vit`` when the ViT ran (or, with no item from L3, the assembly
        of cached items). An image that does not decode raises `MediaError`."""
        spans = list(spans)
        found = (self.global_cache.collect(lookup) if lookup is not None
                 else Found([None] * len(items), [None] * len(items)))
        pieces = found.pieces
        missing = [i for i, piece in enumerate(pieces) if piece is None]
        for item, piece in zip(items, pieces):
            if piece is not None and item.decoded is not None:
                item.decoded.cancel()  # cached: its decode is not needed (one already running ends unused)
        t0 = time.monotonic_ns()
        # one ViT at a time, whichever thread runs it, from the decode to the embedding in hand
        with self._vit_running if missing else contextlib.nullcontext():
            if missing:
                emb, images, t0 = self._decode_and_encode(req_id, part_idx, [items[i] for i in missing], spans)
                counts = [models.num_image_tokens(img.size) for img in images]
                if sum(counts) != emb.shape[0]:
                    raise RuntimeError(f"the ViT gave {emb.shape[0]} tokens, the image sizes say {sum(counts)}")
                for i, piece in zip(missing, emb.to(self.dtype).split(counts)):
                    pieces[i] = piece.clone()  # its own storage, so the cache accounts exactly its bytes
                    if lookup is not None:
                        self.global_cache.insert(items[i].key, pieces[i], partial(self._put_span, req_id, part_idx))
            # a fresh tensor, owned by this request: it is registered and sent, the cache's pieces never are
            embedding = torch.cat(pieces)
            synchronize(self.device)  # the span ends when the ViT did, and the engine's copy reads finished bytes
            t_end = time.monotonic_ns()
        if "l3" in found.levels:  # a hit shows as store_get: from the lookup to the embedding assembled
            spans.append(Span(req_id, part_idx, "store_get", self.recorder.node, lookup.t_start_ns, t_end,
                              found.l3_bytes))
        if missing:
            self.vit_time.observe((t_end - t0) / 1e9)
        if missing or "l3" not in found.levels:
            spans.append(Span(req_id, part_idx, "vit", self.recorder.node, t0, t_end, embedding.nbytes))
        self.recorder.extend(spans)
        return embedding, spans if self.recorder.enabled else []

    async def _encode_and_push(self, req: EncodeRequest, modality: Modality, resp: EncodeResponse,
                               future: concurrent.futures.Future) -> None:
        """zmq backends: wait for the ViT (zmq_to_scheduler: and for every receive URL), then PUSH the bytes
        (or the error) to each receiver."""
        msg = EmbeddingData(req.req_id, req.part_idx, modality.name, [resp.embedding_len, resp.embedding_dim],
                            self.settings.dtype, resp.grid_thw)
        entry = None
        if self.settings.backend == "zmq_to_scheduler":
            entry = self._receive_entry(req.req_id)
            entry.awaited = True
            urls = entry.urls  # filled by /scheduler_receive_url meanwhile
        else:
            urls = [zmq_url(req.prefill_host, req.embedding_port)]
        what = f"the ViT of {req.req_id!r}"
        try:
            if entry is not None:
                await self._bounded(entry.event.wait(), f"/scheduler_receive_url for {req.req_id!r}")
        except ServingError as exc:
            if not urls:
                raise
            raise await asyncio.to_thread(self._push_error, list(urls), msg, "transfer", exc) from None
        finally:
            if entry is not None:
                self.receive_urls.pop(req.req_id, None)
        urls = list(urls)
        await self._after_vit(future, partial(self._push_embedding, msg, urls, what), urls, msg, "transfer", what)
        self.bytes_sent += len(msg.data) * len(urls)

    def _push_embedding(self, msg: EmbeddingData, urls: list[str], what: str, vit: concurrent.futures.Future) -> None:
        """zmq backends, in a sender thread once the ViT ended: PUSH its bytes (or its error) to each receiver."""
        try:
            try:
                embedding, msg.spans = vit.result()
            except Exception as exc:  # answered and told, like any ViT error
                raise _vit_error(exc, what) from None
            msg.data = _raw_bytes(embedding)
        except ServingError as exc:
            raise self._push_error(urls, msg, "transfer", exc) from None
        self._push_all(urls, msg, "transfer")

    def _receive_entry(self, req_id: str) -> _ReceiveUrls:
        return self.receive_urls.setdefault(req_id, _ReceiveUrls(time.monotonic()))

    # ---- /scheduler_receive_url ----
    def set_receive_url(self, req: SchedulerReceiveUrl) -> str:
        """zmq_to_scheduler: add a place `req.req_id`'s embedding goes (and wake its /encode once all
        `receive_count` are known); returns its ZMQ URL."""
        if self.settings.backend != "zmq_to_scheduler":
            raise BadRequest(f"/scheduler_receive_url is for the zmq_to_scheduler backend; "
                                     f"this encoder runs {self.settings.backend}")
        url = receive_url_endpoint(req.receive_url)  # checked on decode already
        entry = self._receive_entry(req.req_id)
        if entry.count is None:
            entry.count = req.receive_count
        elif req.receive_count != entry.count:
            raise BadRequest(f"receive_count {req.receive_count} differs from the {entry.count} that "
                                     f"came before for {req.req_id!r}")
        if url not in entry.urls:
            if len(entry.urls) == entry.count:
                raise BadRequest(f"{req.req_id!r} already has its {entry.count} receive URL(s)")
            entry.urls.append(url)
        if len(entry.urls) == entry.count:
            entry.event.set()
        return url

    # ---- /send ----
    async def send(self, req: SendRequest) -> SendResponse:
        """mooncake: write the held embedding into the receiver's buffer, then notify it."""
        if self.settings.backend != "mooncake":
            raise BadRequest(f"/send is for the mooncake backend; this encoder runs {self.settings.backend}")
        held = self.held.get(req.req_id)
        if held is None:
            raise NotFound(f"req_id {req.req_id!r} is not held here: never encoded, already sent, "
                                     f"or released after embedding_ttl={self.settings.embedding_ttl} s")
        answer = held.answer
        for name in EncodeResponse.__struct_fields__:  # the seed's body repeats the /encode answer
            sent, encoded = getattr(req, name), getattr(answer, name)
            if sent is not None and sent != encoded:
                raise BadRequest(f"{name} {sent!r} does not match the encoded part's {encoded!r}")
        port = req.embedding_port if req.embedding_port is not None else held.embedding_port
        if port is None:
            raise BadRequest("no embedding_port to notify (neither in /send nor in /encode)")
        try:
            parse_session_id(req.session_id)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        # accepted: from here the part is released whatever happens, and the receiver always hears back
        self._release(req.req_id)
        urls = [zmq_url(req.prefill_host or held.prefill_host, port)]
        notify = EmbeddingNotify(answer.req_id, answer.part_idx, held.modality.name,
                                 [answer.embedding_len, answer.embedding_dim], answer.dtype, answer.grid_thw)
        what = f"the ViT of {req.req_id!r}"
        path = await self._after_vit(held.future, partial(self._write_then_notify, req, notify, urls, what), urls,
                                     notify, "notify", what)
        self.bytes_sent += answer.embedding_size
        return SendResponse(req.req_id, req.part_idx, answer.embedding_size, path)

    async def _after_vit(self, vit: concurrent.futures.Future, work: Callable[[concurrent.futures.Future], T],
                         urls: list[str], msg: EmbeddingNotify, stage: str, what: str) -> T:
        """``work(vit)`` in a sender thread from the ViT's completion, with no hop through this loop; waited for at
        most `timeout` s. A ViT that never ends: the work never runs, and the receivers hear why (`stage`); work
        already running is awaited (bounded by the engine and ZMQ's own timeouts)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run(vit: concurrent.futures.Future) -> None:
            if not done.set_running_or_notify_cancel():  # given up on below
                return
            try:
                done.set_result(work(vit))
            except BaseException as exc:  # whatever it is, the route answers it
                done.set_exception(exc)

        def dispatch(vit: concurrent.futures.Future) -> None:
            # from the thread that ran the ViT, as it ends, with no other ViT waiting: the write and notify run on
            # in it (one thread hop, a wake-up, less on the critical path); otherwise in a sender thread, so that
            # the next ViT does not wait for this write (and the loop, for a ViT done before /send came, never does)
            if getattr(_ending_vit, "here", False) and not self._vits:
                run(vit)
            else:
                self.sender.submit(run, vit)

        vit.add_done_callback(dispatch)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), self.settings.timeout)
        except asyncio.TimeoutError:
            if not done.cancel():  # the ViT ended meanwhile and the work runs
                return await asyncio.wrap_future(done)
            exc = GatewayTimeout(f"{what} did not come within {self.settings.timeout} s")
            raise await asyncio.to_thread(self._push_error, urls, msg, stage, exc) from None

    def _write_then_notify(self, req: SendRequest, notify: EmbeddingNotify, urls: list[str], what: str,
                           vit: concurrent.futures.Future) -> str:
        """Write the ViT's embedding, then notify (with the error if the ViT or the write failed); one thread for
        both, as the notify is what the receiver waits for. Returns the path taken."""
        try:
            try:
                embedding, notify.spans = vit.result()
            except Exception as exc:  # answered and told, like any ViT error
                raise _vit_error(exc, what) from None
            path = self._write(req, embedding, notify.spans)
        except ServingError as exc:
            raise self._push_error(urls, notify, "notify", exc) from None
        self._push_all(urls, notify, "notify")
        return path

    def _write(self, req: SendRequest, embedding: torch.Tensor, spans: list[Span]) -> str:
        """One-sided write of `embedding` (registered for the write only); returns the path taken."""
        engine = self.engine
        t0 = time.monotonic_ns()
        try:
            path = engine.path_to(req.session_id)
            ptr, nbytes, _ = engine.register_buffer(embedding)
            try:
                failpoint("encoder.write")
                engine.transfer_sync_write(req.session_id, ptr, req.buffer_address, nbytes, req.rkey)
            finally:
                engine.deregister(ptr)
        except RemoteAccessError as exc:
            raise Forbidden(f"the receiver refused the write: {exc}") from None
        except TransferTimeout as exc:
            raise GatewayTimeout(f"transfer to {req.session_id} timed out: {exc}") from None
        except RegistrationError as exc:
            raise ServingError(f"registering the embedding failed: {exc}") from None
        except TransferError as exc:
            raise BadGateway(f"transfer to {req.session_id} failed: {exc}") from None
        span = Span(req.req_id, req.part_idx, "transfer", self.recorder.node, t0, time.monotonic_ns(), nbytes)
        self.transfer_time.observe((span.t_end_ns - t0) / 1e9)
        self.recorder.add(span)
        if self.recorder.enabled:
            spans.append(span)
        return path

    def _decode_and_encode(self, req_id: str, part_idx: int, items: list[_Item],
                           spans: list[Span]) -> tuple[torch.Tensor, list[Image.Image], int]:
        """Holding the ViT: decode `items` (a ``decode`` span into `spans`) and run the ViT on them (with TP ranks:
        every rank, their ``vit`` spans into `spans`); the embedding, the images and when the ViT began."""
        images, t0 = _decode_items(items)
        t_decoded = time.monotonic_ns()
        spans.append(Span(req_id, part_idx, "decode", self.recorder.node, t0, t_decoded,
                          sum(img.width * img.height * 3 for img in images)))
        with torch.inference_mode():
            if self.tp_group is None:
                emb = self.runtime.encode(*models.preprocess(images, self.device))
            else:  # every rank runs its shard; the other ranks' vit spans join this part's
                emb, rank_spans = self.tp_group.encode(*models.preprocess(images, self.device), req_id, part_idx)
                spans.extend(rank_spans)
        return emb, images, t_decoded

    def _put_span(self, req_id: str, part_idx: int, t_start_ns: int, t_end_ns: int, nbytes: int) -> None:
        """An L3 put done (in the background, after the part was sent): its ``store_put`` span, in this encoder's
        recorder only."""
        self.recorder.add(Span(req_id, part_idx, "store_put", self.recorder.node, t_start_ns, t_end_ns, nbytes))

    # ---- ZMQ (blocking: called in a thread) ----
    def _push_all(self, urls: list[str], msg: EmbeddingNotify, stage: str) -> None:
        for url in urls:
            self._push(url, msg, stage)

    def _push_error(self, urls: list[str], msg: EmbeddingNotify, stage: str, exc: ServingError) -> ServingError:
        """Tell the receivers why their part will not come (so they fail fast); the error to answer with."""
        msg.error = exc.detail
        try:
            self._push_all(urls, msg, stage)
        except ServingError as push_exc:
            return ServingError(f"{exc.detail}; telling the receiver failed too: {push_exc.detail}",
                                status=exc.status, code=exc.code)
        return exc

    def _push(self, url: str, msg: EmbeddingNotify, stage: str) -> None:
        """Send `msg` to `url`, its last span being this send's start (the receiver closes it)."""
        t0 = time.monotonic_ns()
        nbytes = len(msg.data) if isinstance(msg, EmbeddingData) else 0
        if self.recorder.enabled:  # a copy per receiver: each gets only its own send's span (data not copied)
            msg = msgspec.structs.replace(
                msg, spans=[*msg.spans, Span(msg.req_id, msg.part_idx, stage, self.recorder.node, t0, t0, nbytes)],
                clock=clock_id())
        try:
            self.pushers.push(url, encode_zmq(msg))
        except zmq.ZMQError as exc:
            raise BadGateway(f"ZMQ send to {url} failed: {exc}") from None
        t_end = time.monotonic_ns()
        if nbytes:  # the embedding itself over ZMQ (zmq_to_* backends): its E→P transfer
            self.transfer_time.observe((t_end - t0) / 1e9)
        self.recorder.add(Span(msg.req_id, msg.part_idx, stage, self.recorder.node, t0, t_end, nbytes))

    # ---- lifetime ----
    async def _bounded(self, aw: Awaitable[T], what: str) -> T:
        """Await `aw` at most `timeout` seconds (504); an image the worker could not decode is a 400 naming the
        item, as at /encode; any other error of the ViT becomes a 500 with its message."""
        try:
            return await asyncio.wait_for(aw, self.settings.timeout)
        except asyncio.TimeoutError:
            raise GatewayTimeout(f"{what} did not come within {self.settings.timeout} s") from None
        except Exception as exc:
            raise _vit_error(exc, what) from None

    def sweep(self) -> None:
        """Release held embeddings and receive URLs older than the TTL."""
        cutoff = time.monotonic() - self.settings.embedding_ttl
        for req_id in [r for r, h in self.held.items() if h.created < cutoff]:
            self._release(req_id).future.cancel()  # drops the embedding (or a ViT not yet started)
            self.embeddings_expired += 1
        for req_id in [r for r, u in self.receive_urls.items() if u.created < cutoff and not u.awaited]:
            del self.receive_urls[req_id]
        for req_id in [r for r, since in self.released_ids.items() if since < cutoff]:
            del self.released_ids[req_id]

    async def run(self) -> None:
        """For the server's life (the floor runs it): sweep expired embeddings and receive URLs."""
        period = min(1.0, self.settings.embedding_ttl / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()

    def health(self) -> dict:
        dead = self.tp_group.dead_ranks if self.tp_group is not None else []
        return {"status": "ok" if not dead else f"TP rank(s) {dead} dead", "tp": self.settings.tp,
                "backend": self.settings.backend, "model": self.settings.model_name,
                "device": str(self.device), "dtype": self.settings.dtype, "node": self.recorder.node,
                "session_id": self.engine.session_id if self.engine is not None else None,
                "embeddings_held": len(self.held), "held_bytes": self.held_bytes,
                "admitted": self.admission.admitted, "admission": self.admission.stats(),
                "mm_global_cache": {"host_pool_bytes": self.global_cache.l2.capacity_bytes,
                                    "l3": self.settings.store_master if self.global_cache.store else None},
                "encoder_idx": self.encoder_idx}

    def metric_families(self) -> list[Metric]:
        """The encoder's ``/metrics`` families: its queue, ViT and E→P transfer times, held embeddings, bytes sent,
        the embedding cache (each level), its admission and engine."""
        m = self.metrics
        return [*m.instruments(), *(m.of(name, kind, help_, value) for name, kind, value, help_ in (
            ("embeddings_held", "gauge", len(self.held), "embeddings waiting for /send"),
            ("embeddings_expired", "counter", self.embeddings_expired, "embeddings released by the TTL"),
            ("embeddings_released", "counter", self.embeddings_released, "embeddings dropped by /release"),
            ("held_bytes", "gauge", self.held_bytes, "embedding bytes held for /send"),
            ("max_held_bytes", "gauge", self.settings.max_held_bytes, "embedding bytes held for /send at most"),
            ("refused_held_bytes", "counter", self.refused["held_bytes"],
             "/encode refused with 503: max_held_bytes reached"),
            ("bytes_sent", "counter", self.bytes_sent, "embedding bytes written or sent over ZMQ"),
            ("cache_hits", "counter", self.cache.hits, "images found in the embedding cache"),
            ("cache_misses", "counter", self.cache.misses, "images the ViT had to encode"),
            ("cache_evictions", "counter", self.cache.evictions, "cache entries evicted"),
            ("cache_entries", "gauge", len(self.cache), "images in the cache"),
            ("cache_bytes", "gauge", self.cache.num_bytes, "bytes in the cache"),
            ("tp_ranks", "gauge", self.settings.tp, "tensor-parallel ranks of this encoder (rank 0 serves and reports "
             "for the group)"),
            ("tp_dead_ranks", "gauge", len(self.tp_group.dead_ranks) if self.tp_group else 0,
             "ranks of this encoder's TP group known dead (then /health answers 503)"),
        )), *self.global_cache.metric_families(m), *self.admission.metric_families(m), *engine_metrics(m, self.engine)]

    def refusals(self) -> dict[str, float]:
        """Its admission's refusals (``admission_<reason>``), ``held_bytes`` (max_held_bytes reached) and peers
        refused at its engine's port (``transfer_auth``)."""
        return {**{f"admission_{reason}": n for reason, n in self.admission.refused.items()},
                "held_bytes": self.refused["held_bytes"], "transfer_auth": engine_auth_failures(self.engine)}

    def close(self) -> None:
        """Stop the worker, close the sockets and the engine."""
        self.worker.shutdown(wait=True, cancel_futures=True)
        self.decoder.shutdown(wait=True, cancel_futures=True)
        with self._vit_running:  # a ViT running where its media were read ends first
            pass
        self.sender.shutdown(wait=True, cancel_futures=True)
        self.global_cache.close()
        self.held.clear()
        self.pushers.close()
        if self.engine is not None:
            self.engine.close()
        if self.tp_group is not None:
            self.tp_group.close()


def item_key(raw: bytes, model_name: str, dtype: str, vision_config: dict[str, Any]) -> str:
    """The cache key of a media item's embedding (`embedding_key`): its bytes, the model (name, vision tower's
    config), the dtype, and this encoder's preprocessing settings."""
    preprocessing = {"patch": processor.PATCH_SIZE, "merge": processor.MERGE_SIZE,
                     "temporal": processor.TEMPORAL_PATCH_SIZE, "min_pixels": processor.MIN_PIXELS,
                     "max_pixels": processor.MAX_PIXELS}
    return embedding_key(content_hash(raw), model_name, dtype, preprocessing, vision_config)


_ending_vit = threading.local()  # `here`: this thread is completing a ViT's future (`_run_vit_into`)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """On the loop: `future`'s result or exception, unless its awaiter gave up (cancelled) meanwhile."""
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _vit_error(exc: BaseException, what: str) -> ServingError:
    """What answers a failed ViT: an image the worker could not decode is a 400 naming the item, as at /encode;
    any other error a 500 with its message."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, MediaError):  # the client's image, found corrupt only when decoded
        return BadRequest(str(exc))
    return ServingError(f"{what} failed: {type(exc).__name__}: {exc}")


def _item_error(idx: int, exc: MediaError) -> MediaError:
    """`exc` naming the item by its place in the part's mm_items, as every media error is answered."""
    return MediaError(f"mm_items[{idx}]: {exc}")


def _decode_item(item: _Item) -> Image.Image:
    """The item's pixels, as RGB; `MediaError` naming the item when its data is corrupt or truncated."""
    try:
        return load_rgb(item.image, item.name)
    except MediaError as exc:
        raise _item_error(item.idx, exc) from None


def _timed_decode(item: _Item) -> tuple[Image.Image, int]:
    """`_decode_item` in the decoder thread, with when it began (the ``decode`` span's start)."""
    t0 = time.monotonic_ns()
    return _decode_item(item), t0


def _decode_items(items: list[_Item]) -> tuple[list[Image.Image], int]:
    """The items' pixels, and when their decoding began: those whose decode did not start in the decoder thread
    are decoded here, from the last (the decoder takes them from the first), the others awaited."""
    t0 = time.monotonic_ns()
    images: list[Image.Image | None] = [None] * len(items)
    for k in reversed(range(len(items))):
        if items[k].decoded is None or items[k].decoded.cancel():
            images[k] = _decode_item(items[k])
    for k, item in enumerate(items):
        if images[k] is None:
            images[k], started = item.decoded.result()  # its MediaError, if any, raised here
            t0 = min(t0, started)
    return images, t0


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy on the CPU (msgpack copies them once into the frame), bfloat16 too;
    from a GPU, one copy to the host (the zmq backends carry bytes)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).cpu().numpy())


def create_app(settings: EncoderSettings) -> FastAPI:
    """The encode server's app; the model loads, and the engine and worker start, in its lifespan."""
    app = role_app("encoder", lambda: MMEncoder(settings), ROUTES)

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        t_in = time.monotonic_ns()
        server: MMEncoder = app.state.server
        ticket = await server.admission.enter()  # refused before its body is even read: it costs nothing more
        server.queue_time.observe((time.monotonic_ns() - t_in) / 1e9)

        async def body() -> bytes:
            raw = await read_body(request)
            if client_gone(request):  # e.g. read on waking from a freeze the receiver passed over
                raise ClientClosed("the client closed /encode before it was read: nothing is held for it")
            return raw

        return json_response(await server.encode(body(), ticket, t_in))

    @app.post("/send")
    async def send(request: Request) -> Response:
        return json_response(await app.state.server.send(await read_struct(request, SendRequest)))

    @app.post("/release")
    async def release(request: Request) -> Response:
        return json_response(app.state.server.release(await read_struct(request, ReleaseRequest)))

    @app.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        req = await read_struct(request, SchedulerReceiveUrl)
        url = app.state.server.set_receive_url(req)
        return json_response({"req_id": req.req_id, "receive_url": url, "receive_count": req.receive_count})

    return app


def main(argv: list[str] | None = None) -> int:
    """``epd-lab encoder``: serve until SIGINT/SIGTERM."""
    return serve_main(EncoderSettings, create_app, argv, "epd-lab encoder",
                      "the EPD encode server (ViT → embeddings)")


if __name__ == "__main__":
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
