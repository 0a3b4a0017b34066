"""`epd-lab campaign load`: `count` streamed chat requests, `concurrency` at once, through the proxy of a
1E/1P/1D and a 2E/2P/2D cluster.

Per topology: the prompts' solo answers first (each prompt sent alone, and checked against the monolithic
model's answer, `servers.reference`), then the load; every request's
outcome and latency, whether its answer equals its prompt's solo answer (greedy decoding: it must), pool
levels and RSS sampled throughout, and how long after the last answer every pool is back at its idle level.

Targets: 0 requests fail for any reason but a 503 that came back within 1 s; 0 client timeouts;
every answer equals its solo answer; every pool idle within 1 s of the last answer.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from epd_lab.campaign.client import Outcome, chat, client_session, counts, judge
from epd_lab.campaign.metrics import Sampler, refusals, wait_idle
from epd_lab.campaign.prompts import Prompts
from epd_lab.campaign.verdict import Progress, percentiles, target
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info

TOPOLOGIES = {"1E1P1D": (1, 1, 1), "2E2P2D": (2, 2, 2)}


def cluster_topology(shape: tuple[int, int, int], timeout: float) -> Topology:
    encoders, prefills, decodes = shape
    return Topology(encoders=encoders, prefills=prefills, decodes=decodes, proxy=True, timeout=timeout)


async def _drive(proxy_url: str, prompts: Prompts, count: int, concurrency: int, client_timeout: float,
                 deadline: float, t0: float, rng: random.Random, progress: Progress) -> list[Outcome]:
    """`count` requests, at most `concurrency` at once; none started after `deadline`."""
    gate = asyncio.Semaphore(concurrency)
    done = 0
    chosen = [rng.randrange(prompts.count) for _ in range(count)]  # drawn up front: the seed names the run

    async def one(i: int, session) -> Outcome | None:
        nonlocal done
        async with gate:
            if time.monotonic() > deadline:
                return None
            p = chosen[i]
            out = await chat(session, proxy_url, prompts.body(p), client_timeout, index=i, prompt=p, t0=t0)
            done += 1
            if done % max(1, count // 10) == 0 or done == count:
                progress(f"    {done}/{count} answered")
            return out

    async with client_session(concurrency) as session:
        results = await asyncio.gather(*(one(i, session) for i in range(count)))
    return [r for r in results if r is not None]


def run_topology(name: str, *, count: int, concurrency: int, seed: int, time_budget_s: float, timeout: float,
                 max_tokens: int, image_size: int, progress: Progress) -> dict[str, Any]:
    """One topology's load: its requests, samples, pools' return to idle and targets."""
    shape = TOPOLOGIES[name]
    prompts = Prompts(seed, count=min(8, count), image_size=image_size, max_tokens=max_tokens)
    prompts.compute_reference()
    progress(f"  {name}: starting {sum(shape)} servers and the proxy")
    with Cluster(cluster_topology(shape, timeout)) as cluster:
        client_timeout = 6 * timeout
        solo = asyncio.run(prompts.compute_solo(cluster.proxy_url, client_timeout))
        progress(f"  {name}: {sum(o.kind == 'ok' for o in solo)}/{len(solo)} solo answers; "
                 f"{count} requests at concurrency {concurrency}")
        t0 = time.monotonic()
        with Sampler(cluster, t0) as sampler:
            idle = sampler.levels()
            outcomes = asyncio.run(_drive(cluster.proxy_url, prompts, count, concurrency, client_timeout,
                                          t0 + time_budget_s, t0, random.Random(seed), progress))
            last = time.monotonic() - t0
            idle_s, left = wait_idle(sampler, idle, bound_s=max(5.0, 4 * timeout))
            progress(f"  {name}: pools idle {'after %.2f s' % idle_s if idle_s is not None else 'NEVER'}")
        refused_by = refusals(cluster)
        judge(outcomes, prompts.solo)
    refused = [o for o in outcomes if o.kind == "refused"]
    failed = [o for o in outcomes if o.kind not in ("ok", "refused")]
    slow_refusals = [o for o in refused if o.latency_s > 1.0]
    wrong = [o for o in outcomes if o.matches is False]
    targets = [
        target("no failure but a fast 503", not failed and not slow_refusals,
               {"failed": len(failed), "refused_after_1s": len(slow_refusals), "refused": len(refused)},
               "0 requests fail for any reason but a 503 that came back within 1 s"),
        target("no client timeout", not any(o.kind == "timeout" for o in outcomes),
               sum(o.kind == "timeout" for o in outcomes), "0 client timeouts"),
        target("answers equal solo answers", not wrong and all(s is not None for s in prompts.solo),
               {"wrong": len(wrong), "checked": sum(o.matches is not None for o in outcomes),
                "solo_missing": sum(s is None for s in prompts.solo)}, "every answer equals its solo answer"),
        target("solo answers equal the monolithic model's", prompts.solo == prompts.reference,
               sum(s != r for s, r in zip(prompts.solo, prompts.reference)),
               "each prompt's solo answer through the servers equals model.generate's in one process"),
        target("pools idle within 1 s", idle_s is not None and idle_s <= 1.0,
               {"idle_after_s": idle_s, "left": left}, "every pool back to idle within 1 s of the last answer"),
    ]
    return {"topology": name, "count": count, "concurrency": concurrency, "sent": len(outcomes),
            "counts": counts(outcomes), "latency_s": percentiles([o.latency_s for o in outcomes if o.kind == "ok"]),
            "refused_latency_s": percentiles([o.latency_s for o in refused]), "refusals": refused_by,
            "last_answer_s": last, "idle_after_s": idle_s, "leaks_left": left, "idle_levels": idle,
            "solo": [o.record() for o in solo], "targets": targets,
            "requests": [o.record() for o in outcomes], "samples": sampler.rows}


def load(*, count: int = 200, concurrency: int = 200, seed: int = 0, time_budget_s: float = 600.0,
         topologies: tuple[str, ...] = tuple(TOPOLOGIES), timeout: float = 10.0, max_tokens: int = 8,
         image_size: int = 224, progress: Progress = print) -> dict[str, Any]:
    """The load leg over `topologies`; returns its report (``runs``: one per topology, ``targets``: all of
    them prefixed with the topology, ``passed``)."""
    started = time.monotonic()
    runs = []
    for i, name in enumerate(topologies):
        left = time_budget_s - (time.monotonic() - started)
        runs.append(run_topology(name, count=count, concurrency=concurrency, seed=seed + i,
                                 time_budget_s=max(1.0, left / (len(topologies) - i)), timeout=timeout,
                                 max_tokens=max_tokens, image_size=image_size, progress=progress))
    targets = [{**t, "target": f"{r['topology']}: {t['target']}"} for r in runs for t in r["targets"]]
    return {"leg": "load", "seed": seed, "machine": machine_info(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "parameters": {"count": count, "concurrency": concurrency, "time_budget_s": time_budget_s,
                           "timeout": timeout, "max_tokens": max_tokens, "image_size": image_size,
                           "topologies": list(topologies)},
            "runs": runs, "targets": targets,
            "passed": all(t["passed"] for t in targets), "wall_s": time.monotonic() - started}
