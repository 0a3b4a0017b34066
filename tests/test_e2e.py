"""The full E→P→D path through real processes: 2 encoders, a prefill server, a decode server and the
OpenAI-compatible proxy, driven by the official `openai` client. Answers equal the monolithic model's."""
from __future__ import annotations

import base64

import httpx
import openai
import pytest

from epd_lab.launch import Cluster, Topology
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.reference import monolithic_chat
from helpers import wait_for

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster():
    with Cluster(Topology(encoders=2, prefills=1, decodes=1, proxy=True, timeout=20)) as c:
        yield c


@pytest.mark.parametrize("n_images", [0, 1, 3])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_through_the_proxy_equals_the_monolithic_model(cluster, model, n_images, stream):
    sizes = [(224, 224), (100, 333), (500, 260)][:n_images]
    content = [{"type": "image_url", "image_url": {"url": data_uri(random_png(n_images * 10 + i, (h, w)))}}
               for i, (w, h) in enumerate(sizes)] + [{"type": "text", "text": "what do you see?"}]
    messages = [{"role": "user", "content": content}]
    client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL_ID, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        reply = client.chat.completions.create(**kwargs)
        text = reply.choices[0].message.content
        assert reply.usage.completion_tokens == MAX_TOKENS
    assert text == monolithic_chat(model, messages, MAX_TOKENS)
    # every block is back in both pools once the request is over (prefill frees right after TRANS_DONE)
    for url in (*cluster.prefill_urls, *cluster.decode_urls):
        health = f"{url}/health"
        wait_for(lambda: httpx.get(health, timeout=10).json()["used_blocks"] == 0, 10,
                 lambda: f"every KV block back: {httpx.get(health, timeout=10).json()}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_seeded_sampled_chat_equals_the_monolithic_model_s_draws(cluster, model, stream):
    """Prefill draws token 0 and decode the rest with the request's seed (`epd_lab.models.sampling`): the split
    answers what HF's `generate` with the same sampler draws, and another seed answers something else."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(random_png(5, (128, 96)))}},
                                             {"type": "text", "text": "tell me a story"}]}]
    client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = []
    for seed in (1234, 99):
        kwargs = dict(model="x", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            texts.append(client.chat.completions.create(**kwargs).choices[0].message.content)
        assert texts[-1] == monolithic_chat(model, messages, MAX_TOKENS, temperature=1.0, seed=seed), seed
    assert texts[0] != texts[1]
    assert texts[0] != monolithic_chat(model, messages, MAX_TOKENS)  # not the greedy answer


def test_bad_image_is_a_400_through_the_proxy(cluster):
    client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=60)
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}},
           {"type": "text", "text": "hi"}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": bad}], max_tokens=4)
