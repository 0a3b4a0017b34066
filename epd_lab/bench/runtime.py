"""`epd-lab bench runtime`: the model runtimes ("hf", "fast") in one process, each call timed by wall clock and
by GPU busy time, with the bit checks that make the fast runtime usable for EPD.

For each model and runtime, on 448² images and a short text:
- ``vit_1x448``, ``vit_4x448``: `encode` of one and of four images (one call);
- ``prefill``: one image's prompt, `prefill` into blocks (embeddings ready);
- ``decode_c1``: one decode step of one sequence, the token read back (TPOT); ``decode_c16``: sixteen;
  ``decode_c1_sampled``, ``decode_c16_sampled`` (fast runtime): the same, each token drawn at temperature 1 with
  a seed on the logits' device (`epd_lab.models.sampling`) instead of the argmax;
- ``ttft``: preprocess (`models.preprocess` on the model's device) + encode + prefill + the first token read
  back, from a decoded 448² image (the monolithic TTFT); ``preprocess/hf_processor_1x448`` and
  ``preprocess/torch_1x448``: HF's PIL + numpy image processor against `preprocess` (the same bits), beside it.
Each is timed `--repeats` times (medians and ranges); on a GPU, the profiler then counts the kernels of
`--profile-repeats` more calls and sums their time: ``gpu_busy_ms`` and ``kernels`` per call, and
``wall_over_busy`` = median wall / busy. The runtimes alternate call by call, so both see the same host noise.
On a GPU the fast runtime's decode also runs with one graph per bucket (``fast_one_graph``), beside its graphs in
parts; the summary's ``staged_over_one_graph_wall`` holds the ratios of their walls.

Bits (``bits``): the fast runtime's vision tower on 4 images in one call against the images one by one, and its
split (images encoded in two parts, KV copied into other blocks as a transfer would) against its monolithic use,
prefill logits and 8 decode steps; and fast against hf (max abs difference over the largest logit).

    epd-lab bench runtime --device cuda --models qwen2-vl-2b,qwen2-vl-7b --json data/bench/runtime-h200-full.json \
        --summary data/bench/runtime-h200.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from PIL import Image
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from epd_lab.bench import read_json, write_json
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.machine import commit, machine_info
from epd_lab.models import build_input_ids, configure_torch, open_model, preprocess
from epd_lab.models.processor import image_processor
from epd_lab.models.runtime import RUNTIMES, open_runtime
from epd_lab.models.runtime.vision import VisionTower
from epd_lab.models.sampling import sample
from epd_lab.noise import noise_images
from epd_lab.trace import TRANSFER_STAGES

PROMPT = "Describe the picture in one sentence, then list what stands out."
VISION_BUDGETS = (1024, 2048, 4096)  # patch rows per vision call, measured beside the default
TOP_KERNELS = 6  # per measured call, the kernels that took the most GPU time
ONE_GRAPH = "fast_one_graph"  # the fast runtime with one graph per bucket (`staged_graphs=False`)
MAX_SEQ = 1024  # tokens a sequence may reach here: 4 x 448² images (1,024 image tokens) fit only in a prefill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def profile(fn: Callable[[], object], device: torch.device, repeats: int) -> dict:
    """Per call of `fn`, from the profiler (host ops and CUDA events): GPU busy time and kernel count, and where
    the rest of the wall time goes: ``host_lead_ms`` (call start → first kernel: the host's work before the GPU
    has any), ``gpu_idle_ms`` (gaps between the call's first kernel and its last), ``tail_ms`` (last kernel →
    the host seeing it), plus the kernels and the host ops (self time) that took most."""
    if device.type != "cuda":
        return {"gpu_busy_ms": None, "kernels": None, "top_kernels": []}
    fn()
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(repeats):
            with torch.profiler.record_function(f"epd_call_{i}"):
                fn()
                _sync(device)
    events = prof.events()
    # the CUDA timeline also holds each record_function range as an annotation: not a kernel
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith("epd_call_")), key=lambda e: e.time_range.start)
    calls = [e for e in events if e.name.startswith("epd_call_") and e.device_type == torch.autograd.DeviceType.CPU]
    lead, idle, tail = [], [], []
    for call in calls:
        start, end = call.time_range.start, call.time_range.end
        mine = [e for e in gpu if start <= e.time_range.start <= end]
        if not mine:
            continue
        covered, reach = 0, mine[0].time_range.start
        for e in mine:  # the union of the kernels' intervals: copies may overlap kernels
            s0, e0 = max(e.time_range.start, reach), e.time_range.end
            covered += max(0, e0 - s0)
            reach = max(reach, e0)
        lead.append(mine[0].time_range.start - start)
        idle.append(reach - mine[0].time_range.start - covered)
        tail.append(end - reach)
    busy_us = sum(e.time_range.elapsed_us() for e in gpu)
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    host = sorted((a for a in prof.key_averages() if a.device_type == torch.autograd.DeviceType.CPU
                   and not a.key.startswith("epd_call_")), key=lambda a: -a.self_cpu_time_total)[:TOP_KERNELS]
    return {"gpu_busy_ms": busy_us / 1e3 / repeats, "kernels": len(gpu) / repeats,
            "host_lead_ms": _median_ms(lead), "gpu_idle_ms": _median_ms(idle), "tail_ms": _median_ms(tail),
            "top_kernels": [{"name": name[:120], "ms": sum(us) / 1e3 / repeats, "count": len(us) / repeats}
                            for name, us in top],
            "top_host_ops": [{"name": a.key[:120], "self_ms": a.self_cpu_time_total / 1e3 / repeats,
                              "count": a.count / repeats} for a in host]}


def _median_ms(us: list[float]) -> float | None:
    return statistics.median(us) / 1e3 if us else None


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
    return noise_images([(size, size)] * n, seed)


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
        variants = {name: {} for name in runtimes}
        if device.type == "cuda" and "fast" in runtimes:  # its graphs launched whole, side by side with the parts
            variants[ONE_GRAPH] = {"staged_graphs": False}
        for name, options in variants.items():
            t0 = time.perf_counter()
            opened[name] = open_runtime("fast" if name == ONE_GRAPH else name, model, cache, **options)
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

            def step(batch: int, temperature: float = 0.0, rt=rt, states=states) -> None:
                rows = states[:batch]
                logits = rt.decode([s[0] for s in rows], [s[1] for s in rows], tables[:batch],
                                   [s[2] + 1 for s in rows])
                picks = sample(logits, [temperature] * batch, list(range(batch)), [s[1] for s in rows])
                for s, token in zip(rows, picks.tolist()):  # the tokens read back: TPOT's real cost
                    s[0] = token
                    s[1] += 1
                    s[2] = s[2] + 1 if s[2] + 2 < MAX_SEQ else prompt_len  # wrap: stay in the blocks

            def ttft(rt=rt) -> int:
                return int(rt.prefill(ids1, rt.encode(*preprocess(imgs[:1], device)), grid1,
                                      tables[0]).logits.argmax())

            calls[name] = {"decode_c1": lambda step=step: step(1), "decode_c16": lambda step=step: step(16)}
            if name == "fast":  # drawn at temperature 1 where the logits are (`models.sampling`), beside greedy
                calls[name].update({"decode_c1_sampled": lambda step=step: step(1, 1.0),
                                    "decode_c16_sampled": lambda step=step: step(16, 1.0)})
            if name != ONE_GRAPH:  # the same vision tower and prefill graph either way
                calls[name].update({"vit_1x448": lambda rt=rt: rt.encode(pv1, grid1),
                                    "vit_4x448": lambda rt=rt: rt.encode(pv4, grid4),
                                    "prefill": lambda rt=rt, emb1=emb1: rt.prefill(ids1, emb1, grid1, tables[0]),
                                    "ttft": ttft})
        tower = model.model.visual
        # from the same host tensors as the runtimes' encode: the pixels' copy to the GPU is in both
        calls["hf_batched_tower"] = {"vit_4x448": lambda: Qwen2VisionTransformerPretrainedModel.forward(
            tower, pv4.to(device), grid_thw=grid4.to(device))}
        calls["preprocess"] = {"hf_processor_1x448": lambda: image_processor()(images=imgs[:1], return_tensors="pt"),
                               "torch_1x448": lambda: preprocess(imgs[:1], device)}
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
                    f"kernels {entry['kernels']}, host lead {entry.get('host_lead_ms')}, GPU idle "
                    f"{entry.get('gpu_idle_ms')}, tail {entry.get('tail_ms')}; top: {top}; host: "
                    + ", ".join(f"{h['name'][:30]} {h['self_ms']:.3f}" for h in entry.get("top_host_ops", [])[:4]))
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


def split_overhead(e2e: dict, images: int = 1, image_size: int = 448) -> tuple[float | None, dict | None]:
    """From a `bench e2e` result: the split's TTFT over the floor's at concurrency 1 (p50, the first backend that
    ran the point) and the transfer spans on its critical path (ms); where the run paired split and floor
    requests (`bench e2e --pairs`), that backend's paired medians too (``paired``)."""
    rows = [r for r in e2e.get("rows", []) if r["images"] == images and r["image_size"] == image_size
            and r["concurrency"] == 1]
    floor = next((r for r in rows if r["path"] == "monolithic"), None)
    split = next((r for r in rows if r["path"] != "monolithic" and r.get("critical_path")), None)
    if floor is None or split is None:
        return None, None
    stages = {s["stage"]: s["median_ms"] for s in split["critical_path"]}
    spans = {"path": split["path"], **{k: stages.get(k) for k in TRANSFER_STAGES},
             "kv_transfer_4k_tokens_p50": e2e.get("kv_transfer", {}).get("ms", {}).get("p50")}
    pair = next((p for p in e2e.get("paired", []) if p["path"] == split["path"] and p["images"] == images
                 and p["image_size"] == image_size), None)
    if pair is not None:
        spans["paired"] = {"pairs": pair["pairs"], "split_minus_floor_ms": pair["split_minus_floor_ms"]["p50"],
                           "less_transfer_spans_ms": pair["split_minus_floor_less_spans_ms"]["p50"]}
    return split["ttft_ms"]["p50"] - floor["ttft_ms"]["p50"], spans


