"""`Qwen2LM`'s forward captured as CUDA graphs, one per bucket of sizes, all sharing one memory pool (nano-vllm's
and mini-sglang's scheme): `DecodeGraphs` per batch size (1, 2, 4, 8, 16, ...), `PrefillGraphs` per prompt length
(64, 128, ..., powers of two).

A call replays the smallest bucket that holds it; the rows past it are padding that writes nothing to the
cache (slot -1) and that no real row attends to (decode: length 0; prefill: causal, after the prompt). A decode
step's inputs travel in ONE host-to-device copy (a pinned int64 buffer: tokens, positions, slots, sequence
lengths, block tables).

Bits: a sequence's logits depend on the bucket it is replayed in (cuBLAS may pick another kernel for another
row count), never on the other rows' contents or lengths (the fused kernels work row by row). The same prompt
always lands in the same prefill bucket, and a sequence decoded alone always in decode bucket 1, in the
monolithic use and in the split alike.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from epd_lab.models.runtime.qwen2 import Qwen2LM


def buckets_up_to(max_batch: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then steps of 8 up to `max_batch` (included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def token_buckets(max_tokens: int, smallest: int = 64) -> list[int]:
    """Prefill buckets: powers of two from `smallest` up to the first that holds `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1])
    return sizes


class _Graphs:
    """Graphs of `step(bucket)` for each bucket, captured largest first into one pool; `capture=False` runs the
    same padded steps eagerly instead (the same kernels on the same shapes: the same bits, for comparison)."""

    def __init__(self, device: torch.device, buckets: list[int], step: Callable[[int], torch.Tensor],
                 capture: bool) -> None:
        if device.type != "cuda":
            raise ValueError(f"bucketed steps run on a CUDA device, the model is on {device}")
        self.buckets, self._step = buckets, step
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        if capture:
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        step = self._step
        buckets = self.buckets
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        pool = None
        for bucket in reversed(buckets):  # the largest first: the smaller ones fit in its pool
            graph = torch.cuda.CUDAGraph()
            step(bucket)  # warm-up: Triton's compile, cuBLAS's workspace
            torch.cuda.synchronize(device)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._outputs[bucket] = step(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        end.record()
        end.synchronize()
        self.capture_s = start.elapsed_time(end) / 1e3

    def bucket(self, size: int) -> int:
        """The bucket a call of `size` rows replays in."""
        for bucket in self.buckets:
            if bucket >= size:
                return bucket
        raise ValueError(f"{size} rows exceed the largest bucket, {self.buckets[-1]}")

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay a bucket (or run its step eagerly); its output, copied (the next replay overwrites the graph's
        own)."""
        if not self._graphs:
            return self._step(bucket)
        self._graphs[bucket].replay()
        return self._outputs[bucket].clone()


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_batch`, each sequence up to `max_blocks` blocks.

    Capture runs each bucket once eagerly first (Triton compiles its kernels then); `capture_s` records how long.
    `capture=False`: the same bucketed steps, run eagerly.
    """

    def __init__(self, lm: Qwen2LM, max_batch: int, max_blocks: int, capture: bool = True) -> None:
        self.lm, self.max_batch, self.max_blocks = lm, max_batch, max_blocks
        width = 4 + max_blocks  # per row: token, position, slot, seq_len, then the block table
        self._host = torch.zeros(max_batch * width, dtype=torch.long, pin_memory=True)
        self._host[2 * max_batch:3 * max_batch] = -1  # the warm-up and padding rows store nothing
        self._numpy = self._host.numpy()  # the same pinned memory
        self._device = self._host.to(lm.device)
        self._copied = torch.cuda.Event()  # the host buffer is free again once the last copy out of it ran
        self._graphs = _Graphs(lm.device, buckets_up_to(max_batch), self._step, capture)
        self.capture_s = self._graphs.capture_s

    def _step(self, bucket: int) -> torch.Tensor:
        fields = self._device[:4 * self.max_batch].view(4, self.max_batch)[:, :bucket]
        tables = self._device[4 * self.max_batch:].view(self.max_batch, self.max_blocks)[:bucket]
        tokens, positions, slots, seq_lens = fields
        return self.lm.decode(tokens, positions, slots, tables, seq_lens)

    def run(self, tokens: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Replay one step of B sequences; returns logits [B, vocab] on the GPU."""
        batch = len(tokens)
        bucket = self._graphs.bucket(batch)
        host = self._host
        if max(len(table) for table in block_tables) > self.max_blocks:
            raise ValueError(f"a sequence of more than max_blocks {self.max_blocks} blocks")
        self._copied.synchronize()
        buf = self._numpy  # numpy's element writes cost a fraction of torch's on the host
        buf.fill(0)
        fields = buf[:4 * self.max_batch].reshape(4, self.max_batch)
        fields[2, :] = -1
        for row, values in enumerate((tokens, positions, slots, seq_lens)):
            fields[row, :batch] = values
        tables = buf[4 * self.max_batch:].reshape(self.max_batch, self.max_blocks)
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
        self._device.copy_(host, non_blocking=True)
        self._copied.record()
        return self._graphs.replay(bucket)[:batch]


class PrefillGraphs:
    """Captured prefills of one prompt each, for prompts up to `max_tokens` tokens (`capture=False`: the same
    bucketed prefills, run eagerly)."""

    def __init__(self, lm: Qwen2LM, max_tokens: int, capture: bool = True) -> None:
        self.lm = lm
        buckets = token_buckets(max_tokens)
        self.max_tokens = buckets[-1]
        hidden = lm.embed.shape[1]
        self._embeds = torch.zeros(self.max_tokens, hidden, dtype=lm.dtype, device=lm.device)
        self._positions = torch.zeros(3, self.max_tokens, dtype=torch.long, device=lm.device)
        self._slots = torch.full((self.max_tokens,), -1, dtype=torch.long, device=lm.device)
        self._last = torch.zeros(1, dtype=torch.long, device=lm.device)
        self._graphs = _Graphs(lm.device, buckets, self._step, capture)
        self.capture_s = self._graphs.capture_s

    def _step(self, bucket: int) -> torch.Tensor:
        return self.lm.prefill(self._embeds[:bucket], self._positions[:, :bucket], self._slots[:bucket], self._last)

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Replay the prefill of one prompt (all three on the GPU: embeddings [T, hidden], mrope positions [3, T],
        cache rows [T]); returns its last logits [vocab]."""
        tokens = embeds.shape[0]
        bucket = self._graphs.bucket(tokens)
        self._embeds[:tokens].copy_(embeds)
        self._embeds[tokens:bucket].zero_()
        self._positions[:, :tokens].copy_(positions)
        self._positions[:, tokens:bucket].zero_()
        self._slots[:tokens].copy_(slots)
        self._slots[tokens:bucket].fill_(-1)
        self._last.fill_(tokens - 1)
        return self._graphs.replay(bucket)
