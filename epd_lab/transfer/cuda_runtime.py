"""The few CUDA calls the `cuda` transport and the model runtime's gate make, through ctypes (no extra package).

The runtime (libcudart) and NVRTC are the ones PyTorch loaded; the driver is libcuda. Calls:
pointer attributes and allocation ranges (what is GPU memory, and which allocation holds it), CUDA IPC
handles (export once, map once), a stream's wait on a host word (``cuStreamWaitValue32``, for the model
runtime's `epd_lab.models.runtime.gate`), ``cudaMemcpyAsync`` for one block, and for a batch of scattered
blocks either one launch of `BATCH_COPY_SOURCE` (compiled by NVRTC once per process and configuration;
the descriptors travel as one kernel parameter, so no upload precedes the launch) or one
``cudaMemcpyBatchAsync``.

Copies go on the legacy default stream, so they follow work the caller queued on PyTorch's default
stream; a caller that filled the source on a side stream synchronizes that stream first.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import threading

import numpy as np

from epd_lab.transfer.errors import TransferError, TransportUnavailable

IPC_HANDLE_BYTES = 64
_MEMCPY_DEFAULT = 4
_IPC_LAZY_PEER = 1
_MEM_TYPE_DEVICE = 2
_WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
# Batch kernel: copies per launch (the descriptors are one kernel parameter: 3 x 8 x 1024 + 16 bytes, under
# the 32 KiB that CUDA 12.1+ allows), threads per block, and 16-byte vectors per thread per iteration.
BATCH_MAX = 1024
# (threads per block, 16-byte vectors per thread per iteration): KERNEL_CONFIGS are the ones the bench
# measures (device_time); KERNEL_CONFIG is the transport's, the fastest there on the H200.
# Measured on the H200 (256 scattered 64 KiB blocks, GPU time): 256x4 7.4 us, 512x4 7.3, 256x8 7.6,
# 512x8 6.7; one cudaMemcpyAsync of the same 16 MiB 7.0 us (data/bench/transfer-cuda-h200.json).
KERNEL_CONFIGS = ((256, 4), (512, 4), (256, 8), (512, 8))
KERNEL_CONFIG = (512, 8)
# Descriptor tables compiled: a launch passes the smallest that holds its blocks (less parameter to copy).
TABLE_SIZES = (256, BATCH_MAX)

BATCH_COPY_SOURCE = r"""
#define BATCH_MAX %(max)d
#define UNROLL %(unroll)d
struct Batch { unsigned long long src[BATCH_MAX], dst[BATCH_MAX], len[BATCH_MAX], n, dst_offset; };

