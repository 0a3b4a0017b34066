"""P→D servers end to end: real processes on loopback, the monolithic model in this process as the reference.

Processes (module scope, booted in parallel): one encoder (`Cluster(Topology(encoders=1))`), a prefill server
wired to it (`main` prefill), a decode server, and a second, text-only prefill server (`aux`: short side-channel
timeout and KV free timeout; the last test SIGKILLs it). Every server is started as `epd_lab.launch` starts
encoders: port 0, one JSON line ``{"url", "pid"}`` on stdout, its own session, killed with this process.

After every test both pools are back to all-free (`/health`), on every live server.
"""
from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from epd_lab.launch import Cluster, Topology
from epd_lab.procs import die_with_parent, tail
from epd_lab.models import build_input_ids, monolithic_generate, preprocess
from epd_lab.noise import data_uri, random_png
from helpers import free_port, metric, plain_metrics, wait_for

pytestmark = pytest.mark.timeout(180)

N_TOKENS = 16
KV_BLOCKS = 64
DECODE_KV_BLOCKS = 256  # room for the 4000-token requests that keep a decode busy (each reserves 253 blocks)
DECODE_TIMEOUT = 2.0  # decode's wait for the producer's answer
AUX_TIMEOUT = 1.0  # the aux prefill's side-channel wait for a request not yet ready
AUX_FREE_TIMEOUT = 1.5  # the aux prefill frees KV that decode never asked for after this
SLACK = 3.0  # bounded-time checks only


