"""`epd-lab bench e2e`: TTFT, TPOT and requests/s, monolithic vs E→P→D through the proxy.

- ``monolithic``: one process, the same model, the same prompt (the chat template the proxy renders, so the
  same 140 tokens); TTFT = PNG decode + preprocessing + the ViT + one forward (the first token), TPOT = one
  decode step on that cache. No HTTP: this is the floor.
- ``epd/<backend>``: 2 encoders + a prefill server + a decode server + the proxy, on loopback; requests
  go through the official `openai` client, streamed; TTFT = until the first content chunk, TPOT = the
  rest divided by the remaining tokens. Concurrency 1, 4, 16 (threads), `--requests` per level.
- ``kv_transfer``: a 512-token text prompt prefilled and decoded by the servers directly; the decode
  server's `kv_transfer` span (side-channel round trip + one batch write) and its bytes.

Every request is one 224² image plus text, `--max-tokens` greedy tokens; the first request of each
level is a warm-up.
"""
from __future__ import annotations

import argparse
import base64
import io
import statistics
import threading
import time
import uuid
from typing import NamedTuple

import httpx
import numpy as np
import pandas as pd
from PIL import Image

from epd_lab.bench import write_json
from epd_lab.bench.transfer import machine_info
from epd_lab.ep.messages import BACKENDS
from epd_lab.launch import Cluster, Topology
from epd_lab.models import (
    DecodeRunner,
    PrefillRunner,
    VisionEncoder,
    build_input_ids,
    configure_torch,
    load_model,
    preprocess,
)
from epd_lab.servers.text import messages_to_prompt
from epd_lab.trace import critical_path, summarize_critical_paths

TEXT = "what is in this picture?"
# the text around the image as the proxy renders the chat request (`messages_to_prompt`): the floor prefills it too
PROMPT, _ = messages_to_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}},
                                                             {"type": "text", "text": TEXT}]}])
CONCURRENCY = (1, 4, 16)


def _image(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _summary(values: list[float]) -> dict:
    q = np.percentile(values, [50, 90, 99])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "n": len(values)}


def monolithic(requests: int, max_tokens: int) -> dict:
    """The floor: TTFT and TPOT of the same model in this process, one request at a time."""
    configure_torch()
    model = load_model()
    prefill, decode, vision = PrefillRunner(model), DecodeRunner(model), VisionEncoder(model)
    ttft, tpot = [], []
    for r in range(requests + 1):
        raw = _image(1000 + r)
        t0 = time.perf_counter()
        pixel_values, grid = preprocess([Image.open(io.BytesIO(raw)).convert("RGB")])
        result = prefill.prefill(build_input_ids(PROMPT, grid.tolist()), vision.encode(pixel_values, grid), grid)
        token = int(result.logits.argmax(-1))
        t1 = time.perf_counter()
        for i in range(max_tokens - 1):
            token = int(decode.step(token, result.past_key_values, result.next_position + i).argmax(-1))
        t2 = time.perf_counter()
        if r:
            ttft.append((t1 - t0) * 1e3)
            tpot.append((t2 - t1) * 1e3 / max(1, max_tokens - 1))
    return {"path": "monolithic", "concurrency": 1, "ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot),
            "requests_per_s": 1e3 / (statistics.median(ttft) + statistics.median(tpot) * (max_tokens - 1))}


class _Chat(NamedTuple):
    """One streamed request as the client saw it (ms)."""

    ttft: float
    tpot: float  # after the first content chunk, per further token
    second: float  # from the first content chunk to the second
    response_id: str


def _chat(client, raw: bytes, max_tokens: int) -> _Chat:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
               {"type": "text", "text": TEXT}]
    t0 = time.perf_counter()
    times, rid = [], ""
    for chunk in client.chat.completions.create(model="epd-lab-tiny-qwen2-vl", messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, temperature=0, stream=True):
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    end = time.perf_counter()
    if len(times) < 2:
        raise RuntimeError("the proxy streamed fewer than two content chunks")
    return _Chat((times[0] - t0) * 1e3, (end - times[0]) * 1e3 / max(1, max_tokens - 1),
                 (times[1] - times[0]) * 1e3, rid)


def epd(backend: str, requests: int, max_tokens: int, log=print, pipelined: bool = False) -> list[dict]:
    """E→P→D through the proxy at each concurrency level (`pipelined`: decode asked while prefill runs)."""
    import openai

    rows = []
    with Cluster(Topology(encoders=2, backend=backend, prefills=1, decodes=1, proxy=True, timeout=60,
                          pipelined=pipelined)) as cluster:
        client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=300)
        _chat(client, _image(0), max_tokens)  # warm-up: connections, mappings, caches
        for conc in CONCURRENCY:
            n = max(requests, conc)
            results: list[_Chat] = []
            lock = threading.Lock()
            seeds = iter(range(n))

            def worker() -> None:
                while True:
                    with lock:
                        seed = next(seeds, None)
                    if seed is None:
                        return
                    out = _chat(client, _image(10_000 * conc + seed), max_tokens)
                    with lock:
                        results.append(out)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker) for _ in range(conc)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            rows.append({"path": f"epd/{backend}" + (" (pipelined)" if pipelined else ""), "concurrency": conc,
                         "ttft_ms": _summary([r.ttft for r in results]), "tpot_ms": _summary([r.tpot for r in results]),
                         "second_token_ms": _summary([r.second for r in results]),
                         "requests_per_s": len(results) / wall})
            log(_fmt(rows[-1]))
            if conc == 1:
                frame, ids = cluster.spans(), [r.response_id for r in results]
                rows[-1]["critical_path"] = path = _critical_path(frame, ids)
                rows[-1]["gaps"] = gaps = _gaps(frame, ids)
                log(_fmt_path(path, gaps))
    return rows


