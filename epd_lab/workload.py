"""A closed-loop E→P workload: N multimodal requests, C in flight, through the receiver and prefill.

`notebooks/05_sweep.ipynb` runs one point of a sweep with it:

    workload = Workload(requests=4, images_per_request=2, concurrency=2)
    outcomes = run_requests(EPDPrefill(rx, model), workload.images(tmp), workload)
    table = requests_table(outcomes, {0: bit_exact(model, workload.text, outcomes[0])})

Concurrency: `concurrency` threads share one `EPDPrefill`, as the prefill server's worker pool does;
`EmbeddingReceiver.receive` keeps its per-request state under a lock and each prefill holds KV blocks
of its own. Each worker takes the next request when its last one ends (closed loop).
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from PIL import Image

from epd_lab.ep.prefill import EPDPrefill, EPDResult, reference_prefill
from epd_lab.noise import noise_images
from epd_lab.trace import STAGES, request_breakdown, save_frame, to_chrome_trace


def make_images(directory: str, side: int, count: int, seed: int) -> list[str]:
    """`count` random RGB PNGs of `side`², distinct (so no encoder cache hit)."""
    paths = [os.path.join(directory, f"img_{side}_{seed}_{i}.png") for i in range(count)]
    for path, image in zip(paths, noise_images([(side, side)] * count, seed)):
        image.save(path)
    return paths


@dataclass(slots=True)
class Workload:
    """What to send: `requests` requests, each of `images_per_request` distinct random RGB PNGs of
    `image_size`², `concurrency` in flight, after one warm-up request that is not counted."""

    requests: int = 4
    images_per_request: int = 1
    image_size: int = 224
    concurrency: int = 1
    seed: int = 0
    text: str = "describe the images"

    def __post_init__(self) -> None:
        for name in ("requests", "images_per_request", "image_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def images(self, directory: str) -> list[list[str]]:
        """Image paths per request; index 0 is the warm-up. Deterministic in `seed`, distinct across
        requests (so no request hits the encoders' embedding cache)."""
        return [make_images(directory, self.image_size, self.images_per_request, seed=self.seed * 100_003 + i)
                for i in range(self.requests + 1)]


@dataclass
class RequestOutcome:
    """One request as the driver saw it; `result` is None when it failed (`error` says why)."""

    rid: str
    index: int
    paths: list[str]
    result: EPDResult | None = None
    error: str | None = None
    t_start_ns: int = 0  # the driver's CLOCK_MONOTONIC, the spans' clock
    t_end_ns: int = 0


def run_requests(epd: EPDPrefill, images: list[list[str]], workload: Workload) -> list[RequestOutcome]:
    """Warm up with `images[0]`, then send `images[1:]` with `workload.concurrency` in flight.

    Request ids are `req00000`, `req00001`, ... (fixed width, so they sort in sending order). A failed
    request is recorded, not raised; a failed warm-up raises (nothing would work).
    """
    epd.prefill(workload.text, images[0], rid="warmup")
    outcomes = [RequestOutcome(f"req{i:05d}", i, paths) for i, paths in enumerate(images[1:])]
    queue = iter(outcomes)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            item.t_start_ns = time.monotonic_ns()
            try:
                item.result = epd.prefill(workload.text, item.paths, rid=item.rid)
            except Exception as exc:  # a failed request is data for the sweep
                item.error = f"{type(exc).__name__}: {exc}"
            item.t_end_ns = time.monotonic_ns()

    threads = [threading.Thread(target=worker, name=f"workload-{i}") for i in range(workload.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def bit_exact(model: torch.nn.Module, text: str, outcome: RequestOutcome) -> bool:
    """Whether the request's E→P logits equal, bit for bit, the monolithic model's on the same inputs."""
    if outcome.result is None:
        return False
    ref = reference_prefill(model, text, [Image.open(p).convert("RGB") for p in outcome.paths])
    return torch.equal(ref, outcome.result.prefill.logits)


def requests_table(outcomes: list[RequestOutcome], exact: dict[int, bool]) -> pd.DataFrame:
    """One row per request: ok, error, parts, bytes, bit-exact (where checked) and its latency per
    stage (`request_breakdown`, ms: `<stage>_ms`, `e2e_ms`, `control_plane_ms`)."""
    rows = []
    for o in outcomes:
        row = {"request": o.rid, "index": o.index, "images": len(o.paths), "ok": o.result is not None,
               "error": o.error, "bit_exact": exact.get(o.index), "t_start_ns": o.t_start_ns,
               "t_end_ns": o.t_end_ns, "latency_ms": (o.t_end_ns - o.t_start_ns) / 1e6}
        if o.result is not None:
            row |= {"parts": len(o.result.received.parts), "embedding_bytes": o.result.received.nbytes}
            if o.result.spans:  # none when tracing is off (EPD_TRACE=0)
                row |= {f"{k}_ms": v for k, v in request_breakdown(o.result.spans).items()}
        rows.append(row)
    table = pd.DataFrame(rows)
    stages = [f"{s}_ms" for s in (*STAGES, "e2e", "control_plane") if f"{s}_ms" in table]
    rest = [c for c in table.columns if c not in stages]
    return table[rest + stages]


def point_record(parameters: dict, table: pd.DataFrame) -> dict:
    """The point's summary for `results.json`: parameters, counts, bit-exactness, throughput, and the
    median over completed requests of each `*_ms` column."""
    ok = table[table["ok"]]
    wall_s = (table["t_end_ns"].max() - table["t_start_ns"].min()) / 1e9
    checked = table["bit_exact"].dropna()
    record = {"parameters": parameters, "completed": len(ok), "failed": len(table) - len(ok),
              "verified": len(checked), "bit_exact": bool(len(checked) and checked.all()),
              "parts": int(ok["parts"].max()) if len(ok) else 0,
              "embedding_bytes": int(ok["embedding_bytes"].median()) if len(ok) else 0,
              "wall_s": wall_s, "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0}
    for col in (c for c in table.columns if c.endswith("_ms")):
        values = ok[col].dropna()
        record[col] = statistics.median(values) if len(values) else None
    record["errors"] = [{"request": r, "error": e} for r, e in zip(table["request"], table["error"])
                        if isinstance(e, str)]
    return record


def write_point(out_dir: str | Path, record: dict, table: pd.DataFrame, frame: pd.DataFrame) -> list[Path]:
    """Write `results.json`, `requests.csv`, `spans.parquet` and `trace.json` (Chrome/Perfetto) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("results.json", "requests.csv", "spans.parquet", "trace.json")]
    paths[0].write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    table.to_csv(paths[1], index=False)
    save_frame(frame, paths[2])
    to_chrome_trace(frame, paths[3])
    return paths


def _plain(value: object) -> object:
    """JSON for numpy scalars."""
    return value.item()
