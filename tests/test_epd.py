"""E→P end to end: real encoder processes on loopback started by `Cluster`, a real `EmbeddingReceiver` and
`EPDPrefill` in this process, the monolithic model as the reference. No mocks.

1. Correctness matrix (the E→P acceptance test): per backend × dtype one cluster of 3 encoders; receivers
   wired to the first 1, 2 and 3 of them; requests with 1–4 images of different sizes plus text. The prefill
   logits must equal (`torch.equal`) one monolithic forward in this process, and no registration may be left.
2. The persistent pool (`pool_bytes > 0`): same logits, slices go back to the pool and are reused.
   A receiver built directly checks its encoder URLs as the prefill's, and hears its encoders' answers as
   proof of life (as the proxy hears its backends').
3. Failures with short timeouts: an encoder SIGKILLed between /encode and /send, one SIGSTOPped before it
   notifies, undecodable and missing images. Each request fails with `EPDError` within the timeout, naming
   the encoder; nothing stays registered; the next request on a healthy encoder works. An encoder dead before
   or during /encode (the ZMQ backends' encoder killed with /encode in flight) is failed over instead: the
   request is served by the other encoder, bit-exact.
4. Parts whose notifications arrive out of part order still reassemble in part order.
5. `Cluster` hygiene: no process left after `close()` (also after one died, or failed to start).

Cost: every encoder process imports torch and loads the model (~4.5 CPU-s on the 2-core CI VM). The shared
clusters (one per backend × dtype, module scope) and the single-encoder clusters that kill tests own are all
started up front, a few at a time, in background threads (`_Launcher`): a kill test still gets a cluster of
its own that nothing else touches, it just does not wait for it to boot.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from PIL import Image

from epd_lab.ep.messages import EncodeRequest, part_req_id
from epd_lab.ep.prefill import EPDPrefill, reference_prefill
from epd_lab.ep.receiver import EmbeddingReceiver, EPDError, ReceiverConfig
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, load_model, preprocess
from epd_lab.noise import noise_images
from epd_lab.serving import PROBE_TIMEOUT, STALL_MISSES, STALL_SILENCE
from helpers import alive, freeze, plain_metrics, wait_for

# the first test of a cluster waits for it to boot (tens of s on 2 cores); bit-identity across processes needs
# equal thread counts: the encoders run configure_torch() too
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

BACKENDS = ("mooncake", "zmq_to_tokenizer", "zmq_to_scheduler")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SIZES = [(224, 224), (100, 333), (500, 260), (56, 112)]  # PIL (width, height): 64, 48, 162 and 8 tokens
BOOT_TIMEOUT = 10.0  # Topology.timeout of every cluster: the boot bound is 6x this (encoders boot concurrently)
OK_TIMEOUT = 30.0  # receiver timeout of requests that must succeed (generous: the machine is shared)
FAIL_TIMEOUT = 2.5  # receiver timeout of requests that must fail
SLACK = 5.0  # on top of FAIL_TIMEOUT: bounded-time checks only, never "fast enough" checks


# ---------------------------------------------------------------------------------------------------------
# processes
def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...); None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _encoder_alive(pid: int) -> bool:
    """The encoder `pid` still exists (as a process or a zombie); a reused pid running something else is not it."""
    return _proc_stat(pid) is not None and "epd_lab.servers.encoder" in _cmdline(pid)


def _group_members(pgid: int) -> list[int]:
    out = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and int(stat[2]) == pgid:
            out.append(pid)
    return out


def assert_closed_cleanly(cluster: Cluster, pids: list[int]) -> None:
    """`close()` leaves no encoder and nothing in their process groups (each runs in its own session), and a
    second `close()` is harmless."""
    cluster.close()
    assert cluster.procs == []
    for pid in pids:
        assert not _encoder_alive(pid), f"encoder {pid} survived close(): {_proc_stat(pid)}"
        assert _group_members(pid) == [], f"processes of encoder {pid}'s group survived close()"
    cluster.close()  # idempotent
    assert cluster.procs == []


class _Launcher:
    """Boots clusters in background threads, at most `workers` at a time, in the order asked."""

    def __init__(self, workers: int = 3) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="boot")
        self._shared: dict[tuple[str, str], concurrent.futures.Future[Cluster]] = {}
        self._spares: dict[str, list[concurrent.futures.Future[Cluster]]] = {}
        self._all: list[concurrent.futures.Future[Cluster]] = []
        self._lock = threading.Lock()

    def _boot(self, encoders: int, backend: str, dtype: str) -> concurrent.futures.Future[Cluster]:
        fut = self._pool.submit(Cluster, Topology(encoders, backend, dtype=dtype, timeout=BOOT_TIMEOUT))
        self._all.append(fut)
        return fut

    def prefetch_shared(self, backend: str, dtype: str) -> None:
        with self._lock:
            if (backend, dtype) not in self._shared:
                self._shared[backend, dtype] = self._boot(3, backend, dtype)

    def prefetch_spare(self, backend: str) -> None:
        with self._lock:
            self._spares.setdefault(backend, []).append(self._boot(1, backend, "float32"))

    def shared(self, backend: str, dtype: str) -> Cluster:
        self.prefetch_shared(backend, dtype)
        return self._shared[backend, dtype].result()

    def take_spare(self, backend: str) -> Cluster:
        """A single-encoder float32 cluster that only the caller will ever use (and must close)."""
        with self._lock:
            queue = self._spares.get(backend)
            fut = queue.pop(0) if queue else self._boot(1, backend, "float32")
        return fut.result()

    def close(self) -> list[tuple[Cluster, list[int]]]:
        """Close every cluster that booted; returns them with their pids, for the hygiene check."""
        self._pool.shutdown(wait=True)
        closed = []
        for fut in self._all:
            if fut.exception() is None:
                cluster = fut.result()
                pids = [p.pid for p in cluster.procs]
                cluster.close()
                closed.append((cluster, pids))
        return closed


@pytest.fixture(scope="module")
def launcher(request):
    """Shared clusters (3 encoders per backend × dtype) and spare single-encoder clusters for the kill tests,
    booted for exactly the tests that were selected."""
    launcher = _Launcher()
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    for item in items:  # shared clusters first: the first tests need them
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        if "launcher" in item.fixturenames and "backend" in params and "own_cluster" not in item.fixturenames:
            launcher.prefetch_shared(params["backend"], params.get("dtype", "float32"))
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        if "own_cluster" in item.fixturenames:
            launcher.prefetch_shared(params["backend"], "float32")  # the healthy peer
            launcher.prefetch_spare(params["backend"])
    yield launcher
    for cluster, pids in launcher.close():
        assert_closed_cleanly(cluster, pids)


@pytest.fixture
def own_cluster(launcher):
    """`take(backend)`: a single-encoder cluster of this test's own (its encoder may be killed); closed after."""
    taken: list[Cluster] = []

    def take(backend: str) -> Cluster:
        taken.append(launcher.take_spare(backend))
        return taken[-1]

    yield take
    for cluster in taken:
        for p in cluster.procs:  # a frozen encoder would ignore close()'s SIGTERM for 5 s
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        cluster.close()


