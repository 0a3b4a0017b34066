"""`epd-lab campaign load|soak|faults|fuzz`: run one leg with bounded count and time, print progress, write
``<out>/<leg>.json`` and ``<out>/<leg>.html``; exit status 0 when every target passed, 1 otherwise."""
from __future__ import annotations

import argparse
import time

from epd_lab.campaign.report import write_report

LEGS = ("load", "soak", "faults", "fuzz")
# each leg's defaults: the full campaign (docs/campaign.md); smaller runs pass --count and friends
DEFAULTS = {"load": {"count": 200, "concurrency": 200, "time_budget": 900.0},
            "soak": {"count": 10_000, "concurrency": 16, "time_budget": 1800.0},
            "faults": {"count": 4, "concurrency": 2, "time_budget": 7200.0},
            "fuzz": {"count": 10_000, "concurrency": 1, "time_budget": 1800.0}}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab campaign", description=__doc__.splitlines()[0])
    ap.add_argument("leg", choices=LEGS)
    ap.add_argument("--count", type=int, help="load, soak: requests (per topology); faults: in-flight requests "
                                               "per cell; fuzz: generated inputs per server")
    ap.add_argument("--concurrency", type=int, help="requests at once (faults: new requests during the fault)")
    ap.add_argument("--time-budget", type=float, help="seconds: no new request or cell starts after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/campaign", help="folder for <leg>.json and <leg>.html")
    ap.add_argument("--timeout", type=float, default=None, help="the servers' timeout (load, soak: 10; faults: 5)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--topologies", default="1E1P1D,2E2P2D", help="load: which clusters")
    ap.add_argument("--abort-share", type=float, default=0.3, help="soak: share of streams the client cancels")
    ap.add_argument("--bad-share", type=float, default=0.1, help="soak: share of bad requests")
    ap.add_argument("--cells", default="", help="faults: comma-separated role:action:step cells (default: the "
                                                "whole matrix, `epd_lab.campaign.faults.matrix`)")
    ap.add_argument("--fault-s", type=float, default=None, help="faults: how long a freeze or slow-down lasts "
                                                                 "(default: the timeout + 2 s)")
    ap.add_argument("--frames", type=int, default=2000, help="fuzz: frames per socket")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    d = DEFAULTS[args.leg]
    count = args.count if args.count is not None else d["count"]
    concurrency = args.concurrency if args.concurrency is not None else d["concurrency"]
    budget = args.time_budget if args.time_budget is not None else d["time_budget"]
    for name, value in (("--count", count), ("--concurrency", concurrency), ("--time-budget", budget)):
        if value <= 0:
            raise SystemExit(f"epd-lab campaign: {name} must be positive, got {value}")
    t0 = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {line}", flush=True)

    if args.leg == "load":
        from epd_lab.campaign.load import load

        result = load(count=count, concurrency=concurrency, seed=args.seed, time_budget_s=budget,
                      topologies=tuple(t for t in args.topologies.split(",") if t), timeout=args.timeout or 10.0,
                      max_tokens=args.max_tokens, image_size=args.image_size, progress=progress)
    elif args.leg == "soak":
        from epd_lab.campaign.soak import soak

        result = soak(count=count, concurrency=concurrency, seed=args.seed, time_budget_s=budget,
                      abort_share=args.abort_share, bad_share=args.bad_share, timeout=args.timeout or 10.0,
                      max_tokens=args.max_tokens, image_size=args.image_size, progress=progress)
    elif args.leg == "faults":
        from epd_lab.campaign.faults import faults

        result = faults(cells=tuple(c for c in args.cells.split(",") if c), inflight=count,
                        concurrency=concurrency, seed=args.seed, time_budget_s=budget, timeout=args.timeout or 5.0,
                        fault_s=args.fault_s, max_tokens=args.max_tokens, image_size=args.image_size,
                        progress=progress)
    else:
        result = _fuzz(count, args.frames, args.seed, budget, progress)
    json_path, html_path = write_report(result, args.out)
    for t in result.get("targets", []):
        progress(f"{'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t.get('measured')}")
    progress(f"{'every target passed' if result.get('passed') else 'FAILED'}; wrote {json_path} and {html_path}")
    return 0 if result.get("passed") else 1


def _fuzz(count: int, frames: int, seed: int, budget: float, progress) -> dict:
    """The fuzz leg (`epd_lab.campaign.fuzz`) against a 1E/1P/1D cluster with its proxy, with the campaign's
    targets read from its report."""
    from epd_lab.campaign.fuzz import fuzz
    from epd_lab.campaign.verdict import target
    from epd_lab.launch import Cluster, Topology
    from epd_lab.machine import machine_info

    progress("  fuzz: starting 1E/1P/1D and the proxy")
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True)) as cluster:
        result = dict(fuzz(cluster, inputs_per_server=count, frames_per_socket=frames, seed=seed,
                           time_budget_s=budget, progress=progress))
    servers, sockets = result.get("servers", {}), result.get("sockets", {})
    outcomes: dict[str, int] = {}
    for server in servers.values():
        for kind, n in server.get("outcomes", {}).items():
            outcomes[kind] = outcomes.get(kind, 0) + n
    inputs = min((s.get("inputs", 0) for s in servers.values()), default=0)
    sent = min((s.get("frames", 0) for s in sockets.values()), default=0)
    failures = result.get("failures", [])
    result["targets"] = [
        target("no crash", not result.get("crashes"), len(result.get("crashes", [])), "0 crashes"),
        target("no 5xx, hang or stray write", not failures, len(failures),
               "0 5xx on bad input, 0 hangs, 0 writes outside registered memory"),
        target("inputs per server", inputs >= count, inputs, f">= {count} generated inputs per server"),
        target("frames per socket", sent >= frames, sent, f">= {frames} frames per socket"),
    ]
    result["passed"] = all(t["passed"] for t in result["targets"])
    result["counts"] = outcomes
    result.setdefault("leg", "fuzz")
    result.setdefault("machine", machine_info())
    return result
