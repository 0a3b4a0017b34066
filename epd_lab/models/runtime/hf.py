"""The "hf" runtime: HF transformers' eager forward (today's `models.runners`), behind the runtime interface.

The baseline the fast runtime is measured against. HF's forward keeps its KV in a `DynamicCache`, so this
runtime copies: prefill's cache is scattered into the blocks, and every decode step gathers each sequence's
blocks into a `DynamicCache`, runs HF's step and writes the new token's K/V back into its slot. Its decode step
therefore costs a copy of the whole context per sequence (what the fast runtime removes); its answers are
HF's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, Qwen2VLForConditionalGeneration

from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models.runners import DecodeRunner, PrefillRunner, VisionEncoder
from epd_lab.models.runtime import Gate, PrefillOutput, PrefillPlan, RuntimeBase
from epd_lab.models.runtime.tp import TPGroup


class HFRuntime(RuntimeBase):
    """See the module docstring. One process: tensor parallelism is the fast runtime's (`tp` of more than one
    rank is refused)."""

    name = "hf"

    def __init__(self, model: Qwen2VLForConditionalGeneration, cache: PagedKVCache | None = None,
                 tp: TPGroup | None = None) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError(f"the hf runtime runs HF's whole model in one process; tensor parallelism "
                             f"(tp_size {tp.size}) needs --runtime fast")
        self.model, self.cache = model, cache
        self._vision, self._prefill, self._decode = VisionEncoder(model), PrefillRunner(model), DecodeRunner(model)

    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self._vision.encode(pixel_values, image_grid_thw)

    def prefill(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None, block_table: Sequence[int],
                plan: PrefillPlan | None = None, gate: Gate | None = None) -> PrefillOutput:
        if gate is not None:
            raise ValueError("the hf runtime prefills eagerly on the host's time: it takes no gate")
        if plan is not None:  # checked only: HF's forward makes its own positions
            self.checked_plan(plan, input_ids, image_embeds, image_grid_thw, block_table)
        result = self._prefill.prefill(input_ids.reshape(1, -1), image_embeds, image_grid_thw)
        self.cache.write_from(result.kv_tensors(), block_table, result.prompt_len)
        return PrefillOutput(result.logits[0], result.rope_delta, result.prompt_len)

    @torch.no_grad()
    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
               seq_lens: Sequence[int]) -> torch.Tensor:
        caches = [self._gather(table, n - 1) for table, n in zip(block_tables, seq_lens)]
        if len(tokens) == 1:
            logits = self._decode.step(tokens[0], caches[0], positions[0])
        else:
            logits = self._decode.step_batch(list(tokens), caches, list(positions))
        for cache, table, n in zip(caches, block_tables, seq_lens):  # the step's own K/V, into its slot
            self.cache.write_from([(layer.keys, layer.values) for layer in cache.layers], table, n, start=n - 1)
        return logits

    def _gather(self, block_table: Sequence[int], num_tokens: int) -> DynamicCache:
        """A sequence's first `num_tokens` positions, copied out of its blocks into a `DynamicCache`."""
        cache = DynamicCache(config=self.model.config)
        for i, (key, value) in enumerate(self.cache.read_layers(block_table, num_tokens)):
            cache.update(key, value, i)
        return cache
