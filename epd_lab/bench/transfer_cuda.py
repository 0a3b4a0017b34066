"""`epd-lab bench transfer --device cuda`: the `cuda` transport beside its GPU baselines, in one run.

For each size (64 KiB to 1 GiB) and for one batch of 256 scattered 64 KiB blocks, each path moves bytes
from GPU memory of this process into GPU memory; a write counts once the bytes are in place (the engine's
completion, the stream synchronised, or the receiver's ack). Reported as in `epd_lab.bench.transfer`: the
median over repeats (GB/s = bytes / median wall time), the range, the repeats. Successive repeats move
through buffers twice the largest size, so no repeat finds its bytes in the 60 MB L2.

Paths: ``d2d`` (``dst.copy_(src)`` inside this process, then synchronise: the limit; its scattered
batch is one ``index_copy_``), ``cuda`` (our transport into a second process's GPU memory; the batch as
one kernel), ``cuda_api`` and ``cuda_loop`` (the same batch by one ``cudaMemcpyBatchAsync``, or by a
``cudaMemcpyAsync`` per block), ``cuda_arrays`` (the batch handed over as numpy arrays rather than
lists), ``pinned_staging`` (D2H into pinned host memory, then H2D), ``zmq_pickle`` (a pickled dict
holding the tensor, sent to a second process that rebuilds it on its GPU and acks: D2H, pickle, send,
unpickle, H2D). Two GPUs (peer copy, NCCL send/recv) are not measured here: see docs/gpu-summary.md.

Then the KV cache of a 4096-token prompt for each model shape (`epd_lab.models.shapes`), laid out as
`PagedKVCache` lays it out (per layer K and V ``[blocks, 16, kv_heads, head_dim]`` bf16, each registered
as its own region, the prompt's 256 blocks scattered in both caches), written with the region keys by
one `batch_transfer_sync_write`, against the in-process copy of the same bytes in one piece. And each
shape built on the GPU (seeded random weights, bf16) with one 4096-token prefill timed.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Callable, Iterator

import numpy as np

from epd_lab.bench import write_json
from epd_lab.bench.timing import Row, format_ratios, format_row, measure, size_label, to_row
from epd_lab.machine import machine_info

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
SCATTER_BLOCKS, SCATTER_BLOCK = 256, 64 * KiB
SCATTER_SPAN = 2 * SCATTER_BLOCKS * SCATTER_BLOCK
PATHS = ("d2d", "cuda", "cuda_api", "cuda_loop", "cuda_arrays", "pinned_staging", "zmq_pickle")
SCATTER_ONLY = ("cuda_api", "cuda_loop", "cuda_arrays")
ZMQ_MAX = 256 * MiB  # pickling a GiB per repeat adds nothing but minutes
KV_TOKENS, KV_BLOCK_TOKENS = 4096, 16


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


class _GpuBench:
    """The source tensor, the peer process, the writer engines and the baselines of one run."""

    def __init__(self, stack: contextlib.ExitStack, paths: tuple[str, ...], max_size: int, timeout: float) -> None:
        import torch

        self.torch, self.stack, self.timeout = torch, stack, timeout
        self.max = 2 * max(max_size, SCATTER_SPAN)
        self.max_size = max(max_size, SCATTER_SPAN)
        self.src = torch.randint(0, 256, (self.max,), dtype=torch.uint8, device="cuda")
        self.src_ptr = self.src.data_ptr()
        order = np.random.default_rng(1).permutation(SCATTER_BLOCKS)
        self.scatter_blocks = order * 2  # destination block index (of 64 KiB) inside the span
        self.skipped: dict[str, str] = {}
        self.writers: dict[str, tuple[Callable[[int], None] | None, Callable[[], None] | None]] = {}
        self._peer = None
        for path in paths:
            try:
                self.writers[path] = getattr(self, f"_setup_{path}")()
            except Exception as exc:  # a path that cannot run here is reported, the others go on
                self.skipped[path] = f"{type(exc).__name__}: {exc}"

    def _rotor(self) -> Callable[[int], int]:
        cycles: dict[int, Iterator[int]] = {}

        def offset(n: int) -> int:
            if n not in cycles:
                import itertools

                cycles[n] = itertools.cycle(range(0, self.max - n + 1, max(n, SCATTER_BLOCK)))
            return next(cycles[n])

        return offset

    def peer(self):
        if self._peer is None:
            from epd_lab.transfer.cuda_peer import CudaPeerProcess

            self._peer = self.stack.enter_context(CudaPeerProcess(protocol="auto", timeout=self.timeout))
            self.peer_dst = self._peer.cuda_alloc(self.max)
        return self._peer

    def _setup_d2d(self):
        torch = self.torch
        dst = torch.zeros(self.max, dtype=torch.uint8, device="cuda")
        offset = self._rotor()
        src2d, dst2d = self.src.view(-1, SCATTER_BLOCK), dst.view(-1, SCATTER_BLOCK)
        idx = torch.as_tensor(self.scatter_blocks, device="cuda")

        def write(n: int) -> None:
            o = offset(n)
            dst[o:o + n].copy_(self.src[o:o + n])
            torch.cuda.synchronize()

        def scatter() -> None:
            b = offset(SCATTER_SPAN) // SCATTER_BLOCK
            dst2d.index_copy_(0, idx + b, src2d[b:b + SCATTER_BLOCKS])
            torch.cuda.synchronize()

        return write, scatter

    def _engine(self, batch_copy: str):
        from epd_lab.transfer import TransferEngine

        os.environ["EPD_CUDA_BATCH"] = batch_copy
        try:
            eng = self.stack.enter_context(TransferEngine(protocol="cuda", timeout=self.timeout))
            eng.register(self.src_ptr, self.max)
        finally:
            del os.environ["EPD_CUDA_BATCH"]
        return eng

    def _cuda_path(self, batch_copy: str, arrays: bool = False):
        peer = self.peer()
        eng = self._engine(batch_copy)
        sid, src, dst, offset = peer.session_id, self.src_ptr, self.peer_dst, self._rotor()
        src_off = np.arange(SCATTER_BLOCKS, dtype=np.uint64) * SCATTER_BLOCK
        dst_off = self.scatter_blocks.astype(np.uint64) * SCATTER_BLOCK
        # each repeat's batch made beforehand, as a caller holds its block tables: only the write is timed
        batches = {}
        for o in range(0, self.max - SCATTER_SPAN + 1, SCATTER_SPAN):
            s_, d_ = src_off + np.uint64(src + o), dst_off + np.uint64(dst + o)
            batches[o] = (s_, d_, np.full(SCATTER_BLOCKS, SCATTER_BLOCK, dtype=np.uint64)) if arrays else \
                (s_.tolist(), d_.tolist(), [SCATTER_BLOCK] * SCATTER_BLOCKS)

        def write(n: int) -> None:
            o = offset(n)
            eng.transfer_sync_write(sid, src + o, dst + o, n)

        def scatter() -> None:
            eng.batch_transfer_sync_write(sid, *batches[offset(SCATTER_SPAN)])

        scatter()  # the first write maps the peer's memory (and compiles the kernel): not a repeat
        return write, scatter

    def _setup_cuda(self):
        return self._cuda_path("kernel")

    def _setup_cuda_api(self):
        return None, self._cuda_path("api")[1]

    def _setup_cuda_loop(self):
        return None, self._cuda_path("loop")[1]

    def _setup_cuda_arrays(self):
        return None, self._cuda_path("kernel", arrays=True)[1]

    def _setup_pinned_staging(self):
        torch = self.torch
        host = torch.empty(self.max_size, dtype=torch.uint8, pin_memory=True)  # host memory: no L2 to dodge
        dst = torch.zeros(self.max, dtype=torch.uint8, device="cuda")
        offset = self._rotor()

        def write(n: int) -> None:
            o = offset(n)
            host[:n].copy_(self.src[o:o + n], non_blocking=True)
            dst[o:o + n].copy_(host[:n], non_blocking=True)
            torch.cuda.synchronize()

        return write, None

    def _setup_zmq_pickle(self):
        from epd_lab.bench.receivers import connect_push_ack  # imports pyzmq: only this baseline needs it

        proc = subprocess.Popen([sys.executable, "-m", "epd_lab.bench.transfer_cuda", "--zmq-receiver"],
                                stdout=subprocess.PIPE, text=True)
        self.stack.callback(_stop, proc)
        push, ack = connect_push_ack(self.stack, json.loads(proc.stdout.readline()))
        offset = self._rotor()

        def write(n: int) -> None:
            if n > ZMQ_MAX:
                raise _TooBig
            o = offset(n)
            # a tensor of its own (pickling a view would pickle its whole storage), as send_pyobj sends it
            push.send(pickle.dumps({"req_id": "bench", "embedding": self.src[o:o + n].clone()}))
            ack.recv()

        return write, None


class _TooBig(Exception):
    """A size a path does not run at (zmq_pickle past ZMQ_MAX)."""


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


def zmq_receiver() -> None:
    """The zmq_pickle baseline's far side: rebuild each tensor on this process's GPU, then ack.
    (pickle from a socket is what the baseline measures; it runs only inside this benchmark.)"""
    import torch
    import zmq

    from epd_lab.bench.receivers import bind_pull_ack

    torch.zeros(1, device="cuda")
    pull, ack = bind_pull_ack(zmq.Context())
    while True:
        obj = pickle.loads(pull.recv())  # noqa: S301 - the bench's own child, on loopback
        assert obj["embedding"].is_cuda
        torch.cuda.synchronize()
        ack.send(b"k")


# ---- KV of a 4k-token prompt, and the model shapes built on the GPU ----

def kv_transfer(name: str, peer, budget_s: float, timeout: float) -> dict:
    """Write one 4096-token prompt's KV of shape `name` into the peer's paged cache (see module doc)."""
    import torch

    from epd_lab.models.shapes import SHAPES
    from epd_lab.transfer import TransferEngine

    s = SHAPES[name]
    block_len = KV_BLOCK_TOKENS * s.num_key_value_heads * s.head_dim * 2
    nblocks = KV_TOKENS // KV_BLOCK_TOKENS
    pool = 2 * nblocks  # blocks per region in each cache: the prompt's are a scattered half
    regions = 2 * s.num_hidden_layers
    region_bytes = pool * block_len
    rng = np.random.default_rng(7)
    src_blocks, dst_blocks = rng.permutation(pool)[:nblocks], rng.permutation(pool)[:nblocks]
    cache = torch.randint(0, 256, (regions * region_bytes,), dtype=torch.uint8, device="cuda")
    dst = peer.cuda_alloc(regions * region_bytes, register=False)
    keys = [peer.call("register", ptr=dst + r * region_bytes, nbytes=region_bytes)["key"] for r in range(regions)]
    with TransferEngine(protocol="cuda", timeout=timeout) as eng:
        base = cache.data_ptr()
        for r in range(regions):
            eng.register(base + r * region_bytes, region_bytes)
        srcs = [base + r * region_bytes + int(b) * block_len for r in range(regions) for b in src_blocks]
        dsts = [dst + r * region_bytes + int(b) * block_len for r in range(regions) for b in dst_blocks]
        lens, rkeys = [block_len] * len(srcs), [keys[r] for r in range(regions) for _ in dst_blocks]
        total = sum(lens)
        a_srcs, a_dsts = np.array(srcs, dtype=np.uint64), np.array(dsts, dtype=np.uint64)
        a_lens, a_keys = np.array(lens, dtype=np.uint64), np.array(rkeys, dtype=np.uint64)

        def lists() -> None:
            eng.batch_transfer_sync_write(peer.session_id, srcs, dsts, lens, rkeys)

        def arrays() -> None:
            eng.batch_transfer_sync_write(peer.session_id, a_srcs, a_dsts, a_lens, a_keys)

        t_lists, t_arrays = measure(lists, budget_s), measure(arrays, budget_s)
        i = 5  # one block, checked where it landed
        got = peer.cuda_checksum(dsts[i], block_len)
        import zlib

        ok = got == zlib.crc32(cache[srcs[i] - base:srcs[i] - base + block_len].cpu().numpy())
    one = torch.empty(total, dtype=torch.uint8, device="cuda")

    def limit() -> None:
        one.copy_(cache[:total])
        torch.cuda.synchronize()

    t_limit = measure(limit, budget_s)
    peer.call("cuda_free", ptr=dst)
    med = {k: float(np.median(v)) for k, v in (("lists", t_lists), ("arrays", t_arrays), ("limit", t_limit))}
    return {"shape": name, "tokens": KV_TOKENS, "kv_bytes": total, "blocks": len(lens), "block_bytes": block_len,
            "regions": regions, "landed_checked": ok,
            "ms": {k: v * 1e3 for k, v in med.items()},
            "gbps": {k: total / v / 1e9 for k, v in med.items()},
            "vs_limit": {"lists": med["limit"] / med["lists"], "arrays": med["limit"] / med["arrays"]}}


def device_time(repeats: int = 50) -> dict:
    """GPU time alone (CUDA events around back-to-back launches queued behind a sleeping kernel, so host work
    between launches does not count): the batch kernel on
    256 scattered 64 KiB blocks against one cudaMemcpyAsync of the same 16 MiB, inside this process. What
    the wall-clock rows add on top of this is host work per call."""
    import torch

    from epd_lab.transfer import cuda_runtime

    cu = cuda_runtime.get()
    src = torch.randint(0, 256, (SCATTER_SPAN,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(SCATTER_SPAN, dtype=torch.uint8, device="cuda")
    order = np.random.default_rng(1).permutation(SCATTER_BLOCKS)
    srcs = np.arange(SCATTER_BLOCKS, dtype=np.uint64) * SCATTER_BLOCK + np.uint64(src.data_ptr())
    dsts = order.astype(np.uint64) * 2 * SCATTER_BLOCK + np.uint64(dst.data_ptr())
    lens = np.full(SCATTER_BLOCKS, SCATTER_BLOCK, dtype=np.uint64)
    total = SCATTER_BLOCKS * SCATTER_BLOCK

    def timed(fn: Callable[[], None]) -> float:
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # hold the GPU while the launches queue, so none waits for the host
        a.record()
        for _ in range(repeats):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / repeats

    configs = {}
    for threads, unroll in cuda_runtime.KERNEL_CONFIGS:
        dst.zero_()
        t = timed(lambda: cu.batch_copy(0, dsts, srcs, lens, config=(threads, unroll)))
        ok = torch.equal(dst.view(-1, SCATTER_BLOCK)[torch.as_tensor(order * 2, device="cuda")],
                         src[:total].view(-1, SCATTER_BLOCK))
        configs[f"{threads}x{unroll}"] = {"us": t * 1e6, "gbps": total / t / 1e9, "landed": bool(ok)}
    t_memcpy = timed(lambda: cu.copy(dst.data_ptr(), src.data_ptr(), total))
    used = configs["%dx%d" % cuda_runtime.KERNEL_CONFIG]
    return {"bytes": total, "blocks": SCATTER_BLOCKS, "kernel_config": "%dx%d" % cuda_runtime.KERNEL_CONFIG,
            "kernel_us": used["us"], "memcpy_us": t_memcpy * 1e6, "kernel_gbps": used["gbps"],
            "memcpy_gbps": total / t_memcpy / 1e9, "kernel_vs_memcpy": t_memcpy * 1e6 / used["us"],
            "kernel_landed": all(c["landed"] for c in configs.values()), "configs": configs}


NCCL_REPEATS = 20


def two_gpus(sizes: tuple[int, ...], budget_s: float, timeout: float, log: Callable[[str], None]) -> list[Row]:
    """GPU 0 to GPU 1: ``peer_copy`` (``copy_`` inside this process: the limit), ``cuda_gpu1`` (our
    transport into a second process's memory on GPU 1, through CUDA IPC and peer access) and ``nccl``
    (``torch.distributed`` send/recv between two processes, one per GPU, as vLLM's P2pNcclConnector; each
    repeat ends when rank 1's 4-byte ack arrives, so the bytes are in place as for the others)."""
    import torch
    import torch.distributed as dist

    from epd_lab.transfer import TransferEngine
    from epd_lab.transfer.cuda_peer import CudaPeerProcess

    rows: list[Row] = []
    top = max(sizes)
    src = torch.randint(0, 256, (top,), dtype=torch.uint8, device="cuda:0")
    dst1 = torch.zeros(top, dtype=torch.uint8, device="cuda:1")

    def peer_copy(n: int) -> None:
        dst1[:n].copy_(src[:n])
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)

    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(CudaPeerProcess(protocol="auto", timeout=timeout))
        far = peer.cuda_alloc(top, device=1)
        eng = stack.enter_context(TransferEngine(protocol="cuda", timeout=timeout))
        eng.register(src.data_ptr(), top)

        def ours(n: int) -> None:
            eng.transfer_sync_write(peer.session_id, src.data_ptr(), far, n)

        for n in sizes:
            for path, fn in (("peer_copy", peer_copy), ("cuda_gpu1", ours)):
                rows.append(to_row(path, n, 1, measure(lambda: fn(n), budget_s)))
                log(format_row(rows[-1]))
        import zlib

        ok = peer.cuda_checksum(far, top) == zlib.crc32(src.cpu().numpy())
        log(f"  cuda_gpu1 landed: {ok}")
    # NCCL: rank 1 in a child process on GPU 1, rank 0 here
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_NVLS_ENABLE": "0"}
    child = subprocess.Popen([sys.executable, "-m", "epd_lab.bench.transfer_cuda", "--nccl-rank1",
                              ",".join(str(n) for n in sizes)], env=env)
    try:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_NVLS_ENABLE": "0"})
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=2, device_id=torch.device("cuda:0"))
        ack = torch.zeros(1, dtype=torch.int32, device="cuda:0")
        for n in sizes:
            times = []
            for r in range(NCCL_REPEATS + 2):
                t0 = time.perf_counter()
                dist.send(src[:n], dst=1)
                dist.recv(ack, src=1)
                torch.cuda.synchronize(0)
                if r >= 2:
                    times.append(time.perf_counter() - t0)
            rows.append(to_row("nccl", n, 1, times))
            log(format_row(rows[-1]))
        dist.destroy_process_group()
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return rows


