"""`DecodeGraphs`: `Qwen2LM.decode` captured as CUDA graphs, one per batch bucket (1, 2, 4, 8, 16, ...),
sharing one memory pool (nano-vllm's and mini-sglang's scheme).

A step of B sequences replays the smallest bucket that holds B. Its inputs travel in ONE host-to-device copy
(a pinned int64 buffer: tokens, positions, slots, sequence lengths, block tables); the rows past B are padding
that writes nothing (slot -1) and attends to nothing (length 0). The graph also takes the argmax on the GPU, so
a greedy step reads back B integers, not B x vocab logits.

Bits: a sequence's logits depend on the bucket it is replayed in (cuBLAS may pick another kernel for another
row count), never on the other rows' contents or lengths (the fused kernels work row by row). So the same
sequence decoded alone, in the monolithic use and in the split, goes through bucket 1 both times.
"""
from __future__ import annotations

import torch

from epd_lab.models.runtime.qwen2 import Qwen2LM


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to `max_batch` (included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_batch`, each sequence up to `max_blocks` blocks.

    Capture runs each bucket once eagerly first (Triton compiles its kernels then), so constructing this takes
    a few seconds on a warm machine; `capture_s` records how long.
    """

    def __init__(self, lm: Qwen2LM, max_batch: int, max_blocks: int) -> None:
        if lm.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {lm.device}")
        self.lm, self.max_batch, self.max_blocks = lm, max_batch, max_blocks
        self.buckets = buckets_up_to(max_batch)
        width = 4 + max_blocks  # per row: token, position, slot, seq_len, then the block table
        self._host = torch.zeros(max_batch * width, dtype=torch.long, pin_memory=True)
        self._device = torch.zeros_like(self._host, device=lm.device)
        self._copied = torch.cuda.Event()  # the host buffer is free again once the last copy out of it ran
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        pool = None
        for bucket in reversed(self.buckets):  # the largest first: the smaller ones fit in its pool
            graph = torch.cuda.CUDAGraph()
            self._step(bucket)  # warm-up: Triton's compile, cuBLAS's workspace
            torch.cuda.synchronize(lm.device)
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._step(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        end.record()
        end.synchronize()
        self.capture_s = start.elapsed_time(end) / 1e3

    def _views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        rows = self._device[:self.max_batch * (4 + self.max_blocks)]
        fields = rows[:4 * self.max_batch].view(4, self.max_batch)[:, :bucket]
        tables = rows[4 * self.max_batch:].view(self.max_batch, self.max_blocks)[:bucket]
        return fields[0], fields[1], fields[2], fields[3], tables

    def _step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, slots, seq_lens, tables = self._views(bucket)
        logits = self.lm.decode(tokens, positions, slots, tables, seq_lens)
        return logits, logits.argmax(-1)

    def bucket(self, batch: int) -> int:
        """The bucket a batch of `batch` sequences replays in."""
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"a batch of {batch} exceeds max_batch {self.max_batch}")

    def run(self, tokens: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay one step; returns (logits [B, vocab], argmax [B]) on the GPU, views into the graph's outputs
        (valid until the next `run`)."""
        batch = len(tokens)
        bucket = self.bucket(batch)
        host = self._host
        self._copied.synchronize()
        host.zero_()
        fields = host[:4 * self.max_batch].view(4, self.max_batch)
        fields[0, :batch] = torch.tensor(tokens)
        fields[1, :batch] = torch.tensor(positions)
        fields[2, :] = -1  # padding rows store nothing
        fields[2, :batch] = torch.tensor(slots)
        fields[3, :batch] = torch.tensor(seq_lens)
        tables = host[4 * self.max_batch:].view(self.max_batch, self.max_blocks)
        for row, table in enumerate(block_tables):
            if len(table) > self.max_blocks:
                raise ValueError(f"a sequence of {len(table)} blocks exceeds max_blocks {self.max_blocks}")
            tables[row, :len(table)] = torch.tensor(table)
        self._device.copy_(host, non_blocking=True)
        self._copied.record()
        self._graphs[bucket].replay()
        logits, tokens_out = self._outputs[bucket]
        return logits[:batch], tokens_out[:batch]