# ---------------------------------------------------------------------------------------------------------
# model, images, references
class Workload:
    """The model per dtype in this process, noise PNGs in a temp dir, and cached monolithic references."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._models: dict[str, torch.nn.Module] = {}
        self._refs: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def model(self, dtype: str) -> torch.nn.Module:
        with self._lock:
            if dtype not in self._models:
                self._models[dtype] = load_model(dtype=DTYPES[dtype])
            return self._models[dtype]

    def images(self, tag: str, sizes: list[tuple[int, int]]) -> list[str]:
        """PNG files of random noise, their content a function of (`tag`, index, size): distinct per tag."""
        paths = []
        for i, (w, h) in enumerate(sizes):
            path = self.dir / f"{tag}-{i}-{w}x{h}.png"
            if not path.exists():
                noise_images([(w, h)], zlib.crc32(f"{tag}/{i}/{w}x{h}".encode()))[0].save(path)
            paths.append(str(path))
        return paths

    def reference(self, dtype: str, text: str, paths: list[str]) -> tuple[torch.Tensor, list[list[int]]]:
        """Logits of the monolithic use (the same runtime encodes and prefills in one process) on the same images
        and text, and the grids."""
        key = (dtype, text, tuple(paths))
        if key not in self._refs:
            images = [Image.open(p).convert("RGB") for p in paths]
            logits = reference_prefill(self.model(dtype), text, images)
            self._refs[key] = (logits, preprocess(images)[1].tolist())
        return self._refs[key]

    def check(self, rx: EmbeddingReceiver, dtype: str, text: str, paths: list[str]):
        """Prefill over E→P and compare with the monolithic model bit for bit; no registration may be left."""
        result = EPDPrefill(rx, self.model(dtype)).prefill(text, paths)
        want, grids = self.reference(dtype, text, paths)
        assert result.received.grid_thw["image"] == grids
        got = result.prefill.logits
        assert got.dtype == want.dtype == DTYPES[dtype]
        assert torch.equal(got, want), (f"{rx.config.backend}/{dtype}, {len(paths)} images on "
                                        f"{len(rx.config.encoder_urls)} encoders: max |diff| "
                                        f"{(got.float() - want.float()).abs().max().item()}")
        assert rx.engine.stats()["regions"] == 0
        return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Workload:
    return Workload(tmp_path_factory.mktemp("epd-images"))


def cache_hits(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in plain_metrics(httpx.get(url + "/metrics", timeout=10).text).splitlines():
            if line.startswith("epd_lab:encoder_cache_hits_total "):
                total += float(line.split()[1])
    return total


def seed_routing(requests: int, n_encoders: int, last_first: int) -> int:
    """A receiver seed under which the `requests`-th request's shuffle puts encoder `last_first` first (the
    receiver shuffles `range(n_encoders)` once per request, `assign_items_by_modality`), so a one-image
    request then goes to that encoder."""
    for seed in range(1000):
        rng = random.Random(seed)
        for _ in range(requests):
            order = list(range(n_encoders))
            rng.shuffle(order)
        if order[0] == last_first:
            return seed
    raise AssertionError("no seed found")


# ---------------------------------------------------------------------------------------------------------
# 1. correctness matrix
@pytest.mark.parametrize("k", [1, 2, 3], ids=lambda k: f"{k}enc")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_are_bit_identical_to_monolithic(launcher, work, backend, dtype, k):
    """Receivers wired to the first k of 3 encoders; 1, 2, 3, 4 images of different sizes plus text. Images
    are distinct per request (the encoders' caches must not serve them), shared across backends and dtypes
    (other processes). With one encoder, the 4-image request is repeated: served from the cache, same bits."""
    cluster = launcher.shared(backend, dtype)
    urls = cluster.encoder_urls[:k]
    with EmbeddingReceiver(ReceiverConfig(urls, backend, timeout=OK_TIMEOUT, seed=k)) as rx:
        for n in range(1, 5):
            paths = work.images(f"matrix-k{k}-n{n}", SIZES[:n])
            text = f"Describe these {n} pictures, {k} encoder(s)."
            result = work.check(rx, dtype, text, paths)
            assert len(result.received.parts) == min(n, k)
            encoders = [p.encoder for p in result.received.parts]
            assert len(set(encoders)) == len(encoders) and set(encoders) <= set(range(k))
        if k == 1:
            before = cache_hits(urls)
            work.check(rx, dtype, text, paths)
            assert cache_hits(urls) - before == 4
        assert rx.counters["invalid_messages"] == 0


# ---------------------------------------------------------------------------------------------------------
# 2. the persistent pool
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["mooncake"])
def test_pool_gives_the_same_logits_and_slices_return(launcher, work, backend, dtype):
    cluster = launcher.shared(backend, dtype)
    pool_bytes = 4 << 20
    config = ReceiverConfig(cluster.encoder_urls, backend, timeout=OK_TIMEOUT, pool_bytes=pool_bytes, seed=0)
    with EmbeddingReceiver(config) as rx:
        addresses: list[list[int]] = []
        send = rx._send

        def spy(rid, plan, address, *rest):  # records where each part is written, then sends as usual
            addresses[-1].append(address)
            return send(rid, plan, address, *rest)

        rx._send = spy
        for i, sizes in enumerate([SIZES, SIZES[1:3]]):
            addresses.append([])
            work.check(rx, dtype, f"pool request {i}", work.images(f"pool-{dtype}-{i}", sizes))
            assert rx._pool.free == [(0, pool_bytes)], "the request's slice did not return to the pool"
            assert rx.engine.stats()["managed_buffers"] == 1  # the pool stays; nothing else was allocated
        # first fit over a pool that was whole again: the second request reuses the first one's memory
        assert min(addresses[0]) == min(addresses[1]) == rx._pool.base
    # a request larger than the pool fails cleanly and leaves the pool whole
    with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls[:1], backend, timeout=OK_TIMEOUT,
                                          pool_bytes=4096)) as rx:
        with pytest.raises(EPDError, match="pool exhausted"):
            rx.receive(work.images(f"pool-{dtype}-small", SIZES[:1]))
        assert rx._pool.free == [(0, 4096)]
        assert rx.engine.stats()["regions"] == 0


# ---------------------------------------------------------------------------------------------------------
# 2b. the encoders as a receiver built directly sees them: their URLs checked, their answers heard
@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_receivers_encoder_urls_are_checked_as_the_prefills(launcher, work, backend):
    """A `ReceiverConfig` built directly (not through `PrefillSettings`) checks its encoder URLs as every backend
    URL (`check_urls`): one without http(s):// is refused; a trailing slash is dropped, so the routes appended to
    the URL reach the encoder (``//encode`` does not)."""
    url = launcher.shared(backend, "float32").encoder_urls[0]
    with pytest.raises(ValueError, match="encoder URL '127.0.0.1:1' must start with http:// or https://"):
        ReceiverConfig([url, "127.0.0.1:1"], backend)
    with EmbeddingReceiver(ReceiverConfig([url + "/"], backend, timeout=OK_TIMEOUT)) as rx:
        assert rx.config.encoder_urls == (url,)
        work.check(rx, "float32", "one slash too many", work.images("url-slash", SIZES[:1]))


@pytest.mark.parametrize("backend", ["mooncake"])
def test_an_encoders_answers_are_heard_as_proof_of_life(launcher, work, backend):
    """An encoder's answers (its /encode's, its /send's) tell its circuit it is alive, as the proxy's backends'
    answers do: probes it then misses stall it only once nothing was heard from it for `STALL_SILENCE` (busy is not
    frozen). The receiver's one probe thread is held while the request runs, so that no probe answers meanwhile."""
    url = launcher.shared(backend, "float32").encoder_urls[0]
    with EmbeddingReceiver(ReceiverConfig([url], backend, timeout=OK_TIMEOUT)) as rx:
        holding, release = threading.Event(), threading.Event()
        rx._probes.submit(lambda: (holding.set(), release.wait(OK_TIMEOUT)))
        try:
            assert holding.wait(10), "the probe thread was never free"
            start = time.monotonic()
            work.check(rx, "float32", "heard while probes wait", work.images("heard", SIZES[:1]))
            liveness = rx._encoders.liveness[0]
            assert liveness.heard_at > start, "the encoder's answers were not heard"
            # STALL_SILENCE after the request began, two probes missed: it answered since, so it is not stalled
            assert not any([liveness.probed(False, now=start + STALL_SILENCE) for _ in range(STALL_MISSES)])
            assert not liveness.stalled
        finally:
            release.set()


# ---------------------------------------------------------------------------------------------------------
# 3. failures
def _two_encoder_receiver(victim: Cluster, healthy_url: str, backend: str) -> EmbeddingReceiver:
    """Wired to [victim, healthy]: the failing 2-image request puts one part on each; the seed sends the
    following 1-image request to the healthy encoder."""
    config = ReceiverConfig([victim.encoder_urls[0], healthy_url], backend, timeout=FAIL_TIMEOUT,
                            seed=seed_routing(2, 2, last_first=1))
    return EmbeddingReceiver(config)


def _fails_within_timeout(rx: EmbeddingReceiver, work: Workload, tag: str, match: str) -> EPDError:
    paths = work.images(tag, SIZES[:2])
    t0 = time.monotonic()
    with pytest.raises(EPDError, match=match) as info:
        EPDPrefill(rx, work.model("float32")).prefill("this request fails", paths)
    elapsed = time.monotonic() - t0
    assert elapsed < FAIL_TIMEOUT + SLACK, f"the failure took {elapsed:.1f} s"
    assert rx.engine.stats()["regions"] == 0, "the request's buffer is still registered"
    assert rx._pending == {}
    return info.value


def _next_request_works(rx: EmbeddingReceiver, work: Workload, tag: str) -> None:
    result = work.check(rx, "float32", "and this one works", work.images(tag, SIZES[2:3]))
    assert [p.encoder for p in result.received.parts] == [1]  # the healthy encoder


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_encoder_is_failed_over(launcher, own_cluster, work, backend):
    """An encoder killed outright refuses connections: the part planned on it goes to the other encoder, it is left
    out of the next plans, and every request is served, bit-exact (before, about half of them failed with 502
    for the whole outage)."""
    victim = own_cluster(backend)
    proc = victim.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    healthy = launcher.shared(backend, "float32").encoder_urls[0]

    def served_by(rx: EmbeddingReceiver, tag: str) -> list[int]:  # two images: while both are up, a part on each
        result = work.check(rx, "float32", tag, work.images(f"failover-{backend}-{tag}", SIZES[:2]))
        return [p.encoder for p in result.received.parts]

    urls = [victim.encoder_urls[0], healthy]
    with EmbeddingReceiver(ReceiverConfig(urls, backend, timeout=FAIL_TIMEOUT, seed=0, retry_after=60)) as rx:
        assert served_by(rx, "first") == [1, 1]  # its part planned on the dead encoder went to the other
        assert served_by(rx, "second") == served_by(rx, "third") == [1]  # planned over the live encoder alone
        assert rx.counters["encoder_failovers"] == 1
    with EmbeddingReceiver(ReceiverConfig(urls, backend, timeout=FAIL_TIMEOUT, seed=0, retry_after=0)) as rx:
        # once its retry_after has passed it is planned again, refuses again, and is failed over again
        assert served_by(rx, "again") == served_by(rx, "and again") == [1, 1]
        assert rx.counters["encoder_failovers"] == 2


@pytest.mark.parametrize("backend", ["mooncake"])
def test_encoder_killed_between_encode_and_send(launcher, own_cluster, work, backend):
    """A real SIGKILL of the victim encoder's process at the right moment: the receiver's `_send` (the POST
    /send of one part) is wrapped on this instance so that, for the victim's part, it first kills the victim
    and reaps it, then does the real POST, which finds nobody."""
    victim = own_cluster(backend)
    proc = victim.procs[0]
    pid = proc.pid
    with _two_encoder_receiver(victim, launcher.shared(backend, "float32").encoder_urls[0], backend) as rx:
        send = rx._send

        def send_after_killing(rid, plan, *rest):
            if rx._url(plan) == victim.encoder_urls[0]:
                assert proc.poll() is None, "the victim died before /send"
                os.kill(pid, signal.SIGKILL)
                proc.wait(10)
            return send(rid, plan, *rest)

        rx._send = send_after_killing
        err = _fails_within_timeout(rx, work, "killed-before-send", match="/send to")
        assert victim.encoder_urls[0] in str(err)
        assert proc.returncode == -signal.SIGKILL
        _next_request_works(rx, work, "killed-before-send-next")
    assert_closed_cleanly(victim, [pid])  # a cluster whose encoder died closes cleanly


@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_frozen_encoder_is_passed_over_within_seconds(launcher, own_cluster, work, backend):
    """An encoder frozen (SIGSTOP) still accepts connections, so only its silence tells: its /health probes go
    unanswered, the receiver finds it stalled, cuts the /encode waiting on it and gives that part to the other
    encoder. The request is served, bit-exact, long before its timeout (before, it failed at the timeout), and
    the frozen one is left out of the next plans until it answers again."""
    victim = own_cluster(backend)
    pid = victim.procs[0].pid
    healthy = launcher.shared(backend, "float32").encoder_urls[0]
    timeout = 20.0
    with EmbeddingReceiver(ReceiverConfig([victim.encoder_urls[0], healthy], backend, timeout=timeout,
                                          seed=0)) as rx:
        freeze(pid)
        try:
            t0 = time.monotonic()
            result = work.check(rx, "float32", "one frozen", work.images("frozen-failover", SIZES[:2]))
            elapsed = time.monotonic() - t0
            assert [p.encoder for p in result.received.parts] == [1, 1]
            assert elapsed < 2 * STALL_MISSES * PROBE_TIMEOUT + SLACK < timeout, elapsed
            assert rx.counters["encoder_stalls"] == 1 and rx.counters["encoder_failovers"] == 1
            result = work.check(rx, "float32", "planned without it", work.images("frozen-after", SIZES[:2]))
            assert [p.encoder for p in result.received.parts] == [1]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: rx._up_encoders() == [0, 1], 10, "the thawed encoder taken back (answered again: planned "
                 "again)", interval=0.1)


@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_busy_encoder_passes_the_part_on_and_a_failed_request_releases_its_parts(launcher, own_cluster, work,
                                                                                  backend, tmp_path):
    """An encoder at capacity (--max-parts 1, its one part held by another /encode) answers 503 at once: the part
    planned on it goes to the other encoder and the request is served. A request whose other part fails (an image
    that does not decode) releases the part the healthy encoder holds for it (/release) at once, not at its TTL."""
    healthy = launcher.shared(backend, "float32").encoder_urls[0]
    with Cluster(Topology(encoders=1, prefills=0, decodes=0, backend=backend, timeout=FAIL_TIMEOUT,
                          settings={"encoder": {"max_parts": 1}}), log_dir=str(tmp_path)) as tight:
        busy = tight.encoder_urls[0]
        held = EncodeRequest(work.images("busy-holder", SIZES[:1]), 1, 0, "holder_local_part_0", "IMAGE",
                             "127.0.0.1", 1)
        assert httpx.post(busy + "/encode", content=msgspec.json.encode(held), timeout=10).status_code == 200
        refused = httpx.post(busy + "/encode", content=msgspec.json.encode(held), timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        with EmbeddingReceiver(ReceiverConfig([busy, healthy], backend, timeout=FAIL_TIMEOUT, seed=0)) as rx:
            result = work.check(rx, "float32", "one busy", work.images("busy-failover", SIZES[:2]))
            assert [p.encoder for p in result.received.parts] == [1, 1]
            assert rx.counters["encoder_failovers"] == 1
        assert 'epd_lab:encoder_refused_total{reason="queue_full"} 2' in plain_metrics(httpx.get(busy + "/metrics", timeout=10).text)
        answer = httpx.post(busy + "/release", json={"req_id": held.req_id}, timeout=10).json()
        assert answer == {"req_id": held.req_id, "released": True}
        assert httpx.get(busy + "/health", timeout=10).json()["admitted"] == 0
        # a /release that overtakes its part's /encode (a cut link, a freeze): that /encode then holds nothing
        late = msgspec.structs.replace(held, req_id="late_local_part_0")
        assert httpx.post(busy + "/release", json={"req_id": late.req_id}, timeout=10).json()["released"] is False
        refused = httpx.post(busy + "/encode", content=msgspec.json.encode(late), timeout=10)
        assert refused.status_code == 409 and "released before" in refused.text, refused.text
        assert httpx.get(busy + "/health", timeout=10).json()["embeddings_held"] == 0

        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not an image")  # refused by its /encode, while the other part's /encode is held
        before = _held_and_released([busy, healthy])
        with EmbeddingReceiver(ReceiverConfig([busy, healthy], backend, timeout=FAIL_TIMEOUT, seed=0)) as rx:
            paths = [str(bad), *work.images("release-me", SIZES[1:2])]
            with pytest.raises(EPDError):
                EPDPrefill(rx, work.model("float32")).prefill("fails on one part", paths)
            wait_for(lambda: rx.counters["parts_released"] >= 1, SLACK,
                     lambda: f"the healthy encoder's part released: {rx.counters}")
        held_now, released_now = _held_and_released([busy, healthy])
        assert held_now == before[0] and released_now == before[1] + 1


def _held_and_released(urls: list[str]) -> tuple[int, int]:
    """Embeddings held for /send, and released by /release, on these encoders."""
    held = released = 0
    for url in urls:
        held += httpx.get(url + "/health", timeout=10).json()["embeddings_held"]
        metrics = plain_metrics(httpx.get(url + "/metrics", timeout=10).text)
        released += int(float(re.search(r"^epd_lab:encoder_embeddings_released_total (\S+)$", metrics, re.M).group(1)))
    return held, released


@pytest.mark.parametrize("backend", ["mooncake"])
def test_encoder_frozen_before_it_notifies(launcher, own_cluster, work, backend):
    """The victim is SIGSTOPped (and seen stopped in /proc) just before its /send: it never writes nor
    notifies, the request fails on the timeout, or sooner where the receiver's probes (each encoder's on its own
    thread) find the victim stalled first. Once it resumes, its late write finds the buffer deregistered and is
    refused by the receiver's engine; the encoder keeps serving."""
    victim = own_cluster(backend)
    pid = victim.procs[0].pid
    with _two_encoder_receiver(victim, launcher.shared(backend, "float32").encoder_urls[0], backend) as rx:
        send = rx._send

        def send_frozen(rid, plan, address, *rest):
            if rx._url(plan) == victim.encoder_urls[0]:
                freeze(pid)
            return send(rid, plan, address, *rest)

        rx._send = send_frozen
        try:
            err = _fails_within_timeout(rx, work, "frozen-before-notify",
                                        match="no notification from encoder|stopped making progress")
            assert victim.encoder_urls[0] in str(err)
            _next_request_works(rx, work, "frozen-before-notify-next")
            refused = rx.engine.stats()["writes_refused"]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: rx.engine.stats()["writes_refused"] != refused, 15,
                 "the resumed encoder's late write refused")
        assert rx.engine.stats()["regions"] == 0
        assert httpx.get(victim.encoder_urls[0] + "/health", timeout=10).status_code == 200
    assert_closed_cleanly(victim, [pid])


@pytest.mark.parametrize("backend", ["mooncake"])
def test_late_write_of_a_resumed_encoder_does_not_corrupt_a_later_request(launcher, own_cluster, work, backend):
    """Request A's victim is frozen during its /send; A fails on the timeout and its pool slice goes back to
    the pool. Request B (healthy encoder) gets the same memory (first fit). The victim is resumed once B's
    part has landed and before B reassembles: its late /send for A must not change B's embeddings."""
    victim = own_cluster(backend)
    pid = victim.procs[0].pid
    healthy = launcher.shared(backend, "float32").encoder_urls[0]
    config = ReceiverConfig([victim.encoder_urls[0], healthy], backend, timeout=FAIL_TIMEOUT,
                            pool_bytes=4 << 20, seed=seed_routing(2, 2, last_first=1))
    with EmbeddingReceiver(config) as rx:
        send, wait = rx._send, rx._wait
        a_ranges: list[tuple[int, int]] = []

        def send_frozen(rid, plan, address, answer, *rest):  # A's part on the victim: freeze it first
            if rx._url(plan) == victim.encoder_urls[0]:
                a_ranges.append((address, answer.embedding_size))
                freeze(pid)
            return send(rid, plan, address, answer, *rest)

        def wait_then_resume(rid, plans, futures, deadline):  # B's bytes are in; let the victim go
            out = wait(rid, plans, futures, deadline)
            if rid.startswith("B"):
                strays = rx.counters["stray_messages"]
                os.kill(pid, signal.SIGCONT)
                t_end = time.monotonic() + 15  # the victim always notifies once its /send is done
                while rx.counters["stray_messages"] == strays and time.monotonic() < t_end:
                    time.sleep(0.01)
            return out

        rx._send = send_frozen
        try:
            with pytest.raises(EPDError):
                rx.receive(work.images("late-write-A", [(224, 224), (224, 224)]), rid="A")
        finally:
            rx._send = send
        rx._wait = wait_then_resume
        paths = work.images("late-write-B", [(448, 448)])  # 256 KiB: covers A's 2 x 64 KiB
        result = EPDPrefill(rx, work.model("float32")).prefill("after the frozen one", paths, rid="B")
        (a_address, a_size), = a_ranges
        assert rx._pool.base <= a_address and a_address + a_size <= rx._pool.base + result.received.nbytes
        want, _ = work.reference("float32", "after the frozen one", paths)
        assert torch.equal(result.prefill.logits, want), "a late write of request A landed in request B"


@pytest.mark.parametrize("backend", ["zmq_to_tokenizer", "zmq_to_scheduler"])
def test_zmq_encoder_killed_mid_request_is_failed_over(launcher, own_cluster, work, backend):
    """The victim dies with its /encode in flight: the receiver's `_encode` is wrapped so that, for the
    victim's part, it stops the victim (SIGSTOP, seen in /proc), sends the real POST /encode (it waits in the
    victim's socket), and a timer SIGKILLs the victim 0.3 s later. The exchange gets no answer, and not for
    want of time (the connection is reset, or refused on the client's resend), so the part goes to the
    healthy encoder: the request is served, bit-exact, within its timeout. (Before failover it failed.)"""
    victim = own_cluster(backend)
    proc = victim.procs[0]
    pid = proc.pid
    with _two_encoder_receiver(victim, launcher.shared(backend, "float32").encoder_urls[0], backend) as rx:
        encode = rx._encode
        timers = []

        def encode_while_dying(rid, num_parts, plan):
            if rx._url(plan) == victim.encoder_urls[0] and not timers:
                freeze(pid)
                timers.append(threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)))
                timers[-1].start()
            return encode(rid, num_parts, plan)

        rx._encode = encode_while_dying
        t0 = time.monotonic()
        result = work.check(rx, "float32", "this one is failed over", work.images(f"{backend}-killed", SIZES[:2]))
        assert time.monotonic() - t0 < FAIL_TIMEOUT + SLACK
        assert [p.encoder for p in result.received.parts] == [1, 1] and rx.counters["encoder_failovers"] == 1
        assert proc.wait(10) == -signal.SIGKILL
        _next_request_works(rx, work, f"{backend}-killed-next")
    assert_closed_cleanly(victim, [pid])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_media_is_a_4xx_error(launcher, work, backend, tmp_path):
    """An undecodable image, a truncated PNG and a missing file: the encoder's 400 message reaches the
    request as an `EPDError`; the healthy encoders go on serving the same receiver."""
    cluster = launcher.shared(backend, "float32")
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(os.urandom(5000))
    good = Path(work.images(f"bad-media-{backend}", [(224, 224)])[0])
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:2000])
    missing = tmp_path / "no-such-file.png"
    with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls, backend, timeout=FAIL_TIMEOUT)) as rx:
        for bad, why in [(garbage, "is not an image"), (truncated, "does not decode"),
                         (missing, "No such file")]:
            items = work.images(f"bad-media-{backend}-{bad.name}", SIZES[:3])
            items.insert(1, str(bad))  # part 0 holds items 0 and 1 (4 items on 3 encoders)
            # /encode reads headers only: mooncake answers it at once, and the truncated data is found when
            # the worker decodes, so /send answers the 400 (the zmq backends answer /encode after the ViT)
            route = "/send" if backend == "mooncake" and bad is truncated else "/encode"
            t0 = time.monotonic()
            with pytest.raises(EPDError, match=f"{route} to .* answered 400") as info:
                rx.receive(items)
            assert time.monotonic() - t0 < FAIL_TIMEOUT + SLACK
            msg = str(info.value)
            assert "mm_items[1]" in msg and why in msg and str(bad) in msg
            assert any(url in msg for url in cluster.encoder_urls)
            assert rx.engine.stats()["regions"] == 0
        work.check(rx, "float32", "after the bad ones", work.images(f"bad-media-{backend}-next", SIZES))


