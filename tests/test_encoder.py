"""The encode server in real processes on loopback, one per backend, driven as a prefill node would be:
httpx for /encode and /send, a ZMQ PULL for the notifications, and a real `TransferEngine` owning the
buffer the encoder writes into. Media loading, the settings and the cache are also tested in-process.

The "seed's bodies" tests post exactly what a receiver written from seed 000's code posts (SGLang's
`MMReceiverHTTP.encode()` and its /send loop, and /scheduler_receive_url), and check that `EmbeddingReceiver`
builds those same bodies.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import torch
import zmq

from epd_lab import models
from epd_lab.ep import media
from epd_lab.noise import data_uri, random_png
from epd_lab.servers import encoder as enc
from epd_lab.servers.encoder import EmbeddingCache, EncoderSettings
from epd_lab.ep.messages import EmbeddingData, EmbeddingNotify, EncodeResponse, decode_zmq
from epd_lab.ep.receiver import EmbeddingReceiver, EPDError, PartPlan, ReceiverConfig, encode_request, send_request
from epd_lab.serving import MAX_BODY_BYTES
from epd_lab.transfer import TransferEngine
from helpers import plain_metrics, read_line, wait_for

TIMEOUT = 1.5  # the servers' --timeout: the wait for a receive URL that never comes
TTL = 2.0  # the mooncake server's --embedding-ttl


def png_bytes(size: tuple[int, int], seed: int) -> bytes:
    """A noise image of `size` = (width, height) as PNG bytes."""
    return random_png(seed, size[::-1])


# ---- servers ----
@dataclass
class Server:
    """One encoder process and an HTTP client to it."""

    proc: subprocess.Popen
    url: str
    client: httpx.Client

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def metric(self, line_start: str) -> float:
        text = plain_metrics(self.client.get("/metrics").text)
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
        return sum(values)


def _start(backend: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "epd_lab.servers.encoder", "--port", "0", "--backend", backend,
         "--timeout", str(TIMEOUT), "--embedding-ttl", str(TTL), "--cache-bytes", str(4 << 20),
         "--media-roots", tempfile.gettempdir()],  # pytest's tmp_path lies there
        stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    """One encoder per backend, started together (each loads the model: seconds), all killed afterwards."""
    procs = {backend: _start(backend) for backend in ("mooncake", "zmq_to_tokenizer", "zmq_to_scheduler")}
    try:
        deadline = time.monotonic() + 90
        out = {}
        for backend, proc in procs.items():
            url = json.loads(read_line(proc, max(0.0, deadline - time.monotonic()), f"the {backend} encoder printed "
                                       "its URL"))["url"]
            out[backend] = Server(proc, url, httpx.Client(base_url=url, timeout=10))
        yield out
        for server in out.values():
            server.client.close()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.returncode is not None


@pytest.fixture(scope="module")
def vision() -> Iterator[models.VisionEncoder]:
    """The same model in this process, to compute the embeddings the encoder must deliver."""
    threads = torch.get_num_threads()
    models.configure_torch(threads=1)
    try:
        yield models.VisionEncoder(models.load_model())
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def pull_socket() -> Iterator[tuple[zmq.Socket, int]]:
    """A ZMQ PULL on an OS-chosen port: a receiver's embedding_port."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, port
    finally:
        sock.close()
        ctx.term()


@pytest.fixture
def pull() -> Iterator[tuple[zmq.Socket, int]]:
    with pull_socket() as out:
        yield out


@pytest.fixture(scope="module")
def receiver() -> Iterator[TransferEngine]:
    with TransferEngine(timeout=2.0) as engine:
        yield engine


def recv(sock: zmq.Socket, timeout: float = 5.0) -> EmbeddingNotify | EmbeddingData:
    assert sock.poll(int(timeout * 1000)), "no ZMQ message arrived"
    return decode_zmq(sock.recv())


def local_embedding(vision: models.VisionEncoder, raws: list[bytes]) -> torch.Tensor:
    images = [media.decode_image(raw) for raw in raws]
    return vision.encode_images(images)[0]


def encode_body(req_id: str, items: list[str], **extra: object) -> dict:
    return {"mm_items": items, "num_parts": 1, "part_idx": 0, "req_id": req_id, **extra}


def seed_encode_body(rid: str, part_idx: int, num_parts: int, items: list[str], embedding_port: int | None,
                     encoder_idx: int = 0) -> dict:
    """The /encode body exactly as seed 000's `MMReceiverHTTP.encode()` builds it."""
    return {"encoder_idx": encoder_idx, "mm_items": items, "num_parts": num_parts, "part_idx": part_idx,
            "req_id": f"{rid}_local_part_{part_idx}", "modality": "IMAGE", "prefill_host": "127.0.0.1",
            "embedding_port": embedding_port}


IMG_A = png_bytes((224, 224), 1)
IMG_B = png_bytes((168, 112), 2)


