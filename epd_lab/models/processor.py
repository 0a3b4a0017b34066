"""Image preprocessing and prompt assembly, offline: no torchvision, no tokenizer, no hub.

Images go through transformers' own `Qwen2VLImageProcessorPil` (PIL + numpy), constructed here rather than
downloaded, so pixels match what a Qwen2-VL server computes. Sizes and token counts come from the image
size alone (`image_grid`, `num_image_tokens`): the encoder answers them before its ViT runs.

Prompt template (token ids, no tokenizer): every image first, in order, as
``<|vision_start|> <|image_pad|> × num_image_tokens <|vision_end|>``, then the text as its UTF-8 bytes
(byte b → id b).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

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


def preprocess(images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize, normalise and patchify images → (`pixel_values` float32 [patches, 1176], `image_grid_thw` [n, 3])."""
    if not images:
        raise ValueError("preprocess needs at least one image")
    out = image_processor()(images=[im.convert("RGB") for im in images], return_tensors="pt")
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"]


def build_input_ids(text: str, image_grids: Sequence[Sequence[int]]) -> torch.LongTensor:
    """Prompt token ids [1, seq]: each image's vision_start, image_pad × tokens, vision_end, then UTF-8 text."""
    ids: list[int] = []
    for grid in image_grids:
        ids += [VISION_START_ID, *[IMAGE_PAD_ID] * grid_tokens(grid), VISION_END_ID]
    ids += list(text.encode("utf-8"))
    return torch.tensor([ids], dtype=torch.long)

