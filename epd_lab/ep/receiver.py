"""The prefill side of E→P: split a request's media across encoders and collect their embeddings.

This is SGLang's `MMReceiver` (seed 000, `encode_receiver.py`) over epd_lab's transfer engine. Per
request:

1. `assign_items_by_modality`: shuffled encoders, per modality an even split, part ids running
   across modalities (``{rid}_local_part_{idx}``).
2. POST /encode to every encoder at once, with the seed's body (`encode_request`: ``encoder_idx``,
   the modality by its enum name, ``prefill_host``, ``embedding_port``).
3. ``mooncake``: one contiguous buffer for the whole request (the sum of the parts' sizes, parts in
   `part_idx` order), registered with the engine, then POST /send to each encoder: its own /encode
   answer updated with ``session_id`` and ``buffer_address = base + offset`` (`send_request`, the
   seed's body). Each encoder writes its part straight into the buffer and
   pushes a metadata-only notification over ZMQ. ``zmq_to_tokenizer`` / ``zmq_to_scheduler``: the
   bytes come inside the ZMQ message (``zmq_to_scheduler`` first tells each encoder where to send
   through /scheduler_receive_url, ``{req_id, receive_url="host:port", receive_count=1}``).
4. Wait for every part (bounded by the timeout), deregister (mooncake: in the thread that took the last
   notify, where a `Landing` callback may start a forward queued on the embeddings), slice each part by shape
   and dtype, concatenate per modality (mooncake: a modality's parts, side by side in the buffer, are one view).

Every failure reaches the caller as an `EPDError` within the timeout, and the request's buffer is
deregistered whatever happened; parts an encoder holds for a /send that will not come are released there
(``POST /release``) rather than left to its TTL.

Encoders are chosen by health, as the proxy chooses prefills and decodes, over the same `epd_lab.serving.Circuits`
(which are up, the probe schedule; this module does their I/O, in threads): one that refuses a connection is left
out for ``retry_after``; one that misses two ``/health`` probes in a row (each encoder probed each `PROBE_INTERVAL`
s, one probe at a time, each in its own thread), with nothing else heard from it meanwhile (each answer to an
/encode, /send or /scheduler_receive_url is: busy is not frozen), is *stalled*, left out until it answers, and
the exchanges in flight to it are cut at once. A part whose ``/encode`` got no answer (refused, cut, the encoder
died or stalled) or a 503 (at capacity: it holds nothing) goes to another encoder that is up, chosen at random; a
part already handed over (``/send`` sent, or the zmq backends' push awaited) fails the request at once when its
encoder stalls, instead of at the deadline.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import http.client
import logging
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from functools import partial

import msgspec
import torch
import zmq

from epd_lab.ep.messages import (
    BACKENDS,
    DTYPES,
    EmbeddingNotify,
    EncodeRequest,
    EncodeResponse,
    Modality,
    ReleaseRequest,
    SchedulerReceiveUrl,
    SendRequest,
    decode_zmq,
    part_req_id,
    zmq_url,
)
from epd_lab import security
from epd_lab.ep.messages import MAX_ZMQ_BYTES
from epd_lab.ep.push import NOTIFY_MAX_BYTES
from epd_lab.failpoints import failpoint
from epd_lab.http.client import HTTPError, KeepAliveClient
from epd_lab.serving import PROBE_INTERVAL, PROBE_TIMEOUT, Circuits
from epd_lab.serving.settings import check_at_least, check_choice, check_positive, check_urls
from epd_lab.trace import Recorder, clock_id
from epd_lab.transfer import TransferEngine, as_array, open_engine

log = logging.getLogger(__name__)

RELEASE_RETRY_S = 120.0  # a part whose /release got no answer is retried while its encoder may still hold it
# `receive`'s on_sizes: each modality's grids, and the mooncake backend's `Landing` (None for the zmq backends)
SizesCallback = Callable[[dict[str, list[list[int]]], "Landing | None"], None]
RECV_BUFFERS = ("auto", "host", "pinned", "device")  # where a request's buffer lives; auto: `resolve_recv_buffer`


class Landing:
    """A mooncake request's embeddings before they land, as `receive` hands them to its ``on_sizes``.

    `embeddings`: each modality's parts as ONE tensor viewed in the request's buffer (the parts lie there in
    part order), or None where they cannot be used in place (a pooled buffer, which is copied out; parts of
    several dtypes or widths). `when_landed(fn)`: fn() runs once, in the thread that took the last part's
    notify, right after the buffer's deregistration (no write can land after it), or when the request's wait
    ended otherwise (failed, timed out): on every path, exactly once. A GPU forward queued on the embeddings
    behind a gate (`epd_lab.models.runtime.gate`) opens it there.
    """

    def __init__(self, embeddings: dict[str, torch.Tensor] | None, parts: int, deregister: Callable[[], None]) -> None:
        self.embeddings = embeddings
        self._deregister = deregister
        self._lock = threading.Lock()
        self._waiting = parts
        self._landed = False
        self._callbacks: list[Callable[[], None]] = []
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.watched = False  # a callback was given: a forward was queued on the embeddings before they landed

    def when_landed(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the embeddings landed, or the wait for them ended (at once if it has)."""
        with self._lock:
            self.watched = True
            if not self._landed:
                self._callbacks.append(fn)
                return
        fn()

    def part_done(self, part: Future) -> None:
        """A part's future settled (its notify, or a failure): the last good notify lands the request."""
        if part.cancelled() or part.exception() is not None or part.result().error:
            return  # the waiting thread raises, then lands
        with self._lock:
            self._waiting -= 1
            if self._waiting:
                return
        self.land()

    def land(self) -> None:
        """Deregister the buffer and run the callbacks, once; a second call returns when the first one did (so
        no write lands after either). A deregistration's error is raised by `check`."""
        with self._lock:
            first = not self._landed
            self._landed = True
            callbacks, self._callbacks = self._callbacks, []
        if not first:
            self._done.wait()
            return
        try:
            self._deregister()
        except BaseException as exc:  # noqa: BLE001 (kept for the request's own thread: `check`)
            self._error = exc
        finally:
            for fn in callbacks:
                fn()
            self._done.set()

    def check(self) -> None:
        """Raise what the deregistration raised, if it did."""
        if self._error is not None:
            raise self._error


