"""The global embedding cache against a real ``mooncake_master`` and real encoder processes (no mock of the store).

1. The object format, the keys and L2, in-process: an object round-trips; a changed, truncated or foreign one
   is refused; one model's encoders share keys, two models or two preprocessings never do; L2 keeps what L1
   evicted.
2. The master and the client, in-process: OS ports and no process left; the store full evicts and never fails a
   put; an unreachable master is refused within the probe's timeout; an object changed in the store is refused by
   the digest check and counted (the caller runs the ViT).
3. Two encoders behind one master (`Cluster` starts it): an image encoded by encoder A is served by encoder B
   from L3 with no ``vit`` span, bit-equal to A's ViT and to the ViT in this process; an object changed in the
   store is refused and the ViT answers right; answers through the proxy equal the monolithic model's when both
   parts of a request come from L3; the master killed under load: every request answered right within
   its deadline (the ViT as fallback), and the encoders find the store again once the master is back. An encoder
   of 2 TP ranks sends its other rank only the misses.
4. An encoder whose master cannot be reached at start warns and serves. No master outlives its cluster.

Skipped, saying why, where the Mooncake wheel (its store module or ``mooncake_master``) is absent.
"""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import openai
import pytest
import torch
from PIL import Image

from epd_lab import models
from epd_lab.ep import store
from epd_lab.ep.cache import EmbeddingCache
from epd_lab.ep.global_cache import GlobalEmbeddingCache, embedding_key
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.launch import Cluster, Topology
from epd_lab.models.runtime import open_runtime
from epd_lab.noise import random_png
from epd_lab.servers.encoder import item_key
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.reference import monolithic_chat
from helpers import free_port, metric, metrics, read_line, wait_for

REASON = store.unavailable_reason()
if REASON:
    pytest.skip(f"Mooncake Store is unavailable: {REASON}", allow_module_level=True)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]
TIMEOUT = 10.0
PRE = {"patch": 14, "merge": 2}


# ---- 1. object format and keys ----
def test_an_object_round_trips_and_a_changed_one_is_refused() -> None:
    t = torch.randn(7, 5).to(torch.bfloat16)
    obj = store.pack("k", t)
    assert torch.equal(store.unpack("k", obj), t)
    payload_at = len(obj) - t.nbytes
    flipped = bytearray(obj)
    flipped[payload_at + 3] ^= 1
    for bad, why in ((bytes(flipped), "sha256"), (obj[:-2], "payload bytes"), (obj + b"x", "payload bytes"),
                     (b"not an object", "not an embedding object"), (obj[:6], "not an embedding object")):
        with pytest.raises(store.IntegrityError, match=why):
            store.unpack("k", bad)
    with pytest.raises(store.IntegrityError, match="another key"):
        store.unpack("other", obj)
    assert store.unpack("e", store.pack("e", torch.empty(0, 4))).shape == (0, 4)


def test_keys_are_shared_by_one_model_and_never_by_two() -> None:
    key = embedding_key("ab" * 32, "/models/Qwen2-VL-2B", "bfloat16", PRE, {"hidden_size": 1280})
    assert key == embedding_key("ab" * 32, "/elsewhere/Qwen2-VL-2B", "bfloat16", PRE, {"hidden_size": 1280})
    others = [embedding_key("cd" * 32, "/models/Qwen2-VL-2B", "bfloat16", PRE, {"hidden_size": 1280}),
              embedding_key("ab" * 32, "/models/Qwen2-VL-7B", "bfloat16", PRE, {"hidden_size": 1280}),
              embedding_key("ab" * 32, "/models/Qwen2-VL-2B", "float32", PRE, {"hidden_size": 1280}),
              embedding_key("ab" * 32, "/models/Qwen2-VL-2B", "bfloat16", {**PRE, "merge": 4}, {"hidden_size": 1280}),
              embedding_key("ab" * 32, "/models/Qwen2-VL-2B", "bfloat16", PRE, {"hidden_size": 640})]
    assert len({key, *others}) == 6


