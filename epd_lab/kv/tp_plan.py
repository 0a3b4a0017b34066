"""KV between prefill and decode groups of different tensor-parallel sizes: which prefill rank's KV heads go to which
decode rank's blocks, checked before any byte moves; and where each rank's side channel listens.

    plan = plan_kv_transfer(num_kv_heads=2, src_tp=2, dst_tp=1)   # a value: print it, draw it, check it
    plan.check()                                                  # PlanError: a destination head left unwritten
    plan.between(src_rank, dst_rank)                              # the HeadSlices one prefill rank writes
    copies = head_copies(slices, src_geometry, dst_geometry, ...)  # their (src, dst, length) runs

Each rank's cache holds its KV heads (`kv_head_range`): a share of them, or, past the number of KV
heads, one head replicated on ``tp_size / num_kv_heads`` ranks. A destination rank needs every one of its heads
written exactly once, by a source rank that holds the same head; where several source ranks hold it (replicas),
destination rank d takes it from replica ``d % replicas`` so that the replicas share the work. vLLM's first
heterogeneous-TP planner for its Mooncake connector wrote only one replica's slice and left the rest of decode's
block unwritten while marking it ready; here such a plan is refused by `KVTransferPlan.check` with the head
that would be left unwritten.

Bytes: a cache block is ``[block_size, kv_heads, head_dim]``, so a head slice is a piece per token, the pieces
``kv_heads * head_dim`` elements apart: one strided entry per run of blocks contiguous on both sides
(`head_copies`, written by `TransferEngine.batch_transfer_sync_write_strided` in native code). A slice that spans
the whole row on both sides moves as whole blocks merged into runs (`runs.block_copies`), as between equal TP
sizes.

Ports (seed 003): a worker's side channel listens on ``base + dp_rank * tp_size + tp_rank``
(`side_channel_port`), the base from ``VLLM_MOONCAKE_SIDE_CHANNEL_PORT`` (6557 when unset).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from epd_lab.kv.runs import BlockCopies, block_copies, contiguous_runs

DEFAULT_SIDE_CHANNEL_PORT = 6557  # vLLM's VLLM_MOONCAKE_SIDE_CHANNEL_PORT default


class PlanError(ValueError):
    """A transfer plan that would leave destination bytes unwritten, write them twice, or move a head to a rank
    that does not hold it: refused before any write."""


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` rank `tp_rank` of `tp_size` holds: a share of them, or, past their number,
    one head replicated on ``tp_size / num_kv_heads`` consecutive ranks, as vLLM replicates them."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide {num_kv_heads} KV heads")
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {num_kv_heads} KV heads")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def side_channel_port(dp_rank: int, tp_size: int, tp_rank: int, base: int | None = None) -> int:
    """Seed 003's port of a worker's side channel: ``base + dp_rank * tp_size + tp_rank``; `base` defaults to
    ``VLLM_MOONCAKE_SIDE_CHANNEL_PORT`` (6557 when unset). Base 0 means every rank takes a port from the OS."""
    if base is None:
        base = int(os.environ.get("VLLM_MOONCAKE_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT))
    if not 0 <= tp_rank < tp_size or dp_rank < 0:
        raise ValueError(f"no rank {tp_rank} of tp {tp_size} at dp rank {dp_rank}")
    if base == 0:
        return 0
    port = base + dp_rank * tp_size + tp_rank
    if not 0 < port < 65536:
        raise ValueError(f"side channel port {port} (base {base}) lies outside 1..65535")
    return port


@dataclass(frozen=True)
class HeadSlice:
    """Source rank `src_rank`'s local heads ``[src_head, src_head + num_heads)`` go to destination rank
    `dst_rank`'s local heads ``[dst_head, dst_head + num_heads)`` (the same global heads on both sides)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class KVTransferPlan:
    """Every head slice between a source group of `src_tp` ranks and a destination group of `dst_tp` ranks of a
    model with `num_kv_heads` KV heads (`plan_kv_transfer` makes one; a hand-made one is checked the same)."""

    num_kv_heads: int
    src_tp: int
    dst_tp: int
    slices: tuple[HeadSlice, ...]

    def check(self) -> None:
        """Raise `PlanError` with the first reason unless every local head of every destination rank is written
        exactly once, from a source rank holding that global head, in slices of equal length on both sides."""
        for d in range(self.dst_tp):
            d0, d1 = kv_head_range(self.num_kv_heads, self.dst_tp, d)
            written = [0] * (d1 - d0)
            for s in self.slices:
                if s.dst_rank != d:
                    continue
                if not 0 <= s.src_rank < self.src_tp:
                    raise PlanError(f"slice {s}: no source rank {s.src_rank} in tp {self.src_tp}")
                s0, s1 = kv_head_range(self.num_kv_heads, self.src_tp, s.src_rank)
                if s.num_heads < 1 or s.src_head < 0 or s.src_head + s.num_heads > s1 - s0 \
                        or s.dst_head < 0 or s.dst_head + s.num_heads > d1 - d0:
                    raise PlanError(f"slice {s}: heads outside source rank {s.src_rank}'s {s1 - s0} or "
                                    f"destination rank {d}'s {d1 - d0}")
                if s0 + s.src_head != d0 + s.dst_head:
                    raise PlanError(f"slice {s}: source head {s0 + s.src_head} is not destination head "
                                    f"{d0 + s.dst_head}")
                for h in range(s.dst_head, s.dst_head + s.num_heads):
                    written[h] += 1
            for h, n in enumerate(written):
                if n != 1:
                    raise PlanError(f"destination rank {d}'s KV head {d0 + h} would be written {n} times "
                                    f"(every destination byte must be written exactly once)")
        for s in self.slices:
            if not 0 <= s.dst_rank < self.dst_tp:
                raise PlanError(f"slice {s}: no destination rank {s.dst_rank} in tp {self.dst_tp}")

    def between(self, src_rank: int, dst_rank: int) -> list[HeadSlice]:
        """The slices source rank `src_rank` writes into destination rank `dst_rank` (none: it writes nothing)."""
        return [s for s in self.slices if s.src_rank == src_rank and s.dst_rank == dst_rank]

    def sources_of(self, dst_rank: int) -> list[int]:
        """The source ranks destination rank `dst_rank` must hear ``TRANS_DONE`` from, in order."""
        return sorted({s.src_rank for s in self.slices if s.dst_rank == dst_rank})

    def rows(self) -> list[dict[str, int]]:
        """The plan as table rows (global heads too), for a notebook's DataFrame or drawing."""
        out = []
        for s in self.slices:
            s0, _ = kv_head_range(self.num_kv_heads, self.src_tp, s.src_rank)
            out.append({"src_rank": s.src_rank, "dst_rank": s.dst_rank, "first_head": s0 + s.src_head,
                        "num_heads": s.num_heads, "src_head": s.src_head, "dst_head": s.dst_head})
        return out