# ---------------------------------------------------------------------------------------------------------
# 4. out-of-order notifications
@pytest.mark.parametrize("backend", BACKENDS)
def test_parts_reassemble_in_order_when_notifications_arrive_out_of_order(launcher, work, backend):
    """4 images on 3 encoders: part 0 holds images 0 and 1, made the heaviest by far (~1000 tokens against
    8 and 4), so its ViT runs ~0.3 s longer and its message arrives last: the receipt times (the `notify`
    span for mooncake, `transfer` for the ZMQ backends, closed by the receiver on arrival) are not in part
    order, yet the logits are the monolithic ones."""
    cluster = launcher.shared(backend, "float32")
    stage = "notify" if backend == "mooncake" else "transfer"
    with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls, backend, timeout=OK_TIMEOUT)) as rx:
        paths = work.images("out-of-order", [(700, 700), (400, 400), (56, 112), (56, 56)])
        result = work.check(rx, "float32", "heavy first", paths)
        assert [len(p.items) for p in result.received.parts] == [2, 1, 1]
        arrived = {s.part: s.t_end_ns for s in result.spans
                   if s.stage == stage and s.req_id == part_req_id(result.rid, s.part)}
        assert sorted(arrived) == [0, 1, 2]
        ends = [arrived[p] for p in range(3)]
        assert ends != sorted(ends), f"parts arrived in part order: {ends}"
        assert ends[0] == max(ends)


