"""Fuzzing as tests: every msgspec decoder of the wire, the transfer engine's wire header through a real
engine port, and the campaign's fuzz leg (`epd_lab.campaign.fuzz.fuzz`) on a real 1E/1P/1D cluster with the proxy,
on a small budget.

Everything draws from fixed seeds (`derandomize=True`, or the leg's `SEED`), so a CI failure replays locally; the
failing case and the seed are in the assertion message.
"""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_lab import _native
from epd_lab.campaign.fuzz import _WEIRD, BODY_TYPES, fuzz, fuzz_guarded_engine
from epd_lab.ep import messages as ep_messages
from epd_lab.kv import messages as kv_messages
from epd_lab.launch import Cluster, Topology
from epd_lab.servers import messages as server_messages
from epd_lab.servers.openai_api import Job, parse_request
from epd_lab.serving import BadRequest, decode_body
from epd_lab.transfer import verbs
from epd_lab.transfer.errors import ProtocolError
from epd_lab.wire_types import WIRE_REP, WIRE_REQ

pytestmark = pytest.mark.timeout(180)

SEED = 11  # the cluster leg's seed: a failure's report names it, and the same seed replays the same inputs
DECODER_SETTINGS = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                            suppress_health_check=list(HealthCheck))


def _fields(*types: type) -> list[str]:
    names: set[str] = set()
    for typ in types:
        for t in getattr(typ, "__args__", (typ,)):
            names.update(getattr(t, "__struct_fields__", ()))
    return sorted(names - {"type"})


def _tags(*types: type) -> list[Any]:
    tags = ["bogus", 0]
    for typ in types:
        for t in getattr(typ, "__args__", (typ,)):
            config = getattr(t, "__struct_config__", None)
            if config is not None and config.tag is not None:
                tags.append(config.tag)
    return tags


def near_valid(*types: type) -> st.SearchStrategy[Any]:
    """Objects shaped like the structs `types`: their tags and field names, with any values (wrong types, huge
    numbers, nesting, unicode), sometimes as an array (array-like structs) or a bare value."""
    obj = st.fixed_dictionaries({"type": st.sampled_from(_tags(*types))},
                                optional={n: _WEIRD for n in _fields(*types)})
    return st.one_of(obj, st.lists(_WEIRD, max_size=4), _WEIRD)


def _msgpack(obj: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError, UnicodeEncodeError):
        return msgspec.msgpack.encode(repr(obj))


def _json(obj: Any) -> bytes:
    return json.dumps(obj, default=repr).encode("utf-8", "surrogatepass")