def nccl_rank1(sizes: list[int]) -> None:
    """`two_gpus`' NCCL receiver: for each size, receive and ack each repeat."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(1)
    dist.init_process_group("nccl", rank=1, world_size=2, device_id=torch.device("cuda:1"))
    buf = torch.empty(max(sizes), dtype=torch.uint8, device="cuda:1")
    ack = torch.ones(1, dtype=torch.int32, device="cuda:1")
    for n in sizes:
        for _ in range(NCCL_REPEATS + 2):
            dist.recv(buf[:n], src=0)
            dist.send(ack, dst=0)
    torch.cuda.synchronize(1)
    dist.destroy_process_group()


def model_shape(name: str) -> dict:
    """Build shape `name` on the GPU (bf16, seed 0) and time one 4096-token prefill."""
    import torch

    from epd_lab.models.shapes import build_shape_model

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_shape_model(name, "cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    on_cuda = all(p.is_cuda for p in model.parameters())
    ids = torch.randint(0, 1024, (1, KV_TOKENS), device="cuda")
    times = []
    with torch.inference_mode():
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finite = bool(torch.isfinite(out.logits[0, -1]).all())
    kv = out.past_key_values
    layer0 = kv.layers[0].keys if hasattr(kv, "layers") else kv[0][0]
    result = {"shape": name, "parameters": params, "all_on_cuda": on_cuda, "build_s": build_s,
              "prefill_4k_ms": float(np.median(times[1:])) * 1e3, "logits_finite": finite,
              "kv_layer0_key_shape": list(layer0.shape), "peak_gib": torch.cuda.max_memory_allocated() / GiB}
    del model, out, kv, layer0
    torch.cuda.empty_cache()
    return result


def ratios(rows: list[dict], kv: list[dict]) -> list[dict]:
    """The `cuda` transport's targets as ratios of medians measured in this run."""
    def g(path: str, size: int, blocks: int = 1) -> float | None:
        return next((r["gbps"] for r in rows if r["path"] == path and r["size"] == size and r["blocks"] == blocks),
                    None)

    out = []

    def add(name: str, num: float | None, den: float | None, target: float) -> None:
        value = num / den if num and den else None
        out.append({"name": name, "value": value, "target": target,
                    "ok": None if value is None or target == 0.0 else value >= target})

    for size in SIZES:
        if size >= 16 * MiB:
            add(f"cuda / d2d @ {size_label(size)}", g("cuda", size), g("d2d", size), 0.8)
    total = SCATTER_BLOCKS * SCATTER_BLOCK
    for path in ("cuda", "cuda_arrays", "cuda_api", "cuda_loop"):
        add(f"{path} 256 scattered / cuda contiguous @ 16 MiB", g(path, total, SCATTER_BLOCKS), g("cuda", total), 0.7)
    add("d2d index_copy_ 256 scattered / d2d contiguous @ 16 MiB (report)", g("d2d", total, SCATTER_BLOCKS),
        g("d2d", total), 0.0)
    for size in SIZES:
        if size >= 16 * MiB:
            add(f"cuda / pinned_staging @ {size_label(size)}", g("cuda", size), g("pinned_staging", size), 5.0)
    for size in (16 * MiB, 256 * MiB):
        add(f"cuda / zmq_pickle @ {size_label(size)} (report)", g("cuda", size), g("zmq_pickle", size), 0.0)
    for size in SIZES:
        if size >= MiB:
            add(f"two GPUs: cuda_gpu1 / peer_copy @ {size_label(size)}", g("cuda_gpu1", size), g("peer_copy", size),
                0.8 if size >= 16 * MiB else 0.0)
            add(f"two GPUs: cuda_gpu1 / nccl @ {size_label(size)}", g("cuda_gpu1", size), g("nccl", size), 1.0)
    for k in kv:
        add(f"KV 4k {k['shape']} (lists) / d2d of the same bytes (report)", k["gbps"]["lists"],
            k["gbps"]["limit"], 0.0)
        add(f"KV 4k {k['shape']} (arrays) / d2d of the same bytes (report)", k["gbps"]["arrays"],
            k["gbps"]["limit"], 0.0)
    return out


