"""The topology on Ray nodes that are separate network hosts: three network namespaces on one bridge
(`epd_lab.campaign.netns`), each running ``ray start`` with its own address, the driver inside the head's.
Every role binds its node's address (``ray_bind="node"``), so bytes between roles cross the emulated links.
Skips with the reason where network namespaces cannot be made (no CAP_NET_ADMIN).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from epd_lab.campaign import netns  # noqa: E402
from epd_lab.models import configure_torch, load_model  # noqa: E402
from epd_lab.noise import data_uri, random_png  # noqa: E402
from epd_lab.servers.reference import monolithic_chat  # noqa: E402

NODES = ("a", "b", "c")
PINS = {"encoder0": "host_a", "prefill0": "host_b", "decode0": "host_c", "proxy": "host_a"}
MAX_TOKENS = 8

# The driver: on a Ray node (a Ray driver must be), i.e. inside host a's namespace; it prints one JSON line
DRIVER = r"""
import json, sys, httpx, ray
from ray.util.placement_group import placement_group_table
from epd_lab.launch import Cluster, Topology
address, pins, messages, max_tokens = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
options = {name: {"num_cpus": 0, "resources": {host: 1}} for name, host in pins.items()}
topology = Topology(prefills=1, decodes=1, proxy=True, timeout=20, placement="ray", ray_bind="node",
                    ray_options=options)
with Cluster(topology) as cluster:
    body = {"model": "x", "max_tokens": max_tokens, "temperature": 0}
    answers = [httpx.post(cluster.proxy_url + "/v1/chat/completions", json={**body, "messages": m}, timeout=60)
               .json()["choices"][0]["message"]["content"] for m in messages]
    paths = {url: [ln for ln in httpx.get(url + "/metrics").text.splitlines() if "_engine_bytes_out_total{" in ln]
             for url in cluster.urls()[:2]}
    urls, pids = cluster.urls(), [p.pid for p in cluster.procs]
alive = [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
print(json.dumps({"answers": answers, "paths": paths, "urls": urls, "pids": pids, "actors": alive,
                  "groups": len(groups)}))
"""


IMAGE = data_uri(random_png(1, (64, 96)))  # 96x64 noise
MESSAGES = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                          {"type": "text", "text": "which host answered?"}]}]]


def _in(hosts: netns.Hosts, node: str, *cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", hosts.netns(node), *cmd], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def ray_hosts():
    """(the hosts, the Ray head's address)."""
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netns.Hosts(list(NODES)) as hosts, netns.ray_nodes(hosts) as head:
        yield hosts, head


def test_roles_on_three_network_hosts_answer_right_over_tcp_and_leave_nothing(ray_hosts):
    hosts, head = ray_hosts
    run = _in(hosts, "a", sys.executable, "-c", DRIVER, head, json.dumps(PINS),
              json.dumps(MESSAGES), str(MAX_TOKENS), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    configure_torch()
    assert got["answers"] == [monolithic_chat(load_model(), m, MAX_TOKENS) for m in MESSAGES]
    # each role bound its own host's address: encoder and proxy on a, prefill on b, decode on c
    assert [u.split("//")[1].rsplit(":", 1)[0] for u in got["urls"]] == [hosts.address(n) for n in "abca"]
    encoder, prefill = got["urls"][:2]
    assert [ln.split('path="')[1].split('"')[0] for ln in got["paths"][encoder]] == ["tcp"]  # E→P: a to b
    assert [ln.split('path="')[1].split('"')[0] for ln in got["paths"][prefill]] == ["tcp"]  # P→D: b to c
    assert got["actors"] == [] and got["groups"] == 0
    left = [pid for pid in got["pids"] if os.path.exists(f"/proc/{pid}")]  # one PID namespace for all hosts
    assert left == []
