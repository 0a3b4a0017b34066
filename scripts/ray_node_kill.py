"""A node killed under load: 2E2P2D + proxy spread over three emulated Ray nodes (`ray.cluster_utils.Cluster`, a
head and two workers on this machine's address), 8 closed-loop clients, then one worker node killed. ``--kill
node`` (a machine lost): at one instant every role process and actor process of the node SIGKILLed and its Ray
daemons too (`remove_node(allow_graceful=False)`). ``--kill raylet``: only the Ray daemons; the actors notice
and exit, their roles follow by their death signal. Every answer is checked against the monolithic model's.
Prints one JSON object; `--out` writes it.

Targets: of the requests sent after the kill, >= 99% answered right; a request in flight at the kill
that fails ends within the request timeout.

    .venv/bin/python scripts/ray_node_kill.py --runs 3 --before 15 --out data/bench/ray-node-kill.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster as RayCluster

from epd_lab.bench import write_json
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.models import configure_torch, load_model
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.reference import monolithic_chat

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
# host_b is killed: it holds one of each model role, so each role loses a replica; the proxy stays on the head
# (a Ray driver's node cannot be removed, and without its proxy no request is served at all)
PINS = {"encoder0": "host_a", "encoder1": "host_b", "prefill0": "host_b", "prefill1": "host_c",
        "decode0": "host_b", "decode1": "host_c", "proxy": "host_a"}
VICTIM = "host_b"
MAX_TOKENS = 4


# half of the requests carry an image (E→P→D), half are text only (P→D)
IMAGES = [data_uri(random_png(i, (96, 128))) for i in range(2)]  # 128x96 noise
MESSAGES = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                          {"type": "text", "text": f"what is picture {i}?"}]}]
            for i, image in enumerate(IMAGES)] + \
           [[{"role": "user", "content": f"question number {i}"}] for i in range(2)]


def _client_loop(url: str, expected: list[str], stop: threading.Event, out: list[dict[str, Any]], k: int,
                 timeout: float) -> None:
    """One closed-loop client: the next request as soon as the last one ended."""
    with httpx.Client(timeout=timeout) as client:
        i = k
        while not stop.is_set():
            m = i % len(MESSAGES)
            t0 = time.monotonic()
            try:
                reply = client.post(url + "/v1/chat/completions", json={
                    "model": "x", "messages": MESSAGES[m], "max_tokens": MAX_TOKENS, "temperature": 0})
                status = reply.status_code
                right = status == 200 and reply.json()["choices"][0]["message"]["content"] == expected[m]
                error = "" if right else reply.text[:200]
            except httpx.HTTPError as exc:
                status, right, error = 0, False, f"{type(exc).__name__}: {exc}"
            out.append({"t0": t0, "t1": time.monotonic(), "status": status, "right": right, "error": error})
            i += 1


def one_run(model: Any, expected: list[str], clients: int, before_s: float, after_s: float, timeout: float,
            kill: str) -> dict[str, Any]:
    """One cluster, `before_s` of load, the kill, `after_s` more; the requests classified around the kill."""
    head = {**NODE, "resources": {"host_a": 8}, "include_dashboard": False}
    nodes = RayCluster(initialize_head=True, head_node_args=head)
    try:
        hosts = {host: nodes.add_node(**NODE, resources={host: 8}) for host in ("host_b", "host_c")}
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level="ERROR", log_to_driver=False)
        options = {name: {"num_cpus": 0, "resources": {host: 1}} for name, host in PINS.items()}
        topology = Topology(encoders=2, prefills=2, decodes=2, proxy=True, timeout=timeout, placement="ray",
                            ray_strategy="SPREAD", ray_options=options)
        with Cluster(topology) as cluster:
            names = cluster.process_names()
            victims = [p for name, p in zip(names, cluster.procs) if PINS[name] == VICTIM]
            stop, got = threading.Event(), [[] for _ in range(clients)]
            threads = [threading.Thread(target=_client_loop, args=(cluster.proxy_url, expected, stop, got[k], k,
                                                                   3 * timeout)) for k in range(clients)]
            for t in threads:
                t.start()
            time.sleep(before_s)
            t_kill = time.monotonic()
            if kill == "node":
                for p in victims:  # the emulated nodes share this machine: their pids are visible here
                    for pid in (p.pid, p.actor_pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            nodes.remove_node(hosts[VICTIM], allow_graceful=False)
            t_removed = time.monotonic()
            # until every role process of the node has stopped (raylet only: its death signal follows its
            # actor's exit), then until Ray reports each actor dead (what `Cluster.alive()` reads; asking a
            # dead actor blocks, so the first wait must not ask it)
            gone_s = reported_s = None
            while gone_s is None and time.monotonic() - t_kill < 60:
                if not any(_running(p.pid) for p in victims):
                    gone_s = time.monotonic() - t_kill
                time.sleep(0.01)
            while reported_s is None and time.monotonic() - t_kill < 60:
                if all(p.poll() is not None for p in victims):
                    reported_s = time.monotonic() - t_kill
                time.sleep(0.05)
            time.sleep(max(0.0, after_s - (time.monotonic() - t_kill)))
            stop.set()
            for t in threads:
                t.join(4 * timeout)
            alive = dict(zip(names, cluster.alive()))
    finally:
        ray.shutdown()
        nodes.shutdown()
    reqs = [r for rs in got for r in rs]
    before = [r for r in reqs if r["t1"] < t_kill]
    in_flight = [r for r in reqs if r["t0"] < t_kill <= r["t1"]]
    new = [r for r in reqs if r["t0"] >= t_kill]
    failed_in_flight = [r for r in in_flight if not r["right"]]
    errors: dict[str, int] = {}
    for r in [*failed_in_flight, *(r for r in new if not r["right"])]:
        key = f"{r['status']} {r['error'][:120]}"
        errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(reqs), "before": {"n": len(before), "right": sum(r["right"] for r in before),
                                          "median_ms": _median_ms(before)},
        "in_flight": {"n": len(in_flight), "right": sum(r["right"] for r in in_flight),
                      "failed_max_s": max((r["t1"] - r["t0"] for r in failed_in_flight), default=None),
                      "failed_end_after_kill_max_s": max((r["t1"] - t_kill for r in failed_in_flight), default=None)},
        "new": {"n": len(new), "right": sum(r["right"] for r in new),
                "failed_max_s": max((r["t1"] - r["t0"] for r in new if not r["right"]), default=None),
                "right_pct": 100 * sum(r["right"] for r in new) / max(1, len(new)), "median_ms": _median_ms(new),
                "first_5s_n": sum(r["t0"] < t_kill + 5 for r in new),
                "first_5s_right": sum(r["right"] for r in new if r["t0"] < t_kill + 5)},
        "remove_node_s": t_removed - t_kill, "roles_gone_s": gone_s, "ray_reports_dead_s": reported_s,
        "alive_after": alive, "errors": errors,
    }


def _running(pid: int) -> bool:
    """Whether `pid` still runs: a zombie (dead, not yet reaped by whoever inherited it) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _median_ms(reqs: list[dict[str, Any]]) -> float | None:
    ok = [1e3 * (r["t1"] - r["t0"]) for r in reqs if r["right"]]
    return statistics.median(ok) if ok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--before", type=float, default=20.0, help="seconds of load before the kill")
    ap.add_argument("--after", type=float, default=30.0, help="seconds of load after the kill")
    ap.add_argument("--timeout", type=float, default=10.0, help="the request timeout (the proxy's and each role's)")
    ap.add_argument("--kill", choices=("node", "raylet"), default="node",
                    help="node: roles, actors and Ray daemons at once; raylet: Ray's daemons only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    configure_torch()
    model = load_model()
    expected = [monolithic_chat(model, m, MAX_TOKENS) for m in MESSAGES]
    runs = []
    for _ in range(args.runs):
        load0 = Path("/proc/loadavg").read_text().split()[0]
        runs.append({"load_before": float(load0), **one_run(model, expected, args.clients, args.before, args.after,
                                                            args.timeout, args.kill)})
        print(json.dumps(runs[-1]), flush=True)
    pct = [r["new"]["right_pct"] for r in runs]
    result = {
        "what": "2E2P2D + proxy on 3 cluster_utils Ray nodes (1 CPU each), one worker node "
                "killed under closed-loop load; answers checked against the monolithic model",
        "kill": args.kill,
        "machine": machine_info(), "shared": "2 vCPUs shared with other sessions' work", "ray": ray.__version__,
        "pins": PINS, "victim": VICTIM,
        "clients": args.clients, "before_s": args.before, "after_s": args.after, "timeout_s": args.timeout,
        "max_tokens": MAX_TOKENS,
        "summary": {"new_right_pct_median": statistics.median(pct), "new_right_pct_range": [min(pct), max(pct)],
                    "in_flight_failed_max_s": max((r["in_flight"]["failed_max_s"] or 0.0) for r in runs),
                    # the timeout is an idle one (it restarts with each sign of progress): the kill is the last
                    "in_flight_failed_end_after_kill_max_s": max(
                        (r["in_flight"]["failed_end_after_kill_max_s"] or 0.0) for r in runs),
                    "targets": {"new_right_pct": ">= 99", "in_flight_failed_max_s": f"<= {args.timeout}"}},
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(str(args.out), result)


if __name__ == "__main__":
    main()