# ---------------------------------------------------------------------------------------------------------
# 4b. the landing: what a prefill queues its forward on before the embeddings land
@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_landing_fires_once_in_the_notify_thread_after_every_part_landed(launcher, work, backend):
    """3 images on 2 encoders: `on_sizes` gets a `Landing` whose embeddings are ONE view of the request's
    buffer. Its callback runs once, in the thread that took the last notify, with the buffer already
    deregistered and every part's bytes in place (a snapshot taken there equals the logits-checked result,
    which is that same view); a watched landing records no reassemble span. When a part's /send fails, the
    callback still runs, once."""
    cluster = launcher.shared(backend, "float32")
    with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls[:2], backend, timeout=OK_TIMEOUT)) as rx:
        seen: list[tuple[str, int, torch.Tensor]] = []
        landings = []

        def on_sizes(grids, landing):
            landings.append(landing)
            view = landing.embeddings["image"]
            landing.when_landed(lambda: seen.append((threading.current_thread().name, rx.engine.stats()["regions"],
                                                     view.clone())))

        paths = work.images("landing", SIZES[:3])
        got = rx.receive(paths, rid="landing", on_sizes=on_sizes)
        assert len(got.parts) == 2 and len(landings) == 1 and len(seen) == 1
        thread, regions, snapshot = seen[0]
        assert thread == "epd-receiver-zmq" and regions == 0
        joined = landings[0].embeddings["image"]
        assert got.embeddings["image"] is joined
        assert torch.equal(snapshot, joined)
        ref = EPDPrefill(rx, work.model("float32")).prefill("landed", paths)  # the same images, reassembled
        assert torch.equal(joined, ref.received.embeddings["image"])
        assert {s.stage for s in rx.recorder.spans("landing")}.isdisjoint({"reassemble"})
        assert "reassemble" in {s.stage for s in ref.spans}

        send = rx._send

        def send_refused(rid, plan, *rest):
            if plan.part_idx == 1:
                raise EPDError("refused for the test", status=400)
            return send(rid, plan, *rest)

        rx._send = send_refused
        seen.clear()
        with pytest.raises(EPDError, match="refused for the test"):
            rx.receive(work.images("landing-failed", SIZES[:3]), on_sizes=on_sizes)
        assert len(seen) == 1 and seen[0][1] == 0
        assert rx.engine.stats()["regions"] == 0


