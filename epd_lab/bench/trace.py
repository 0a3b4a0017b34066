"""`epd-lab bench trace`: what tracing costs an E→P request (target: under 2% of its latency).

Two clusters of the same topology run side by side, one with tracing on and one with it off
(`Topology(trace=False)`: ``EPD_TRACE=0`` in every encoder, a disabled recorder in the receiver). Requests
alternate between them in pairs (on/off, off/on, ... so that neither always goes first), each with images of
its own (no cache hit), and the client times each one end to end. The overhead is the ratio of the medians
minus one; its range comes from the ratios of medians over disjoint blocks of pairs.

That A/B difference sits inside this machine's noise, so the bench also reports a bound that noise cannot
hide: the measured cost of one span (a `Recorder.span` round, plus twice its encoding: into the notification
and out of it) times the most spans one request recorded, over the median untraced request latency.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import msgspec

from epd_lab.bench import write_json
from epd_lab.bench.epd import make_images
from epd_lab.bench.transfer import machine_info
from epd_lab.epd.prefill import EPDPrefill
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, load_model
from epd_lab.trace import Recorder, Span

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


def run(requests: int = 40, side: int = 224, images: int = 1, encoders: int = 1, backend: str = "mooncake",
        blocks: int = 4, log=print) -> dict:
    """Measure; returns the JSON document (see the module docstring)."""
    configure_torch()
    model = load_model()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="epd-bench-trace-") as tmp, \
            Cluster(Topology(encoders=encoders, backend=backend, timeout=60)) as on, \
            Cluster(Topology(encoders=encoders, backend=backend, timeout=60, trace=False)) as off, \
            on.receiver() as rx_on, off.receiver() as rx_off:
        epd = {True: EPDPrefill(rx_on, model), False: EPDPrefill(rx_off, model)}
        for r in range(requests + 1):
            for traced in ((True, False) if r % 2 else (False, True)):
                paths = make_images(tmp, side, images, seed=(r << 1) | traced)
                t0 = time.perf_counter()
                epd[traced].prefill("describe the image", paths)
                if r:  # the first pair warms connections and mappings
                    times[traced].append((time.perf_counter() - t0) * 1e3)
        frame = on.spans(extra=rx_on.recorder.spans())  # every span of every request, from every process
    n_spans = int(frame.groupby("request").size().max())
    med = {k: statistics.median(v) for k, v in times.items()}
    size = max(1, requests // blocks)
    block_ratios = [statistics.median(times[True][i:i + size]) / statistics.median(times[False][i:i + size]) - 1
                    for i in range(0, requests - size + 1, size)]
    cost = span_cost_ns()
    # each span is recorded, encoded into a notification and decoded at most once (decoding ~ encoding)
    bound = n_spans * (cost["record_ns"] + 2 * cost["encode_ns"]) / 1e6 / med[False]
    result = {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "topology": {"encoders": encoders, "backend": backend, "images": images, "side": side},
              "requests": requests, "target": TARGET,
              "e2e_ms": {"traced": med[True], "untraced": med[False],
                         "traced_range": [min(times[True]), max(times[True])],
                         "untraced_range": [min(times[False]), max(times[False])]},
              "ab_overhead": med[True] / med[False] - 1, "ab_overhead_blocks": block_ratios,
              "spans_per_request": n_spans, "span_cost_ns": cost, "cost_bound": bound}
    log(f"e2e median traced {med[True]:.2f} ms, untraced {med[False]:.2f} ms: A/B overhead "
        f"{result['ab_overhead']:+.2%} (blocks {', '.join(f'{b:+.2%}' for b in block_ratios)})")
    log(f"{n_spans} spans/request x {cost['record_ns'] + 2 * cost['encode_ns']:.0f} ns = bound {bound:.3%} of the "
        f"request (target < {TARGET:.0%})")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epd-lab bench trace", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--requests", type=int, default=40, help="request pairs (traced + untraced)")
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--backend", default="mooncake")
    args = ap.parse_args(argv)
    result = run(args.requests, args.side, args.images, args.encoders, args.backend)
    if args.json:
        write_json(args.json, result)
    return 0