# ---- mooncake ----
def test_mooncake_encode_send_lands_the_embedding(servers, vision, receiver, pull, tmp_path):
    server, (sock, port) = servers["mooncake"], pull
    sent = server.metric("epd_lab:encoder_bytes_sent_total")
    img_a, img_b = png_bytes((224, 224), 21), png_bytes((168, 112), 22)  # not in the cache: decoded
    path = tmp_path / "b.png"
    path.write_bytes(img_b)
    t0 = time.perf_counter()
    resp = server.client.post("/encode", json=encode_body("moon_local_part_0", [data_uri(img_a), str(path)]))
    t_encode = time.perf_counter() - t0
    assert resp.status_code == 200, resp.text
    meta = resp.json()
    # 224² → 16×16 patches → 64 tokens; 168×112 → 12×8 patches → 24 tokens
    assert meta == {"req_id": "moon_local_part_0", "part_idx": 0, "embedding_size": 88 * 256 * 4,
                    "embedding_len": 88, "embedding_dim": 256, "dtype": "float32",
                    "grid_thw": [[1, 16, 16], [1, 8, 12]]}

    # another part's bytes come first in the prefill's buffer: write at base + offset
    offset = 4096
    buf = torch.zeros(offset + meta["embedding_size"], dtype=torch.uint8)
    base, _, _ = receiver.register_buffer(buf)
    try:
        t0 = time.perf_counter()
        resp = server.client.post("/send", json={
            "req_id": "moon_local_part_0", "part_idx": 0, "session_id": receiver.session_id,
            "buffer_address": base + offset, "embedding_size": meta["embedding_size"], "embedding_port": port})
        t_send = time.perf_counter() - t0
        assert resp.status_code == 200, resp.text
        assert resp.json()["path"] in ("shm", "tcp") and resp.json()["embedding_size"] == meta["embedding_size"]
        msg = recv(sock)
    finally:
        receiver.deregister_buffer(buf)
    print(f"/encode {t_encode * 1e3:.1f} ms, /send {t_send * 1e3:.1f} ms")

    assert type(msg) is EmbeddingNotify and msg.error is None
    assert (msg.req_id, msg.part_idx, msg.modality) == ("moon_local_part_0", 0, "IMAGE")
    assert (msg.shape, msg.dtype, msg.grid_thw) == ([88, 256], "float32", meta["grid_thw"])
    assert [s.stage for s in msg.spans] == ["intake", "load", "decode", "vit", "transfer", "notify"]
    assert {s.node for s in msg.spans} == {f"encoder:{server.port}"}
    intake, load, decode, vit = msg.spans[:4]
    assert intake.nbytes > 0  # the /encode body's bytes
    assert load.nbytes == len(img_a) + len(img_b)  # the media's bytes; decode's are the pixels'
    assert decode.nbytes == (224 * 224 + 168 * 112) * 3 and vit.nbytes == meta["embedding_size"]
    # at one part in flight the decoding may start beside the hash, inside the load span; it ends after it
    assert intake.t_end_ns <= load.t_start_ns <= decode.t_start_ns and load.t_end_ns <= decode.t_end_ns \
        <= vit.t_start_ns <= msg.spans[4].t_start_ns
    assert not buf[:offset].any()
    landed = buf[offset:].view(torch.float32).reshape(msg.shape)
    assert torch.equal(landed, local_embedding(vision, [img_a, img_b]))
    assert server.metric("epd_lab:encoder_bytes_sent_total") == sent + meta["embedding_size"]

    # released after sending: a second /send is refused
    resp = server.client.post("/send", json={
        "req_id": "moon_local_part_0", "part_idx": 0, "session_id": receiver.session_id,
        "buffer_address": base, "embedding_size": meta["embedding_size"], "embedding_port": port})
    assert resp.status_code == 404 and "not held" in resp.json()["detail"]


def test_mooncake_refused_write_answers_4xx_and_notifies(servers, receiver, pull):
    server, (sock, port) = servers["mooncake"], pull
    size = server.client.post("/encode", json=encode_body("refused", [data_uri(IMG_A)])).json()["embedding_size"]
    buf = torch.zeros(size, dtype=torch.uint8)
    base, _, _ = receiver.register_buffer(buf)
    refused_before = receiver.stats()["writes_refused"]
    try:
        # the write would run past the registered region: the receiver's engine refuses it
        resp = server.client.post("/send", json={
            "req_id": "refused", "part_idx": 0, "session_id": receiver.session_id,
            "buffer_address": base + 64, "embedding_size": size, "embedding_port": port})
    finally:
        receiver.deregister_buffer(buf)
    assert resp.status_code == 403 and "refused" in resp.json()["detail"]
    msg = recv(sock)
    assert msg.req_id == "refused" and "refused" in msg.error
    assert receiver.stats()["writes_refused"] == refused_before + 1
    assert not buf.any()
    # the encoder keeps serving
    assert server.client.get("/health").json()["status"] == "ok"
    assert server.client.post("/encode", json=encode_body("after_refused", [data_uri(IMG_A)])).status_code == 200


def test_mooncake_dead_receiver_answers_502_and_notifies(servers, pull):
    server, (sock, port) = servers["mooncake"], pull
    size = server.client.post("/encode", json=encode_body("dead", [data_uri(IMG_B)])).json()["embedding_size"]
    with TransferEngine() as gone:
        session_id = gone.session_id  # a port nobody listens on once closed
    resp = server.client.post("/send", json={"req_id": "dead", "part_idx": 0, "session_id": session_id,
                                             "buffer_address": 4096, "embedding_size": size, "embedding_port": port})
    assert resp.status_code == 502, resp.text
    assert recv(sock).error == resp.json()["detail"]


