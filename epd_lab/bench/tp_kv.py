"""`epd-lab bench tp-kv`: one prompt's KV moved prefill → decode between TP sizes, regrouped by head, against the
same KV moved between equal sizes, side by side in one run.

    epd-lab bench tp-kv --tokens 4096 --shape qwen2-vl-2b --protocols shm,tcp --json data/bench/tp-kv.json

Decode is one process (a `PeerProcess`) with one cache of every KV head (TP 1), registered with its engine;
its blocks are the prefill's in reverse order, so no two blocks merge into one run (the worst case for both
moves). Three moves, each round in rotating order:
- plain: prefill TP 1 → decode TP 1, one engine holding every head: whole blocks, `batch_transfer_sync_write`
  (the connector's path between equal TP sizes);
- plain_strided: the same whole blocks as one `batch_transfer_sync_write_strided` (entries of one piece): the
  plain move in the strided op's framing, so that the regrouped move is also compared with its own op;
- regrouped: prefill TP `src_tp` → decode TP 1, `src_tp` engines (one a prefill rank, each its own thread, as
  rank processes write at once), each writing its heads' slice of every token of every block
  (`tp_plan.head_copies` → `batch_transfer_sync_write_strided`: an entry per block, a piece per token).
A move's time runs from making its runs to the last write's return. After every move decode's bytes are
checked against the expected cache (the source heads regrouped in numpy), so a fast wrong move cannot pass.
"""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np

from epd_lab.bench import write_json
from epd_lab.kv.tp_plan import CacheGeometry, KVLayout, head_copies, kv_head_range, plan_kv_transfer
from epd_lab.machine import commit, machine_info
from epd_lab.models.shapes import SHAPES
from epd_lab.transfer import TransferEngine
from epd_lab.transfer.buffers import as_array
from epd_lab.transfer.peer import PeerProcess

BLOCK_SIZE = 16
ELEMENT_BYTES = 2  # bfloat16, the published models' dtype


def _regions(base: int, num_regions: int, region_bytes: int) -> list[int]:
    return [base + i * region_bytes for i in range(num_regions)]


