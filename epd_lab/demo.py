"""`epd-lab demo` (`make demo`): the transfer engine, E→P and E→P→D on loopback, then a report of the run.

1. Transfer: a peer process allocates and registers memory; this process writes into it with each
   path of the engine, checks the bytes landed (crc32 on both sides), shows a refused write outside
   the peer's registrations, and prints the peer's counters.
2. E→P: two encode servers (real processes) and the prefill role in this process; a few multimodal
   requests go through the seed's mooncake flow, each checked bit for bit against the monolithic
   model, and each request's latency is printed stage by stage.
3. E→P→D: 2 encoders + a prefill server + a decode server + the OpenAI-compatible proxy; chat
   requests through the official `openai` client, streamed, each answer checked against
   `model.generate`.

It ends by writing an offline HTML report of its run (`epd_lab.viz.html_report`): each request's
waterfall from its spans, the stage distributions and the tables printed above.
"""
from __future__ import annotations

import argparse
import datetime
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from epd_lab.transfer import RemoteAccessError, TransferEngine
from epd_lab.transfer.peer import PeerProcess

MiB = 1 << 20
REPORTS_DIR = Path(__file__).resolve().parents[1] / "data" / "reports"


def main(argv: list[str] | None = None) -> int:
    """`epd-lab demo [--report-dir DIR]`."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab demo", description=__doc__.split("\n")[0])
    ap.add_argument("--report-dir", type=Path, default=None,
                    help="where report.html goes (default: data/reports/demo-<UTC timestamp>/)")
    run(ap.parse_args(argv).report_dir)
    return 0


def run(report_dir: Path | str | None = None) -> Path:
    """The three parts of the demo, then the report of the run; returns the report's path."""
    print("== 1. transfer engine: one-sided writes into another process's registered memory ==")
    transfer = run_transfer()
    print("\n== 2. E→P: 2 encoders + prefill, mooncake backend ==")
    epd = run_epd()
    print("\n== 3. E→P→D: 2 encoders + prefill server + decode server + proxy, openai client ==")
    e2e = run_e2e()
    if report_dir is None:
        report_dir = REPORTS_DIR / datetime.datetime.now(datetime.timezone.utc).strftime("demo-%Y%m%dT%H%M%SZ")
    path = write_report(Path(report_dir) / "report.html", transfer, epd, e2e)
    print(f"\n== report of this run (offline HTML): {path}")
    return path


