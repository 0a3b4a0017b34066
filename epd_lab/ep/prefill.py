"""Prefill on embeddings that came from the encoders: the receiver plus the model runtime the servers run
(`epd_lab.models.runtime`), its KV in a paged cache of this object's own."""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from epd_lab.ep.receiver import EmbeddingReceiver, EPDError, Landing, ReceivedEmbeddings
from epd_lab.kv import BlockManager, OutOfBlocks, PagedKVCache, blocks_needed
from epd_lab.models import build_input_ids, model_device, preprocess
from epd_lab.models.runtime import PrefillOutput, open_runtime
from epd_lab.models.catalog import synchronize
from epd_lab.trace import Span


@dataclass
class ReceivedPrompt:
    """A request's prompt once its images' embeddings arrived: what a prefill forward takes."""

    input_ids: torch.Tensor  # [1, T]: the images' pads, then the text
    image_embeds: torch.Tensor | None  # [image tokens, hidden], None for a text-only prompt
    image_grid_thw: torch.Tensor | None  # [images, 3]
    received: ReceivedEmbeddings


@dataclass
class EPDResult:
    """What one request's E→P prefill produced (the runtime's output: logits [vocab], rope delta, prompt length),
    with every span of it (encoders' included)."""

    rid: str
    prefill: PrefillOutput
    received: ReceivedEmbeddings
    spans: list[Span]


def _prompt_cache(model: torch.nn.Module, prompt_len: int, block_size: int, num_blocks: int | None = None,
                  ) -> PagedKVCache:
    """A paged KV cache for one prompt of `prompt_len` tokens (or `num_blocks` blocks), on the model's device."""
    return PagedKVCache.from_config(model.config, num_blocks=num_blocks or blocks_needed(prompt_len, block_size),
                                    block_size=block_size, dtype=model.dtype, device=model_device(model))


class EPDPrefill:
    """The prefill role of E→P in this process: collect a request's image embeddings, then prefill them with the
    model runtime the prefill server runs (`runtime`, fast by default), into blocks of a paged KV cache of
    `kv_blocks` blocks (made on the first prefill), given back when the forward is done. Threads may share one, as
    the prefill server's workers share its runtime: each prefill holds blocks of its own (a prompt that needs more
    than are free is a ValueError). A context manager (`close` frees the cache)."""

    def __init__(self, receiver: EmbeddingReceiver, model: torch.nn.Module, runtime: str = "fast",
                 kv_blocks: int = 512, block_size: int = 16) -> None:
        self.receiver, self.model = receiver, model
        self.runtime_name, self.block_size = runtime, block_size
        self.blocks = BlockManager(kv_blocks)
        self.cache: PagedKVCache | None = None
        self.runtime: Any = None
        self._lock = threading.Lock()

    def prefill(self, text: str, mm_items: list[str], rid: str | None = None,
                before_forward: Callable[[torch.Tensor], None] | None = None) -> EPDResult:
        """Encode `mm_items` on the encoders and prefill the prompt (images first, then `text`); `before_forward`
        is called with the prompt's ids once they are known, before the LLM runs (the prefill server announces
        the KV's size there)."""
        rid = rid or uuid.uuid4().hex
        prompt = self.receive(text, mm_items, rid)
        n = blocks_needed(prompt.input_ids.shape[1], self.block_size)
        if before_forward is not None:
            before_forward(prompt.input_ids)
        with self._lock:
            if self.runtime is None:
                self.cache = _prompt_cache(self.model, 0, self.block_size, self.blocks.num_blocks)
                self.runtime = open_runtime(self.runtime_name, self.model, self.cache)
            try:
                table = self.blocks.allocate(n)
            except OutOfBlocks as exc:  # the prompt, or the prompts in flight beside it, are too long
                raise ValueError(f"the prompt's KV needs {n} blocks of {self.block_size} tokens; "
                                 f"{self.blocks.num_free_blocks} of this prefill's {self.blocks.num_blocks} are "
                                 f"free (kv_blocks)") from exc
        try:
            with self.receiver.recorder.span("prefill", rid):
                result = self.runtime.prefill(prompt.input_ids, prompt.image_embeds, prompt.image_grid_thw, table)
                synchronize(result.logits.device)  # GPU kernels run asynchronously: the span ends when they did
        finally:
            self.blocks.free(table)
        return EPDResult(rid, result, prompt.received, self.receiver.recorder.spans(rid))

    def close(self) -> None:
        """Free the KV cache. Idempotent."""
        if self.cache is not None:
            self.cache.close()
        self.cache = self.runtime = None

    def __enter__(self) -> "EPDPrefill":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, text: str, mm_items: list[str], rid: str,
                on_prompt: Callable[[torch.Tensor, torch.Tensor, Landing | None], None] | None = None
                ) -> ReceivedPrompt:
        """The E→P part alone: encode `mm_items` on the encoders, collect the embeddings, build the prompt (the
        images, then `text`). A prefill server runs its own runtime's forward on the result. The prompt's ids and
        grids are built from the encoders' /encode answers, while the embeddings are on their way, and handed to
        `on_prompt(input_ids, image_grid_thw, landing)` then, with the receiver's `Landing` (mooncake; None
        otherwise): the prefill server checks the prompt's length, holds its KV and plans its forward there, and
        on a GPU queues the forward itself, gated until the embeddings land."""
        announced: dict[str, Any] = {}  # from the /encode answers: "grids" (and as a tensor), the prompt's "ids"

        def on_sizes(grids: dict[str, list[list[int]]], landing: Landing | None) -> None:
            announced["grids"], announced["ids"] = grids["image"], build_input_ids(text, grids["image"])
            announced["grid_thw"] = torch.tensor(grids["image"])
            if on_prompt is not None:
                on_prompt(announced["ids"], announced["grid_thw"], landing)

        got = self.receiver.receive(mm_items, rid, on_sizes=on_sizes)
        grids = got.grid_thw["image"]
        if grids != announced["grids"]:  # the notifies must describe what the /encode answers announced
            raise EPDError(f"request {rid}: the embeddings' grids {grids} are not the /encode answers' "
                           f"{announced['grids']}")
        return ReceivedPrompt(announced["ids"], got.embeddings["image"], announced["grid_thw"], got)


def reference_prefill(model: torch.nn.Module, text: str, images: Sequence[Image.Image],
                      runtime: str = "fast", block_size: int = 16) -> torch.Tensor:
    """The monolithic use's prefill logits [vocab] for the prompt `EPDPrefill.prefill` builds (the images, then
    `text`): the same runtime encodes the images and prefills in this process. What a split prefill's logits must
    equal bit for bit."""
    pixel_values, grid = preprocess(list(images)) if images else (None, None)
    ids = build_input_ids(text, grid.tolist() if images else [])
    with _prompt_cache(model, ids.shape[1], block_size) as cache:
        rt = open_runtime(runtime, model, cache)
        device = model_device(model)
        embeds = rt.encode(pixel_values.to(device), grid) if images else None
        return rt.prefill(ids, embeds, grid, list(range(cache.num_blocks))).logits
