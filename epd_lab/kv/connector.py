"""The P→D side channel (seed 003): the producer (prefill) serves a ZMQ ROUTER, the consumer (decode) asks
over REQ, the producer writes the blocks with one batch write and answers ``TRANS_DONE`` / ``TRANS_ERROR``.

    producer = KVProducer(engine, cache, free_blocks=blocks.free)      # prefill
    producer.request_finished(request_id, block_ids)                   # after its prefill wrote the KV
    producer.abort(request_id)                                         # decode will never ask: free now
    consumer = KVConsumer(engine, cache)                               # decode
    consumer.receive_kv(producer.url, request_id, block_ids)           # returns once the KV is in place

Seed 003's names for the same jobs (Mooncake's vLLM connector):

- ``request_finished()`` (producer, scheduler side): `KVProducer.request_finished`. The blocks are held (the
  seed's ``delay_free_blocks``) until decode's ``TRANS_DONE`` / ``TRANS_ERROR`` or `free_timeout`; the prefill
  server answers the ``kv_transfer_params`` decode calls back with.
- ``register_kv_caches()`` (worker side): `PagedKVCache.register_kv_caches`, which registers every K and V
  region once and gives `base_addrs`, the seed's ``kv_caches_base_addr``.
- ``_handle_handshake()``: `KVProducer._handle_handshake` decodes the `MooncakeAgentMetadata` decode sent. The
  seed hands it to a thread pool (``_handshake_executor``) that calls ``send_kv_to_decode()``; here the ask
  waits in the one serving thread until every request it names is finished, then
  `KVProducer.send_kv_to_decode` writes and answers.
- ``_send_blocks()``: `KVProducer._send_blocks`, the addresses ``base + block_id * block_len`` of the runs that
  ``group_concurrent_contiguous()`` (`epd_lab.kv.runs`) merges, in one ``batch_transfer_sync_write``.
- ``receive_kv()`` (consumer, worker side): `KVConsumer.receive_kv`. The seed's ``start_load_kv()``, which
  starts one ``receive_kv`` thread per remote host, has no counterpart: the decode server calls `receive_kv`
  per request from its own threads.

This project's extensions, not in the seed: `KVProducer.announce` and `KVConsumer.query` (the pipelined
handshake), and `KVProducer.abort`.

Bounded everywhere, so no request waits forever (vLLM #35943): the producer answers ``TRANS_ERROR`` for a
request not finished (`request_finished`) within `timeout`, and frees a finished request's blocks once it is
answered or after `free_timeout` if decode never asks; the consumer raises `KVTransferError` on
``TRANS_ERROR``, after `timeout` without an answer (producer dead or stuck), or on a reply it cannot decode; a
caller may pass a shorter wait (decode: what is left of the request's deadline, so that a producer that died
mid-transfer fails the request within its deadline, not a whole `timeout` after decode asked).

Abort (what vLLM's proxy does when decode fails): `abort` frees a finished request's blocks at once instead of
after `free_timeout`, and for `free_timeout` afterwards an ask for that request is answered
``TRANS_ERROR`` "aborted" at once, and `request_finished` for it is refused (a prefill still running when the
abort came).

Limit kept from the seed: after a consumer timed out, a producer that was only slow may still write into
the blocks it named. Decode should not hand those blocks to another request before the producer's
`timeout` has passed too.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from epd_lab import security
from epd_lab.kv.messages import (
    MAX_MESSAGE_BYTES,
    KVAux,
    KVPlan,
    KVQuery,
    MooncakeAgentMetadata,
    TransDone,
    TransError,
    decode_ask,
    decode_reply,
    encode,
)
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.kv.runs import BlockCopies, block_copies
from epd_lab.kv.tp_plan import CacheGeometry, KVLayout, StridedCopies, head_copies, plan_kv_transfer
from epd_lab.failpoints import failpoint
from epd_lab.transfer.engine import parse_session_id

log = logging.getLogger(__name__)

MAX_REQUEST_IDS = 64  # requests one ask may name (decode names one per ask)
MAX_WAITING = 512  # asks and queries waiting at once on a producer
MAX_WAITING_PER_PEER = 128  # of them from one sender address (a decode admits 64 requests at once by default)


_peek = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def _named_requests(payload: memoryview) -> int:
    """How many request ids an ask's msgpack map names, read from the array's header without decoding them (a
    walk that builds no strings, about a hundred times cheaper than decoding 20,000 ids). -1 when there is no
    such array (the full decode then says what is wrong)."""
    try:
        raw = bytes(_peek.decode(payload).get("request_ids", b""))
    except msgspec.DecodeError:
        return -1
    if raw and 0x90 <= raw[0] <= 0x9F:
        return raw[0] & 0x0F
    if raw[:1] == b"\xdc":
        return int.from_bytes(raw[1:3], "big")
    if raw[:1] == b"\xdd":
        return int.from_bytes(raw[1:5], "big")
    return -1


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's IP address (ZMQ's message property), for the per-peer bound."""
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:  # not a TCP transport
        return ""


