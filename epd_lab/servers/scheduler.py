"""`DecodeScheduler`: the decode role's generation loop, over a model runtime whose KV stays in the paged cache.

ONE thread owns the runtime's decode. Each turn it steps every active request once, in batches of at most
`max_batch`: one ``runtime.decode`` per batch, each request's token stored as the next token of its own blocks and
attending over them where they lie (the fast runtime; `epd_lab.models.runtime`). Token 0 is prefill's first
token; token i+1 comes from the logits of feeding token i at ``prompt_len + rope_delta + i``, greedy at
temperature 0, else drawn from ``softmax(logits / temperature)`` with the noise of the request's seed and step i+1
(`epd_lab.models.sampling`, as prefill drew token 0): picked where the logits are, so on a GPU only the B token ids
come back.

Blocks: a request arrives with its prompt's blocks (the KV transfer wrote them) and gets one more block whenever
its next token would not fit, as vLLM's scheduler does; when the pool has none left, that request fails with an
error (and frees what it held) while the others go on (the decode server reserves each request's blocks at
admission, so it never meets that; the monolithic server does not). A request that ends (all its tokens, a failure, its client
gone, the server closing) is handed to `on_end`, which gives its blocks back: the blocks of a request are held
from the KV transfer to its last step, and no longer.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from epd_lab.models.sampling import sample
from epd_lab.trace import Recorder, Span

DONE = object()  # the end marker a request's `emit` gets after its last token


@dataclasses.dataclass(slots=True, eq=False)
class Generation:
    """One admitted request: its blocks, how far its KV reaches, and where its tokens go."""

    rid: str
    block_table: list[int]  # the prompt's blocks (the KV transfer wrote them), then those its tokens took
    seq_len: int  # tokens whose KV is in the blocks
    next_position: int  # mrope position of token 0 (prompt_len + rope_delta)
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int  # the sampling noise's (`epd_lab.models.sampling`; the request's, else a random one)
    emit: Callable[[Any], None]  # thread-safe: an int token, DONE, or an Exception
    tokens: list[int]
    spans: list[Span]
    logits: list[torch.Tensor] | None = None  # kept only when the request asked for them
    cancelled: bool = False
    released: Callable[[], None] = lambda: None  # called once its blocks are back (decode's KV reservation)


class DecodeScheduler:
    """See the module docstring.

    Args:
        runtime: the model runtime (its `decode`, its `cache.block_size`).
        max_batch: requests per decode forward.
        allocate: ``allocate(n)`` → n block ids, or raises (the pool is exhausted).
        recorder: where each token's ``decode_step`` span goes.
        count: the server's counter (``count(*names, **amounts)``).
        on_end: called once with each request that ended, from the scheduler's thread (or `close`'s).
    """

    def __init__(self, runtime: Any, max_batch: int, allocate: Callable[[int], list[int]], recorder: Recorder,
                 count: Callable[..., None], on_end: Callable[[Generation], None]) -> None:
        self.runtime, self.max_batch, self.recorder = runtime, max_batch, recorder
        self._allocate, self._block_size = allocate, runtime.cache.block_size
        self._count, self._on_end = count, on_end
        self._cond = threading.Condition()
        self._active: list[Generation] = []
        self._closed = False
        self._thread = threading.Thread(target=self._schedule, name="decode-scheduler", daemon=True)
        self._thread.start()

    @property
    def num_active(self) -> int:
        """Requests generating."""
        with self._cond:
            return len(self._active)

    def add(self, gen: Generation) -> None:
        """Queue an admitted request for its next step (token 0 was emitted already)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the decode scheduler is closed")
            self._active.append(gen)
            self._cond.notify()

    def close(self) -> None:
        """Fail the active requests, hand them to `on_end` and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    batch, self._active = self._active, []
                    for gen in batch:
                        gen.emit(RuntimeError("the decode server is shutting down"))
                        self._on_end(gen)
                    return
                batch = list(self._active)
            ended = [gen for gen in batch if gen.cancelled]
            self._count(requests_cancelled=len(ended))
            live = []
            for gen in batch:
                if gen.cancelled:
                    continue
                if self._grow(gen):
                    live.append(gen)
                else:
                    ended.append(gen)
            for start in range(0, len(live), self.max_batch):
                ended += self._step(live[start:start + self.max_batch])
            if ended:
                with self._cond:
                    self._active = [g for g in self._active if g not in ended]
                for gen in ended:
                    self._on_end(gen)

    def _grow(self, gen: Generation) -> bool:
        """Room in `gen`'s blocks for the token its next step stores: a block more when full. False (the request
        failed, told why) when the pool has none."""
        if gen.seq_len < len(gen.block_table) * self._block_size:
            return True
        try:
            gen.block_table += self._allocate(1)
        except Exception as exc:  # noqa: BLE001 - OutOfBlocks: this request fails, the others go on
            self._count("requests_failed", kv_pool_exhausted=1)
            gen.emit(RuntimeError(f"KV pool exhausted while generating: {exc}"))
            return False
        return True

    def _step(self, batch: list[Generation]) -> list[Generation]:
        """One decode step of every request in `batch` (one forward): feed each its last token, emit the next.

        Returns the requests that ended: those with all their tokens, and failed ones (all of them when the
        forward fails). Their decode_step spans share the forward's start.
        """
        t0 = time.monotonic_ns()
        try:
            logits = self.runtime.decode([gen.tokens[-1] for gen in batch],
                                         [gen.next_position + len(gen.tokens) - 1 for gen in batch],
                                         [gen.block_table for gen in batch], [gen.seq_len + 1 for gen in batch])
            # picked on the logits' device, B ids copied back; only the rows of a request that keeps its logits
            # travel whole (float32 holds float32 and bfloat16 logits exactly)
            picks = sample(logits, [gen.temperature for gen in batch], [gen.seed for gen in batch],
                           [len(gen.tokens) for gen in batch]).tolist()
            wanted = [i for i, gen in enumerate(batch) if gen.logits is not None]
            rows = dict(zip(wanted, logits[wanted].float().cpu())) if wanted else {}
        except Exception as exc:  # noqa: BLE001 - its requests fail, the scheduler keeps going
            self._count(requests_failed=len(batch))
            for gen in batch:
                gen.emit(exc)
            return batch
        self._count("decode_forwards")
        ended: list[Generation] = []
        for i, gen in enumerate(batch):
            gen.seq_len += 1
            token = picks[i]
            gen.tokens.append(token)
            if gen.logits is not None:
                gen.logits.append(rows[i])
            gen.spans.append(Span(gen.rid, len(gen.tokens) - 1, "decode_step", self.recorder.node, t0,
                                  time.monotonic_ns()))
            self.recorder.add(gen.spans[-1])
            self._count(tokens_generated=1)
            gen.emit(token)
            if len(gen.tokens) >= gen.max_tokens:
                ended.append(gen)
                self._count("requests_finished")
                gen.emit(DONE)
        return ended
