"""The encoder's embedding cache: by content hash, capped in bytes, least recently used evicted first."""
from __future__ import annotations

import collections
import threading

import torch


class EmbeddingCache:
    """Embeddings by content key, capped in bytes, least recently used evicted first. Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Whether `key` is cached, without counting a hit or a miss or touching its recency."""
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embedding of `key` (a hit, now the most recently used), or None (a miss)."""
        with self._lock:
            tensor = self._entries.get(key)
            if tensor is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return tensor

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` (owned by the cache from now on: never registered or written to)."""
        nbytes = tensor.nbytes
        if nbytes > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old.nbytes
            while self.num_bytes + nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = tensor
            self.num_bytes += nbytes
