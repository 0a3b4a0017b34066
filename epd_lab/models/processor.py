"""Image preprocessing and prompt assembly, offline: no torchvision, no tokenizer, no hub.

`preprocess` computes what transformers' own `Qwen2VLImageProcessorPil` (PIL + numpy; `image_processor`, built
here rather than downloaded) computes, bit for bit (a test holds it to that), but with torch ops on any device:
the PIL bicubic resize on the host where an image is not already at its multiple-of-28 size, then rescale,
normalise and patchify where the tower runs. HF's path spends about 11 ms of host time on one 448² image (measured on
the H200's host); on the GPU the same bits cost a few small kernels. Sizes and token counts come from
the image size alone (`image_grid`, `num_image_tokens`): the encoder answers them before its ViT runs.

Prompt template (token ids, no tokenizer): every image first, in order, as
``<|vision_start|> <|image_pad|> × num_image_tokens <|vision_end|>``, then the text as its UTF-8 bytes
(byte b → id b).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from epd_lab.models.tiny import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Qwen2-VL's processor defaults: images are resized to hold between 4 and 1280 merged 28×28 tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280

GridTHW = tuple[int, int, int]


@lru_cache(maxsize=1)
def image_processor() -> Qwen2VLImageProcessorPil:
    """The Qwen2-VL image processor with this model's patch geometry, built without the hub."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


def resized_size(size: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) the processor resizes an image of PIL `size` (width, height) to: multiples of 28."""
    width, height = size
    factor = PATCH_SIZE * MERGE_SIZE
    new_height, new_width = smart_resize(height, width, factor=factor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return new_width, new_height


def image_grid(size: tuple[int, int]) -> GridTHW:
    """The (t, h, w) patch grid of an image of PIL `size` (width, height), as in `image_grid_thw`."""
    width, height = resized_size(size)
    return 1, height // PATCH_SIZE, width // PATCH_SIZE


def grid_tokens(grid: Sequence[int]) -> int:
    """Number of LLM tokens (merged patches) of one (t, h, w) grid."""
    t, h, w = grid
    return t * h * w // MERGE_SIZE**2


def num_image_tokens(size: tuple[int, int]) -> int:
    """Number of image tokens for an image of PIL `size` (width, height); 224×224 → 64."""
    return grid_tokens(image_grid(size))


def preprocess(images: Sequence[Image.Image],
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize, normalise and patchify images → (`pixel_values` float32 [patches, 1176] on `device` (default: the
    CPU), `image_grid_thw` [n, 3] on the CPU), equal to `image_processor`'s output bit for bit.

    The ops are HF's, in HF's dtypes: PIL's bicubic resize of the uint8 image (skipped when the size already is
    the target, as PIL itself skips it), ``uint8 → float64 × rescale_factor → float32``, then
    ``(x - mean) / std`` in float32: element-wise IEEE operations, the same bits on any device.
    """
    if not images:
        raise ValueError("preprocess needs at least one image")
    proc = image_processor()
    device = torch.device("cpu" if device is None else device)
    mean, std = _mean_std(device)
    patches, grids = [], []
    for image in images:
        image = image.convert("RGB")
        size = resized_size(image.size)
        if size != image.size:
            image = image.resize(size, resample=proc.resample)
        array = np.asarray(image)  # uint8 [h, w, 3], read-only: copied once, into pinned memory for a GPU
        hwc = torch.empty(array.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
        hwc.numpy()[...] = array
        chw = hwc.to(device, non_blocking=True).permute(2, 0, 1)
        pixels = (chw.double() * proc.rescale_factor).float()
        pixels = (pixels - mean) / std
        patches.append(_patchify(pixels))
        grids.append([1, size[1] // PATCH_SIZE, size[0] // PATCH_SIZE])
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)


@lru_cache(maxsize=8)
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's mean and std [3, 1, 1] in float32 on `device`, made once: a tensor built from a list on a
    GPU is a pageable copy, which would make every call wait for the GPU's queued work."""
    proc = image_processor()
    return tuple(torch.tensor(values, dtype=torch.float32, device=device).view(3, 1, 1)
                 for values in (proc.image_mean, proc.image_std))


def _patchify(pixels: torch.Tensor) -> torch.Tensor:
    """[3, h, w] → [h/14 · w/14, 3 · 2 · 14 · 14] in the processor's order (merge windows first, the one frame
    repeated over the temporal patch)."""
    channels, height, width = pixels.shape
    gh, gw, m, p = height // PATCH_SIZE, width // PATCH_SIZE, MERGE_SIZE, PATCH_SIZE
    grid = pixels.reshape(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    grid = grid.unsqueeze(5).expand(*grid.shape[:5], TEMPORAL_PATCH_SIZE, p, p)
    return grid.reshape(gh * gw, channels * TEMPORAL_PATCH_SIZE * p * p)


def build_input_ids(text: str, image_grids: Sequence[Sequence[int]]) -> torch.LongTensor:
    """Prompt token ids [1, seq]: each image's vision_start, image_pad × tokens, vision_end, then UTF-8 text."""
    ids: list[int] = []
    for grid in image_grids:
        ids += [VISION_START_ID, *[IMAGE_PAD_ID] * grid_tokens(grid), VISION_END_ID]
    ids += list(text.encode("utf-8"))
    return torch.tensor([ids], dtype=torch.long)

