"""`PagedKVCache`: a role's KV cache as fixed-size blocks, registered with the transfer engine once.

Per layer there is a K and a V tensor ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's
FlashAttention layout with K and V apart), so block `b` of a layer's K is one contiguous run of `block_len`
bytes at ``base + b * block_len``: the seed's ``block_address = layer_base_addr + block_id * block_len``.

With an engine, all tensors are carved out of ONE buffer: the engine's managed host memory (a same-host peer
writes into it with a memcpy), or on a GPU one allocation of GPU memory (a same-host peer's GPU writes into it
over CUDA IPC, `epd_lab.transfer.cuda`); every tensor is registered as its own region (`register_kv_caches`, the
seed's name), whose key (the rkey's role) a writer names. `base_addrs` (the seed's ``kv_caches_base_addr``) and
`keys` list the regions in the order ``[K0, V0, K1, V1, ...]``: layer by layer, K before V.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from epd_lab.kv.block_manager import blocks_needed
from epd_lab.kv.tp_plan import kv_head_range
from epd_lab.transfer.buffers import as_array

KVLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value), each [1, heads, seq, head_dim]


class PagedKVCache:
    """A paged KV cache; see the module docstring. A context manager: `close` deregisters and frees.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV geometry (`from_config` reads them).
        num_blocks: blocks per layer tensor.
        block_size: tokens per block.
        dtype: the model's dtype.
        engine: allocate from this engine's managed memory (on a GPU: one GPU allocation) and register with
            it; None: ``torch.empty``, unregistered (`register_kv_caches` can register it later).
        device: where the cache lives (the model's device).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, engine: Any = None,
                 device: str | torch.device = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_len = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        tensor_bytes = num_blocks * self.block_len
        self._engine: Any = None  # the engine the regions are registered with
        self._allocator: Any = engine  # the engine whose managed buffer holds them
        self._managed_ptr: int | None = None
        self.keys: list[int] = []
        if engine is None:
            regions = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2 * num_layers)]
        else:
            if self.device.type == "cpu":
                self._managed_ptr = engine.allocate_managed_buffer(2 * num_layers * tensor_bytes)
                raw = torch.from_numpy(as_array(self._managed_ptr, 2 * num_layers * tensor_bytes))
            else:  # one allocation: CUDA IPC exports (and a peer maps) it once for every region
                raw = torch.empty(2 * num_layers * tensor_bytes, dtype=torch.uint8, device=self.device)
            regions = [raw[i * tensor_bytes:(i + 1) * tensor_bytes].view(dtype).view(shape)
                       for i in range(2 * num_layers)]
        self._regions = regions  # [K0, V0, K1, V1, ...]
        if engine is not None:
            try:
                self.register_kv_caches(engine)
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_config(cls, config: Any, *, num_blocks: int, block_size: int = 16,
                    dtype: torch.dtype = torch.float32, engine: Any = None,
                    device: str | torch.device = "cpu", tp_size: int = 1) -> "PagedKVCache":
        """A cache shaped for a model's text config (a Qwen2-VL config or its `text_config`); with `tp_size` > 1,
        for one rank of a tensor-parallel group: its share of the KV heads (`runtime.tp.kv_head_range`)."""
        text = getattr(config, "text_config", config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        start, stop = kv_head_range(text.num_key_value_heads, tp_size, 0)
        return cls(text.num_hidden_layers, stop - start, head_dim, num_blocks=num_blocks,
                   block_size=block_size, dtype=dtype, engine=engine, device=device)

    # ---- the regions ----
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s (K, V) tensors, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self._regions[2 * i], self._regions[2 * i + 1]

    def nbytes(self, num_blocks: int) -> int:
        """Bytes of `num_blocks` blocks over every K and V region: what moves when they are transferred."""
        return num_blocks * self.block_len * len(self._regions)

    @property
    def base_addrs(self) -> list[int]:
        """Address of every region, ``[K0, V0, K1, V1, ...]`` (the seed's `kv_caches_base_addr`)."""
        return [t.data_ptr() for t in self._regions]

    def register_kv_caches(self, engine: Any) -> list[int]:
        """Register every region with `engine` once (seed 003's worker-side ``register_kv_caches()``); returns
        (and keeps in `keys`) their keys, in `base_addrs` order. Raises if already registered."""
        if self._engine is not None:
            raise ValueError("this cache is already registered")
        keys: list[int] = []
        try:
            for t in self._regions:
                keys.append(engine.register(t.data_ptr(), t.numel() * t.element_size()))
        except BaseException:
            for t in self._regions[:len(keys)]:
                engine.deregister(t.data_ptr())
            raise
        self._engine, self.keys = engine, keys
        return keys

    def close(self) -> None:
        """Deregister the regions and free the managed buffer. Idempotent; the cache is unusable after."""
        engine = self._engine
        if engine is not None:
            self._engine, self.keys = None, []
            for t in self._regions:
                engine.deregister(t.data_ptr())
        self._regions = []  # views of the buffer freed below must not outlive it
        if self._managed_ptr is not None:
            ptr, self._managed_ptr = self._managed_ptr, None
            self._allocator.free_managed_buffer(ptr)

    # ---- tokens in and out of blocks ----
    def slots(self, block_ids: Sequence[int], num_tokens: int,
              device: torch.device | str | None = None) -> torch.Tensor:
        """Row of each of a sequence's first `num_tokens` tokens in a region viewed as
        [num_blocks * block_size, heads, head_dim], on `device` (default: the cache's); checked against the
        pool."""
        if num_tokens < 0 or len(block_ids) < blocks_needed(num_tokens, self.block_size):
            raise ValueError(f"{num_tokens} tokens need {blocks_needed(num_tokens, self.block_size)} blocks "
                             f"of {self.block_size}, got {len(block_ids)}")
        # numpy: a prefill's host time before its first kernel (a fifth of torch's CPU ops here)
        blocks = np.asarray(block_ids, dtype=np.int64)
        if len(blocks) and not (0 <= blocks.min() and blocks.max() < self.num_blocks):
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {list(block_ids)}")
        t = np.arange(num_tokens)
        return torch.from_numpy(blocks[t // self.block_size] * self.block_size + t % self.block_size).to(
            device or self.device)

    def write_from(self, layers: KVLayers, block_ids: Sequence[int], num_tokens: int, start: int = 0) -> None:
        """Scatter positions `start`..`num_tokens - 1` of a sequence's KV (per layer (key, value) in transformers'
        layout [1, heads, seq, head_dim]) into their slots of `block_ids`."""
        if len(layers) != self.num_layers:
            raise ValueError(f"the cache has {len(layers)} layers, this paged cache {self.num_layers}")
        slots = self.slots(block_ids, num_tokens)[start:]
        for i, (key, value) in enumerate(layers):
            for region, src in zip(self.layer(i), (key, value)):
                if src.shape[0] != 1 or src.shape[1] != self.num_kv_heads or src.shape[3] != self.head_dim:
                    raise ValueError(f"layer {i}: shape {tuple(src.shape)} is not "
                                     f"[1, {self.num_kv_heads}, seq, {self.head_dim}]")
                if src.dtype != self.dtype:  # a silent cast would break decode's bit-identity
                    raise ValueError(f"layer {i}: KV is {src.dtype}, the cache {self.dtype}")
                flat = region.view(-1, self.num_kv_heads, self.head_dim)
                flat[slots] = src[0, :, start:num_tokens].transpose(0, 1)

    def read_layers(self, block_ids: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Gather `num_tokens` positions from `block_ids`: per layer (key, value), [1, heads, seq, head_dim]."""
        slots = self.slots(block_ids, num_tokens)
        return [tuple(region.view(-1, self.num_kv_heads, self.head_dim)[slots].transpose(0, 1).unsqueeze(0)
                      .contiguous() for region in self.layer(i))
                for i in range(self.num_layers)]

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_layers} layers × K/V [{self.num_blocks}, {self.block_size}, "
                f"{self.num_kv_heads}, {self.head_dim}] {self.dtype} on {self.device}, block_len={self.block_len})")