def test_l2_keeps_what_l1_evicted_and_gives_it_back_to_l1() -> None:
    """L1 holds one embedding, L2 three: the first of two is evicted from L1, found in L2 (counted there), and kept
    in L1 again; with no L3 a miss in both is the ViT's (no prefetch)."""
    emb = {k: torch.full((4, 8), float(i)) for i, k in enumerate(("a", "b"))}
    cache = GlobalEmbeddingCache(EmbeddingCache(emb["a"].nbytes), 3 * emb["a"].nbytes, None, torch.device("cpu"), 1.0)
    for key, tensor in emb.items():
        cache.insert(key, tensor)
    assert "a" not in cache.l1 and "a" in cache.l2 and "b" in cache.l1
    lookup = cache.lookup(["a", "c"], [(4, 8), (4, 8)], torch.float32)
    assert lookup.prefetches == [None, None] and not lookup.found_all
    found = cache.collect(lookup)
    assert found.levels == ["l2", None] and torch.equal(found.pieces[0], emb["a"])
    assert "a" in cache.l1 and (cache.l2.hits, cache.l2.misses) == (1, 1)
    assert cache.lookup(["a", "b"], [(4, 8)] * 2, torch.float32).found_all


# ---- 2. master and client in-process ----
@pytest.fixture(scope="module")
def master() -> Iterator[store.MooncakeMaster]:
    with store.MooncakeMaster() as m:
        yield m


def test_masters_take_os_ports_and_leave_no_process() -> None:
    with store.MooncakeMaster() as a, store.MooncakeMaster() as b:
        assert a.port != b.port and a.alive() and b.alive()
        procs = [a.proc, b.proc]
    assert all(p.poll() is not None for p in procs)