def plan_kv_transfer(num_kv_heads: int, src_tp: int, dst_tp: int) -> KVTransferPlan:
    """The checked plan between TP sizes `src_tp` and `dst_tp` (see the module docstring): each destination rank's
    heads from the source ranks holding them, replicas shared out, adjacent heads of one source merged."""
    slices: list[HeadSlice] = []
    for d in range(dst_tp):
        d0, d1 = kv_head_range(num_kv_heads, dst_tp, d)
        for head in range(d0, d1):
            holders = [r for r in range(src_tp) if kv_head_range(num_kv_heads, src_tp, r)[0] <= head
                       < kv_head_range(num_kv_heads, src_tp, r)[1]]
            src = holders[d % len(holders)]
            s0 = kv_head_range(num_kv_heads, src_tp, src)[0]
            last = slices[-1] if slices else None
            if last and last.dst_rank == d and last.src_rank == src and last.dst_head + last.num_heads == head - d0 \
                    and last.src_head + last.num_heads == head - s0:
                slices[-1] = HeadSlice(src, d, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                slices.append(HeadSlice(src, d, head - s0, head - d0, 1))
    plan = KVTransferPlan(num_kv_heads, src_tp, dst_tp, tuple(slices))
    plan.check()
    return plan


@dataclass(frozen=True)
class KVLayout:
    """A rank's place in its role's TP group and the model's KV heads: what the side channel exchanges so that
    both sides make the same plan."""

    num_kv_heads: int  # the model's
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)  # ValueError for a layout that cannot be
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} of tp_size {self.tp_size}")

    @property
    def local_heads(self) -> int:
        """KV heads this rank's cache holds."""
        start, stop = kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)
        return stop - start


