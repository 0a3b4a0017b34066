"""XpYd through real processes: 2 encoders, 2 prefills, 2 decodes and the proxy (`Cluster`), driven by the
official `openai` client. Answers equal the monolithic model's; both prefills and both decodes serve; a failed
decode makes the proxy abort the request on its prefill (`POST /v1/abort`), which frees the KV at once instead
of after ``--kv-free-timeout`` (30 s by default, far above every wait here); spans of one request line up.

The tests share one cluster (booting 7 processes takes most of this file's time) and run in file order: the
last two freeze and kill a decode, then a prefill, and check that the rest keeps serving.

The first test is in-process: `KVProducer.abort` against a producer and a raw side-channel REQ socket.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import zmq

from epd_lab.kv import BlockManager, KVConsumer, KVProducer, PagedKVCache, TransError
from epd_lab.kv.connector import RequestAborted
from epd_lab.kv.messages import decode_reply, encode
from epd_lab.launch import Cluster, Topology
from epd_lab.procs import die_with_parent
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.reference import monolithic_chat
from epd_lab.transfer import TransferEngine
from helpers import chat, metric, metrics, plain_metrics, read_line, wait_for

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 16
# every role's timeout: the proxy's idle timeout, decode's wait for the producer, E→P. At 4 s the six concurrent
# chats (pipelined: decode's wait spans the prefill) failed 1 run in 3 on a loaded
# 2-vCPU host
TIMEOUT = 6.0
SLACK = 3.0  # bounded-time checks only; the prefills' KV free timeout (30 s) is far above TIMEOUT + SLACK
PREFILLS, DECODES = slice(2, 4), slice(4, 6)  # Cluster.procs: encoders, prefills, decodes, proxy


# ---- KVProducer.abort, in process ----
def _ask(producer: KVProducer, consumer: KVConsumer, rid: str) -> Any:
    """Send decode's metadata for `rid` over a raw REQ socket; the producer's reply."""
    with zmq.Context.instance().socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(producer.url)
        sock.send(encode(consumer.metadata(rid, [0, 1])))
        assert sock.poll(3000), "no reply from the producer"
        return decode_reply(sock.recv())


def test_producer_abort_frees_blocks_and_answers_trans_error() -> None:
    with (TransferEngine(timeout=2.0) as p_engine, TransferEngine(timeout=2.0) as d_engine,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=p_engine) as p_cache,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=d_engine) as d_cache):
        blocks = BlockManager(8)
        consumer = KVConsumer(d_engine, d_cache)
        with KVProducer(p_engine, p_cache, free_blocks=blocks.free, timeout=5.0, free_timeout=60.0) as producer:
            producer.request_finished("r", blocks.allocate(2))
            assert producer.abort("r") == 2 and blocks.num_free_blocks == 8  # now, not after free_timeout
            assert producer.abort("r") == 0  # idempotent
            start = time.monotonic()
            reply = _ask(producer, consumer, "r")
            assert isinstance(reply, TransError) and "aborted" in reply.error
            assert time.monotonic() - start < 1.0  # at once, not after the ask's 5 s wait
            with pytest.raises(RequestAborted):
                producer.request_finished("r", [3])  # a prefill that finishes after its abort keeps nothing
            # an abort of a request not yet readied answers an ask already waiting for it at once
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(_ask, producer, consumer, "late")
                time.sleep(0.2)
                assert producer.abort("late") == 0
                assert "aborted" in waiting.result(2).error
            stats = producer.stats()
            assert stats["requests_aborted"] == 1 and stats["requests_held"] == 0 and stats["blocks_freed"] == 2


# ---- the cluster ----
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(Topology(encoders=2, prefills=2, decodes=2, proxy=True, timeout=TIMEOUT, pipelined=True)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=5).json()


def _live(cluster: Cluster, urls: list[str], procs: slice) -> list[str]:
    return [url for url, proc in zip(urls, cluster.procs[procs], strict=True) if proc.poll() is None]


@pytest.fixture(autouse=True)
def blocks_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every cluster test: all blocks free and nothing generating on every live prefill and decode. The
    wait is far below the prefills' KV free timeout, so a request the proxy failed to abort shows here."""
    yield
    if "cluster" not in request.fixturenames:
        return
    c: Cluster = request.getfixturevalue("cluster")
    for url in _live(c, c.prefill_urls, PREFILLS) + _live(c, c.decode_urls, DECODES):
        health = wait_for(lambda u=url: (h := _health(u))["used_blocks"] == 0 and h.get("active_requests", 0) == 0 and h,
                       SLACK, f"{url} kept blocks or requests")
        assert health["free_blocks"] == health["num_blocks"]


