"""`epd-lab bench epd`: E→P per backend and encoder count, decomposed into the seed's stages.

For each backend and encoder count a cluster of real encode servers is started; for each point of the
sweep (images per request × image side) it runs N requests one after another through the receiver and
the prefill runner, and reports per-stage medians (ms), the end-to-end median and the control-plane
overhead: everything except the slowest part's ``vit + transfer`` and ``prefill`` (see
`epd_lab.trace.request_breakdown`). The first request of each point is a warm-up and not counted.

Each point also measures **delivery**: the same images sent again and again, so that the encoders
serve them from their embedding cache, and the receiver only collects the embeddings (no prefill).
That isolates what the backends differ in (HTTP, allocation, the bytes' path, notification,
reassembly) from the ViT and prefill, which on this CPU take 10-1000x longer than moving the bytes.

``mooncake_pool`` is the mooncake backend with the receiver's persistent managed pool (request
buffers carved from one registered-once memfd buffer) instead of a `torch.empty` per request.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence

from epd_lab.bench import write_json
from epd_lab.ep.messages import BACKENDS
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.models import configure_torch, load_model
from epd_lab.trace import STAGES, Recorder, request_breakdown
from epd_lab.workload import make_images


POOL_BYTES = 256 << 20
VARIANTS = (*BACKENDS, "mooncake_pool")


def run(backends: tuple[str, ...], encoders: tuple[int, ...], images: tuple[int, ...], sides: tuple[int, ...],
        requests: int, transport: str = "auto", log=print) -> dict:
    """Measure; returns ``{"machine", "rows"}`` with one row per (backend, encoders, images, side)."""
    configure_torch()
    model = load_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        for backend in backends:
            if backend not in VARIANTS:
                raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(VARIANTS)}")
            pool_bytes = POOL_BYTES if backend == "mooncake_pool" else 0
            for n_enc in encoders:
                topo = Topology(encoders=n_enc, backend=backend.removesuffix("_pool"), transport=transport,
                                pool_bytes=pool_bytes, timeout=60)
                with Cluster(topo) as cluster, cluster.receiver(Recorder("prefill")) as rx:
                    epd = EPDPrefill(rx, model)
                    for n_img in images:
                        for side in sides:
                            rows.append(_point(epd, tmp, backend, n_enc, n_img, side, requests))
                            log(_fmt(rows[-1]))
    return {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "transport": transport, "rows": rows}


def _point(epd: EPDPrefill, tmp: str, backend: str, n_enc: int, n_img: int, side: int, requests: int) -> dict:
    breakdowns = []
    nbytes = 0
    for r in range(requests + 1):
        paths = make_images(tmp, side, n_img, seed=hash((backend, n_enc, r)) & 0xFFFF)
        result = epd.prefill("describe the images", paths)
        nbytes = result.received.nbytes
        if r:  # the first request warms connections, mappings and caches
            breakdowns.append(request_breakdown(result.spans))
    keys = sorted({k for b in breakdowns for k in b})
    med = {k: statistics.median(b.get(k, 0.0) for b in breakdowns) for k in keys}
    delivery = _delivery(epd, make_images(tmp, side, n_img, seed=0xD0D0 + n_img), requests)
    return {"backend": backend, "encoders": n_enc, "images": n_img, "side": side, "embedding_bytes": nbytes,
            "requests": requests, "e2e_ms": med.pop("e2e"), "control_plane_ms": med.pop("control_plane"),
            "control_plane_range_ms": [min(b["control_plane"] for b in breakdowns),
                                       max(b["control_plane"] for b in breakdowns)],
            "stages_ms": {s: med[s] for s in STAGES if s in med}, **delivery}


def warm_encoder_caches(encoder_urls: Sequence[str], backend: str, paths: list[str], transport: str = "auto") -> None:
    """Every encoder encodes every image once. The receiver hands each part to a random encoder, so warming
    through it would leave some later requests running the ViT on an encoder that has not seen the image."""
    for url in encoder_urls:
        with EmbeddingReceiver(ReceiverConfig([url], backend, timeout=60, transport=transport)) as one:
            one.receive(paths)


def _delivery(epd: EPDPrefill, paths: list[str], requests: int) -> dict:
    """Median wall time of `receive` for cached images (see the module docstring)."""
    rx = epd.receiver
    warm_encoder_caches(rx.config.encoder_urls, rx.config.backend, paths, rx.config.transport)
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        rx.receive(paths)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"delivery_ms": statistics.median(times), "delivery_range_ms": [min(times), max(times)]}


def _fmt(row: dict) -> str:
    stages = " ".join(f"{k}={v:.2f}" for k, v in row["stages_ms"].items())
    return (f"  {row['backend']:17s} enc={row['encoders']} img={row['images']}x{row['side']}px "
            f"{row['embedding_bytes'] / 2**20:7.2f} MiB  e2e {row['e2e_ms']:8.2f} ms  "
            f"control {row['control_plane_ms']:6.2f} ms  delivery {row['delivery_ms']:6.2f} ms  [{stages}]")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench epd", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--backends", default=",".join(VARIANTS))
    ap.add_argument("--encoders", default="1,2")
    ap.add_argument("--images", default="1,4")
    ap.add_argument("--sides", default="224,448,896")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--transport", default="auto")
    args = ap.parse_args(argv)
    result = run(tuple(args.backends.split(",")), _ints(args.encoders), _ints(args.images), _ints(args.sides),
                 args.requests, args.transport)
    if args.json:
        write_json(args.json, result)
    return 0
