"""Is Ray off the request path? TTFT at c=1 of the same topology on the same emulated hosts (network namespaces),
started by the local launcher (``ip netns exec``) and on Ray (``ray start`` in each namespace), requests
alternating between the two. Each request carries one 224² image (data: URI), so the encoder is on the measured
path. Needs root (network namespaces). Prints one JSON object, and writes it to ``--out`` with the machine and the
load average.

    .venv/bin/python scripts/ray_ttft.py --requests 100 --out data/bench/ray-ttft.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from epd_lab.campaign import netns
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.noise import data_uri, random_png

PINS = {"encoder0": "a", "prefill0": "b", "decode0": "c", "proxy": "a"}
BASE = {"prefills": 1, "decodes": 1, "proxy": True, "timeout": 20}
# the Ray side's driver, on host a (a Ray driver must run on a node): prints the proxy's URL, holds the cluster
# until its stdin closes
DRIVER = r"""
import json, sys, ray
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.noise import data_uri, random_png
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
pins, base = json.loads(sys.argv[2]), json.loads(sys.argv[3])
options = {name: {"num_cpus": 0, "resources": {"host_" + host: 1}} for name, host in pins.items()}
with Cluster(Topology(**base, placement="ray", ray_bind="node", ray_options=options)) as cluster:
    print(cluster.proxy_url, flush=True)
    sys.stdin.read()
"""
IMAGE = {"type": "image_url", "image_url": {"url": data_uri(random_png(0, 224))}}
BODY = {"model": "x", "max_tokens": 2, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "how long is the first token?"}]}]}


def ttft_ms(client: httpx.Client, url: str) -> float:
    """Milliseconds from sending a streamed chat to its first content chunk."""
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=BODY) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError(f"{url} streamed no content")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests to each cluster, alternating")
    ap.add_argument("--out", help="also write the result here, with the machine and the load average (JSON)")
    args = ap.parse_args()
    ok, why = netns.available()
    if not ok:
        sys.exit(f"network namespaces unavailable: {why}")
    load_before = os.getloadavg()
    with netns.Hosts(["a", "b", "c"]) as hosts, netns.ray_nodes(hosts) as head:
        driver = subprocess.Popen(["ip", "netns", "exec", hosts.netns("a"), sys.executable, "-c", DRIVER, head,
                                   json.dumps(PINS), json.dumps(BASE)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            urls = {"ray": driver.stdout.readline().strip()}
            placed = {name: (hosts.netns(host), hosts.address(host)) for name, host in PINS.items()}
            with Cluster(Topology(**BASE, hosts=placed)) as local, httpx.Client(timeout=30) as client:
                urls["local"] = local.proxy_url
                for url in urls.values():  # warm both: first requests pay for lazy set-up
                    for _ in range(5):
                        ttft_ms(client, url)
                got: dict[str, list[float]] = {"local": [], "ray": []}
                for i in range(args.requests):
                    for name in (("local", "ray") if i % 2 else ("ray", "local")):
                        got[name].append(ttft_ms(client, urls[name]))
        finally:
            driver.stdin.close()
            driver.wait(60)
    q = {name: statistics.quantiles(v, n=10) for name, v in got.items()}
    result = {name: {"median_ms": statistics.median(v), "p10_ms": q[name][0], "p90_ms": q[name][-1]}
              for name, v in got.items()} | {
        "paired_median_ms": statistics.median(r - lo for r, lo in zip(got["ray"], got["local"])),
        "requests": args.requests, "request": "1 x 224² image by data: URI, 2 tokens, streamed",
        "pins": PINS, "load_average": {"before": load_before, "after": os.getloadavg()}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result | {"machine": machine_info(), "ttft_ms": got}, f, indent=1)


if __name__ == "__main__":
    main()
