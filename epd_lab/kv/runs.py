"""Block ids → the (src, dst, length) runs of one batch write: the seed's addressing and run merging.

``block_address = layer_base_addr + block_id * block_len`` for every region (each layer's K and V), and
blocks that are consecutive on BOTH sides merge into one run (`group_concurrent_contiguous`), so a request
whose block tables are contiguous moves as one write per region.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def group_concurrent_contiguous(src_ids: Sequence[int],
                                dst_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Split paired block ids into runs that are consecutive (+1) in both `src_ids` and `dst_ids`.

    The same groups as the seed's numpy version, as lists; for empty input it returns no groups, where the
    seed returns one empty group. Plain Python: block lists are short and numpy's call overhead dominates.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    src_groups: list[list[int]] = []
    dst_groups: list[list[int]] = []
    for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
        if i and s == src_ids[i - 1] + 1 and d == dst_ids[i - 1] + 1:
            src_groups[-1].append(s)
            dst_groups[-1].append(d)
        else:
            src_groups.append([s])
            dst_groups.append([d])
    return src_groups, dst_groups


class BlockCopies(NamedTuple):
    """The arguments of one `batch_transfer_sync_write`: a run per entry, region by region."""

    srcs: list[int]
    dsts: list[int]
    lengths: list[int]
    rkeys: list[int]  # the destination region's key per run (0: bounds check only)


def block_copies(src_base_addrs: Sequence[int], dst_base_addrs: Sequence[int], src_block_ids: Sequence[int],
                 dst_block_ids: Sequence[int], block_len: int,
                 dst_rkeys: Sequence[int] | None = None) -> BlockCopies:
    """The merged runs that copy `src_block_ids` to `dst_block_ids` in every region.

    `src_base_addrs` / `dst_base_addrs` are the regions of each side in the same order (`PagedKVCache.base_addrs`:
    ``[K0, V0, K1, V1, ...]``); `dst_rkeys`, if given, are the destination regions' keys in that order.
    """
    if len(src_base_addrs) != len(dst_base_addrs):
        raise ValueError(f"{len(src_base_addrs)} source regions but {len(dst_base_addrs)} destination regions")
    if dst_rkeys is not None and len(dst_rkeys) != len(dst_base_addrs):
        raise ValueError(f"{len(dst_rkeys)} rkeys for {len(dst_base_addrs)} destination regions")
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    src_first, dst_first, num_blocks = contiguous_runs(src_block_ids, dst_block_ids)
    regions = len(src_base_addrs)
    rkeys = np.zeros(regions, dtype=np.uint64) if dst_rkeys is None else np.asarray(dst_rkeys, dtype=np.uint64)
    return BlockCopies(  # region by region, the runs in order within each
        (np.asarray(src_base_addrs, dtype=np.uint64)[:, None] + src_first * block_len).ravel().tolist(),
        (np.asarray(dst_base_addrs, dtype=np.uint64)[:, None] + dst_first * block_len).ravel().tolist(),
        np.tile(num_blocks * block_len, regions).tolist(), np.repeat(rkeys, len(num_blocks)).tolist())


def contiguous_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`group_concurrent_contiguous` as arrays: each run's first source block, first destination block and
    length in blocks (uint64), in order; numpy, for the thousands of blocks of a long prompt."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if len(src) == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    starts = np.flatnonzero(np.r_[True, (np.diff(src) != 1) | (np.diff(dst) != 1)])
    lengths = np.diff(np.r_[starts, len(src)])
    return src[starts].astype(np.uint64), dst[starts].astype(np.uint64), lengths.astype(np.uint64)