def _source(engine: TransferEngine, heads: int, geometry: dict[str, int], rng: np.random.Generator,
            ) -> tuple[CacheGeometry, np.ndarray]:
    """A prefill rank's cache of `heads` heads in `engine`'s managed (registered) memory, filled with random bytes:
    its geometry and a numpy view [regions, blocks, block_size, heads, head_bytes]."""
    shape = (geometry["regions"], geometry["blocks"], BLOCK_SIZE, heads, geometry["head_bytes"])
    nbytes = int(np.prod(shape))
    ptr = engine.allocate_managed_buffer(nbytes)
    engine.register(ptr, nbytes)  # a source is registered too (an lkey's role): shm reads need it
    view = as_array(ptr, nbytes).reshape(shape)
    view[...] = rng.integers(0, 256, shape, dtype=np.uint8)
    return CacheGeometry(_regions(ptr, shape[0], nbytes // shape[0]), BLOCK_SIZE, heads, geometry["head_bytes"]), view


def run(tokens: int = 4096, shape: str = "qwen2-vl-2b", src_tp: int = 2, protocols: tuple[str, ...] = ("shm", "tcp"),
        rounds: int = 7) -> dict[str, Any]:
    """The benchmark; returns its result (see the module docstring)."""
    spec = SHAPES[shape]
    num_kv_heads = spec.num_key_value_heads
    head_bytes = spec.hidden_size // spec.num_attention_heads * ELEMENT_BYTES
    blocks = -(-tokens // BLOCK_SIZE)
    geometry = {"regions": 2 * spec.num_hidden_layers, "blocks": blocks, "head_bytes": head_bytes}
    plan = plan_kv_transfer(num_kv_heads, src_tp, 1)
    src_ids = list(range(blocks))
    dst_ids = list(range(blocks))[::-1]  # decode's blocks in another order: runs cannot merge across blocks
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "bench": "tp-kv", "shape": shape, "tokens": tokens, "block_size": BLOCK_SIZE, "dtype": "bfloat16",
        "num_kv_heads": num_kv_heads, "src_tp": src_tp, "dst_tp": 1, "rounds": rounds,
        "kv_bytes": geometry["regions"] * blocks * BLOCK_SIZE * num_kv_heads * head_bytes,
        "plan": plan.rows(), "machine": machine_info(), "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "protocols": {}}
    for protocol in protocols:
        out["protocols"][protocol] = _one_protocol(protocol, plan, geometry, num_kv_heads, src_ids, dst_ids, rng,
                                                   rounds)
    return out


def _one_protocol(protocol: str, plan, geometry: dict[str, int], num_kv_heads: int, src_ids: list[int],
                  dst_ids: list[int], rng: np.random.Generator, rounds: int) -> dict[str, Any]:
    src_tp = plan.src_tp
    dst_bytes = geometry["regions"] * geometry["blocks"] * BLOCK_SIZE * num_kv_heads * geometry["head_bytes"]
    engines = [TransferEngine(protocol=protocol, timeout=30.0) for _ in range(1 + src_tp)]
    try:
        with PeerProcess(protocol=protocol, timeout=30.0) as peer:
            dst_ptr = peer.call("alloc", nbytes=dst_bytes, managed=True)["ptr"]
            dst = CacheGeometry(_regions(dst_ptr, geometry["regions"], dst_bytes // geometry["regions"]), BLOCK_SIZE,
                                num_kv_heads, geometry["head_bytes"])
            whole, whole_view = _source(engines[0], num_kv_heads, geometry, rng)
            ranks = [_source(engines[1 + r], KVLayout(num_kv_heads, src_tp, r).local_heads, geometry, rng)
                     for r in range(src_tp)]

            def plain() -> int:
                copies = head_copies(plan_kv_transfer(num_kv_heads, 1, 1).between(0, 0), whole, dst, src_ids,
                                     dst_ids)
                engines[0].batch_transfer_sync_write(peer.session_id, *(f.tolist() for f in copies[:3]))
                return len(copies.srcs)

            def plain_strided() -> int:
                copies = head_copies(plan_kv_transfer(num_kv_heads, 1, 1).between(0, 0), whole, dst, src_ids,
                                     dst_ids)
                engines[0].batch_transfer_sync_write_strided(peer.session_id, *copies[:6])
                return len(copies.srcs)

            def regrouped(pool: ThreadPoolExecutor) -> int:
                def rank(r: int) -> int:
                    copies = head_copies(plan_kv_transfer(num_kv_heads, src_tp, 1).between(r, 0), ranks[r][0], dst,
                                         src_ids, dst_ids)
                    if len(copies.srcs):
                        engines[1 + r].batch_transfer_sync_write_strided(peer.session_id, *copies[:6])
                    return len(copies.srcs)
                return sum(pool.map(rank, range(src_tp)))

            moves = {"plain": plain, "plain_strided": plain_strided, "regrouped": None}
            times: dict[str, list[float]] = {name: [] for name in moves}
            runs: dict[str, int] = {}
            equal: dict[str, bool] = dict.fromkeys(moves, True)
            expected = {"regrouped": _expected_regrouped(plan, ranks, dst_ids)}
            expected["plain"] = expected["plain_strided"] = _expected_whole(whole_view, dst_ids)
            with ThreadPoolExecutor(max_workers=src_tp) as pool:
                moves["regrouped"] = lambda: regrouped(pool)
                names = list(moves)
                for i in range(rounds + 1):  # round 0 warms every path (connections, page faults) and is dropped
                    for name in names[i % 3:] + names[:i % 3]:
                        peer.call("fill", ptr=dst_ptr, nbytes=dst_bytes, value=0)
                        start = time.perf_counter()
                        runs[name] = moves[name]()
                        if i:
                            times[name].append(time.perf_counter() - start)
                        equal[name] &= _check(peer, dst_ptr, dst_bytes, expected[name])
            return {
                **{f"{name}_s": _summary(t) for name, t in times.items()},
                "ratio": _summary([r / p for r, p in zip(times["regrouped"], times["plain"])]),
                "ratio_to_plain_strided": _summary([r / p for r, p in zip(times["regrouped"],
                                                                           times["plain_strided"])]),
                "runs": runs, "bytes_equal": equal,
                **{f"{name}_gb_s": round(dst_bytes / statistics.median(t) / 1e9, 2) for name, t in times.items()}}
    finally:
        for engine in engines:
            engine.close()


def _expected_whole(view: np.ndarray, dst_ids: list[int]) -> np.ndarray:
    out = np.empty_like(view)
    out[:, dst_ids] = view
    return out


def _expected_regrouped(plan, ranks, dst_ids: list[int]) -> np.ndarray:
    """The decode cache the regrouped move must produce: every head from a rank holding it, by global index."""

    views = [v for _, v in ranks]
    heads = [None] * plan.num_kv_heads
    for r, view in enumerate(views):
        start, stop = kv_head_range(plan.num_kv_heads, plan.src_tp, r)
        for h in range(start, stop):
            heads[h] = heads[h] if heads[h] is not None else view[:, :, :, h - start]
    full = np.stack(heads, axis=3)
    return _expected_whole(full, dst_ids)


def _check(peer: PeerProcess, ptr: int, nbytes: int, expected: np.ndarray) -> bool:
    """Whether decode's memory holds `expected`, by checksum (the peer sums its bytes; numpy sums ours)."""
    from epd_lab.transfer.peer import checksum

    return peer.call("checksum", ptr=ptr, nbytes=nbytes)["crc32"] == checksum(expected.ctypes.data, nbytes)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 5), "min": round(min(values), 5),
            "max": round(max(values), 5), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    """`epd-lab bench tp-kv`."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench tp-kv", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens whose KV moves (default 4096)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-vl-2b", help="the model's KV geometry")
    ap.add_argument("--src-tp", type=int, default=2, help="prefill's TP size for the regrouped move (default 2)")
    ap.add_argument("--protocols", default="shm,tcp", help="transfer engine protocols, comma-separated")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the three moves, order rotating (default 9)")
    ap.add_argument("--json", metavar="PATH", help="write the result here")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be at least 1")
    result = run(args.tokens, args.shape, args.src_tp, tuple(p for p in args.protocols.split(",") if p),
                 args.rounds)
    for protocol, r in result["protocols"].items():
        print(f"{protocol}: plain {r['plain_s']['median'] * 1e3:.1f} ms, plain_strided "
              f"{r['plain_strided_s']['median'] * 1e3:.1f} ms, regrouped (tp {args.src_tp} -> 1) "
              f"{r['regrouped_s']['median'] * 1e3:.1f} ms: {r['ratio']['median']:.2f}x plain "
              f"({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f}), bytes equal {all(r['bytes_equal'].values())}")
    if args.json:
        write_json(args.json, result)
    return 0
