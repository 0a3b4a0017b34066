"""Overload without turning users away, through real processes: the proxy, encoders, prefills and
decodes of `epd_lab.launch.Cluster`, driven by the campaign's streaming chat client.

- A burst of 200 concurrent streamed chats is queued and served in full on 1E/1P/1D and 2E/2P/2D, every answer
  equal to its solo answer (the fixed caps of before refused most of it).
- A 50 MB prompt is refused by the proxy with 400 before it travels; sent straight to a prefill it is refused
  there too without holding the process; meanwhile other chats are served and no replica is found stalled.
- A burst far past what its deadline allows is refused at once, each refusal stating the predicted wait, and
  what is admitted is served with the right answer; on a fresh cluster (the prefill's rate still its prior) the
  proxy plans at a share of that prior.

Behaviour only: the speeds (refusal latency, the 1,000-request burst, RSS) and who refuses a second 1,000-burst
(a property that moves with the host's load) are `epd-lab bench overload`'s, in ``data/bench/overload*.json``.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from epd_lab.campaign.client import chat, client_session, judge
from epd_lab.campaign.load import run_topology
from epd_lab.campaign.overload import burst_with_deadline
from epd_lab.campaign.prompts import Prompts
from epd_lab.launch import Cluster, Topology
from epd_lab.servers.proxy import PRIOR_RATE_SHARE
from epd_lab.serving import DEADLINE_HEADER
from helpers import plain_metrics

pytestmark = pytest.mark.timeout(300)

BIG_CHARS = 50_000_000  # a 50 MB chat message, under the 64 MiB body limit
HANG_GUARD_S = 5.0  # bounded-time checks only (the speed figures live in the benchmark)


def metric(text: str, prefix: str) -> float:
    """The sum of the samples of `text` (Prometheus exposition) whose name-and-labels start with `prefix`."""
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("topology", ["1E1P1D", "2E2P2D"])
def test_a_burst_of_200_streamed_chats_is_queued_and_served(topology):
    run = run_topology(topology, count=200, concurrency=200, seed=5, time_budget_s=240.0, timeout=10.0,
                       max_tokens=8, image_size=224, progress=lambda _: None)
    kinds = run["counts"]
    right = sum(r["matches"] is True for r in run["requests"])
    refusals = sorted({r["error"][:200] for r in run["requests"] if r["kind"] == "refused"})
    assert right >= 198, (kinds, refusals[:3])  # >= 99% served, each with its solo answer
    assert kinds.get("ok", 0) + kinds.get("refused", 0) == 200, kinds  # nothing lost: errors, timeouts
    assert not any(r["matches"] is False for r in run["requests"])
    assert all(t["passed"] for t in run["targets"] if "solo" in t["target"] or "idle" in t["target"]), run["targets"]
    proxy = run["refusals"]["proxy"]
    assert sum(proxy.values()) == kinds.get("refused", 0)  # every refusal counted, by its reason


def test_a_50_mb_prompt_is_refused_before_it_travels_and_stalls_nobody(tmp_path):
    prompts = Prompts(3, count=4, image_size=112, max_tokens=6)
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True), log_dir=str(tmp_path)) as cluster:
        proxy, prefill = cluster.proxy_url, cluster.prefill_urls[0]
        asyncio.run(prompts.compute_solo(proxy, 60.0))
        assert all(prompts.solo)
        health = httpx.get(proxy + "/health", timeout=10).json()  # the proxy learns the prefills' limit
        limit = health["prefill"][0]["health"]["max_prompt_tokens"]
        assert limit == 4095  # the tiny model's max_position_embeddings, less the token to generate
        before = plain_metrics(httpx.get(prefill + "/metrics", timeout=10).text)

        stop, outcomes, errors = threading.Event(), [], []

        def chatter(k: int) -> None:  # other connections keep chatting throughout
            async def go() -> None:
                async with client_session(1) as session:
                    i = 0
                    while not stop.is_set() or i < 2:
                        p = (k + i) % prompts.count
                        outcomes.append(await chat(session, proxy, prompts.body(p), 60.0, index=i, prompt=p))
                        i += 1
            try:
                asyncio.run(go())
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=chatter, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            body = json.dumps({"model": "m", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "x" * BIG_CHARS}]}).encode()
            r = httpx.post(proxy + "/v1/chat/completions", content=body, timeout=HANG_GUARD_S,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and f"at most {limit}" in error["message"]
            # a prefill sent one straight (another client, no proxy): refused without building 50 M ids, and
            # answering its probes meanwhile
            direct = json.dumps({"request_id": "big", "prompt": "y" * BIG_CHARS,
                                 "kv_transfer_params": {"do_remote_decode": True}}).encode()
            r = httpx.post(prefill + "/v1/prefill", content=direct, timeout=HANG_GUARD_S,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and "this model takes at most 4095" in r.json()["detail"]
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert not errors
        judge(outcomes, prompts.solo)
        assert outcomes and all(o.kind == "ok" and o.matches for o in outcomes), [o.record() for o in outcomes]
        metrics = plain_metrics(httpx.get(proxy + "/metrics", timeout=10).text)
        assert metric(metrics, "epd_lab:proxy_backend_stalls_total{") == 0  # busy, never taken for frozen
        assert metric(metrics, "epd_lab:proxy_backend_up{") == 2  # its prefill and its decode
        assert metric(metrics, 'epd_lab:proxy_refused_total{reason="context_length_exceeded"}') == 1
        after = plain_metrics(httpx.get(prefill + "/metrics", timeout=10).text)
        key = 'epd_lab:prefill_requests_total{route="/v1/prefill",status="400"}'
        assert metric(after, key) == metric(before, key) + 1  # only the direct one: the proxy forwarded nothing


def test_a_burst_far_past_its_deadline_is_refused_at_once_with_the_predicted_wait(tmp_path):
    prompts = Prompts(4, count=4, image_size=224, max_tokens=8)
    deadline_s, count = 3.0, 300
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True), log_dir=str(tmp_path)) as cluster:
        proxy = cluster.proxy_url
        asyncio.run(prompts.compute_solo(proxy, 60.0))
        assert all(prompts.solo)
        health = httpx.get(proxy + "/health", timeout=10).json()  # the proxy has the prefill's rate now
        told = health["prefill"][0]["health"]["admission"]
        assert told["rate_per_s"] > 0
        # served one at a time so far, the prefill's rate is its prior: the proxy plans below it, so that a host
        # slower than the guess has the proxy refuse at once, not the prefill seconds later
        assert told["loaded_measured"] is False
        planned = metric(plain_metrics(httpx.get(proxy + "/metrics", timeout=10).text), "epd_lab:proxy_planned_rate_per_second ")
        assert planned == pytest.approx(PRIOR_RATE_SHARE * told["rate_per_s"], rel=1e-4)
        raws = [json.dumps(prompts.body(p)).encode() for p in range(prompts.count)]
        outcomes = asyncio.run(burst_with_deadline(proxy, prompts, count, deadline_s, 60.0))
        judge(outcomes, prompts.solo)
        refused = [o for o in outcomes if o.kind == "refused"]
        served = [o for o in outcomes if o.kind == "ok"]
        assert len(refused) + len(served) == count, {o.kind for o in outcomes}  # no error, no timeout
        assert refused and served  # far past the deadline: some refused, and what fits is served ...
        assert all(o.matches for o in served)  # ... with the right answer
        # refused at once on the prediction (never left to wait out the deadline in a queue), saying the wait
        assert all(o.clear and "predicted wait" in o.error and "does not fit" in o.error for o in refused), \
            (len(served), sum("passed while" in o.error for o in refused), sorted({o.error[:100] for o in refused})[:3])
        assert all(o.latency_s < deadline_s for o in refused), max(o.latency_s for o in refused)
        # judged from the headers, before routing: a deadline nothing fits is 503 with Retry-After, one that is not
        # a number 400, each an OpenAI error object
        for value, status in (("1", 503), ("soon", 400)):
            r = httpx.post(proxy + "/v1/chat/completions", content=raws[0], timeout=HANG_GUARD_S,
                           headers={"content-type": "application/json", DEADLINE_HEADER: value})
            assert r.status_code == status, r.text
            assert (status == 503) == ("retry-after" in r.headers), r.headers
            error = r.json()["error"]
            assert error["code"] == ("overloaded_deadline" if status == 503 else "invalid_request")
            assert ("predicted wait" if status == 503 else DEADLINE_HEADER) in error["message"]
        metrics = plain_metrics(httpx.get(proxy + "/metrics", timeout=10).text)
        assert metric(metrics, "epd_lab:proxy_refused_total{") == len(refused) + 1
        assert metric(metrics, "epd_lab:proxy_pending ") == 0
        prefill = plain_metrics(httpx.get(cluster.prefill_urls[0] + "/metrics", timeout=10).text)
        assert metric(prefill, "epd_lab:prefill_admitted ") == 0 and metric(prefill, "epd_lab:prefill_queue_length ") == 0