def test_mooncake_send_errors(servers, receiver):
    client = servers["mooncake"].client
    size = client.post("/encode", json=encode_body("errs", [data_uri(IMG_A)])).json()["embedding_size"]
    send = {"req_id": "errs", "part_idx": 0, "session_id": receiver.session_id, "buffer_address": 4096,
            "embedding_size": size, "embedding_port": 1}

    def post(**change: object) -> httpx.Response:
        return client.post("/send", json={**send, **change})

    assert post(req_id="never_encoded").status_code == 404
    resp = post(embedding_size=size + 4)
    assert resp.status_code == 400 and "does not match" in resp.json()["detail"]
    assert post(part_idx=1).status_code == 400
    assert post(session_id="no-port").status_code == 400
    assert post(embedding_port=None).status_code == 400
    # the rest of the /encode answer (the seed posts it back) must match what was encoded
    for field, value in (("embedding_len", 1), ("embedding_dim", 255), ("dtype", "bfloat16"),
                         ("grid_thw", [[1, 2, 2]])):
        resp = post(**{field: value})
        assert resp.status_code == 400 and f"{field} {value!r} does not match" in resp.json()["detail"], resp.text
    for field, value in (("prefill_host", "127.0.0.1;10.0.0.1"), ("prefill_host", "*"), ("embedding_port", 0),
                         ("embedding_port", 65536), ("buffer_address", -1), ("rkey", -1)):
        assert post(**{field: value}).status_code == 400, (field, value)
    assert client.post("/send", json={**send, "extra": 1}).status_code == 400
    # still held after the refusals above; a second /encode of the same req_id is a conflict
    assert client.post("/encode", json=encode_body("errs", [data_uri(IMG_A)])).status_code == 409


def test_mooncake_embedding_released_after_ttl(servers, receiver):
    server = servers["mooncake"]
    meta = server.client.post("/encode", json=encode_body("ttl", [data_uri(IMG_A)])).json()
    expired = server.metric("epd_lab:encoder_embeddings_expired_total")
    wait_for(lambda: server.client.get("/health").json()["embeddings_held"] == 0, TTL + 5,
             "the held embeddings released at their TTL", interval=0.1)
    assert server.metric("epd_lab:encoder_embeddings_expired_total") > expired
    resp = server.client.post("/send", json={"req_id": "ttl", "part_idx": 0, "session_id": receiver.session_id,
                                             "buffer_address": 4096, "embedding_size": meta["embedding_size"],
                                             "embedding_port": 1})
    assert resp.status_code == 404 and "embedding_ttl" in resp.json()["detail"]


def test_encode_request_errors(servers, tmp_path):
    client = servers["mooncake"].client
    (tmp_path / "not.png").write_bytes(b"not an image")
    cases = {
        b"{": "malformed",
        b'{"mm_items": [], "num_parts": 1, "part_idx": 0, "req_id": "e"}': "empty",
        b'{"mm_items": ["x"], "num_parts": 1, "part_idx": 0}': "malformed",
        b'{"mm_items": ["x"], "num_parts": 1, "part_idx": 0, "req_id": "e", "bogus": 1}': "malformed",
        b'{"mm_items": ["x"], "num_parts": 1, "part_idx": 1, "req_id": "e"}': "part_idx",
    }
    for body, words in cases.items():
        resp = client.post("/encode", content=body)
        assert resp.status_code == 400 and words in resp.json()["detail"], (body, resp.text)
    for items, modality, words in (
        ([data_uri(IMG_A)], "VIDEO", "modality VIDEO is not served"),
        ([data_uri(IMG_A)], "audio", "modality AUDIO is not served"),
        ([data_uri(IMG_A)], "bogus", "unknown modality"),
        ([data_uri(IMG_A), "data:image/png;base64,!!!"], "image", "mm_items[1]"),
        ([str(tmp_path / "not.png")], "image", "not an image"),
        ([str(tmp_path / "missing.png")], "image", "cannot read"),
        ([data_uri(bomb_png((10_000, 10_000)))], "image", "exceeds limit"),  # refused at the header
    ):
        resp = client.post("/encode", json=encode_body("e", items, modality=modality))
        assert resp.status_code == 400 and words in resp.json()["detail"], resp.text
    for extra, words in (({"encoder_idx": -1}, "encoder_idx"), ({"encoder_idx": "0"}, "encoder_idx"),
                         ({"prefill_host": "eth0;10.0.0.1"}, "not a host name"), ({"prefill_host": ""}, "not a host"),
                         ({"embedding_port": 0}, "embedding_port"), ({"num_parts": 0}, "num_parts")):
        resp = client.post("/encode", json={**encode_body("e", [data_uri(IMG_A)]), **extra})
        assert resp.status_code == 400 and words in resp.json()["detail"], (extra, resp.text)
    resp = client.post("/encode", content=b" " * (MAX_BODY_BYTES + 1))
    assert resp.status_code == 413
    # routes of other backends
    assert client.post("/scheduler_receive_url", json={"req_id": "e", "receive_url": "tcp://h:1"}).status_code == 400
    assert servers["zmq_to_tokenizer"].client.post("/send", json={
        "req_id": "e", "part_idx": 0, "session_id": "h:1", "buffer_address": 1, "embedding_size": 1}).status_code == 400