def _messages(text: str, sizes: list[tuple[int, int]], seed: int) -> list[dict[str, Any]]:
    content = [{"type": "image_url", "image_url": {"url": data_uri(random_png(seed + i, (h, w)))}}
               for i, (w, h) in enumerate(sizes)]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def _served(cluster: Cluster) -> tuple[list[int], list[int]]:
    """Requests answered by each prefill, requests finished by each decode."""
    return ([_health(u)["counters"].get("requests_ok", 0) for u in cluster.prefill_urls],
            [_health(u)["counters"].get("requests_finished", 0) for u in cluster.decode_urls])


def _aborts(cluster: Cluster) -> int:
    """Requests whose KV the live prefills freed on the proxy's abort."""
    return sum(_health(u)["producer"]["requests_aborted"] for u in _live(cluster, cluster.prefill_urls, PREFILLS))


def test_xpyd_concurrent_chats_equal_the_monolithic_model(cluster: Cluster, client: openai.OpenAI,
                                                          model: Any) -> None:
    cases = [(_messages("what do you see?", sizes, seed=10 * i), i % 2 == 1)
             for i, sizes in enumerate([[], [(224, 224)], [(100, 333), (64, 64)], [(500, 260)], [], [(128, 96)]])]
    before_p, before_d = _served(cluster)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(chat, cluster.proxy_url, messages, MAX_TOKENS, stream) for messages, stream in cases]
        texts = [f.result(120)[1] for f in futures]
    assert texts == [monolithic_chat(model, messages, MAX_TOKENS) for messages, _ in cases]
    after_p, after_d = _served(cluster)
    served_p = [a - b for a, b in zip(after_p, before_p, strict=True)]
    served_d = [a - b for a, b in zip(after_d, before_d, strict=True)]
    assert sum(served_p) == sum(served_d) == len(cases)
    assert all(served_p) and all(served_d), (served_p, served_d)  # round robin spread them over both of each


def test_decode_asks_only_the_producers_it_was_told_about(cluster: Cluster) -> None:
    """A /v1/decode naming a side channel that is not one of the cluster's prefills is refused (403) before any
    socket opens: a listening ROUTER there hears nothing, so decode's cache addresses and keys never leave. (Before,
    decode sent its MooncakeAgentMetadata to any URL a caller named.)"""
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as trap:
        trap.setsockopt(zmq.LINGER, 0)
        port = trap.bind_to_random_port("tcp://127.0.0.1")
        for pipelined in (False, True):
            kv = {"remote_url": f"tcp://127.0.0.1:{port}", "remote_request_id": "x"}
            if not pipelined:
                kv |= {"prompt_len": 16, "rope_delta": 0, "first_token": 1, "num_blocks": 1}
            r = httpx.post(cluster.decode_urls[0] + "/v1/decode", timeout=10,
                           json={"request_id": f"trap-{pipelined}", "max_tokens": 2, "kv_transfer_params": kv})
            assert r.status_code == 403 and "not a producer" in r.json()["detail"]
            assert str(port) not in r.json()["detail"]
        assert not trap.poll(300), "decode wrote to a side channel it was never told about"
    assert _health(cluster.decode_urls[0])["kv_producers_guarded"] is True


