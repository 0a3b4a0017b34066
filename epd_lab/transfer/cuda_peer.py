"""A transfer engine in another process that owns GPU memory (the `cuda` transport's far side).

As `epd_lab.transfer.peer` (JSON lines on stdin/stdout, no pickle), with GPU commands beside the host
ones: ``cuda_alloc`` (a PyTorch tensor on the GPU, registered), ``cuda_checksum`` and ``cuda_read``
(of bytes inside such a tensor), ``cuda_free``.

    with CudaPeerProcess() as peer:
        dst = peer.cuda_alloc(1 << 20)
        engine.transfer_sync_write(peer.session_id, src, dst, 1 << 20)
        peer.cuda_checksum(dst, 1 << 20)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import zlib
from typing import Any

from epd_lab.transfer.peer import PeerProcess, _Target, command_loop
from epd_lab.transfer.registry import open_engine


class _CudaTarget(_Target):
    """The host commands, and GPU memory held as PyTorch tensors."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.tensors: dict[int, Any] = {}

    def cuda_alloc(self, nbytes: int, device: int = 0, register: bool = True, fill: int = 0) -> dict:
        import torch

        t = torch.full((nbytes,), fill, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
        ptr = t.data_ptr()
        self.tensors[ptr] = t
        key = self.engine.register(ptr, nbytes) if register else 0
        return {"ptr": ptr, "key": key}

    def cuda_free(self, ptr: int, release: bool = False) -> dict:
        """Drop the tensor; `release`: hand PyTorch's cached segments back to the driver (cudaFree) too."""
        self.tensors.pop(ptr)
        if release:
            import torch

            torch.cuda.empty_cache()
        return {}

    def _view(self, ptr: int, nbytes: int) -> Any:
        for base, t in self.tensors.items():
            if base <= ptr and ptr + nbytes <= base + t.numel():
                return t[ptr - base:ptr - base + nbytes]
        raise ValueError(f"0x{ptr:x} (+{nbytes}) is not inside a tensor this peer allocated")

    def cuda_checksum(self, ptr: int, nbytes: int) -> dict:
        return {"crc32": zlib.crc32(self._view(ptr, nbytes).cpu().numpy())}

    def cuda_read(self, ptr: int, nbytes: int) -> dict:
        return {"hex": self._view(ptr, nbytes).cpu().numpy().tobytes().hex()}


def serve(protocol: str, timeout: float) -> None:
    """The command loop of `epd_lab.transfer.peer.serve`, with `_CudaTarget`'s commands."""
    with open_engine(protocol, timeout=timeout) as engine:
        command_loop(_CudaTarget(engine), engine.session_id)


class CudaPeerProcess(PeerProcess):
    """`serve` in a child process; the `PeerProcess` calls plus the GPU ones."""

    def __init__(self, protocol: str = "auto", timeout: float = 5.0, start_timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_lab.transfer.cuda_peer", "--protocol", protocol, "--timeout", str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        hello = self._readline(start_timeout)
        self.session_id: str = hello["session_id"]
        self.pid: int = hello["pid"]

    def cuda_alloc(self, nbytes: int, device: int = 0, register: bool = True, fill: int = 0) -> int:
        """A GPU tensor of `nbytes` filled with `fill`, registered unless told otherwise; its address."""
        return self.call("cuda_alloc", nbytes=nbytes, device=device, register=register, fill=fill)["ptr"]

    def cuda_checksum(self, ptr: int, nbytes: int) -> int:
        return self.call("cuda_checksum", ptr=ptr, nbytes=nbytes)["crc32"]

    def cuda_read(self, ptr: int, nbytes: int) -> bytes:
        return bytes.fromhex(self.call("cuda_read", ptr=ptr, nbytes=nbytes)["hex"])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    serve(args.protocol, args.timeout)


if __name__ == "__main__":
    main()