# ---- /encode reads the header, the worker decodes ----
def truncated_png(size: tuple[int, int], seed: int) -> bytes:
    """A PNG whose header (its size included) is sound and whose pixel data stops half way."""
    raw = png_bytes(size, seed)
    return raw[:len(raw) // 2]


def bomb_png(size: tuple[int, int]) -> bytes:
    """A PNG header claiming `size` (a decompression bomb's), followed by nothing worth decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    ihdr = size[0].to_bytes(4, "big") + size[1].to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def send_body(meta: dict, receiver: TransferEngine, address: int, port: int) -> dict:
    """The seed's /send body: the /encode answer plus where to write, and where to notify."""
    return {**meta, "session_id": receiver.session_id, "buffer_address": address, "embedding_port": port}


def test_encode_answers_from_the_header_before_the_image_is_decoded(servers, receiver, pull, tmp_path):
    """The worker is kept busy by a first part's ViT; a second part's /encode, a large image, is answered
    meanwhile: its answer comes before its `decode` span even starts (/encode read the header only; its bytes are
    hashed after the answer).
    672² (576 tokens): a ViT long enough to outlast an /encode, short enough for the servers' timeout."""
    server, (sock, port) = servers["mooncake"], pull

    def send(meta: dict) -> EmbeddingNotify:
        buf = torch.zeros(meta["embedding_size"], dtype=torch.uint8)
        base, _, _ = receiver.register_buffer(buf)
        try:
            resp = server.client.post("/send", json=send_body(meta, receiver, base, port))
            assert resp.status_code == 200, resp.text
            msg = recv(sock)
        finally:
            receiver.deregister_buffer(buf)
        assert msg.error is None and msg.req_id == meta["req_id"]
        return msg

    # The encoder's first write to this receiver settles its shm copy (`transfer.shm_copy`: a calibration, seconds
    # when loaded). Done first: during the first /send below, the second part would be held past its TTL (404).
    send(server.client.post("/encode", json=encode_body("hdr_warm", [data_uri(IMG_B)])).json())
    answers, paths = {}, {}
    # Both images are made before the first /encode: making a 672² noise PNG takes as long as the ViT
    # (~0.3 s, more when loaded), and between the two /encodes it let the busy ViT end first.
    for req_id, seed in (("hdr_busy", 31), ("hdr", 32)):
        paths[req_id] = tmp_path / f"{req_id}.png"
        paths[req_id].write_bytes(png_bytes((672, 672), seed))
    for req_id, path in paths.items():
        resp = server.client.post("/encode", json=encode_body(req_id, [str(path)]))
        answered = time.monotonic_ns()  # CLOCK_MONOTONIC, which the encoder's spans share
        assert resp.status_code == 200, resp.text
        answers[req_id] = resp.json(), answered
    spans = {req_id: {s.stage: s for s in send(meta).spans} for req_id, (meta, _) in answers.items()}
    meta, answered = answers["hdr"]
    assert meta["grid_thw"] == [[1, 48, 48]] and meta["embedding_len"] == 576
    load, decode, vit = (spans["hdr"][stage] for stage in ("load", "decode", "vit"))
    # answered from the header: before the decode began (the hash, the load span's end, may come after)
    assert load.t_start_ns < answered < decode.t_start_ns < decode.t_end_ns <= vit.t_start_ns
    assert decode.nbytes == 672 * 672 * 3
    assert spans["hdr_busy"]["vit"].t_end_ns <= decode.t_start_ns  # one worker: it was busy until then


def test_mooncake_truncated_image_is_a_400_at_send_and_an_error_notify(servers, receiver, pull):
    """A truncated PNG with a sound header: /encode answers its size; the worker finds the data truncated, so
    /send answers 400 naming the item and the receiver is notified of the same error, long before the
    timeout; nothing is written and the part is released."""
    server, (sock, port) = servers["mooncake"], pull
    items = [data_uri(IMG_B), data_uri(truncated_png((224, 224), 41))]
    resp = server.client.post("/encode", json=encode_body("trunc", items))
    assert resp.status_code == 200, resp.text
    meta = resp.json()
    assert meta["grid_thw"] == [[1, 8, 12], [1, 16, 16]]
    buf = torch.zeros(meta["embedding_size"], dtype=torch.uint8)
    base, _, _ = receiver.register_buffer(buf)
    try:
        t0 = time.monotonic()
        resp = server.client.post("/send", json=send_body(meta, receiver, base, port))
        msg = recv(sock)
        elapsed = time.monotonic() - t0
    finally:
        receiver.deregister_buffer(buf)
    detail = resp.json()["detail"]
    assert resp.status_code == 400 and detail.startswith("mm_items[1]: data:image/png;base64,"), resp.text
    assert "does not decode as an image: image file is truncated" in detail
    assert type(msg) is EmbeddingNotify and (msg.req_id, msg.error) == ("trunc", detail)
    assert elapsed < TIMEOUT  # the error, not the timeout (504)
    assert not buf.any()
    assert server.client.post("/send", json=send_body(meta, receiver, base, port)).status_code == 404


def test_receiver_fails_a_truncated_image_with_its_send_answer_s_400(servers):
    """The receiver waits for the notifies, not the /send answers; the error notify of a truncated image carries
    no status, so the request fails with its /send answer's 400 (the client's error), not a 502, whichever of
    the two comes first (a race: several requests, so that both orders occur)."""
    with EmbeddingReceiver(ReceiverConfig([servers["mooncake"].url], "mooncake", timeout=TIMEOUT)) as rx:
        for i in range(12):
            with pytest.raises(EPDError) as raised:
                rx.receive([data_uri(IMG_B), data_uri(truncated_png((224, 224), 100 + i))], f"trunc-rx-{i}")
            assert raised.value.status == 400 and "image file is truncated" in str(raised.value), i


@pytest.mark.parametrize("backend", ["zmq_to_tokenizer", "zmq_to_scheduler"])
def test_zmq_truncated_image_is_a_400_and_an_error_message(servers, pull, backend):
    """The zmq backends answer /encode after the ViT: a truncated image is a 400 naming the item, and the
    message pushed to the receiver carries the same error (and no bytes), long before the timeout."""
    server, (sock, port) = servers[backend], pull
    req_id = f"trunc_{backend}"
    if backend == "zmq_to_scheduler":
        url = {"req_id": req_id, "receive_url": f"127.0.0.1:{port}", "receive_count": 1}
        assert server.client.post("/scheduler_receive_url", json=url).status_code == 200
    items = [data_uri(IMG_B), data_uri(truncated_png((224, 224), 42))]
    t0 = time.monotonic()
    resp = server.client.post("/encode", json=encode_body(req_id, items, embedding_port=port))
    msg = recv(sock)
    elapsed = time.monotonic() - t0
    detail = resp.json()["detail"]
    assert resp.status_code == 400 and detail.startswith("mm_items[1]: ") and "image file is truncated" in detail
    assert type(msg) is EmbeddingData and (msg.req_id, msg.error, msg.data) == (req_id, detail, b"")
    assert elapsed < TIMEOUT


def test_mooncake_cached_image_is_never_decoded(servers, receiver, pull):
    """The same bytes twice: the second part's embedding comes from the cache, and no `decode` span says it
    was decoded; the bytes are the same."""
    server, (sock, port) = servers["mooncake"], pull
    item = data_uri(png_bytes((224, 224), 43))
    hits = server.metric("epd_lab:encoder_cache_hits_total")
    landed = []
    for req_id, stages in (("cached_0", ["intake", "load", "decode", "vit"]), ("cached_1", ["intake", "load", "vit"])):
        meta = server.client.post("/encode", json=encode_body(req_id, [item])).json()
        buf = torch.zeros(meta["embedding_size"], dtype=torch.uint8)
        base, _, _ = receiver.register_buffer(buf)
        try:
            assert server.client.post("/send", json=send_body(meta, receiver, base, port)).status_code == 200
            msg = recv(sock)
        finally:
            receiver.deregister_buffer(buf)
        assert msg.error is None and [s.stage for s in msg.spans] == [*stages, "transfer", "notify"]
        landed.append(buf)
    assert torch.equal(*landed)
    assert server.metric("epd_lab:encoder_cache_hits_total") == hits + 1


# ---- zmq backends ----
def test_zmq_to_tokenizer_pushes_the_bytes_and_caches(servers, vision, pull):
    """The second request is a cache hit (same bytes, another request): no decode span (a decode started beside
    its hash is dropped unused)."""
    server, (sock, port) = servers["zmq_to_tokenizer"], pull
    hits = server.metric("epd_lab:encoder_cache_hits_total")
    img = png_bytes((168, 112), 23)  # not in the cache yet
    expected = local_embedding(vision, [img])
    for req_id, stages in (("tok_0", ["intake", "load", "decode", "vit", "transfer"]),
                           ("tok_1", ["intake", "load", "vit", "transfer"])):
        resp = server.client.post("/encode", json=encode_body(req_id, [data_uri(img)], embedding_port=port))
        assert resp.status_code == 200, resp.text
        msg = recv(sock)
        assert type(msg) is EmbeddingData and msg.error is None and msg.req_id == req_id
        assert (msg.shape, msg.grid_thw) == ([24, 256], [[1, 8, 12]])
        assert [s.stage for s in msg.spans] == stages
        assert msg.spans[-2].nbytes == len(msg.data) == resp.json()["embedding_size"]
        got = torch.frombuffer(bytearray(msg.data), dtype=torch.float32).reshape(msg.shape)
        assert torch.equal(got, expected)
    assert server.metric("epd_lab:encoder_cache_hits_total") == hits + 1
    resp = server.client.post("/encode", json=encode_body("tok_x", [data_uri(IMG_B)]))
    assert resp.status_code == 400 and "embedding_port" in resp.json()["detail"]


def test_zmq_to_scheduler_waits_for_the_receive_url(servers, vision, pull):
    server, (sock, port) = servers["zmq_to_scheduler"], pull
    url = f"tcp://127.0.0.1:{port}"
    expected = local_embedding(vision, [IMG_A])
    # URL after /encode: /encode waits for it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(server.client.post, "/encode", json=encode_body("sch_0", [data_uri(IMG_A)]))
        time.sleep(0.2)
        resp = server.client.post("/scheduler_receive_url", json={"req_id": "sch_0", "receive_url": url})
        assert resp.status_code == 200
        assert fut.result().status_code == 200, fut.result().text
    # URL before /encode
    assert server.client.post("/scheduler_receive_url", json={"req_id": "sch_1", "receive_url": url}).status_code == 200
    assert server.client.post("/encode", json=encode_body("sch_1", [data_uri(IMG_A)])).status_code == 200
    for req_id in ("sch_0", "sch_1"):
        msg = recv(sock)
        assert type(msg) is EmbeddingData and msg.req_id == req_id
        got = torch.frombuffer(bytearray(msg.data), dtype=torch.float32).reshape(msg.shape)
        assert torch.equal(got, expected)
    # no URL ever: an error after the timeout
    resp = server.client.post("/encode", json=encode_body("sch_none", [data_uri(IMG_A)]))
    assert resp.status_code == 504 and "/scheduler_receive_url" in resp.json()["detail"]
    for url in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "*:5555", "eth0;127.0.0.1:5555", "ipc:///tmp/x",
                "udp://127.0.0.1:5555", "tcp://127.0.0.1:5555/x", "[fe80::1%eth0]:5555", " 127.0.0.1:5555"):
        resp = server.client.post("/scheduler_receive_url", json={"req_id": "x", "receive_url": url})
        assert resp.status_code == 400 and "receive_url" in resp.json()["detail"], (url, resp.text)


