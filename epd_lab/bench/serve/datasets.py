"""The requests `epd-lab bench serve` sends: five datasets, each a list of `SampleRequest`.

Prompt lengths are tokens of the served model's tokenizer (`tokenizer.get_tokenizer`; an epd_lab model reads one
token per UTF-8 byte), and random prompts are vLLM's (`tokenizer.random_prompt`).

- ``random`` (vLLM's): text only, ``prefix_len`` shared tokens then ``input_len`` tokens (± ``range_ratio``),
  ``output_len`` tokens asked (± ``range_ratio``).
- ``random-mm`` (vLLM's): ``random``'s text, and a number of images per request drawn uniformly from
  ``base_items`` ± ``items_range_ratio`` (at most the image limit of ``limit_mm_per_prompt``), each image's
  (height, width) drawn from a bucket config ``{(h, w, frames): probability}`` (frames 1: an image).
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

from epd_lab.bench.serve.tokenizer import ByteTokenizer, Tokenizer, random_prompt
from epd_lab.noise import random_png

DATASETS = ("random", "random-mm", "image", "image-repeat", "jsonl")
RESOLUTIONS = {"360p": (360, 640), "720p": (720, 1280), "1080p": (1080, 1920), "4k": (2160, 3840)}
MIN_SIDE = 56  # the Qwen2-VL processor's smallest side
# vLLM's defaults for random-mm
DEFAULT_LIMIT_MM = {"image": 255, "video": 1}
DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}"
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


@dataclass(slots=True)
class SampleRequest:
    """One request: its text, its images (PNG bytes, or an http(s) URL sent as it is), how many tokens to ask, and
    how many tokens its text is (0: not counted; the server's ``usage`` gives the whole prompt's)."""

    prompt: str
    images: list[bytes | str] = field(default_factory=list)
    output_len: int = 16
    prompt_len: int = 0


def random_text(rng: np.random.Generator, length: int) -> str:
    """`length` characters of lowercase words (one token each for epd_lab's byte tokenizer)."""
    return rng.choice(_LETTERS, size=length).tobytes().decode()


def _around(rng: np.random.Generator, base: int, ratio: float, low: int = 1) -> int:
    """An integer drawn uniformly from ``[base (1 - ratio), base (1 + ratio)]``, at least `low` (vLLM's range ratio)."""
    lo, hi = max(low, math.floor(base * (1 - ratio))), max(low, math.ceil(base * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))


def _bucket_key(key: object) -> tuple[int, ...]:
    """A bucket's key as vLLM's flag writes it: a tuple, or in JSON a string ``"(h, w, f)"`` or ``"h,w,f"``."""
    parts = key.strip().strip("()[]").split(",") if isinstance(key, str) else key
    try:
        if not isinstance(parts, (tuple, list)) or len(parts) != 3:
            raise ValueError
        return tuple(int(x) for x in parts)
    except (ValueError, TypeError):
        raise ValueError(f"bucket {key!r}: a bucket is (height, width, frames)") from None


def parse_buckets(text: str | Mapping) -> dict[tuple[int, int], float]:
    """vLLM's ``--random-mm-bucket-config``, ``{(height, width, frames): probability}`` (a Python literal, or JSON
    with string keys) → the image buckets ``{(h, w): p}``, normalized. Buckets of probability 0 are dropped, as
    vLLM drops them (its default has a video bucket at 0). `ValueError` for a video bucket (frames > 1) of positive
    probability (epd_lab's models have no video path), sides under 56, or no positive probability."""
    if isinstance(text, str):
        try:
            raw = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"bucket config {text!r} is neither a Python dict nor JSON") from None
    else:
        raw = dict(text)
    if not isinstance(raw, dict):
        raise ValueError(f"bucket config {text!r} is not a dict")
    buckets: dict[tuple[int, int], float] = {}
    for key, weight in raw.items():
        height, width, frames = _bucket_key(key)
        if not isinstance(weight, (int, float)) or weight < 0:
            raise ValueError(f"bucket {key}: probability {weight!r} is not a number >= 0")
        if weight == 0:
            continue
        if frames != 1:
            raise ValueError(f"bucket {key}: video (frames > 1) is not supported, epd_lab's models have no video path")
        if min(height, width) < MIN_SIDE:
            raise ValueError(f"bucket {key}: sides must be >= {MIN_SIDE}")
        buckets[(height, width)] = buckets.get((height, width), 0.0) + float(weight)
    total = sum(buckets.values())
    if not total > 0:
        raise ValueError("the bucket config has no positive probability")
    return {k: v / total for k, v in buckets.items()}


