"""`epd-lab bench overload`: the overload targets (queue what can be served in time, refuse the rest at once),
measured once through real processes (tiny model, this host).

1. ``burst``: 200 concurrent streamed chats (one image, 8 tokens, greedy) on 1E/1P/1D and on 2E/2P/2D, through
   the campaign's load leg (`epd_lab.campaign.load.run_topology`: solo answers first, every answer checked
   against its solo answer and those against the monolithic model's): served, refused, lost, the slowest
   refusal. Target: >= 99% served with the right answer, 0 lost, every refusal within 0.5 s.
2. ``deadline``: 1,000 concurrent on 1E/1P/1D, each with ``X-EPD-Deadline-Ms: 10000``, twice on one cluster
   (the first burst on roles that never saw a queue, the second with the drain rate the first measured): how
   many were admitted and how many refused (and by whom), the refusals' latency (all, and split: the proxy's,
   from the headers, and those after it, by the prefill), the admitted ones' latency against the deadline (at
   the client, and from their arrival at the proxy: its ``e2e`` spans), the processes' peak RSS and the pools back at idle. Target: what cannot finish is
   refused within 0.5 s, what is admitted finishes within the deadline, memory stays bounded. The client is
   `epd_lab.campaign.rawburst`'s: every connection open and every request's bytes built before the burst, all
   written back to back; a latency runs from its own request's write (and, recorded too, from the burst's start).
3. ``floor``: the same client's 1,000 concurrent requests (the same bodies and deadline header) against a server
   that answers each with a 503 as soon as its headers are in (raw asyncio, no framework, no cluster): the refusal
   latency this client on this host measures for a server that costs nothing, the floor under part 2's.
4. ``big_prompt``: a 50 MB text prompt (one chat message of 50 million ASCII characters) sent to the proxy
   while 8 clients keep streaming ordinary chats: its status and latency, the others' outcomes, and whether the
   proxy found any backend stalled. Target: a 400 within 1 s, the others served, no replica stalled.

    epd-lab bench overload [--json data/bench/overload.json] [--parts burst,deadline,floor,big_prompt]

The figures are this host's (``machine`` in the JSON, with the CPU model); tests check the behaviour, not these
speeds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import subprocess
import sys

import aiohttp
import httpx

from epd_lab.bench import write_json
from epd_lab.campaign import rawburst
from epd_lab.campaign.client import Outcome, chat, client_session, counts, judge
from epd_lab.campaign.load import run_topology
from epd_lab.campaign.metrics import Sampler, parse_metrics, refusals, wait_idle
from epd_lab.campaign.prompts import Prompts
from epd_lab.campaign.verdict import percentiles
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.serving import DEADLINE_HEADER

PARTS = ("burst", "deadline", "floor", "big_prompt")
BIG_PROMPT_CHARS = 50_000_000


def _quiet(_: str) -> None:
    pass


def burst(name: str, count: int = 200, timeout: float = 10.0) -> dict[str, Any]:
    """`count` streamed chats at once on topology `name` (the campaign's load leg), summarised."""
    run = run_topology(name, count=count, concurrency=count, seed=0, time_budget_s=600.0, timeout=timeout,
                       max_tokens=8, image_size=224, progress=_quiet)
    c = run["counts"]
    right = sum(1 for r in run["requests"] if r["matches"] is True)
    lost = run["sent"] - c.get("ok", 0) - c.get("refused", 0)
    max_refusal = run["refused_latency_s"]["max"]
    return {"topology": name, "concurrency": count, "served": c.get("ok", 0), "served_right": right,
            "refused": c.get("refused", 0), "lost": lost, "max_refusal_latency_s": max_refusal,
            "latency_s": run["latency_s"], "refusals_by_server": run["refusals"], "idle_after_s": run["idle_after_s"],
            "target_met": right >= 0.99 * count and lost == 0 and (max_refusal is None or max_refusal <= 0.5)}


async def burst_with_deadline(url: str, prompts: Prompts, count: int, deadline_s: float,
                              client_timeout: float) -> list[Outcome]:
    """`count` streamed chats at once to `url`, each with a `deadline_s` ``X-EPD-Deadline-Ms``, cycling through
    `prompts`: their outcomes, in order, each request's latency from the moment its bytes were written
    (`epd_lab.campaign.rawburst`: connections open and bytes built before the burst; ``t_start + latency_s`` is
    the latency from the burst's start)."""
    raws = [json.dumps(prompts.body(p)).encode() for p in range(prompts.count)]
    order = [i % prompts.count for i in range(count)]
    return await rawburst.burst(url, [raws[p] for p in order], order, client_timeout,
                                headers={DEADLINE_HEADER: f"{deadline_s * 1000:.0f}"})


def _from_start(outcomes: list[Outcome]) -> list[float]:
    """The outcomes' latencies from the burst's start rather than from their own request's write."""
    return [o.t_start + o.latency_s for o in outcomes]


def deadline(count: int = 1000, deadline_s: float = 10.0, prompts_n: int = 32, bursts: int = 2) -> list[dict[str, Any]]:
    """`bursts` bursts (one after another, the cluster idle between) of `count` concurrent streamed chats with a
    `deadline_s` deadline each on 1E/1P/1D: the first on a fresh cluster (its roles never saw a queue), the next
    with the drain rate the first measured."""
    prompts = Prompts(1, count=prompts_n, image_size=224, max_tokens=8)
    prompts.compute_reference()
    results = []
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True, timeout=deadline_s)) as cluster:
        asyncio.run(prompts.compute_solo(cluster.proxy_url, 6 * deadline_s))
        for n in range(bursts):
            time.sleep(1.0)  # the proxy's probes read the prefill's admission as it is now
            t0, t0_ns = time.monotonic(), time.monotonic_ns()
            with Sampler(cluster, t0) as sampler:
                idle = sampler.levels()
                outcomes = asyncio.run(burst_with_deadline(cluster.proxy_url, prompts, count, deadline_s,
                                                            6 * deadline_s))
                idle_s, left = wait_idle(sampler, idle, bound_s=4 * deadline_s)
            spans = cluster.spans(since_ns=t0_ns)
            at_proxy = ((spans.t_end_ns - spans.t_start_ns) / 1e9)[spans.stage == "e2e"].tolist()
            results.append(_deadline_result(n, outcomes, prompts, sampler.rows, idle_s, left, count, deadline_s,
                                            at_proxy))
        refused_by = refusals(cluster)
    results[-1]["refusals_by_server_all_bursts"] = refused_by
    return results


