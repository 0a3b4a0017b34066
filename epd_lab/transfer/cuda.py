"""The ``cuda`` transport: one-sided writes into a same-host peer's GPU memory through CUDA IPC.

Owner side (`CudaTransport.export`): when an engine registers GPU memory, the allocation that holds it
is exported once (``cudaIpcGetMemHandle``) and listed for peers, who ask for the list over the engine's
control channel (`CONTROL_EXPORTS`; JSON, never pickle). The registration itself goes into the engine's
native table like any other, and that table stays the authority on what may be written.

Writer side (`CudaTransport.write`): the first write into a peer's GPU memory maps the peer's
allocations once (``cudaIpcOpenMemHandle``; peer access across GPUs is enabled lazily). Every write
then pins the owner's registrations covering its blocks in the owner's published table
(`epd_lab.transfer.cuda_table`, the contract of the shm path: a write outside it, or into a
deregistered region, is refused and counted in the owner's ``writes_refused``), copies on the GPU
(one ``cudaMemcpyAsync`` per block for up to `SMALL_BATCH` blocks, else one launch of the batch-copy
kernel for the whole batch), waits for the copy, and releases the pins: when it returns, the bytes are
in place and a deregister that was waiting may proceed.

Memory on the host and on the GPU mix as follows:

- GPU source, peer GPU destination, same host: the path above.
- host source, peer GPU destination, same host: the same path (the copy engine reads host memory by UVA).
- GPU source, peer host destination (any host), or any GPU source to a peer on another host: the blocks
  are staged through pinned host memory registered with this engine (one D2H copy), then written by
  the engine's host path (shm or tcp).
- GPU destination on another host: refused with `TransportUnavailable` (CUDA IPC is same-host only; the
  Mooncake adapter is where GPUDirect RDMA users go).
"""
from __future__ import annotations

import bisect
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from epd_lab.transfer.cuda_table import PeerTable
from epd_lab.transfer.errors import ProtocolError, RegistrationError, TransferError, TransportUnavailable

CONTROL_PREFIX = b"CUDA/"
CONTROL_EXPORTS = CONTROL_PREFIX + b"exports"
SMALL_BATCH = 4  # up to this many blocks, one cudaMemcpyAsync each; more: one batched copy
# How a larger batch is copied: "kernel" (one launch of cuda_runtime's batch copy; the default, measured
# fastest), "api" (one cudaMemcpyBatchAsync) or "loop" (a cudaMemcpyAsync per block). EPD_CUDA_BATCH picks.
BATCH_COPIES = ("kernel", "api", "loop")
STAGING_MIN = 64 << 20  # pinned staging buffer, grown to the largest staged write


def gpu_memory_possible() -> bool:
    """Whether this process could hold GPU memory now: torch imported and its CUDA initialised. Cheap;
    a CPU-only process never imports torch or touches a driver through this module."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def device_of(ptr: int) -> int | None:
    """The GPU that `ptr` lives on, or None for host memory (and in a process without CUDA)."""
    if not gpu_memory_possible():
        return None
    from epd_lab.transfer import cuda_runtime

    return cuda_runtime.get().device_of(ptr)


@dataclass
class _Export:
    """One of the owner's GPU allocations, as peers see it; `local` once this process mapped it."""

    base: int
    size: int
    device: int
    handle: bytes
    keys: frozenset = frozenset()  # the registrations inside it: a write pinned under another key is not here
    local: int = 0

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass
class _PeerState:
    table: PeerTable | None  # None for a peer on another host
    control: Callable[[bytes], bytes]
    exports: list[_Export] = field(default_factory=list)  # sorted by base
    bases: list[int] = field(default_factory=list)
    fetched: bool = False
    host_keys: set = field(default_factory=set)  # keys of the peer's registrations seen to be host memory
    lock: threading.Lock = field(default_factory=threading.Lock)


