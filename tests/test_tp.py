"""Tensor parallelism: the fast runtime sharded over gloo ranks, the head-slice plan between prefill and decode
groups of different TP sizes, and the KV moved between them, bit for bit.

Every group here is real: one spawned process a rank, torch.distributed over gloo on loopback, transfer engines
and side channels as the roles use them (tiny model, one torch thread a rank). The bound against TP 1: the TP
forward differs from TP 1 only in the order of the sums that the all-reduces split (each rank sums its heads' or
its MLP share's products, then the ranks' partial sums are added), so float32 logits differ by float32 rounding
of a few hundred products: `TP_ATOL` (1e-4, the bound the batched decode is held to) with margin over the 1e-5
seen; greedy tokens of the tiny model agree.
"""
from __future__ import annotations

import os
import socket
import time

import psutil
import pytest
import torch

from epd_lab.kv import BlockManager, PagedKVCache
from epd_lab.kv.connector import KVConsumer, KVProducer, KVTransferError
from epd_lab.servers.tp_groups import PDCase, monolithic_rank, run_pd
from epd_lab.kv.tp_plan import (CacheGeometry, HeadSlice, KVLayout, KVTransferPlan, PlanError, covered_exactly_once,
                                head_copies, kv_head_range, plan_kv_transfer, side_channel_port)
from epd_lab.models import build_input_ids, load_model, preprocess
from epd_lab.models.runtime import continue_tokens, generate, open_runtime
from epd_lab.models.sampling import sample
from epd_lab.models.runtime.tp import TPGroup, check_model, run_ranks
from epd_lab.noise import noise_images
from epd_lab.transfer import TransferEngine

pytestmark = pytest.mark.timeout(600)

TP_ATOL = 1e-4
SIZES = (1, 2, 4)


# ---- the plan ----
@pytest.mark.parametrize("num_kv_heads", [2, 4])
@pytest.mark.parametrize("src_tp", SIZES)
@pytest.mark.parametrize("dst_tp", SIZES)
def test_the_plan_covers_every_destination_byte_exactly_once(num_kv_heads, src_tp, dst_tp):
    """Across every (P tp, D tp), replication included (tp 4 over 2 KV heads): the runs of all source ranks,
    together, tile each destination rank's blocks in every region exactly once, each from the same global head."""
    plan = plan_kv_transfer(num_kv_heads, src_tp, dst_tp)
    head_bytes, src_ids, dst_ids = 8, [3, 4, 5, 9], [7, 8, 2, 1]
    for d in range(dst_tp):
        dst = CacheGeometry([(d + 1) << 40 | r << 30 for r in range(4)], 16,
                            KVLayout(num_kv_heads, dst_tp, d).local_heads, head_bytes)
        dsts, lengths = [], []
        for r in range(src_tp):
            src = CacheGeometry([(r + 1) << 50 | g << 30 for g in range(4)], 16,
                                KVLayout(num_kv_heads, src_tp, r).local_heads, head_bytes)
            pieces = head_copies(plan.between(r, d), src, dst, src_ids, dst_ids).pieces()
            dsts += pieces.dsts
            lengths += pieces.lengths
        assert covered_exactly_once(dsts, lengths, dst, dst_ids)
        assert not covered_exactly_once(dsts[1:], lengths[1:], dst, dst_ids)  # one run short: refused
    for s in plan.slices:  # every slice moves a head from a rank that holds it
        assert kv_head_range(num_kv_heads, src_tp, s.src_rank)[0] + s.src_head == \
            kv_head_range(num_kv_heads, dst_tp, s.dst_rank)[0] + s.dst_head


def test_a_plan_that_leaves_bytes_unwritten_is_refused_with_the_head():
    """The replicated-head plan that writes one replica's slice only (decode tp 1 from prefill tp 4 over 2 KV
    heads: head 1 never sent), a head written twice, and a head sent to a rank that holds another are refused."""
    one_replica = KVTransferPlan(2, 4, 1, (HeadSlice(0, 0, 0, 0, 1),))
    with pytest.raises(PlanError, match="KV head 1 would be written 0 times"):
        one_replica.check()
    twice = KVTransferPlan(2, 4, 1, (HeadSlice(0, 0, 0, 0, 1), HeadSlice(1, 0, 0, 0, 1), HeadSlice(2, 0, 0, 1, 1)))
    with pytest.raises(PlanError, match="KV head 0 would be written 2 times"):
        twice.check()
    crossed = KVTransferPlan(2, 2, 1, (HeadSlice(1, 0, 0, 0, 1), HeadSlice(0, 0, 0, 1, 1)))
    with pytest.raises(PlanError, match="source head 1 is not destination head 0"):
        crossed.check()
    assert plan_kv_transfer(2, 4, 1).sources_of(0) == [0, 2]  # a replica of each head, not every rank


