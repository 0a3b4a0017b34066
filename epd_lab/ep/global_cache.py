"""The global embedding cache (SGLang's ``--enable-mm-global-cache``): three levels an encoder looks an image up in
before it runs the ViT.

- L1: the encoder's own cache (`EmbeddingCache` on its device), as without the global cache.
- L2: a host pool on rank 0 of the encoder (an `EmbeddingCache` of host tensors, ``--l2-bytes``): what L1 evicted
  can still be found without the network.
- L3: Mooncake Store (`epd_lab.ep.store`), shared by every encoder that talks to one master: an image one encoder
  encoded is found by another.

Keys are content-addressed (`embedding_key`): the image's bytes, the model and the preprocessing settings, so that
two encoders of one model share an entry and two models never do.

The flow of one part (`GlobalEmbeddingCache.lookup`, then `Lookup.collect` in the ViT's turn):

1. when the part's images are hashed, the items found in neither L1 nor L2 are asked of L3 in one
   ``batch_is_exist``; each one there starts its prefetch (get + check) in the store client's threads at once;
2. in the ViT's turn, each item is taken from L1, else L2, else its prefetch (awaited until the lookup's
   deadline); the rest, and every prefetch that failed, timed out or was refused by the digest check (a
   fallback, counted), go to the ViT (with TP ranks: only those, so every rank sees only the misses);
3. each embedding the ViT made goes into L1 and L2, and into L3 in the background (`insert`): a put never delays
   the part's /send; puts beyond ``MAX_PENDING_PUTS`` waiting are dropped (counted).

L3 failing (the master killed, a segment's owner gone) turns every L3 lookup into a miss within ``timeout``; the
Mooncake client reconnects by itself once the master is back.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from epd_lab.ep.cache import EmbeddingCache
from epd_lab.ep.store import IntegrityError, StoreClient
from epd_lab.serving import Metric, RoleMetrics

MAX_PENDING_PUTS = 64  # L3 puts waiting at once: past it a new one is dropped, not queued behind a dead master


def embedding_key(media_digest: str, model: str, dtype: str, preprocessing: dict[str, Any],
                  vision_config: dict[str, Any] | None = None) -> str:
    """The content address of an image's embedding: the sha256 of its bytes (`media_digest`, hex), the model
    (its directory's name and, when given, its vision tower's config), the embedding's dtype and the preprocessing
    settings. Printable, as Mooncake keys are strings."""
    model_id = json.dumps({"model": Path(model).name, "vision": vision_config or {}, "dtype": dtype,
                           "pre": preprocessing}, sort_keys=True, default=str)
    return f"epd-emb/{hashlib.sha256(model_id.encode()).hexdigest()[:16]}/{media_digest}"


@dataclasses.dataclass(slots=True)
class Counters:
    """What L3 did, read by `/metrics` (L1's and L2's hits and misses are their `EmbeddingCache`'s own)."""

    hits: int = 0
    misses: int = 0  # items asked of L3 (in neither L1 nor L2) and not taken from it
    fallbacks: int = 0  # found in L3, yet ran through the ViT: the prefetch failed, timed out or was refused
    integrity_failures: int = 0  # objects the digest or length check refused
    prefetch_timeouts: int = 0
    lookup_errors: int = 0  # batch_is_exist failed or did not answer in time
    prefetch_seconds: float = 0.0  # Σ from each prefetch's start to its result in hand
    l3_bytes_got: int = 0
    puts: int = 0
    put_failures: int = 0
    puts_dropped: int = 0
    l3_bytes_put: int = 0


@dataclasses.dataclass(slots=True)
class Lookup:
    """One part's L3 lookup: per item, its prefetch (None: not asked of L3, or not there); `t_start_ns`: when
    the lookup began (the ``store_get`` span's start); `found_all`: every item was in L1, L2 or L3 (the part
    should need no ViT, unless a prefetch fails)."""

    keys: list[str]
    prefetches: list[concurrent.futures.Future | None]
    deadline: float  # monotonic seconds: a prefetch not done by then is a fallback
    t_start_ns: int
    found_all: bool = False


@dataclasses.dataclass(slots=True)
class Found:
    """What `collect` found: per item its embedding (None: to the ViT), the level it came from, and the L3
    bytes fetched."""

    pieces: list[torch.Tensor | None]
    levels: list[str | None]
    l3_bytes: int = 0


class GlobalEmbeddingCache:
    """L1, L2 and L3 of one encoder (rank 0); see the module docstring. Thread-safe.

    Args:
        l1: the encoder's own cache (on its device).
        l2_bytes: the host pool's capacity (0: no L2).
        store: the L3 client (None: no L3).
        device: where embeddings are used (L2 and L3 hits are copied there).
        timeout: seconds a part waits for its L3 lookup and prefetches before running the ViT instead.
    """

    def __init__(self, l1: EmbeddingCache, l2_bytes: int, store: StoreClient | None, device: torch.device,
                 timeout: float) -> None:
        self.l1, self.store, self.device, self.timeout = l1, store, device, timeout
        self.l2 = EmbeddingCache(l2_bytes)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._pending_puts = 0
        # puts in a thread of their own: one blocked by a dead master (seconds) never holds up a prefetch
        self._putter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-store-put")

    @property
    def enabled(self) -> bool:
        """Whether any level can hold anything (else the encoder needs no keys)."""
        return bool(self.l1.capacity_bytes or self.l2.capacity_bytes or self.store is not None)

    def lookup(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> Lookup:
        """Ask L3 for the items in neither L1 nor L2, and start the prefetch of each found there; an object whose
        tensor is not of its item's shape in `shapes` and of `dtype` is refused as a changed one is."""
        t0 = time.monotonic_ns()
        prefetches: list[concurrent.futures.Future | None] = [None] * len(keys)
        deadline = time.monotonic() + self.timeout
        asked = [i for i, key in enumerate(keys) if key not in self.l1 and key not in self.l2]
        if self.store is None:
            return Lookup(list(keys), prefetches, deadline, t0, not asked)
        if asked:
            found = self.store.exists([keys[i] for i in asked])
            if None in found:
                with self._lock:
                    self.counters.lookup_errors += 1
            for i, there in zip(asked, found):
                if there:
                    prefetches[i] = self.store.submit(self._prefetch, keys[i], tuple(shapes[i]), dtype)
        return Lookup(list(keys), prefetches, deadline, t0, all(prefetches[i] is not None for i in asked))

    def _prefetch(self, key: str, shape: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[torch.Tensor | None, int, float]:
        """In a store thread: the checked tensor on the device (None: gone meanwhile, or the fetch failed), its
        bytes and the seconds taken. An object the check refuses, or not of `shape` and `dtype`, is counted and is
        None."""
        t0 = time.monotonic()
        try:
            tensor = self.store.get(key)
            if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != dtype):
                raise IntegrityError(f"{key}: {list(tensor.shape)} {tensor.dtype}, the image needs {list(shape)} "
                                     f"{dtype}")
        except IntegrityError:
            with self._lock:
                self.counters.integrity_failures += 1
            return None, 0, time.monotonic() - t0
        if tensor is None:
            return None, 0, time.monotonic() - t0
        return tensor.to(self.device), tensor.nbytes, time.monotonic() - t0

    def collect(self, lookup: Lookup) -> Found:
        """In the ViT's turn: each item from L1, else L2 (then kept in L1 too), else its prefetch (awaited until
        the lookup's deadline; then kept in L1 and L2); None for the ViT."""
        found = Found([None] * len(lookup.keys), [None] * len(lookup.keys))
        for i, key in enumerate(lookup.keys):
            piece = self.l1.get(key)
            if piece is not None:
                found.pieces[i], found.levels[i] = piece, "l1"
                continue
            if self.l2.capacity_bytes:
                host = self.l2.get(key)
                if host is not None:
                    found.pieces[i], found.levels[i] = host.to(self.device), "l2"
                    self.l1.put(key, found.pieces[i])
                    continue
            if self.store is None:
                continue
            prefetch = lookup.prefetches[i]
            got = self._await(prefetch, lookup.deadline) if prefetch is not None else None
            with self._lock:
                if got is None:
                    self.counters.misses += 1
                else:
                    self.counters.hits += 1
            if got is None:
                continue
            tensor, nbytes = got
            found.pieces[i], found.levels[i] = tensor, "l3"
            found.l3_bytes += nbytes
            self.l1.put(key, tensor)
            self.l2.put(key, tensor if tensor.device.type == "cpu" else tensor.to("cpu"))
        for prefetch in lookup.prefetches:  # those not awaited (found in L1 or L2 meanwhile): not needed
            if prefetch is not None:
                prefetch.cancel()
        return found

    def _await(self, prefetch: concurrent.futures.Future, deadline: float) -> tuple[torch.Tensor, int] | None:
        """The prefetch's tensor and bytes, or None (a fallback, counted) when it failed or is late."""
        try:
            tensor, nbytes, seconds = prefetch.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            prefetch.cancel()
            with self._lock:
                self.counters.prefetch_timeouts += 1
                self.counters.fallbacks += 1
            return None
        except Exception:  # the store failed under it: the ViT answers instead
            tensor = None
            seconds = 0.0
            nbytes = 0
        with self._lock:
            self.counters.prefetch_seconds += seconds
            if tensor is None:
                self.counters.fallbacks += 1
            else:
                self.counters.l3_bytes_got += nbytes
        return None if tensor is None else (tensor, nbytes)

    def insert(self, key: str, tensor: torch.Tensor,
               stored: Callable[[int, int, int], None] | None = None) -> None:
        """An embedding the ViT made (owned by the cache from now on): into L1 and L2 now, into L3 in the
        background (dropped when ``MAX_PENDING_PUTS`` wait already); `stored(t_start_ns, t_end_ns, nbytes)` once
        the L3 put succeeded."""
        self.l1.put(key, tensor)
        if self.l2.capacity_bytes:
            self.l2.put(key, tensor if tensor.device.type == "cpu" else tensor.to("cpu"))
        if self.store is None:
            return
        with self._lock:
            if self._pending_puts >= MAX_PENDING_PUTS:
                self.counters.puts_dropped += 1
                return
            self._pending_puts += 1
        try:
            self._putter.submit(self._put, key, tensor, stored)
        except RuntimeError:  # closing
            with self._lock:
                self._pending_puts -= 1

    def _put(self, key: str, tensor: torch.Tensor, stored: Callable[[int, int, int], None] | None) -> None:
        t0 = time.monotonic_ns()
        try:
            rc = self.store.put(key, tensor)
        except Exception:  # a put is best effort: the next encoder that needs it runs the ViT
            rc = -1
        if rc == 0 and stored is not None:
            stored(t0, time.monotonic_ns(), tensor.nbytes)
        with self._lock:
            self._pending_puts -= 1
            if rc == 0:
                self.counters.puts += 1
                self.counters.l3_bytes_put += tensor.nbytes
            else:
                self.counters.put_failures += 1

    def metric_families(self, metrics: RoleMetrics) -> list[Metric]:
        """``/metrics`` (named by `metrics`): hits and misses per level, L3's fallbacks, refusals, timings and
        bytes, L2's bytes."""
        c = self.counters
        with self._lock:
            rows = [
                ("mm_cache_l1_hits_total", "counter", self.l1.hits, "items found in L1 (the encoder's own cache)"),
                ("mm_cache_l1_misses_total", "counter", self.l1.misses, "items not in L1"),
                ("mm_cache_l2_hits_total", "counter", self.l2.hits, "items found in L2 (the host pool)"),
                ("mm_cache_l2_misses_total", "counter", self.l2.misses, "items in neither L1 nor L2"),
                ("mm_cache_l3_hits_total", "counter", c.hits, "items taken from L3 (Mooncake Store)"),
                ("mm_cache_l3_misses_total", "counter", c.misses,
                 "items the ViT encoded: in no level, or not taken from L3"),
                ("mm_cache_l1_bytes", "gauge", self.l1.num_bytes, "bytes in L1"),
                ("mm_cache_l2_bytes", "gauge", self.l2.num_bytes, "bytes in the host pool (L2)"),
                ("mm_cache_l2_entries", "gauge", len(self.l2), "embeddings in the host pool (L2)"),
                ("mm_cache_l3_enabled", "gauge", int(self.store is not None), "1: Mooncake Store (L3) is in use"),
                ("mm_cache_l3_fallbacks_total", "counter", c.fallbacks,
                 "items found in L3 that the ViT encoded after all (prefetch failed, late or refused)"),
                ("mm_cache_l3_integrity_failures_total", "counter", c.integrity_failures,
                 "L3 objects refused by the length or digest check"),
                ("mm_cache_l3_prefetch_timeouts_total", "counter", c.prefetch_timeouts, "L3 prefetches past their "
                 "deadline"),
                ("mm_cache_l3_lookup_errors_total", "counter", c.lookup_errors, "L3 lookups that failed or were late"),
                ("mm_cache_l3_prefetch_seconds_total", "counter", round(c.prefetch_seconds, 6),
                 "seconds the L3 prefetches took, summed"),
                ("mm_cache_l3_bytes_got_total", "counter", c.l3_bytes_got, "embedding bytes fetched from L3"),
                ("mm_cache_l3_puts_total", "counter", c.puts, "embeddings put into L3"),
                ("mm_cache_l3_put_failures_total", "counter", c.put_failures, "L3 puts that failed"),
                ("mm_cache_l3_puts_dropped_total", "counter", c.puts_dropped,
                 f"L3 puts dropped: {MAX_PENDING_PUTS} were waiting already"),
                ("mm_cache_l3_bytes_put_total", "counter", c.l3_bytes_put, "embedding bytes this encoder put into L3"),
            ]
        return [metrics.of(name.removesuffix("_total"), kind, help_, value) for name, kind, value, help_ in rows]

    def close(self) -> None:
        """Stop the puts waiting, close the L3 client (its segment leaves the pool)."""
        self._putter.shutdown(wait=True, cancel_futures=True)  # a put running ends first (Mooncake bounds it)
        if self.store is not None:
            self.store.close()