# ---- the seed's bodies ----
def test_seed_mooncake_bodies_land_the_embedding(servers, vision, receiver, pull):
    """Seed 000's mooncake flow, body for body: /encode per part, then each part's /encode answer, updated with
    session_id and buffer_address = base + offset, posted back to /send; the bytes land part after part."""
    server, (sock, port) = servers["mooncake"], pull
    raws = [[IMG_A], [IMG_B, IMG_A]]
    # a receiver whose encoder list names this server twice: the parts' encoder_idx are 0 and 1
    bodies = [seed_encode_body("seed_moon", i, len(raws), [data_uri(r) for r in part], port, encoder_idx=i)
              for i, part in enumerate(raws)]
    replies = [server.client.post("/encode", json=body) for body in bodies]
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert server.client.get("/health").json()["encoder_idx"] == 1  # the latest /encode's
    answers = sorted((r.json() for r in replies), key=lambda a: a["part_idx"])  # the seed sorts by part_idx
    assert [a["req_id"] for a in answers] == ["seed_moon_local_part_0", "seed_moon_local_part_1"]
    sizes = [a["embedding_size"] for a in answers]

    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    base, _, _ = receiver.register_buffer(buf)
    try:
        offset = 0
        for answer in answers:  # the seed's /send loop
            answer.update({"session_id": receiver.session_id, "buffer_address": offset + base})
            resp = server.client.post("/send", json=answer)
            assert resp.status_code == 200, resp.text
            offset += answer["embedding_size"]
        msgs = sorted((recv(sock) for _ in answers), key=lambda m: m.part_idx)
    finally:
        receiver.deregister_buffer(buf)

    offset = 0
    for part, answer, msg in zip(raws, answers, msgs, strict=True):
        assert type(msg) is EmbeddingNotify and msg.error is None
        assert (msg.req_id, msg.modality, msg.grid_thw) == (answer["req_id"], "IMAGE", answer["grid_thw"])
        assert msg.shape == [answer["embedding_len"], answer["embedding_dim"]]
        landed = buf[offset:offset + answer["embedding_size"]].view(torch.float32).reshape(msg.shape)
        assert torch.equal(landed, local_embedding(vision, part))
        offset += answer["embedding_size"]