def frames(encode, *types: type) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, near-valid encodings, and near-valid encodings cut short."""
    whole = near_valid(*types).map(encode)
    cut = st.tuples(whole, st.integers(1, 64)).map(lambda t: t[0][:-t[1]])
    return st.one_of(st.binary(max_size=512), whole, cut)


def _decodes_or_raises(decode, frame: bytes, allowed: tuple[type[BaseException], ...]) -> None:
    try:
        decode(frame)
    except allowed:
        pass
    except Exception as exc:  # noqa: BLE001 - the point: anything else is a bug
        pytest.fail(f"{decode.__qualname__} raised {type(exc).__name__}: {exc} on {frame!r}")


# ---- every msgspec decoder of the wire ----
@DECODER_SETTINGS
@given(frames(_msgpack, ep_messages.ZmqMessage))
def test_ep_notify_decoder_raises_only_decode_errors(frame: bytes) -> None:
    _decodes_or_raises(ep_messages.decode_zmq, frame, (msgspec.DecodeError,))


@DECODER_SETTINGS
@given(frames(_msgpack, kv_messages.Ask))
def test_kv_ask_decoders_raise_only_decode_errors(frame: bytes) -> None:
    _decodes_or_raises(kv_messages.decode_ask, frame, (msgspec.DecodeError,))
    _decodes_or_raises(kv_messages.decode_metadata, frame, (msgspec.DecodeError,))


@DECODER_SETTINGS
@given(frames(_msgpack, kv_messages.Reply))
def test_kv_reply_decoder_raises_only_decode_errors(frame: bytes) -> None:
    _decodes_or_raises(kv_messages.decode_reply, frame, (msgspec.DecodeError,))


def test_kv_oversized_frame_is_a_value_error_before_decoding() -> None:
    big = b"\x00" * (kv_messages.MAX_MESSAGE_BYTES + 1)
    for decode in (kv_messages.decode_ask, kv_messages.decode_metadata):
        with pytest.raises(ValueError, match="exceeds"):
            decode(big)


@DECODER_SETTINGS
@given(frames(_msgpack, verbs.Request, verbs.Reply))
def test_verbs_control_decoders_raise_only_protocol_errors(frame: bytes) -> None:
    _decodes_or_raises(verbs.decode_request, frame, (ProtocolError,))
    _decodes_or_raises(verbs.decode_reply, frame, (ProtocolError,))


HTTP_BODIES = [*BODY_TYPES.values(), server_messages.KVTransferParams]


@pytest.mark.parametrize("typ", HTTP_BODIES, ids=lambda t: t.__name__)
def test_http_body_decoders_answer_bad_request_only(typ: type) -> None:
    @DECODER_SETTINGS
    @given(st.one_of(frames(_json, typ), st.integers(1, 5000).map(lambda d: b"[" * d + b"]" * d),
                     st.integers(1, 5000).map(lambda d: b'{"a":' * d + b"0" + b"}" * d)))
    def run(body: bytes) -> None:
        _decodes_or_raises(lambda b: decode_body(b, typ), body, (BadRequest,))

    run()


@DECODER_SETTINGS
@given(st.one_of(near_valid(), st.fixed_dictionaries({}, optional={
    "messages": st.lists(st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "x"]) | _WEIRD,
                                                             "content": _WEIRD}), max_size=3) | _WEIRD,
    "prompt": _WEIRD, "max_tokens": _WEIRD, "temperature": _WEIRD, "stream": _WEIRD, "stream_options": _WEIRD,
    "seed": _WEIRD, "n": _WEIRD, "stop": _WEIRD})), st.sampled_from(["chat", "text"]))
def test_openai_request_parser_answers_bad_request_only(body: Any, kind: str) -> None:
    try:
        job, prompt, images = parse_request(body, kind, time.monotonic_ns())
    except BadRequest:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"parse_request raised {type(exc).__name__}: {exc} on {body!r}")
    assert isinstance(job, Job) and isinstance(prompt, str) and isinstance(images, list)
    assert job.max_tokens >= 1 and 0 <= job.temperature <= 2


# ---- the engine's wire header, through a real engine port ----
def test_the_fuzz_frames_are_the_size_of_the_engine_structs() -> None:
    """The fuzz leg packs epd_wire_req / epd_wire_rep with `struct`; the C compiler sized them from the header."""
    assert (WIRE_REQ.size, WIRE_REP.size) == (_native.WIRE_REQ_SIZE, _native.WIRE_REP_SIZE)
    assert _native.WIRE_MAGIC.to_bytes(4, "little") == b"EPDW"


def test_engine_wire_header_never_writes_outside_registered_memory() -> None:
    report = fuzz_guarded_engine(n=600, seed=SEED, deadline=time.monotonic() + 30)
    assert report["failures"] == [], f"seed {SEED}: {report['failures'][:3]}"
    assert report["guards_intact"] and report["region_exact"]
    # the draw reaches both sides of the check: writes landed inside the region, and writes were refused (with
    # the shared secret in the environment no frame passes the engine's handshake: none may land)
    assert report["writes_in"] > 0 if not report["authenticated"] else report["writes_in"] == 0, report
    assert report["writes_refused"] > 0 or report["authenticated"], report
    assert report["outcomes"].get("hang", 0) == 0


# ---- the fuzz leg on a real cluster ----
@pytest.fixture(scope="module")
def cluster():
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True, timeout=5)) as c:
        yield c


def test_fuzz_leg_finds_no_5xx_crash_or_hang(cluster) -> None:
    report = fuzz(cluster, inputs_per_server=60, frames_per_socket=60, seed=SEED, time_budget_s=40)
    assert not report["crashes"], f"seed {SEED}: {report['crashes']}"
    assert report["legit_before"]["ok"] and report["legit_after"]["ok"], report["legit_after"]
    assert report["guarded_engine"]["guards_intact"]
    assert not report["failures"], f"seed {SEED}: " + json.dumps(report["failures"][:5], default=str)[:4000]
    # every server and every listening socket was reached
    assert {name for name in report["servers"]} == {"encoder0", "prefill0", "decode0", "proxy"}
    assert all(rep["inputs"] > 0 for rep in report["servers"].values()), report["servers"]
    kinds = {rep["kind"] for rep in report["sockets"].values()}
    assert {"engine", "http", "zmq:ROUTER", "zmq:PULL"} <= kinds, kinds
    assert all(rep["frames"] > 0 for rep in report["sockets"].values())
    for name, rep in report["sockets"].items():
        assert rep["outcomes"].get("hang", 0) == 0 and rep["alive_after"], name


def test_decode_naming_kv_its_producer_does_not_hold_is_a_client_error(cluster) -> None:
    """Found by the fuzz leg (a 502, or a 504 after the timeout); TRANS_ERROR now carries its reason (4d0c294)."""
    kv_url = httpx.get(cluster.prefill_urls[0] + "/health", timeout=10).json()["kv_url"]
    body = {"request_id": "fuzz-unheld", "max_tokens": 1,
            "kv_transfer_params": {"remote_url": kv_url, "remote_request_id": "never-prefilled"}}
    r = httpx.post(cluster.decode_urls[0] + "/v1/decode", json=body, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


def test_tiny_positive_temperature_is_served(cluster) -> None:
    """Found by the fuzz leg (seed 7): logits / 5e-198 overflowed, softmax gave NaN, sampling raised, the proxy
    answered 502; decode now samples from a shifted float64 softmax (024f255)."""
    body = {"model": "any", "max_tokens": 2, "temperature": 5e-198, "seed": 1,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)


# ---- regressions of what the campaign's 10,000-input run found (seed 7) ----
@pytest.mark.parametrize("typ, body", [
    (ep_messages.EncodeRequest, {"mm_items": ["a\u0000b"], "num_parts": 1, "part_idx": 0, "req_id": "r"}),
    (server_messages.PrefillRequest, {"request_id": "r", "prompt": "", "images": ["/tmp/x\u0000.png"]}),
    (server_messages.DecodeRequest, {"request_id": "r", "max_tokens": 1, "seed": 2**64,
                                     "kv_transfer_params": {"remote_url": "tcp://h:1", "remote_request_id": "x"}}),
], ids=["nul-in-mm_items", "nul-in-images", "seed-past-int64"])
def test_values_no_server_can_use_are_refused_on_decode(typ: type, body: dict) -> None:
    with pytest.raises(BadRequest):
        decode_body(json.dumps(body).encode(), typ)


@pytest.mark.parametrize("extra, image", [({}, "/tmp/a\u0000.png"), ({"seed": 2**64}, None)],
                         ids=["nul-image-was-502", "huge-seed-was-502"])
def test_proxy_answers_400_for_values_that_were_5xx(cluster, extra: dict, image: str | None) -> None:
    content: Any = [{"type": "text", "text": "hi"}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": "any", "max_tokens": 2, "temperature": 1.0, "messages": [{"role": "user", "content": content}],
            **extra}
    r = httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, (r.status_code, r.text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_proxy_refuses_max_tokens_past_the_limit_before_answering(cluster, stream: bool) -> None:
    """Found by the 10,000-input run: streamed, max_tokens past decode's bound was a 200 and then an error event;
    parse_request now refuses it with the same 400 either way."""
    body = {"model": "any", "max_tokens": server_messages.MAX_TOKENS + 6, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, (r.status_code, r.text[-400:])
