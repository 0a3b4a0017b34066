"""`epd-lab campaign soak`: `count` streamed chat requests at `concurrency`, a seeded share of them cancelled
by the client mid-stream and a share of them bad (an image that is not one, bad fields), on a 1E/1P/1D
cluster; pool levels and every process's RSS sampled throughout.

Targets: 0 leaked registrations, blocks, pins or embedding buffers at the end (every pool gauge
back at its idle level); every process's RSS grows by at most 5% over the second half of the run; bad input
is refused with a 4xx (never a 5xx); every answer equals its solo answer.
"""
from __future__ import annotations

import asyncio
import base64
import random
import time
from typing import Any

from epd_lab.campaign.client import Outcome, chat, client_session, counts, judge
from epd_lab.campaign.metrics import Sampler, refusals, wait_idle
from epd_lab.campaign.prompts import Prompts
from epd_lab.campaign.verdict import Progress, percentiles, target
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.servers.openai_api import MODEL_ID

RSS_GROWTH_LIMIT = 0.05


def bad_body(kind: str, rng: random.Random, prompts: Prompts) -> dict[str, Any]:
    """A request the proxy must refuse with a 4xx: `kind` names what is wrong with it."""
    body = prompts.body(rng.randrange(prompts.count))
    text = {"type": "text", "text": "what is this?"}
    if kind == "not_an_image":
        junk = base64.b64encode(rng.randbytes(rng.randrange(16, 4096))).decode()
        body["messages"] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + junk}}, text]}]
    elif kind == "truncated_png":
        uri = body["messages"][0]["content"][0]["image_url"]["url"]
        raw = base64.b64decode(uri.split(",", 1)[1])
        cut = base64.b64encode(raw[:rng.randrange(8, max(9, len(raw) // 2))]).decode()
        body["messages"] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + cut}}, text]}]
    elif kind == "bad_max_tokens":
        body["max_tokens"] = rng.choice([-1, "many", 2.5, 0])  # not null: OpenAI reads null as "the default"
    elif kind == "bad_temperature":
        body["temperature"] = rng.choice(["hot", -3, [1]])
    elif kind == "no_messages":
        body = {"model": MODEL_ID, "stream": True, "max_tokens": 4}
    elif kind == "bad_role":
        body["messages"] = [{"role": "wizard", "content": 7}]
    else:
        raise ValueError(f"unknown bad input {kind!r}")
    return body


BAD_KINDS = ("not_an_image", "truncated_png", "bad_max_tokens", "bad_temperature", "no_messages", "bad_role")


