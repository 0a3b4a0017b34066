"""A prefill that freezes or dies in the middle of writing a request's KV into decode: the client's error comes
within the request's deadline (the proxy's ``--timeout``, counted from when the proxy took the request), and
decode's blocks all come back (before, decode waited a whole ``--timeout`` from its own ask).

Through real processes: 1 encoder, 2 prefills, 1 decode and the proxy (`Cluster`), started with
``EPD_FAILPOINTS=@<dir>`` so that each prefill can be stopped at ``prefill.kv_write`` (the producer has decode's
metadata and starts the batch write). The first is kept frozen, the second killed once stopped.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from epd_lab.failpoints import arm, disarm, is_stopped
from epd_lab.launch import Cluster, Topology
from epd_lab.servers.openai_api import MODEL_ID
from helpers import wait_for

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 4.0  # the request's deadline (the proxy's --timeout) and every role's timeout
# what the client may see past the deadline: its own connection and reading (decode gives up 0.2 s before it,
# `KV_ANSWER_S`, as its ask went out early in the request's life, far more than `KV_ASK_FLOOR_S` before that)
MARGIN = 0.25
QUARANTINE = 1.0  # decode's --kv-quarantine: a frozen producer may still write into the blocks it was given
PREFILLS, DECODE = slice(1, 3), 3  # Cluster.procs: encoder, prefills, decode, proxy


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    fp_dir = str(tmp_path_factory.mktemp("failpoints"))
    old = os.environ.get("EPD_FAILPOINTS")
    os.environ["EPD_FAILPOINTS"] = "@" + fp_dir  # inherited by the processes; armed per pid below
    try:
        topology = Topology(encoders=1, prefills=2, decodes=1, proxy=True, timeout=TIMEOUT,
                            settings={"decode": {"kv_quarantine": QUARANTINE}})
        with Cluster(topology) as c:
            yield c, fp_dir
    finally:
        if old is None:
            os.environ.pop("EPD_FAILPOINTS", None)
        else:
            os.environ["EPD_FAILPOINTS"] = old


def _decode_health(c: Cluster) -> dict[str, Any]:
    return httpx.get(c.decode_urls[0] + "/health", timeout=5).json()


def _chat(c: Cluster, text: str) -> tuple[httpx.Response, float]:
    """One non-streaming chat through the proxy: (its response, seconds from sending to its end)."""
    body = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    t0 = time.monotonic()
    response = httpx.post(c.proxy_url + "/v1/chat/completions", json=body, timeout=3 * TIMEOUT)
    return response, time.monotonic() - t0


def _stopped(procs: list[Any], timeout: float) -> Any:
    """The first of `procs` to stop itself at its failpoint within `timeout` s, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if is_stopped(proc.pid):
                return proc
        time.sleep(0.005)
    return None


@pytest.mark.parametrize("fault", ["freeze", "kill"])  # in this order: the kill leg takes the prefill left
def test_a_prefill_lost_mid_kv_write_fails_its_request_within_the_deadline(
        cluster: tuple[Cluster, str], fault: str) -> None:
    """The prefill serving a request stops as it starts writing the KV into decode, and stays frozen (or is
    killed then): the client's 504 comes within the deadline + `MARGIN` from its sending, decode counts one
    KV timeout and has every block free again after its quarantine, and no process hangs."""
    c, fp_dir = cluster
    live = [p for p in c.procs[PREFILLS] if p.poll() is None]
    assert _chat(c, f"warm up before the {fault}")[0].status_code == 200  # the copy path calibrated
    health = wait_for(lambda: (h := _decode_health(c))["free_blocks"] == h["num_blocks"] and h, 5.0,
                      "decode's blocks were not all free before the fault")
    timeouts = health["counters"].get("kv_timeouts", 0)
    for prefill in live:  # whichever the proxy picks stops as it starts writing the KV
        arm(fp_dir, prefill.pid, "prefill.kv_write")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(_chat, c, f"lost in the {fault}")
        victim = _stopped(live, 2 * TIMEOUT)
        if victim is not None and fault == "kill":
            victim.kill()  # dead mid-transfer, as on a lost node: the producer never answers
        response, elapsed = sent.result(3 * TIMEOUT)
    for prefill in live:
        disarm(fp_dir, prefill.pid)  # the other's arming, unused
    try:
        assert victim is not None, "no prefill stopped at its KV write"
        assert response.status_code == 504, response.text
        assert "within the request's deadline" in response.json()["error"]["message"]
        # within the deadline counted from the request's start (not a whole --timeout after decode asked)
        assert elapsed < TIMEOUT + MARGIN, f"{elapsed:.3f} s"
        # decode gave up on the producer once, and its blocks are all back after the quarantine
        health = wait_for(lambda: (h := _decode_health(c))["free_blocks"] == h["num_blocks"] and h,
                          QUARANTINE + 5.0, "decode did not get its blocks back")
        assert health["counters"]["kv_timeouts"] == timeouts + 1
        assert health["quarantined_blocks"] == 0 and health["reserved_blocks"] == 0
        assert health["active_requests"] == 0 and c.procs[DECODE].poll() is None
    finally:
        if victim is not None:  # a frozen one, woken, would write into blocks decode no longer holds for it
            victim.kill()
            victim.wait(10)