def run_transfer(nbytes: int = 64 * MiB, repeats: int = 5) -> list[dict[str, Any]]:
    """Write `nbytes` `repeats` times over each path and print what moved and how fast (also returned)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    want = zlib.crc32(src)
    rows = []
    with PeerProcess(protocol="tcp") as peer:
        print(f"peer process pid {peer.pid} listening at {peer.session_id}")
        targets = {"managed": peer.alloc(nbytes, managed=True), "external": peer.alloc(nbytes)}
        print(f"peer registered 2 x {nbytes // MiB} MiB: a managed (memfd) buffer at 0x{targets['managed']:x} "
              f"and a numpy array at 0x{targets['external']:x}")
        print(f"\n{'path':16s} {'target':9s} {'moved':>9s} {'median':>10s} {'bytes ok':>9s}")
        for protocol, target in (("shm", "managed"), ("shm", "external"), ("tcp", "external")):
            dst = targets[target]
            peer.call("fill", ptr=dst, nbytes=nbytes, value=0)
            with TransferEngine(protocol=protocol) as engine:
                engine.register_buffer(src)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    engine.transfer_sync_write(peer.session_id, src.ctypes.data, dst, nbytes)
                    times.append(time.perf_counter() - t0)
                path = engine.path_to(peer.session_id)
                ok = peer.checksum(dst, nbytes) == want
                name = "shm_registered" if path == "shm" and target == "external" else path
                gbps = nbytes / float(np.median(times)) / 1e9
                print(f"{name:16s} {target:9s} {repeats * nbytes // MiB:6d} MiB {gbps:6.2f} GB/s {str(ok):>9s}")
                rows.append({"path": name, "target": target, "moved MiB": repeats * nbytes // MiB,
                             "median GB/s": gbps, "bytes ok": ok})
                try:
                    engine.transfer_sync_write(peer.session_id, src.ctypes.data, dst + nbytes, 4096)
                except RemoteAccessError as exc:
                    refused = str(exc)
        print(f"\na write past the end of the peer's buffer: refused ({refused})")
        stats = peer.stats()
        print(f"peer counters: {stats['writes_in']} writes in, {stats['bytes_in'] // MiB} MiB in, "
              f"{stats['writes_refused']} refused, {stats['regions']} regions registered")
    return rows


REQUESTS = (  # (text, image sizes as (width, height))
    ("what is in this picture?", [(224, 224)]),
    ("compare these two", [(448, 448), (100, 333)]),
    ("describe each of them", [(500, 260), (224, 224), (56, 112)]),
    ("one more", [(640, 480)]),
)


def run_epd(encoders: int = 2, backend: str = "mooncake") -> dict[str, Any]:
    """Launch `encoders` encode servers, send `REQUESTS`, check each against the monolithic model.

    Returns the printed table (``rows``) and every request's spans (``spans``)."""
    import tempfile

    import torch
    from PIL import Image

    from epd_lab.ep.prefill import EPDPrefill, reference_prefill
    from epd_lab.launch import Cluster, Topology
    from epd_lab.models import configure_torch, load_model
    from epd_lab.noise import noise_images
    from epd_lab.trace import STAGES, request_breakdown

    configure_torch()
    model = load_model()
    rng = np.random.default_rng(0)
    rows, spans = [], []
    with tempfile.TemporaryDirectory(prefix="epd-demo-") as tmp, \
            Cluster(Topology(encoders=encoders, backend=backend)) as cluster, cluster.receiver() as rx:
        print(f"encoders: {', '.join(cluster.encoder_urls)}; prefill engine {rx.engine.session_id}")
        epd = EPDPrefill(rx, model)
        for i, (text, sizes) in enumerate(REQUESTS):
            paths = [f"{tmp}/r{i}_{j}.png" for j in range(len(sizes))]
            for path, image in zip(paths, noise_images(sizes, rng)):
                image.save(path)
            result = epd.prefill(text, paths, rid=f"demo{i}")
            ref = reference_prefill(model, text, [Image.open(p).convert("RGB") for p in paths])
            same = torch.equal(ref, result.prefill.logits)
            rows.append((result.rid, len(paths), len(result.received.parts), result.received.nbytes, same,
                         request_breakdown(result.spans)))
            spans += result.spans
        left = rx.engine.stats()["regions"]
    stages = [s for s in STAGES if any(s in b for *_, b in rows)]
    print(f"\n{'request':8s} {'imgs':>4s} {'parts':>5s} {'KiB':>6s} {'bit-equal':>9s} "
          + " ".join(f"{s:>11s}" for s in stages) + f" {'e2e':>7s} {'control':>7s}   (ms)")
    for rid, n_img, n_parts, nbytes, same, b in rows:
        print(f"{rid:8s} {n_img:4d} {n_parts:5d} {nbytes // 1024:6d} {str(same):>9s} "
              + " ".join(f"{b.get(s, 0.0):11.2f}" for s in stages) + f" {b['e2e']:7.2f} {b['control_plane']:7.2f}")
    print(f"\nregistrations left on the prefill engine: {left}; every process stopped")
    table = [{"request": rid, "images": n_img, "parts": n_parts, "KiB": nbytes // 1024, "bit-equal": same,
              **{s: b.get(s, 0.0) for s in stages}, "e2e": b["e2e"], "control": b["control_plane"]}
             for rid, n_img, n_parts, nbytes, same, b in rows]
    return {"rows": table, "spans": spans}