def test_spans_of_one_request_make_one_timeline(cluster: Cluster, client: openai.OpenAI) -> None:
    response_id, _ = chat(cluster.proxy_url, _messages("timeline", [(224, 224)], seed=99), MAX_TOKENS, stream=True)
    got = wait_for(lambda: (r := httpx.get(cluster.proxy_url + "/v1/spans", params={"request_id": response_id}))
                .status_code == 200 and "e2e" in {s[2] for s in r.json()["spans"]} and r.json(),
                SLACK, "the proxy never recorded the request's e2e span")  # recorded as the stream closes
    spans = got["spans"]
    stages = {s[2] for s in spans}
    assert stages >= {"http_encode", "vit", "transfer", "prefill", "kv_write", "kv_query", "kv_transfer",
                      "decode_step", "ttft", "tpot", "e2e"}, stages
    assert {s[3].split(":")[0] for s in spans} >= {"proxy", "prefill", "decode"}
    assert [s[4] for s in spans] == sorted(s[4] for s in spans)  # oldest first
    first = {stage: min(s[4] for s in spans if s[2] == stage) for stage in stages}
    last = {stage: max(s[5] for s in spans if s[2] == stage) for stage in stages}
    # one clock for every process: E→P, then prefill, then decode steps, inside e2e; decode was asked while
    # prefill ran (pipelined), and its KV arrived once prefill had written it
    assert first["e2e"] <= first["http_encode"] <= last["transfer"] <= first["prefill"]
    assert first["kv_query"] <= first["prefill"] and first["kv_transfer"] <= last["prefill"]
    # the write began before decode had the KV (the producer may answer TRANS_DONE before kv_write's span closes)
    assert first["kv_write"] <= last["kv_transfer"] <= first["decode_step"]
    assert last["decode_step"] <= last["e2e"] and last["ttft"] <= last["e2e"]
    assert sum(s[2] == "decode_step" for s in spans) == MAX_TOKENS - 1
    bare = httpx.get(cluster.proxy_url + "/v1/spans", params={"request_id": response_id.removeprefix("chatcmpl-")})
    assert bare.json()["spans"] == spans
    assert httpx.get(cluster.proxy_url + "/v1/spans", params={"request_id": "nope"}).json()["spans"] == []
    every = httpx.get(cluster.proxy_url + "/v1/spans").json()["spans"]  # no request_id: all the proxy holds
    assert all(s in every for s in spans)
    # the same timeline collected from every server (each answers /v1/spans), copies counted once
    frame = cluster.spans(response_id)
    assert {n.split(":")[0] for n in frame.node} == {"encoder", "prefill", "decode", "proxy"}
    assert not frame.duplicated(["req_id", "part", "stage", "node", "t_start_ns"]).any()
    # every span the proxy holds, and maybe a prefill's http_send that ended after the prefill answered (its /send
    # answer comes one loop turn after its notify, which the prefill does not wait for)
    held = {tuple(s[:5]) for s in spans}
    collected = {tuple(row) for row in frame[["req_id", "part", "stage", "node", "t_start_ns"]].values.tolist()}
    assert held <= collected and {key[2] for key in collected - held} <= {"http_send"}, collected - held


def _start_proxy(prefills: list[str], decodes: list[str], *options: str) -> tuple[subprocess.Popen, str]:
    """``python -m epd_lab.servers.proxy`` as a process, with more `options`; (process, URL)."""
    cmd = [sys.executable, "-m", "epd_lab.servers.proxy", "--port", "0", "--prefill", ",".join(prefills),
           "--decode", ",".join(decodes), "--timeout", str(TIMEOUT), *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)  # noqa: PLW1509
    return proc, json.loads(read_line(proc, 30, "the proxy printed its URL"))["url"]


def test_no_reachable_decode_aborts_the_prefilled_request(cluster: Cluster) -> None:
    """A proxy whose only decode is dead: the client gets 503, and the prefill that served the request frees
    its KV at once (the proxy's abort), not after its 30 s free timeout."""
    with socket.socket() as dead:  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        proc, url = _start_proxy(cluster.prefill_urls, [f"http://127.0.0.1:{dead.getsockname()[1]}"])
        try:
            aborted_before = _aborts(cluster)
            with pytest.raises(openai.InternalServerError, match="no decode server is reachable") as info:
                chat(url, _messages("nobody decodes me", [(224, 224)], seed=5), MAX_TOKENS, timeout=30)
            assert info.value.status_code == 503
            assert _aborts(cluster) == aborted_before + 1
            assert 'epd_lab:proxy_prefill_aborts_total{result="freed"} 1' in plain_metrics(httpx.get(url + "/metrics").text)
        finally:
            proc.terminate()
            proc.wait(10)
            proc.stdout.close()
    # blocks_back: that prefill's pool is whole again within SLACK


