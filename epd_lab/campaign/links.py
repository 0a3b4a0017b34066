"""E, P and D on three emulated hosts (`epd_lab.campaign.netns`), so that each link can be shaped on its own while
the roles run: the encoders on host ``e``, whose uplink is the E→P link (the embeddings, and the encoders' small
HTTP replies); the prefills on ``p``; the decodes on ``d``, whose downlink is the P→D link (prefill writes the KV
into decode's blocks; the proxy's requests to decode and the side channel's replies are small). Not prefill's
uplink: it also carries the images prefill sends the encoders. The proxy runs here, on the bridge. Every role
binds its host's address and the transfers go over tcp. Needs root (network namespaces).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import httpx
import pandas as pd

from epd_lab.campaign import netns
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, load_model
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.reference import monolithic_chat

# each link: (the host, whether it is that host's downlink)
LINKS = {"ep": ("e", False), "pd": ("d", True)}


@dataclass(frozen=True, slots=True)
class Answer:
    """One streamed chat: its text, the request id the servers' spans carry, the time to its first token and to
    the stream's end."""
    text: str
    rid: str
    ttft_ms: float
    e2e_ms: float


def placement(hosts: netns.Hosts, topology: Topology) -> dict[str, tuple[str, str]]:
    """`topology`'s processes on `hosts` (named e, p, d): encoders on e, prefills on p, decodes on d, the proxy
    here on the bridge (the namespaces reach it; 127.0.0.1 they would not)."""
    placed = {f"{role}{i}": (hosts.netns(host), hosts.address(host))
              for role, count, host in (("encoder", topology.encoders, "e"), ("prefill", topology.prefills, "p"),
                                        ("decode", topology.decodes, "d")) for i in range(count)}
    return {**placed, **({"proxy": ("", hosts.root)} if topology.proxy else {})}


def shape(hosts: netns.Hosts, link: str, rate_mbit: float | None) -> None:
    """Limit `link` ("ep" or "pd") to `rate_mbit`, or lift the limit (None); while the roles run."""
    host, downlink = LINKS[link]
    hosts.shape(host, rate_mbit, downlink=downlink)


@contextlib.contextmanager
def linked_cluster(topology: Topology) -> Iterator[tuple[netns.Hosts, Cluster]]:
    """`topology` (its transport forced to tcp) on three fresh emulated hosts, unshaped (`shape` a link).
    Removes the hosts at exit."""
    with netns.Hosts(["e", "p", "d"]) as hosts:
        placed = placement(hosts, topology)
        with Cluster(replace(topology, transport="tcp", hosts=placed)) as cluster:
            yield hosts, cluster


def chat(client: httpx.Client, proxy_url: str, messages: list[dict[str, Any]], max_tokens: int) -> Answer:
    """Stream one greedy chat through the proxy: its text, request id, TTFT (sent to first content chunk) and
    e2e (sent to the stream's end). The proxy hands out prefill's token before decode fetches the KV, so the P→D
    link shows in e2e, not in TTFT."""
    body = {"model": "x", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, parts, rid = None, [], ""
    with client.stream("POST", proxy_url + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            rid = event["id"].split("-", 1)[1]  # "chatcmpl-<rid>"
            content = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if content:
                ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
                parts.append(content)
    if ttft is None:
        raise RuntimeError(f"{proxy_url} streamed no content")
    return Answer("".join(parts), rid, ttft, (time.perf_counter() - t0) * 1e3)


def stage_ms(cluster: Cluster, rid: str, stage: str) -> tuple[float, int]:
    """The `stage` span of request `rid` (e.g. ``kv_transfer``, ``transfer``): (its duration in ms, its bytes);
    the longest when the request has several (parts)."""
    frame = cluster.spans(rid)
    rows = frame[frame["stage"] == stage]
    if rows.empty:
        raise LookupError(f"request {rid} has no {stage} span")
    row = rows.loc[rows["duration_ms"].idxmax()]
    return float(row["duration_ms"]), int(row["nbytes"])


def image_chat(seed: int | tuple[int, ...], image_size: int) -> list[dict[str, Any]]:
    """One user message: a random `image_size`² image (distinct per seed: no encoder cache hit) and a question."""
    url = data_uri(random_png(seed, image_size))
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "describe the image"}]}]


