"""A prefill TP group and decode TP groups exchanging one prompt's KV over the side channel, each rank a process:
the P→D mechanism between TP sizes, run end to end (notebooks step through it, tests check it block by block).

    result = run_pd(PDCase(prompt="describe", image_sizes=[(224, 224)]), src_tp=2, dst_tps=[1, 4])
    result.decode[1][0]["kv_equal"]    # decode tp 1, rank 0: its blocks equal the head-regrouped prefill KV
    result.decode[1][0]["tokens"]      # its answer, decoded by the TP 1 group

Every prefill rank runs the fast runtime's TP prefill (`runtime.tp`) into its own registered cache, serves its own
side channel (`KVProducer` with its `KVLayout`) and holds the blocks for each decode group's request; every
decode rank asks all prefill ranks at once (`KVConsumer.receive_kv_group`), each of which writes the head slices
the plan gives it into the decode rank's blocks. The decode rank then compares the bytes that landed with the
prefill ranks' KV regrouped by global head (written for the purpose, independently of the plan: prefill's
blocks are saved to the meeting folder), and decodes from them with its group: greedy, then seeded sampling.
Ranks meet through files in a fresh folder (side-channel URLs, the saved KV, "done" marks), not fixed ports.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from epd_lab.kv.block_manager import BlockManager, blocks_needed
from epd_lab.kv.connector import KVConsumer, KVProducer
from epd_lab.kv.messages import KVAux
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.kv.tp_plan import KVLayout, kv_head_range, side_channel_port
from epd_lab.models.runtime.tp import TPGroup, run_ranks


@dataclass(frozen=True)
class PDCase:
    """One prompt and how to run it (picklable: it travels to every rank)."""

    prompt: str = "compare these"
    image_sizes: tuple[tuple[int, int], ...] = ((224, 224), (100, 333))
    dtype: str = "float32"
    max_new_tokens: int = 8
    temperature: float = 0.8  # the seeded draw's
    seed: int = 7
    block_size: int = 16
    num_blocks: int = 64
    protocol: str = "shm"  # the transfer engine's: shm or tcp
    timeout_s: float = 60.0  # each wait of a rank on another group
    side_channel_base: int = 0  # prefill ranks listen on base + dp_rank * tp_size + tp_rank; 0: ports from the OS


@dataclass
class PDResult:
    """Per prefill DP replica, per rank, its summary (`prefill_rank`); per decode TP size, per rank, its summary
    (`decode_rank`)."""

    prefill: dict[int, list[dict[str, Any]]]
    decode: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def _load(case: PDCase) -> tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The model (seeded random weights: the same on every rank) and the prompt's ids, pixels and grids."""
    from epd_lab.models import build_input_ids, load_model, preprocess
    from epd_lab.noise import noise_images

    model = load_model(dtype=getattr(torch, case.dtype))
    images = noise_images(list(case.image_sizes), len(case.prompt))
    pixel_values, grid = preprocess(images) if images else (None, None)
    return model, build_input_ids(case.prompt, grid.tolist() if images else []), pixel_values, grid


