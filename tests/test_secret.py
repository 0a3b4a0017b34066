"""The optional shared secret (`epd_lab.security`), on every surface, through real sockets and processes: without
it (or with another one) a client is refused by the engine's handshake, the ZMQ side channels and HTTP, and nothing
is written into registered memory; with it, a whole E→P→D request through `launch.Cluster` is served."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import zmq

from epd_lab import _native, security
from epd_lab.ep.messages import EmbeddingNotify, encode_zmq
from epd_lab.ep.push import PushSockets
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.kv import BlockManager, KVConsumer, KVProducer, KVTransferError, PagedKVCache, TransError
from epd_lab.kv.messages import decode_reply, encode
from epd_lab.launch import Cluster, Topology
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.transfer import TransferEngine
from epd_lab.transfer.errors import AuthenticationError, PeerUnreachable
from epd_lab.transfer.peer import PeerProcess
from epd_lab.wire_types import WIRE_REQ
from helpers import wait_for

SECRET = "s3cret-" + "x" * 25
OTHER = "other-" + "y" * 26


@pytest.fixture(autouse=True)
def no_ambient_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says which secret each side has; none leaks in from the environment."""
    monkeypatch.delenv(security.ENV_SECRET, raising=False)
    monkeypatch.delenv(security.ENV_SECRET_FILE, raising=False)


# ---- the module ----
def test_secret_comes_from_the_environment_or_a_file(tmp_path):
    assert security.load_secret({}) is None
    assert security.load_secret({security.ENV_SECRET: SECRET}) == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert security.load_secret({security.ENV_SECRET_FILE: str(path)}) == SECRET.encode()
    with pytest.raises(ValueError, match="not both"):
        security.load_secret({security.ENV_SECRET: SECRET, security.ENV_SECRET_FILE: str(path)})
    with pytest.raises(ValueError, match="at least 16"):
        security.load_secret({security.ENV_SECRET: "short"})
    with pytest.raises(ValueError, match="No such file"):
        security.load_secret({security.ENV_SECRET_FILE: str(tmp_path / "missing")})


def test_tags_bind_secret_and_channel():
    key = SECRET.encode()
    frame = security.sign(key, security.KV_ASK, b"payload")
    assert bytes(security.verify(key, security.KV_ASK, frame)) == b"payload"
    for secret, domain, data in ((OTHER.encode(), security.KV_ASK, frame), (key, security.KV_REPLY, frame),
                                 (key, security.KV_ASK, b"payload"), (key, security.KV_ASK, frame[:-1] + b"X")):
        with pytest.raises(security.AuthError):
            security.verify(secret, domain, data)
    assert security.check_bearer(key, f"Bearer {SECRET}") and not security.check_bearer(key, f"Bearer {OTHER}")
    assert not security.check_bearer(key, None) and not security.check_bearer(key, SECRET)


def test_native_hmac_is_hmac_sha256():
    for key in (b"", b"k" * 16, b"k" * 64, b"k" * 65, os.urandom(200)):
        for msg in (b"", b"abc", os.urandom(63), os.urandom(64), os.urandom(1000)):
            assert _native.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


# ---- the engine's handshake ----
@pytest.fixture
def guarded_peer() -> Iterator[PeerProcess]:
    with PeerProcess("tcp", env={**os.environ, security.ENV_SECRET: SECRET}) as peer:
        yield peer


def test_engine_refuses_writers_without_the_secret_and_nothing_lands(guarded_peer):
    peer = guarded_peer
    dst = peer.alloc(4096, fill=0x11)
    src = np.full(4096, 0x22, dtype=np.uint8)
    with TransferEngine(protocol="tcp") as none, pytest.raises(PeerUnreachable):
        none.register_buffer(src)
        none.write_buffer(peer.session_id, src, dst)
    with TransferEngine(protocol="tcp", secret=OTHER) as other, pytest.raises(AuthenticationError,
                                                                              match="does not know"):
        other.register_buffer(src)
        other.write_buffer(peer.session_id, src, dst)
    # a raw client that skips the handshake and sends a well-formed write header, then the bytes
    host, port = peer.session_id.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(WIRE_REQ.pack(_native.WIRE_MAGIC, _native.WIRE_VERSION, _native.OP_WRITE, 0, dst, 4096, 0)
                  + src.tobytes())
        s.settimeout(5)
        assert s.recv(24) == b""  # closed unanswered
    assert peer.read(dst, 4096) == b"\x11" * 4096
    stats = peer.stats()
    assert stats["writes_in"] == 0 and stats["auth_failures"] >= 3
    for protocol, value in (("tcp", 0x22), ("auto", 0x33)):  # the handshake also guards the HELLO of the shm path
        src[:] = value
        with TransferEngine(protocol=protocol, secret=SECRET) as good:
            good.register_buffer(src)
            good.write_buffer(peer.session_id, src, dst)
            assert good.path_to(peer.session_id) == ("shm" if protocol == "auto" else "tcp")
        assert peer.read(dst, 4096) == bytes([value]) * 4096


def test_writer_with_a_secret_refuses_a_peer_without_one():
    with PeerProcess("tcp") as peer, TransferEngine(protocol="tcp", secret=SECRET) as writer:
        src = np.zeros(64, dtype=np.uint8)
        writer.register_buffer(src)
        with pytest.raises(AuthenticationError, match="has no shared secret"):
            writer.write_buffer(peer.session_id, src, peer.alloc(64))


