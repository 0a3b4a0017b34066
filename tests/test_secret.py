"""The optional shared secret (`epd_lab.security`), on every surface, through real sockets and processes: without
it (or with another one) a client is refused by the engine's handshake, the ZMQ side channels and HTTP, and nothing
is written into registered memory; with it, a whole E→P→D request through `launch.Cluster` is served."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import zlib
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
from epd_lab.kv import BlockManager, KVAuthenticationError, KVConsumer, KVProducer, PagedKVCache, TransError
from epd_lab.kv.messages import decode_reply, encode
from epd_lab.launch import Cluster, Topology
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.transfer import TransferEngine
from epd_lab.transfer.errors import AuthenticationError, PeerUnreachable, TransferError
from epd_lab.transfer.peer import PeerProcess
from epd_lab.wire_types import WIRE_REP, WIRE_REQ
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
def guarded_peer(tmp_path) -> Iterator[PeerProcess]:
    """A peer process with the secret; its log in ``peer.log``."""
    with (open(tmp_path / "peer.log", "w") as log,
          PeerProcess("tcp", env={**os.environ, security.ENV_SECRET: SECRET}, stderr=log) as peer):
        peer.log = tmp_path / "peer.log"
        yield peer


def _write_error(engine: TransferEngine, session_id: str, src: np.ndarray, dst: int) -> TransferError:
    """The error `engine` gets writing `src` to `dst` of the peer `session_id`."""
    with pytest.raises(TransferError) as info:
        engine.write_buffer(session_id, src, dst)
    return info.value


def test_engine_tells_writers_without_the_secret_that_they_failed_authentication(guarded_peer, caplog):
    peer = guarded_peer
    big = 8 << 20  # far past the sockets' buffers: refused while the writer is still sending
    dst, big_dst = peer.alloc(4096, fill=0x11), peer.alloc(big, fill=0x11)
    src, big_src = np.full(4096, 0x22, dtype=np.uint8), np.full(big, 0x22, dtype=np.uint8)
    cases = [("tcp", None, src, dst, "requires the shared secret and this engine has none"),
             ("auto", None, src, dst, "requires the shared secret"),  # refused at the shm path's HELLO
             ("tcp", None, big_src, big_dst, "requires the shared secret"),
             ("tcp", OTHER, src, dst, "does not know this engine's shared secret")]
    for protocol, secret, data, where, message in cases:
        with TransferEngine(protocol=protocol, secret=secret, timeout=5.0) as writer:
            writer.register_buffer(data)
            error = _write_error(writer, peer.session_id, data, where)
            # the peer is reachable: the error names the secret, and a retry gets the same answer
            assert isinstance(error, AuthenticationError) and not isinstance(error, PeerUnreachable), repr(error)
            assert message in str(error) and SECRET not in str(error)
            assert isinstance(_write_error(writer, peer.session_id, data, where), AuthenticationError)
            # the writer's log: one line for that peer, however often it retries
            lines = [r.getMessage() for r in caplog.records if "failed authentication" in r.getMessage()]
            assert len(lines) == 1 and peer.session_id in lines[0] and SECRET not in lines[0], lines
            caplog.clear()
    # a raw client that skips the handshake and sends a well-formed write header, then the bytes
    host, port = peer.session_id.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(WIRE_REQ.pack(_native.WIRE_MAGIC, _native.WIRE_VERSION, _native.OP_WRITE, 7, dst, 4096, 0)
                  + src.tobytes())
        s.settimeout(5)
        magic, status, seq, length = WIRE_REP.unpack(s.recv(WIRE_REP.size, socket.MSG_WAITALL))
        assert (magic, status, seq, length) == (_native.WIRE_MAGIC, _native.ST_AUTH_REQUIRED, 7, 0)
        assert s.recv(1) == b""  # then closed
    assert peer.read(dst, 4096) == b"\x11" * 4096 and peer.checksum(big_dst, big) == zlib.crc32(b"\x11" * big)
    stats = peer.stats()
    assert stats["writes_in"] == 0 and stats["auth_failures"] >= 9
    # the refusing side's log: a line naming the handshake and the count, never the secret
    log = peer.log.read_text()
    assert "failed the shared-secret handshake" in log and "auth_failures=" in log and SECRET not in log, log
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


def test_kv_side_channel_refuses_untagged_and_wrongly_tagged_asks(kv_pair, caplog):
    producer, d_engine, d_cache, blocks = kv_pair
    producer.request_finished("r", blocks.allocate(2))
    for secret, message in ((None, "requires the shared secret"), (OTHER, "another EPD_SECRET, or none")):
        with KVConsumer(d_engine, d_cache, timeout=3.0, secret=secret) as consumer:
            with pytest.raises(KVAuthenticationError, match=message) as info:  # named, and at once
                consumer.receive_kv(producer.url, "r", [0, 1])
            assert info.value.reason == "unauthenticated" and "authentication failed" in str(info.value)
    # the producer's log: a line naming the surface and the count, never the secret
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_lab.kv.connector"]
    assert any("KV side channel: a peer at 127.0.0.1" in m and "failed authentication" in m
               for m in lines), lines
    assert not any(SECRET in m for m in lines)
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


def test_notify_channel_drops_untagged_messages_before_decoding(monkeypatch, caplog):
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
    # a PUSH gets no answer: the receiver's log tells of the refusal, never the secret
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_lab.ep.receiver"]
    assert any("E→P notifications: a peer at 127.0.0.1" in m and "failed authentication" in m
               for m in lines), lines
    assert not any(SECRET in m or OTHER in m for m in lines)


# ---- a whole cluster ----
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(Topology(prefills=1, decodes=1, proxy=True, timeout=20.0, secret=SECRET)) as c:
        yield c


def test_every_role_requires_the_bearer_token_except_health(cluster):
    auth = {"Authorization": f"Bearer {SECRET}"}
    for url in cluster.urls():
        # alive or not to anyone; the detail (addresses of side channels, engines, peers) only to the token
        for headers in ({}, {"Authorization": f"Bearer {OTHER}"}, {"Authorization": SECRET}):
            r = httpx.get(url + "/health", headers=headers, timeout=10)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, (url, r.text)
            assert "127.0.0.1" not in r.text and "tcp://" not in r.text
        detail = httpx.get(url + "/health", headers=auth, timeout=10).json()
        assert detail["status"] == "ok" and "http" in detail, (url, detail)
        for headers in ({}, {"Authorization": f"Bearer {OTHER}"}, {"Authorization": SECRET}):
            r = httpx.get(url + "/metrics", headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (url, r.text)
            assert "bearer token" in r.text
        assert httpx.get(url + "/metrics", headers=auth, timeout=10).status_code == 200
    r = httpx.post(cluster.prefill_urls[0] + "/v1/prefill", json={}, timeout=10)
    assert r.status_code == 401 and r.json() == {"detail": r.json()["detail"]}  # the role's own error body
    prefill = httpx.get(cluster.prefill_urls[0] + "/health", headers=auth, timeout=10).json()
    assert prefill["kv_url"].startswith("tcp://127.0.0.1:") and prefill["kv_urls"] == [prefill["kv_url"]]


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
    auth = {"Authorization": f"Bearer {SECRET}"}
    kv_url = httpx.get(cluster.prefill_urls[0] + "/health", headers=auth, timeout=10).json()["kv_url"]
    with zmq.Context.instance().socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv_url)
        sock.send(b"\x81\xa4type\xa5query")  # untagged: refused before it is decoded
        assert sock.poll(5000)
        reply = decode_reply(security.verify(SECRET.encode(), security.KV_REPLY, sock.recv()))
    assert isinstance(reply, TransError) and "tag" in reply.error
    health = httpx.get(cluster.prefill_urls[0] + "/health", headers=auth, timeout=10).json()
    assert health["producer"]["unauthenticated"] >= 1


def test_mooncake_engine_is_refused_when_a_secret_is_set(monkeypatch):
    """Mooncake's port has no handshake: with a secret set, opening it fails rather than leaving a port open."""
    from epd_lab.transfer.errors import TransportUnavailable
    from epd_lab.transfer.registry import open_engine

    monkeypatch.setenv(security.ENV_SECRET, SECRET)
    with pytest.raises(TransportUnavailable, match="cannot check the shared secret"):
        open_engine("mooncake")