def _deadline_result(n: int, outcomes: list[Outcome], prompts: Prompts, rows: list[dict[str, Any]],
                     idle_s: float | None, left: dict, count: int, deadline_s: float,
                     at_proxy: list[float]) -> dict[str, Any]:
    judge(outcomes, prompts.solo)
    ok = [o for o in outcomes if o.kind == "ok"]
    refused = [o for o in outcomes if o.kind == "refused"]
    rss: dict[str, float] = {}
    queue: dict[str, float] = {}
    for row in rows:
        table = rss if row["metric"] == "rss_bytes" else queue if row["metric"] == "queue_length" else None
        if table is not None:
            table[row["process"]] = max(table.get(row["process"], 0.0), row["value"])
    late = [o for o in ok if o.latency_s > deadline_s]
    slow_refusals = [o for o in refused if o.latency_s > 0.5]
    # who refused decides where the time went: the proxy judges from the headers (its refusals sit at the
    # client's own floor, part 3), a prefill after the proxy read and forwarded the body, or while it waited
    by_proxy = [o for o in refused if o.error.startswith("proxy overloaded")]
    past_proxy = [o for o in refused if not o.error.startswith("proxy overloaded")]
    by_whom = {"proxy, before the body": sum(o.error.startswith("proxy overloaded") for o in refused),
               "prefill, on arrival": sum("does not fit the request's deadline" in o.error
                                          and o.error.startswith("prefill") for o in refused),
               "prefill, while waiting": sum("predicted wait now" in o.error for o in refused),
               "prefill, expired": sum("passed while" in o.error for o in refused)}
    return {"burst": n + 1, "topology": "1E1P1D", "concurrency": count, "deadline_s": deadline_s,
            "counts": counts(outcomes), "served_right": sum(o.matches is True for o in ok),
            "wrong": sum(o.matches is False for o in ok),
            "admitted_latency_s": percentiles([o.latency_s for o in ok]), "admitted_past_deadline": len(late),
            # the same from the head's arrival at the proxy (its e2e spans): what the client's own lag, before
            # the proxy read the head, adds to the line above is the client's floor (part 3)
            "admitted_at_proxy_s": percentiles(at_proxy),
            "admitted_past_deadline_at_proxy": sum(t > deadline_s for t in at_proxy),
            # from each request's own write (the target's), and from the burst's start (the client's writes of
            # the requests before it in it, with the server's reading of them)
            "refusal_latency_s": percentiles([o.latency_s for o in refused]),
            "refusal_latency_from_burst_start_s": percentiles(_from_start(refused)),
            "refusals_past_0_5_s": len(slow_refusals), "refused_by": by_whom,
            "refusal_latency_by": {"proxy": percentiles([o.latency_s for o in by_proxy]),
                                   "after the proxy": percentiles([o.latency_s for o in past_proxy])},
            "writes_s": max(o.t_start for o in outcomes),  # the burst's last write, after its first
            "refusal_detail_example": refused[0].error if refused else None,
            "errors": sorted({o.error[:200] for o in outcomes if o.kind in ("error", "timeout")})[:5],
            "peak_queue_length": queue, "peak_rss_mib": {k: round(v / 2**20, 1) for k, v in rss.items()},
            "idle_after_s": idle_s, "leaks_left": left,
            "target_met": not late and not slow_refusals and idle_s is not None
            and not any(o.kind in ("error", "timeout") for o in outcomes)}