// blockIdx.y picks the copy; the x blocks stride over it. dst_offset turns the owner's addresses into this
// process's mapping of them. 16-byte vectors where source, destination and length allow it (KV blocks
// do), bytes otherwise.
extern "C" __global__ void __launch_bounds__(%(threads)d) epd_batch_copy(const __grid_constant__ Batch b) {
    const unsigned i = blockIdx.y;
    const unsigned long long s = b.src[i], d = b.dst[i] + b.dst_offset, len = b.len[i];
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x * UNROLL;
    if (((s | d | len) & 15ull) == 0) {
        const uint4 *src = (const uint4 *)s;
        uint4 *dst = (uint4 *)d;
        const unsigned long long n = len >> 4;
        for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
             base < n; base += step) {
            uint4 r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                unsigned long long k = base + (unsigned long long)u * blockDim.x;
                if (k < n) r[u] = src[k];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                unsigned long long k = base + (unsigned long long)u * blockDim.x;
                if (k < n) dst[k] = r[u];
            }
        }
    } else {
        const unsigned char *src = (const unsigned char *)s;
        unsigned char *dst = (unsigned char *)d;
        for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < len;
             k += (unsigned long long)gridDim.x * blockDim.x)
            dst[k] = src[k];
    }
}
"""


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_byte * 64)]


class IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+): srcAccessOrder, srcLocHint, dstLocHint, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int), ("src_loc_id", ctypes.c_int),
                ("dst_loc_type", ctypes.c_int), ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


def _loaded(pattern: str) -> str | None:
    """The path of a shared library this process already loaded (PyTorch's CUDA libraries)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if re.search(pattern, os.path.basename(path)):
                return path
    return None


def _open(pattern: str, fallbacks: tuple[str, ...]) -> ctypes.CDLL:
    path = _loaded(pattern)
    for name in ((path,) if path else ()) + fallbacks:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise TransportUnavailable(f"no CUDA library matching {pattern!r} (tried {', '.join(fallbacks)})")


class Cuda:
    """The CUDA runtime, driver and NVRTC entry points the transport uses. One per process (`get`)."""

    def __init__(self) -> None:
        import torch  # the GPU memory the transport moves is PyTorch's; its CUDA libraries are the ones used

        if not torch.cuda.is_available():
            raise TransportUnavailable("the cuda transport needs a CUDA GPU; torch.cuda.is_available() is False")
        torch.cuda.init()
        self.rt = _open(r"^libcudart\.so", ("libcudart.so.13", "libcudart.so.12", "libcudart.so"))
        self.drv = _open(r"^libcuda\.so", ("libcuda.so.1",))
        rt, drv = self.rt, self.drv
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in {
            "cudaGetErrorString": (ctypes.c_int,),
            "cudaSetDevice": (ctypes.c_int,),
            "cudaGetDevice": (ctypes.POINTER(ctypes.c_int),),
            "cudaPointerGetAttributes": (ctypes.POINTER(_PointerAttributes), vp),
            "cudaIpcGetMemHandle": (ctypes.POINTER(IpcHandle), vp),
            "cudaIpcOpenMemHandle": (ctypes.POINTER(vp), IpcHandle, ctypes.c_uint),
            "cudaIpcCloseMemHandle": (vp,),
            "cudaMemcpyAsync": (vp, vp, sz, ctypes.c_int, vp),
            "cudaStreamSynchronize": (vp,),
            "cudaStreamCreate": (ctypes.POINTER(vp),),
            "cudaGetLastError": (),
        }.items():
            fn = getattr(rt, name)
            fn.argtypes = args
            fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int
        self.rt_batch = getattr(rt, "cudaMemcpyBatchAsync", None)
        if self.rt_batch is not None:  # CUDA 13's signature (12.8's had a failIdx before the stream)
            self.rt_batch.argtypes = (vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz, vp)
            self.rt_batch.restype = ctypes.c_int
        drv.cuMemGetAddressRange_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(sz), ctypes.c_uint64)
        drv.cuLaunchKernel.argtypes = (vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                       ctypes.c_uint, ctypes.c_uint, vp, ctypes.POINTER(vp), vp)
        drv.cuModuleLoadData.argtypes = (ctypes.POINTER(vp), ctypes.c_char_p)
        drv.cuModuleGetFunction.argtypes = (ctypes.POINTER(vp), vp, ctypes.c_char_p)
        drv.cuFuncSetAttribute.argtypes = (vp, ctypes.c_int, ctypes.c_int)
        drv.cuMemHostGetDevicePointer_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), vp, ctypes.c_uint)
        drv.cuStreamWaitValue32_v2.argtypes = (vp, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
        self.multi_gpu = torch.cuda.device_count() > 1  # else the current device never needs switching
        self._kernels: dict[tuple, int] = {}  # (device, table, threads, unroll) -> CUfunction of the batch copy
        self._lock = threading.Lock()
        self._tls = threading.local()

    # ---- errors ----
    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.rt.cudaGetLastError()  # clear it: PyTorch's next check would report it as its own
            raise TransferError(f"{what} failed: CUDA error {rc} ({self.rt.cudaGetErrorString(rc).decode()})")

    def check_drv(self, rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"{what} failed: CUDA driver error {rc}")

    # ---- memory ----
    def device_of(self, ptr: int) -> int | None:
        """The device ordinal of GPU memory at `ptr`, or None for host memory."""
        attrs = _PointerAttributes()
        rc = self.rt.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if rc != 0:
            self.rt.cudaGetLastError()  # an unknown host pointer leaves a sticky-free error behind
            return None
        return attrs.device if attrs.type == _MEM_TYPE_DEVICE else None

    def bind_context(self) -> None:
        """Make a context current in this thread before a driver call. A thread gets one from its first runtime
        call that needs it; a new worker thread of a server's pool may have made none, and the driver then
        answers error 201 (invalid context): the current device's primary context is bound here, once per
        thread (`set_device` later switches it, never unbinds)."""
        if not getattr(self._tls, "bound", False):
            self.set_device(self.current_device())
            self._tls.bound = True

    def allocation(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the cudaMalloc allocation holding `ptr` (what an IPC handle maps)."""
        self.bind_context()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check_drv(self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                       f"cuMemGetAddressRange(0x{ptr:x})")
        return base.value, size.value

    def host_device_pointer(self, ptr: int) -> int:
        """The device's address of page-locked host memory at `ptr` (the same under unified addressing)."""
        self.bind_context()
        out = ctypes.c_uint64()
        self.check_drv(self.drv.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr), 0),
                       f"cuMemHostGetDevicePointer(0x{ptr:x})")
        return out.value

    def wait_value(self, stream: int, address: int, value: int) -> None:
        """Queue on `stream` a wait until the 32-bit word at device `address` reaches `value` (a cyclic
        comparison: ``(int32)(word - value) >= 0``); the work queued after it starts then, with no host call."""
        self.bind_context()
        self.check_drv(self.drv.cuStreamWaitValue32_v2(ctypes.c_void_p(stream), address, value & 0xFFFFFFFF,
                                                       _WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def ipc_handle(self, base: int) -> bytes:
        h = IpcHandle()
        self.check(self.rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation into this one, on the current device (peer access enabled
        lazily where the allocation lives on another GPU)."""
        h = IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        out = ctypes.c_void_p()
        self.check(self.rt.cudaIpcOpenMemHandle(ctypes.byref(out), h, _IPC_LAZY_PEER), "cudaIpcOpenMemHandle")
        return out.value

    def ipc_close(self, ptr: int) -> None:
        self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def current_device(self) -> int:
        dev = ctypes.c_int()
        self.check(self.rt.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        return dev.value

    def set_device(self, device: int) -> None:
        """Make `device` current in this thread (the runtime keeps it per thread, and so does PyTorch)."""
        self.check(self.rt.cudaSetDevice(device), f"cudaSetDevice({device})")

    # ---- copies ----
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue one copy (device to device, peer, or host to device by UVA) on the default stream."""
        self.check(self.rt.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, None), "cudaMemcpyAsync")

    def synchronize(self) -> None:
        """Wait for the default stream: every queued copy has landed when this returns."""
        self.check(self.rt.cudaStreamSynchronize(None), "cudaStreamSynchronize")

    def batch_copy(self, device: int, dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray,
                   dst_offset: int = 0, config: tuple[int, int] | None = None, longest: int | None = None) -> None:
        """Queue a batch of copies as one kernel launch per `BATCH_MAX` blocks (uint64 arrays); the kernel
        writes to ``dst + dst_offset`` (modulo 2**64). `config`: (threads, vectors per thread), else
        `KERNEL_CONFIG`; `longest`: the longest block, where the caller knows it."""
        self.bind_context()
        threads, unroll = config or KERNEL_CONFIG
        chunk = threads * unroll * 16  # bytes one block moves per iteration
        if longest is None:
            longest = int(lengths.max())
        for lo in range(0, len(dsts), BATCH_MAX):
            n = min(BATCH_MAX, len(dsts) - lo)
            table = TABLE_SIZES[0] if n <= TABLE_SIZES[0] else BATCH_MAX
            fn, params, argv = self._launchable(device, table, threads, unroll)
            params[0:n] = srcs[lo:lo + n]
            params[table:table + n] = dsts[lo:lo + n]
            params[2 * table:2 * table + n] = lengths[lo:lo + n]
            params[3 * table] = n
            params[3 * table + 1] = dst_offset
            gx = max(1, min(-(-longest // chunk), max(1, 4096 // n)))  # enough blocks in flight, none idle
            self.check_drv(self.drv.cuLaunchKernel(fn, gx, n, 1, threads, 1, 1, 0, None, argv, None),
                           "cuLaunchKernel(epd_batch_copy)")

    def _launchable(self, device: int, table: int, threads: int, unroll: int):
        """The kernel for this table size and config, and this thread's parameter buffer for it (a launch
        copies its parameters at the call, so the buffer is free again when cuLaunchKernel returns)."""
        key = (device, table, threads, unroll)
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = {}
        entry = bufs.get(key)
        if entry is None:
            params = np.zeros(3 * table + 2, dtype=np.uint64)
            entry = bufs[key] = (self._kernel(key), params, (ctypes.c_void_p * 1)(params.ctypes.data))
        return entry

    def batch_copy_api(self, device: int, dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray) -> None:
        """The same batch through ``cudaMemcpyBatchAsync`` (the driver's own batched copy)."""
        if self.rt_batch is None:
            raise TransportUnavailable("this CUDA runtime has no cudaMemcpyBatchAsync (CUDA 12.8+)")
        attrs = _MemcpyAttributes(1, 0, 0, 0, 0, 0)  # the source is read in stream order; no location hints
        zero = ctypes.c_size_t(0)
        d, s, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, lengths))
        stream = getattr(self._tls, "stream", None)
        if stream is None:  # the batch API refuses the legacy stream; a blocking stream still follows its work
            stream = ctypes.c_void_p()
            self.check(self.rt.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
            self._tls.stream = stream = stream.value
        self.check(self.rt_batch(d.ctypes.data, s.ctypes.data, n.ctypes.data, len(d), ctypes.byref(attrs),
                                 ctypes.byref(zero), 1, stream), "cudaMemcpyBatchAsync")
        self.check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def _kernel(self, key: tuple[int, int, int, int]) -> int:
        fn = self._kernels.get(key)
        if fn is None:
            with self._lock:
                fn = self._kernels.get(key)
                if fn is None:
                    fn = self._kernels[key] = self._compile(*key)
        return fn

    def _compile(self, device: int, table: int, threads: int, unroll: int) -> int:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        nvrtc = _open(r"^libnvrtc\.so", ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"))
        prog = ctypes.c_void_p()
        src = (BATCH_COPY_SOURCE % {"max": table, "unroll": unroll, "threads": threads}).encode()
        if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"epd_batch_copy.cu", 0, None, None) != 0:
            raise TransferError("nvrtcCreateProgram failed")
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"--std=c++17"]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), argv)
        if rc != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise TransferError(f"NVRTC could not compile the batch copy: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        torch.cuda.synchronize(device)  # the device's primary context exists and is current
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check_drv(self.drv.cuModuleLoadData(ctypes.byref(module), cubin.raw), "cuModuleLoadData")
        self.check_drv(self.drv.cuModuleGetFunction(ctypes.byref(fn), module, b"epd_batch_copy"),
                       "cuModuleGetFunction")
        return fn.value


@functools.lru_cache(maxsize=1)
def get() -> Cuda:
    """The process's `Cuda` (raises `TransportUnavailable` with the reason where there is no GPU)."""
    return Cuda()


def unavailable_reason() -> str | None:
    """Why the cuda transport cannot run in this process, or None. Imports torch, never initialises a GPU
    that is absent."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA GPU here (torch.cuda.is_available() is False)"
    return None
