"""The requests `epd-lab bench serve` sends: three multimodal datasets, each a list of `SampleRequest`.

- ``random-mm`` (vLLM's): random text of ``input_len`` characters (± ``range_ratio``), and a number of images per
  request drawn uniformly from ``base_items`` ± ``items_range_ratio`` (at most ``limit_items``), each image's
  (height, width) drawn from a bucket config ``{(h, w, 1): probability}``.
- ``image`` (SGLang's): ``image_count`` images of one resolution (``448x448``, or 360p, 720p, 1080p, 4k) per request.
- ``image-repeat``: one image of one resolution per request, some of them sent before (an embedding cache's
  workload): a share ``repeat_fraction`` of the requests, at random places after the first, repeat an earlier
  image (drawn from the last ``pool_size`` distinct ones), or, with ``zipf`` = s, every image is drawn from a pool
  of ``pool_size`` by Zipf's law (the k-th most popular with probability ∝ k^-s).
- ``jsonl``: one request a line, ``{"prompt": str, "images": [path or http(s) URL, ...], "output_len": int}``
  (``images`` and ``output_len`` optional): a sample of a real dataset (VisionArena, MMMU) that the user fetched.

Generated images are random RGB noise (every one distinct but the repeats of ``image-repeat``, so that no server's
embedding cache is hit otherwise), held as
PNG bytes: the bench sends them as data: URIs or through its media server (`MediaServer`), as asked. A local path
in a JSONL file is read into bytes the same way; an http(s) URL is sent as it is.
"""
from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epd_lab.noise import random_png

DATASETS = ("random-mm", "image", "image-repeat", "jsonl")
RESOLUTIONS = {"360p": (360, 640), "720p": (720, 1280), "1080p": (1080, 1920), "4k": (2160, 3840)}
MIN_SIDE = 56  # the Qwen2-VL processor's smallest side
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


@dataclass(slots=True)
class SampleRequest:
    """One request: its text, its images (PNG bytes, or an http(s) URL sent as it is) and how many tokens to ask."""

    prompt: str
    images: list[bytes | str] = field(default_factory=list)
    output_len: int = 16


def random_text(rng: np.random.Generator, length: int) -> str:
    """`length` characters of lowercase words (the tiny model's tokenizer reads one token per byte)."""
    return rng.choice(_LETTERS, size=length).tobytes().decode()


def _around(rng: np.random.Generator, base: int, ratio: float, low: int = 1) -> int:
    """An integer drawn uniformly from ``[base (1 - ratio), base (1 + ratio)]``, at least `low` (vLLM's range ratio)."""
    lo, hi = max(low, math.floor(base * (1 - ratio))), max(low, math.ceil(base * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))


def parse_buckets(text: str | Mapping) -> dict[tuple[int, int], float]:
    """A bucket config, ``{(height, width, 1): probability}`` (a Python literal, as vLLM's flag) → ``{(h, w): p}``,
    the probabilities normalized. `ValueError` for video buckets (frames > 1), sides under 56 or no weight."""
    raw = ast.literal_eval(text) if isinstance(text, str) else dict(text)
    buckets: dict[tuple[int, int], float] = {}
    for key, weight in raw.items():
        if len(key) != 3 or key[2] != 1:
            raise ValueError(f"bucket {key}: only images, (height, width, 1)")
        if min(key[:2]) < MIN_SIDE:
            raise ValueError(f"bucket {key}: sides must be >= {MIN_SIDE}")
        if weight < 0:
            raise ValueError(f"bucket {key}: a negative probability")
        buckets[(int(key[0]), int(key[1]))] = buckets.get((int(key[0]), int(key[1])), 0.0) + float(weight)
    total = sum(buckets.values())
    if not total > 0:
        raise ValueError("the bucket config has no positive probability")
    return {k: v / total for k, v in buckets.items()}


def parse_resolution(text: str) -> tuple[int, int]:
    """``448x448`` (height x width) or one of 360p, 720p, 1080p, 4k → (height, width)."""
    if text in RESOLUTIONS:
        return RESOLUTIONS[text]
    height, sep, width = text.lower().partition("x")
    if not sep or not height.isdigit() or not width.isdigit() or min(int(height), int(width)) < MIN_SIDE:
        raise ValueError(f"image resolution {text!r}: HEIGHTxWIDTH (sides >= {MIN_SIDE}) or one of "
                         f"{', '.join(RESOLUTIONS)}")
    return int(height), int(width)