@dataclass(frozen=True)
class CacheGeometry:
    """One rank's paged cache as a transfer sees it: region base addresses ``[K0, V0, ...]``, tokens per block,
    local KV heads, and bytes per head per token (``head_dim * element size``)."""

    base_addrs: Sequence[int]
    block_size: int
    kv_heads: int
    head_bytes: int

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region."""
        return self.block_size * self.kv_heads * self.head_bytes


class StridedCopies(NamedTuple):
    """The arguments of one `batch_transfer_sync_write_strided`, as uint64 arrays (the engine takes them without a
    Python object per value): entry i is `counts[i]` pieces of `lengths[i]` bytes, `src_strides[i]` /
    `dst_strides[i]` apart; `rkeys` the destination region's key per entry (0: bounds only). Whole blocks are
    entries of one piece."""

    srcs: np.ndarray
    dsts: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    src_strides: np.ndarray
    dst_strides: np.ndarray
    rkeys: np.ndarray

    @classmethod
    def concatenate(cls, parts: Sequence["StridedCopies"]) -> "StridedCopies":
        """The entries of `parts`, in order (none: an empty batch)."""
        if not parts:
            return cls(*(np.zeros(0, dtype=np.uint64) for _ in cls._fields))
        return cls(*(np.concatenate(field) for field in zip(*parts)))

    @classmethod
    def whole(cls, copies: BlockCopies) -> "StridedCopies":
        """`copies` (whole blocks or runs of them) as entries of one piece each."""
        n = len(copies.srcs)
        ones, zeros = np.ones(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
        return cls(*(np.asarray(f, dtype=np.uint64) for f in copies[:3]), ones, zeros, zeros,
                   np.asarray(copies.rkeys, dtype=np.uint64))

    def pieces(self) -> BlockCopies:
        """One (src, dst, length, key) per piece: for byte-level checks, and paths without strided writes."""
        counts = np.asarray(self.counts, dtype=np.int64)
        entry = np.repeat(np.arange(len(counts)), counts)
        k = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.uint64)

        def per_piece(base: np.ndarray, stride: np.ndarray) -> list[int]:
            return (base[entry] + k * stride[entry]).tolist()
        return BlockCopies(per_piece(self.srcs, self.src_strides), per_piece(self.dsts, self.dst_strides),
                           self.lengths[entry].tolist(), self.rkeys[entry].tolist())

    @property
    def nbytes(self) -> int:
        """Bytes the entries move."""
        return int((self.lengths * self.counts).sum())


def head_copies(slices: Sequence[HeadSlice], src: CacheGeometry, dst: CacheGeometry, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int], dst_rkeys: Sequence[int] | None = None) -> StridedCopies:
    """The strided entries that write `slices` (one source rank's to one destination rank) of the blocks
    `src_block_ids` into `dst_block_ids`, region by region: for each run of blocks contiguous on both sides
    (`group_concurrent_contiguous`), a slice is one entry of a piece a token. Slices spanning whole rows on both
    sides are whole blocks, one piece a run (`runs.block_copies`). Raises ValueError when the caches' regions,
    block sizes or head widths differ, or the block lists do not pair up."""
    if len(src.base_addrs) != len(dst.base_addrs) or src.block_size != dst.block_size \
            or src.head_bytes != dst.head_bytes:
        raise ValueError(f"caches do not match: {len(src.base_addrs)} / {len(dst.base_addrs)} regions, block size "
                         f"{src.block_size} / {dst.block_size}, {src.head_bytes} / {dst.head_bytes} bytes a head")
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
    if any(s.num_heads == src.kv_heads == dst.kv_heads for s in slices):  # whole rows: whole blocks
        runs = [np.asarray(field, dtype=np.uint64) for field in block_copies(
            src.base_addrs, dst.base_addrs, src_block_ids, dst_block_ids, src.block_len, dst_rkeys)]
        return StridedCopies(runs[0], runs[1], runs[2], np.ones_like(runs[2]), runs[2], runs[2], runs[3])
    src_first, dst_first, num_blocks = contiguous_runs(src_block_ids, dst_block_ids)
    src_row, dst_row = src.kv_heads * src.head_bytes, dst.kv_heads * dst.head_bytes  # a token's bytes
    regions = len(src.base_addrs)
    src_head = np.asarray([s.src_head for s in slices], dtype=np.uint64) * np.uint64(src.head_bytes)
    dst_head = np.asarray([s.dst_head for s in slices], dtype=np.uint64) * np.uint64(dst.head_bytes)
    widths = np.asarray([s.num_heads * src.head_bytes for s in slices], dtype=np.uint64)

    def grid(base: Sequence[int], first: np.ndarray, block_len: int, head: np.ndarray) -> np.ndarray:
        # [region, run, slice], flattened in that order
        return (np.asarray(base, dtype=np.uint64)[:, None, None] + (first * np.uint64(block_len))[None, :, None]
                + head[None, None, :]).ravel()

    shape = (regions, len(num_blocks), len(slices))

    def each(values: np.ndarray) -> np.ndarray:  # a [region, run, slice] value broadcast to every entry
        return np.ascontiguousarray(np.broadcast_to(values, shape).ravel(), dtype=np.uint64)

    rkeys = np.zeros(regions, dtype=np.uint64) if dst_rkeys is None else np.asarray(dst_rkeys, dtype=np.uint64)
    return StridedCopies(grid(src.base_addrs, src_first, src.block_len, src_head),
                         grid(dst.base_addrs, dst_first, dst.block_len, dst_head), each(widths[None, None, :]),
                         each((num_blocks * np.uint64(src.block_size))[None, :, None]), each(np.uint64(src_row)),
                         each(np.uint64(dst_row)), each(rkeys[:, None, None]))


def covered_exactly_once(dsts: Sequence[int], lengths: Sequence[int], dst: CacheGeometry,
                         dst_block_ids: Sequence[int]) -> bool:
    """Whether the runs (`dsts`, `lengths`), the union over every source rank's, cover each byte of the blocks
    `dst_block_ids` in every region of `dst` exactly once and nothing outside them (a byte-level check of a plan,
    for tests and notebooks; `KVTransferPlan.check` is the head-level one every transfer makes)."""
    starts = np.asarray(dsts, dtype=np.uint64)
    ends = starts + np.asarray(lengths, dtype=np.uint64)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    blocks = np.sort(np.asarray(dst_block_ids, dtype=np.uint64))
    want_starts = (np.asarray(dst.base_addrs, dtype=np.uint64)[:, None] + blocks * dst.block_len).reshape(-1)
    want_starts.sort()
    want_ends = want_starts + dst.block_len
    if len(starts) == 0 or np.any(starts[1:] < ends[:-1]):  # an overlap: some byte written twice
        return False
    # runs must tile each wanted block exactly: merge touching runs, then compare with the merged wanted extents
    return _merged(starts, ends) == _merged(want_starts, want_ends)


def _merged(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Sorted, non-overlapping extents merged where one ends where the next starts."""
    breaks = np.nonzero(starts[1:] != ends[:-1])[0] + 1
    return list(zip(starts[np.r_[0, breaks]].tolist(), ends[np.r_[breaks - 1, len(ends) - 1]].tolist()))
