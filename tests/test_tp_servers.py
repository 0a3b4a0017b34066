"""Prefill and decode as TP groups through the servers: `epd-lab launch`'s topology with ``tp=2`` (rank 0 each
server, rank 1 a process it started) and decodes of TP 1 and 2, each rank of which asks every prefill rank's side
channel. The answers equal the in-process reference of the same TP sizes (`servers.tp_groups.run_pd`), the ports
follow seed 003's formula, and a rank that dies takes its role out of service at once (/health 503, requests
failed), with rank 0's blocks back in the pool."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from epd_lab.launch import Cluster, Topology
from epd_lab.noise import noise_images
from epd_lab.servers.tp_groups import PDCase, run_pd
from helpers import free_port, metric, plain_metrics, wait_for

PROMPT, SIZES, N_TOKENS = "compare these", ((224, 224),), 6


@pytest.fixture(scope="module")
def image() -> str:
    """The reference case's image as a PNG the encoders may read (lossless: the same pixels)."""
    path = Path(tempfile.mkdtemp(prefix="epd-tp-servers-")) / "noise.png"
    noise_images(SIZES, len(PROMPT))[0].save(path)
    return str(path)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """Greedy tokens of the in-process P tp 2 → D tp 1 and D tp 2 runs (the fast runtime, float32, tiny), by the
    decode's TP size."""
    result = run_pd(PDCase(prompt=PROMPT, image_sizes=SIZES, max_new_tokens=N_TOKENS), 2, [1, 2])
    assert all(rank["kv_equal"] for ranks in result.decode.values() for rank in ranks)
    return {d: ranks[0]["tokens"] for d, ranks in result.decode.items()}


@pytest.fixture(scope="module")
def cluster():
    """One encoder TP 2 (the reference encodes with the prefill group's TP 2 tower), one prefill TP 2, decode0 TP 1
    and decode1 TP 2, and the proxy."""
    with Cluster(Topology(encoders=1, prefills=1, decodes=2, proxy=True, tp=2, dtype="float32", timeout=10.0,
                          settings={"decode1": {"tp": 2}})) as c:
        yield c


def _prefill(http: httpx.Client, url: str, rid: str, image: str) -> httpx.Response:
    return http.post(url + "/v1/prefill", json={"request_id": rid, "prompt": PROMPT, "images": [image],
                                                "kv_transfer_params": {"do_remote_decode": True}})


def _decode(http: httpx.Client, url: str, rid: str, kv: dict) -> httpx.Response:
    return http.post(url + "/v1/decode", json={"request_id": rid, "max_tokens": N_TOKENS, "kv_transfer_params": kv})


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_prefill_tp2_to_decode_through_the_servers_equals_the_reference(cluster, image, reference, decode_tp):
    """The prefill's answer names both ranks' side channels; decode's tokens (TP 1, or TP 2 whose ranks each took
    their heads) equal the in-process reference's of the same sizes; rank 1's forward shows as its own span; every
    block of both roles' rank 0 is back once the request ended."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[decode_tp - 1]
    rid = f"tp-serial-{decode_tp}"
    with httpx.Client(timeout=60) as http:
        health = http.get(prefill + "/health").json()
        assert health["tp"] == 2 and len(health["kv_urls"]) == 2 and health["kv_urls"][0] == health["kv_url"]
        assert http.get(decode + "/health").json()["tp"] == decode_tp
        r = _prefill(http, prefill, rid, image)
        assert r.status_code == 200, r.text
        kv = r.json()["kv_transfer_params"]
        assert kv["remote_urls"] == health["kv_urls"]
        assert any(s[3].endswith("/rank1") for s in r.json()["spans"] if s[2] == "prefill")
        out = _decode(http, decode, rid, kv)
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == reference[decode_tp]
        for url in (prefill, decode):
            wait_for(lambda: http.get(url + "/health").json()["used_blocks"] == 0, 10, "rank 0's blocks back")


def test_pipelined_decode_asks_every_rank_before_prefill_answers(cluster, image, reference):
    """Decode (TP 2) gets only the side channels (as the proxy sends them while prefill runs): it learns the
    prompt's size from rank 0, each of its ranks asks both prefill ranks, and its tokens equal the reference's."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[1]
    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        urls = http.get(prefill + "/health").json()["kv_urls"]
        decoded = pool.submit(_decode, http, decode, "tp-piped",
                              {"remote_url": urls[0], "remote_urls": urls, "remote_request_id": "tp-piped"})
        time.sleep(0.3)
        assert not decoded.done()
        assert _prefill(http, prefill, "tp-piped", image).status_code == 200
        out = decoded.result(60)
    assert out.status_code == 200, out.text
    assert out.json()["tokens"] == reference[2]