# ---- the ZMQ side channels ----
@pytest.fixture
def kv_pair() -> Iterator[tuple[KVProducer, TransferEngine, PagedKVCache, BlockManager]]:
    with (TransferEngine(timeout=2.0, secret=SECRET) as p_engine, TransferEngine(timeout=2.0, secret=SECRET) as d_engine,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=p_engine) as p_cache,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=d_engine) as d_cache):
        blocks = BlockManager(8)
        with KVProducer(p_engine, p_cache, free_blocks=blocks.free, timeout=1.0, secret=SECRET) as producer:
            yield producer, d_engine, d_cache, blocks


def test_kv_side_channel_refuses_untagged_and_wrongly_tagged_asks(kv_pair):
    producer, d_engine, d_cache, blocks = kv_pair
    producer.request_finished("r", blocks.allocate(2))
    for secret in (None, OTHER):
        with KVConsumer(d_engine, d_cache, timeout=3.0, secret=secret) as consumer:
            with pytest.raises(KVTransferError):
                consumer.receive_kv(producer.url, "r", [0, 1])
    meta = KVConsumer(d_engine, d_cache, secret=SECRET).metadata("r", [0, 1])
    with zmq.Context.instance().socket(zmq.REQ) as sock:  # a raw ask, untagged: answered at once, typed
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(producer.url)
        sock.send(encode(meta))
        assert sock.poll(3000)
        reply = decode_reply(security.verify(SECRET.encode(), security.KV_REPLY, sock.recv()))
    assert isinstance(reply, TransError) and "tag" in reply.error
    assert producer.stats()["unauthenticated"] == 3 and producer.stats()["requests_held"] == 1
    assert d_engine.stats()["writes_in"] == 0  # nothing written into decode's cache
    with KVConsumer(d_engine, d_cache, timeout=3.0, secret=SECRET) as consumer:
        consumer.receive_kv(producer.url, "r", [0, 1])
    assert d_engine.stats()["writes_in"] > 0


def test_notify_channel_drops_untagged_messages_before_decoding(monkeypatch):
    monkeypatch.setenv(security.ENV_SECRET, SECRET)
    msg = encode_zmq(EmbeddingNotify(req_id="nobody_local_part_0", part_idx=0, modality="IMAGE", shape=[1, 1],
                                     dtype="float32", grid_thw=[[1, 1, 1]]))
    with EmbeddingReceiver(ReceiverConfig(encoder_urls=["http://127.0.0.1:9"], timeout=2.0)) as receiver:
        url = f"tcp://127.0.0.1:{receiver.embedding_port}"
        pushers = [PushSockets(2.0, secret=secret) for secret in (OTHER, SECRET)]
        try:
            for p in pushers:
                p.push(url, msg)
            # LINGER=0: the pushers stay open until the messages arrived
            wait_for(lambda: sum(receiver.counters[k] for k in ("unauthenticated_messages", "stray_messages")) >= 2,
                     5, lambda: f"both messages arrived: {dict(receiver.counters)}", interval=0.02)
        finally:
            for p in pushers:
                p.close()
        assert receiver.counters["unauthenticated_messages"] == 1  # the other secret's: never decoded
        assert receiver.counters["stray_messages"] == 1  # ours: decoded (no request waits for it)


# ---- a whole cluster ----
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(Topology(prefills=1, decodes=1, proxy=True, timeout=20.0, secret=SECRET)) as c:
        yield c


def test_every_role_requires_the_bearer_token_except_health(cluster):
    auth = {"Authorization": f"Bearer {SECRET}"}
    for url in cluster.urls():
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for headers in ({}, {"Authorization": f"Bearer {OTHER}"}, {"Authorization": SECRET}):
            r = httpx.get(url + "/metrics", headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (url, r.text)
            assert "bearer token" in r.text
        assert httpx.get(url + "/metrics", headers=auth, timeout=10).status_code == 200
    r = httpx.post(cluster.prefill_urls[0] + "/v1/prefill", json={}, timeout=10)
    assert r.status_code == 401 and r.json() == {"detail": r.json()["detail"]}  # the role's own error body


def test_openai_clients_pass_the_secret_as_api_key_and_a_request_crosses_e_p_d(cluster):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(random_png(0, 64))}},
                                             {"type": "text", "text": "describe it"}]}]
    with openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="wrong", max_retries=0, timeout=60) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4)
        assert info.value.status_code == 401 and info.value.body["code"] == "unauthorized"
    with openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key=SECRET, max_retries=0, timeout=60) as good:
        reply = good.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
        chunks = list(good.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0,
                                                   stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # the request's timeline is collected from every role with the topology's secret
    frame = cluster.spans(reply.id)
    assert not frame.attrs["unreachable"] and {"prefill", "kv_transfer", "decode_step"} <= set(frame["stage"])


def test_cluster_side_channels_refuse_clients_without_the_secret(cluster):
    kv_url = httpx.get(cluster.prefill_urls[0] + "/health", timeout=10).json()["kv_url"]
    with zmq.Context.instance().socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv_url)
        sock.send(b"\x81\xa4type\xa5query")  # untagged: refused before it is decoded
        assert sock.poll(5000)
        reply = decode_reply(security.verify(SECRET.encode(), security.KV_REPLY, sock.recv()))
    assert isinstance(reply, TransError) and "tag" in reply.error
    health = httpx.get(cluster.prefill_urls[0] + "/health", timeout=10).json()
    assert health["producer"]["unauthenticated"] >= 1


def test_mooncake_engine_is_refused_when_a_secret_is_set(monkeypatch):
    """Mooncake's port has no handshake: with a secret set, opening it fails rather than leaving a port open."""
    from epd_lab.transfer.errors import TransportUnavailable
    from epd_lab.transfer.registry import open_engine

    monkeypatch.setenv(security.ENV_SECRET, SECRET)
    with pytest.raises(TransportUnavailable, match="cannot check the shared secret"):
        open_engine("mooncake")