def test_streaming_client_disconnect_releases_prefill_and_decode(cluster: Cluster, client: openai.OpenAI) -> None:
    def cancelled() -> int:
        return sum(_health(u)["counters"].get("requests_cancelled", 0) for u in cluster.decode_urls)

    before = cancelled()
    stream = client.chat.completions.create(model=MODEL_ID, messages=_messages("go on", [], seed=0), max_tokens=3000,
                                            temperature=0, stream=True)
    chunks = iter(stream)
    for _ in range(4):
        next(chunks)
    assert sum(_health(u)["active_requests"] for u in cluster.decode_urls) == 1
    stream.close()
    wait_for(lambda: cancelled() == before + 1, SLACK, "the decode did not drop the request")
    wait_for(lambda: metric(metrics(cluster.proxy_url), 'epd_lab:proxy_streams_aborted_total{reason="client_disconnect"}', None) == 1, SLACK,
          "the proxy did not count the disconnect")
    # blocks_back: no blocks held and nothing generating on any prefill or decode


def _leave_while_prefills_are_frozen(cluster: Cluster, body: bytes) -> None:
    """Send `body` to the proxy with every prefill frozen, hang up once a prefill holds it, thaw them."""
    host, port = cluster.proxy_url.removeprefix("http://").split(":")
    for proc in cluster.procs[PREFILLS]:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: sum(metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_inflight{{role="prefill",url="{u}"}}', None)
                              for u in cluster.prefill_urls) == 1, SLACK, "the request never reached a prefill")
    finally:  # thawed well within the proxy's idle timeout, which would otherwise fail the prefill call
        for proc in cluster.procs[PREFILLS]:
            os.kill(proc.pid, signal.SIGCONT)


def test_client_gone_before_decode_began_is_aborted(cluster: Cluster) -> None:
    """A request that is not streamed (decode is asked after prefill): both prefills frozen while the proxy waits
    on one; the client hangs up; the prefills thaw: the proxy sees the client gone before it calls decode, answers
    499 into the void and aborts the request on its prefill."""
    body = json.dumps({"model": MODEL_ID, "messages": _messages("leaving", [], seed=1), "max_tokens": MAX_TOKENS,
                       "stream": False}).encode()
    aborted_before, served_before = _aborts(cluster), _served(cluster)[1]
    status_before = metric(metrics(cluster.proxy_url), 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="499"}', None) or 0
    _leave_while_prefills_are_frozen(cluster, body)
    wait_for(lambda: _aborts(cluster) == aborted_before + 1, SLACK, "the prefill never got the abort")
    assert metric(metrics(cluster.proxy_url), 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="499"}', None) == status_before + 1
    assert _served(cluster)[1] == served_before  # no decode was asked


def test_streamed_client_gone_while_prefill_runs_releases_both(cluster: Cluster) -> None:
    """A streamed request asks decode while prefill runs (pipelined). The client hangs up during the prefill:
    the proxy answers 499 into the void and drops the decode request it had started; whether the KV had already
    moved to decode or still waited on the prefill, every block on both sides comes back (`blocks_back`)."""
    body = json.dumps({"model": MODEL_ID, "messages": _messages("leaving too", [], seed=2), "max_tokens": MAX_TOKENS,
                       "stream": True}).encode()
    status_before = metric(metrics(cluster.proxy_url), 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="499"}', None) or 0
    _leave_while_prefills_are_frozen(cluster, body)
    wait_for(lambda: metric(metrics(cluster.proxy_url), 'epd_lab:proxy_requests_total{route="/v1/chat/completions",status="499"}', None)
          == status_before + 1, SLACK, "the proxy did not answer 499")


