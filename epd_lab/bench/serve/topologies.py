"""The clusters `epd-lab bench serve --launch` and the rate sweep start: the monolithic floor, or E→P→D as NeMpKd.

``monolithic`` is one process (`epd_lab.servers.monolithic`); ``2xmonolithic`` two of them behind the round-robin
front (`epd_lab.servers.front`); ``1e1p1d`` is 1 encoder, 1 prefill, 1 decode and the proxy; ``2e1p1d`` two
encoders, and so on. With `media_url` the model roles fetch http(s) media from loopback (``media_private_hosts``):
the bench's media server listens on 127.0.0.1, which their policy refuses otherwise.

`devices` places roles or single processes over `device` (``--devices monolithic1=cuda:1`` or
``encoder=cuda:1,prefill0=cuda:0``): a process's entry wins over its role's; a name the topology does not start
is refused (`Topology`'s check), before any process starts.

`PLACEMENTS` are the deployments compared at equal GPUs (two): each a topology and the processes or roles that run
on the second GPU, every other one on the first (`placement`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from epd_lab.launch import Cluster, Topology

# name → (topology, {process or role: the index of its GPU}); what is not named runs on GPU 0
PLACEMENTS: dict[str, tuple[str, dict[str, int]]] = {
    "2xmonolithic": ("2xmonolithic", {"monolithic1": 1}),  # one replica per GPU, round-robin in the front
    "e-gpu1": ("1e1p1d", {"encoder": 1}),  # the encoder alone on GPU 1, prefill and decode on GPU 0
    "d-gpu1": ("1e1p1d", {"decode": 1}),  # encoder and prefill on GPU 0, decode on GPU 1 (the seed's P→D split)
    "spread": ("2e1p1d", {"encoder1": 1, "decode": 1}),  # E0 and P on GPU 0, E1 and D on GPU 1
}
_SPLIT = re.compile(r"(\d+)e(\d+)p(\d+)d")
_REPLICAS = re.compile(r"(\d+)xmonolithic")


def parse_devices(text: str) -> dict[str, str]:
    """``NAME=DEVICE[,NAME=DEVICE...]`` (a role or process name, and a device) as a dict; `ValueError` if
    malformed."""
    devices = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, device = (s.strip() for s in item.partition("="))
        if not (sep and name and device):
            raise ValueError(f"{item!r} is not NAME=DEVICE (e.g. monolithic1=cuda:1)")
        devices[name] = device
    return devices


def placement(name: str, gpus: Sequence[str]) -> tuple[str, str, dict[str, str]]:
    """Placement `name` over `gpus` (two devices, GPU 0 first): its topology's name, the device of every process
    it does not place, and the devices of those it does (`topology`'s `device` and `devices`); `ValueError` for an
    unknown name or not two devices."""
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}: {', '.join(PLACEMENTS)}")
    if len(gpus) != 2:
        raise ValueError(f"a placement spreads over two devices, got {list(gpus)}")
    topology_name, on = PLACEMENTS[name]
    return topology_name, gpus[0], {process: gpus[index] for process, index in on.items()}


def topology(name: str, backend: str = "mooncake", device: str = "cpu", model: str | None = None,
             media_url: bool = False, kv_blocks: int = 1024, devices: Mapping[str, str] | None = None,
             mm_global_cache: bool = False) -> Topology:
    """The `Topology` a name stands for (`mm_global_cache`: its encoders share the global embedding cache, behind
    a master the cluster starts); `ValueError` for an unknown name, or a `devices` name it does not start."""
    shared = {"device": device, "model": model, "kv_blocks": kv_blocks, "timeout": 60.0}
    replicas = _REPLICAS.fullmatch(name)
    if name == "monolithic" or replicas:
        media = {"monolithic": {"media_private_hosts": media_url}}
        return Topology(monolithic=True, replicas=int(replicas.group(1)) if replicas else 1,
                        settings=_placed(media, devices), **shared)
    match = _SPLIT.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown topology {name!r}: monolithic, Nxmonolithic such as 2xmonolithic, or NeMpKd such "
                         f"as 1e1p1d")
    encoders, prefills, decodes = map(int, match.groups())
    return Topology(encoders=encoders, prefills=prefills, decodes=decodes, proxy=True, backend=backend,
                    mm_global_cache=mm_global_cache,
                    settings=_placed({"encoder": {"media_private_hosts": media_url}}, devices), **shared)


def _placed(settings: dict[str, dict], devices: Mapping[str, str] | None) -> dict[str, dict]:
    """`settings` with each of `devices`' names given its ``device``."""
    placed = {key: dict(values) for key, values in settings.items()}
    for name, device in (devices or {}).items():
        placed.setdefault(name, {})["device"] = device
    return placed


def launch(name: str, **options: object) -> Cluster:
    """Start the cluster `name` stands for (`topology`'s options); a context manager."""
    return Cluster(topology(name, **options))