def rss_growth(samples: list[dict[str, Any]], t_mid: float, t_end: float) -> dict[str, float | None]:
    """Per process: RSS growth over [t_mid, t_end] as a fraction of its RSS at t_mid: the median of the first
    tenth of that window's samples against the median of its last tenth (at least one sample each), so that
    one sample's noise does not decide. None where the window holds fewer than two samples."""
    out: dict[str, float | None] = {}
    by_process: dict[str, list[float]] = {}
    for s in sorted(samples, key=lambda s: s["t"]):
        if s["metric"] == "rss_bytes" and t_mid <= s["t"] <= t_end:
            by_process.setdefault(s["process"], []).append(s["value"])
    for name, values in by_process.items():
        if len(values) < 2:
            out[name] = None
            continue
        k = max(1, len(values) // 10)
        head, tail = sorted(values[:k]), sorted(values[-k:])
        start, end = head[len(head) // 2], tail[len(tail) // 2]
        out[name] = (end - start) / start
    return out


async def _drive(proxy_url: str, prompts: Prompts, count: int, concurrency: int, client_timeout: float,
                 abort_share: float, bad_share: float, deadline: float, t0: float, seed: int,
                 progress: Progress) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    # every request's plan drawn up front, so a seed names the same run whatever the timing
    plans = []
    for i in range(count):
        roll = rng.random()
        if roll < bad_share:
            kind = rng.choice(BAD_KINDS)
            plans.append((i, -1, bad_body(kind, rng, prompts), None, f"bad:{kind}"))
        else:
            p = rng.randrange(prompts.count)
            abort = rng.randrange(1, prompts.max_tokens) if roll < bad_share + abort_share else None
            plans.append((i, p, prompts.body(p), abort, "abort" if abort else ""))
    done = 0

    async def one(plan, session) -> Outcome | None:
        nonlocal done
        i, p, body, abort, tag = plan
        async with gate:
            if time.monotonic() > deadline:
                return None
            out = await chat(session, proxy_url, body, client_timeout, index=i, prompt=p, abort_after=abort,
                             t0=t0, tag=tag)
            done += 1
            if done % max(1, count // 10) == 0:
                progress(f"    {done}/{count} done ({time.monotonic() - t0:.0f} s)")
            return out

    async with client_session(concurrency) as session:
        results = await asyncio.gather(*(one(plan, session) for plan in plans))
    return [r for r in results if r is not None]


def soak(*, count: int = 10_000, concurrency: int = 16, seed: int = 0, time_budget_s: float = 1800.0,
         abort_share: float = 0.3, bad_share: float = 0.1, timeout: float = 10.0, max_tokens: int = 8,
         image_size: int = 224, sample_interval: float = 0.25, progress: Progress = print) -> dict[str, Any]:
    """The soak leg; returns its report (one run)."""
    started = time.monotonic()
    prompts = Prompts(seed, count=16, image_size=image_size, max_tokens=max_tokens)
    progress("  soak: starting 1E/1P/1D and the proxy")
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True, timeout=timeout)) as cluster:
        client_timeout = 6 * timeout
        solo = asyncio.run(prompts.compute_solo(cluster.proxy_url, client_timeout))
        progress(f"  soak: {count} requests at concurrency {concurrency} ({abort_share:.0%} aborted by the client, "
                 f"{bad_share:.0%} bad), budget {time_budget_s:.0f} s")
        t0 = time.monotonic()
        with Sampler(cluster, t0, sample_interval) as sampler:
            idle = sampler.levels()
            outcomes = asyncio.run(_drive(cluster.proxy_url, prompts, count, concurrency, client_timeout,
                                          abort_share, bad_share, started + time_budget_s, t0, seed, progress))
            t_last = time.monotonic() - t0
            idle_s, left = wait_idle(sampler, idle, bound_s=max(5.0, 4 * timeout))
        refused_by = refusals(cluster)
        judge(outcomes, prompts.solo)
    growth = rss_growth(sampler.rows, t_last / 2, t_last)
    bad = [o for o in outcomes if o.tag.startswith("bad:")]
    bad_5xx = [o for o in bad if o.kind in ("error", "timeout")]  # a 5xx, an error event or a broken connection
    good = [o for o in outcomes if not o.tag.startswith("bad:")]
    failed = [o for o in good if o.kind in ("error", "timeout")]
    wrong = [o for o in outcomes if o.matches is False]
    targets = [
        target("no leaked pools", idle_s is not None, {"idle_after_s": idle_s, "left": left},
               "0 leaked registrations, blocks, pins or embedding buffers at the end"),
        target("RSS flat over the second half", all(g is not None and g <= RSS_GROWTH_LIMIT for g in growth.values()),
               growth, f"every process's RSS grows by <= {RSS_GROWTH_LIMIT:.0%} over the second half"),
        target("bad input refused with a 4xx", not bad_5xx and all(o.kind == "rejected" for o in bad),
               {"bad": len(bad), "5xx_or_broken": len(bad_5xx), "not_rejected": sum(o.kind != "rejected" for o in bad)},
               "every bad request gets a 4xx error object, never a 5xx"),
        target("good requests served", not failed, {"failed": len(failed), "refused": sum(o.kind == "refused" for o in good)},
               "0 errors or client timeouts among well-formed requests (503 refusals counted apart)"),
        target("answers equal solo answers", not wrong and all(s is not None for s in prompts.solo),
               {"wrong": len(wrong), "checked": sum(o.matches is not None for o in outcomes)},
               "every complete answer equals its solo answer"),
    ]
    run = {"name": "soak 1E1P1D", "count": count, "sent": len(outcomes), "counts": counts(outcomes),
           "bad_counts": counts(bad), "refusals": refused_by, "latency_s": percentiles([o.latency_s for o in outcomes if o.kind == "ok"]),
           "last_answer_s": t_last, "idle_after_s": idle_s, "leaks_left": left, "idle_levels": idle,
           "rss_growth_second_half": growth, "solo": [o.record() for o in solo], "targets": targets,
           "requests": [o.record() for o in outcomes], "samples": sampler.rows}
    return {"leg": "soak", "seed": seed, "machine": machine_info(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "parameters": {"count": count, "concurrency": concurrency, "time_budget_s": time_budget_s,
                           "abort_share": abort_share, "bad_share": bad_share, "timeout": timeout,
                           "max_tokens": max_tokens, "image_size": image_size},
            "runs": [run], "targets": targets,
            "passed": all(t["passed"] for t in targets), "wall_s": time.monotonic() - started}
