"""Prefill wall of the fast runtime under two bucket schemes, side by side: the
prompt-length buckets in steps of 512 past 512 (`graph.token_buckets`' default) against powers of two, 2B bf16 on a
GPU, 1/4/8 x 448² prompts, the schemes alternating call by call; the host read of the argmax included.

    python scripts/prefill_buckets_ab.py OUT.json
"""
import json
import statistics
import sys
import time

import torch

import epd_lab.models.runtime.graph as graph
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models import build_input_ids, open_model, preprocess
from epd_lab.models.runtime import open_runtime
from epd_lab.noise import noise_images

steps = graph.token_buckets
model = open_model("qwen2-vl-2b", dtype=torch.bfloat16, device="cuda")
res = {}
with PagedKVCache.from_config(model.config, num_blocks=600, dtype=torch.bfloat16, device="cuda") as cache:
    rts = {"steps_of_512": open_runtime("fast", model, cache)}
    graph.token_buckets = lambda n, smallest=64: steps(n, smallest, step=1 << 30)  # powers of two only
    rts["powers_of_two"] = open_runtime("fast", model, cache)
    for n in (1, 4, 8):
        pv, grid = preprocess(noise_images([(448, 448)] * n, 1), "cuda")
        ids = build_input_ids("Describe the pictures.", grid.tolist())
        emb = rts["steps_of_512"].encode(pv, grid)
        table = list(range(-(-ids.shape[1] // 16)))
        times, tokens = {k: [] for k in rts}, {}
        for _ in range(18):
            for k, rt in rts.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tokens[k] = int(rt.prefill(ids, emb, grid, table).logits.argmax())
                times[k].append((time.perf_counter() - t0) * 1e3)
        res[f"{n}x448"] = {"prompt_tokens": ids.shape[1], "same_token": len(set(tokens.values())) == 1,
                           **{k: {"median_ms": statistics.median(v[2:]), "min_ms": min(v[2:]), "max_ms": max(v[2:]),
                                  "n": len(v) - 2} for k, v in times.items()}}
out = {"gpu": torch.cuda.get_device_name(0), "prefill_wall_by_buckets": res}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res))