class Server:
    """A server process started with port 0; `url` from its first stdout line; `close` kills its session."""

    def __init__(self, name: str, module: str, *args: str, log_dir: Path) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *args],
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                         preexec_fn=die_with_parent)  # noqa: PLW1509 (as launch.py)
        self.url, self.pid = "", 0

    def wait_ready(self, timeout: float = 90) -> Server:
        """Read the announcement (the port the OS chose)."""
        self.url, self.pid = self._announce(timeout)
        return self

    def _announce(self, timeout: float) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log:\n{tail(self.log)}")
            if select.select([self.proc.stdout], [], [], 0.1)[0]:
                line = self.proc.stdout.readline()
                if line:
                    hello = json.loads(line)
                    return hello["url"], hello["pid"]
        raise TimeoutError(f"{self.name} did not come up within {timeout} s; log:\n{tail(self.log)}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=5)
        assert r.status_code == 200
        return r.json()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


class Stack:
    def __init__(self, cluster: Cluster, main: Server, aux: Server, decode: Server) -> None:
        self.cluster, self.main, self.aux, self.decode = cluster, main, aux, decode
        self.http = httpx.Client(timeout=30)

    def prefill(self, server: Server, rid: str, prompt: str, images: list[str] = ()) -> httpx.Response:
        return self.http.post(server.url + "/v1/prefill", json={
            "request_id": rid, "prompt": prompt, "images": list(images),
            "kv_transfer_params": {"do_remote_decode": True}})

    def decode_body(self, rid: str, kv: dict, max_tokens: int = N_TOKENS, stream: bool = False, **kw) -> dict:
        return {"request_id": rid, "max_tokens": max_tokens, "stream": stream, "kv_transfer_params": kv, **kw}

    def generate(self, rid: str, prompt: str, images: list[str] = (), stream: bool = False) -> list[int]:
        """prefill on `main`, then decode; the tokens (checking the response shapes on the way)."""
        r = self.prefill(self.main, rid, prompt, images)
        assert r.status_code == 200, r.text
        pre = r.json()
        kv = pre["kv_transfer_params"]
        assert kv["first_token"] == pre["first_token"] and kv["prompt_len"] == pre["prompt_len"]
        assert kv["remote_request_id"] == rid and kv["num_blocks"] == -(-kv["prompt_len"] // 16)
        assert {s[2] for s in pre["spans"]} >= ({"prefill", "kv_write"} | ({"vit", "transfer"} if images else set()))
        body = self.decode_body(rid, kv, stream=stream)
        if not stream:
            r = self.http.post(self.decode.url + "/v1/decode", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["request_id"] == rid and out["finish_reason"] == "length"
            stages = [s[2] for s in out["spans"]]
            assert stages.count("kv_transfer") == 1 and stages.count("decode_step") == N_TOKENS - 1
            return out["tokens"]
        with self.http.stream("POST", self.decode.url + "/v1/decode", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines[-1]["type"] == "done" and lines[-1]["finish_reason"] == "length"
        assert [ln["index"] for ln in lines[:-1]] == list(range(N_TOKENS))
        return [ln["token"] for ln in lines[:-1]]


@pytest.fixture(scope="module")
def stack():
    # Every process is started from this (the main) thread: PR_SET_PDEATHSIG fires when the *thread* that
    # started a child ends, so a child started from a pool thread would die with that thread.
    log_dir = Path(tempfile.mkdtemp(prefix="epd-lab-pd-"))
    servers: list[Server] = []
    cluster = None
    try:
        servers.append(Server("decode", "epd_lab.servers.decode", "--kv-blocks", str(DECODE_KV_BLOCKS),
                              "--timeout", str(DECODE_TIMEOUT), "--kv-quarantine", "0.5", log_dir=log_dir))
        servers.append(Server("aux", "epd_lab.servers.prefill", "--kv-blocks", "32", "--timeout", str(AUX_TIMEOUT),
                              "--kv-free-timeout", str(AUX_FREE_TIMEOUT), log_dir=log_dir))
        cluster = Cluster(Topology(encoders=1, timeout=10.0))  # boots while the two above do
        servers.append(Server("main", "epd_lab.servers.prefill", "--encoders", ",".join(cluster.encoder_urls),
                              "--kv-blocks", str(KV_BLOCKS), "--timeout", "30", log_dir=log_dir))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.close()
        if cluster is not None:
            cluster.close()
        raise
    decode, aux, main = servers
    servers = [main, aux, decode]
    s = Stack(cluster, *servers)
    yield s
    s.http.close()
    for server in servers:
        server.close()
        assert not server.alive()
    cluster.close()
    assert cluster.procs == []


@pytest.fixture(autouse=True)
def pools_back(request):
    yield
    if "stack" not in request.fixturenames:
        return
    st = request.getfixturevalue("stack")
    for server in (st.main, st.aux, st.decode):
        if not server.alive():
            continue
        h = wait_for(lambda: (h := server.health())["used_blocks"] == 0 and h["free_blocks"] == h["num_blocks"] and h,
                     5, lambda: f"{server.name} gave its blocks back: {server.health()}")
        if server is st.decode:
            assert h["active_requests"] == 0 and h["quarantined_blocks"] == 0


def reference(model, prompt: str, images: list[Path]) -> list[int]:
    if not images:
        return monolithic_generate(model, build_input_ids(prompt, []), None, None, N_TOKENS)
    pixel_values, grid = preprocess([Image.open(p) for p in images])
    return monolithic_generate(model, build_input_ids(prompt, grid.tolist()), pixel_values, grid, N_TOKENS)


@pytest.fixture(scope="module")
def images():
    d = Path(tempfile.mkdtemp(prefix="epd-lab-pd-img-"))
    (d / "a.png").write_bytes(random_png(1, 224))
    (d / "b.png").write_bytes(random_png(2, (333, 100)))  # 100 wide, 333 high
    return [d / "a.png", d / "b.png"]


# ---------------------------------------------------------------------------------------------------------
def test_text_prompt_non_streaming_and_streaming(stack, model):
    prompt = "hello world, " * 3
    want = reference(model, prompt, [])
    assert stack.generate("text-plain", prompt) == want
    assert stack.generate("text-stream", prompt, stream=True) == want


def test_image_prompts_non_streaming_and_streaming(stack, model, images):
    assert stack.generate("img-1", "describe it", [str(images[0])]) == reference(model, "describe it", images[:1])
    # two images, one as a path and one as a data: URI
    two = [str(images[0]), data_uri(images[1].read_bytes())]
    assert stack.generate("img-2", "compare", two, stream=True) == reference(model, "compare", images)


def test_two_requests_concurrently(stack, model, images):
    cases = [("conc-text", "two at once " * 4, [], False), ("conc-img", "and this", [images[1]], True)]
    wants = [reference(model, prompt, imgs) for _, prompt, imgs, _ in cases]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(stack.generate, rid, prompt, [str(p) for p in imgs], stream)
                for rid, prompt, imgs, stream in cases]
        assert [f.result(60) for f in futs] == wants


def test_concurrent_decodes_interleave_steps(stack, model):
    """Two streams at once: the scheduler runs them round-robin, so their decode steps interleave in time, and
    each one's tokens are still exactly its single-request (monolithic) tokens.

    `rr-a` is generating (its first step done) before `rr-b` is sent, and its client leaves only once `rr-b`
    ended: the two overlap whatever the load. (Sent at once, 120 tokens each, one could end before a loaded
    machine admitted the other.)"""
    n, a_max = 120, 2000  # rr-a asks for far more than it generates here; its KV reservation leaves room for rr-b
    prompts = {"rr-a": "first of two " * 2, "rr-b": "second, longer prompt " * 3}
    kvs = {rid: stack.prefill(stack.main, rid, p).json()["kv_transfer_params"] for rid, p in prompts.items()}
    url = stack.decode.url + "/v1/decode"
    with stack.http.stream("POST", url, json=stack.decode_body("rr-a", kvs["rr-a"], a_max, stream=True)) as ra:
        assert ra.status_code == 200
        a_lines = (json.loads(line) for line in ra.iter_lines() if line)
        a_tokens = [next(a_lines)["token"] for _ in range(2)]  # token 1 came from rr-a's first step
        with stack.http.stream("POST", url, json=stack.decode_body("rr-b", kvs["rr-b"], n, stream=True)) as rb:
            assert rb.status_code == 200
            b_lines = [json.loads(line) for line in rb.iter_lines() if line]
        assert b_lines[-1]["type"] == "done", b_lines[-1]
        # rr-a still generates: its steps so far from the decode's recorder (its own last line never comes)
        spans = stack.http.get(stack.decode.url + "/v1/spans", params={"request_id": "rr-a"}).json()["spans"]
        a = [s for s in spans if s[2] == "decode_step"]
        while len(a_tokens) <= len(a) and (line := next(a_lines))["type"] == "token":  # streamed already
            a_tokens.append(line["token"])
    # leaving the stream cancels rr-a (the pools_back fixture checks its blocks come back)
    b = [s for s in b_lines[-1]["spans"] if s[2] == "decode_step"]
    got = {"rr-a": a_tokens, "rr-b": [ln["token"] for ln in b_lines[:-1]]}
    assert len(got["rr-b"]) == n
    for rid, prompt in prompts.items():
        assert got[rid] == monolithic_generate(model, build_input_ids(prompt, []), None, None, len(got[rid])), rid
    # some step of each falls strictly between two steps of the other: interleaved, not one after the other
    assert any(a[0][4] < s[4] < a[-1][5] for s in b) and any(b[0][4] < s[4] < b[-1][5] for s in a)


def test_sampling_is_seeded_and_starts_from_prefill_token(stack):
    tokens = []
    for i in range(2):
        pre = stack.prefill(stack.main, f"sample-{i}", "sample me").json()
        r = stack.http.post(stack.decode.url + "/v1/decode", json=stack.decode_body(
            f"sample-{i}", pre["kv_transfer_params"], temperature=1.5, seed=7))
        assert r.status_code == 200, r.text
        tokens.append(r.json()["tokens"])
        assert tokens[-1][0] == pre["first_token"] and len(tokens[-1]) == N_TOKENS
    assert tokens[0] == tokens[1]


def test_bad_requests_are_4xx_or_503_with_detail(stack):
    p, d = stack.main.url + "/v1/prefill", stack.decode.url + "/v1/decode"
    r = stack.http.post(p, content=b"{not json")
    assert r.status_code == 400 and "malformed PrefillRequest" in r.json()["detail"]
    r = stack.http.post(p, json={"request_id": "x", "prompt": "a", "extra": 1})
    assert r.status_code == 400 and "unknown field" in r.json()["detail"]
    r = stack.prefill(stack.main, "bad-img", "a", ["data:image/png;base64," + base64.b64encode(b"not a png").decode()])
    assert r.status_code == 400 and "mm_items[0]" in r.json()["detail"]  # the encoder's message
    r = stack.prefill(stack.aux, "no-encoders", "a", ["/nonexistent.png"])
    assert r.status_code == 400 and "no encoders" in r.json()["detail"]
    # found before any compute: a prompt past the model's positions, or whose KV outgrows the whole cache
    r = stack.prefill(stack.main, "too-long", "x" * 72_000)
    assert r.status_code == 400 and "max_position_embeddings 4096" in r.json()["detail"]
    r = stack.prefill(stack.aux, "too-big", "x" * (33 * 16))  # 33 blocks, aux has 32
    assert r.status_code == 400 and "more than the 32 blocks" in r.json()["detail"]
    # a pool that is only full now is a 503: the same request fits once the held KV is gone
    assert stack.prefill(stack.aux, "holds-20", "x" * (20 * 16 - 1)).status_code == 200  # KV held for decode
    r = stack.prefill(stack.aux, "needs-20", "x" * (20 * 16 - 1))
    assert r.status_code == 503 and "KV pool exhausted" in r.json()["detail"]
    assert stack.http.post(stack.aux.url + "/v1/abort", json={"request_id": "holds-20"}).json()["freed_blocks"] == 20
    assert stack.http.post(stack.aux.url + "/v1/abort", json={"request_id": "needs-20"}).status_code == 200
    kv = {"remote_url": "tcp://127.0.0.1:1", "remote_request_id": "r", "prompt_len": 40, "rope_delta": 0,
          "first_token": 1, "num_blocks": 3}
    r = stack.http.post(d, json=stack.decode_body("x", {**kv, "num_blocks": 2}))
    assert r.status_code == 400 and "take 3 blocks" in r.json()["detail"]
    # a decode whose prompt and tokens could never fit its pool: 400 at once, no KV asked for
    r = stack.http.post(d, json=stack.decode_body("x", {**kv, "prompt_len": 16 * 256, "num_blocks": 256}))
    assert r.status_code == 400 and "needs 257 blocks of a capacity of 256" in r.json()["detail"], r.text
    r = stack.http.post(d, json=stack.decode_body("x", kv, max_tokens=0))
    assert r.status_code == 400 and "max_tokens" in r.json()["detail"]
    r = stack.http.post(d, json={"request_id": "x", "max_tokens": 1})
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["detail"]
    metrics = plain_metrics(stack.http.get(stack.main.url + "/metrics").text)
    assert 'epd_lab:prefill_requests_total{route="/v1/prefill",status="400"}' in metrics
    metrics = plain_metrics(stack.http.get(stack.decode.url + "/metrics").text)
    assert f"epd_lab:decode_kv_blocks_free {DECODE_KV_BLOCKS}" in metrics and "epd_lab:decode_kv_blocks_reserved 0" in metrics


def test_a_prefill_past_its_queue_bound_refuses_at_once_with_retry_after(tmp_path):
    """workers 1 + max_queued 1 (the memory backstop, here tiny): of a burst of 8 concurrent prefills, those beyond
    the one running and the one waiting are refused with 503 and Retry-After at once (before their body is read),
    counted by reason, and the admitted ones are served. (Before deadline-aware admission it was the only rule:
    workers + max_queued, 4 + 32 by default; now a request waits while its deadline allows, and this bound is a
    large backstop.)"""
    tight = Server("tight", "epd_lab.servers.prefill", "--workers", "1", "--max-queued", "1", "--kv-blocks", "64",
                   log_dir=tmp_path).wait_ready()
    try:
        body = {"prompt": "slow " * 100, "kv_transfer_params": {"do_remote_decode": False}}

        def post(i: int) -> tuple[int, float, str | None, str]:
            t0 = time.monotonic()
            r = httpx.post(tight.url + "/v1/prefill", json={"request_id": f"burst-{i}", **body}, timeout=60)
            return r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), r.text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
        statuses = sorted(status for status, _, _, _ in answers)
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2, answers
        refused = [(elapsed, retry, text) for status, elapsed, retry, text in answers if status == 503]
        assert all(int(retry) >= 1 and elapsed < 2.0 and "at capacity" in text for elapsed, retry, text in refused)
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert f'epd_lab:prefill_refused_total{{reason="queue_full"}} {len(refused)}' in metrics
        assert "epd_lab:prefill_max_queued 1" in metrics and "epd_lab:prefill_admitted 0" in metrics
        assert "epd_lab:prefill_queue_length 0" in metrics
    finally:
        tight.close()


def test_a_prefill_queues_what_fits_the_deadline_and_refuses_what_does_not(tmp_path):
    """workers 1, the default queue: a burst of 8 concurrent prefills waits and is served in full (the old fixed
    cap refused 6 of them); a request whose deadline (X-EPD-Deadline-Ms) cannot hold even its own service is
    refused at once with 503, Retry-After and the predicted wait, and counted by reason."""
    tight = Server("queueing", "epd_lab.servers.prefill", "--workers", "1", "--kv-blocks", "64",
                   log_dir=tmp_path).wait_ready()
    try:
        body = {"prompt": "slow " * 100, "kv_transfer_params": {"do_remote_decode": False}}

        def post(i: int) -> int:
            return httpx.post(tight.url + "/v1/prefill", json={"request_id": f"wait-{i}", **body},
                              timeout=60).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(post, range(8))) == [200] * 8
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert "epd_lab:prefill_queued_total 0" not in metrics  # some of them waited their turn
        r = httpx.post(tight.url + "/v1/prefill", json={"request_id": "hurried", **body},
                       headers={"X-EPD-Deadline-Ms": "0.001"}, timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "predicted wait 0.00 s" in r.json()["detail"] and "deadline of 0.00 s" in r.json()["detail"]
        r = httpx.post(tight.url + "/v1/prefill", json={"request_id": "garbled", **body},
                       headers={"X-EPD-Deadline-Ms": "soon"}, timeout=10)
        assert r.status_code == 400 and "X-EPD-Deadline-Ms" in r.json()["detail"]
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert 'epd_lab:prefill_refused_total{reason="deadline"} 1' in metrics
        assert 'epd_lab:prefill_refused_total{reason="queue_full"} 0' in metrics
        admission = tight.health()["admission"]
        assert admission["workers"] == 1 and admission["queued"] == 0 and admission["service_s"] > 0
    finally:
        tight.close()


def test_a_decode_at_capacity_refuses_at_once_with_retry_after(stack, tmp_path):
    """max_active 1 and no queue (--max-queued 0): while one streamed request generates, a second is refused with
    503 and Retry-After at once (its KV stays with prefill, untouched); once the first stream ends, the second is
    admitted and served. (Before deadline-aware admission max_active refused; now --max-queued 0 asks for that.)"""
    tight = Server("tight-decode", "epd_lab.servers.decode", "--max-active", "1", "--max-queued", "0",
                   "--kv-blocks", str(DECODE_KV_BLOCKS), log_dir=tmp_path).wait_ready()
    try:
        kv = {rid: stack.prefill(stack.main, rid, "a" * 40).json()["kv_transfer_params"] for rid in ("cap-a", "cap-b")}
        body = stack.decode_body("cap-a", kv["cap-a"], 4000, stream=True)  # seconds of generating
        with stack.http.stream("POST", tight.url + "/v1/decode", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator, collected, would close the stream
            next(lines)  # it is generating
            t0 = time.monotonic()
            r = stack.http.post(tight.url + "/v1/decode", json=stack.decode_body("cap-b", kv["cap-b"], 2))
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and time.monotonic() - t0 < 2.0
            assert "at capacity" in r.json()["detail"]
        # the client hung up: decode drops the request and admits again
        wait_for(lambda: "epd_lab:decode_admitted 0" in plain_metrics(httpx.get(tight.url + "/metrics").text), 10,
                 "the closed stream released")
        r = stack.http.post(tight.url + "/v1/decode", json=stack.decode_body("cap-b", kv["cap-b"], 2))
        assert r.status_code == 200 and len(r.json()["tokens"]) == 2
        assert 'epd_lab:decode_refused_total{reason="queue_full"} 1' in plain_metrics(httpx.get(tight.url + "/metrics").text)
    finally:
        tight.close()


def test_a_decode_request_waits_holding_no_kv_and_is_served_when_a_place_frees(stack, tmp_path):
    """max_active 1, the default queue: while one streamed request generates, a second waits (queue length 1,
    its blocks not allocated: only the first's were ever held) and is served once the first stream ends."""
    tight = Server("queue-decode", "epd_lab.servers.decode", "--max-active", "1",
                   "--kv-blocks", str(DECODE_KV_BLOCKS), log_dir=tmp_path).wait_ready()
    try:
        kv = {rid: stack.prefill(stack.main, rid, "a" * 40).json()["kv_transfer_params"] for rid in ("q-a", "q-b")}
        body = stack.decode_body("q-a", kv["q-a"], 4000, stream=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with stack.http.stream("POST", tight.url + "/v1/decode", json=body) as first:
                assert first.status_code == 200
                lines = first.iter_lines()
                next(lines)
                second = pool.submit(httpx.post, tight.url + "/v1/decode",
                                     json=stack.decode_body("q-b", kv["q-b"], 2), timeout=30)
                metrics = wait_for(lambda: _queued(second, tight.url, lambda m: "epd_lab:decode_queue_length 1" in m), 10,
                                   "the second request queued", interval=0.02)
                assert "epd_lab:decode_running 1" in metrics and not second.done()
            r = second.result(30)  # the first stream closed: its place goes to the waiting one
        assert r.status_code == 200 and len(r.json()["tokens"]) == 2
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert "epd_lab:decode_queued_total 1" in metrics and 'epd_lab:decode_refused_total{reason="expired"} 0' in metrics
    finally:
        tight.close()


def _queued(second: concurrent.futures.Future, url: str, queued: Callable[[str], bool]) -> str:
    """`url`'s /metrics once `queued` says the `second` request waits there, else ""; that request answered before
    it queued fails the test at once."""
    assert not second.done(), "the second request was answered before it queued"
    metrics = plain_metrics(httpx.get(url + "/metrics").text)
    return metrics if queued(metrics) else ""


def _max_tokens_for(blocks: int, prompt_len: int) -> int:
    """The max_tokens whose reservation (prompt_len + max_tokens - 1 tokens) takes exactly `blocks` of 16."""
    return blocks * 16 - prompt_len + 1


def test_decode_admits_a_request_only_when_its_whole_kv_fits_the_pool(stack, tmp_path):
    """--kv-blocks 16, the default --max-active 64: a burst of 10 streamed requests that each reserve 6 blocks (60,
    far past the pool; two fit at once) is served in full or refused with a 503 before its stream begins; none
    fails for lack of KV, the excess waits (holding no blocks) rather than failing, and afterwards every block and
    reservation is back. A request whose reservation exceeds the whole pool is a 400 at once."""
    tight = Server("kv-decode", "epd_lab.servers.decode", "--kv-blocks", "16", "--kv-quarantine", "0.5",
                   log_dir=tmp_path).wait_ready()
    rids = [f"kvb-{i}" for i in range(10)]
    try:
        kv = {rid: stack.prefill(stack.main, rid, "a" * 40).json()["kv_transfer_params"] for rid in [*rids, "kvb-big"]}
        big = stack.decode_body("kvb-big", kv["kvb-big"], _max_tokens_for(17, kv["kvb-big"]["prompt_len"]))
        r = stack.http.post(tight.url + "/v1/decode", json=big)
        assert r.status_code == 400 and "needs 17 blocks of a capacity of 16" in r.json()["detail"], r.text

        def one(rid: str) -> tuple[int, list[dict], str | None]:
            n = _max_tokens_for(6, kv[rid]["prompt_len"])
            with httpx.stream("POST", tight.url + "/v1/decode", timeout=60,
                              json=stack.decode_body(rid, kv[rid], n, stream=True)) as resp:
                lines = [json.loads(line) for line in resp.iter_lines() if line]
                return resp.status_code, lines, resp.headers.get("retry-after")

        with concurrent.futures.ThreadPoolExecutor(len(rids)) as pool:
            results = dict(zip(rids, pool.map(one, rids)))
        served = [rid for rid, (status, _, _) in results.items() if status == 200]
        for rid, (status, lines, retry_after) in results.items():
            if status == 200:  # all its tokens, then done: never an error line
                n = _max_tokens_for(6, kv[rid]["prompt_len"])
                assert [ln["type"] for ln in lines] == ["token"] * n + ["done"], (rid, lines[-1])
            else:
                assert status == 503 and retry_after is not None, (rid, status, lines)
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert len(served) >= 2 and metric(metrics, "epd_lab:decode_kv_admission_queued_total") >= 1
        assert metric(metrics, "epd_lab:decode_requests_failed_total") == 0
        assert tight.health()["counters"].get("kv_pool_exhausted", 0) == 0
        wait_for(lambda: (h := tight.health())["free_blocks"] == 16 and h["reserved_blocks"] == 0, 10,
                 lambda: f"every block and reservation back: {tight.health()}")
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert metric(metrics, "epd_lab:decode_kv_blocks_reserved") == 0
        assert metric(metrics, "epd_lab:decode_kv_admission_admitted") == 0
    finally:
        for rid in [*rids, "kvb-big"]:  # the refused ones' KV, left with the prefill
            stack.http.post(stack.main.url + "/v1/abort", json={"request_id": rid})
        tight.close()


def test_a_decode_kv_waiter_is_served_when_blocks_return_or_refused_by_its_deadline(stack, tmp_path):
    """One streamed request reserves 255 of 256 blocks for thousands of tokens. A request that needs 3 waits,
    holding no blocks (only the first's are used), and is served once the first's stream closes; one whose
    deadline (X-EPD-Deadline-Ms) passes meanwhile is refused with 503 and Retry-After, not failed later."""
    tight = Server("kv-wait-decode", "epd_lab.servers.decode", "--kv-blocks", "256", log_dir=tmp_path).wait_ready()
    rids = ("kvw-hold", "kvw-wait", "kvw-short")
    try:
        kv = {rid: stack.prefill(stack.main, rid, "a" * 40).json()["kv_transfer_params"] for rid in rids}
        body = stack.decode_body("kvw-hold", kv["kvw-hold"], _max_tokens_for(255, kv["kvw-hold"]["prompt_len"]),
                                 stream=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with stack.http.stream("POST", tight.url + "/v1/decode", json=body) as first:
                assert first.status_code == 200
                lines = first.iter_lines()  # kept: a dropped iterator, collected, would close the stream
                next(lines)
                received = tight.health()["counters"]["kv_bytes"]
                second = pool.submit(httpx.post, tight.url + "/v1/decode", timeout=60, json=stack.decode_body(
                    "kvw-wait", kv["kvw-wait"], _max_tokens_for(3, kv["kvw-wait"]["prompt_len"])))
                metrics = wait_for(lambda: _queued(second, tight.url, lambda m: metric(
                    m, "epd_lab:decode_kv_admission_queue_length") == 1), 10, "the second request queued", interval=0.02)
                assert metric(metrics, "epd_lab:decode_kv_blocks_reserved") == 255
                assert tight.health()["counters"]["kv_bytes"] == received  # the waiter's KV stays with prefill
                t0 = time.monotonic()
                r = stack.http.post(tight.url + "/v1/decode", headers={"X-EPD-Deadline-Ms": "1500"},
                                    json=stack.decode_body("kvw-short", kv["kvw-short"], 2))
                assert r.status_code == 503 and "retry-after" in r.headers, r.text
                assert time.monotonic() - t0 < 1.5 + SLACK and "decode KV" in r.json()["detail"]
                assert not second.done()
            r = second.result(30)  # the first stream closed: its blocks and reservation come back
        assert r.status_code == 200 and len(r.json()["tokens"]) == _max_tokens_for(3, kv["kvw-wait"]["prompt_len"])
        metrics = plain_metrics(httpx.get(tight.url + "/metrics").text)
        assert metric(metrics, 'epd_lab:decode_kv_admission_refused_total{reason="deadline"}') + metric(
            metrics, 'epd_lab:decode_kv_admission_refused_total{reason="expired"}') == 1
    finally:
        stack.http.post(stack.main.url + "/v1/abort", json={"request_id": "kvw-short"})
        tight.close()


def test_decode_against_a_dead_producer_fails_within_the_timeout(stack):
    kv = {"remote_url": f"tcp://127.0.0.1:{free_port()}", "remote_request_id": "r", "prompt_len": 20,
          "rope_delta": 0, "first_token": 1, "num_blocks": 2}
    start = time.monotonic()
    r = stack.http.post(stack.decode.url + "/v1/decode", json=stack.decode_body("dead", kv))
    assert time.monotonic() - start < DECODE_TIMEOUT + SLACK
    assert r.status_code == 504 and "no answer from the producer" in r.json()["detail"]
    assert stack.decode.health()["counters"]["kv_timeouts"] >= 1
    # the blocks rest in quarantine (a slow producer could still write), then pools_back sees them free


def test_decode_of_an_unknown_request_is_trans_error(stack):
    """A request the producer never held: its TRANS_ERROR says "not found", and decode answers 404 (the caller
    named KV that is not there; it once answered 502, a server error)."""
    kv_url = stack.aux.health()["kv_url"]
    kv = {"remote_url": kv_url, "remote_request_id": "never-prefilled", "prompt_len": 20, "rope_delta": 0,
          "first_token": 1, "num_blocks": 2}
    start = time.monotonic()
    r = stack.http.post(stack.decode.url + "/v1/decode", json=stack.decode_body("unknown", kv))
    assert time.monotonic() - start < AUX_TIMEOUT + SLACK
    assert r.status_code == 404 and "TRANS_ERROR" in r.json()["detail"] and "not found" in r.json()["detail"]


def test_prefill_frees_blocks_decode_never_asks_for(stack):
    before = stack.aux.health()["producer"]["requests_expired"]
    r = stack.prefill(stack.aux, "orphan", "nobody decodes me " * 3)
    assert r.status_code == 200
    assert stack.aux.health()["used_blocks"] == r.json()["kv_transfer_params"]["num_blocks"]
    h = wait_for(lambda: (h := stack.aux.health())["used_blocks"] == 0 and h, AUX_FREE_TIMEOUT + SLACK,
                 lambda: f"the orphan's blocks freed: {stack.aux.health()}")
    assert h["producer"]["requests_expired"] == before + 1


def test_streaming_client_disconnect_stops_decode(stack):
    before = stack.decode.health()["counters"]
    pre = stack.prefill(stack.main, "gone", "a long one").json()
    max_tokens = 4000
    with httpx.Client(timeout=30) as client, client.stream("POST", stack.decode.url + "/v1/decode",
                       json=stack.decode_body("gone", pre["kv_transfer_params"], max_tokens, stream=True)) as r:
        lines = r.iter_lines()
        got = [json.loads(next(lines)) for _ in range(3)]
        assert [g["index"] for g in got] == [0, 1, 2]
        assert stack.decode.health()["active_requests"] == 1
    # the connection is closed: the scheduler drops the request
    h = wait_for(lambda: (h := stack.decode.health())["active_requests"] == 0 and h, 10,
                 lambda: f"the request dropped: {stack.decode.health()}", interval=0.02)
    after = h["counters"]
    assert after.get("requests_cancelled", 0) == before.get("requests_cancelled", 0) + 1
    assert after["tokens_generated"] - before["tokens_generated"] < max_tokens // 2


def test_prefill_killed_before_decode_fails_within_the_timeout(stack):
    """Last: it SIGKILLs the aux prefill server."""
    r = stack.prefill(stack.aux, "doomed", "prefilled, then the prefill server dies")
    assert r.status_code == 200
    stack.aux.kill()
    start = time.monotonic()
    body = stack.decode_body("doomed", r.json()["kv_transfer_params"])
    r = stack.http.post(stack.decode.url + "/v1/decode", json=body)
    assert time.monotonic() - start < DECODE_TIMEOUT + SLACK
    assert r.status_code == 504 and "no answer from the producer" in r.json()["detail"]


def test_logits_through_the_servers_are_bit_identical_to_generate(stack, model, images):
    """float32, one request: prefill server (E→P from an encoder) → KV over the side channel → decode
    server; every decode step's logits equal those `model.generate` scored the same token with."""
    pixel_values, grid = preprocess([Image.open(images[0])])
    ids = build_input_ids("look", grid.tolist())
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values,
                             image_grid_thw=grid, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                             max_new_tokens=N_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    pre = stack.prefill(stack.main, "logits-1", "look", [str(images[0])]).json()
    out = stack.http.post(stack.decode.url + "/v1/decode", json=stack.decode_body(
        "logits-1", pre["kv_transfer_params"], return_logits=True)).json()
    assert out["tokens"] == ref.sequences[0, ids.shape[1]:].tolist()
    assert len(out["logits"]) == N_TOKENS - 1
    for step, row in enumerate(out["logits"]):
        assert torch.equal(torch.tensor(row, dtype=torch.float32), ref.logits[step + 1][0]), f"step {step}"


def test_pipelined_decode_asks_while_prefill_runs(stack, model, images):
    """Decode gets the request first, with only the producer's address (as the proxy sends it while prefill
    runs): it learns the prompt's size from the producer's plan, its metadata waits for the KV, TRANS_DONE
    brings prefill's first token, and the tokens are the monolithic model's. Its kv_query began before prefill
    answered."""
    kv = {"remote_url": stack.main.health()["kv_url"], "remote_request_id": "piped"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(stack.http.post, stack.decode.url + "/v1/decode", json=stack.decode_body("piped", kv))
        time.sleep(0.3)
        assert not decoded.done()  # waiting for prefill's plan
        t_prefill = time.monotonic_ns()
        r = stack.prefill(stack.main, "piped", "describe it", [str(images[0])])
        assert r.status_code == 200, r.text
        out = decoded.result(60)
    assert out.status_code == 200, out.text
    assert out.json()["tokens"] == reference(model, "describe it", images[:1])
    assert out.json()["tokens"][0] == r.json()["first_token"]
    query = next(s for s in out.json()["spans"] if s[2] == "kv_query")
    assert query[4] < t_prefill  # asked before prefill even began


def test_pipelined_decode_fails_at_once_when_its_prefill_fails(stack, images):
    """The prefill refuses the request (an image that does not decode) after decode began waiting: the
    producer tells decode at once, not at its timeout; nothing is held on either side."""
    kv = {"remote_url": stack.main.health()["kv_url"], "remote_request_id": "piped-bad"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(stack.http.post, stack.decode.url + "/v1/decode",
                              json=stack.decode_body("piped-bad", kv))
        time.sleep(0.3)
        r = stack.prefill(stack.main, "piped-bad", "a", [str(images[0]), "data:image/png;base64,bm90IGEgcG5n"])
        assert r.status_code == 400
        start = time.monotonic()
        out = decoded.result(DECODE_TIMEOUT + SLACK)
    assert out.status_code == 409 and "aborted" in out.json()["detail"], out.text  # TRANS_ERROR "aborted"
    assert time.monotonic() - start < 1.0  # the producer answered the waiting query when prefill failed
    r = stack.http.post(stack.decode.url + "/v1/decode", json=stack.decode_body(
        "x", {"remote_url": kv["remote_url"], "remote_request_id": "r", "prompt_len": 3}))
    assert r.status_code == 400 and "together, or none of them" in r.json()["detail"]
