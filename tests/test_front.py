"""Monolithic replicas behind the round-robin front (`epd_lab.servers.front`), through real processes on the CPU
with the tiny model: answers equal the monolithic model's, both replicas serve, a dead replica is skipped and two
dead ones are a clear 503. And the per-process settings a `Topology` writes on each command line."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from epd_lab.launch import Cluster, Topology
from epd_lab.models import build_input_ids, monolithic_generate
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.front import FrontSettings
from epd_lab.servers.monolithic import MonolithicSettings
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.reference import monolithic_chat
from epd_lab.servers.text import completion_prompt, detokenize
from epd_lab.serving import from_argv
from helpers import chat, plain_metrics

MAX_TOKENS = 8
CHAT_OK = re.compile(r'^epd_lab:monolithic_requests_total\{route="/v1/chat/completions",status="200"\} (\d+)$', re.M)


def _messages(n_images: int, seed: int) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": data_uri(random_png(seed + i, (96, 128)))}}
               for i in range(n_images)] + [{"type": "text", "text": f"what do you see? ({seed})"}]
    return [{"role": "user", "content": content}]


def _chats_served(url: str) -> int:
    """The chat requests a monolithic server answered 200, from its /metrics."""
    return sum(map(int, CHAT_OK.findall(plain_metrics(httpx.get(url + "/metrics", timeout=10).text))))


def test_two_replicas_answer_as_the_monolithic_model_and_both_serve(model):
    with Cluster(Topology(monolithic=True, replicas=2, timeout=20)) as cluster:
        assert len(cluster.monolithic_urls) == 2 and cluster.proxy_url not in cluster.monolithic_urls
        assert cluster.urls() == [*cluster.monolithic_urls, cluster.proxy_url]
        cases = [(n, stream, 10 * i) for i, (n, stream) in enumerate((n, s) for n in (0, 1, 2) for s in (False, True))]
        for n_images, stream, seed in cases:
            messages = _messages(n_images, seed)
            assert chat(cluster.proxy_url, messages, MAX_TOKENS, stream)[1] == monolithic_chat(model, messages, MAX_TOKENS), \
                (n_images, stream)
        served = [_chats_served(url) for url in cluster.monolithic_urls]
        assert served == [3, 3]  # round-robin: every other request
        # text completions too, whole and streamed
        client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=60)
        reference = detokenize(monolithic_generate(model, build_input_ids(completion_prompt("once upon"), []), None,
                                                   None, MAX_TOKENS))
        kwargs = dict(model=MODEL_ID, prompt="once upon", max_tokens=MAX_TOKENS, temperature=0)
        assert client.completions.create(**kwargs).choices[0].text == reference
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == reference
        health = httpx.get(cluster.proxy_url + "/health", timeout=10)
        assert health.status_code == 200 and [r["served"] for r in health.json()["replicas"]] == [4, 4]
        assert "epd_lab:front_backend_served_total" in plain_metrics(httpx.get(cluster.proxy_url + "/metrics", timeout=10).text)
        # a seeded draw: each replica draws what HF's generate draws with the servers' sampler
        messages = _messages(1, 3)
        want = monolithic_chat(model, messages, MAX_TOKENS, temperature=0.8, seed=5)
        for _ in cluster.monolithic_urls:
            sampled = client.chat.completions.create(model="x", messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0.8, seed=5)
            assert sampled.choices[0].message.content == want
        # a replica's own 400 passes through: the image is the client's error
        not_png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm9wZQ=="}}
        bad = [{"role": "user", "content": [not_png, {"type": "text", "text": "hi"}]}]
        with pytest.raises(openai.BadRequestError):
            chat(cluster.proxy_url, bad, MAX_TOKENS, False)[1]


def test_a_killed_replica_is_skipped_and_none_left_is_a_503(model):
    with Cluster(Topology(monolithic=True, replicas=2, timeout=20)) as cluster:
        victim = cluster.procs[0]  # monolithic0
        victim.kill()
        victim.wait(timeout=10)
        for i, stream in enumerate((False, True, False)):
            messages = _messages(1, 100 + i)
            assert chat(cluster.proxy_url, messages, MAX_TOKENS, stream)[1] == monolithic_chat(model, messages, MAX_TOKENS)
        assert _chats_served(cluster.monolithic_urls[1]) == 3
        survivor = cluster.procs[1]
        survivor.kill()
        survivor.wait(timeout=10)
        answer = httpx.post(cluster.proxy_url + "/v1/chat/completions", timeout=60,
                            json={"messages": _messages(0, 7), "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_backend"
        assert httpx.get(cluster.proxy_url + "/health", timeout=10).status_code == 503
        refused = plain_metrics(httpx.get(cluster.proxy_url + "/metrics", timeout=10).text)
        assert 'epd_lab:refusals_total{reason="no_backend"} 1' in refused  # the front's own refusal, counted


def _command_line_only(topology: Topology) -> Cluster:
    cluster = object.__new__(Cluster)  # only its command lines: nothing is started
    cluster.topology, cluster.procs, cluster._ray = topology, [], None  # what close() reads at __del__
    return cluster


def test_a_process_own_settings_reach_its_command_line_over_its_role():
    topology = Topology(monolithic=True, replicas=2, device="cuda:0", timeout=20,
                        settings={"monolithic": {"max_batch": 4}, "monolithic1": {"device": "cuda:1"},
                                  "front": {"policy": "least_loaded"}})
    assert topology.process_names() == ["monolithic0", "monolithic1", "front"]
    cluster = _command_line_only(topology)
    replicas = [from_argv(MonolithicSettings, cluster.command("monolithic", name)[3:])
                for name in ("monolithic0", "monolithic1")]
    assert [(r.device, r.max_batch) for r in replicas] == [("cuda:0", 4), ("cuda:1", 4)]
    front = from_argv(FrontSettings, cluster.command("front", "front", replicas=("http://m:1", "http://m:2"))[3:])
    assert (front.policy, front.timeout, front.replicas) == ("least_loaded", 20, ("http://m:1", "http://m:2"))
    split = _command_line_only(Topology(encoders=2, prefills=1, decodes=1, proxy=True, device="cuda:0",
                                        settings={"encoder1": {"device": "cuda:1"}}))
    assert [c[c.index("--device") + 1] for c in (split.command("encoder", f"encoder{i}") for i in (0, 1))] == \
        ["cuda:0", "cuda:1"]
    assert from_argv(Topology, ["--monolithic", "--replicas", "2", "--settings",
                                'monolithic1={"device": "cuda:1"}']).settings == {"monolithic1": {"device": "cuda:1"}}


def test_a_process_the_topology_does_not_start_is_refused():
    with pytest.raises(ValueError, match="unknown role or process 'monolithic2'.*monolithic0, monolithic1, front"):
        Topology(monolithic=True, replicas=2, settings={"monolithic2": {"device": "cuda:1"}})
    with pytest.raises(ValueError, match="monolithic has no setting kv_block"):
        Topology(monolithic=True, replicas=2, settings={"monolithic1": {"kv_block": 4}})
    with pytest.raises(ValueError, match="set monolithic=True"):
        Topology(replicas=2)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        Topology(monolithic=True, replicas=0)
