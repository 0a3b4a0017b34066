"""`epd-lab bench runtime`: the model runtimes ("hf", "fast") in one process, each call timed by wall clock and
by GPU busy time, with the bit checks that make the fast runtime usable for EPD (issue 17).

For each model and runtime, on 448² images and a short text:
- ``vit_1x448``, ``vit_4x448``: `encode` of one and of four images (one call);
- ``prefill``: one image's prompt, `prefill` into blocks (embeddings ready);
- ``decode_c1``: one decode step of one sequence, the token read back (TPOT); ``decode_c16``: sixteen;
- ``ttft``: encode + prefill + the first token read back, from preprocessed pixels (the monolithic TTFT);
  ``preprocess_ms``: the CPU image processor, which that TTFT leaves out, measured beside it.
Each is timed `--repeats` times (medians and ranges); on a GPU, the profiler then counts the kernels of
`--profile-repeats` more calls and sums their time: ``gpu_busy_ms`` and ``kernels`` per call, and
``wall_over_busy`` = median wall / busy. The runtimes alternate call by call, so both see the same host noise.

Bits (``bits``): the fast runtime's vision tower on 4 images in one call against the images one by one, and its
split (images encoded in two parts, KV copied into other blocks as a transfer would) against its monolithic use,
prefill logits and 8 decode steps; and fast against hf (max abs difference over the largest logit).

    epd-lab bench runtime --device cuda --models qwen2-vl-2b,qwen2-vl-7b --json data/bench/runtime-h200-full.json \
        --summary data/bench/runtime-h200.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from epd_lab.bench import write_json
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models import build_input_ids, configure_torch, open_model, preprocess
from epd_lab.models.runtime import RUNTIMES, open_runtime
from epd_lab.models.runtime.vision import VisionTower

PROMPT = "Describe the picture in one sentence, then list what stands out."
VISION_BUDGETS = (1024, 2048, 4096)  # patch rows per vision call, measured beside the default
TOP_KERNELS = 6  # per measured call, the kernels that took the most GPU time
MAX_SEQ = 1024  # tokens a sequence may reach here: 4 x 448² images (1,024 image tokens) fit only in a prefill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def profile(fn: Callable[[], object], device: torch.device, repeats: int) -> dict:
    """GPU busy time and kernel count per call of `fn` (the profiler's CUDA events: kernels and copies)."""
    if device.type != "cuda":
        return {"gpu_busy_ms": None, "kernels": None, "top_kernels": []}
    fn()
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        _sync(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in events)
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {"gpu_busy_ms": busy_us / 1e3 / repeats, "kernels": len(events) / repeats,
            "top_kernels": [{"name": name[:120], "ms": sum(us) / 1e3 / repeats, "count": len(us) / repeats}
                            for name, us in top]}


class Timer:
    """Wall times of several named calls, taken in turns (a, b, a, b, ...) so that they share the host's noise."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.ms = device, {}

    def round(self, calls: dict[str, Callable[[], object]]) -> None:
        for name, fn in calls.items():
            _sync(self.device)
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            self.ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)


def _images(n: int, size: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _copy_blocks(cache: PagedKVCache, src: list[int], dst: list[int]) -> None:
    """Move blocks within the cache as a KV transfer would move them between two caches."""
    for i in range(cache.num_layers):
        for region in cache.layer(i):
            region[dst] = region[src]


def bit_checks(rt, hf, images: list[Image.Image], steps: int = 8) -> dict:
    """The fast runtime's bit contracts and its distance from hf; see the module docstring."""
    pixel_values, grid = preprocess(images)
    one_by_one = torch.cat([rt.encode(*preprocess([img])) for img in images])
    embeds = rt.encode(pixel_values, grid)
    ids = build_input_ids(PROMPT, grid.tolist())
    blocks = -(-(len(ids[0]) + steps) // rt.cache.block_size)
    mono_table, split_table, moved = (list(range(k * blocks, (k + 1) * blocks)) for k in range(3))

    def run(table: list[int], parts: torch.Tensor, move_to: list[int] | None) -> list[torch.Tensor]:
        out = rt.prefill(ids, parts, grid, table)
        if move_to is not None:
            _copy_blocks(rt.cache, table, move_to)
            table = move_to
        logits, token = [out.logits.float()], int(out.logits.argmax())
        for i in range(steps):
            row = rt.decode([token], [out.next_position + i], [table], [out.prompt_len + i + 1])[0]
            logits.append(row.float())
            token = int(row.argmax())
        return logits

    mono = run(mono_table, embeds, None)
    patches = int(grid[0].prod())
    split_embeds = torch.cat([rt.encode(pixel_values[:patches], grid[:1]), rt.encode(pixel_values[patches:], grid[1:])])
    split = run(split_table, split_embeds, moved)
    hf_logits = hf.prefill(ids, hf.encode(pixel_values, grid), grid, mono_table).logits.float()
    scale = float(hf_logits.abs().max())
    return {"vit_4_one_call_equals_one_by_one": bool(torch.equal(embeds, one_by_one)),
            "split_embeddings_equal": bool(torch.equal(split_embeds, embeds)),
            "split_logits_equal_monolithic": all(torch.equal(a, b) for a, b in zip(mono, split)),
            "split_tokens": [int(x.argmax()) for x in split], "monolithic_tokens": [int(x.argmax()) for x in mono],
            "fast_vs_hf_prefill_max_abs_over_max_logit": float((mono[0] - hf_logits).abs().max()) / scale}


def measure(model_name: str, device: torch.device, dtype: torch.dtype, runtimes: list[str], repeats: int,
            profile_repeats: int, log: Callable[[str], None] = print) -> dict:
    """Every measurement of the module docstring for one model; returns its JSON object."""
    t0 = time.perf_counter()
    model = open_model(model_name, dtype=dtype, device=device)
    log(f"{model_name}: opened in {time.perf_counter() - t0:.1f} s")
    imgs = _images(4, 448)
    pv1, grid1 = preprocess(imgs[:1])
    pv4, grid4 = preprocess(imgs)
    ids1 = build_input_ids(PROMPT, grid1.tolist())
    prompt_len = ids1.shape[1]
    per_seq = -(-MAX_SEQ // 16)
    result: dict = {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
                    "runtimes": {}}
    with PagedKVCache.from_config(model.config, num_blocks=per_seq * 20, dtype=dtype, device=device) as cache:
        opened = {}
        for name in runtimes:
            t0 = time.perf_counter()
            opened[name] = open_runtime(name, model, cache)
            log(f"{model_name}: runtime {name} opened in {time.perf_counter() - t0:.1f} s")
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(16)]
        timer = Timer(device)
        calls: dict[str, dict[str, Callable[[], object]]] = {}
        for name, rt in opened.items():
            emb1 = rt.encode(pv1, grid1)
            states = []
            for table in tables:  # 16 sequences, each prefilled into its own blocks
                out = rt.prefill(ids1, emb1, grid1, table)
                states.append([int(out.logits.argmax()), out.next_position, out.prompt_len])

            def step(batch: int, rt=rt, states=states) -> None:
                rows = states[:batch]
                logits = rt.decode([s[0] for s in rows], [s[1] for s in rows], tables[:batch],
                                   [s[2] + 1 for s in rows])
                for s, token in zip(rows, logits.argmax(-1).tolist()):  # the tokens read back: TPOT's real cost
                    s[0] = token
                    s[1] += 1
                    s[2] = s[2] + 1 if s[2] + 2 < MAX_SEQ else prompt_len  # wrap: stay in the blocks

            def ttft(rt=rt) -> int:
                return int(rt.prefill(ids1, rt.encode(pv1, grid1), grid1, tables[0]).logits.argmax())

            calls[name] = {"vit_1x448": lambda rt=rt: rt.encode(pv1, grid1),
                           "vit_4x448": lambda rt=rt: rt.encode(pv4, grid4),
                           "prefill": lambda rt=rt, emb1=emb1: rt.prefill(ids1, emb1, grid1, tables[0]),
                           "decode_c1": lambda step=step: step(1), "decode_c16": lambda step=step: step(16),
                           "ttft": ttft}
        tower = model.model.visual
        # from the same host tensors as the runtimes' encode: the pixels' copy to the GPU is in both
        calls["hf_batched_tower"] = {"vit_4x448": lambda: Qwen2VisionTransformerPretrainedModel.forward(
            tower, pv4.to(device), grid_thw=grid4.to(device))}
        calls["cpu"] = {"preprocess_1x448": lambda: preprocess(imgs[:1])}
        if device.type == "cuda":  # the vision budget's trade: one image's latency against four images' work
            towers = {budget: VisionTower(tower, budget) for budget in VISION_BUDGETS}
            calls["vision_budget"] = {f"vit_{n}x448@{budget}": lambda n=n, t=t: t.encode(*((pv1, grid1) if n == 1
                                                                                           else (pv4, grid4)))
                                      for budget, t in towers.items() for n in (1, 4)}
        flat = {f"{rt}/{what}": fn for rt, table in calls.items() for what, fn in table.items()}
        with torch.no_grad():
            for fn in flat.values():  # warm-up: allocation, kernel selection, Triton's compile
                fn()
            for _ in range(repeats):
                timer.round(flat)
            for key, fn in flat.items():
                rt_name, what = key.split("/", 1)
                entry = {**_stats(timer.ms[key]), **profile(fn, device, profile_repeats)}
                if entry["gpu_busy_ms"]:
                    entry["wall_over_busy"] = entry["median_ms"] / entry["gpu_busy_ms"]
                result["runtimes"].setdefault(rt_name, {})[what] = entry
                top = ", ".join(f"{k['name'][:40]} {k['ms']:.3f}" for k in entry["top_kernels"][:3])
                log(f"{model_name} {key}: {entry['median_ms']:.2f} ms wall, busy {entry['gpu_busy_ms']}, "
                    f"kernels {entry['kernels']}; top: {top}")
            if "fast" in opened and "hf" in opened:
                result["bits"] = bit_checks(opened["fast"], opened["hf"], imgs)
                log(f"{model_name} bits: {result['bits']}")
        if "fast" in opened and opened["fast"].graphs is not None:
            result["graph_capture_s"] = {"decode": opened["fast"].graphs.capture_s,
                                         "prefill": opened["fast"].prefill_graphs.capture_s}
        for rt in opened.values():
            rt.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def summary(results: list[dict], machine: dict) -> dict:
    """The issue's summary keys (times in ms) from the fast runtime's rows."""
    def fast(model: str, what: str, key: str = "median_ms") -> float | None:
        row = next((r for r in results if r["model"] == model), None)
        return None if row is None else row["runtimes"].get("fast", {}).get(what, {}).get(key)

    main = "qwen2-vl-2b" if any(r["model"] == "qwen2-vl-2b" for r in results) else results[0]["model"]
    c1, c16 = fast(main, "decode_c1"), fast(main, "decode_c16")
    bits = next((r.get("bits", {}) for r in results if r["model"] == main), {})
    hf_busy = next((r["runtimes"]["hf_batched_tower"]["vit_4x448"]["gpu_busy_ms"] for r in results
                    if r["model"] == main), None)
    return {
        "gpu": machine.get("gpu"), "runtime": "fast", "commit": machine.get("commit"),
        "wall_over_gpu_busy": {"vit": fast(main, "vit_1x448", "wall_over_busy"),
                               "prefill": fast(main, "prefill", "wall_over_busy"),
                               "decode_step": fast(main, "decode_c1", "wall_over_busy")},
        "tpot_ms_c1": {r["model"]: fast(r["model"], "decode_c1") for r in results},
        "decode_tokens_per_s": {"c1": None if c1 is None else 1e3 / c1, "c16": None if c16 is None else 16e3 / c16},
        "monolithic_ttft_ms": fast(main, "ttft"),
        "split_ttft_overhead_ms": None,  # through the servers: bench e2e's job, not run with this runtime yet
        "split_transfer_spans_ms": None,
        "vit_4x448": {"gpu_busy_ms": fast(main, "vit_4x448", "gpu_busy_ms"), "hf_batched_gpu_busy_ms": hf_busy,
                      "bit_identical_to_one_by_one": bits.get("vit_4_one_call_equals_one_by_one")},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd-lab bench runtime`."""
    ap = argparse.ArgumentParser(prog="epd-lab bench runtime", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, qwen2-vl-2b, qwen2-vl-7b")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated of {', '.join(RUNTIMES)}")
    ap.add_argument("--repeats", type=int, default=16, help="timed calls of each (default 16)")
    ap.add_argument("--profile-repeats", type=int, default=8, help="profiled calls of each on a GPU (default 8)")
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--summary", help="write the issue's summary keys here")
    args = ap.parse_args(argv)
    configure_torch(threads=1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        from epd_lab.bench.transfer_cuda import machine_info
    else:
        from epd_lab.bench.transfer import machine_info
    machine = machine_info()
    try:
        machine["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        machine["commit"] = None
    results = [measure(m, device, dtype, args.runtimes.split(","), args.repeats, args.profile_repeats)
               for m in args.models.split(",")]
    out = {"machine": machine, "results": results, "summary": summary(results, machine)}
    print(out["summary"])
    if args.json:
        write_json(args.json, out)
    if args.summary:
        write_json(args.summary, out["summary"])
    return 0
