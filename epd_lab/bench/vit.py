"""`epd-lab bench vit`: what the image-invariant vision tower costs, and whether this CPU needs it.

For float32 and bfloat16, on the tiny model, with images of three sizes:
- ``kernels``: the unchanged (batched) tower run over all images at once against each image alone; the largest
  difference says whether this machine's matrix kernels give a row bits that depend on the other rows of the
  call (0 on the AMD EPYC here; not 0 on Intel Xeons with AVX-512). The image-invariant tower's
  difference must be 0 everywhere.
- ``encoder``: `VisionEncoder.encode` of one part (2 images), batched tower against per-image tower.
- ``monolithic``: `monolithic_prefill` over all images (tower + LLM prefill), batched against per-image.

Batched and per-image calls alternate, `--repeats` each; medians and ranges in ms. One thread, as every role.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from PIL import Image
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from epd_lab.bench import write_json
from epd_lab.machine import machine_info
from epd_lab.models import (
    VisionEncoder,
    build_input_ids,
    configure_torch,
    load_model,
    monolithic_prefill,
    preprocess,
)
from epd_lab.models.vision import PerImageVisionTower
from epd_lab.noise import noise_images

SIZES = ((224, 224), (100, 333), (500, 260), (56, 112))  # 64, 48, 162 and 8 image tokens, as tests/test_vision.py


@contextlib.contextmanager
def batched_tower(model: torch.nn.Module) -> Iterator[None]:
    """Within: `model`'s vision tower is HF's own again, all images of a call in one batch (the old path)."""
    tower = model.model.visual
    tower.__class__ = Qwen2VisionTransformerPretrainedModel
    try:
        yield
    finally:
        tower.__class__ = PerImageVisionTower


def images(seed: int = 0) -> list[Image.Image]:
    """Random RGB images of SIZES."""
    return noise_images(SIZES, seed)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def kernel_check(model: torch.nn.Module, imgs: list[Image.Image]) -> dict:
    """All images in one call against each alone: the batched tower's and the per-image tower's difference."""
    vision = VisionEncoder(model)
    pixel_values, grid = preprocess(imgs)
    alone = torch.cat([vision.encode(*preprocess([img])) for img in imgs])
    with batched_tower(model):
        batched = vision.encode(pixel_values, grid)
    per_image = vision.encode(pixel_values, grid)
    return {"batched_vs_alone_max_abs": _max_diff(batched, alone),
            "per_image_vs_alone_max_abs": _max_diff(per_image, alone)}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def compare(model: torch.nn.Module, fn: Callable[[], object], repeats: int) -> dict:
    """`fn` with the batched tower and with the per-image tower, alternating; per-image/batched of medians."""
    fn()  # warm both paths once: first calls pay for allocation and kernel selection
    with batched_tower(model):
        fn()
    batched, per_image = [], []
    for _ in range(repeats):
        with batched_tower(model):
            batched.append(_timed(fn))
        per_image.append(_timed(fn))
    out = {"batched": _stats(batched), "per_image": _stats(per_image)}
    out["ratio"] = out["per_image"]["median_ms"] / out["batched"]["median_ms"]
    return out


@torch.inference_mode()
def run(repeats: int = 30) -> dict:
    """Measure both dtypes; returns the JSON document."""
    configure_torch()
    imgs = images()
    result: dict = {"machine": {**machine_info(), "torch": torch.__version__,
                                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "image_sizes": [list(s) for s in SIZES], "dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(dtype=dtype)
        vision = VisionEncoder(model)
        part = preprocess(imgs[:2])
        pixel_values, grid = preprocess(imgs)
        input_ids = build_input_ids("what is in these pictures?", grid.tolist())
        name = str(dtype).removeprefix("torch.")
        result["dtypes"][name] = row = {
            "kernels": kernel_check(model, imgs),
            "encoder_part_2_images": compare(model, lambda: vision.encode(*part), repeats),
            "monolithic_prefill_4_images": compare(
                model, lambda: monolithic_prefill(model, input_ids, pixel_values, grid), repeats),
        }
        print(f"{name:9s} kernels: batched vs alone {row['kernels']['batched_vs_alone_max_abs']:.3g}, "
              f"per-image vs alone {row['kernels']['per_image_vs_alone_max_abs']:.3g}")
        for key in ("encoder_part_2_images", "monolithic_prefill_4_images"):
            r = row[key]
            print(f"{name:9s} {key:28s} batched {r['batched']['median_ms']:7.2f} ms "
                  f"[{r['batched']['min_ms']:.2f}-{r['batched']['max_ms']:.2f}]  per-image "
                  f"{r['per_image']['median_ms']:7.2f} ms [{r['per_image']['min_ms']:.2f}-"
                  f"{r['per_image']['max_ms']:.2f}]  ratio {r['ratio']:.3f}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd-lab bench vit`."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench vit", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30, help="timed calls of each path (default 30)")
    ap.add_argument("--json", help="write the result here (e.g. data/bench/vit.json)")
    args = ap.parse_args(argv)
    result = run(args.repeats)
    if args.json:
        write_json(args.json, result)
    return 0