def test_tp_sizes_that_do_not_split_the_heads_are_refused_at_start():
    model = load_model()
    with pytest.raises(ValueError, match="tp_size 3 does not split the language model's 4 attention heads"):
        check_model(model.config, 3)
    with pytest.raises(ValueError, match=r"choose one of \[1, 2, 4\]"):
        open_runtime("fast", model, PagedKVCache.from_config(model.config, num_blocks=4), tp=_FakeRank(3))
    with pytest.raises(ValueError, match="needs --runtime fast"):
        open_runtime("hf", model, None, tp=_FakeRank(2))


def _FakeRank(size: int) -> TPGroup:
    """A rank of a group of `size` (its process group never used: the runtime refuses before any collective)."""
    return TPGroup(0, size, group=object())


def test_the_seed_port_formula():
    assert [side_channel_port(dp, 2, tp, base=6557) for dp in (0, 1) for tp in (0, 1)] == [6557, 6558, 6559, 6560]
    assert side_channel_port(3, 8, 5, base=6557) == 6557 + 3 * 8 + 5
    assert side_channel_port(1, 2, 1, base=0) == 0  # ports from the OS
    with pytest.raises(ValueError, match="no rank 2 of tp 2"):
        side_channel_port(0, 2, 2, base=6557)


def test_decode_with_another_head_layout_is_refused_at_the_handshake():
    """A decode rank whose model has 4 KV heads asks a prefill of 2: TRANS_ERROR naming the layouts; prefill's
    blocks go back to its pool."""
    with (TransferEngine(timeout=2.0) as p_engine, TransferEngine(timeout=2.0) as d_engine,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=p_engine) as p_cache,
          PagedKVCache(2, 2, 64, num_blocks=8, engine=d_engine) as d_cache):
        blocks = BlockManager(8)
        with KVProducer(p_engine, p_cache, free_blocks=blocks.free, timeout=1.0) as producer, \
                KVConsumer(d_engine, d_cache, layout=KVLayout(4, 2, 0), timeout=1.0) as consumer:
            producer.request_finished("r", blocks.allocate(2))
            with pytest.raises(KVTransferError, match="different models or head layouts"):
                consumer.receive_kv(producer.url, "r", [4, 5])
            deadline = time.monotonic() + 3
            while blocks.num_free_blocks != 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert blocks.num_free_blocks == 8
        with pytest.raises(ValueError, match="holds 1 of 2 KV heads, but its cache has 2"):
            KVConsumer(d_engine, d_cache, layout=KVLayout(2, 2, 1))


# ---- the sharded runtime ----
CASE = ("compare these", [(224, 224), (100, 333)])


def _inputs():
    images = noise_images(CASE[1], len(CASE[0]))
    pixel_values, grid = preprocess(images)
    return build_input_ids(CASE[0], grid.tolist()), pixel_values, grid


def _sharded(tp: TPGroup, dtype: str) -> dict:
    """On each rank: the monolithic use, the split (images encoded one by one, KV moved into other blocks of
    another cache, decode there), and the prefill logits."""
    torch.set_num_threads(1)
    model = load_model(dtype=getattr(torch, dtype))
    ids, pixel_values, grid = _inputs()
    with PagedKVCache.from_config(model.config, num_blocks=64, dtype=model.dtype, tp_size=tp.size) as cache, \
            PagedKVCache.from_config(model.config, num_blocks=64, dtype=model.dtype, tp_size=tp.size) as other:
        rt = open_runtime("fast", model, cache, tp=tp)
        mono = generate(rt, ids, pixel_values, grid, 10, list(range(10)))
        mono_seeded = generate(rt, ids, pixel_values, grid, 10, list(range(10)), 0.8, 7)
        patches = int(grid[0].prod())
        parts = torch.cat([rt.encode(pixel_values[:patches], grid[:1]), rt.encode(pixel_values[patches:], grid[1:])])
        out = rt.prefill(ids, parts, grid, list(range(20, 30)))
        table = [5, 60, 7, 33, 2, 40, 11, 13, 50, 51]
        for i in range(cache.num_layers):  # the KV into another cache's blocks, as decode receives it
            for region, dst in zip(cache.layer(i), other.layer(i)):
                dst[torch.tensor(table)] = region[20:30]
        decode_rt = open_runtime("fast", model, other, tp=tp)
        split = {}
        for name, temperature, seed in (("greedy", 0.0, 0), ("seeded", 0.8, 7)):  # token 0 drawn as prefill does
            first = int(sample(out.logits.reshape(1, -1), [temperature], [seed], [0]))
            split[name] = continue_tokens(decode_rt, first, out.next_position, out.prompt_len, table, 10,
                                          temperature, seed)
        return {"mono": mono, "mono_seeded": mono_seeded, "split": split, "logits": out.logits,
                "embeds": parts, "kv_heads": cache.num_kv_heads}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_ranks_agree_the_split_equals_monolithic_and_tp_n_is_within_the_bound(dtype):
    runs = {n: run_ranks(_sharded, n, dtype) for n in SIZES}
    for n, ranks in runs.items():
        first = ranks[0]
        assert [r["kv_heads"] for r in ranks] == [max(1, 2 // n)] * n
        for r in ranks:  # every rank ends with the same bits: the same tokens without a broadcast
            assert torch.equal(r["logits"], first["logits"]) and torch.equal(r["embeds"], first["embeds"])
            assert r["mono"] == first["mono"] and r["mono_seeded"] == first["mono_seeded"]
        # the split equals the monolithic use at the same TP, bit for bit
        assert first["split"] == {"greedy": first["mono"], "seeded": first["mono_seeded"]}
    if dtype == "float32":  # the stated bound against TP 1 (see the module docstring)
        for n in SIZES[1:]:
            assert torch.allclose(runs[n][0]["logits"], runs[1][0]["logits"], rtol=0, atol=TP_ATOL)
            assert torch.allclose(runs[n][0]["embeds"], runs[1][0]["embeds"], rtol=0, atol=TP_ATOL)
            assert runs[n][0]["mono"] == runs[1][0]["mono"]


def test_run_ranks_reports_a_dead_rank_and_leaves_no_process():
    """A rank that dies while the other waits in an all-reduce: the group fails within its bound, naming the
    rank, and no rank process is left."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"TP rank 1 of 2 died \(exit code 3\)"):
        run_ranks(_die_on_rank_1, 2, timeout_s=60)
    assert time.monotonic() - start < 60
    assert not _rank_processes()


def _rank_processes() -> list[psutil.Process]:
    """This test process's rank processes still alive (multiprocessing's resource tracker is not one)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and p.is_running()]


