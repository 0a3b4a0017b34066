"""Wire messages of the prefill and decode servers (P→D), as msgspec structs with one JSON codec.

Everything is validated on decode (`epd_lab.serving.decode_body`); a malformed body or an unknown field is a
400 at the server.

    PrefillRequest  → POST /v1/prefill → PrefillResponse   (its kv_transfer_params: `KVTransferParams`)
    DecodeRequest   → POST /v1/decode  → DecodeResponse, or NDJSON `StreamLine`s: `StreamToken`… then
                                         `StreamDone` or `StreamError`
    AbortRequest    → POST /v1/abort   → AbortResponse     (prefill: decode will never ask for this KV)

`KVTransferParams` is what decode needs besides the KV blocks: where to ask for
them (the producer's side channel and request id), the prompt length and the mrope rope delta (decode
positions are ``prompt_len + rope_delta + i``), the first token (drawn by prefill at the request's temperature and
seed) and the block count.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from epd_lab.trace import Span
from epd_lab.wire_types import MediaItem, NonNegative

MAX_TOKENS = 4096  # the tiny model's max_position_embeddings bounds prompt + generated tokens anyway

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # int64; None: a random one (`models.sampling`)
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]  # 0: greedy


class PrefillKVParams(msgspec.Struct, forbid_unknown_fields=True):
    """The proxy's ``kv_transfer_params`` on /v1/prefill (vLLM's connector convention)."""

    do_remote_decode: bool = True  # keep the KV for a remote decode (False: answer the token, keep nothing)


class PrefillRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/prefill: run E→P on `images` + `prompt` (images first, then the text, as `build_input_ids`)."""

    request_id: NonEmpty
    prompt: str
    images: list[MediaItem] = []  # media items: file paths, data: URIs, http(s) URLs
    kv_transfer_params: PrefillKVParams = msgspec.field(default_factory=PrefillKVParams)
    temperature: Temperature = 0.0  # token 0 is drawn as decode draws the others (`epd_lab.models.sampling`)
    seed: Seed | None = None


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Prefill → (proxy) → decode: everything decode needs to fetch the KV and continue from it.

    Pipelined (the proxy sends decode its request while prefill runs): only `remote_url` and
    `remote_request_id`, the rest None; decode learns the prompt's size from the producer's `KVPlan` and the
    first token and rope delta from its ``TRANS_DONE``. Otherwise all six are given, as prefill answered them.
    """

    remote_url: NonEmpty  # the producer's ZMQ side channel, "tcp://host:port"
    remote_request_id: NonEmpty
    prompt_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    rope_delta: int | None = None  # mrope max position + 1 - prompt_len (≤ 0 with images)
    first_token: NonNegative | None = None
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # a prefill TP group's side channels in rank order (`remote_url` is rank 0's); None: one rank, `remote_url`
    remote_urls: list[NonEmpty] | None = None

    def __post_init__(self) -> None:
        if self.remote_urls is not None and (not self.remote_urls or self.remote_urls[0] != self.remote_url):
            raise ValueError("remote_urls lists a prefill TP group's side channels in rank order, rank 0's "
                             "(remote_url) first")
        given = [v is not None for v in (self.prompt_len, self.rope_delta, self.first_token, self.num_blocks)]
        if any(given) and not all(given):
            raise ValueError("give prompt_len, rope_delta, first_token and num_blocks together, or none of them "
                             "(pipelined: decode asks the producer)")

    @property
    def pipelined(self) -> bool:
        """Whether decode asks the producer for what prefill has not answered yet."""
        return self.prompt_len is None


class PrefillResponse(msgspec.Struct):
    """The answer to /v1/prefill. `kv_transfer_params` is None when ``do_remote_decode`` was false."""

    request_id: str
    first_token: int
    prompt_len: int
    kv_transfer_params: KVTransferParams | None
    spans: list[Span] = []


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/abort on a prefill server: the proxy gave up on `request_id` (its decode failed, or its client
    left before decode began), so its KV will never be asked for."""

    request_id: NonEmpty


class AbortResponse(msgspec.Struct):
    """The answer to /v1/abort. `freed_blocks`: blocks freed now (0 when the KV was not waiting: unknown, already
    sent, or still being prefilled; such a prefill's KV is then refused instead of kept)."""

    request_id: str
    freed_blocks: int


class DecodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/decode: fetch the KV named by `kv_transfer_params` and generate `max_tokens` tokens
    (the first is ``kv_transfer_params.first_token``)."""

    request_id: NonEmpty
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    kv_transfer_params: KVTransferParams
    temperature: Temperature = 0.0
    seed: Seed | None = None  # past 64 bits a 400, not a 500
    stream: bool = False
    return_logits: bool = False  # the non-streaming answer carries each decode step's logits (bit-exact checks)


class DecodeResponse(msgspec.Struct):
    """The non-streaming answer to /v1/decode."""

    request_id: str
    tokens: list[int]
    finish_reason: str = "length"
    spans: list[Span] = []
    logits: list[list[float]] | None = None  # with return_logits: step i's logits, which chose token i + 1


class StreamToken(msgspec.Struct, tag="token"):
    """One NDJSON line of a streaming /v1/decode: token number `index` (0-based)."""

    token: int
    index: int


class StreamDone(msgspec.Struct, tag="done"):
    """The last NDJSON line of a streaming /v1/decode that ran to its end."""

    finish_reason: str = "length"
    spans: list[Span] = []


class StreamError(msgspec.Struct, tag="error"):
    """The last NDJSON line of a streaming /v1/decode that failed after its answer began (its status was sent)."""

    detail: str


StreamLine = StreamToken | StreamDone | StreamError  # tagged by "type": {"type": "token", ...}


_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """JSON bytes of a message."""
    return _encoder.encode(msg)
