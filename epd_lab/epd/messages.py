"""Wire messages of E→P, as typed structs with one codec each (JSON over HTTP, msgpack over ZMQ).

Names follow SGLang's encode_server/encode_receiver (seed 000). Everything is validated on decode;
nothing is unpickled. A part of a request is named ``{rid}_local_part_{idx}`` (`part_req_id`).
"""
from __future__ import annotations

import msgspec
import torch

from epd_lab.trace import Span

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # dtype names on the wire
BACKENDS = ("mooncake", "zmq_to_tokenizer", "zmq_to_scheduler")
MODALITIES = ("image",)
MAX_JSON_BYTES = 8 << 20  # an /encode body carries data: URIs; larger bodies are refused with 413
MAX_ZMQ_BYTES = 1 << 31


def part_req_id(rid: str, part_idx: int) -> str:
    """The seed's name of one part of request `rid`."""
    return f"{rid}_local_part_{part_idx}"


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /encode: encode these media items as part `part_idx` of `num_parts`."""

    mm_items: list[str]
    num_parts: int
    part_idx: int
    req_id: str
    modality: str = "image"
    prefill_host: str = "127.0.0.1"
    embedding_port: int | None = None  # where ZMQ messages go (mooncake, zmq_to_tokenizer)


class EncodeResponse(msgspec.Struct):
    """The sizes the receiver needs to allocate (mooncake), answered as soon as the grid is known."""

    req_id: str
    part_idx: int
    embedding_size: int  # bytes
    embedding_len: int  # tokens
    embedding_dim: int
    dtype: str
    grid_thw: list[list[int]]


class SendRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /send (mooncake): write the part's embedding to `buffer_address` in engine `session_id`."""

    req_id: str
    part_idx: int
    session_id: str
    buffer_address: int
    embedding_size: int
    prefill_host: str = "127.0.0.1"
    embedding_port: int | None = None
    rkey: int = 0  # the key of the receiver's registration: a late write cannot land in a later request


class SendResponse(msgspec.Struct):
    """The answer to POST /send: the bytes are in the receiver's buffer and the notify is queued."""

    req_id: str
    part_idx: int
    embedding_size: int  # bytes written
    path: str  # the transfer engine's path to the receiver: "shm", "tcp" or "verbs"


class SchedulerReceiveUrl(msgspec.Struct, forbid_unknown_fields=True):
    """POST /scheduler_receive_url (zmq_to_scheduler): where this part's embedding goes."""

    req_id: str
    receive_url: str  # "tcp://host:port"


class EmbeddingNotify(msgspec.Struct, tag="notify"):
    """mooncake: the bytes are already in place; this says what they are (or why they are not)."""

    req_id: str
    part_idx: int
    modality: str
    shape: list[int]
    dtype: str
    grid_thw: list[list[int]]
    error: str | None = None
    spans: list[Span] = []


class EmbeddingData(EmbeddingNotify, tag="data"):
    """zmq_to_tokenizer / zmq_to_scheduler: the embedding bytes travel in the message."""

    data: bytes = b""


ZmqMessage = EmbeddingNotify | EmbeddingData

_zmq_encoder = msgspec.msgpack.Encoder()
_zmq_decoder = msgspec.msgpack.Decoder(ZmqMessage)


def encode_zmq(msg: EmbeddingNotify | EmbeddingData) -> bytes:
    """msgpack with a type tag."""
    return _zmq_encoder.encode(msg)


def decode_zmq(frame: bytes | memoryview) -> EmbeddingNotify | EmbeddingData:
    """Validate and decode; raises `msgspec.ValidationError`/`DecodeError` on anything else."""
    return _zmq_decoder.decode(frame)