def run(paths: tuple[str, ...] = PATHS, sizes: tuple[int, ...] = SIZES, budget_s: float = 0.3,
        scatter: bool = True, shapes: tuple[str, ...] = ("qwen2-vl-2b", "qwen2-vl-7b"), timeout: float = 20.0,
        log: Callable[[str], None] = print) -> dict:
    """Measure; returns ``{"machine", "rows", "skipped", "kv_4k", "models", "ratios"}``."""
    from epd_lab.transfer.cuda_runtime import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"epd-lab bench transfer --device cuda: {reason}")
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}")
    rows: list[Row] = []
    kv: list[dict] = []
    models: list[dict] = []
    with contextlib.ExitStack() as stack:
        bench = _GpuBench(stack, paths, max(sizes), timeout)
        for path, why in bench.skipped.items():
            log(f"  {path}: skipped ({why})")
        for size in sizes:
            for path, (write, _) in bench.writers.items():
                if write is None:
                    continue
                try:
                    rows.append(to_row(path, size, 1, measure(lambda: write(size), budget_s)))
                except _TooBig:
                    continue
                log(format_row(rows[-1]))
        if scatter:
            total = SCATTER_BLOCKS * SCATTER_BLOCK
            for path, (write, scat) in bench.writers.items():
                if scat is None:
                    continue
                if write is not None and total not in sizes:
                    rows.append(to_row(path, total, 1, measure(lambda: write(total), budget_s)))
                    log(format_row(rows[-1]))
                rows.append(to_row(path, total, SCATTER_BLOCKS, measure(scat, budget_s)))
                log(format_row(rows[-1]))
        if shapes:
            peer = bench.peer()
            for name in shapes:
                kv.append(kv_transfer(name, peer, budget_s, timeout))
                k = kv[-1]
                log(f"  KV 4k {name}: {k['kv_bytes'] / MiB:.0f} MiB in {k['blocks']} blocks of {k['block_bytes']} B: "
                    f"lists {k['ms']['lists']:.3f} ms ({k['gbps']['lists']:.0f} GB/s), arrays {k['ms']['arrays']:.3f} "
                    f"ms ({k['gbps']['arrays']:.0f} GB/s), d2d limit {k['ms']['limit']:.3f} ms "
                    f"({k['gbps']['limit']:.0f} GB/s); landed {k['landed_checked']}")
        skipped = bench.skipped
    import torch

    if torch.cuda.device_count() >= 2:
        try:
            rows += two_gpus(tuple(n for n in sizes if n >= MiB), budget_s, timeout, log)
        except Exception as exc:  # reported; the one-GPU results stand
            skipped["two_gpus"] = f"{type(exc).__name__}: {exc}"
            log(f"  two GPUs: skipped ({skipped['two_gpus']})")
    else:
        skipped["two_gpus"] = f"{torch.cuda.device_count()} GPU here (kind nvidia-h200-x2 has two)"
    gpu_time = device_time()
    log(f"  device time, 256 x 64 KiB scattered: kernel {gpu_time['kernel_us']:.1f} us "
        f"({gpu_time['kernel_gbps']:.0f} GB/s) vs one cudaMemcpyAsync of 16 MiB {gpu_time['memcpy_us']:.1f} us "
        f"({gpu_time['memcpy_gbps']:.0f} GB/s): {gpu_time['kernel_vs_memcpy']:.2f}; configs (threads x vectors) "
        + ", ".join(f"{k} {v['us']:.1f} us" for k, v in gpu_time["configs"].items()))
    for name in shapes:
        try:
            models.append(model_shape(name))
            log(f"  model {name}: {models[-1]}")
        except Exception as exc:  # a shape that cannot build here is reported, the rest stands
            skipped[f"model {name}"] = f"{type(exc).__name__}: {exc}"
            log(f"  model {name}: skipped ({skipped[f'model {name}']})")
    result = {"machine": machine_info(gpu=True), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": [asdict(r) for r in rows], "skipped": skipped, "device_time": gpu_time, "kv_4k": kv,
              "models": models,
              "untested": ["GPU memory across hosts (a GPU destination on another host is refused; GPU sources "
                           "to another host staged through pinned memory run only between two processes here); "
                           "GPUDirect RDMA"]}
    result["ratios"] = ratios(result["rows"], kv)
    result["ratios"].append({"name": "device time: kernel 256 scattered / memcpy contiguous @ 16 MiB",
                             "value": gpu_time["kernel_vs_memcpy"], "target": 0.7,
                             "ok": gpu_time["kernel_vs_memcpy"] >= 0.7})
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="epd-lab bench transfer --device cuda", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--json", metavar="PATH", help="write the result here")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma-separated")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of repeats per point (at least 5)")
    ap.add_argument("--no-scatter", action="store_true", help="skip the 256-block scattered batch")
    ap.add_argument("--shapes", default="qwen2-vl-2b,qwen2-vl-7b",
                    help="model shapes for the 4k-token KV transfer and the GPU build ('' for none)")
    ap.add_argument("--zmq-receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nccl-rank1", metavar="SIZES", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.nccl_rank1:
        nccl_rank1([int(n) for n in args.nccl_rank1.split(",")])
        return 0
    if args.zmq_receiver:
        zmq_receiver()
        return 0
    paths = tuple(p for p in args.paths.split(",") if p)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    shapes = tuple(s for s in args.shapes.split(",") if s)
    print(f"epd-lab bench transfer --device cuda: {len(paths)} paths x {len(sizes)} sizes, {args.budget} s per point")
    result = run(paths, sizes, args.budget, scatter=not args.no_scatter, shapes=shapes)
    print(format_ratios(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