def _concurrently(client: openai.OpenAI, n: int, text: str) -> list[concurrent.futures.Future]:
    pool = concurrent.futures.ThreadPoolExecutor(n)
    futures = [pool.submit(chat, cluster.proxy_url, _messages(f"{text} {i}", [(128, 96)], seed=i), MAX_TOKENS) for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def _stalls(cluster: Cluster, role: str, url: str) -> float:
    return metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_stalls_total{{role="{role}",url="{url}"}}', None) or 0


def test_frozen_then_killed_decode(cluster: Cluster, client: openai.OpenAI, model: Any) -> None:
    """Decode 1 frozen (SIGSTOP): round robin sends one of two concurrent requests to it. Its /health probes go
    unanswered, so the proxy finds it stalled within seconds, takes the request back (decode 1 never read it) and
    gives it to decode 0: both clients get the monolithic answer, before the proxy's timeout would have cut one,
    and no prefill KV is aborted. Then decode 1 is killed: the proxy marks it down and decode 0 serves everything."""
    victim, victim_url = cluster.procs[DECODES][1], cluster.decode_urls[1]
    aborted_before, stalls_before = _aborts(cluster), _stalls(cluster, "decode", victim_url)
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        messages = [_messages(f"frozen {i}", [(128, 96)], seed=i) for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda m: chat(cluster.proxy_url, m, MAX_TOKENS)[1], messages))
        assert time.monotonic() - start < TIMEOUT + SLACK
        assert answers == [monolithic_chat(model, m, MAX_TOKENS) for m in messages]
        assert _stalls(cluster, "decode", victim_url) == stalls_before + 1
        assert metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_up{{role="decode",url="{victim_url}"}}', None) == 0
        assert _aborts(cluster) == aborted_before  # the KV went to decode 0: nothing to abort
    finally:
        victim.kill()  # SIGKILL ends a stopped process too
        victim.wait(10)
    messages = [_messages(f"after {i}", [], seed=i) for i in range(3)]
    assert [chat(cluster.proxy_url, m, MAX_TOKENS)[1] for m in messages] == [monolithic_chat(model, m, MAX_TOKENS) for m in messages]
    health = httpx.get(cluster.proxy_url + "/health", timeout=10).json()  # probes, so marks it down now
    assert health["status"] == "ok" and [e["healthy"] for e in health["decode"]] == [True, False]
    assert metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_up{{role="decode",url="{victim_url}"}}', None) == 0


def test_frozen_prefill_is_passed_over_and_drops_the_request_on_waking(cluster: Cluster, client: openai.OpenAI,
                                                                      model: Any) -> None:
    """Prefill 1 frozen with a request on it: the proxy finds it stalled, gives the request to prefill 0 (answered
    as the monolithic model does, before the proxy's timeout) and keeps telling prefill 1 to drop it. Thawed,
    prefill 1 hears the abort (or finds the request's client gone) and holds no KV for it (`blocks_back`)."""
    victim, victim_url = cluster.procs[PREFILLS][1], cluster.prefill_urls[1]
    inflight = f'epd_lab:proxy_backend_inflight{{role="prefill",url="{victim_url}"}}'
    stalls_before = _stalls(cluster, "prefill", victim_url)
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        messages = [_messages(f"passed over {i}", [(96, 64)], seed=i) for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(chat, cluster.proxy_url, m, MAX_TOKENS) for m in messages]
            wait_for(lambda: metric(metrics(cluster.proxy_url), inflight, None) == 1 or all(f.done() for f in futures), SLACK,
                  "no request reached the frozen prefill")
            answers = [f.result(TIMEOUT + SLACK)[1] for f in futures]
        assert time.monotonic() - start < TIMEOUT + SLACK
        assert answers == [monolithic_chat(model, m, MAX_TOKENS) for m in messages]
        assert _stalls(cluster, "prefill", victim_url) == stalls_before + 1
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    wait_for(lambda: metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_up{{role="prefill",url="{victim_url}"}}', None) == 1, SLACK,
          "the thawed prefill was not taken back")
    # blocks_back: prefill 1 holds nothing for the request it was passed over for