class CudaTransport:
    """The GPU side of one `TransferEngine`: its exports (owner) and its mappings of peers (writer).

    Args:
        covers: the engine's own registration check (sources must lie in memory it registered).
        register, deregister: the engine's owner table, for the pinned staging buffer (a source it owns).
    """

    def __init__(self, covers: Callable[[int, int], bool], register: Callable[[int, int], int],
                 deregister: Callable[[int], None]) -> None:
        from epd_lab.transfer import cuda_runtime

        self.cu = cuda_runtime.get()
        self._covers = covers
        self._register, self._deregister = register, deregister
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, int, int]] = {}  # registered ptr -> (length, allocation base, device)
        self._index_regions()
        self._allocs: dict[int, _Export] = {}  # allocation base -> export, while a region uses it
        self._keys: dict[int, int] = {}  # registered ptr -> its registration key
        self._peers: dict[str, _PeerState] = {}
        self._staging: tuple[Any, int] | None = None  # (pinned tensor, ptr), registered with the engine
        self._staging_lock = threading.Lock()
        self._counts = {"cuda_writes_out": 0, "cuda_bytes_out": 0, "cuda_staged_bytes": 0}
        self.batch_copy = os.environ.get("EPD_CUDA_BATCH", "kernel")
        if self.batch_copy not in BATCH_COPIES:
            raise ValueError(f"EPD_CUDA_BATCH={self.batch_copy!r}; choose one of {', '.join(BATCH_COPIES)}")

    # ---- owner side ----
    def export(self, ptr: int, length: int, device: int, key: int) -> None:
        """Record GPU memory the engine just registered; export its allocation once (in the context of the
        GPU that holds it: the driver finds an allocation only there)."""
        cu = self.cu
        prev = cu.current_device() if cu.multi_gpu else device
        if prev != device:
            cu.set_device(device)
        try:
            base, size = cu.allocation(ptr)
            if ptr + length > base + size:
                raise ValueError(f"0x{ptr:x} + {length} bytes runs past its GPU allocation (0x{base:x}, {size} bytes)")
            with self._lock:
                if base not in self._allocs:
                    self._allocs[base] = _Export(base, size, device, cu.ipc_handle(base))
                self._regions[ptr] = (length, base, device)
                self._keys[ptr] = key
                self._index_regions()
        finally:
            if prev != device:
                cu.set_device(prev)

    def unexport(self, ptr: int) -> None:
        """Forget a deregistered region; its allocation leaves the list when no region uses it."""
        with self._lock:
            entry = self._regions.pop(ptr, None)
            self._keys.pop(ptr, None)
            self._index_regions()
            if entry is not None and all(b != entry[1] for _, b, _ in self._regions.values()):
                self._allocs.pop(entry[1], None)

    def _index_regions(self) -> None:
        """The GPU regions sorted, as the write paths look them up (rebuilt on register and deregister)."""
        local = sorted((start, start + length, device) for start, (length, _, device) in self._regions.items())
        self._local = local
        self._local_starts = np.array([r[0] for r in local], dtype=np.uint64)
        self._local_stops = np.array([r[1] for r in local], dtype=np.uint64)

    def owns(self, ptr: int) -> bool:
        """Whether `ptr` starts GPU memory this engine registered."""
        return ptr in self._regions

    def handle_control(self, request: bytes) -> bytes:
        """Answer `CONTROL_EXPORTS`: the allocations that hold registered GPU memory, with their handles and
        the keys of the registrations inside each (a writer maps an allocation once and, by the keys, knows
        when an address is registered again inside a new allocation)."""
        if request != CONTROL_EXPORTS:
            raise ProtocolError(f"unknown cuda control request {request[:32]!r}")
        with self._lock:
            items = [{"base": e.base, "size": e.size, "device": e.device, "handle": e.handle.hex(),
                      "keys": [self._keys[p] for p, (_, b, _) in self._regions.items() if b == e.base]}
                     for e in self._allocs.values()]
        return json.dumps(items).encode()

    # ---- writer side ----
    def _peer(self, session_id: str, hello: tuple[int, int, int] | None,
              control: Callable[[bytes], bytes]) -> _PeerState:
        """A peer's state, made on first use: its table (`hello` from a same-host HELLO, else None) and its
        control channel."""
        state = self._peers.get(session_id)
        if state is None:
            state = _PeerState(PeerTable(*hello) if hello is not None else None, control)
            with self._lock:
                kept = self._peers.setdefault(session_id, state)
            if kept is not state:
                self._close_peer(state)
            state = kept
        return state

    def detach(self, session_id: str) -> None:
        with self._lock:
            state = self._peers.pop(session_id, None)
        if state is not None:
            self._close_peer(state)

    def _close_peer(self, state: _PeerState) -> None:
        for e in state.exports:
            if e.local:
                self.cu.ipc_close(e.local)
        if state.table is not None:
            state.table.close()

    def _refresh(self, state: _PeerState) -> None:
        """Fetch the peer's export list; map new allocations, keep mapped ones, close vanished ones."""
        try:
            items = json.loads(state.control(CONTROL_EXPORTS))
            fresh = [_Export(int(i["base"]), int(i["size"]), int(i["device"]), bytes.fromhex(i["handle"]),
                             frozenset(int(k) for k in i["keys"])) for i in items]
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"the peer's cuda export list is malformed: {exc}") from exc
        with state.lock:
            known = {(e.base, e.handle): e for e in state.exports}
            keep = []
            for e in sorted(fresh, key=lambda e: e.base):
                old = known.pop((e.base, e.handle), None)
                if old is not None:
                    old.keys = e.keys
                    keep.append(old)
                    continue
                if state.table is not None:
                    e.local = self.cu.ipc_open(e.handle)
                    # the size is the peer's word: bound writes by the mapping this process really got
                    base, size = self.cu.allocation(e.local)
                    e.size = min(e.size, base + size - e.local)
                keep.append(e)
            for e in known.values():
                if e.local:
                    self.cu.ipc_close(e.local)
            state.exports, state.bases, state.fetched = keep, [e.base for e in keep], True

    def _export_of(self, state: _PeerState, dst: int) -> _Export | None:
        i = bisect.bisect_right(state.bases, dst) - 1
        if i >= 0 and dst < state.exports[i].end:
            return state.exports[i]
        return None

    def write(self, session_id: str, hello: tuple[int, int, int] | None, control: Callable[[bytes], bytes],
              srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int], rkeys: Sequence[int] | None,
              host_write: Callable[[Sequence[int]], int]) -> int | None:
        """Write a batch where GPU memory is involved; None when neither side is GPU memory (the engine's
        host path takes it as before). `hello`: the peer's HELLO where it is on this host, else None;
        `control`: its control channel; `host_write(srcs)` writes the batch by the host path from other
        sources (the staged copies). Returns the bytes written."""
        state = self._peers.get(session_id) or self._peer(session_id, hello, control)
        src_device = self._device_of_local(srcs[0])
        export = self._export_of(state, dsts[0])
        if export is None:
            if src_device is None and not self._may_be_gpu(state, dsts[0]):
                return None  # host to host: the engine's own path, at no extra cost
            self._refresh(state)  # an allocation registered since the last look
            export = self._export_of(state, dsts[0])
            if export is None:
                if src_device is None:
                    self._host_keys(state, dsts[0])
                    return None
                return self._staged(srcs, lengths, host_write)
        if state.table is None:
            raise TransportUnavailable(
                f"0x{dsts[0]:x} is GPU memory of {session_id}, which is on another host: CUDA IPC is "
                f"same-host only; write into a host buffer there, or use the Mooncake engine (GPUDirect RDMA)")
        cu = self.cu
        if not cu.multi_gpu:
            return self._device_write(state, export, 0, srcs, dsts, lengths, rkeys)
        prev = cu.current_device()
        device = prev if src_device is None else src_device
        if device != prev:  # copies in the source's context; the caller's device is restored
            cu.set_device(device)
        try:
            return self._device_write(state, export, device, srcs, dsts, lengths, rkeys)
        finally:
            if device != prev:
                cu.set_device(prev)

    def _may_be_gpu(self, state: _PeerState, dst: int) -> bool:
        """For a host source: whether `dst` might be GPU memory of the peer that its export list does not
        show yet. Registrations already seen to be host memory are remembered by key, so a host-to-host
        write asks the peer once per registration at most."""
        if state.table is None:
            return not state.fetched
        key = state.table.key_at(dst)
        return key is not None and key not in state.host_keys

    def _host_keys(self, state: _PeerState, dst: int) -> None:
        if state.table is not None:
            key = state.table.key_at(dst)
            if key is not None:
                state.host_keys.add(key)

    def _device_of_local(self, ptr: int) -> int | None:
        for start, stop, device in self._local:
            if start <= ptr < stop:
                return device
        return None

    def _device_write(self, state: _PeerState, export: _Export, device: int, srcs: Sequence[int],
                      dsts: Sequence[int], lengths: Sequence[int], rkeys: Sequence[int] | None,
                      retried: bool = False) -> int:
        n = len(lengths)
        if n <= SMALL_BATCH:  # plain Python: a handful of blocks costs less than numpy's setup
            for i in range(n):
                if not (export.base <= dsts[i] and dsts[i] + lengths[i] <= export.end):
                    return self._device_write_split(state, device, *self._arrays(srcs, dsts, lengths), rkeys)
                self._check_source(srcs[i], lengths[i], i)
            pins = self._pin_in(state, export, dsts, lengths, rkeys)
            if pins is None:
                return self._remapped(state, device, srcs, dsts, lengths, rkeys, retried)
            off = export.local - export.base
            cu, landed = self.cu, False
            try:
                for i in range(n):
                    cu.copy(int(dsts[i]) + off, int(srcs[i]), int(lengths[i]))
                cu.synchronize()
                landed = True
            finally:
                pins.release(landed)
            total = pins.nbytes
        else:
            s, d, ln = self._arrays(srcs, dsts, lengths)
            # one pass of reductions serves every check below; KV blocks share one length, so their spans
            # need no per-block end addresses
            shortest, longest = int(ln.min()), int(ln.max())
            uniform = shortest == longest
            lo = int(d.min())
            hi = int(d.max()) + longest if uniform else int((d + ln).max())
            if lo < export.base or hi > export.end:
                return self._device_write_split(state, device, s, d, ln, rkeys)
            self._check_sources(s, ln, longest if uniform else None)
            pins = self._pin_in(state, export, d, ln, rkeys, span=(lo, hi),
                                sizes=(shortest, shortest * n if uniform else int(ln.sum())))
            if pins is None:
                return self._remapped(state, device, srcs, dsts, lengths, rkeys, retried)
            off = (export.local - export.base) % (1 << 64)  # the kernel adds it modulo 2**64
            cu, landed = self.cu, False
            try:
                if self.batch_copy == "kernel":
                    cu.batch_copy(device, d, s, ln, off, longest=longest)
                elif self.batch_copy == "api":
                    cu.batch_copy_api(device, d + np.uint64(off), s, ln)
                else:
                    for i in range(n):
                        cu.copy((int(d[i]) + off) % (1 << 64), int(s[i]), int(ln[i]))
                cu.synchronize()
                landed = True
            finally:
                pins.release(landed)
            total = pins.nbytes
        with self._lock:
            self._counts["cuda_writes_out"] += n
            self._counts["cuda_bytes_out"] += total
        return total

    def _pin_in(self, state: _PeerState, export: _Export, dsts, lengths, rkeys, **hints):
        """Pin the blocks' registrations, and confirm each lies in `export` by its key; None (nothing pinned)
        when one does not: the address was registered again inside an allocation mapped since."""
        pins = state.table.pin(dsts, lengths, rkeys, **hints)
        if all(k in export.keys for k in pins.keys):
            return pins
        pins.release(landed=False)
        return None

    def _remapped(self, state: _PeerState, device: int, srcs, dsts, lengths, rkeys, retried: bool) -> int:
        """Look at the peer's allocations again and write once more; fail if the keys still do not match."""
        export = None
        if not retried:
            self._refresh(state)
            export = self._export_of(state, int(dsts[0]))
        if export is None:
            raise TransferError(f"0x{int(dsts[0]):x} is registered with pid {state.table.pid}, but in none of the "
                                f"GPU allocations it exports")
        return self._device_write(state, export, device, srcs, dsts, lengths, rkeys, retried=True)

    @staticmethod
    def _arrays(srcs, dsts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(srcs, dtype=np.uint64), np.asarray(dsts, dtype=np.uint64),
                np.asarray(lengths, dtype=np.uint64))

    def _check_source(self, src: int, length: int, i: int) -> None:
        for start, stop, _ in self._local:
            if start <= src and src + length <= stop:
                return
        if not self._covers(src, length):
            raise RegistrationError(f"source 0x{src:x} ({length} bytes) of write {i} is not inside memory "
                                    f"registered with this engine; register() it first")

    def _check_sources(self, s: np.ndarray, ln: np.ndarray, length: int | None = None) -> None:
        """Every source block inside one of this engine's registrations (the lkey's role): first whether the
        GPU region of the first block holds the whole span, else one sorted search; a block outside the GPU
        regions is asked of the engine's table (host memory). `length`: every block's, where they share one."""
        s0 = int(s[0])
        for start, stop, _ in self._local:
            if start <= s0 < stop:
                end = int(s.max()) + length if length is not None else int((s + ln).max())
                if int(s.min()) >= start and end <= stop:
                    return
                break
        starts, stops = self._local_starts, self._local_stops
        ends = s + ln
        if len(starts):
            j = np.searchsorted(starts, s, side="right") - 1
            ok = (j >= 0) & (ends <= stops[np.maximum(j, 0)])
            if ok.all():
                return
            bad = np.flatnonzero(~ok)
        else:
            bad = range(len(s))
        for i in bad:
            self._check_source(int(s[i]), int(ln[i]), int(i))

    def _device_write_split(self, state: _PeerState, device: int, s: np.ndarray, d: np.ndarray, ln: np.ndarray,
                            rkeys: Sequence[int] | None) -> int:
        """A batch whose destinations span several of the peer's allocations: one write per allocation."""
        keys = None if rkeys is None else np.asarray(rkeys, dtype=np.uint64)
        total = 0
        groups: dict[int, list[int]] = {}
        for i, dst in enumerate(d.tolist()):
            e = self._export_of(state, dst)
            if e is None:
                state.table.pin(d[i:i + 1], ln[i:i + 1], None if keys is None else keys[i:i + 1])  # refuses
                raise TransferError(f"0x{dst:x} is not in the peer's GPU memory")
            groups.setdefault(e.base, []).append(i)
        for base, idx in groups.items():
            ix = np.array(idx)
            e = self._export_of(state, base)
            total += self._device_write(state, e, device, s[ix], d[ix], ln[ix], None if keys is None else keys[ix])
        return total

    def _staged(self, srcs: Sequence[int], lengths: Sequence[int], host_write: Callable[[Sequence[int]], int]) -> int:
        """GPU sources to a host destination: copy them into pinned host memory, then write from there."""
        total = int(sum(lengths))
        with self._staging_lock:
            ptr = self._ensure_staging(total)
            offsets = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.uint64))[:-1])).astype(np.uint64)
            staged = offsets + np.uint64(ptr)
            for i, (src, n) in enumerate(zip(srcs, lengths)):
                self._check_source(int(src), int(n), i)
                self.cu.copy(int(staged[i]), int(src), int(n))
            self.cu.synchronize()
            n = host_write([int(x) for x in staged])
        with self._lock:
            self._counts["cuda_staged_bytes"] += total
        return n

    def _ensure_staging(self, nbytes: int) -> int:
        import torch

        if self._staging is None or self._staging[0].numel() < nbytes:
            if self._staging is not None:
                self._release_staging(self._staging[1])
            buf = torch.empty(max(nbytes, STAGING_MIN), dtype=torch.uint8, pin_memory=True)
            self._register(buf.data_ptr(), buf.numel())
            self._staging = (buf, buf.data_ptr())
        return self._staging[1]

    def _release_staging(self, ptr: int) -> None:
        self._deregister(ptr)
        self._staging = None

    def stats(self) -> dict[str, int]:
        """``cuda_exports`` (allocations exported), ``cuda_regions``, and as a writer ``cuda_writes_out``,
        ``cuda_bytes_out``, ``cuda_staged_bytes``."""
        with self._lock:
            return {"cuda_exports": len(self._allocs), "cuda_regions": len(self._regions), **self._counts}

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for state in peers:
            self._close_peer(state)
        if self._staging is not None:
            self._release_staging(self._staging[1])