def test_modality_is_matched_by_name_in_any_case(servers, pull):
    server, (sock, port) = servers["zmq_to_tokenizer"], pull
    for i, modality in enumerate(("IMAGE", "image", "Image")):
        resp = server.client.post("/encode", json={**seed_encode_body("seed_case", i, 3, [data_uri(IMG_B)], port),
                                                   "modality": modality})
        assert resp.status_code == 200, resp.text
        assert recv(sock).modality == "IMAGE"


def test_seed_zmq_to_tokenizer_body(servers, vision, pull):
    server, (sock, port) = servers["zmq_to_tokenizer"], pull
    resp = server.client.post("/encode", json=seed_encode_body("seed_tok", 0, 1, [data_uri(IMG_B)], port))
    assert resp.status_code == 200, resp.text
    msg = recv(sock)
    assert type(msg) is EmbeddingData and (msg.req_id, msg.error) == ("seed_tok_local_part_0", None)
    got = torch.frombuffer(bytearray(msg.data), dtype=torch.float32).reshape(msg.shape)
    assert torch.equal(got, local_embedding(vision, [IMG_B]))


def test_seed_zmq_to_scheduler_bodies_reach_every_receiver(servers, vision, pull):
    """The seed's {req_id, receive_url="host:port", receive_count}: two scheduler ranks each post their URL
    (no scheme, as the seed; "tcp://" accepted too) and both get the bytes once both are known."""
    server, (sock, port) = servers["zmq_to_scheduler"], pull
    expected = local_embedding(vision, [IMG_A])
    req_id = "seed_sch_local_part_0"

    def post_url(url: str, count: int, rid: str = req_id) -> httpx.Response:
        return server.client.post("/scheduler_receive_url", json={"req_id": rid, "receive_url": url,
                                                                  "receive_count": count})

    with pull_socket() as (sock2, port2):
        resp = post_url(f"127.0.0.1:{port}", 2)
        assert resp.status_code == 200 and resp.json()["receive_url"] == f"tcp://127.0.0.1:{port}"
        assert post_url(f"127.0.0.1:{port}", 2).status_code == 200  # the same URL again: still one receiver
        resp = post_url(f"127.0.0.1:{port2}", 3)
        assert resp.status_code == 400 and "receive_count 3 differs" in resp.json()["detail"]
        assert post_url(f"tcp://127.0.0.1:{port2}", 2).status_code == 200
        resp = post_url("127.0.0.1:1", 2)
        assert resp.status_code == 400 and "already has its 2" in resp.json()["detail"]
        resp = server.client.post("/encode", json=seed_encode_body("seed_sch", 0, 1, [data_uri(IMG_A)], None))
        assert resp.status_code == 200, resp.text
        for s in (sock, sock2):
            msg = recv(s)
            assert type(msg) is EmbeddingData and (msg.req_id, msg.error) == (req_id, None)
            # its own send only (decode or not: IMG_A may be in the cache already)
            assert [sp.stage for sp in msg.spans if sp.stage != "decode"] == ["intake", "load", "vit", "transfer"]
            assert torch.equal(torch.frombuffer(bytearray(msg.data), dtype=torch.float32).reshape(msg.shape),
                               expected)

        # one of two receivers never posts: the one that did hears why, within the timeout
        assert post_url(f"127.0.0.1:{port2}", 2, "seed_sch_local_part_1").status_code == 200
        resp = server.client.post("/encode", json=seed_encode_body("seed_sch", 1, 2, [data_uri(IMG_A)], None))
        assert resp.status_code == 504 and "/scheduler_receive_url" in resp.json()["detail"]
        msg = recv(sock2)
        assert msg.req_id == "seed_sch_local_part_1" and "/scheduler_receive_url" in msg.error
    assert post_url(f"127.0.0.1:{port}", 0).status_code == 400