def _critical_path(frame: pd.DataFrame, response_ids: list[str]) -> list[dict]:
    """Per stage, the ms on the TTFT's critical path over `response_ids` (`trace.summarize_critical_paths`)."""
    table = summarize_critical_paths(frame, response_ids)
    return [{"stage": stage, **{k: float(v) for k, v in row.items()}} for stage, row in table.iterrows()]


def _gaps(frame: pd.DataFrame, response_ids: list[str]) -> list[dict]:
    """The gaps of the TTFT's critical path by where they lie (``between``): median ms over the requests
    (0 where a request has no such gap), largest first."""
    per_request = [critical_path(frame, rid).query("kind == 'gap'").groupby("between")["dur_ms"].sum()
                   for rid in response_ids]
    table = pd.DataFrame(per_request).fillna(0.0)
    return [{"between": b, "median_ms": float(table[b].median()), "max_ms": float(table[b].max())}
            for b in table.median().sort_values(ascending=False).index]


def _fmt_path(path: list[dict], gaps: list[dict]) -> str:
    lines = ["    TTFT critical path at concurrency 1 (median ms [range], % of TTFT):"]
    lines += [f"      {p['stage']:14s} {p['median_ms']:7.2f} [{p['min_ms']:6.2f} .. {p['max_ms']:6.2f}]  "
              f"{p['median_pct']:5.1f}%" for p in path]
    lines += ["    its gaps, where they lie (median ms, max):"]
    lines += [f"      {g['between']:28s} {g['median_ms']:6.2f}  {g['max_ms']:6.2f}" for g in gaps if g["max_ms"] > 0.05]
    return "\n".join(lines)


def kv_transfer(requests: int) -> dict:
    """The decode server's `kv_transfer` span for a 512-token prompt (prefill and decode called directly)."""
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, timeout=60)) as cluster:
        p, d = cluster.prefill_urls[0], cluster.decode_urls[0]
        ms, nbytes, blocks = [], 0, 0
        with httpx.Client(timeout=120) as http:
            for r in range(requests + 1):
                rid = uuid.uuid4().hex
                pr = http.post(p + "/v1/prefill", json={"request_id": rid, "prompt": "x" * 512, "images": [],
                                                        "kv_transfer_params": {"do_remote_decode": True}}).json()
                dr = http.post(d + "/v1/decode", json={"request_id": rid, "max_tokens": 2, "temperature": 0.0,
                                                       "seed": None, "stream": False,
                                                       "kv_transfer_params": pr["kv_transfer_params"]}).json()
                span = next(s for s in dr["spans"] if s[2] == "kv_transfer")
                if r:
                    ms.append((span[5] - span[4]) / 1e6)
                nbytes, blocks = span[6], pr["kv_transfer_params"]["num_blocks"]
    return {"prompt_tokens": pr["prompt_len"], "blocks": blocks, "bytes": nbytes, "ms": _summary(ms)}


def _fmt(row: dict) -> str:
    return (f"  {row['path']:26s} conc={row['concurrency']:<3d} TTFT p50 {row['ttft_ms']['p50']:8.2f} "
            f"p90 {row['ttft_ms']['p90']:8.2f}  TPOT p50 {row['tpot_ms']['p50']:7.2f} ms  "
            f"{row['requests_per_s']:6.2f} req/s")


def run(backends: tuple[str, ...], requests: int, max_tokens: int, log=print, pipelined: bool = False) -> dict:
    """Measure; returns ``{"machine", "rows", "kv_transfer", "ttft_overhead_ms"}``. `pipelined`: each backend
    also with decode asked while prefill runs, beside the default path."""
    rows = [monolithic(requests, max_tokens)]
    log(_fmt(rows[0]))
    for backend in backends:
        rows += epd(backend, requests, max_tokens, log)
        if pipelined:
            rows += epd(backend, requests, max_tokens, log, pipelined=True)
    kv = kv_transfer(requests)
    log(f"  kv_transfer: {kv['prompt_tokens']} tokens, {kv['blocks']} blocks, {kv['bytes']} bytes, "
        f"p50 {kv['ms']['p50']:.3f} ms (p90 {kv['ms']['p90']:.3f})")
    mono = rows[0]["ttft_ms"]["p50"]
    overhead = {r["path"]: r["ttft_ms"]["p50"] - mono for r in rows[1:] if r["concurrency"] == 1}
    for path, ms in overhead.items():
        log(f"  TTFT overhead over monolithic at concurrency 1, {path}: {ms:.2f} ms (target <= 3 ms)")
    step = rows[0]["tpot_ms"]["p50"]
    for r in rows[1:]:
        if r["concurrency"] == 1:
            gap = next(p for p in r["critical_path"] if p["stage"] == "gap")
            log(f"  {r['path']}: time covered by no span {gap['median_pct']:.1f}% of TTFT (median; "
                f"{gap['min_pct']:.1f}..{gap['max_pct']:.1f}%; target <= 10%); second token "
                f"{r['second_token_ms']['p50']:.2f} ms after the first, monolithic decode step {step:.2f} ms")
    return {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "max_tokens": max_tokens, "rows": rows, "kv_transfer": kv, "ttft_overhead_ms": overhead}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epd-lab bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least the level)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pipelined", action="store_true",
                    help="also measure each backend with decode asked while prefill runs")
    args = ap.parse_args(argv)
    result = run(tuple(args.backends.split(",")), args.requests, args.max_tokens, pipelined=args.pipelined)
    if args.json:
        write_json(args.json, result)
    return 0