def test_the_proxy_serves_through_the_tp_group(cluster, image):
    """A chat request through the proxy (whichever decode it picks), serial and pipelined (streamed), gets the
    same answer."""
    body = {"model": "tiny", "max_tokens": N_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": PROMPT}]}]}
    with httpx.Client(timeout=60) as http:
        plain = http.post(cluster.proxy_url + "/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        text = plain.json()["choices"][0]["message"]["content"]
        with http.stream("POST", cluster.proxy_url + "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            streamed = "".join(_deltas(s.iter_lines()))
    assert streamed == text and text


def _deltas(lines) -> list[str]:
    import json

    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            out.append(choice.get("delta", {}).get("content") or "")
    return out


def test_seed_ports_of_two_prefill_tp2_replicas():
    """Prefill i is DP rank i: rank r of it listens on base + i * 2 + r, read from the processes themselves."""
    base = free_port()
    while any(c.laddr.port in range(base, base + 4) for c in psutil.net_connections("tcp")):
        base = free_port()
    topology = Topology(encoders=1, prefills=2, tp=1, dtype="float32", timeout=10.0,
                        settings={"prefill": {"tp": 2, "side_channel_base": base}})
    with Cluster(topology) as c, httpx.Client(timeout=30) as http:
        for i, url in enumerate(c.prefill_urls):
            ports = [int(u.rsplit(":", 1)[1]) for u in http.get(url + "/health").json()["kv_urls"]]
            assert ports == [base + i * 2, base + i * 2 + 1]
            rank1 = _rank1(c, c.topology.encoders + i, "epd_lab.servers.prefill_tp")
            assert base + i * 2 + 1 in {x.laddr.port for x in rank1.net_connections("tcp")
                                        if x.status == psutil.CONN_LISTEN}


def _rank1(cluster: Cluster, index: int, module: str) -> psutil.Process:
    server = psutil.Process(cluster.procs[index].pid)
    return next(p for p in server.children() if module in " ".join(p.cmdline()))


def test_a_dead_rank_takes_its_role_out_of_service(image):
    """Rank 1 of prefill, then of decode, killed: each role's /health answers 503 naming it and its next request
    fails with 502 well within the role's timeout (no collective waits on the dead rank); every block of rank 0
    comes back."""
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, dtype="float32", timeout=5.0,
                          settings={"prefill": {"tp": 2, "kv_free_timeout": 1.0}, "decode": {"tp": 2}})) as c, \
            httpx.Client(timeout=30) as http:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        kv = _prefill(http, prefill, "before", image).json()["kv_transfer_params"]
        assert _decode(http, decode, "before", kv).status_code == 200
        for url, index, role in ((decode, 2, "decode"), (prefill, 1, "prefill")):
            module = f"epd_lab.servers.{role}_tp"
            os.kill(_rank1(c, index, module).pid, signal.SIGKILL)
            wait_for(lambda: http.get(url + "/health").status_code == 503, 10, f"{module}'s role's /health to fail")
            assert "TP rank(s) [1] dead" in http.get(url + "/health").text
            assert metric(plain_metrics(http.get(url + "/metrics").text), f"epd_lab:{role}_tp_dead_ranks") == 1
        t0 = time.monotonic()
        r = _prefill(http, prefill, "after", image)
        assert r.status_code == 502 and "dead" in r.json()["detail"], r.text
        r = _decode(http, decode, "after", kv)
        assert r.status_code == 502 and "dead" in r.json()["detail"], r.text
        assert time.monotonic() - t0 < 5.0
        for url in (prefill, decode):
            wait_for(lambda: http.get(url + "/health").json()["used_blocks"] == 0, 10, "rank 0's blocks back")
