"""The monolithic model's answer to an OpenAI chat request: what the proxy's answer must equal."""
from __future__ import annotations

from typing import Any

from epd_lab.ep.media import MAX_MEDIA_BYTES, load_image
from epd_lab.kv.block_manager import blocks_needed
from epd_lab.models import build_input_ids, monolithic_generate, preprocess
from epd_lab.models.runtime import generate
from epd_lab.servers.text import detokenize, messages_to_prompt


def monolithic_chat(model: Any, messages: list[dict[str, Any]], max_tokens: int, timeout: float = 10.0,
                    runtime: Any = None, temperature: float = 0.0, seed: int = 0) -> str:
    """Render `messages` as the proxy does, generate in this process on the same images (any media item the
    encoders accept; greedy, or drawn at `temperature` with `seed` as the servers draw), and detokenize as the
    proxy does. The generation is `model.generate`'s, or with a
    model `runtime` (`epd_lab.models.runtime`) that runtime's monolithic use, in the first blocks of its cache:
    what servers running the same runtime must answer."""
    prompt, items = messages_to_prompt(messages)
    pixel_values, grid = None, None
    if items:
        pixel_values, grid = preprocess([load_image(item, timeout, MAX_MEDIA_BYTES) for item in items])
    input_ids = build_input_ids(prompt, [] if grid is None else grid.tolist())
    if runtime is None:
        return detokenize(monolithic_generate(model, input_ids, pixel_values, grid, max_tokens, temperature, seed))
    table = list(range(blocks_needed(input_ids.shape[1] + max_tokens, runtime.cache.block_size)))
    return detokenize(generate(runtime, input_ids, pixel_values, grid, max_tokens, table, temperature, seed))