def run_e2e(max_tokens: int = 16) -> dict[str, Any]:
    """Chat through the proxy with the `openai` client (streaming); compare with `model.generate`.

    Returns the printed table (``rows``) and every request's spans from the proxy (``spans``)."""
    import time

    import httpx
    import msgspec
    import openai

    from epd_lab.launch import Cluster, Topology
    from epd_lab.models import configure_torch, load_model
    from epd_lab.noise import data_uri, random_png
    from epd_lab.servers.openai_api import MODEL_ID
    from epd_lab.servers.reference import monolithic_chat
    from epd_lab.trace import Span

    configure_torch()
    model = load_model()
    rng = np.random.default_rng(1)
    rows, all_spans = [], []
    with Cluster(Topology(encoders=2, prefills=1, decodes=1, proxy=True)) as cluster:
        print(f"proxy {cluster.proxy_url}; prefill {cluster.prefill_urls[0]}; decode {cluster.decode_urls[0]}")
        client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=120)
        for text, sizes in REQUESTS[:3]:
            content = [{"type": "image_url", "image_url": {"url": data_uri(random_png(rng, (h, w)))}}
                       for w, h in sizes] + [{"type": "text", "text": text}]
            messages = [{"role": "user", "content": content}]
            t0 = time.perf_counter()
            ttft, pieces, response_id = None, [], None
            for chunk in client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                        max_tokens=max_tokens, temperature=0, stream=True):
                response_id = chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(chunk.choices[0].delta.content)
            total = time.perf_counter() - t0
            timeline = httpx.get(f"{cluster.proxy_url}/v1/spans", params={"request_id": response_id}, timeout=10)
            spans = msgspec.convert(timeline.json()["spans"], list[Span])
            same = "".join(pieces) == monolithic_chat(model, messages, max_tokens)
            rows.append((response_id, len(sizes), ttft, total, same, _stage_ms(spans)))
            all_spans += spans
    stages = ("http_encode", "vit", "transfer", "prefill", "kv_transfer", "decode_step", "ttft")
    print(f"\n{'images':>6s} {'tokens':>6s} {'TTFT ms':>8s} {'total ms':>9s} {'same as generate':>17s}   "
          + " ".join(f"{s:>11s}" for s in stages) + "   (stages from the proxy's /v1/spans, ms)")
    for _, n_img, ttft, total, same, per_stage in rows:
        print(f"{n_img:6d} {max_tokens:6d} {ttft * 1e3:8.1f} {total * 1e3:9.1f} {str(same):>17s}   "
              + " ".join(f"{per_stage.get(s, 0.0):11.2f}" for s in stages))
    table = [{"request": rid, "images": n_img, "tokens": max_tokens, "TTFT ms": ttft * 1e3, "total ms": total * 1e3,
              "same as generate": same, **{s: per_stage.get(s, 0.0) for s in stages}}
             for rid, n_img, ttft, total, same, per_stage in rows]
    return {"rows": table, "spans": all_spans}


def _stage_ms(spans: list) -> dict[str, float]:
    """ms per stage of one request: parts in parallel count once (the longest), decode steps add up."""
    out: dict[str, float] = {}
    for s in spans:
        if s.stage == "decode_step":
            out[s.stage] = out.get(s.stage, 0.0) + s.duration_ms
        else:
            out[s.stage] = max(out.get(s.stage, 0.0), s.duration_ms)
    return out


def write_report(path: Path, transfer: list[dict[str, Any]], epd: dict[str, Any], e2e: dict[str, Any]) -> Path:
    """The run as one offline HTML file (the tables printed above, each request's waterfall, the stages),
    with its spans beside it as ``trace.json`` (Perfetto) and ``spans.parquet``."""
    import pandas as pd

    from epd_lab.trace import save_frame, spans_frame, to_chrome_trace
    from epd_lab.viz import html_report, stage_distributions, waterfalls

    epd_frame, e2e_frame = spans_frame(epd["spans"]), spans_frame(e2e["spans"])
    both = pd.concat([epd_frame.assign(flow="2. E→P"), e2e_frame.assign(flow="3. E→P→D")], ignore_index=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_chrome_trace(both, path.parent / "trace.json")
    save_frame(both, path.parent / "spans.parquet")
    e2e_rows = pd.DataFrame(e2e["rows"])
    e2e_titles = [f"{r['images']} image(s), {r['tokens']} tokens" for r in e2e["rows"]]  # sent one after another
    return html_report([
        ("About this run", "Written by `epd-lab demo` on loopback. Waterfalls: one bar per span, from the request's "
                           "first span (ms); hover a bar for its bytes. Tables: the same numbers the demo printed. "
                           "Beside this file: trace.json (open it in ui.perfetto.dev) and spans.parquet."),
        ("1. Transfer engine: one-sided writes into another process", pd.DataFrame(transfer)),
        ("2. E→P: stages per request (ms; parts in parallel count once, the longest)", pd.DataFrame(epd["rows"])),
        ("2. E→P: waterfalls", waterfalls(epd_frame, cols=2)),
        ("3. E→P→D: through the proxy (stages from its /v1/spans, ms)", e2e_rows),
        ("3. E→P→D: waterfalls", waterfalls(e2e_frame, cols=1, titles=e2e_titles)),
        ("Durations per stage, both flows", stage_distributions(both, color="flow")),
        ("Every span", both.drop(columns=["t_start_ns", "t_end_ns"])),
    ], path, title="epd_lab demo")