def test_killed_prefill_passes_its_request_on_or_is_a_502_when_alone(cluster: Cluster, client: openai.OpenAI,
                                                                     model: Any) -> None:
    """Prefill 1 frozen, then killed once a request is on it from the cluster's proxy and one from a second proxy
    whose only prefill it is. The cluster's proxy sees the connection closed unanswered, marks prefill 1 down and
    passes the request to prefill 0: both its clients get the monolithic answer, the retry is counted, and every
    request after is served by prefill 0. The lone proxy has no other prefill: its client (streamed, pipelined:
    the serial way finds no other prefill either) gets a 502 naming the closed connection (not the timeout's
    504), and the abort it sends the dead prefill finds nobody."""
    victim, victim_url = cluster.procs[PREFILLS][1], cluster.prefill_urls[1]
    inflight = f'epd_lab:proxy_backend_inflight{{role="prefill",url="{victim_url}"}}'
    retried = 'epd_lab:proxy_retries_total{reason="disconnected",role="prefill"}'  # labels in name order
    lone, lone_url = _start_proxy([victim_url], cluster.decode_urls, "--pipelined")
    try:
        retried_before = metric(metrics(cluster.proxy_url), retried, None) or 0
        health = httpx.get(lone_url + "/health", timeout=10).json()  # probes: the lone proxy learns the kv_url
        assert health["prefill"][0]["health"]["kv_url"]  # so its streamed request goes the pipelined way
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            messages = [_messages(f"doomed {i}", [(128, 96)], seed=i) for i in range(2)]
            os.kill(victim.pid, signal.SIGSTOP)
            try:  # round robin sends one of the two to prefill 1; the lone proxy has only it
                futures = [pool.submit(chat, cluster.proxy_url, m, MAX_TOKENS) for m in messages]
                alone = pool.submit(chat, lone_url, _messages("alone", [], seed=7), MAX_TOKENS, stream=True)
                wait_for(lambda: metric(metrics(cluster.proxy_url), inflight, None) == 1
                         and metric(metrics(lone_url), inflight, None) == 1, SLACK,
                         "no request reached the frozen prefill")
            finally:
                victim.kill()  # SIGKILL ends a stopped process too
                victim.wait(10)
            answers = [f.result(60)[1] for f in futures]
            error = alone.exception(TIMEOUT + SLACK)  # bounded: the proxy's own timeout would give a 504
        assert answers == [monolithic_chat(model, m, MAX_TOKENS) for m in messages]
        assert metric(metrics(cluster.proxy_url), retried, None) == retried_before + 1
        assert metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_up{{role="prefill",url="{victim_url}"}}', None) == 0
        assert isinstance(error, openai.InternalServerError) and error.status_code == 502, error
        assert f"prefill {victim_url} closed the connection before answering" in str(error)
        assert metric(metrics(lone_url), retried, None) == 1  # passed on, with no prefill left to take it
        wait_for(lambda: metric(metrics(lone_url), 'epd_lab:proxy_prefill_aborts_total{result="unreachable"}', None) == 1,
                 SLACK, "the lone proxy sent the dead prefill no abort")
    finally:
        lone.terminate()
        lone.wait(10)
        lone.stdout.close()
    messages = [_messages(f"one prefill left {i}", [(100, 100)] * (i % 2), seed=i) for i in range(3)]
    assert [chat(cluster.proxy_url, m, MAX_TOKENS)[1] for m in messages] == [monolithic_chat(model, m, MAX_TOKENS) for m in messages]
    health = httpx.get(cluster.proxy_url + "/health", timeout=10).json()  # probes, so marks it down now
    assert health["status"] == "ok" and [e["healthy"] for e in health["prefill"]] == [True, False]
    assert metric(metrics(cluster.proxy_url), f'epd_lab:proxy_backend_up{{role="prefill",url="{victim_url}"}}', None) == 0
