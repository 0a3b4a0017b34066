"""`epd-lab bench transfer`: every transfer path beside its baselines, in one run, between two processes.

For each size (and for one batch of 256 scattered 64 KiB blocks) each path writes from a registered
source into memory a second process registered; a write counts once the writer knows the bytes are
in place (the engine's completion, or the receiver's ack for the socket/ZMQ baselines). Reported:
the median over repeats (GB/s = bytes / median time), the range (slowest and fastest repeat), and
for 4 KiB the median round trip in µs. Successive repeats move through a buffer twice the largest size,
so that no repeat finds its source or destination still in the CPU cache (16 MiB + 16 MiB would fit in
this machine's 32 MiB L3 and beat the memory-bound limit).

The JSON records the machine (CPU vendor, model and the flags that matter to copies, the C library and
its memcpy's non-temporal threshold) and ``copy_policy``: which copy the shm path used for large writes
and how that was chosen (`epd_lab.transfer.shm_copy`; ``EPD_SHM_COPY=memcpy|stream`` forces one).

Paths: ``shm`` (into the peer's managed buffer), ``shm_registered`` (into memory the peer registered
from elsewhere, via process_vm_writev), ``tcp``, ``verbs`` (where an RDMA device exists),
``mooncake`` (the real Mooncake engine on tcp, where installed); baselines ``memcpy`` (single-thread
numpy.copyto: the limit), ``socket`` (raw TCP sendall/recv_into + ack), ``zmq`` (PUSH/PULL raw frames
+ ack), ``zmq_pickle`` (a pickled dict holding the array, as SGLang's ZMQ backends send it).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Callable, Iterator

import numpy as np

from epd_lab.bench import write_json
from epd_lab.bench.timing import KiB, MiB, Row, format_ratios, format_row, measure, size_label, to_row
from epd_lab.machine import machine_info
from epd_lab.transfer import TransferEngine, shm_copy
from epd_lab.transfer.peer import PeerProcess

SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB)
SCATTER_BLOCKS, SCATTER_BLOCK = 256, 64 * KiB
SCATTER_SPAN = 2 * SCATTER_BLOCKS * SCATTER_BLOCK  # the blocks land in every other 64 KiB of 32 MiB
PATHS = ("memcpy", "shm", "shm_registered", "tcp", "verbs", "mooncake", "socket", "zmq", "zmq_pickle")
OURS = ("shm", "shm_registered", "tcp", "verbs")


@contextlib.contextmanager
def _child(kind: str, max_bytes: int) -> Iterator[dict]:
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.bench.receivers", kind, "--max-bytes", str(max_bytes)],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


class _Bench:
    """Holds the source buffer, writer engines, peers and baseline receivers for one run."""

    def __init__(self, stack: contextlib.ExitStack, paths: tuple[str, ...], max_size: int, timeout: float) -> None:
        self.stack = stack
        self.max = 2 * max(max_size, 2 * SCATTER_BLOCKS * SCATTER_BLOCK)
        self.src = np.random.default_rng(0).integers(0, 256, self.max, dtype=np.uint8)
        self.src_ptr = self.src.ctypes.data
        self.timeout = timeout
        self.skipped: dict[str, str] = {}
        self.writers: dict[str, tuple[Callable[[int], None], Callable[[], None] | None]] = {}
        # scattered destinations: every other 64 KiB block of the first 32 MiB, in a shuffled order
        order = np.random.default_rng(1).permutation(SCATTER_BLOCKS)
        self.scatter_offsets = [int(i) * 2 * SCATTER_BLOCK for i in order]
        self.src_offsets = [i * SCATTER_BLOCK for i in range(SCATTER_BLOCKS)]
        for path in paths:
            try:
                self.writers[path] = getattr(self, f"_setup_{path}")()
            except Exception as exc:  # a path that cannot run here is reported, the others go on
                self.skipped[path] = f"{type(exc).__name__}: {exc}"

    def _engine_path(self, protocol: str, dst_managed: bool, peer_protocol: str = "tcp"):
        peer = self.stack.enter_context(PeerProcess(protocol=peer_protocol, timeout=self.timeout))
        dst = peer.alloc(self.max, managed=dst_managed)
        if protocol == "mooncake":
            from epd_lab.transfer.mooncake import MooncakeTransferEngine

            eng = self.stack.enter_context(MooncakeTransferEngine())
        else:
            eng = self.stack.enter_context(TransferEngine(protocol=protocol, timeout=self.timeout))
        eng.register(self.src_ptr, self.max)
        sid, src, offset = peer.session_id, self.src_ptr, self._rotor()
        lens = [SCATTER_BLOCK] * SCATTER_BLOCKS

        def write(n: int) -> None:
            o = offset(n)
            eng.transfer_sync_write(sid, src + o, dst + o, n)

        def scatter() -> None:
            o = offset(SCATTER_SPAN)
            eng.batch_transfer_sync_write(sid, [src + o + s for s in self.src_offsets],
                                          [dst + o + d for d in self.scatter_offsets], lens)

        return write, scatter

    def _rotor(self) -> Callable[[int], int]:
        """A path's own cycle of offsets per size: every path sees the same sequence."""
        cycles: dict[int, Iterator[int]] = {}

        def offset(n: int) -> int:
            if n not in cycles:
                cycles[n] = itertools.cycle(range(0, self.max - n + 1, n))
            return next(cycles[n])

        return offset

    def _setup_memcpy(self):
        dst = np.empty(self.max, dtype=np.uint8)
        dst[:] = 0
        offset = self._rotor()

        def write(n: int) -> None:
            o = offset(n)
            np.copyto(dst[o:o + n], self.src[o:o + n])

        def scatter() -> None:
            o = offset(SCATTER_SPAN)
            for d, s in zip(self.scatter_offsets, self.src_offsets):
                np.copyto(dst[o + d:o + d + SCATTER_BLOCK], self.src[o + s:o + s + SCATTER_BLOCK])

        return write, scatter

    def _setup_shm(self):
        return self._engine_path("shm", dst_managed=True)

    def _setup_shm_registered(self):
        return self._engine_path("shm", dst_managed=False)

    def _setup_tcp(self):
        return self._engine_path("tcp", dst_managed=False)

    def _setup_verbs(self):
        from epd_lab.transfer import verbs

        reason = verbs.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        return self._engine_path("verbs", dst_managed=False, peer_protocol="verbs")

    def _setup_mooncake(self):
        from epd_lab.transfer import mooncake

        reason = mooncake.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        return self._engine_path("mooncake", dst_managed=False, peer_protocol="mooncake")

    def _setup_socket(self):
        from epd_lab.bench.receivers import HEADER  # imports pyzmq, which the engine's paths do without

        info = self.stack.enter_context(_child("socket", self.max))
        sock = self.stack.enter_context(socket.create_connection(("127.0.0.1", info["port"])))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view, offset = memoryview(self.src), self._rotor()

        def write(n: int) -> None:
            o = offset(n)
            sock.sendall(HEADER.pack(n))
            sock.sendall(view[o:o + n])
            if sock.recv(1) != b"k":
                raise RuntimeError("socket receiver closed")

        return write, None

    def _zmq(self, kind: str):
        from epd_lab.bench.receivers import connect_push_ack  # imports pyzmq: only the zmq baselines need it

        return connect_push_ack(self.stack, self.stack.enter_context(_child(kind, self.max)))

    def _setup_zmq(self):
        push, ack = self._zmq("zmq")
        view, offset = memoryview(self.src), self._rotor()

        def write(n: int) -> None:
            o = offset(n)
            push.send(view[o:o + n], copy=n < 64 * KiB)
            ack.recv()

        return write, None

    def _setup_zmq_pickle(self):
        push, ack = self._zmq("zmq_pickle")
        offset = self._rotor()

        def write(n: int) -> None:
            o = offset(n)
            push.send(pickle.dumps({"req_id": "bench", "embedding": self.src[o:o + n]}))  # as send_pyobj does
            ack.recv()

        return write, None


