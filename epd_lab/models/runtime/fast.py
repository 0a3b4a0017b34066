"""The "fast" runtime: `Qwen2LM` over the paged cache; on a GPU, prefill and decode replayed from CUDA graphs
(bucketed by prompt length and batch size, `runtime.graph`) and the vision tower batched across images in
fixed-size calls, each replayed from a graph too (`runtime.vision.VisionTower`). Prefills replay on a stream of
their own, and may be queued there behind a gate before their embeddings land (`prefill_gate`, `runtime.gate`).

On the CPU the same code runs with torch ops (`ops.TorchOps`), no graphs, and the vision tower image by image
(a CPU GEMM may pick its kernel by row position too, so there the budget would not buy bit-identity: measured
on an Intel Xeon with AVX-512 in 66c337e, 2026-11-30, see `models.vision`). That is what CI tests against HF
transformers.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import torch
from transformers import Qwen2VLForConditionalGeneration

from epd_lab.kv.block_manager import blocks_needed
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models.catalog import model_device
from epd_lab.models.runners import VisionEncoder, _to
from epd_lab.models.runtime import PrefillOutput, PrefillPlan, RuntimeBase, token_slot
from epd_lab.models.runtime.gate import Gate, GateWord
from epd_lab.models.runtime.graph import DecodeGraphs, PrefillGraphs
from epd_lab.models.runtime.qwen2 import Qwen2LM
from epd_lab.models.runtime.tp import TPGroup
from epd_lab.models.runtime.vision import VisionTower
from epd_lab.transfer.errors import TransferError

# Patch rows per vision call on a GPU: one 448² image (1,024 patches). The budget trades one image's latency (every
# call costs a full budget) against the work of many (fewer, larger calls); measured side by side on an H200 (2B
# tower, `data/bench/runtime-h200-2b-vision-budget-full.json`): one 448² image 4.46 ms of GPU time (2048: 6.96, 4096: 12.5),
# four 18.5 ms (2048: 16.2, 4096: 16.0; HF's batched tower 23.7).
DEFAULT_VISION_BUDGET = 1024


class FastRuntime(RuntimeBase):
    """See the module docstring. A context manager: `close` drops the graphs and their memory pool.

    Args:
        model, cache: the loaded model and the paged cache its KV lives in.
        max_batch: the largest decode batch in buckets (a larger one runs eagerly, unpadded).
        max_seq_len: the longest sequence (prompt + generated) a bucketed decode step takes; a longer one runs
            eagerly (on the H200, 2B: 14 ms a token past 4,096 with the old default, against 2 in a graph).
        max_prefill_tokens: the longest prompt a bucketed prefill takes (a longer one runs eagerly: its GPU time,
            20 ms and more for 2B, hides its launches).
        vision_budget: patch rows per vision call (None: `DEFAULT_VISION_BUDGET` on a GPU; on the CPU, HF's tower
            image by image).
        cuda_graphs: replay the buckets from CUDA graphs on a GPU (False: run the same padded buckets eagerly,
            which gives the same bits; for comparison).
        staged_graphs: capture each decode bucket in parts launched back to back (`runtime.graph`); False: one
            graph per bucket (the same bits; for comparison).
        tp: this rank's place in a tensor-parallel group (`runtime.tp`; `cache` then holds its KV heads). Every
            rank must make the same calls in the same order: each layer all-reduces. The tower then runs the
            runtime's own forward sharded, image by image on the CPU; on a GPU a TP rank runs eagerly (no graphs,
            no gates: untested on GPUs).
    """

    name = "fast"

    def __init__(self, model: Qwen2VLForConditionalGeneration, cache: PagedKVCache | None = None, *,
                 max_batch: int = 16, max_seq_len: int = 16384, max_prefill_tokens: int = 4096,
                 vision_budget: int | None = None, cuda_graphs: bool = True, staged_graphs: bool = True,
                 tp: TPGroup | None = None) -> None:
        self.model, self.cache = model, cache
        self.device = model_device(model)
        self.tp = tp = tp or TPGroup(0, 1)
        on_gpu = self.device.type == "cuda" and tp.size == 1
        if vision_budget is None and on_gpu:
            vision_budget = DEFAULT_VISION_BUDGET
        if vision_budget is None and tp.size > 1:  # one call per image: a call's rows never depend on its request
            vision_budget = model.model.visual.spatial_merge_size ** 2
        self.vision = VisionTower(model.model.visual, vision_budget, cuda_graphs and on_gpu, tp) \
            if vision_budget else None
        self._hf_vision = VisionEncoder(model)
        self._lock = threading.Lock()  # the buckets' static buffers: one prefill or decode at a time on a GPU
        self._vision_lock = threading.Lock()
        self.lm = self.prefill_graphs = self.graphs = self._gates = None
        if cache is None:
            return
        self.lm = Qwen2LM(model, cache, tp=tp)
        if on_gpu:
            self.prefill_graphs = PrefillGraphs(self.lm, max_prefill_tokens, model.config.image_token_id, cuda_graphs)
            try:
                self._gates = GateWord(self.device)
            except TransferError as exc:  # a driver without stream memory operations: prefills wait on the host
                warnings.warn(f"no gated prefills on {self.device}: {exc}", RuntimeWarning, stacklevel=2)
            self.graphs = DecodeGraphs(self.lm, max_batch, blocks_needed(max_seq_len, cache.block_size), cuda_graphs,
                                       staged_graphs)

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged vision embeddings [tokens, hidden]: in budgeted calls on a GPU, HF's tower image by image on the
        CPU (HF's bits there)."""
        if self.vision is None:
            return self._hf_vision.encode(pixel_values, image_grid_thw)
        with self._vision_lock:  # the graphs' static inputs
            return self.vision.encode(pixel_values, image_grid_thw)

    def prefill_gate(self, num_tokens: int, image_embeds: torch.Tensor | None) -> Gate | None:
        """A gate on a GPU, for a prompt the prefill graphs take, with embeddings in pinned or GPU memory, while
        no other gate is pending; else None."""
        if self._gates is None or num_tokens > self.prefill_graphs.max_tokens or not _gpu_readable(image_embeds):
            return None
        return self._gates.gate()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None, block_table: Sequence[int],
                plan: PrefillPlan | None = None, gate: Gate | None = None) -> PrefillOutput:
        if self.lm is None:
            raise ValueError("this runtime was opened without a KV cache: it only encodes")
        plan = self.checked_plan(plan, input_ids, image_embeds, image_grid_thw, block_table)
        ids = plan.ids
        if self.prefill_graphs is not None and len(ids) <= self.prefill_graphs.max_tokens:
            if gate is not None and not _gpu_readable(image_embeds):
                raise ValueError("a gated prefill reads its embeddings on the GPU's time: they must be in pinned "
                                 "or GPU memory (a pageable copy would wait for the gate on the host)")
            ready = None
            with self._lock:
                logits = self.prefill_graphs.run(ids, plan.positions, plan.slots, image_embeds, gate)
                if gate is not None:
                    ready = torch.cuda.Event()
                    ready.record(self.prefill_graphs.stream)
            return PrefillOutput(logits, plan.rope_delta, len(ids), ready)
        if gate is not None:
            raise ValueError(f"a gated prefill runs from the prefill graphs: {len(ids)} tokens is not one "
                             f"(prefill_gate gives none for it)")
        ids = _to(ids, self.device)
        embeds = self.lm.embed_tokens(ids)
        if image_embeds is not None:
            mask = ids == self.model.config.image_token_id
            embeds = embeds.masked_scatter(mask[:, None], _to(image_embeds, self.device).to(embeds.dtype))
        logits = self.lm.prefill(embeds, _to(plan.positions, self.device), _to(plan.slots, self.device))
        return PrefillOutput(logits, plan.rope_delta, len(ids))

    @torch.no_grad()
    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
               seq_lens: Sequence[int]) -> torch.Tensor:
        if self.lm is None:
            raise ValueError("this runtime was opened without a KV cache: it only encodes")
        if not len(tokens) == len(positions) == len(block_tables) == len(seq_lens) > 0:
            raise ValueError("decode needs as many tokens, positions, block tables and lengths (>= 1)")
        if not 0 <= min(positions) and max(positions) < self.lm.max_position:
            raise ValueError(f"decode positions must lie in [0, {self.lm.max_position}) (the model's "
                             f"max_position_embeddings), got {min(positions)}..{max(positions)}")
        block_size = self.cache.block_size
        for table, n in zip(block_tables, seq_lens):
            if not 0 < n <= len(table) * block_size:
                raise ValueError(f"a sequence of {n} tokens does not fit {len(table)} blocks of {block_size}")
        slots = [token_slot(table, n - 1, block_size) for table, n in zip(block_tables, seq_lens)]
        if self.graphs is not None and len(tokens) <= self.graphs.max_batch and \
                max(len(t) for t in block_tables) <= self.graphs.max_blocks:
            with self._lock:
                return self.graphs.run(list(tokens), list(positions), slots, list(seq_lens),
                                       [list(t) for t in block_tables])
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], device=self.device)

        def tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.long, device=self.device)

        return self.lm.decode(tensor(tokens), tensor(positions), tensor(slots), tables, tensor(seq_lens))

    def close(self) -> None:
        """Open a pending gate, drop the captured graphs (their pool goes with them). Idempotent."""
        if self._gates is not None:
            self._gates.close()
        self.graphs = self.prefill_graphs = self._gates = None


def _gpu_readable(tensor: torch.Tensor | None) -> bool:
    """Whether a copy out of `tensor` runs on the GPU's time alone (GPU or page-locked memory; none at all)."""
    return tensor is None or tensor.is_cuda or tensor.is_pinned()
