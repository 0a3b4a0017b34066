"""`epd-lab bench trace`: what tracing costs an E→P request (target: under 2% of its latency).

Two clusters of the same topology run side by side, one with tracing on and one with it off
(`Topology(trace=False)`: ``EPD_TRACE=0`` in every encoder, a disabled recorder in the receiver). Requests
alternate between them in pairs (on/off, off/on, ... so that neither always goes first), each with images of
its own (no cache hit), and the client times each one end to end. A round's overhead is the ratio of its
medians minus one. Each round starts two fresh clusters (which one starts first alternates), because the
processes' placement on the 2 vCPUs biases a whole round one way or the other.

That A/B difference sits inside this machine's noise, so the bench also reports a bound that noise cannot
hide: the measured cost of one span (a `Recorder.span` round, plus twice its encoding: into the notification
and out of it) times the most spans one request recorded, over the median untraced request latency.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import msgspec

from epd_lab.bench import write_json
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.models import configure_torch, load_model
from epd_lab.trace import Recorder, Span
from epd_lab.workload import make_images

TARGET = 0.02


def span_cost_ns(rounds: int = 100_000) -> dict[str, float]:
    """Median ns of one `Recorder.span` round and of encoding one span (msgspec, as in a notification)."""
    rec = Recorder("bench", capacity=rounds)
    costs = []
    for _ in range(5):
        rec.clear()
        t0 = time.perf_counter_ns()
        for _ in range(rounds):
            with rec.span("vit", "0123456789abcdef0123456789abcdef_local_part_0", 0, 1 << 20):
                pass
        costs.append((time.perf_counter_ns() - t0) / rounds)
    span = Span("0123456789abcdef0123456789abcdef_local_part_0", 0, "vit", "encoder:40000", 1, 2, 1 << 20)
    t0 = time.perf_counter_ns()
    for _ in range(rounds):
        msgspec.json.encode(span)
    return {"record_ns": statistics.median(costs), "encode_ns": (time.perf_counter_ns() - t0) / rounds}


def _round(model, tmp: str, pairs: int, side: int, images: int, topology: dict, on_first: bool,
           seed: int) -> tuple[dict[bool, list[float]], int]:
    """One round on two fresh clusters (the traced one started first when `on_first`): the client's ms
    per request, traced and untraced, and the most spans one request recorded."""
    times: dict[bool, list[float]] = {True: [], False: []}
    with contextlib.ExitStack() as stack:
        clusters = {}
        for traced in ((True, False) if on_first else (False, True)):
            clusters[traced] = stack.enter_context(Cluster(Topology(**topology, timeout=60, trace=traced)))
        rx = {traced: stack.enter_context(c.receiver()) for traced, c in clusters.items()}
        epd = {traced: EPDPrefill(r, model) for traced, r in rx.items()}
        for r in range(pairs + 1):
            for traced in ((True, False) if r % 2 else (False, True)):
                paths = make_images(tmp, side, images, seed=seed + ((r << 1) | traced))
                t0 = time.perf_counter()
                epd[traced].prefill("describe the image", paths)
                if r:  # the first pair warms connections and mappings
                    times[traced].append((time.perf_counter() - t0) * 1e3)
        frame = clusters[True].spans(extra=rx[True].recorder.spans())  # every span, from every process
    return times, int(frame.groupby("request").size().max())


def run(pairs: int = 100, rounds: int = 3, side: int = 224, images: int = 1, encoders: int = 1,
        backend: str = "mooncake", log=print) -> dict:
    """Measure; returns the JSON document (see the module docstring)."""
    configure_torch()
    model = load_model()
    topology = {"encoders": encoders, "backend": backend}
    out_rounds = []
    n_spans = 0
    with tempfile.TemporaryDirectory(prefix="epd-bench-trace-") as tmp:
        for k in range(rounds):
            times, spans = _round(model, tmp, pairs, side, images, topology, on_first=k % 2 == 0, seed=k << 20)
            n_spans = max(n_spans, spans)
            med = {traced: statistics.median(v) for traced, v in times.items()}
            out_rounds.append({"traced_ms": med[True], "untraced_ms": med[False],
                               "traced_range_ms": [min(times[True]), max(times[True])],
                               "untraced_range_ms": [min(times[False]), max(times[False])],
                               "ab_overhead": med[True] / med[False] - 1})
            log(f"round {k}: e2e median traced {med[True]:.2f} ms, untraced {med[False]:.2f} ms: "
                f"A/B {out_rounds[-1]['ab_overhead']:+.2%}")
    cost = span_cost_ns()
    untraced = statistics.median(r["untraced_ms"] for r in out_rounds)
    # each span is recorded, encoded into a notification and decoded at most once (decoding ~ encoding)
    bound = n_spans * (cost["record_ns"] + 2 * cost["encode_ns"]) / 1e6 / untraced
    ab = [r["ab_overhead"] for r in out_rounds]
    result = {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "topology": {**topology, "images": images, "side": side}, "pairs_per_round": pairs,
              "target": TARGET, "rounds": out_rounds, "ab_overhead_median": statistics.median(ab),
              "ab_overhead_range": [min(ab), max(ab)], "spans_per_request": n_spans, "span_cost_ns": cost,
              "cost_bound": bound}
    log(f"A/B overhead median {result['ab_overhead_median']:+.2%} over {rounds} rounds "
        f"(range {min(ab):+.2%} .. {max(ab):+.2%})")
    log(f"{n_spans} spans/request x {cost['record_ns'] + 2 * cost['encode_ns']:.0f} ns = bound {bound:.3%} of the "
        f"request (target < {TARGET:.0%})")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench trace", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--pairs", type=int, default=100, help="request pairs (traced + untraced) per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each on two fresh clusters")
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--backend", default="mooncake")
    args = ap.parse_args(argv)
    result = run(args.pairs, args.rounds, args.side, args.images, args.encoders, args.backend)
    if args.json:
        write_json(args.json, result)
    return 0