def test_a_master_run_from_the_command_line_serves_and_stops_with_it() -> None:
    """``python -m epd_lab.ep.store`` (a master for encoders on other hosts) prints its address, serves a client,
    and takes its master down on SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.ep.store"], stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(read_line(proc, 20, "the master's address"))
        with store.StoreClient(hello["address"], segment_bytes=store.MIN_SEGMENT_BYTES) as client:
            assert client.put("cli", torch.ones(3)) == 0 and client.exists(["cli"]) == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        wait_for(lambda: not Path(f"/proc/{hello['pid']}").exists() or
                 Path(f"/proc/{hello['pid']}/stat").read_text().split(") ")[1][0] == "Z", 5, "the master gone")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_store_master_without_the_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="set mm_global_cache too"):
        Topology(store_master="127.0.0.1:1")


def test_a_full_store_evicts_the_oldest_and_takes_puts_again(master) -> None:
    """Puts past the pool's size: the master evicts the oldest objects (in the background: a put that finds the
    pool full before it ran fails, as the encoder's background put does, counted, never seen by a client), and
    a put succeeds again afterwards."""
    with store.StoreClient(master.address, segment_bytes=store.MIN_SEGMENT_BYTES) as client:
        t = torch.zeros(256 << 10, dtype=torch.uint8)  # 256 KiB: 64 fill the segment, 200 are put
        prefix = uuid.uuid4().hex
        rcs = [client.put(f"{prefix}/{i}", t) for i in range(200)]
        assert rcs[:40] == [0] * 40
        wait_for(lambda: client.put(f"{prefix}/last", t) == 0, 10, "a put into the full pool, once evicted")
        there = client.exists([f"{prefix}/{i}" for i in range(200)] + [f"{prefix}/last"])
        assert not there[0] and there[-1], "the oldest were evicted, the newest kept"


def test_an_unreachable_master_is_refused_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(store.StoreUnavailable, match="not reachable"):
        store.StoreClient(f"127.0.0.1:{free_port()}", timeout=1.0)
    assert time.monotonic() - t0 < 3.0


def test_an_object_changed_in_the_store_is_refused_by_the_digest(master) -> None:
    """Encoder A's cache puts an embedding; the object is then rewritten with one byte changed, truncated, and
    whole but of another shape: B's lookup finds it, its check refuses it, and B counts an integrity failure and a
    fallback (the ViT's)."""
    emb = torch.randn(16, 8)
    key = f"epd-emb/test/{uuid.uuid4().hex}"
    with store.StoreClient(master.address, segment_bytes=store.MIN_SEGMENT_BYTES) as a, \
            store.StoreClient(master.address, segment_bytes=store.MIN_SEGMENT_BYTES) as b:
        cache_a = GlobalEmbeddingCache(EmbeddingCache(0), 0, a, torch.device("cpu"), 2.0)
        cache_a.insert(key, emb)
        wait_for(lambda: cache_a.counters.puts == 1, 5, "A's put")
        cache_b = GlobalEmbeddingCache(EmbeddingCache(0), 0, b, torch.device("cpu"), 2.0)
        found = cache_b.collect(cache_b.lookup([key], [(16, 8)], torch.float32))
        assert found.levels == ["l3"] and torch.equal(found.pieces[0], emb), "the object as put is taken"
        obj = bytearray(a.get_raw(key))
        obj[-1] ^= 0x40
        other_shape = store.pack(key, emb.reshape(8, 16))  # whole and signed, but not the image's shape
        for i, changed in enumerate((bytes(obj), bytes(obj[:-4]), other_shape)):
            assert a.put_raw(key, changed, replace=True) == 0
            found = cache_b.collect(cache_b.lookup([key], [(16, 8)], torch.float32))
            assert found.pieces == [None] and found.levels == [None]
            assert cache_b.counters.integrity_failures == i + 1 and cache_b.counters.fallbacks == i + 1
        cache_a.close()
        cache_b.close()


# ---- 3. two encoders behind one master ----
def _png(tmp: Path, seed: int, size: int = 112) -> tuple[str, bytes]:
    raw = random_png(seed, size)
    path = tmp / f"gc-{uuid.uuid4().hex}.png"
    path.write_bytes(raw)
    return str(path), raw


@pytest.fixture(scope="module")
def images() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="epd-gc-") as tmp:  # under the encoders' media root
        yield Path(tmp)