def _die_on_rank_1(tp: TPGroup) -> None:
    if tp.rank == 1:
        os._exit(3)
    tp.all_reduce(torch.ones(4))


# ---- P and D groups over the side channel ----
@pytest.mark.parametrize("src_tp", SIZES)
def test_kv_regrouped_between_every_pair_of_tp_sizes_bit_for_bit(src_tp):
    """A prefill group of `src_tp` ranks, decode groups of 1, 2 and 4 ranks, each rank a process: the blocks each
    decode rank received equal the prefill ranks' KV regrouped by head, block by block; decoding from them equals
    decoding from the same KV put in place locally (greedy and seeded); where the sizes are equal the answers
    equal the monolithic use at that TP; every block is back in its pool."""
    case = PDCase(max_new_tokens=6)
    result = run_pd(case, src_tp, list(SIZES))
    mono = run_ranks(monolithic_rank, src_tp, case)[0]
    for dst_tp, ranks in result.decode.items():
        assert len(ranks) == dst_tp
        for r in ranks:
            assert r["kv_equal"] and all(r["regions_equal"]) and r["replicas_equal"], (src_tp, dst_tp, r["rank"])
            assert r["tokens"] == r["reference_tokens"] and r["seeded_tokens"] == r["reference_seeded_tokens"]
            assert r["tokens"] == ranks[0]["tokens"] and r["blocks_in_use"] == 0
        if dst_tp == src_tp:  # greedy: prefill here draws token 0 greedily for every request
            assert ranks[0]["tokens"] == mono["tokens"]
    prefill = result.prefill[0]
    assert all(p["blocks_in_use"] == 0 and p["transfers_failed"] == 0 for p in prefill)
    assert sum(p["transfers_done"] for p in prefill) == src_tp * sum(SIZES)  # every decode rank asked every rank


def test_kv_over_tcp_and_the_seed_ports_of_a_tp2_dp2_prefill():
    """Prefill tp 2 x dp 2 on seed 003's ports (base + dp_rank * tp_size + tp_rank): each rank's process listens
    on its port; decode groups of 1 and 4 ranks get their KV over tcp, bit for bit."""
    base = _free_port_run(4)
    case = PDCase(max_new_tokens=4, protocol="tcp", side_channel_base=base)
    result = run_pd(case, 2, [1, 4], dp_size=2)
    for dp, ranks in result.prefill.items():
        for r in ranks:
            port = base + dp * 2 + r["rank"]
            assert r["url"].endswith(f":{port}") and port in r["listening_ports"]
            assert r["blocks_in_use"] == 0
    assert all(r["kv_equal"] and r["tokens"] == r["reference_tokens"] for ranks in result.decode.values()
               for r in ranks)


def _free_port_run(n: int) -> int:
    """A base port whose `n` consecutive ports are free now, on loopback (the formula needs a run)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports found")


def test_bench_tp_kv_moves_every_byte_on_both_paths(tmp_path):
    """`epd-lab bench tp-kv` end to end at a small size: every move of every round left decode's cache as expected."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tp-kv.json"
    subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "tp-kv", "--tokens", "64", "--rounds", "1",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["kv_bytes"] == 56 * 64 * 2 * 256 and result["src_tp"] == 2
    for protocol in ("shm", "tcp"):
        moves = result["protocols"][protocol]
        assert moves["bytes_equal"] == {"plain": True, "plain_strided": True, "regrouped": True}
        assert moves["runs"]["regrouped"] == 2 * 56 * 4  # a strided entry per region and block per rank