def run(paths: tuple[str, ...] = PATHS, sizes: tuple[int, ...] = SIZES, budget_s: float = 0.5,
        scatter: bool = True, timeout: float = 10.0, log: Callable[[str], None] = print) -> dict:
    """Measure; returns ``{"machine", "rows", "skipped", "ratios"}`` (rows as in the JSON file)."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}")
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        bench = _Bench(stack, paths, max(sizes), timeout)
        for path, reason in bench.skipped.items():
            log(f"  {path}: skipped ({reason})")
        # all paths one size after another, so that the ratios of one size are measured side by side
        for size in sizes:
            for path, (write, _) in bench.writers.items():
                rows.append(to_row(path, size, 1, measure(lambda: write(size), budget_s)))
                log(format_row(rows[-1]))
        if scatter:
            for path, (write, scat) in bench.writers.items():
                if scat is None:
                    continue
                total = SCATTER_BLOCKS * SCATTER_BLOCK
                if total not in sizes:  # the contiguous twin the scattered batch is compared with
                    rows.append(to_row(path, total, 1, measure(lambda: write(total), budget_s)))
                    log(format_row(rows[-1]))
                rows.append(to_row(path, total, SCATTER_BLOCKS, measure(scat, budget_s)))
                log(format_row(rows[-1]))
    result = {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "copy_policy": shm_copy.current(), "rows": [asdict(r) for r in rows], "skipped": bench.skipped}
    result["ratios"] = ratios(result["rows"])
    return result


def ratios(rows: list[dict]) -> list[dict]:
    """The transfer targets as ratios of medians measured in this run; `ok` is None where a side is missing."""
    def g(path: str, size: int, blocks: int = 1) -> float | None:
        for r in rows:
            if r["path"] == path and r["size"] == size and r["blocks"] == blocks:
                return r["gbps"]
        return None

    def rtt(path: str) -> float | None:
        return next((r["rtt_us"] for r in rows if r["path"] == path and r["rtt_us"] is not None), None)

    out = []

    def add(name: str, num: float | None, den: float | None, target: float, higher_is_better: bool = True) -> None:
        value = num / den if num and den else None
        ok = None if value is None else (value >= target if higher_is_better else value <= target)
        out.append({"name": name, "value": value, "target": target, "ok": ok})

    for size in (16 * MiB, 256 * MiB):
        add(f"shm / memcpy @ {size_label(size)}", g("shm", size), g("memcpy", size), 0.8)
        add(f"shm_registered / memcpy @ {size_label(size)} (report)", g("shm_registered", size), g("memcpy", size), 0.0)
    add("tcp / mooncake @ 1 MiB", g("tcp", MiB), g("mooncake", MiB), 1.0)
    add("tcp / socket @ 1 MiB", g("tcp", MiB), g("socket", MiB), 0.9)
    for size in (16 * MiB, 256 * MiB):
        add(f"tcp / mooncake @ {size_label(size)}", g("tcp", size), g("mooncake", size), 1.5)
    add("tcp rtt / mooncake rtt @ 4 KiB", rtt("tcp"), rtt("mooncake"), 1.0, higher_is_better=False)
    total = SCATTER_BLOCKS * SCATTER_BLOCK
    for path in ("shm", "shm_registered", "tcp", "verbs", "mooncake"):
        add(f"{path} 256 scattered / contiguous @ 16 MiB", g(path, total, SCATTER_BLOCKS), g(path, total), 0.7)
    for size in (16 * MiB, 256 * MiB):
        add(f"shm / zmq_pickle @ {size_label(size)}", g("shm", size), g("zmq_pickle", size), 5.0)
        add(f"tcp / zmq_pickle @ {size_label(size)}", g("tcp", size), g("zmq_pickle", size), 1.5)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    device = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    device.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    where, rest = device.parse_known_args(sys.argv[1:] if argv is None else argv)
    if where.device == "cuda":  # GPU memory: epd_lab.bench.transfer_cuda, its own paths and sizes
        from epd_lab.bench import transfer_cuda

        return transfer_cuda.main(rest)
    argv = rest
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench transfer", description=__doc__.splitlines()[0],
                                 epilog="--device cuda: the GPU benchmark (epd_lab.bench.transfer_cuda; --help there)")
    ap.add_argument("--json", metavar="PATH", help="write the result here")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma-separated")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of repeats per point (at least 5)")
    ap.add_argument("--no-scatter", action="store_true", help="skip the 256-block scattered batch")
    args = ap.parse_args(argv)
    paths = tuple(p for p in args.paths.split(",") if p)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    print(f"epd-lab bench transfer: {len(paths)} paths x {len(sizes)} sizes, {args.budget} s per point")
    result = run(paths, sizes, args.budget, scatter=not args.no_scatter)
    print(format_ratios(result))
    if args.json:
        write_json(args.json, result)
    return 0