def parse_mm_limit(text: str | Mapping | int) -> int:
    """vLLM's ``--random-mm-limit-mm-per-prompt``, JSON such as ``{"image": 3, "video": 0}`` → the image limit
    (an int is taken as the image limit). `ValueError` for another modality or a negative limit. A video limit is
    accepted and has no effect: video buckets are refused (`parse_buckets`)."""
    if isinstance(text, int):
        return _limit("image", text)
    try:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError:
        raise ValueError(f"--random-mm-limit-mm-per-prompt {text!r} is not JSON such as "
                         '\'{"image": 3, "video": 0}\'') from None
    if not isinstance(raw, dict) or set(raw) - {"image", "video"}:
        raise ValueError(f"--random-mm-limit-mm-per-prompt {text!r}: the modalities are image and video")
    for name, value in raw.items():
        _limit(name, value)
    if "image" not in raw:
        raise ValueError(f"--random-mm-limit-mm-per-prompt {text!r} has no image limit")
    return int(raw["image"])


def _limit(name: str, value: object) -> int:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"--random-mm-limit-mm-per-prompt: {name} limit {value!r} is not an integer >= 0")
    return value


def parse_resolution(text: str) -> tuple[int, int]:
    """``448x448`` (height x width) or one of 360p, 720p, 1080p, 4k → (height, width)."""
    if text in RESOLUTIONS:
        return RESOLUTIONS[text]
    height, sep, width = text.lower().partition("x")
    if not sep or not height.isdigit() or not width.isdigit() or min(int(height), int(width)) < MIN_SIDE:
        raise ValueError(f"image resolution {text!r}: HEIGHTxWIDTH (sides >= {MIN_SIDE}) or one of "
                         f"{', '.join(RESOLUTIONS)}")
    return int(height), int(width)