def _wait_for(paths: list[Path], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not appear within {timeout_s:.0f} s")
        time.sleep(0.02)


def _publish(path: Path, text: str) -> None:
    """Write `text` to `path` at once: a rank polling for the file never reads it half written."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


def _blocks(cache: PagedKVCache, table: list[int]) -> list[torch.Tensor]:
    """Copies of `table`'s blocks in every region, ``[K0, V0, ...]``, each [blocks, block_size, heads, head_dim]."""
    index = torch.tensor(table)
    return [cache.layer(i)[j][index].clone() for i in range(cache.num_layers) for j in (0, 1)]


def prefill_rank(tp: TPGroup, case: PDCase, meeting: str, request_ids: list[str], dp_rank: int = 0,
                 ) -> dict[str, Any]:
    """Rank `tp.rank` of DP replica `dp_rank` of the prefill role: prefill the prompt once per request id into its
    own blocks, save the first one's KV blocks, serve the side channel (on seed 003's port when
    `case.side_channel_base` is set) until every request was asked for, and report its block pool (every block
    back), its producer's counters and its process's listening TCP ports."""
    from epd_lab.models.runtime import open_runtime
    from epd_lab.models.sampling import sample
    from epd_lab.transfer import TransferEngine

    folder, name = Path(meeting), f"prefill-{dp_rank}-{tp.rank}"
    model, ids, pixel_values, grid = _load(case)
    n_blocks = blocks_needed(ids.shape[-1], case.block_size)
    port = side_channel_port(dp_rank, tp.size, tp.rank, case.side_channel_base)
    pool = BlockManager(case.num_blocks)
    layout = KVLayout(model.config.text_config.num_key_value_heads, tp.size, tp.rank)
    with TransferEngine(protocol=case.protocol) as engine, \
            PagedKVCache.from_config(model.config, num_blocks=case.num_blocks, block_size=case.block_size,
                                     dtype=model.dtype, engine=engine, tp_size=tp.size) as cache, \
            KVProducer(engine, cache, free_blocks=pool.free, layout=layout, timeout=case.timeout_s,
                       port=port) as producer:
        runtime = open_runtime("fast", model, cache, tp=tp)
        embeds = None if pixel_values is None else runtime.encode(pixel_values, grid)
        for i, rid in enumerate(request_ids):
            table = pool.allocate(n_blocks)
            out = runtime.prefill(ids, embeds, grid, table)
            first = int(sample(out.logits.reshape(1, -1), [0.0], [case.seed], [0]))
            if i == 0:
                torch.save({"blocks": _blocks(cache, table), "first_token": first, "rope_delta": out.rope_delta},
                           folder / f"{name}.pt")
            producer.request_finished(rid, table, KVAux(first, out.rope_delta))
        _publish(folder / f"{name}.url", producer.url)
        _wait_for([folder / f"done-{rid}" for rid in request_ids], case.timeout_s, "the decode groups' asks")
        deadline = time.monotonic() + case.timeout_s  # the producer frees after its reply has gone
        while pool.num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        listening = sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN})
        return {"rank": tp.rank, "dp_rank": dp_rank, "kv_heads": kv_head_range(layout.num_kv_heads, tp.size, tp.rank),
                "url": producer.url, "listening_ports": listening, "blocks_in_use": pool.num_used_blocks,
                **producer.stats()}


def regrouped(prefill_blocks: list[list[torch.Tensor]], num_kv_heads: int, dst_tp: int,
              dst_rank: int) -> tuple[list[torch.Tensor], bool]:
    """The prefill ranks' KV blocks (rank by rank, region by region) regrouped into decode rank `dst_rank`'s
    heads by global head index, and whether every replica of each head holds the same bits."""
    src_tp = len(prefill_blocks)
    d0, d1 = kv_head_range(num_kv_heads, dst_tp, dst_rank)
    out, replicas_equal = [], True
    for region in range(len(prefill_blocks[0])):
        heads = []
        for g in range(d0, d1):
            copies = []
            for r in range(src_tp):
                s0, s1 = kv_head_range(num_kv_heads, src_tp, r)
                if s0 <= g < s1:
                    copies.append(prefill_blocks[r][region][:, :, g - s0])
            replicas_equal &= all(torch.equal(copies[0], c) for c in copies[1:])
            heads.append(copies[0])
        out.append(torch.stack(heads, dim=2))
    return out, replicas_equal