def test_receiver_builds_the_seed_bodies():
    """`EmbeddingReceiver` posts what seed 000's receiver posts: the /encode body field for field, and the
    /encode answer updated with session_id and buffer_address (plus where to notify and the rkey)."""
    plan = PartPlan(part_idx=1, encoder=2, modality="image", items=["a.png", "b.png"])
    body = msgspec.json.decode(msgspec.json.encode(encode_request("r", 3, plan, "127.0.0.1", 5555)))
    assert body == seed_encode_body("r", 1, 3, ["a.png", "b.png"], 5555, encoder_idx=2)
    answer = EncodeResponse("r_local_part_1", 1, 1024, 1, 256, "float32", [[1, 2, 2]])
    body = msgspec.to_builtins(send_request(answer, "127.0.0.1:7000", 4096, "127.0.0.1", 5555, 7))
    assert body == {**msgspec.to_builtins(answer), "session_id": "127.0.0.1:7000", "buffer_address": 4096,
                    "prefill_host": "127.0.0.1", "embedding_port": 5555, "rkey": 7}
    with pytest.raises(ValueError, match="unknown modality"):
        encode_request("r", 3, PartPlan(0, 0, "pictures", ["a.png"]), "127.0.0.1", 5555)


def test_health_and_metrics(servers, pull):
    server, tokenizer = servers["mooncake"], servers["zmq_to_tokenizer"]
    assert server.client.post("/encode", content=b"[]").status_code == 400
    assert server.client.post("/encode", json=encode_body("metrics", [data_uri(png_bytes((56, 56), 3))])).is_success
    health = server.client.get("/health").json()
    assert health["backend"] == "mooncake" and health["model"] == "tiny-qwen2-vl"
    assert health["session_id"].startswith("127.0.0.1:") and health["node"] == f"encoder:{server.port}"
    assert tokenizer.client.get("/health").json()["session_id"] is None
    assert server.metric('epd_lab:encoder_requests_total{route="/health",status="200"}') >= 1
    assert server.metric('epd_lab:encoder_requests_total{route="/encode",status="400"}') >= 1
    assert server.metric("epd_lab:encoder_embeddings_held") >= 1
    assert server.metric("epd_lab:encoder_cache_misses_total") >= 1
    # the zmq backends answer /encode after the ViT: its result is in the cache by now
    body = encode_body("metrics", [data_uri(png_bytes((56, 56), 4))], embedding_port=pull[1])
    assert tokenizer.client.post("/encode", json=body).is_success
    assert 0 < tokenizer.metric("epd_lab:encoder_cache_bytes") <= 4 << 20
    assert tokenizer.metric("epd_lab:encoder_bytes_sent_total") >= 4 * 256 * 4  # 56² → 4 tokens
    for proc in (s.proc for s in servers.values()):
        assert proc.poll() is None


# ---- in-process ----
def test_settings_are_checked():
    assert EncoderSettings().backend == "mooncake"
    for bad in ({"backend": "grpc"}, {"dtype": "float16"}, {"transport": "rdma"}, {"port": 70000},
                {"timeout": 0}, {"embedding_ttl": -1}, {"cache_bytes": -1}):
        with pytest.raises(ValueError):
            EncoderSettings(**bad)


def test_cache_evicts_least_recently_used():
    cache = EmbeddingCache(capacity_bytes=3 * 400)
    for key in "abc":
        cache.put(key, torch.zeros(100))  # 400 bytes each
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("d", torch.zeros(100))
    assert cache.get("b") is None and cache.get("c") is not None
    cache.put("huge", torch.zeros(1000))  # larger than the cache: not kept
    assert (cache.hits, cache.misses, cache.evictions, cache.num_bytes, len(cache)) == (2, 1, 1, 1200, 3)


def test_decode_items_takes_over_what_the_decoder_did_not_start():
    """`_decode_items`: an item whose decode the decoder thread had not begun is decoded in the ViT's thread (the
    decoder's future cancelled), one begun there is awaited, with its start as the decode's; the pixels equal
    a plain decode, and a truncated item's `MediaError` names it wherever it was decoded."""
    raws = [png_bytes((64, 48), 1), png_bytes((32, 32), 2), truncated_png((64, 64), 3)]
    items = [enc._Item(i, f"item{i}", raw, media.open_image(raw)) for i, raw in enumerate(raws)]
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as decoder:
        blocker = decoder.submit(gate.wait)  # the decoder is busy: items 1 and 2 wait behind item 0's start
        items[0].decoded = concurrent.futures.Future()
        items[0].decoded.set_running_or_notify_cancel()
        started = time.monotonic_ns()
        items[0].decoded.set_result((media.decode_image(raws[0]), started))
        items[1].decoded = decoder.submit(enc._timed_decode, items[1])
        images, t0 = enc._decode_items(items[:2])
        assert items[1].decoded.cancelled() and t0 == started
        assert [img.tobytes() for img in images] == [media.decode_image(raw).tobytes() for raw in raws[:2]]
        items[2].decoded = decoder.submit(enc._timed_decode, items[2])
        gate.set()
        blocker.result()
        with pytest.raises(media.MediaError, match=r"mm_items\[2\].*truncated"):
            enc._decode_items(items[2:])


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts: list[str] = []  # the Host header of every GET, in order

    def do_GET(self) -> None:
        _Handler.hosts.append(self.headers.get("Host", ""))
        body = {"/a.png": IMG_A, "/big": b"x" * 5000}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_media() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_media_sources(http_media, tmp_path):
    (tmp_path / "a.png").write_bytes(IMG_A)
    for item in (data_uri(IMG_A), str(tmp_path / "a.png"), f"file://{tmp_path}/a.png", f"{http_media}/a.png"):
        assert media.fetch_media(item, 2.0, 1 << 20) == IMG_A
        assert media.load_image(item, 2.0, 1 << 20).size == (224, 224)
    assert media.content_hash(IMG_A) == media.content_hash(bytes(IMG_A)) != media.content_hash(IMG_B)
    for item, words in ((f"{http_media}/missing", "404"), (f"{http_media}/big", "more than"),
                        ("http://127.0.0.1:1/x", "failed"), ("data:image/png,abc", "not base64"),
                        ("data:image/png;base64,@@", "not valid base64"), (data_uri(b"x" * 6000), "more than"),
                        (str(tmp_path / "nope"), "cannot read"), ("", "empty")):
        with pytest.raises(media.MediaError, match=words):
            media.fetch_media(item, 2.0, 4096)
    with pytest.raises(media.MediaError, match="not an image"):
        media.load_image(data_uri(b"GIF89a broken"), 2.0, 4096)


