"""The clusters `epd-lab bench serve --launch` and the rate sweep start: the monolithic floor, or E→P→D as NeMpKd.

``monolithic`` is one process (`epd_lab.servers.monolithic`); ``1e1p1d`` is 1 encoder, 1 prefill, 1 decode and the
proxy; ``2e1p1d`` two encoders, and so on. With `media_url` the model roles fetch http(s) media from loopback
(``media_private_hosts``): the bench's media server listens on 127.0.0.1, which their policy refuses otherwise.
"""
from __future__ import annotations

import re

from epd_lab.launch import Cluster, Topology

_SPLIT = re.compile(r"(\d+)e(\d+)p(\d+)d")


def topology(name: str, backend: str = "mooncake", device: str = "cpu", model: str | None = None,
             media_url: bool = False, kv_blocks: int = 1024) -> Topology:
    """The `Topology` a name stands for; `ValueError` for an unknown name."""
    shared = {"device": device, "model": model, "kv_blocks": kv_blocks, "timeout": 60.0}
    if name == "monolithic":
        return Topology(monolithic=True, settings={"monolithic": {"media_private_hosts": media_url}}, **shared)
    match = _SPLIT.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown topology {name!r}: monolithic, or NeMpKd such as 1e1p1d")
    encoders, prefills, decodes = map(int, match.groups())
    return Topology(encoders=encoders, prefills=prefills, decodes=decodes, proxy=True, backend=backend,
                    settings={"encoder": {"media_private_hosts": media_url}}, **shared)


def launch(name: str, **options: object) -> Cluster:
    """Start the cluster `name` stands for (`topology`'s options); a context manager."""
    return Cluster(topology(name, **options))