def _lengths(rng: np.random.Generator, n: int, base: int, ratio: float, low: int) -> np.ndarray:
    """vLLM's draw of `n` lengths: uniform integers in ``[floor(base (1 - ratio)), ceil(base (1 + ratio))]``, at
    least `low`."""
    lo, hi = max(low, math.floor(base * (1 - ratio))), max(low, math.ceil(base * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _prompts(rng: np.random.Generator, tokenizer: Tokenizer, lengths: np.ndarray,
             prefix_len: int = 0) -> list[tuple[str, int]]:
    """vLLM's random prompts: a prefix drawn once, then each request's own tokens from a random offset (drawn in
    vLLM's order: the offsets, then the prefix)."""
    offsets = rng.integers(0, len(tokenizer.allowed_ids), size=len(lengths))
    prefix = rng.choice(tokenizer.allowed_ids, size=prefix_len).tolist() if prefix_len else []
    return [random_prompt(tokenizer, rng, int(n), int(offset), i, prefix)
            for i, (n, offset) in enumerate(zip(lengths, offsets))]


def random_mm(num_prompts: int, seed: int = 0, input_len: int = 1024, output_len: int = 128,
              range_ratio: float = 0.0, base_items: int = 1, items_range_ratio: float = 0.0,
              limit_items: int | str | Mapping = 255, buckets: Mapping[tuple[int, int], float] | None = None,
              prefix_len: int = 0, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """vLLM's ``random-mm`` (``random`` with `base_items` 0): see the module docstring. `limit_items` is the image
    limit, or vLLM's JSON (`parse_mm_limit`); `buckets` as `parse_buckets` gives them (none: vLLM's default);
    `tokenizer` counts the prompt's tokens (none: epd_lab's bytes)."""
    buckets = buckets if buckets is not None else parse_buckets(DEFAULT_BUCKETS)
    tokenizer = tokenizer or ByteTokenizer()
    limit = parse_mm_limit(limit_items if not isinstance(limit_items, Mapping) else dict(limit_items))
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must lie in [0, 1), got {range_ratio}")
    if not 0 <= items_range_ratio <= 1:
        raise ValueError(f"--random-mm-num-mm-items-range-ratio must lie in [0, 1], got {items_range_ratio}")
    if input_len < 0 or prefix_len < 0 or output_len < 1 or base_items < 0:
        raise ValueError("lengths must be >= 0 (the output's >= 1) and items per request >= 0")
    lo_items = max(0, math.floor(base_items * (1 - items_range_ratio)))
    hi_items = min(limit, math.ceil(base_items * (1 + items_range_ratio)))
    if lo_items > hi_items:
        raise ValueError(f"at least {lo_items} images per request, but the image limit is {limit}")
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, num_prompts, input_len, range_ratio, 0)
    output_lens = _lengths(rng, num_prompts, output_len, range_ratio, 1)
    prompts = _prompts(rng, tokenizer, input_lens, prefix_len)
    sizes, weights = list(buckets), np.asarray(list(buckets.values()))
    requests = []
    for r, ((text, tokens), out_len) in enumerate(zip(prompts, output_lens)):
        count = int(rng.integers(lo_items, hi_items + 1))
        picks = rng.choice(len(sizes), size=count, p=weights / weights.sum())
        images: list[bytes | str] = [random_png((seed, r, i), sizes[k], compress_level=0) for i, k in enumerate(picks)]
        requests.append(SampleRequest(text, images, int(out_len), tokens))
    return requests


def image_dataset(num_prompts: int, seed: int = 0, image_count: int = 1, resolution: str = "448x448",
                  input_len: int = 64, output_len: int = 16, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """SGLang's ``image`` dataset: `image_count` images of `resolution` and a random prompt of `input_len` tokens
    each."""
    size = parse_resolution(resolution)
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, tokenizer or ByteTokenizer(), np.full(num_prompts, input_len))
    return [SampleRequest(text, [random_png((seed, r, i), size, compress_level=0) for i in range(image_count)],
                          output_len, tokens)
            for r, (text, tokens) in enumerate(prompts)]


def repeated_images(num_prompts: int, seed: int = 0, repeat_fraction: float = 0.5, pool_size: int = 64,
                    zipf: float | None = None, resolution: str = "448x448", input_len: int = 64,
                    output_len: int = 16, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
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
    prompts = _prompts(rng, tokenizer or ByteTokenizer(), np.full(num_prompts, input_len))
    if zipf is not None:
        pool = [random_png((seed, 1, k, 0), size, compress_level=0) for k in range(pool_size)]
        weights = 1.0 / np.arange(1, pool_size + 1) ** zipf
        picks = rng.choice(pool_size, size=num_prompts, p=weights / weights.sum())
        return [SampleRequest(text, [pool[k]], output_len, tokens) for (text, tokens), k in zip(prompts, picks)]
    # exactly round(fraction × prompts) repeats (none can be the first request), at places drawn at random
    repeats = set(rng.permutation(np.arange(1, num_prompts))[:round(repeat_fraction * num_prompts)].tolist())
    sent: list[bytes] = []  # distinct images so far, newest last
    requests: list[SampleRequest] = []
    for r, (text, tokens) in enumerate(prompts):
        if r in repeats:
            image = sent[-pool_size:][int(rng.integers(min(pool_size, len(sent))))]
        else:
            image = random_png((seed, 0, r, 0), size, compress_level=0)
            sent.append(image)
        requests.append(SampleRequest(text, [image], output_len, tokens))
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