def random_mm(num_prompts: int, seed: int = 0, input_len: int = 64, output_len: int = 16, range_ratio: float = 0.0,
              base_items: int = 1, items_range_ratio: float = 0.0, limit_items: int = 8,
              buckets: Mapping[tuple[int, int], float] | None = None) -> list[SampleRequest]:
    """vLLM's ``random-mm``: see the module docstring (`buckets` as `parse_buckets` gives them; none: 448² only)."""
    buckets = buckets or {(448, 448): 1.0}
    if not 0 <= range_ratio < 1 or not 0 <= items_range_ratio <= 1:
        raise ValueError("range ratios must lie in [0, 1)")
    rng = np.random.default_rng(seed)
    sizes, weights = list(buckets), np.asarray(list(buckets.values()))
    requests = []
    for r in range(num_prompts):
        count = min(limit_items, _around(rng, base_items, items_range_ratio, low=0))
        picks = rng.choice(len(sizes), size=count, p=weights / weights.sum())
        images: list[bytes | str] = [random_png((seed, r, i), sizes[k], compress_level=0) for i, k in enumerate(picks)]
        requests.append(SampleRequest(random_text(rng, _around(rng, input_len, range_ratio)), images,
                                      _around(rng, output_len, range_ratio)))
    return requests


def image_dataset(num_prompts: int, seed: int = 0, image_count: int = 1, resolution: str = "448x448",
                  input_len: int = 64, output_len: int = 16) -> list[SampleRequest]:
    """SGLang's ``image`` dataset: `image_count` images of `resolution` and `input_len` characters of text each."""
    size = parse_resolution(resolution)
    rng = np.random.default_rng(seed)
    return [SampleRequest(random_text(rng, input_len),
                          [random_png((seed, r, i), size, compress_level=0) for i in range(image_count)], output_len)
            for r in range(num_prompts)]


def repeated_images(num_prompts: int, seed: int = 0, repeat_fraction: float = 0.5, pool_size: int = 64,
                    zipf: float | None = None, resolution: str = "448x448", input_len: int = 64,
                    output_len: int = 16) -> list[SampleRequest]:
    """``image-repeat``: see the module docstring. A repeat is the very bytes object sent before (one URL with
    ``--media url``). `ValueError` for a fraction outside [0, 1], a pool under 1 or a Zipf exponent not above 0."""
    if not 0 <= repeat_fraction <= 1:
        raise ValueError(f"the repeat fraction must lie in [0, 1], got {repeat_fraction}")
    if pool_size < 1:
        raise ValueError(f"the image pool needs at least 1 image, got {pool_size}")
    if zipf is not None and not zipf > 0:
        raise ValueError(f"the Zipf exponent must be above 0, got {zipf}")
    size = parse_resolution(resolution)
    rng = np.random.default_rng(seed)
    requests: list[SampleRequest] = []
    if zipf is not None:
        pool = [random_png((seed, 1, k, 0), size, compress_level=0) for k in range(pool_size)]
        weights = 1.0 / np.arange(1, pool_size + 1) ** zipf
        picks = rng.choice(pool_size, size=num_prompts, p=weights / weights.sum())
        return [SampleRequest(random_text(rng, input_len), [pool[k]], output_len) for k in picks]
    # exactly round(fraction × prompts) repeats (none can be the first request), at places drawn at random
    repeats = set(rng.permutation(np.arange(1, num_prompts))[:round(repeat_fraction * num_prompts)].tolist())
    sent: list[bytes] = []  # distinct images so far, newest last
    for r in range(num_prompts):
        if r in repeats:
            image = sent[-pool_size:][int(rng.integers(min(pool_size, len(sent))))]
        else:
            image = random_png((seed, 0, r, 0), size, compress_level=0)
            sent.append(image)
        requests.append(SampleRequest(random_text(rng, input_len), [image], output_len))
    return requests


def jsonl_dataset(path: str | Path, num_prompts: int, output_len: int = 16) -> list[SampleRequest]:
    """The first `num_prompts` lines of a JSONL file (fewer if it has fewer); local image paths are read (relative
    ones from the file's folder). `ValueError` naming the line for a malformed one."""
    path = Path(path)
    requests = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if len(requests) == num_prompts:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, items = row["prompt"], row.get("images", [])
                if not isinstance(prompt, str) or not isinstance(items, list):
                    raise TypeError("prompt must be a string and images a list")
                images = [item if item.startswith(("http://", "https://")) else (path.parent / item).read_bytes()
                          for item in items]
                requests.append(SampleRequest(prompt, images, int(row.get("output_len", output_len))))
            except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
                raise ValueError(f"{path}:{number}: {type(exc).__name__}: {exc}") from None
    if not requests:
        raise ValueError(f"{path} holds no request")
    return requests
