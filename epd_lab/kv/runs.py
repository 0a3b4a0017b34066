"""Block ids → the (src, dst, length) runs of one batch write: the seed's addressing and run merging.

``block_address = layer_base_addr + block_id * block_len`` for every region (each layer's K and V), and
blocks that are consecutive on BOTH sides merge into one run (`group_concurrent_contiguous`), so a request
whose block tables are contiguous moves as one write per region.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


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
    src_groups, dst_groups = group_concurrent_contiguous(src_block_ids, dst_block_ids)
    out = BlockCopies([], [], [], [])
    for region, (src_base, dst_base) in enumerate(zip(src_base_addrs, dst_base_addrs)):
        rkey = 0 if dst_rkeys is None else dst_rkeys[region]
        for src_run, dst_run in zip(src_groups, dst_groups):
            out.srcs.append(src_base + src_run[0] * block_len)
            out.dsts.append(dst_base + dst_run[0] * block_len)
            out.lengths.append(len(src_run) * block_len)
            out.rkeys.append(rkey)
    return out
