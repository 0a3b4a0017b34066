"""Wire messages of the P→D side channel: msgpack structs with a type tag and one codec (no pickle).

The consumer (decode) sends `MooncakeAgentMetadata`: the seed's five fields under the seed's names, plus three
optional ones our engine uses (`session_id`, a key per destination region, `block_len`). The seed's exact
message (the five fields, without our type tag) is accepted too. The producer (prefill) answers `TransDone`
(the seed's ``TRANS_DONE``) or `TransError` (``TRANS_ERROR``). Everything is validated on decode.

The pipelined handshake adds one exchange before it: decode sends `KVQuery` as soon as the proxy has told it
which prefill serves the request, and the producer answers `KVPlan` (the prompt's length and blocks) as soon as
prefill knows them, before its forward; decode then allocates and sends its metadata while prefill computes, and
the producer writes the moment the KV exists. The `TransDone` of such an ask carries what decode could not know
beforehand: prefill's first token and the rope delta (`KVAux`).
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from epd_lab.transfer.engine import parse_session_id
from epd_lab.wire_types import NonNegative

MAX_MESSAGE_BYTES = 16 << 20  # a metadata frame larger than this is refused before decoding


class MooncakeAgentMetadata(msgspec.Struct, tag="metadata", forbid_unknown_fields=True):
    """Decode → prefill: write these requests' KV into my blocks.

    `kv_caches_base_addr` and `rkeys` list the destination regions in `PagedKVCache.base_addrs` order
    (``[K0, V0, K1, V1, ...]``); `block_ids[i]` are the destination blocks of `request_ids[i]`.

    The first five fields are the seed's. What the seed's message lacks takes the seed's behaviour:
    `session_id` becomes ``remote_hostname:remote_port`` (how the seed's producer names the decode's engine),
    no `rkeys` means writes checked against the registered bounds only (the seed's engine has no keys), and no
    `block_len` means the producer's own is used unchecked (the seed's producer assumes both sides agree).
    `KVConsumer` always sends all three.
    """

    remote_hostname: str  # the decode engine's host
    remote_port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]  # the decode engine's port
    request_ids: list[str]
    kv_caches_base_addr: list[NonNegative]
    block_ids: list[list[NonNegative]]
    session_id: str = ""  # "remote_hostname:remote_port", what batch_transfer_sync_write takes
    rkeys: list[NonNegative] = []  # empty: no keys
    block_len: Annotated[int, msgspec.Meta(gt=0)] | None = None  # bytes per block per region
    # the decode rank's place in its TP group and its model's KV layout (None: the seed's whole caches, unchecked)
    tp_size: Annotated[int, msgspec.Meta(gt=0, le=1024)] = 1
    tp_rank: NonNegative = 0
    num_kv_heads: Annotated[int, msgspec.Meta(gt=0)] | None = None  # the model's, not the rank's
    block_size: Annotated[int, msgspec.Meta(gt=0)] | None = None  # tokens per block

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into a ValidationError of the decode.
        if not self.request_ids:
            raise ValueError("no request_ids")
        if len(self.block_ids) != len(self.request_ids):
            raise ValueError(f"{len(self.block_ids)} block lists for {len(self.request_ids)} requests")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} of tp_size {self.tp_size}")
        if self.tp_size > 1 and (self.num_kv_heads is None or self.block_size is None):
            raise ValueError("a TP rank's metadata must name num_kv_heads and block_size")
        if self.rkeys and len(self.rkeys) != len(self.kv_caches_base_addr):
            raise ValueError(f"{len(self.rkeys)} rkeys for {len(self.kv_caches_base_addr)} regions")
        if not self.session_id:
            self.session_id = f"{self.remote_hostname}:{self.remote_port}"  # as the seed's producer derives it
        host, port = parse_session_id(self.session_id)
        if (host, port) != (self.remote_hostname.strip("[]"), self.remote_port):
            raise ValueError(f"session_id {self.session_id!r} is not {self.remote_hostname}:{self.remote_port}")


class KVQuery(msgspec.Struct, tag="query", forbid_unknown_fields=True):
    """Decode → prefill, before the KV exists: how long will `request_id`'s prompt be?"""

    request_id: Annotated[str, msgspec.Meta(min_length=1)]


class KVPlan(msgspec.Struct, tag="plan"):
    """Prefill → decode: `request_id`'s prompt length and the blocks its KV takes (known before the forward)."""

    request_id: str
    prompt_len: Annotated[int, msgspec.Meta(ge=1)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]


class KVAux(msgspec.Struct, array_like=True):
    """What decode needs besides the KV: prefill's first token and the mrope offset."""

    first_token: NonNegative
    rope_delta: int


class TransDone(msgspec.Struct, tag="TRANS_DONE"):
    """Prefill → decode: every block of these requests is in the decode's memory. `aux`, when given, is per
    request in `request_ids` order."""

    request_ids: list[str]
    aux: list[KVAux] = []


TRANS_ERROR_REASONS = ("failed", "not_found", "aborted", "busy")


class TransError(msgspec.Struct, tag="TRANS_ERROR"):
    """Prefill → decode: the transfer failed (or a request was not found); decode fails the requests.

    `reason` (epd_lab's; the seed gives no bytes for this message) lets decode answer its caller the right status:
    ``not_found`` (no request of that id finished on the producer within its timeout, or its KV was freed),
    ``aborted``, ``busy`` (refused at one of the producer's bounds, or it is shutting down: ask again later),
    ``failed`` (the write, or anything else, failed)."""

    request_ids: list[str]
    error: str
    reason: str = "failed"


Ask = MooncakeAgentMetadata | KVQuery
Reply = TransDone | TransError | KVPlan
Message = Ask | Reply

_encoder = msgspec.msgpack.Encoder()
_metadata_decoder = msgspec.msgpack.Decoder(MooncakeAgentMetadata)
_ask_decoder = msgspec.msgpack.Decoder(Ask)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: Message) -> bytes:
    """msgpack with the type tag."""
    return _encoder.encode(msg)


def decode_metadata(frame: bytes | memoryview) -> MooncakeAgentMetadata:
    """Validate and decode the consumer's metadata; raises `msgspec.DecodeError` (a `ValidationError`
    for well-formed msgpack that is not valid metadata) or `ValueError` on an oversized frame."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ValueError(f"metadata frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _metadata_decoder.decode(frame)


def decode_ask(frame: bytes | memoryview) -> MooncakeAgentMetadata | KVQuery:
    """Validate and decode what a consumer sent: tagged metadata or query, else the seed's untagged metadata;
    raises as `decode_metadata`."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ValueError(f"metadata frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _ask_decoder.decode(frame)
    except msgspec.ValidationError:
        return _metadata_decoder.decode(frame)  # the seed's message has no tag; its error is the one to report


def decode_reply(frame: bytes | memoryview) -> TransDone | TransError | KVPlan:
    """Validate and decode the producer's reply; raises `msgspec.DecodeError` on anything else."""
    return _reply_decoder.decode(frame)