# A server that answers every request with a 503 once its head is in, and drops its body unparsed: nothing cheaper
# can refuse. Kept-alive connections: a body is skipped by its content-length, then the next head is read.
REFUSER = r"""
import asyncio, socket
BODY = b'{"error":{"message":"refused at once","type":"server_error","code":"overloaded"}}'
ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
          % len(BODY) + BODY)

class Refuser(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf, self.skip = transport, b"", 0

    def data_received(self, data):
        self.buf += data
        while True:
            if self.skip:  # the body of a request answered already: dropped
                n = min(self.skip, len(self.buf))
                self.buf, self.skip = self.buf[n:], self.skip - n
                if self.skip:
                    return
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            self.transport.write(ANSWER)
            length = [line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            self.buf, self.skip = rest, int(length[0]) if length else 0

async def main():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    print(sock.getsockname()[1], flush=True)
    server = await asyncio.get_running_loop().create_server(Refuser, sock=sock)
    await server.serve_forever()

asyncio.run(main())
"""


def floor(count: int = 1000, deadline_s: float = 10.0, bursts: int = 3) -> dict[str, Any]:
    """`bursts` bursts of `count` requests, part 2's bodies and client, against `REFUSER`: their refusal latency."""
    prompts = Prompts(1, count=32, image_size=224, max_tokens=8)
    proc = subprocess.Popen([sys.executable, "-c", REFUSER], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        runs = []
        for _ in range(bursts):
            outcomes = asyncio.run(burst_with_deadline(url, prompts, count, deadline_s, 60.0))
            refused = [o for o in outcomes if o.kind == "refused"]
            runs.append({"counts": counts(outcomes), "refusal_latency_s": percentiles([o.latency_s for o in refused]),
                         "refusal_latency_from_burst_start_s": percentiles(_from_start(refused)),
                         "writes_s": max(o.t_start for o in outcomes)})
            time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return {"concurrency": count, "bursts": runs}


async def _big_prompt(url: str, prompts: Prompts, others: int) -> tuple[dict[str, Any], list[Outcome]]:
    raw = json.dumps({"model": "m", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "x" * BIG_PROMPT_CHARS}]}).encode()
    stop = asyncio.Event()
    outcomes: list[Outcome] = []

    async def keep_chatting(session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while not stop.is_set():
            outcomes.append(await chat(session, url, prompts.body((k + i) % prompts.count), 60.0,
                                       index=len(outcomes), prompt=(k + i) % prompts.count))
            i += 1

    async with client_session(others + 1) as session:
        chatters = [asyncio.create_task(keep_chatting(session, k)) for k in range(others)]
        await asyncio.sleep(1.0)  # the others are under way
        t0 = time.monotonic()
        async with session.post(url + "/v1/chat/completions", data=raw,
                                headers={"content-type": "application/json"}) as resp:
            body = await resp.read()
            big = {"bytes": len(raw), "status": resp.status, "latency_s": time.monotonic() - t0,
                   "answer": body[:300].decode(errors="replace")}
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*chatters)
    return big, outcomes


