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
from typing import Any, Iterator

import httpx

from epd_lab.campaign import netns
from epd_lab.launch import Cluster, Topology

# each link: (the host, whether it is that host's downlink)
LINKS = {"ep": ("e", False), "pd": ("d", True)}


@dataclass(frozen=True, slots=True)
class Answer:
    """One streamed chat: its text, the request id the servers' spans carry, and the time to its first token."""
    text: str
    rid: str
    ttft_ms: float


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
    """Stream one greedy chat through the proxy: its text, request id and TTFT (sent to first content chunk)."""
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
    return Answer("".join(parts), rid, ttft)


def stage_ms(cluster: Cluster, rid: str, stage: str) -> tuple[float, int]:
    """The `stage` span of request `rid` (e.g. ``kv_transfer``, ``transfer``): (its duration in ms, its bytes);
    the longest when the request has several (parts)."""
    frame = cluster.spans(rid)
    rows = frame[frame["stage"] == stage]
    if rows.empty:
        raise LookupError(f"request {rid} has no {stage} span")
    row = rows.loc[rows["duration_ms"].idxmax()]
    return float(row["duration_ms"]), int(row["nbytes"])
