"""Shaped links through real processes (`epd_lab.campaign.links`): 1E1P1D on three emulated hosts, the proxy on
the bridge. A shaped E→P link (the encoder host's uplink) slows the ``transfer`` span, a shaped P→D link (the
decode host's downlink) the ``kv_transfer`` span, each by about bytes / rate, and the answers stay the monolithic
model's. The bounds are loose (this machine is shared): the span less the unshaped one between 0.8 and 2.5 times
bytes / rate; tbf lets no transfer through faster than its rate, bar one 4 KiB burst. Skips without network
namespaces."""
from __future__ import annotations

import statistics

import httpx
import pytest

from epd_lab.campaign import links, netns
from epd_lab.launch import Topology
from epd_lab.models import configure_torch, load_model
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.reference import monolithic_chat

NETNS = netns.available()
MAX_TOKENS = 4
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(random_png(3, 224))}},
                                         {"type": "text", "text": "how fast is the link?"}]}]
# link -> (its span, the rate in Mbit/s: a few hundred ms for the tiny model's bytes at 224², 64 KiB and 256 KiB)
CASES = {"ep": ("transfer", 4.0), "pd": ("kv_transfer", 10.0)}


@pytest.mark.timeout(300)
@pytest.mark.skipif(not NETNS[0], reason=f"no network namespaces: {NETNS[1]}")
def test_a_shaped_link_slows_its_transfer_by_bytes_over_rate():
    configure_torch()
    expected = monolithic_chat(load_model(), MESSAGES, MAX_TOKENS)
    topology = Topology(prefills=1, decodes=1, proxy=True, timeout=30)
    with links.linked_cluster(topology) as (hosts, cluster), httpx.Client(timeout=60) as client:
        for _ in range(2):  # warm: connections and lazy set-up
            links.chat(client, cluster.proxy_url, MESSAGES, MAX_TOKENS)
        for link, (stage, rate) in CASES.items():
            got: dict[float | None, list[float]] = {None: [], rate: []}
            sizes = set()
            for _ in range(3):
                for r in got:
                    links.shape(hosts, link, r)
                    answer = links.chat(client, cluster.proxy_url, MESSAGES, MAX_TOKENS)
                    assert answer.text == expected
                    ms, nbytes = links.stage_ms(cluster, answer.rid, stage)
                    got[r].append(ms)
                    sizes.add(nbytes)
            links.shape(hosts, link, None)
            (size,) = sizes
            model_ms = size * 8 / (rate * 1e6) * 1e3
            slowed = statistics.median(got[rate]) - statistics.median(got[None])
            assert 0.8 * model_ms <= slowed <= 2.5 * model_ms, (link, stage, size, got)
