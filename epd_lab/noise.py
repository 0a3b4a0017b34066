"""Random-noise images: the inputs of the tests, the benches, the demo and the campaign.

Noise rather than a flat colour: near-identical embedding rows would hide misplaced bytes. Every maker draws
``rng.integers(0, 256, (h, w, 3), dtype=np.uint8)`` from ``np.random.default_rng(seed)``, so an image is a
function of its seed (or of its place in one generator's sequence) and the same in every process.
"""
from __future__ import annotations

import base64
import io
from collections.abc import Iterable

import numpy as np
from PIL import Image

Seed = int | tuple[int, ...] | np.random.Generator


def noise_images(sizes: Iterable[tuple[int, int]], seed: Seed) -> list[Image.Image]:
    """RGB noise images, one per ``(width, height)``, drawn in order from one generator (a Generator passed as
    `seed` is drawn from, and advanced, in place)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def random_png(seed: Seed, size: int | tuple[int, int], compress_level: int = 6) -> bytes:
    """A random RGB image of `size`² (or `size` = (height, width)) as PNG bytes (distinct per seed). Noise does not
    compress: level 0 stores it and spares both ends a deflate that gains nothing."""
    buf = io.BytesIO()
    height, width = (size, size) if isinstance(size, int) else size
    noise_images([(width, height)], seed)[0].save(buf, "PNG", compress_level=compress_level)
    return buf.getvalue()


def data_uri(raw: bytes) -> str:
    """An image's bytes as a ``data:image/…;base64,…`` URI (what a chat request's ``image_url`` carries): JPEG by
    its magic bytes, else PNG."""
    kind = "jpeg" if raw.startswith(b"\xff\xd8\xff") else "png"
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def image_uri(seed: Seed, size: int) -> str:
    """A random RGB PNG of `size`² as a data URI (distinct per seed)."""
    return data_uri(random_png(seed, size))
