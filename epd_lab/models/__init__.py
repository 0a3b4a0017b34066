"""The workload the encode/prefill/decode roles run: a tiny random-weight Qwen2-VL (DESIGN.md §4).

- `tiny`: the config, deterministic build, offline load (`load_model`), `configure_torch`.
- `processor`: image preprocessing, image sizes → token counts, prompt ids without a tokenizer.
- `runners`: `VisionEncoder` (encode), `PrefillRunner` (prefill), `DecodeRunner` (decode steps on a received
  KV cache), and the monolithic references.
"""
from epd_lab.models.processor import (
    build_input_ids,
    grid_tokens,
    image_grid,
    num_image_tokens,
    preprocess,
    resized_size,
)
from epd_lab.models.runners import (
    DecodeRunner,
    PrefillResult,
    PrefillRunner,
    VisionEncoder,
    monolithic_generate,
    monolithic_prefill,
)
from epd_lab.models.tiny import (
    DEFAULT_MODEL_DIR,
    IMAGE_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    build_tiny_model,
    configure_torch,
    ensure_tiny_model,
    load_model,
    num_parameters,
    tiny_config,
)

__all__ = [
    "DEFAULT_MODEL_DIR",
    "IMAGE_PAD_ID",
    "VISION_END_ID",
    "VISION_START_ID",
    "DecodeRunner",
    "PrefillResult",
    "PrefillRunner",
    "VisionEncoder",
    "build_input_ids",
    "build_tiny_model",
    "configure_torch",
    "ensure_tiny_model",
    "grid_tokens",
    "image_grid",
    "load_model",
    "monolithic_generate",
    "monolithic_prefill",
    "num_image_tokens",
    "num_parameters",
    "preprocess",
    "resized_size",
    "tiny_config",
]