def test_the_media_policy_says_no_more_than_no(http_media, tmp_path):
    """A server fetching for a client: local paths only inside its roots (links resolved, regular files only,
    a FIFO refused without blocking), http(s) to private addresses only when allowed; a refusal reads the same
    whether or not the file or port exists."""
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(IMG_A)
    (root / "escape.png").symlink_to("/etc/hostname")
    os.mkfifo(root / "fifo.png")
    policy = media.MediaPolicy(roots=(str(root),))
    assert media.fetch_media(str(root / "a.png"), 2.0, 1 << 20, policy) == IMG_A
    outside = [str(tmp_path / "missing.png"), "/etc/hostname", "/proc/self/fd/1", str(root / "escape.png"),
               f"file://{root}/../media/../../etc/passwd"]
    messages = set()
    for item in outside:
        with pytest.raises(media.MediaError) as info:
            media.fetch_media(item, 2.0, 1 << 20, policy)
        messages.add(str(info.value).replace(item, "ITEM").split(" is outside")[1])
    assert messages == {" the folders this server serves media from"}
    with pytest.raises(media.MediaError, match="not a regular file"):
        media.fetch_media(str(root / "fifo.png"), 2.0, 1 << 20, policy)  # returns: O_NONBLOCK, then refused
    with pytest.raises(media.MediaError, match="local paths are not served here"):
        media.fetch_media(str(root / "a.png"), 2.0, 1 << 20, media.MediaPolicy())
    closed_port = "http://127.0.0.1:1/a.png"
    for url in (f"{http_media}/a.png", closed_port, "http://localhost:9/x", "http://[::1]:9/x", "http://10.0.0.1/x"):
        with pytest.raises(media.MediaError, match="public addresses only"):
            media.fetch_media(url, 2.0, 1 << 20, policy)
    assert media.fetch_media(f"{http_media}/a.png", 2.0, 1 << 20, media.MediaPolicy(private_hosts=True)) == IMG_A


def test_a_fetch_connects_to_the_address_it_checked(http_media):
    """Rebinding: the host is resolved once, and the connection goes to that checked address, not to whatever a
    second lookup would answer; the URL's host still reaches the server (``Host``) and, for https, the SNI name
    the certificate is checked against."""
    port = http_media.rsplit(":", 1)[1]
    _Handler.hosts.clear()
    allowed = media.MediaPolicy(private_hosts=True)
    assert media.fetch_media(f"http://localhost:{port}/a.png", 2.0, 1 << 20, allowed) == IMG_A
    assert _Handler.hosts == [f"localhost:{port}"]  # sent to the checked 127.0.0.1 as "localhost:port"
    assert media.pinned_request("https://user:pw@example.org:8443/p?q=1", "93.184.216.34") == (
        "https://93.184.216.34:8443/p?q=1", {"Host": "example.org:8443"}, {"sni_hostname": "example.org"})
    assert media.pinned_request("http://example.org/x", "2606:2800:220:1::1")[0] == "http://[2606:2800:220:1::1]/x"
    with pytest.raises(media.MediaError, match="public addresses only"):
        media.MediaPolicy().address(f"http://localhost:{port}/a.png")


def test_an_encoder_is_no_file_or_port_oracle(servers, http_media):
    """Through a real encoder (roots: the temp folder only): a file that exists and one that does not, outside
    its roots, and an open and a closed loopback port, each get the same 400."""
    client = servers["mooncake"].client
    answers = []
    for item in ("/etc/hostname", "/etc/no-such-file", f"{http_media}/a.png", "http://127.0.0.1:1/a.png"):
        resp = client.post("/encode", json=encode_body("oracle", [item]))
        assert resp.status_code == 400
        answers.append(resp.json()["detail"].replace(item, "ITEM"))
    assert answers[0] == answers[1] and answers[2] == answers[3], answers


def test_header_opens_without_decoding():
    """`open_image` reads the header only: the size of a truncated PNG is known, its pixels fail in
    `load_rgb`; decompression bombs are refused at the header."""
    bad = truncated_png((300, 200), 44)
    img = media.open_image(bad, "t.png")
    assert img.size == (300, 200)
    with pytest.raises(media.MediaError, match="t.png does not decode as an image: image file is truncated"):
        media.load_rgb(img, "t.png")
    with pytest.raises(media.MediaError, match="does not decode"):
        media.decode_image(bad)
    good = media.decode_image(IMG_B)
    assert (good.mode, good.size) == ("RGB", (168, 112))
    for side in (10_000, 20_000):  # PIL warns past its pixel limit and raises past twice it: both refused
        with pytest.raises(media.MediaError, match="exceeds limit"):
            media.open_image(bomb_png((side, side)))