def _layout_of(cache: PagedKVCache, layout: KVLayout | None) -> KVLayout:
    """`layout`, checked against the rank's cache (its KV heads); None: one rank holding the cache's heads."""
    layout = layout or KVLayout(cache.num_kv_heads)
    if layout.local_heads != cache.num_kv_heads:
        raise ValueError(f"rank {layout.tp_rank} of tp {layout.tp_size} holds {layout.local_heads} of "
                         f"{layout.num_kv_heads} KV heads, but its cache has {cache.num_kv_heads}")
    return layout


REPLY_SLACK_S = 0.5  # a consumer waits this much past its timeout for the producer's answer (see KVConsumer)


def _tagged_reply(frame: memoryview) -> bool:
    """Whether `frame` reads as a reply behind a tag (`security.sign`): what a producer with a secret sends."""
    try:
        decode_reply(frame[security.TAG_BYTES:])
    except (msgspec.DecodeError, ValueError):
        return False
    return True


class KVTransferError(RuntimeError):
    """The KV of a request did not arrive: ``TRANS_ERROR`` (its `reason`), a timeout, or a dead producer."""

    def __init__(self, message: str, reason: str = "failed") -> None:
        super().__init__(message)
        self.reason = reason


class KVAuthenticationError(KVTransferError):
    """The producer and this consumer do not share the secret (`epd_lab.security`): one has another or none. The
    producer was reached; asking again cannot help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="unauthenticated")


class KVTransferTimeout(KVTransferError):
    """No answer from the producer in time: it may still write into the blocks (quarantine them)."""


class RequestAborted(ValueError):
    """`KVProducer.request_finished` (or `announce`) for a request that was aborted first."""


class AlreadyHeld(ValueError):
    """`KVProducer.request_finished` (or `announce`) for a request whose KV is already waiting for decode."""


@dataclass(slots=True)
class _Held:
    """A finished request's blocks, held for decode (the seed's delay_free_blocks)."""

    block_ids: list[int]
    expires: float  # monotonic time after which the blocks are freed unasked
    aux: KVAux | None = None  # sent with TRANS_DONE (a pipelined decode learns the first token there)
    asked: set[int] = field(default_factory=set)  # the decode TP ranks answered so far: each rank asks once


@dataclass(slots=True)
class _Query:
    envelope: list[bytes]
    request_id: str
    deadline: float  # monotonic time after which a request still not announced is an error
    peer: str = ""  # the sender's address: the per-peer bound on waiting work

    @property
    def request_ids(self) -> list[str]:
        return [self.request_id]


@dataclass(slots=True)
class _Ask:
    envelope: list[bytes]  # ROUTER identity and REQ delimiter: where the reply goes
    metadata: MooncakeAgentMetadata
    deadline: float  # monotonic time after which a request still not finished is an error
    peer: str = ""

    @property
    def request_ids(self) -> list[str]:
        return self.metadata.request_ids


class KVProducer:
    """The prefill side: serves the consumers' metadata on a ROUTER socket from one thread.

    Args:
        engine: the transfer engine the cache is registered with (the writes' source).
        cache: the prefill's registered `PagedKVCache`.
        free_blocks: called with a request's block ids once the producer is done with them (after its
            answer, or after `free_timeout` unasked, or at `close`): the seed's delayed free; typically
            `BlockManager.free`.
        host, port: where the ROUTER binds; port 0 lets the OS choose (`url` tells).
        timeout: seconds an ask waits for its requests' `request_finished` before ``TRANS_ERROR``.
        free_timeout: seconds a finished request waits to be asked before its blocks are freed.
        max_request_ids: requests one ask may name; an ask naming more is answered ``TRANS_ERROR`` at once.
        max_waiting: asks and queries waiting (for requests not yet finished or announced) at once; past it, or
            past `max_waiting_per_peer` from one sender address, a new one is answered ``TRANS_ERROR`` at once.
            An ask whose requests are all finished is served on arrival and never waits.
        secret: the shared secret whose tag every ask must carry (`epd_lab.security`); None takes ``EPD_SECRET``
            from the environment. Replies are tagged with it too.
        layout: this prefill rank's place in its TP group (`tp_plan.KVLayout`); None: one rank holding every KV
            head. A decode rank names its own in its metadata; this rank writes the head slices the plan between
            the two group sizes gives it (`tp_plan.plan_kv_transfer`), possibly none, and refuses a decode whose
            model has another KV layout.

    Waiting work is indexed by request id: `request_finished`, `announce` and `abort` re-examine only the asks
    naming that request, so the serving thread's work per event does not grow with what waits.
    """

    def __init__(self, engine: Any, cache: PagedKVCache, *, free_blocks: Callable[[list[int]], None],
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 5.0, free_timeout: float = 30.0,
                 max_request_ids: int = MAX_REQUEST_IDS, max_waiting: int = MAX_WAITING,
                 max_waiting_per_peer: int = MAX_WAITING_PER_PEER, secret: bytes | str | None = None,
                 layout: KVLayout | None = None) -> None:
        self.layout = _layout_of(cache, layout)
        if timeout <= 0 or free_timeout <= 0:
            raise ValueError(f"timeout and free_timeout must be positive, got {timeout}, {free_timeout}")
        if min(max_request_ids, max_waiting, max_waiting_per_peer) < 1:
            raise ValueError(f"max_request_ids, max_waiting and max_waiting_per_peer must be at least 1, got "
                             f"{max_request_ids}, {max_waiting}, {max_waiting_per_peer}")
        if not cache.keys:
            raise ValueError("the cache is not registered with a transfer engine")
        self.engine, self.cache, self.free_blocks = engine, cache, free_blocks
        self.timeout, self.free_timeout = timeout, free_timeout
        self.max_request_ids, self.max_waiting = max_request_ids, max_waiting
        self.max_waiting_per_peer = max_waiting_per_peer
        self._secret = security.resolve(secret)
        self._held: dict[str, _Held] = {}
        self._plans: dict[str, tuple[KVPlan, float]] = {}  # announced: (plan, when it is forgotten unasked)
        self._aborted: dict[str, float] = {}  # request id → monotonic time its abort is forgotten
        self._dirty: set[str] = set()  # request ids finished, announced or aborted since the thread last looked
        # waiting asks and queries, touched by the serving thread only: by sequence number, by the request ids
        # they name, by sender, and their deadlines (a heap; entries of answered ones are skipped)
        self._waiting: dict[int, _Ask | _Query] = {}
        self._by_rid: dict[str, set[int]] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._deadlines: list[tuple[float, int]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("transfers_done", "transfers_failed", "requests_done", "requests_failed", "requests_expired",
             "requests_aborted", "malformed", "unauthenticated", "asks_refused", "blocks_freed", "bytes_sent"), 0)
        self._refusals = security.RefusalLog(log, "KV side channel")
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # a larger frame is dropped by ZMQ, and its sender disconnected, before any of it is buffered here
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + security.TAG_BYTES)
        try:
            self._socket.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.url: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # request_finished(), announce(), abort() and close() wake the serving thread through this pipe; the
        # thread owns the socket.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kv-producer", daemon=True)
        self._thread.start()

    # ---- the scheduler side ----
    def announce(self, request_id: str, prompt_len: int, num_blocks: int) -> None:
        """Tell a pipelined decode, before the forward, how long `request_id`'s prompt is and how many blocks
        its KV takes: its `KVQuery` is answered now (or when it comes). This project's extension (the pipelined
        handshake), not in seed 003, whose decode learns this from ``kv_transfer_params`` after prefill.

        Raises `ValueError` when the producer is closed, `AlreadyHeld` when the request's KV already waits,
        `RequestAborted` when it was aborted."""
        with self._lock:
            self._check_new(request_id)
            plan = KVPlan(request_id, prompt_len, num_blocks)
            self._plans[request_id] = (plan, time.monotonic() + self.free_timeout)
            self._dirty.add(request_id)
        self._wake()

    def request_finished(self, request_id: str, block_ids: Sequence[int], aux: KVAux | None = None) -> None:
        """`request_id`'s prefill is done and its KV written into `block_ids`: hold the blocks for decode (the
        seed's ``delay_free_blocks``) and send them when decode asks (with `aux`, prefill's first token and rope
        delta, in its ``TRANS_DONE``). From here on the producer frees the blocks: after it answers decode's
        ``TRANS_DONE`` / ``TRANS_ERROR``, after `free_timeout` unasked, at `abort`, or at `close`.

        Raises `ValueError` when the producer is closed, `AlreadyHeld` when the request's KV already waits, or
        `RequestAborted` when it was aborted first; the blocks then stay the caller's to free."""
        with self._lock:
            self._check_new(request_id)
            self._held[request_id] = _Held(list(block_ids), time.monotonic() + self.free_timeout, aux)
            self._dirty.add(request_id)
        self._wake()

    def _check_new(self, request_id: str) -> None:
        # under the lock: the producer is open, and the request neither waits already nor was aborted
        if self._closed:
            raise ValueError("the producer is closed")
        if request_id in self._held:
            raise AlreadyHeld(f"request {request_id!r}: its KV already waits for decode")
        if request_id in self._aborted:
            raise RequestAborted(f"request {request_id!r} was aborted")

    def abort(self, request_id: str) -> int:
        """Drop `request_id`: free its blocks now if it is finished, and answer its asks (waiting or to come
        within `free_timeout`) ``TRANS_ERROR`` "aborted". Returns the number of blocks freed: 0 when it was not
        waiting (unknown, not yet finished, or its transfer already taken up: that one frees its blocks itself).
        This project's extension (vLLM's proxy aborts on the scheduler side), not in seed 003."""
        with self._lock:
            if self._closed:
                return 0
            entry = self._held.pop(request_id, None)
            self._plans.pop(request_id, None)
            self._aborted[request_id] = time.monotonic() + self.free_timeout
            self._dirty.add(request_id)
            if entry is not None:
                self._counters["requests_aborted"] += 1
        self._wake()  # an ask already waiting for it is answered now, not at its deadline
        if entry is None:
            return 0
        self._free(entry.block_ids)
        return len(entry.block_ids)

    def stats(self) -> dict[str, int]:
        """Counters: ``requests_held`` (finished, not yet asked), ``transfers_done`` / ``transfers_failed``
        (asks answered ``TRANS_DONE`` / ``TRANS_ERROR``), ``requests_done`` / ``requests_failed``,
        ``requests_expired`` (freed unasked), ``requests_aborted`` (freed by `abort`), ``malformed``
        (frames that were not metadata), ``unauthenticated`` (frames without a valid tag of the secret),
        ``asks_refused`` (past `max_request_ids`, `max_waiting` or `max_waiting_per_peer`), ``asks_waiting``,
        ``blocks_freed``, ``bytes_sent``."""
        with self._lock:
            return {"requests_held": len(self._held), "asks_waiting": len(self._waiting), **self._counters}

    # ---- the worker side (serving thread) ----
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._closed:
            events = dict(poller.poll(self._poll_ms()))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            while self._socket.poll(0, zmq.POLLIN):
                self._handle_handshake(self._socket.recv_multipart(copy=False))
            with self._lock:
                dirty, self._dirty = self._dirty, set()
            for rid in dirty:
                for seq in list(self._by_rid.get(rid, ())):
                    if seq in self._waiting and self._settle(self._waiting[seq]):
                        self._unwait(seq)
            self._expire_waiting()
            self._expire_held()
        for item in self._waiting.values():  # answered, not left waiting for the consumer's timeout
            self._reply(item.envelope, TransError(item.request_ids, "the producer is shutting down",
                                                      reason="busy"))
        self._waiting.clear()

    def _poll_ms(self) -> int:
        with self._lock:
            deadlines = [r.expires for r in self._held.values()] + [until for _, until in self._plans.values()]
        if self._deadlines:
            deadlines.append(self._deadlines[0][0])
        if not deadlines:
            return 1000
        return max(0, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _handle_handshake(self, frames: list[zmq.Frame]) -> None:
        """Check the tag, decode the `MooncakeAgentMetadata` (or a pipelined `KVQuery`) a consumer sent, and serve
        it now (`send_kv_to_decode`) if every request it names is finished, else let it wait within the bounds;
        an ask past a bound is answered ``TRANS_ERROR`` at once."""
        # ROUTER put the sender's identity first; a REQ sender adds an empty delimiter. The reply goes
        # back with whatever envelope came, so even a frame without the delimiter is answered.
        envelope, last = [f.bytes for f in frames[:-1]], frames[-1]
        failpoint("prefill.kv_handshake")
        try:
            payload = security.verify(self._secret, security.KV_ASK, last.buffer)
        except security.AuthError as exc:
            self._count("unauthenticated")
            self._refusals(self._counters["unauthenticated"], last)
            self._reply(envelope, TransError([], str(exc)))
            return
        named = _named_requests(payload)
        if named > self.max_request_ids:  # refused before the costly decode of every id
            self._count("asks_refused", "transfers_failed")
            self._reply(envelope, TransError([], f"an ask names {named} requests; this producer takes at most "
                                                 f"{self.max_request_ids}"))
            return
        try:
            ask = decode_ask(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            self._count("malformed")
            self._reply(envelope, TransError([], f"malformed metadata: {exc}"))
            return
        peer = _peer_address(last)
        deadline = time.monotonic() + self.timeout
        item = _Query(envelope, ask.request_id, deadline, peer) if isinstance(ask, KVQuery) \
            else _Ask(envelope, ask, deadline, peer)
        rids = item.request_ids
        if len(rids) > self.max_request_ids:
            self._refuse(item, f"an ask names {len(rids)} requests; this producer takes at most "
                               f"{self.max_request_ids}", [])
        elif not self._settle(item):
            if len(self._waiting) >= self.max_waiting or self._per_peer[peer] >= self.max_waiting_per_peer:
                self._refuse(item, f"producer busy: {len(self._waiting)} asks wait ({self._per_peer[peer]} from "
                                   f"{peer}); try again later", rids)
            else:
                self._wait(item)

    def _settle(self, item: _Ask | _Query) -> bool:
        """Answer `item` if it can be now (its requests finished, announced or aborted); whether it was."""
        rids = item.request_ids
        with self._lock:
            aborted = [rid for rid in rids if rid in self._aborted]
            if isinstance(item, _Query):
                plan = self._plans.get(item.request_id, (None, 0.0))[0]
                entries: list[_Held | None] = []
            else:
                entries = [self._held.get(rid) for rid in rids]
                if all(entries) and not aborted:
                    meta = item.metadata
                    for rid, entry in zip(rids, entries):
                        entry.asked.add(meta.tp_rank)
                        if len(entry.asked) >= meta.tp_size:  # the last decode rank: the blocks go after this
                            del self._held[rid]
                            self._plans.pop(rid, None)
        if aborted:  # the other requests of the ask stay held: they may be asked for again
            if isinstance(item, _Ask):
                self._count("transfers_failed")
            self._reply(item.envelope, TransError(rids, f"request(s) {aborted} aborted", reason="aborted"))
        elif isinstance(item, _Query):
            if plan is None:
                return False
            self._reply(item.envelope, plan)
        elif all(entries):
            self.send_kv_to_decode(item, entries, last=len(entries[0].asked) >= item.metadata.tp_size)
        else:
            return False
        return True

    def _refuse(self, item: _Ask | _Query, error: str, rids: list[str]) -> None:
        self._count("asks_refused")
        if isinstance(item, _Ask):
            self._count("transfers_failed")
        self._reply(item.envelope, TransError(rids, error, reason="busy"))

    def _wait(self, item: _Ask | _Query) -> None:
        seq = next(self._seq)
        self._waiting[seq] = item
        for rid in item.request_ids:
            self._by_rid.setdefault(rid, set()).add(seq)
        self._per_peer[item.peer] += 1
        heapq.heappush(self._deadlines, (item.deadline, seq))

    def _unwait(self, seq: int) -> None:
        item = self._waiting.pop(seq)
        for rid in item.request_ids:
            seqs = self._by_rid.get(rid)
            if seqs is not None:
                seqs.discard(seq)
                if not seqs:
                    del self._by_rid[rid]
        self._per_peer[item.peer] -= 1
        if self._per_peer[item.peer] <= 0:
            del self._per_peer[item.peer]

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq = heapq.heappop(self._deadlines)
            item = self._waiting.get(seq)
            if item is None:  # answered before its deadline
                continue
            self._unwait(seq)
            if isinstance(item, _Query):
                error = f"request(s) {item.request_ids} not announced on the producer within {self.timeout} s"
            else:
                with self._lock:
                    missing = [rid for rid in item.request_ids if rid not in self._held]
                self._count("transfers_failed")
                error = f"request(s) {missing} not found on the producer within {self.timeout} s"
            self._reply(item.envelope, TransError(item.request_ids, error, reason="not_found"))

    def send_kv_to_decode(self, ask: _Ask, entries: list[_Held], last: bool = True) -> None:
        """Write the finished requests of `ask` into decode's blocks (`_send_blocks`), answer ``TRANS_DONE``
        (``TRANS_ERROR`` on any failure) and, once `last` (every rank of the decode's TP group has asked) or on a
        failure, free the blocks. Called on the serving thread only."""
        meta = ask.metadata
        try:
            nbytes = self._send_blocks(meta, entries)
        except Exception as exc:  # any failure is the consumer's TRANS_ERROR, never a crash of this thread
            reply: TransDone | TransError = TransError(meta.request_ids, f"{type(exc).__name__}: {exc}")
            self._count("transfers_failed", requests_failed=len(entries))
            if not last:  # the request failed for every decode rank: the others' asks find it gone
                with self._lock:
                    for rid in meta.request_ids:
                        self._held.pop(rid, None)
                        self._plans.pop(rid, None)
                last = True
        else:
            auxes = [entry.aux for entry in entries]
            reply = TransDone(meta.request_ids, auxes if all(a is not None for a in auxes) else [])
            self._count("transfers_done", requests_done=len(entries), bytes_sent=nbytes)
        self._reply(ask.envelope, reply)
        if last:  # answered either way: no decode rank will ask again
            for entry in entries:
                self._free(entry.block_ids)

    def _send_blocks(self, meta: MooncakeAgentMetadata, entries: list[_Held]) -> int:
        """One ``batch_transfer_sync_write`` of every request's blocks into decode's: whole blocks in the runs
        contiguous on both sides (`block_copies`, `group_concurrent_contiguous`), or under TP this rank's head
        slices of them (`tp_plan.head_copies`); returns the bytes written. Raises `ValueError` when decode's
        cache, KV layout or block tables do not match prefill's."""
        for rid, entry, dst_ids in zip(meta.request_ids, entries, meta.block_ids):
            if len(dst_ids) != len(entry.block_ids):
                raise ValueError(f"request {rid!r}: decode sent {len(dst_ids)} blocks, "
                                 f"prefill has {len(entry.block_ids)}")
        if meta.num_kv_heads is None:  # the seed's metadata: whole caches on both sides
            if self.layout.tp_size > 1:
                raise ValueError(f"prefill is rank {self.layout.tp_rank} of a TP group of {self.layout.tp_size}: "
                                 f"decode's metadata must name its KV layout (num_kv_heads, block_size)")
            if (meta.block_len not in (None, self.cache.block_len)  # None: the seed's, which never says
                    or len(meta.kv_caches_base_addr) != len(self.cache.base_addrs)):
                raise ValueError(f"decode's cache ({len(meta.kv_caches_base_addr)} regions, block_len "
                                 f"{meta.block_len}) does not match prefill's ({len(self.cache.base_addrs)}, "
                                 f"{self.cache.block_len})")
            return self._write_whole_blocks(meta, entries)
        src, dst = self._geometries(meta)
        if src.kv_heads == dst.kv_heads == self.layout.num_kv_heads:  # every head on both sides: whole blocks
            return self._write_whole_blocks(meta, entries)
        slices = plan_kv_transfer(self.layout.num_kv_heads, self.layout.tp_size, meta.tp_size).between(
            self.layout.tp_rank, meta.tp_rank)
        copies = StridedCopies.concatenate([head_copies(slices, src, dst, entry.block_ids, dst_ids, meta.rkeys or None)
                                            for entry, dst_ids in zip(entries, meta.block_ids)] if slices else [])
        failpoint("prefill.kv_write")
        if not len(copies.srcs):  # this rank holds none of the decode rank's heads
            return 0
        self._write(meta.session_id, copies)
        return copies.nbytes

    def _write(self, session_id: str, copies: StridedCopies) -> None:
        """One batch write of `copies`: the strided op where the engine has it (one request over tcp for every
        entry, about a third of the time of a request per scattered block), else a batch of pieces (Mooncake's
        engine)."""
        if hasattr(self.engine, "batch_transfer_sync_write_strided"):
            self.engine.batch_transfer_sync_write_strided(session_id, *copies)
        else:
            self.engine.batch_transfer_sync_write(session_id, *copies.pieces())

    def _write_whole_blocks(self, meta: MooncakeAgentMetadata, entries: list[_Held]) -> int:
        """Every request's blocks into decode's as whole blocks, in the runs contiguous on both sides, in one batch
        write (the path between whole caches: no plan; each run an entry of one piece); the bytes written."""
        out = BlockCopies([], [], [], [])
        for entry, dst_ids in zip(entries, meta.block_ids):
            part = block_copies(self.cache.base_addrs, meta.kv_caches_base_addr, entry.block_ids, dst_ids,
                                self.cache.block_len, meta.rkeys or None)
            for mine, theirs in zip(out, part):
                mine.extend(theirs)
        failpoint("prefill.kv_write")
        self._write(meta.session_id, StridedCopies.whole(out))
        return sum(out.lengths)

    def _geometries(self, meta: MooncakeAgentMetadata) -> tuple[CacheGeometry, CacheGeometry]:
        """This rank's cache and the decode rank's, as the plan's runs address them; ValueError (the handshake's
        refusal) when decode's model has another KV layout: heads, layers, block size, head width or dtype."""
        cache, layout = self.cache, self.layout
        head_bytes = cache.block_len // (cache.block_size * cache.num_kv_heads)
        dst = KVLayout(meta.num_kv_heads, meta.tp_size, meta.tp_rank) if meta.num_kv_heads == layout.num_kv_heads \
            else None
        if dst is None or meta.block_size != cache.block_size or len(meta.kv_caches_base_addr) != len(
                cache.base_addrs) or meta.block_len != cache.block_size * dst.local_heads * head_bytes:
            raise ValueError(
                f"decode's KV layout ({meta.num_kv_heads} KV heads, {len(meta.kv_caches_base_addr)} regions, "
                f"block size {meta.block_size}, block_len {meta.block_len} at tp {meta.tp_size}) is not prefill's "
                f"({layout.num_kv_heads} KV heads, {len(cache.base_addrs)} regions, block size {cache.block_size}, "
                f"{head_bytes} bytes a head): different models or head layouts")
        return (CacheGeometry(cache.base_addrs, cache.block_size, cache.num_kv_heads, head_bytes),
                CacheGeometry(meta.kv_caches_base_addr, meta.block_size, dst.local_heads, head_bytes))

    def _expire_held(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, r in self._held.items() if now >= r.expires]
            entries = [self._held.pop(rid) for rid in expired]
            self._plans = {rid: p for rid, p in self._plans.items() if now < p[1] and rid not in expired}
            self._aborted = {rid: until for rid, until in self._aborted.items() if now < until}
        for rid, entry in zip(expired, entries):
            log.warning("KV of request %r was never asked for within %s s; freeing its blocks", rid, self.free_timeout)
            self._count(requests_expired=1)
            self._free(entry.block_ids)

    def _reply(self, envelope: list[bytes], reply: TransDone | TransError) -> None:
        # A consumer that gave up is gone: ROUTER drops the reply instead of blocking.
        self._socket.send_multipart([*envelope, security.sign(self._secret, security.KV_REPLY, encode(reply))])

    def _free(self, block_ids: list[int]) -> None:
        try:
            self.free_blocks(block_ids)
        except Exception:  # a bad callback must not stop the side channel
            log.exception("free_blocks(%s) failed", block_ids)
        else:
            self._count(blocks_freed=len(block_ids))

    def _count(self, *names: str, **amounts: int) -> None:
        with self._lock:
            for name in names:
                self._counters[name] += 1
            for name, amount in amounts.items():
                self._counters[name] += amount

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread is already due to wake
            pass

    # ---- lifetime ----
    def close(self) -> None:
        """Answer waiting asks with ``TRANS_ERROR``, free the blocks of finished requests, stop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join()
        self._socket.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._lock:
            entries, self._held = list(self._held.values()), {}
        for entry in entries:
            self._free(entry.block_ids)

    def __enter__(self) -> "KVProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVConsumer:
    """The decode side: asks a producer to write a request's KV into this role's blocks.

    REQ sockets are kept per producer and reused: a connect costs a TCP handshake and ZMQ's greeting on every
    request otherwise. A socket goes back to the pool only after a whole round trip; one whose ask timed out or
    failed is closed (a REQ waiting for a lost reply cannot send again). At most `MAX_PRODUCERS` producers keep
    sockets, the least recently used first out, and at most `MAX_IDLE` idle sockets each.

    Args:
        engine: the transfer engine the cache is registered with (the writes' destination).
        cache: the decode's registered `PagedKVCache`.
        timeout: seconds `receive_kv` waits for the producer's answer, plus `REPLY_SLACK_S`: a producer with the
            same timeout answers an ask it could not serve (``TRANS_ERROR`` "not found") before this gives up.
        secret: the shared secret asks are tagged with and replies must carry (`epd_lab.security`); None takes
            ``EPD_SECRET`` from the environment.
        layout: this decode rank's place in its TP group (`tp_plan.KVLayout`), sent in every ask; None: one rank
            holding every KV head.
    """

    MAX_PRODUCERS = 64
    MAX_IDLE = 8

    def __init__(self, engine: Any, cache: PagedKVCache, *, timeout: float = 5.0,
                 secret: bytes | str | None = None, layout: KVLayout | None = None) -> None:
        self.layout = _layout_of(cache, layout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not cache.keys:
            raise ValueError("the cache is not registered with a transfer engine")
        self.engine, self.cache, self.timeout = engine, cache, timeout
        self._secret = security.resolve(secret)
        self._idle: dict[str, list[zmq.Socket]] = {}  # producer URL -> idle sockets, least recently used first
        self._lock = threading.Lock()
        self._closed = False
        self.sockets_created = 0

    def _socket(self, producer_url: str) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise KVTransferError("the KV consumer is closed")
            idle = self._idle.pop(producer_url, [])
            sock = idle.pop() if idle else None
            if idle:
                self._idle[producer_url] = idle  # re-inserted: now the most recently used
            if sock is not None:
                return sock
            self.sockets_created += 1
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + security.TAG_BYTES)
        try:
            sock.connect(producer_url)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def _release(self, producer_url: str, sock: zmq.Socket) -> None:
        """Back to the pool after a whole round trip (or closed, past the bounds or once closed)."""
        evicted: list[zmq.Socket] = []
        with self._lock:
            idle = self._idle.pop(producer_url, [])
            if not self._closed and len(idle) < self.MAX_IDLE:
                idle.append(sock)
                sock = None
            self._idle[producer_url] = idle
            while len(self._idle) > self.MAX_PRODUCERS:
                evicted += self._idle.pop(next(iter(self._idle)))
        for s in evicted + ([sock] if sock is not None else []):
            s.close()

    def close(self) -> None:
        """Close the pooled sockets; a later `receive_kv` raises `KVTransferError`."""
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()

    def __enter__(self) -> "KVConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metadata(self, request_id: str, block_ids: Sequence[int]) -> MooncakeAgentMetadata:
        """The agent metadata that asks for `request_id`'s KV in `block_ids`."""
        host, port = parse_session_id(self.engine.session_id)
        return MooncakeAgentMetadata(
            remote_hostname=host, remote_port=port, request_ids=[request_id],
            kv_caches_base_addr=self.cache.base_addrs, block_ids=[list(block_ids)],
            session_id=self.engine.session_id, rkeys=list(self.cache.keys), block_len=self.cache.block_len,
            tp_size=self.layout.tp_size, tp_rank=self.layout.tp_rank, num_kv_heads=self.layout.num_kv_heads,
            block_size=self.cache.block_size)

    def query(self, producer_url: str, request_id: str, timeout: float | None = None) -> KVPlan:
        """The pipelined handshake's first step: ask the producer how long `request_id`'s prompt is and how many
        blocks its KV takes; returns when prefill has announced it (`KVProducer.announce`). Raises
        `KVTransferError` otherwise (`KVTransferTimeout` after `timeout` seconds, when given and shorter than
        this consumer's own). This project's extension, not in seed 003."""
        reply = self._round_trip(producer_url, request_id, encode(KVQuery(request_id)), timeout)
        if not isinstance(reply, KVPlan) or reply.request_id != request_id:
            raise KVTransferError(f"request {request_id!r}: {type(reply).__name__} from {producer_url} where its "
                                  f"plan was due")
        return reply

    def receive_kv(self, producer_url: str, request_id: str, block_ids: Sequence[int],
                   timeout: float | None = None) -> TransDone:
        """Have the producer at `producer_url` write `request_id`'s KV into `block_ids`; returns its
        ``TRANS_DONE`` (with prefill's first token and rope delta when prefill gave them). Raises
        `KVTransferError` otherwise (`KVTransferTimeout` after `timeout` seconds, when given and shorter than this
        consumer's own: what is left of the request's deadline); the blocks stay the caller's to free."""
        return self.receive_kv_group([producer_url], request_id, block_ids, timeout)

    def receive_kv_group(self, producer_urls: Sequence[str], request_id: str, block_ids: Sequence[int],
                         timeout: float | None = None) -> TransDone:
        """`receive_kv` from a prefill TP group, `producer_urls` its ranks' side channels in rank order: the same
        ask goes to every rank at once (each writes the head slices the plan gives it, possibly none, and frees
        its blocks), and this returns once every rank answered ``TRANS_DONE``: rank 0's. Raises
        `KVTransferError` as `receive_kv`, naming the rank, after asking them all (no reply is left pending)."""
        if not producer_urls:
            raise ValueError("no producer to ask")
        # both groups' sizes give the same plan on both sides; a plan that cannot cover this rank is refused here
        plan_kv_transfer(self.layout.num_kv_heads, len(producer_urls), self.layout.tp_size)
        payload = encode(self.metadata(request_id, block_ids))
        own = self.timeout + REPLY_SLACK_S
        wait = own if timeout is None else min(own, timeout)
        deadline = time.monotonic() + wait
        asked = [(url, self._ask(url, payload)) for url in producer_urls]
        replies: list[TransDone | KVPlan] = []
        error: KVTransferError | None = None
        for rank, (url, sock) in enumerate(asked):
            try:
                reply = self._answer(url, sock, request_id, deadline - time.monotonic(), wait == own)
            except KVTransferError as exc:
                if error is None:
                    error = exc if len(asked) == 1 else type(exc)(f"prefill rank {rank}: {exc}", exc.reason)
                continue
            if not isinstance(reply, TransDone) or reply.request_ids != [request_id]:
                what = f"TRANS_DONE for {reply.request_ids}" if isinstance(reply, TransDone) else type(reply).__name__
                error = error or KVTransferError(f"request {request_id!r}: {what} instead")
            replies.append(reply)
        if error is not None:
            raise error
        return replies[0]

    def _round_trip(self, producer_url: str, request_id: str, payload: bytes,
                    timeout: float | None) -> TransDone | KVPlan:
        # a request's deadline may come before the producer's own TRANS_ERROR would: a producer that died or froze
        # mid-transfer is given up on then, not after this consumer's whole timeout
        own = self.timeout + REPLY_SLACK_S
        wait = own if timeout is None else min(own, timeout)
        return self._answer(producer_url, self._ask(producer_url, payload), request_id, wait, wait == own)

    def _ask(self, producer_url: str, payload: bytes) -> zmq.Socket:
        """Send a signed ask on a pooled socket; the socket awaits its answer (`_answer`)."""
        sock = self._socket(producer_url)
        try:
            sock.send(security.sign(self._secret, security.KV_ASK, payload))
        except BaseException:
            sock.close()
            raise
        return sock

    def _answer(self, producer_url: str, sock: zmq.Socket, request_id: str, wait: float,
                whole: bool) -> TransDone | KVPlan:
        """The verified answer on `sock` within `wait` seconds (`whole`: this consumer's own timeout, else the
        request's deadline); `KVTransferError` otherwise. The socket goes back to the pool only after a reply."""
        try:
            if not sock.poll(max(0, int(wait * 1000)), zmq.POLLIN):
                within = f"{self.timeout} s" if whole else f"the request's deadline ({max(wait, 0.0):.2f} s)"
                raise KVTransferTimeout(f"request {request_id!r}: no answer from the producer at {producer_url} "
                                        f"within {within} (dead or stuck)")
            frame = sock.recv(copy=False)
        except BaseException:
            sock.close()  # its reply may still come: this socket cannot be used again
            raise
        self._release(producer_url, sock)
        try:
            reply = decode_reply(security.verify(self._secret, security.KV_REPLY, frame.buffer))
        except security.AuthError as exc:
            raise KVAuthenticationError(f"request {request_id!r}: authentication failed with the producer at "
                                        f"{producer_url}: its reply refused: {exc} (it has another EPD_SECRET, or "
                                        f"none)") from None
        except msgspec.DecodeError as exc:
            if self._secret is None and _tagged_reply(frame.buffer):
                raise KVAuthenticationError(f"request {request_id!r}: authentication failed with the producer at "
                                            f"{producer_url}: it requires the shared secret (its replies are "
                                            f"tagged) and this consumer has none: set the same EPD_SECRET on "
                                            f"both") from None
            raise KVTransferError(f"request {request_id!r}: unreadable reply from {producer_url}: {exc}") from None
        if isinstance(reply, TransError):
            raise KVTransferError(f"request {request_id!r}: TRANS_ERROR from {producer_url}: {reply.error}",
                                  reason=reply.reason)
        return reply
