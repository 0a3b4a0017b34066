"""Wire messages of E→P, as typed structs with one codec each (JSON over HTTP, msgpack over ZMQ).

Names follow SGLang's encode_server/encode_receiver (seed 000), and the HTTP routes take the seed's exact
bodies: `EncodeRequest` is the body `MMReceiverHTTP.encode()` builds (with ``encoder_idx`` and the modality
by its enum name, ``"IMAGE"``), `SendRequest` is the `/encode` answer updated with ``session_id`` and
``buffer_address`` (what the seed posts to `/send`), `SchedulerReceiveUrl` is
``{req_id, receive_url="host:port", receive_count}``. Fields neither side defines are refused.

Everything is validated on decode; nothing is unpickled. A part of a request is named
``{rid}_local_part_{idx}`` (`part_req_id`).
"""
from __future__ import annotations

import enum
import ipaddress
import re
from typing import Annotated

import msgspec
import torch

from epd_lab.trace import Span
from epd_lab.transfer.engine import parse_session_id
from epd_lab.wire_types import MediaItem, NonNegative

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # dtype names on the wire
BACKENDS = ("mooncake", "zmq_to_tokenizer", "zmq_to_scheduler")
MAX_ZMQ_BYTES = 1 << 31

Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

# An RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


class Modality(enum.Enum):
    """SGLang's `Modality` (seed 000). On the wire by its name (the seed sends ``modality.name``)."""

    IMAGE = enum.auto()
    VIDEO = enum.auto()
    AUDIO = enum.auto()

    @classmethod
    def from_str(cls, name: str) -> "Modality":
        """The modality called `name`, in any case (``"IMAGE"``, ``"image"``), as SGLang's `from_str`;
        `ValueError` for anything else."""
        member = cls.__members__.get(name.upper()) if name.isascii() else None
        if member is None:
            raise ValueError(f"unknown modality {name!r}; the modalities are {', '.join(cls.__members__)}")
        return member


def part_req_id(rid: str, part_idx: int) -> str:
    """The seed's name of one part of request `rid`."""
    return f"{rid}_local_part_{part_idx}"


def check_host(host: str) -> None:
    """`ValueError` unless `host` is an IP address (IPv6 without brackets) or a DNS host name.

    What a client names is only ever connected to: ZMQ would also take ``*``, interface names before a
    ``;`` (the local source of the connection) and IPv6 scope ids, and none of those may come from a client.
    """
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if len(host) > 253 or not _HOST_NAME.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or an IP address") from None
    else:
        if "%" in host:
            raise ValueError(f"{host!r}: IPv6 scope ids are not accepted")


def zmq_url(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 address in brackets) for a checked `host`."""
    check_host(host)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not in 1..65535")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def receive_url_endpoint(receive_url: str) -> str:
    """The ZMQ URL of a ``receive_url``: the seed's ``"host:port"`` or ``"tcp://host:port"`` (IPv6 as
    ``[addr]:port``), host and port checked as `check_host` and `zmq_url` do; `ValueError` otherwise."""
    try:
        return zmq_url(*parse_session_id(receive_url.removeprefix("tcp://")))
    except ValueError:
        raise ValueError(f"receive_url {receive_url!r} is not 'host:port' or 'tcp://host:port' (a host name or "
                         f"IP address, a port in 1..65535)") from None


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /encode: encode these media items as part `part_idx` of `num_parts`.

    The seed's body, field for field. ``modality`` is a `Modality` name in any case (the seed sends
    ``"IMAGE"``); the encoder answers 400 for a modality it does not serve. ``encoder_idx`` is the
    sender's index of this encoder in its list of encoder URLs: SGLang's receiver picks the URL with it,
    and its encode server does not act on it. Here it is checked to be an int >= 0 and the encoder
    records the latest one in ``/health`` (which position its receivers give it); nothing else depends on it.
    """

    mm_items: list[MediaItem]
    num_parts: Positive
    part_idx: NonNegative
    req_id: str
    modality: str = Modality.IMAGE.name
    prefill_host: str = "127.0.0.1"  # where ZMQ messages go (mooncake, zmq_to_tokenizer)
    embedding_port: Port | None = None
    encoder_idx: NonNegative | None = None

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into a ValidationError of the decode (a 400).
        check_host(self.prefill_host)


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
    """POST /send (mooncake): write the part's embedding to `buffer_address` in engine `session_id`.

    The seed posts the `/encode` answer itself, updated with ``session_id`` and ``buffer_address``; so
    every field of `EncodeResponse` is accepted, and one that is sent must match what the encoder answered
    for that part (a 400 otherwise). ``prefill_host`` / ``embedding_port`` default to the `/encode`'s.
    """

    req_id: str
    part_idx: NonNegative
    session_id: str
    buffer_address: NonNegative
    embedding_size: NonNegative
    prefill_host: str | None = None
    embedding_port: Port | None = None
    rkey: NonNegative = 0  # the key of the receiver's registration: a late write cannot land in a later request
    embedding_len: int | None = None
    embedding_dim: int | None = None
    dtype: str | None = None
    grid_thw: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.prefill_host is not None:
            check_host(self.prefill_host)


class SendResponse(msgspec.Struct):
    """The answer to POST /send: the bytes are in the receiver's buffer and the notify is queued."""

    req_id: str
    part_idx: int
    embedding_size: int  # bytes written
    path: str  # the transfer engine's path to the receiver: "shm", "tcp" or "verbs"


class SchedulerReceiveUrl(msgspec.Struct, forbid_unknown_fields=True):
    """POST /scheduler_receive_url (zmq_to_scheduler): one of the places this part's embedding goes.

    The seed's ``{req_id, receive_url="host:port", receive_count}``: each of `receive_count` receivers
    (the prefill scheduler's ranks) posts its own URL, and the encoder sends the embedding to every one
    once all have (every post for a req_id must give the same count). ``"tcp://host:port"`` is accepted too.
    """

    req_id: str
    receive_url: str
    receive_count: Positive = 1

    def __post_init__(self) -> None:
        receive_url_endpoint(self.receive_url)


class ReleaseRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /release (mooncake; epd_lab's, not the seed's): the receiver will not /send for this part (its
    request failed elsewhere), so the encoder drops the held embedding now rather than after its TTL."""

    req_id: str


class EmbeddingNotify(msgspec.Struct, tag="notify"):
    """mooncake: the bytes are already in place; this says what they are (or why they are not)."""

    req_id: str
    part_idx: int
    modality: str  # the `Modality` name, e.g. "IMAGE"
    shape: list[int]
    dtype: str
    grid_thw: list[list[int]]
    error: str | None = None
    spans: list[Span] = []
    clock: str = ""  # the sender's `trace.clock_id()`: its last span is ended on arrival only on the same clock


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
