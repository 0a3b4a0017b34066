"""The workload the encode/prefill/decode roles run: a random-weight Qwen2-VL, tiny or at published sizes, or real
weights from a directory, built so that the EPD split is bit-identical to one monolithic forward (the
preconditions: docs/protocols.md, "What bit-identity rests on").

- `tiny`: the config, deterministic build, offline load (`load_model`), `configure_torch`.
- `processor`: image preprocessing, image sizes → token counts, prompt ids without a tokenizer.
- `catalog`: ``--model``/``--device``/``--dtype`` resolved (`open_model`: tiny, a published shape with random
  weights, or a directory, on the device asked; `resolve_device`, `resolve_dtype`, `model_device`).
- `shapes`: Qwen2-VL at its published sizes (qwen2-vl-2b, qwen2-vl-7b), seeded random weights on the device.
- `runners`: `VisionEncoder` (encode), `PrefillRunner` (prefill), `DecodeRunner` (decode steps on a received
  KV cache), and the monolithic references.
- `runtime`: the roles' model runtimes behind one interface over the paged KV cache (`open_runtime`: ``fast``,
  written from the architecture, CUDA graphs and Triton kernels on a GPU; ``hf``, the runners above).
"""
from epd_lab.models.catalog import (
    DTYPE_NAMES,
    MODEL_SHAPES,
    model_device,
    open_model,
    resolve_device,
    resolve_dtype,
)
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
    "DTYPE_NAMES",
    "MODEL_SHAPES",
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
    "model_device",
    "monolithic_generate",
    "monolithic_prefill",
    "num_image_tokens",
    "num_parameters",
    "open_model",
    "preprocess",
    "resized_size",
    "resolve_device",
    "resolve_dtype",
    "tiny_config",
]