@pytest.fixture(scope="module")
def vit() -> Iterator[object]:
    """The encoder's ViT in this process (one thread, the fast runtime): the embeddings to expect."""
    model = models.open_model(None)
    runtime = open_runtime("fast", model)

    def encode(path: str) -> torch.Tensor:
        with torch.inference_mode():
            return runtime.encode(*models.preprocess([Image.open(path).convert("RGB")]))

    encode.vision_config = model.config.vision_config.to_dict()
    yield encode


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two encoders, a prefill, a decode and the proxy, and the master the cluster starts; L1 and L2 off, so that
    every repeat goes to L3. The master is gone once the cluster is."""
    with Cluster(Topology(encoders=2, prefills=1, decodes=1, proxy=True, mm_global_cache=True, timeout=TIMEOUT,
                          settings={"encoder": {"cache_bytes": 0, "host_pool_bytes": 0}})) as c:
        master = c.store_master.proc
        yield c
    assert master.poll() is not None, "the cluster's mooncake_master outlived it"


def _receive(url: str, paths: list[str], rid: str | None = None) -> torch.Tensor:
    with EmbeddingReceiver(ReceiverConfig([url], "mooncake", TIMEOUT)) as receiver:
        return receiver.receive(paths, rid).embeddings["image"]


def test_an_image_encoded_by_one_encoder_is_served_by_another_from_l3(cluster, images, vit) -> None:
    a, b = cluster.encoder_urls
    path, _ = _png(images, 1)
    puts = metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total")
    hits = metric(metrics(b), "epd_lab:encoder_mm_cache_l3_hits_total")
    from_a = _receive(a, [path])
    wait_for(lambda: metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total") == puts + 1, 5, "A's L3 put")
    rid = uuid.uuid4().hex
    from_b = _receive(b, [path], rid)
    assert torch.equal(from_a, vit(path)) and torch.equal(from_b, from_a), "bit for bit the ViT's embedding"
    assert metric(metrics(b), "epd_lab:encoder_mm_cache_l3_hits_total") == hits + 1
    spans = cluster.spans(rid)
    stages = set(spans[spans["node"].str.startswith("encoder")]["stage"])
    assert "store_get" in stages and not stages & {"vit", "decode"}, stages
    got = spans[spans["stage"] == "store_get"]
    assert got["nbytes"].iloc[0] >= from_b.nbytes
    a_spans = cluster.spans()
    assert "store_put" in set(a_spans[a_spans["node"].str.startswith("encoder")]["stage"])


def test_answers_through_the_proxy_equal_the_model_s_with_the_cache_hit(cluster, images) -> None:
    """Two images a request (a part on each encoder), the same request three times: the second and third take
    both embeddings from L3 (the other encoder's, or its own), and every answer is the monolithic model's."""
    model = models.load_model()
    paths = [_png(images, 40 + i)[0] for i in range(2)]
    messages = [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": p}} for p in paths),
                                             {"type": "text", "text": "what differs?"}]}]
    want = monolithic_chat(model, messages, 8)
    def total(name: str) -> float:
        return sum(metric(metrics(url), f"epd_lab:encoder_mm_cache_l3_{name}_total") for url in cluster.encoder_urls)

    hits, puts = total("hits"), total("puts")
    client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    for i in range(3):
        got = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0)
        assert got.choices[0].message.content == want
        if i == 0:  # the puts run behind the answer
            wait_for(lambda: total("puts") == puts + 2, 5, "both embeddings put into L3")
    assert total("hits") == hits + 4


def test_a_changed_object_is_refused_and_the_vit_answers(cluster, images, vit) -> None:
    a, b = cluster.encoder_urls
    path, raw = _png(images, 2)
    puts = metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total")
    _receive(a, [path])
    wait_for(lambda: metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total") == puts + 1, 5, "A's L3 put")
    key = item_key(raw, "tiny-qwen2-vl", "float32", vit.vision_config)
    refused = metric(metrics(b), "epd_lab:encoder_mm_cache_l3_integrity_failures_total")
    with store.StoreClient(cluster.store_master.address, segment_bytes=store.MIN_SEGMENT_BYTES) as writer:
        obj = bytearray(writer.get_raw(key))
        assert obj, "the object A put is in the store under the key this test computes"
        obj[-1] ^= 1
        assert writer.put_raw(key, bytes(obj), replace=True) == 0
        rid = uuid.uuid4().hex
        assert torch.equal(_receive(b, [path], rid), vit(path))
    assert metric(metrics(b), "epd_lab:encoder_mm_cache_l3_integrity_failures_total") == refused + 1
    assert "vit" in set(cluster.spans(rid)["stage"])


def test_the_master_killed_under_load_every_request_is_answered_right(cluster, images, vit) -> None:
    """40 requests of one image each from a pool of 6 (half seen before), 2 at a time over both encoders; the
    master is SIGKILLed after 10 and started again after 30. Every answer equals the ViT's, none takes its
    deadline; once the master is back an image put by one encoder is found by the other again."""
    pool = [_png(images, 100 + i)[0] for i in range(6)]
    expected = {p: vit(p) for p in pool}
    master = cluster.store_master
    a, b = cluster.encoder_urls
    failed = ("epd_lab:encoder_mm_cache_l3_lookup_errors_total", "epd_lab:encoder_mm_cache_l3_fallbacks_total")
    texts = {url: metrics(url) for url in (a, b)}
    before = {url: (metric(text, "epd_lab:encoder_mm_cache_l3_hits_total"), sum(metric(text, m) for m in failed))
              for url, text in texts.items()}
    done = []

    def one(i: int) -> tuple[bool, float]:
        t0 = time.monotonic()
        path = pool[(i * 7) % len(pool)]
        with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls, "mooncake", TIMEOUT)) as receiver:
            got = receiver.receive([path]).embeddings["image"]
        done.append(i)
        return torch.equal(got, expected[path]), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(one, i) for i in range(40)]
        wait_for(lambda: len(done) >= 10, 60, "10 requests done")
        master.kill()
        wait_for(lambda: len(done) >= 30, 60, "30 requests done")
        master.restart()
        results = [f.result() for f in futures]
    right = [ok for ok, _ in results]
    assert sum(right) == len(results), f"{len(results) - sum(right)} answers differ from the ViT's"
    assert max(t for _, t in results) < TIMEOUT
    hits = sum(metric(metrics(url), "epd_lab:encoder_mm_cache_l3_hits_total") - before[url][0] for url in (a, b))
    misses = sum(sum(metric(metrics(url), m) for m in failed) - before[url][1] for url in (a, b))
    assert hits > 0 and misses > 0, "repeats came from L3 while the master ran, and fell back to the ViT without it"
    path = _png(images, 7)[0]
    puts = metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total")

    def put_again() -> bool:  # the encoder finds the restarted master by itself (its client reconnects)
        _receive(a, [_png(images, int(time.monotonic_ns() % 100000) + 1000)[0]])
        return metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total") > puts

    wait_for(put_again, 30, "encoder A putting into the restarted master", interval=0.5)
    _receive(a, [path])
    wait_for(lambda: metric(metrics(a), "epd_lab:encoder_mm_cache_l3_puts_total") > puts + 1, 5,
             "the put of the probe image")
    hits = metric(metrics(b), "epd_lab:encoder_mm_cache_l3_hits_total")
    assert torch.equal(_receive(b, [path]), vit(path))
    assert metric(metrics(b), "epd_lab:encoder_mm_cache_l3_hits_total") == hits + 1


def test_a_tp_encoder_s_other_ranks_run_only_the_misses() -> None:
    """An encoder of 2 ranks (L1 and L2 off): its first request of an image runs on both ranks (rank 1's ``vit``
    span); the same image again comes from L3 with no step sent to rank 1, bit-equal to the first answer."""
    with tempfile.TemporaryDirectory(prefix="epd-gc-") as tmp, \
            Cluster(Topology(encoders=1, mm_global_cache=True, timeout=TIMEOUT,
                             settings={"encoder": {"tp": 2, "cache_bytes": 0, "host_pool_bytes": 0}})) as c:
        (url,) = c.encoder_urls
        path, _ = _png(Path(tmp), 70)
        rids = [uuid.uuid4().hex, uuid.uuid4().hex]
        first = _receive(url, [path], rids[0])
        wait_for(lambda: metric(metrics(url), "epd_lab:encoder_mm_cache_l3_puts_total") == 1, 5, "the L3 put")
        again = _receive(url, [path], rids[1])
        assert torch.equal(first, again)
        on_rank1 = [set(c.spans(rid).query("node.str.endswith('/rank1')", engine="python")["stage"]) for rid in rids]
    assert on_rank1 == [{"vit"}, set()], on_rank1


# ---- 4. no master at start ----
def test_an_unreachable_master_at_start_warns_and_serves(images, vit) -> None:
    with Cluster(Topology(encoders=1, mm_global_cache=True, store_master=f"127.0.0.1:{free_port()}",
                          timeout=TIMEOUT)) as c:
        (url,) = c.encoder_urls
        assert metric(metrics(url), "epd_lab:encoder_mm_cache_l3_enabled") == 0
        path, _ = _png(images, 3)
        assert torch.equal(_receive(url, [path]), vit(path))
        log = c.logs[0].read_text()
    assert "warning: the global embedding cache's L3 is off" in log and "not reachable" in log