# ---------------------------------------------------------------------------------------------------------
# 5. cluster hygiene
def test_cluster_whose_encoder_fails_to_start_raises_with_its_log(tmp_path):
    """`--model` pointing nowhere: the first encoder exits while starting; the cluster raises with its log
    tail, starts no further encoder, and leaves no process."""
    marker = f"/nonexistent/epd-test-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="encoder0 exited with") as info:
        Cluster(Topology(encoders=2, model=marker, timeout=BOOT_TIMEOUT), log_dir=str(tmp_path))
    assert time.monotonic() - t0 < 6 * BOOT_TIMEOUT
    msg = str(info.value)
    log = (tmp_path / "encoder0.log").read_text(errors="replace").splitlines()
    assert log and log[-1] in msg  # the log tail is in the message
    assert not (tmp_path / "encoder1.log").exists()  # nothing more was started
    leftovers = [pid for pid in _all_pids() if marker in _cmdline(pid)]
    assert leftovers == [], f"processes left behind: {leftovers}"
    assert marker in msg  # the error that names the model path, though the log ends with the server's traceback


DRIVER = """
import json, time
from epd_lab.launch import Cluster, Topology
cluster = Cluster(Topology(encoders=1, timeout=30))
print(json.dumps([p.pid for p in cluster.procs]), flush=True)
time.sleep(600)
"""