def big_prompt(others: int = 8) -> dict[str, Any]:
    """A 50 MB prompt to the proxy of a 1E/1P/1D while `others` clients keep chatting."""
    prompts = Prompts(2, count=8, image_size=224, max_tokens=8)
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True)) as cluster:
        asyncio.run(prompts.compute_solo(cluster.proxy_url, 60.0))
        big, outcomes = asyncio.run(_big_prompt(cluster.proxy_url, prompts, others))
        metrics = parse_metrics(httpx.get(cluster.proxy_url + "/metrics", timeout=10).text)
        stalls = sum(float(line.rpartition(" ")[2]) for line in
                     httpx.get(cluster.proxy_url + "/metrics", timeout=10).text.splitlines()
                     if line.startswith("epd_lab:proxy_backend_stalls_total{"))
    judge(outcomes, prompts.solo)
    return {"topology": "1E1P1D", "big": big, "others": counts(outcomes),
            "others_right": sum(o.matches is True for o in outcomes), "backend_stalls": stalls,
            "backends_up": metrics.get("epd_lab:proxy_backend_up"),
            "target_met": big["status"] == 400 and big["latency_s"] <= 1.0 and stalls == 0
            and all(o.kind == "ok" and o.matches for o in outcomes)}


def run(parts: tuple[str, ...] = PARTS, log: Any = print) -> dict[str, Any]:
    """Measure `parts`; the JSON's dict."""
    out: dict[str, Any] = {"bench": "overload", "machine": machine_info(),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           # the host's other work: its 2 vCPUs may be shared (another checkout's tests)
                           "load_average_at_start": os.getloadavg()}
    if "burst" in parts:
        out["burst"] = []
        for name in ("1E1P1D", "2E2P2D"):
            log(f"burst of 200 on {name}")
            out["burst"].append(burst(name))
            log(f"  {json.dumps({k: v for k, v in out['burst'][-1].items() if k != 'refusals_by_server'})}")
    if "deadline" in parts:
        log("1,000 concurrent with a 10 s deadline on 1E1P1D, twice")
        out["deadline"] = deadline()
        for result in out["deadline"]:
            log(f"  {json.dumps(result)}")
    if "floor" in parts:
        log("the same client's 1,000 requests against a server that refuses each at once")
        out["floor"] = floor()
        log(f"  {json.dumps(out['floor'])}")
    if "big_prompt" in parts:
        log("a 50 MB prompt while 8 clients chat")
        out["big_prompt"] = big_prompt()
        log(f"  {json.dumps(out['big_prompt'])}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench overload", description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="data/bench/overload.json", help="where to write the results")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    result = run(parts)
    result["load_average_at_end"] = os.getloadavg()
    write_json(args.json, result)
    return 0