def resolve_recv_buffer(buffer: str, device: str) -> str:
    """``auto`` is pinned host memory where the prefill runs on CUDA (as the seed's receiver allocates it; the
    embeddings then go to the GPU in one copy), else pageable host memory; a named one is checked."""
    if buffer not in RECV_BUFFERS:
        raise ValueError(f"unknown receive buffer {buffer!r}; choose one of {', '.join(RECV_BUFFERS)}")
    if buffer == "auto":
        return "pinned" if device.startswith("cuda") else "host"
    if buffer != "host" and not device.startswith("cuda"):
        raise ValueError(f"a {buffer} receive buffer needs a CUDA device, got device={device!r}")
    return buffer


class EPDError(RuntimeError):
    """A request could not be served: which part, which encoder and why. `status` is the encoder's HTTP status
    where an encoder answered one (a 4xx is the request's fault), else None."""

    def __init__(self, message: str, status: int | None = None, refused: bool = False,
                 lost: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.refused = refused  # the encoder refused the connection: it never heard of the part
        self.lost = lost  # no answer, and not for want of time: refused, reset or cut (the encoder died)


@dataclass(frozen=True)
class PartPlan:
    """One part of a request: which encoder (its index in the receiver's encoder URLs) encodes which items."""

    part_idx: int
    encoder: int
    modality: str
    items: list[str]


def encode_request(rid: str, num_parts: int, plan: PartPlan, prefill_host: str,
                   embedding_port: int) -> EncodeRequest:
    """The /encode body of one part, as the seed's `MMReceiverHTTP.encode()` builds it; `ValueError` for a
    modality that is not a `Modality` name."""
    return EncodeRequest(plan.items, num_parts, plan.part_idx, part_req_id(rid, plan.part_idx),
                         Modality.from_str(plan.modality).name, prefill_host, embedding_port, plan.encoder)


def send_request(answer: EncodeResponse, session_id: str, buffer_address: int, prefill_host: str,
                 embedding_port: int, rkey: int) -> SendRequest:
    """The /send body of one part: its /encode `answer` updated with where to write (the seed's body), plus
    where to notify (as SGLang's /send reads it) and the registration's key (epd_lab's)."""
    return SendRequest(**msgspec.structs.asdict(answer), session_id=session_id, buffer_address=buffer_address,
                       prefill_host=prefill_host, embedding_port=embedding_port, rkey=rkey)


def assign_items_by_modality(items_by_modality: dict[str, list[str]], encoder_num: int,
                             rng: random.Random | None = None) -> list[PartPlan]:
    """The seed's `_assign_items_by_modality`: shuffle the encoders (against hot spots), split each
    modality's items evenly (the first `remainder` encoders take one more), give each encoder a
    contiguous run of items, and number the parts across modalities in that order."""
    if encoder_num < 1:
        raise ValueError("need at least one encoder")
    order = list(range(encoder_num))
    (rng or random).shuffle(order)
    plans: list[PartPlan] = []
    for modality, items in items_by_modality.items():
        base, remainder = divmod(len(items), encoder_num)
        start = 0
        for i, enc in enumerate(order):
            n = base + (1 if i < remainder else 0)
            if n:
                plans.append(PartPlan(len(plans), enc, modality, items[start:start + n]))
            start += n
    return plans


@dataclass
class ReceivedEmbeddings:
    """A request's embeddings, per modality in item order, with what the LLM needs besides."""

    rid: str
    embeddings: dict[str, torch.Tensor]
    grid_thw: dict[str, list[list[int]]]
    nbytes: int
    parts: list[PartPlan] = field(default_factory=list)
    # mooncake: (offset, embedding_size) of each part in the registered buffer, in part order
    part_ranges: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ReceiverConfig:
    """How the receiver talks to its encoders.

    Args:
        encoder_urls: base URLs of the encode servers (http:// or https://, at least one; kept as a tuple,
            without a trailing slash: `epd_lab.serving.check_urls`, as the prefill's ``--encoders``).
        backend: ``mooncake`` (one-sided write), ``zmq_to_tokenizer`` or ``zmq_to_scheduler``.
        timeout: seconds a request may take to collect every part before it fails.
        pool_bytes: 0 to allocate and register one buffer per request (as the seed does); otherwise
            the size of a persistent managed pool that request buffers are carved from.
        host: the address encoders push notifications to (and the engine listens on).
        transport: the transfer engine's protocol for this side.
        seed: seeds the shuffle of encoders (None: random).
        retry_after: seconds an encoder that refused a connection is left out of the plans (its parts go to
            the others meanwhile; after that it is tried again).
        buffer: where a request's buffer lives (mooncake, no pool): ``auto`` (`resolve_recv_buffer`), ``host``
            (pageable), ``pinned`` (page-locked host memory, as the seed's receiver allocates it) or ``device``
            (GPU memory on `device`: the encoder's GPU writes into it directly).
        device: the GPU of a ``device`` buffer, and where the prefill's model runs.
    """

    encoder_urls: Sequence[str]
    backend: str = "mooncake"
    timeout: float = 10.0
    pool_bytes: int = 0
    host: str = "127.0.0.1"
    transport: str = "auto"
    seed: int | None = None
    retry_after: float = 5.0
    buffer: str = "auto"
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.buffer = resolve_recv_buffer(self.buffer, self.device)
        if self.buffer != "host" and self.pool_bytes:
            raise ValueError(f"pool_bytes needs buffer='host' (the pool is the engine's managed host memory), "
                             f"not {self.buffer!r}")
        # the settings' checks, with their messages (built directly, a config skips PrefillSettings')
        check_at_least(self, 0, "retry_after", "pool_bytes")
        check_urls(self, "encoder_urls", "encoder")
        check_choice(self, "backend", BACKENDS)
        check_positive(self, "timeout")


class _Pool:
    """First-fit allocator over one managed buffer: request buffers come from here, and the memory is
    never handed to anything but the pool (so a late write can only land in pool memory)."""

    def __init__(self, engine: TransferEngine, nbytes: int) -> None:
        self.engine = engine
        self.base = engine.allocate_managed_buffer(nbytes)
        self.view = torch.from_numpy(as_array(self.base, nbytes))
        self.free = [(0, nbytes)]  # (offset, length), sorted
        self.lock = threading.Lock()

    def alloc(self, nbytes: int) -> int:
        size = (nbytes + 63) & ~63  # cache-line aligned slices
        with self.lock:
            for i, (off, length) in enumerate(self.free):
                if length >= size:
                    self.free[i:i + 1] = [(off + size, length - size)] if length > size else []
                    return off
        raise EPDError(f"embedding pool exhausted: {nbytes} bytes wanted; raise pool_bytes")

    def release(self, off: int, nbytes: int) -> None:
        size = (nbytes + 63) & ~63
        with self.lock:
            self.free.append((off, size))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for o, n in self.free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self.free = merged

    def close(self) -> None:
        self.engine.free_managed_buffer(self.base)


class EmbeddingReceiver:
    """Collects embeddings from encode servers; a context manager (closes its engine and sockets)."""

    def __init__(self, config: ReceiverConfig, recorder: Recorder | None = None) -> None:
        self.config = config
        self.recorder = recorder or Recorder("prefill")
        self.engine = open_engine(config.transport, config.host, config.timeout)
        self._rng = random.Random(config.seed)
        self._pool = _Pool(self.engine, config.pool_bytes) if config.pool_bytes else None
        self._http = KeepAliveClient(config.timeout)
        self._io = ThreadPoolExecutor(max_workers=32, thread_name_prefix="epd-receiver")
        self._pending: dict[str, Future] = {}
        self._owner: dict[str, int] = {}  # part id -> the encoder that took it (its /encode answered)
        # parts whose /release got no answer (the encoder stalled), per encoder: sent again once it answers
        self._unreleased: list[dict[str, float]] = [{} for _ in config.encoder_urls]
        self._encoders = Circuits(len(config.encoder_urls), config.retry_after)
        self._lock = threading.Lock()
        self.counters = collections.Counter()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # mooncake's notifications are metadata; the zmq backends carry the embedding bytes
        max_frame = NOTIFY_MAX_BYTES if config.backend == "mooncake" else MAX_ZMQ_BYTES
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame + security.TAG_BYTES)
        self._secret = security.load_secret()
        self._refusals = security.RefusalLog(log, "E→P notifications")
        self.embedding_port = self._pull.bind_to_random_port(f"tcp://{config.host}")
        self._closing = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="epd-receiver-zmq", daemon=True)
        self._listener.start()
        # probes in threads of their own: /encode and /send exchanges waiting on a frozen encoder delay none
        self._probes = ThreadPoolExecutor(max_workers=len(config.encoder_urls), thread_name_prefix="epd-receiver-probe")
        self._monitor = threading.Thread(target=self._probe_encoders, name="epd-receiver-monitor", daemon=True)
        self._monitor.start()

    # ---- notifications ----
    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closing.is_set():
            if not poller.poll(100):
                continue
            frame = self._pull.recv(copy=False)
            t_recv = time.monotonic_ns()
            try:
                msg = decode_zmq(security.verify(self._secret, security.EP_NOTIFY, frame.buffer))
            except security.AuthError:
                self.counters["unauthenticated_messages"] += 1  # no valid tag of the secret: never decoded
                self._refusals(self.counters["unauthenticated_messages"], frame)
                continue
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.counters["invalid_messages"] += 1  # validated, never trusted: drop it
                continue
            if msg.spans and msg.spans[-1].t_end_ns == msg.spans[-1].t_start_ns and msg.clock == clock_id():
                # a message cannot time its own sending: it ends when it arrives, if read on the sender's clock
                # (another host's arrival time would be on another clock: the send then stays zero-length)
                msg.spans[-1] = msgspec.structs.replace(msg.spans[-1], t_end_ns=t_recv)
            with self._lock:
                fut = self._pending.get(msg.req_id)
            try:
                if fut is None:
                    raise InvalidStateError
                fut.set_result(msg)
            except InvalidStateError:
                self.counters["stray_messages"] += 1  # a part that already failed or timed out

    # ---- the request ----
    def receive(self, mm_items: list[str], rid: str | None = None, modality: str = "image",
                on_sizes: SizesCallback | None = None) -> ReceivedEmbeddings:
        """Encode `mm_items` on the encoders and return their embeddings (raises `EPDError`). `on_sizes(grids,
        landing)`, when given, is called in this thread with each modality's grids once every /encode answered
        (mooncake: and every /send went out), while the embeddings are still on their way: what their prompt
        needs can be made ready meanwhile; what it raises fails the request as it is. `landing`: mooncake's
        `Landing` (where the embeddings will be, and when they are), None for the zmq backends."""
        return self.receive_by_modality({modality: list(mm_items)}, rid, on_sizes)

    def receive_by_modality(self, items_by_modality: dict[str, list[str]], rid: str | None = None,
                            on_sizes: SizesCallback | None = None) -> ReceivedEmbeddings:
        """As `receive`, for several modalities at once (parts numbered across them). A modality is a
        `Modality` name in any case (``"image"``); `ValueError` for another."""
        for modality in items_by_modality:  # refused before any encoder hears of the request
            Modality.from_str(modality)
        rid = rid or uuid.uuid4().hex
        deadline = time.monotonic() + self.config.timeout
        up = self._up_encoders()
        plans = [replace(p, encoder=up[p.encoder])
                 for p in assign_items_by_modality(items_by_modality, len(up), self._rng)]
        if not plans:
            raise EPDError(f"request {rid} has no media items")
        futures = {part_req_id(rid, p.part_idx): Future() for p in plans}
        with self._lock:
            self._pending.update(futures)
        sent: set[str] = set()  # mooncake: parts whose /send the encoder answered (so it holds them no more)
        try:
            plans, responses = map(list, zip(*self._parallel(plans, lambda p: self._start_part(rid, len(plans), p))))
            sized = (lambda landing: on_sizes(_grids(plans, responses), landing)) if on_sizes is not None else None
            if self.config.backend == "mooncake":
                return self._receive_mooncake(rid, plans, responses, futures, deadline, sent, sized)
            if sized is not None:
                sized(None)
            messages = self._wait(rid, plans, futures, deadline)
            with self.recorder.span("reassemble", rid, nbytes=sum(len(m.data) for m in messages)):
                tensors = [_tensor_from_bytes(m, bytearray(m.data)) for m in messages]
                return self._assemble(rid, plans, messages, tensors)
        except BaseException:
            if self.config.backend == "mooncake":  # parts encoded and held for a /send that will not come
                with self._lock:
                    held = [(key, self._owner[key]) for key in futures if key in self._owner and key not in sent]
                for key, encoder in held:
                    self._io.submit(self._release, key, encoder)
            raise
        finally:
            with self._lock:
                for key in futures:
                    self._pending.pop(key, None)
                    self._owner.pop(key, None)

    def _receive_mooncake(self, rid: str, plans: list[PartPlan], responses: list[EncodeResponse],
                          futures: dict[str, Future], deadline: float, sent: set[str],
                          sized: Callable[[Landing], None] | None) -> ReceivedEmbeddings:
        sizes = [r.embedding_size for r in responses]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        with self.recorder.span("buffer_alloc", rid, nbytes=total):
            if self._pool is not None:
                pool_off = self._pool.alloc(total)
                buf = self._pool.view[pool_off:pool_off + total]
            else:
                buf = self._buffer(total)
        base = buf.data_ptr()
        try:
            # each part's tensor, viewed as its /encode answer describes it, before the wait: the thread that wakes
            # when the notifies come goes on at once (after a wait its first tensor operations run cold)
            views = [_answered_view(r, buf[offsets[i]:offsets[i] + sizes[i]]) for i, r in enumerate(responses)]
            joined = None if self._pool is not None else _joined(plans, views, buf, offsets, sizes)
            with self.recorder.span("register", rid, nbytes=total):
                rkey = self.engine.register(base, total)
            landing = Landing(joined, len(plans), partial(self.engine.deregister, base))
            try:
                failpoint("prefill.between_encode_and_send")
                # the notifies are awaited, not the /send answers: an answer comes after its notify, one loop
                # and one HTTP response later; a /send that fails fails its part's wait at once
                sends = [self._io.submit(self._send, rid, p, base + offsets[p.part_idx], responses[p.part_idx],
                                         rkey, sent) for p in plans]
                for plan, send in zip(plans, sends):
                    send.add_done_callback(partial(_fail_part, futures[part_req_id(rid, plan.part_idx)]))
                for part in futures.values():
                    part.add_done_callback(landing.part_done)
                try:
                    if sized is not None:
                        sized(landing)
                    messages = self._wait(rid, plans, futures, deadline)
                except BaseException as exc:
                    # every /send settled first: the caller then knows what each encoder holds; an error notify
                    # carries no status, its /send answer does (an image that does not decode: 400)
                    concurrent.futures.wait(sends, max(0.0, deadline - time.monotonic()))
                    answered = [e for e in (s.exception() for s in sends if s.done())
                                if isinstance(e, EPDError) and e.status is not None]
                    if isinstance(exc, EPDError) and exc.status is None and answered:
                        raise answered[0] from None
                    raise
            finally:
                landing.land()  # no write can land once this returns (the last notify's thread may have already)
            landing.check()
            # a forward queued on the embeddings runs already: the checks are off its path, and no reassemble
            # span lies inside its prefill span
            with contextlib.nullcontext() if landing.watched else self.recorder.span("reassemble", rid, nbytes=total):
                for m, r in zip(messages, responses, strict=True):
                    _check_notified(m, r)
                # pool memory goes back to the pool: copy out; a per-request buffer is viewed in place
                tensors = [v.clone() for v in views] if self._pool is not None else views
                got = self._assemble(rid, plans, messages, tensors, joined)
                got.part_ranges = list(zip(offsets, sizes))
                return got
        finally:
            if self._pool is not None:
                self._pool.release(pool_off, total)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A request's own buffer (registered, written, viewed in place): pinned and GPU memory come from
        PyTorch's caching allocators, so a steady stream of requests allocates nothing from the driver."""
        if self.config.buffer == "device":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.config.device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.config.buffer == "pinned")

    def _assemble(self, rid: str, plans: list[PartPlan], messages: list[EmbeddingNotify],
                  tensors: list[torch.Tensor], joined: dict[str, torch.Tensor] | None = None) -> ReceivedEmbeddings:
        """`MultiModalEmbeddingData`: concatenate each modality's parts in part order (`joined`: already one
        tensor each, viewed where the parts lie side by side)."""
        embeddings = joined
        if embeddings is None:
            by_mod: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
            for plan, t in zip(plans, tensors, strict=True):
                by_mod[plan.modality].append(t)
            embeddings = {m: ts[0] if len(ts) == 1 else torch.cat(ts) for m, ts in by_mod.items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return ReceivedEmbeddings(rid, embeddings, _grids(plans, messages), nbytes, plans)

    def _wait(self, rid: str, plans: list[PartPlan], futures: dict[str, Future],
              deadline: float) -> list[EmbeddingNotify]:
        """Every part's message, in part order; the first error or the deadline fails the request."""
        out = []
        for plan in plans:
            key = part_req_id(rid, plan.part_idx)
            try:
                msg = futures[key].result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise EPDError(f"{key}: no notification from encoder {self._url(plan)} within "
                               f"{self.config.timeout} s (encoder dead or stuck?)") from None
            if msg.error:
                raise EPDError(f"{key}: encoder {self._url(plan)} failed: {msg.error}")
            self.recorder.extend(msg.spans)
            out.append(msg)
        return out

    # ---- encoders ----
    def _up_encoders(self) -> list[int]:
        """The encoders the plans may use: those up (all of them when none is: they are tried again rather than
        failing the request unasked)."""
        return self._encoders.up() or list(range(len(self._encoders)))

    def _probe_encoders(self) -> None:
        """The monitor thread: the probe schedule's tick each `PROBE_INTERVAL` (`Circuits.probe_due`)."""
        while not self._closing.wait(PROBE_INTERVAL):
            self._encoders.probe_due(partial(self._probes.submit, self._probe))

    def _probe(self, encoder: int) -> None:
        """Probe `encoder`'s /health: cut what waits on it if this probe finds it stalled; once it answers, tell it
        again the releases it missed."""
        answered = _health_answers(self.config.encoder_urls[encoder])
        if self._encoders.liveness[encoder].probed(answered):
            self._stalled(encoder)
        if answered and self._unreleased[encoder]:
            with self._lock:
                keys, self._unreleased[encoder] = list(self._unreleased[encoder]), {}
            for key in keys:
                self._io.submit(self._release, key, encoder)

    def _stalled(self, encoder: int) -> None:
        """Encoder `encoder` stopped making progress: cut its exchanges in flight (an /encode goes on to another
        encoder) and fail the parts it holds (their requests fail now, not at their deadline)."""
        url = self.config.encoder_urls[encoder]
        self.counters["encoder_stalls"] += 1
        self._http.interrupt(url)
        error = EPDError(f"encoder {url} stopped making progress (no answer to its /health probes)", lost=True)
        with self._lock:
            waiting = [self._pending.get(key) for key, owner in self._owner.items() if owner == encoder]
        for fut in waiting:
            with contextlib.suppress(InvalidStateError, AttributeError):  # arrived meanwhile, or done
                fut.set_exception(error)

    def _release(self, key: str, encoder: int) -> None:
        """Tell `encoder` to drop part `key`, held for a /send that will not come; one that does not answer is
        told again once it answers its probes (for up to `RELEASE_RETRY_S`; its own TTL bounds the hold anyway)."""
        try:
            status, _ = self._http.post(self.config.encoder_urls[encoder] + "/release",
                                        msgspec.json.encode(ReleaseRequest(key)))
        except HTTPError:
            now = time.monotonic()
            with self._lock:
                pending = self._unreleased[encoder]
                for stale in [k for k, since in pending.items() if now - since > RELEASE_RETRY_S]:
                    del pending[stale]
                pending.setdefault(key, now)
            self.counters["parts_release_deferred"] += 1
            return
        self._encoders.liveness[encoder].heard()  # an answer, as to /encode and /send
        self.counters["parts_released" if status == 200 else "parts_release_failed"] += 1

    def _start_part(self, rid: str, num_parts: int, plan: PartPlan) -> tuple[PartPlan, EncodeResponse]:
        """Hand a part to its encoder (zmq_to_scheduler: its receive URL, then /encode). When the exchange gets no
        answer, and not for want of time (the encoder refused the connection, died or stalled with the request in
        flight), or a 503, the part goes to the next encoder that is up; one that refused is left out for
        `retry_after`. A late message from the first encoder is dropped as a stray. An encoder that answers
        another error, or does not answer in time, fails the request. Returns the plan as it was served, and the
        /encode answer."""
        tried: list[int] = []
        while True:
            tried.append(plan.encoder)
            try:
                if self.config.backend == "zmq_to_scheduler":
                    self._scheduler_receive_url(rid, plan)
                answer = self._encode(rid, num_parts, plan)
                with self._lock:
                    self._owner[answer.req_id] = plan.encoder
                return plan, answer
            except EPDError as exc:
                if not (exc.lost or exc.status == 503):  # 503: at capacity, it holds nothing
                    raise
                if exc.lost and not exc.refused and self.config.backend == "mooncake":
                    # it may have taken the part (the answer was lost, or it reads the request on waking)
                    self._io.submit(self._release, part_req_id(rid, plan.part_idx), plan.encoder)
                spare = [i for i in self._up_encoders() if i not in tried]
                if not spare:
                    raise
                self.counters["encoder_failovers"] += 1
                plan = replace(plan, encoder=self._rng.choice(spare))

    # ---- HTTP ----
    def _url(self, plan: PartPlan) -> str:
        return self.config.encoder_urls[plan.encoder]

    def _parallel(self, plans: list[PartPlan], fn) -> list:
        if len(plans) == 1:  # one part: in this thread, without a hop to the pool (0.2 ms on a 2-vCPU host)
            return [fn(plans[0])]
        futs = [self._io.submit(fn, p) for p in plans]
        concurrent.futures.wait(futs)  # all settled first: a failed request then knows every part an encoder holds
        return [f.result() for f in futs]  # re-raises the first failure

    def _post(self, plan: PartPlan, route: str, body: msgspec.Struct) -> bytes:
        url = self._url(plan) + route
        try:
            status, content = self._http.post(url, msgspec.json.encode(body))
        except HTTPError as exc:
            if exc.refused:  # left out of the plans for a while: its parts go to the other encoders
                self._encoders.liveness[plan.encoder].refused()
            raise EPDError(f"{route} to {url} failed: {exc}", refused=exc.refused, lost=not exc.timed_out) from exc
        self._encoders.liveness[plan.encoder].heard()  # it answered: busy maybe, not frozen (as the proxy's pools)
        if status != 200:
            raise EPDError(f"{route} to {url} answered {status}: {content[:300].decode(errors='replace')}", status)
        return content

    def _encode(self, rid: str, num_parts: int, plan: PartPlan) -> EncodeResponse:
        req = encode_request(rid, num_parts, plan, self.config.host, self.embedding_port)
        with self.recorder.span("http_encode", rid, plan.part_idx):
            raw = self._post(plan, "/encode", req)
        answer = msgspec.json.decode(raw, type=EncodeResponse)
        if (answer.req_id, answer.part_idx) != (req.req_id, req.part_idx):  # /send posts this answer back
            raise EPDError(f"{req.req_id}: encoder {self._url(plan)} answered for {answer.req_id} "
                           f"part {answer.part_idx}")
        return answer

    def _send(self, rid: str, plan: PartPlan, address: int, answer: EncodeResponse, rkey: int,
              sent: set[str]) -> None:
        req = send_request(answer, self.engine.session_id, address, self.config.host, self.embedding_port, rkey)
        with self.recorder.span("http_send", rid, plan.part_idx, nbytes=answer.embedding_size):
            try:
                self._post(plan, "/send", req)
            except EPDError as exc:
                if exc.status is not None:  # answered: it holds the part no more
                    sent.add(answer.req_id)
                raise
            sent.add(answer.req_id)

    def _scheduler_receive_url(self, rid: str, plan: PartPlan) -> None:
        # the seed's "host:port", no scheme; this process is the scheduler here, its only rank: receive_count 1
        url = zmq_url(self.config.host, self.embedding_port).removeprefix("tcp://")
        self._post(plan, "/scheduler_receive_url", SchedulerReceiveUrl(part_req_id(rid, plan.part_idx), url))

    # ---- lifetime ----
    def close(self) -> None:
        """Stop listening, close sockets, the HTTP client, the pool and the engine. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._listener.join()
        self._monitor.join()
        self._probes.shutdown(wait=True, cancel_futures=True)  # before _io: a probe that answers submits releases
        self._pull.close()
        self._ctx.term()
        self._io.shutdown(wait=True, cancel_futures=True)
        self._http.close()
        if self._pool is not None:
            self._pool.close()
        self.engine.close()

    def __enter__(self) -> "EmbeddingReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _health_answers(url: str) -> bool:
    """Whether `url`'s /health answers 200 within `PROBE_TIMEOUT`."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=PROBE_TIMEOUT)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _fail_part(part: Future, send: Future) -> None:
    """A part's /send failed: its wait ends with that error (unless its notify, or another error, came first)."""
    exc = send.exception()
    if exc is not None:
        with contextlib.suppress(InvalidStateError):
            part.set_exception(exc)


def _grids(plans: list[PartPlan], answers: Sequence[EncodeResponse | EmbeddingNotify]) -> dict[str, list[list[int]]]:
    """Each modality's image grids, its parts' in part order (from their /encode answers or their notifies)."""
    grids: dict[str, list[list[int]]] = collections.defaultdict(list)
    for plan, answer in zip(plans, answers, strict=True):
        grids[plan.modality].extend(answer.grid_thw)
    return dict(grids)


def _joined(plans: list[PartPlan], views: list[torch.Tensor], buf: torch.Tensor, offsets: list[int],
            sizes: list[int]) -> dict[str, torch.Tensor] | None:
    """Each modality's parts as one tensor viewed in `buf` (they lie there in part order), or None when some
    modality's parts are not one run of one dtype and width."""
    runs: dict[str, list[int]] = collections.defaultdict(list)
    for i, plan in enumerate(plans):
        runs[plan.modality].append(i)
    out = {}
    for modality, idx in runs.items():
        first, last = idx[0], idx[-1]
        if idx != list(range(first, last + 1)) or len({(views[i].dtype, views[i].shape[1]) for i in idx}) != 1:
            return None
        out[modality] = buf[offsets[first]:offsets[last] + sizes[last]].view(views[first].dtype).view(
            -1, views[first].shape[1])
    return out


def _tensor_from_bytes(msg: EmbeddingNotify, raw: bytearray) -> torch.Tensor:
    """The part's bytes (the zmq backends' message) viewed as the tensor the message describes."""
    return _viewed(msg.req_id, torch.frombuffer(raw, dtype=torch.uint8), msg.shape, msg.dtype)


def _answered_view(answer: EncodeResponse, region: torch.Tensor) -> torch.Tensor:
    """A mooncake part's region of the request's buffer viewed as its /encode answer's tensor."""
    return _viewed(answer.req_id, region, [answer.embedding_len, answer.embedding_dim], answer.dtype)


def _check_notified(msg: EmbeddingNotify, answer: EncodeResponse) -> None:
    """A mooncake notify must describe the tensor its part's /encode answer announced (and its buffer was sized
    and viewed for); `EPDError` otherwise."""
    announced = [answer.embedding_len, answer.embedding_dim]
    if (msg.shape, msg.dtype) != (announced, answer.dtype):
        raise EPDError(f"{msg.req_id}: the notify describes {msg.shape} of {msg.dtype}, its /encode answer "
                       f"{announced} of {answer.dtype}")


def _viewed(req_id: str, raw: torch.Tensor, shape: list[int], dtype_name: str) -> torch.Tensor:
    """`raw` (uint8) viewed as `shape` of `dtype_name`; `EPDError` when the dtype is unknown or the bytes do not
    hold exactly that."""
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise EPDError(f"{req_id}: unknown dtype {dtype_name!r}")
    want = 1
    for d in shape:
        want *= d
    if raw.numel() != want * dtype.itemsize:
        raise EPDError(f"{req_id}: {raw.numel()} bytes do not hold shape {shape} of {dtype_name}")
    return raw.view(dtype).view(shape)
