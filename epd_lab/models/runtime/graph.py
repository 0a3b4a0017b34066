"""`Qwen2LM`'s forward captured as CUDA graphs, one per bucket of sizes, all sharing one memory pool (nano-vllm's
and mini-sglang's scheme): `DecodeGraphs` per batch size (1, 2, 4, 8, 16, ...), `PrefillGraphs` per prompt length
(64, 128, 256, 512, then steps of 512).

A decode bucket's forward is captured in parts, runs of layers growing 1, 2, 4, 8, ... (`qwen2.layer_bounds`),
one graph each, launched back to back: the GPU starts on the first part while the host still launches the rest
(7B on the H200: 0.96x the wall of one graph per bucket; 2B 1.00x). A prefill is one graph (see `PrefillGraphs`).
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

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from epd_lab.models.runtime.gate import Gate
from epd_lab.models.runtime.qwen2 import Qwen2LM, layer_bounds

T = TypeVar("T")


def buckets_up_to(max_batch: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then steps of 8 up to `max_batch` (included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def token_buckets(max_tokens: int, smallest: int = 64, step: int = 512) -> list[int]:
    """Prefill buckets: powers of two from `smallest` up to `step`, then multiples of `step`, up to the first that
    holds `max_tokens`. A prompt pays for its bucket's rows: in powers of two a 4 x 448² prompt (~1,100 tokens)
    ran in 2,048 rows and an 8 x 448² one (~2,090) in 4,096; in steps of 512 they run in 1,536 and 2,560, for four
    more graphs up to 4,096: 2B prefill 9.0 against 11.4 ms and 14.3 against 22.1 ms on an H200, one image's
    unchanged (`data/bench/prefill-buckets-h200.json`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1] if sizes[-1] < step else sizes[-1] + step)
    return sizes


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection in any thread meanwhile (`gc` is the interpreter's, not a thread's)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(fn: Callable[[], T], device: torch.device, pool: tuple | None = None,
            collect: bool = True) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of `fn` and the output it captured, into `pool` (None: a new one); `collect`: collect garbage first.

    PyTorch's recipe: `fn` runs once eagerly on the capture stream first (Triton compiles, cuBLAS makes that
    stream's handle and workspace, allocations settle), then is captured on the same stream. Warmed up on the
    default stream instead, a 2B prefill's capture failed once on the H200 with CUBLAS_STATUS_EXECUTION_FAILED
    (`data/bench/logs/cuda-graph-capture-cublas-failure-h200.txt`); the recipe removes the likeliest cause, a GEMM creating its
    stream's workspace while capturing. Not reproduced on purpose.

    No garbage is collected during a capture. PyTorch no longer collects before one (``force_cudagraph_gc`` is
    off), so a collection could start mid-capture and free what an earlier runtime left (its graphs, their
    pools); a process that opened its ninth runtime (a test, a re-run notebook cell) once failed its decode
    capture on the H200 with ``cudaErrorStreamCaptureInvalidated`` (`data/bench/logs/cuda-graph-capture-invalidated-h200.txt`).
    That garbage is collected before the capture instead, where it is harmless.
    """
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    if collect:
        gc.collect()
    graph = torch.cuda.CUDAGraph()
    with _gc_paused(), torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class _Graphs:
    """Graphs of each bucket's forward, captured largest bucket first into one pool; `capture=False` runs the same
    padded forwards eagerly instead (the same kernels on the same shapes: the same bits, for comparison).

    `step(bucket)` gives a bucket's forward as its input and its chain of parts (`Stages.parts`): each part is
    captured as its own graph, and a replay launches them in order, so that the GPU runs a part while the host
    launches the next (a graph of ~330 nodes took 0.4-0.7 ms of host time to launch on the H200)."""

    def __init__(self, device: torch.device, buckets: list[int],
                 step: Callable[[int], tuple[Any, list[Callable[[Any], Any]]]], capture: bool) -> None:
        if device.type != "cuda":
            raise ValueError(f"bucketed steps run on a CUDA device, the model is on {device}")
        self.buckets, self._step = buckets, step
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        if capture:
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        pool = None
        for bucket in reversed(self.buckets):  # the largest first: the smaller ones fit in its pool
            value, parts = self._step(bucket)
            graphs = []
            for part in parts:  # each part reads the output its predecessor's graph wrote
                # garbage collected before the first graph only: once a runtime is enough
                graph, value = capture(lambda part=part, value=value: part(value), device, pool, pool is None)
                pool = graph.pool()
                graphs.append(graph)
            self._graphs[bucket], self._outputs[bucket] = graphs, value
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
        """Replay a bucket (or run its forward eagerly); its output, copied (the next replay overwrites the
        graph's own)."""
        if not self._graphs:
            value, parts = self._step(bucket)
            for part in parts:
                value = part(value)
            return value
        for graph in self._graphs[bucket]:
            graph.replay()
        return self._outputs[bucket].clone()


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_batch`, each sequence up to `max_blocks` blocks.

    Capture runs each bucket once eagerly first (Triton compiles its kernels then); `capture_s` records how long.
    `capture=False`: the same bucketed steps, run eagerly.
    """

    def __init__(self, lm: Qwen2LM, max_batch: int, max_blocks: int, capture: bool = True,
                 staged: bool = True) -> None:
        self.lm, self.max_batch, self.max_blocks = lm, max_batch, max_blocks
        self.bounds = layer_bounds(len(lm.layers)) if staged else [len(lm.layers)]
        width = 4 + max_blocks  # per row: token, position, slot, seq_len, then the block table
        self._host = torch.zeros(max_batch * width, dtype=torch.long, pin_memory=True)
        self._host[2 * max_batch:3 * max_batch] = -1  # the warm-up and padding rows store nothing
        self._numpy = self._host.numpy()  # the same pinned memory
        self._device = self._host.to(lm.device)
        self._copied = torch.cuda.Event()  # the host buffer is free again once the last copy out of it ran
        self._graphs = _Graphs(lm.device, buckets_up_to(max_batch), self._step, capture)
        self.capture_s = self._graphs.capture_s

    def _step(self, bucket: int) -> tuple[torch.Tensor, list[Callable[[Any], Any]]]:
        fields = self._device[:4 * self.max_batch].view(4, self.max_batch)[:, :bucket]
        tables = self._device[4 * self.max_batch:].view(self.max_batch, self.max_blocks)[:bucket]
        tokens, positions, slots, seq_lens = fields
        return tokens, self.lm.decode_stages(positions, slots, tables, seq_lens).parts(self.bounds)

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
    bucketed prefills, run eagerly).

    The graph starts from token ids: the embedding lookup and the image embeddings' scatter into the image_pad
    rows (`image_token_id`) are in it. A call's ids, mrope positions, cache rows and last index travel in ONE
    host-to-device copy (a pinned int64 buffer), the image embeddings in one device copy: no pageable copy,
    hence no host sync, before the replay.
    """

    def __init__(self, lm: Qwen2LM, max_tokens: int, image_token_id: int, capture: bool = True) -> None:
        self.lm, self.image_token_id = lm, image_token_id
        # one graph: in parts, a 2B prefill's wall was 1.04x one graph's on the H200 (7B 1.01x; side by side,
        # `data/bench/runtime-h200-prefill-graph-parts-full.json`): its GPU time hides the launches, the parts' fixed costs add
        self.bounds = [len(lm.layers)]
        buckets = token_buckets(max_tokens)
        self.max_tokens = width = buckets[-1]
        # ids, 3 rows of positions, slots (each `width`), then the index of the last prompt token
        self._host = torch.zeros(5 * width + 1, dtype=torch.long, pin_memory=True)
        self._host[4 * width:5 * width] = -1  # the warm-up and capture store nothing
        self._numpy = self._host.numpy()
        self._device = self._host.to(lm.device)
        self._copied = torch.cuda.Event()  # the host buffer is free again once the last copy out of it ran
        self._images = torch.zeros(width, lm.embed.shape[1], dtype=lm.dtype, device=lm.device)
        # every prefill replays here, gated or not (one graph pool: never two replays at once); a stream of
        # its own, so that a gate's wait blocks no other work of the process (the cuda transport's copies
        # go on the legacy default stream)
        self.stream = torch.cuda.Stream(lm.device)
        self._graphs = _Graphs(lm.device, buckets, self._step, capture)
        self.capture_s = self._graphs.capture_s

    def _step(self, bucket: int) -> tuple[torch.Tensor, list[Callable[[Any], Any]]]:
        width = self.max_tokens
        ids = self._device[:bucket]
        positions = self._device[width:4 * width].view(3, width)[:, :bucket]
        slots = self._device[4 * width:4 * width + bucket]
        first, *rest = self.lm.prefill_stages(positions, slots, self._device[5 * width:]).parts(self.bounds)
        return ids, [lambda ids: first(self._embed(ids)), *rest]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt's input embeddings: the k-th image_pad takes image embedding k, the other ids their own."""
        is_image = ids == self.image_token_id
        image_row = (torch.cumsum(is_image, 0) - 1).clamp_(min=0)
        return torch.where(is_image[:, None], self._images.index_select(0, image_row), self.lm.embed_tokens(ids))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            image_embeds: torch.Tensor | None, gate: Gate | None = None) -> torch.Tensor:
        """Replay the prefill of one prompt: ids [T], mrope positions [3, T] and cache rows [T] on the host, the
        embeddings of its image_pad tokens in order (any device, any float dtype); returns its last logits
        [vocab] on the GPU. The embeddings are read by queued work: keep them until the logits are read.

        Ungated, the caller's stream waits for the logits. With a `gate`, the copies and the replay wait on the
        GPU for it to open (`runtime.gate`), and nothing else waits: read the logits after an event recorded on
        `stream`."""
        tokens, width = len(ids), self.max_tokens
        bucket = self._graphs.bucket(tokens)
        self._copied.synchronize()
        buf = self._numpy
        buf[:bucket] = 0  # padding: id 0 is no image_pad; nothing real attends to these rows
        buf[:tokens] = ids.numpy()
        rows = buf[width:4 * width].reshape(3, width)
        rows[:, :bucket] = 0
        rows[:, :tokens] = positions.numpy()
        buf[4 * width:4 * width + bucket] = -1  # padding rows store nothing
        buf[4 * width:4 * width + tokens] = slots.numpy()
        buf[5 * width] = tokens - 1
        caller, stream = torch.cuda.current_stream(self.lm.device), self.stream
        stream.wait_stream(caller)  # what the caller queued before (embeddings made on the GPU, KV reads)
        with torch.cuda.stream(stream):
            if gate is not None:
                gate.wait(stream)
            if image_embeds is not None:
                self._images[:len(image_embeds)].copy_(image_embeds, non_blocking=True)
                if image_embeds.is_cuda:
                    image_embeds.record_stream(stream)
            self._device.copy_(self._host, non_blocking=True)
            self._copied.record(stream)
            logits = self._graphs.replay(bucket)
        logits.record_stream(caller)
        if gate is None:
            caller.wait_stream(stream)
        return logits