def summary(results: list[dict], machine: dict, e2e: dict | None = None) -> dict:
    """The summary keys (times in ms: `runtime-h200.json`'s) from the fast runtime's rows, and from `e2e` (a `bench e2e`
    result through the servers on the same machine) the split's overhead."""
    def fast(model: str, what: str, key: str = "median_ms", runtime: str = "fast") -> float | None:
        row = next((r for r in results if r["model"] == model), None)
        return None if row is None else row["runtimes"].get(runtime, {}).get(what, {}).get(key)

    def one_graph(model: str) -> dict:  # the staged graphs' walls over one graph's, measured side by side
        return {what: (fast(model, what) / whole if (whole := fast(model, what, runtime=ONE_GRAPH)) and
                       fast(model, what) else None) for what in ("decode_c1", "decode_c16")}

    main = "qwen2-vl-2b" if any(r["model"] == "qwen2-vl-2b" for r in results) else results[0]["model"]
    overhead, spans = split_overhead(e2e) if e2e else (None, None)
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
        "split_ttft_overhead_ms": overhead,
        "split_transfer_spans_ms": spans,
        "split_media": e2e.get("media", "data-uri") if e2e else None,  # how that run's requests carried images
        "vit_4x448": {"gpu_busy_ms": fast(main, "vit_4x448", "gpu_busy_ms"), "hf_batched_gpu_busy_ms": hf_busy,
                      "bit_identical_to_one_by_one": bits.get("vit_4_one_call_equals_one_by_one")},
        "staged_over_one_graph_wall": {r["model"]: one_graph(r["model"]) for r in results},
        # a seeded draw at temperature 1 on the logits' device instead of the argmax: the step's walls over greedy's
        "sampled_over_greedy_wall": {r["model"]: {f"decode_c{n}": (fast(r["model"], f"decode_c{n}_sampled") /
                                                                  fast(r["model"], f"decode_c{n}")
                                                                  if fast(r["model"], f"decode_c{n}_sampled") else None)
                                                  for n in (1, 16)} for r in results},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd-lab bench runtime`."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench runtime", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, qwen2-vl-2b, qwen2-vl-7b")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated of {', '.join(RUNTIMES)}")
    ap.add_argument("--repeats", type=int, default=16, help="timed calls of each (default 16)")
    ap.add_argument("--profile-repeats", type=int, default=8, help="profiled calls of each on a GPU (default 8)")
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--summary", help="write the summary keys here")
    ap.add_argument("--e2e", help="a `bench e2e` JSON of the same machine: the summary's split overhead")
    ap.add_argument("--summarize", metavar="FULL_JSON[,FULL_JSON...]",
                    help="measure nothing: rewrite --summary from these full JSONs (a model's first result counts; "
                         "the machine is the first file's) and --e2e")
    args = ap.parse_args(argv)
    e2e = read_json(args.e2e) if args.e2e else None
    if args.summarize:
        fulls = [read_json(path) for path in args.summarize.split(",")]
        results: list[dict] = []
        for full in fulls:
            results += [r for r in full["results"] if r["model"] not in {x["model"] for x in results}]
        out = summary(results, fulls[0]["machine"], e2e)
        print(out)
        if args.summary:
            write_json(args.summary, out)
        return 0
    configure_torch(threads=1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    machine = machine_info(gpu=device.type == "cuda")
    machine["commit"] = commit()  # the device's copy of the tree may carry an older .git: EPD_LAB_COMMIT
    results = [measure(m, device, dtype, args.runtimes.split(","), args.repeats, args.profile_repeats)
               for m in args.models.split(",")]
    out = {"machine": machine, "results": results, "summary": summary(results, machine, e2e)}
    print(out["summary"])
    if args.json:
        write_json(args.json, out)
    if args.summary:
        write_json(args.summary, out["summary"])
    return 0
