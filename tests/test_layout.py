"""The layout drawings (`epd_lab.viz.layout`) draw what the protocols did.

E→P: two real encode servers write one request's parts into the buffer a real receiver registered; the
bars of `buffer_layout` sit at the byte ranges the receiver handed out (`buffer_address = base + offset`),
whose sizes are the bytes each encoder reports having written. P→D: the runs drawn for fragmented block
tables are `group_concurrent_contiguous`'s, and the addresses of the batch write (`block_copies`) over a
real paged cache.
"""
from __future__ import annotations

import numpy as np
import pytest

from epd_lab.ep.receiver import PartPlan, ReceivedEmbeddings
from epd_lab.kv import BlockManager, PagedKVCache, block_copies, group_concurrent_contiguous
from epd_lab.launch import Cluster, Topology
from epd_lab.models import tiny_config
from epd_lab.noise import noise_images
from epd_lab.viz.layout import block_runs, block_runs_frame, block_tables, buffer_layout, part_ranges
from helpers import wait_for


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    paths = []
    sides = (448, 224, 224)  # part 0 (two images on one encoder) is the largest
    for i, image in enumerate(noise_images([(side, side) for side in sides], 0)):
        path = tmp_path_factory.mktemp("img") / f"img{i}.png"
        image.save(path)
        paths.append(str(path))
    return paths


def test_buffer_layout_draws_the_receivers_byte_ranges(images):
    with Cluster(Topology(encoders=2, backend="mooncake")) as cluster, cluster.receiver(seed=1) as rx:
        got = rx.receive(images, "layout")
        # the receiver returns on the parts' notifies; a /send's answer, and its span, may come just after
        wait_for(lambda: sum(s.stage == "http_send" for s in rx.recorder.spans("layout")) == 2,
                 what="both /send answers recorded")
        spans = rx.recorder.spans("layout")
    frame = part_ranges(got)
    assert list(frame["part_idx"]) == [0, 1] and [len(i) for i in frame["items"]] == [2, 1]
    assert list(frame["encoder"]) == [p.encoder for p in got.parts]
    assert list(zip(frame["offset"], frame["nbytes"])) == got.part_ranges
    # the parts tile the registered buffer in part order, and it holds exactly the request's embeddings
    assert got.part_ranges[0][0] == 0 and got.part_ranges[1][0] == got.part_ranges[0][1]
    assert sum(n for _, n in got.part_ranges) == got.nbytes == got.embeddings["image"].numel() * 4
    # each range is as long as what its encoder wrote (its transfer span) and what the receiver asked in /send
    written = {s.part: s.nbytes for s in spans if s.stage == "transfer"}
    asked = {s.part: s.nbytes for s in spans if s.stage == "http_send"}
    assert written == asked == dict(zip(frame["part_idx"], frame["nbytes"]))

    fig = buffer_layout(got)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["part 0", "part 1"]
    for bar, row in zip(bars, frame.itertuples(), strict=True):
        assert (list(bar.base), list(bar.x), list(bar.y)) == ([row.offset], [row.nbytes], [f"encoder {row.encoder}"])
    assert fig.layout.shapes[0].x0 == got.nbytes  # the end of the registration


def test_buffer_layout_needs_a_registered_buffer():
    # what a zmq_to_* backend returns: parts, but no buffer they were written into
    zmq_result = ReceivedEmbeddings("r", {}, {}, 0, [PartPlan(0, 0, "image", ["a.png"])])
    with pytest.raises(ValueError, match="only the mooncake backend"):
        part_ranges(zmq_result)


def fragmented_tables(n: int) -> tuple[list[int], list[int]]:
    """Prefill's and decode's block tables for an `n`-block request after some churn on both pools."""
    src_pool, dst_pool = BlockManager(32, shuffle_seed=4), BlockManager(32)
    dst_pool.free(dst_pool.allocate(5)[1:4])  # decode's free list is now 5.., then 1, 2, 3
    return src_pool.allocate(n), dst_pool.allocate(n)


@pytest.mark.parametrize("n", [1, 7, 30])
def test_runs_drawn_are_group_concurrent_contiguous(n):
    src, dst = fragmented_tables(n)
    src_groups, dst_groups = group_concurrent_contiguous(src, dst)
    runs = block_runs_frame(src, dst)
    assert list(runs["src_block_ids"]) == src_groups and list(runs["dst_block_ids"]) == dst_groups
    assert list(runs["first_block"]) == list(np.cumsum([0] + [len(g) for g in src_groups])[:-1])

    fig = block_runs(src, dst, 32, 32)
    bars = [t for t in fig.data if t.type == "bar" and t.name != "pool"]
    assert len(bars) == len(src_groups)
    for bar, s, d in zip(bars, src_groups, dst_groups, strict=True):
        assert list(bar.y) == ["prefill", "decode"] and list(bar.base) == [s[0], d[0]]
        assert list(bar.x) == [len(s), len(d)]

    tables = block_tables(src, dst)
    ids = next(t for t in tables.data if t.name == "block ids")
    assert list(ids.text) == [str(b) for b in src + dst]
    run_bars = [t for t in tables.data if t.type == "bar"]
    assert [(t.base[0], t.x[0]) for t in run_bars] == list(zip(runs["first_block"], runs["num_blocks"]))


def test_runs_drawn_are_the_batch_writes():
    """Each drawn run is one write per K/V region of the batch the producer issues (`block_copies`) over
    real paged caches: same first blocks, same lengths."""
    src, dst = fragmented_tables(12)
    runs = block_runs_frame(src, dst)
    with (PagedKVCache.from_config(tiny_config(), num_blocks=32) as p_cache,
          PagedKVCache.from_config(tiny_config(), num_blocks=32) as d_cache):
        copies = block_copies(p_cache.base_addrs, d_cache.base_addrs, src, dst, p_cache.block_len)
        block_len, regions = p_cache.block_len, len(p_cache.base_addrs)
        assert len(copies.srcs) == regions * len(runs)
        for i, (s, d, length) in enumerate(zip(copies.srcs, copies.dsts, copies.lengths)):
            region, run = divmod(i, len(runs))
            assert (s - p_cache.base_addrs[region]) // block_len == runs["src_block_ids"][run][0]
            assert (d - d_cache.base_addrs[region]) // block_len == runs["dst_block_ids"][run][0]
            assert length == runs["num_blocks"][run] * block_len
