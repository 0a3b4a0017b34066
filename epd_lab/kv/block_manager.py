"""`BlockManager`: the free list of a paged KV cache's blocks (nano-vllm's block manager, without prefix caching).

Blocks are handed out from the front of the free list and returned to its back, so after a few requests
come and go the free list is no longer in order and a request's blocks are not contiguous: the fragmented
block tables that the transfer's run merging (`group_concurrent_contiguous`) must handle. `shuffle_seed`
starts from a shuffled free list, to get fragmentation on the first allocation.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Iterable


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens at `block_size` tokens per block."""
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    """`allocate` asked for more blocks than are free."""


class BlockManager:
    """Allocates and frees block ids in ``range(num_blocks)``; thread-safe (the KV producer frees from its
    side-channel thread while the scheduler allocates).

    Args:
        num_blocks: size of the pool.
        shuffle_seed: shuffle the initial free list with this seed (None: ascending order).
    """

    def __init__(self, num_blocks: int, *, shuffle_seed: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(ids)
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to `allocate`."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks allocated and not yet freed."""
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free list; raises `OutOfBlocks` (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free")
            ids = [self._free.popleft() for _ in range(n)]
            self._used.update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the back of the free list. Raises `ValueError`, freeing nothing, if any id is
        not allocated (a double free, or an id outside the pool) or repeats."""
        ids = list(block_ids)
        with self._lock:
            bad = [b for b in ids if b not in self._used]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"free of blocks that are not allocated (double free?): {bad or ids}")
            self._used.difference_update(ids)
            self._free.extend(ids)

    def __repr__(self) -> str:
        return f"BlockManager({self.num_free_blocks}/{self.num_blocks} free)"