def decode_rank(tp: TPGroup, case: PDCase, meeting: str, src_tp: int, request_id: str, src_dp: int = 0,
                ) -> dict[str, Any]:
    """Rank `tp.rank` of a decode group: receive `request_id`'s KV from every rank of prefill replica `src_dp`,
    compare the landed
    blocks with the prefill KV regrouped (`regrouped`), then decode greedy and seeded from them, and from a second
    copy of the blocks filled locally with the regrouped KV (the in-process reference). Reports the comparison,
    the answers and its block pool."""
    from epd_lab.models.runtime import continue_tokens, open_runtime
    from epd_lab.transfer import TransferEngine

    folder = Path(meeting)
    model, ids, _, _ = _load(case)
    prompt_len = ids.shape[-1]
    num_kv_heads = model.config.text_config.num_key_value_heads
    pool = BlockManager(case.num_blocks)
    n_blocks = blocks_needed(prompt_len + case.max_new_tokens - 1, case.block_size)
    names = [folder / f"prefill-{src_dp}-{r}" for r in range(src_tp)]
    _wait_for([n.with_suffix(".url") for n in names], case.timeout_s, "the prefill group")
    urls = [n.with_suffix(".url").read_text() for n in names]
    saved = [torch.load(n.with_suffix(".pt")) for n in names]
    with TransferEngine(protocol=case.protocol) as engine, \
            PagedKVCache.from_config(model.config, num_blocks=case.num_blocks, block_size=case.block_size,
                                     dtype=model.dtype, engine=engine, tp_size=tp.size) as cache, \
            KVConsumer(engine, cache, layout=KVLayout(num_kv_heads, tp.size, tp.rank),
                       timeout=case.timeout_s) as consumer:
        table = pool.allocate(n_blocks)
        prompt_blocks = table[:blocks_needed(prompt_len, case.block_size)]
        done = consumer.receive_kv_group(urls, request_id, prompt_blocks)
        if tp.rank == 0:
            (folder / f"done-{request_id}").touch()
        landed = _blocks(cache, prompt_blocks)
        expected, replicas_equal = regrouped([s["blocks"] for s in saved], num_kv_heads, tp.size, tp.rank)
        kv_equal = [torch.equal(a, b) for a, b in zip(landed, expected)]
        # the reference: the same KV put in place by a local copy
        reference = pool.allocate(n_blocks)
        index = torch.tensor(reference[:len(prompt_blocks)])
        for region, blocks in enumerate(expected):
            cache.layer(region // 2)[region % 2][index] = blocks
        runtime = open_runtime("fast", model, cache, tp=tp)
        aux = done.aux[0]
        answers = {}
        for name, blocks in (("received", table), ("reference", reference)):
            for mode, temperature in (("greedy", 0.0), ("seeded", case.temperature)):
                answers[name, mode] = continue_tokens(runtime, aux.first_token, prompt_len + aux.rope_delta,
                                                      prompt_len, blocks, case.max_new_tokens, temperature,
                                                      case.seed)
        pool.free(table)
        pool.free(reference)
        return {"rank": tp.rank, "kv_equal": all(kv_equal), "regions_equal": kv_equal,
                "replicas_equal": replicas_equal, "kv_bytes": sum(t.numel() * t.element_size() for t in landed),
                "tokens": answers["received", "greedy"], "seeded_tokens": answers["received", "seeded"],
                "reference_tokens": answers["reference", "greedy"],
                "reference_seeded_tokens": answers["reference", "seeded"],
                "first_token": aux.first_token, "blocks_in_use": pool.num_used_blocks}


def monolithic_rank(tp: TPGroup, case: PDCase) -> dict[str, list[int]]:
    """The monolithic use at this group's TP size: encode, prefill and decode in one group, greedy and seeded
    (token 0 drawn with the seed too, where `prefill_rank` draws it greedily)."""
    from epd_lab.models.runtime import generate, open_runtime

    model, ids, pixel_values, grid = _load(case)
    table = list(range(blocks_needed(ids.shape[-1] + case.max_new_tokens - 1, case.block_size)))
    with PagedKVCache.from_config(model.config, num_blocks=len(table), block_size=case.block_size, dtype=model.dtype,
                                  tp_size=tp.size) as cache:
        runtime = open_runtime("fast", model, cache, tp=tp)
        return {"tokens": generate(runtime, ids, pixel_values, grid, case.max_new_tokens, table),
                "seeded_tokens": generate(runtime, ids, pixel_values, grid, case.max_new_tokens, table,
                                          case.temperature, case.seed)}


def run_pd(case: PDCase, src_tp: int, dst_tps: list[int], dp_size: int = 1) -> PDResult:
    """`dp_size` prefill replicas of `src_tp` ranks and one decode group per size in `dst_tps` (decode group i
    asks replica i % dp_size), all at once, each rank a process, over a fresh meeting folder that is removed
    afterwards; see the module docstring."""
    folder = Path(tempfile.mkdtemp(prefix="epd-tp-pd-"))
    rids = [f"tp-pd-{src_tp}-{d}-{i}" for i, d in enumerate(dst_tps)]
    try:
        with ThreadPoolExecutor(max_workers=dp_size + len(dst_tps)) as pool:
            prefills = {dp: pool.submit(run_ranks, prefill_rank, src_tp, case, str(folder), rids[dp::dp_size], dp,
                                        timeout_s=3 * case.timeout_s) for dp in range(dp_size)}
            decodes = {d: pool.submit(run_ranks, decode_rank, d, case, str(folder), src_tp, rid, i % dp_size,
                                      timeout_s=3 * case.timeout_s) for i, (d, rid) in enumerate(zip(dst_tps, rids))}
            decode = {d: f.result() for d, f in decodes.items()}  # a decode group's failure first: the cause
            return PDResult({dp: f.result() for dp, f in prefills.items()}, decode)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
