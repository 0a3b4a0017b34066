"""The monolithic model's answer to an OpenAI chat request: what the proxy's answer must equal."""
from __future__ import annotations

from typing import Any

from epd_lab.ep.media import MAX_MEDIA_BYTES, load_image
from epd_lab.models import build_input_ids, monolithic_generate, preprocess
from epd_lab.servers.text import detokenize, messages_to_prompt


def monolithic_chat(model: Any, messages: list[dict[str, Any]], max_tokens: int, timeout: float = 10.0) -> str:
    """Render `messages` as the proxy does, run `model.generate` greedily in this process on the same
    images (any media item the encoders accept), and detokenize as the proxy does."""
    prompt, items = messages_to_prompt(messages)
    if not items:
        return detokenize(monolithic_generate(model, build_input_ids(prompt, []), None, None, max_tokens))
    pixel_values, grid = preprocess([load_image(item, timeout, MAX_MEDIA_BYTES) for item in items])
    return detokenize(monolithic_generate(model, build_input_ids(prompt, grid.tolist()), pixel_values, grid,
                                          max_tokens))