def test_encoders_die_with_a_killed_driver():
    """A notebook kernel or benchmark killed with SIGKILL runs no cleanup: its encoders still go."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        assert pids and all(os.path.exists(f"/proc/{p}") for p in pids)
        driver.kill()
        driver.wait()
        wait_for(lambda: not any(alive(p) for p in pids), 10, f"encoders {pids} gone with their killed driver")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        driver.stdout.close()


def test_mooncake_backend_over_the_real_mooncake_engine(tmp_path):
    """SGLang's `mooncake` backend with the real Mooncake transfer engine on both sides (the seed's
    setup): same logits as the monolithic model. Mooncake checks bounds only (no registration keys)."""
    from epd_lab.transfer import mooncake

    if mooncake.unavailable_reason():
        pytest.skip(mooncake.unavailable_reason())
    configure_torch()
    model = load_model()
    paths = [str(tmp_path / f"m{i}.png") for i in range(2)]
    for path, image in zip(paths, noise_images([(224, 224), (100, 333)], 5)):
        image.save(path)
    with Cluster(Topology(encoders=1, backend="mooncake", transport="mooncake", timeout=10)) as cluster, \
            cluster.receiver() as rx:
        result = EPDPrefill(rx, model).prefill("over mooncake", paths)
        assert rx.engine.stats()["regions"] == 0
        health = httpx.get(cluster.encoder_urls[0] + "/health", timeout=10).json()
    ref = reference_prefill(model, "over mooncake", [Image.open(p).convert("RGB") for p in paths])
    assert torch.equal(ref, result.prefill.logits)
    assert health["session_id"]  # the encoder's Mooncake engine