def link_sweep(backends: list[str], rates: list[float], requests: int, max_tokens: int = 4, image_size: int = 224,
               progress: Callable[[str], None] = lambda _: None) -> pd.DataFrame:
    """TTFT and e2e of 1E1P1D (tiny model, CPU) per E→P backend, with each link ("ep", "pd") shaped in turn to each
    of `rates` (Mbit/s) and once unshaped ("none", rate 0). One cluster per backend, all up at once; `requests`
    rounds of every setting, each setting's request sent to every backend in turn (the order rotating by round), so
    the machine's load drifts spread over backends and settings alike. One row per request: its spans'
    ``transfer_ms`` (E→P, the slowest part) and ``kv_transfer_ms`` with their bytes, and ``exact``: its answer
    equals the monolithic model's."""
    configure_torch()
    model = load_model()
    settings = [("none", 0.0), *((link, float(r)) for link in LINKS for r in rates)]
    rows = []
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=60))
        clusters = {}
        for backend in backends:
            topology = Topology(backend=backend, prefills=1, decodes=1, proxy=True, timeout=30)
            clusters[backend] = stack.enter_context(linked_cluster(topology))
            for w in range(2):  # warm: connections and lazy set-up
                chat(client, clusters[backend][1].proxy_url, image_chat((9999, w), image_size), max_tokens)
            progress(f"{backend}: up")
        for i in range(requests):
            for k, (link, rate) in enumerate(settings):
                messages = image_chat((i, k), image_size)
                expected = monolithic_chat(model, messages, max_tokens)
                for j in range(len(backends)):
                    backend = backends[(i + j) % len(backends)]
                    hosts, cluster = clusters[backend]
                    for name in LINKS:
                        shape(hosts, name, rate if name == link else None)
                    answer = chat(client, cluster.proxy_url, messages, max_tokens)
                    transfer_ms, transfer_bytes = stage_ms(cluster, answer.rid, "transfer")
                    kv_ms, kv_bytes = stage_ms(cluster, answer.rid, "kv_transfer")
                    rows.append({"backend": backend, "link": link, "rate_mbit": rate, "round": i,
                                 "ttft_ms": answer.ttft_ms, "e2e_ms": answer.e2e_ms, "transfer_ms": transfer_ms,
                                 "transfer_bytes": transfer_bytes, "kv_transfer_ms": kv_ms, "kv_bytes": kv_bytes,
                                 "exact": answer.text == expected})
            progress(f"round {i + 1} of {requests}: {len(settings) * len(backends)} requests")
    return pd.DataFrame(rows)


def link_medians(frame: pd.DataFrame) -> pd.DataFrame:
    """`link_sweep`'s rows as medians per link (E→P, P→D), speed and backend; the unshaped run counts in both links,
    as speed "unshaped" after the rates."""
    names = {"ep": "E→P", "pd": "P→D"}
    shaped = frame[frame["link"] != "none"].assign(link=lambda f: f["link"].map(names),
                                                   speed=lambda f: f["rate_mbit"].map("{:g} Mbit/s".format))
    free = frame[frame["link"] == "none"]
    both = pd.concat([shaped, *(free.assign(link=name, speed="unshaped") for name in names.values())])
    order = [*(f"{r:g} Mbit/s" for r in sorted(frame.loc[frame["link"] != "none", "rate_mbit"].unique())), "unshaped"]
    both["speed"] = pd.Categorical(both["speed"], order, ordered=True)
    values = ["ttft_ms", "e2e_ms", "transfer_ms", "kv_transfer_ms"]
    return (both.groupby(["link", "speed", "backend"], observed=True)[values].median()
            .join(both.groupby(["link", "speed", "backend"], observed=True).size().rename("requests")).reset_index())
