"""A transfer engine in another process, driven over its stdin/stdout with JSON lines (no pickle).

The demo, the benchmark and the tests need a real second process that owns memory. Its Python code
only sets up (allocate, register) and inspects (checksum, read) on command; while a peer writes into
its memory, it sits blocked reading its stdin.

    with PeerProcess(protocol="shm") as peer:
        dst = peer.alloc(1 << 20, managed=True)      # and registered
        engine.transfer_sync_write(peer.session_id, src, dst, 1 << 20)
        peer.checksum(dst, 1 << 20)

Run by hand: ``python -m epd_lab.transfer.peer --protocol tcp``.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import zlib
from typing import IO, Any

import numpy as np

from epd_lab.transfer.buffers import as_array
from epd_lab.transfer.engine import TransferEngine
from epd_lab.transfer.registry import open_engine


def checksum(ptr: int, nbytes: int) -> int:
    """crc32 of `nbytes` at `ptr` (the same on both sides of a transfer)."""
    return zlib.crc32(as_array(ptr, nbytes))


class _Target:
    """The command handlers of the peer process."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.arrays: dict[int, np.ndarray] = {}  # memory allocated "from elsewhere" (like torch.empty)
        self.managed: set[int] = set()

    def alloc(self, nbytes: int, managed: bool = False, register: bool = True, fill: int = 0) -> dict:
        if managed:
            ptr = self.engine.allocate_managed_buffer(nbytes)
            self.managed.add(ptr)
        else:
            arr = np.empty(nbytes, dtype=np.uint8)
            ptr = arr.ctypes.data
            self.arrays[ptr] = arr
        as_array(ptr, nbytes)[:] = fill  # touch every page now, not during a timed write
        key = self.engine.register(ptr, nbytes) if register else 0
        return {"ptr": ptr, "key": key}

    def free(self, ptr: int) -> dict:
        if ptr in self.managed:
            self.engine.free_managed_buffer(ptr)
            self.managed.discard(ptr)
        else:
            self.arrays.pop(ptr)
        return {}

    def register(self, ptr: int, nbytes: int) -> dict:
        return {"key": self.engine.register(ptr, nbytes)}

    def deregister(self, ptr: int) -> dict:
        self.engine.deregister(ptr)
        return {}

    def checksum(self, ptr: int, nbytes: int) -> dict:
        return {"crc32": checksum(ptr, nbytes)}

    def read(self, ptr: int, nbytes: int) -> dict:
        return {"hex": as_array(ptr, nbytes).tobytes().hex()}

    def fill(self, ptr: int, nbytes: int, value: int) -> dict:
        as_array(ptr, nbytes)[:] = value
        return {}

    def write(self, session_id: str, src: int, dst: int, nbytes: int, rkey: int = 0) -> dict:
        self.engine.transfer_sync_write(session_id, src, dst, nbytes, rkey)
        return {}

    def stats(self) -> dict:
        return self.engine.stats()

    def registrations(self) -> dict:
        return {"regions": self.engine.registrations()}


def serve(protocol: str, timeout: float, engine_args: dict[str, Any] | None = None) -> None:
    """Run the command loop on stdin/stdout until ``{"cmd": "exit"}`` or end of input. `engine_args`: more
    keyword arguments of `TransferEngine` (``max_connections``, ``idle_timeout``); the secret comes from the
    environment (``EPD_SECRET``), as in every role."""
    engine = (TransferEngine("127.0.0.1", protocol, timeout=timeout, **engine_args) if engine_args
              else open_engine(protocol, timeout=timeout))
    with engine:
        command_loop(_Target(engine), engine.session_id)


def command_loop(target: Any, session_id: str) -> None:
    """Announce ``{"session_id", "pid"}``, then answer each JSON-line command on stdin with `target`'s method of
    that name until ``{"cmd": "exit"}`` or end of input."""
    out = sys.stdout
    print(json.dumps({"session_id": session_id, "pid": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "exit":
                break
            if cmd.startswith("_") or not hasattr(target, cmd):
                raise ValueError(f"unknown command {cmd!r}")
            reply: dict[str, Any] = {"ok": True, **getattr(target, cmd)(**msg)}
        except Exception as exc:  # the error goes back to the driver; the peer keeps serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=out, flush=True)


class PeerError(RuntimeError):
    """A command failed inside the peer process."""


class PeerProcess:
    """Start `serve` in a child process and call its commands. A context manager; `close` kills it."""

    def __init__(self, protocol: str = "auto", timeout: float = 5.0, start_timeout: float = 30.0,
                 env: dict[str, str] | None = None, stderr: IO[Any] | None = None, **engine_args: Any) -> None:
        """`env`: the child's whole environment (default: this process's); `stderr`: a file for the child's log
        (default: this process's stderr); `engine_args`: more keyword arguments of `TransferEngine`
        (``max_connections``, ``idle_timeout``)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_lab.transfer.peer", "--protocol", protocol, "--timeout", str(timeout),
             "--engine-args", json.dumps(engine_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=env,
        )
        hello = self._readline(start_timeout)
        self.session_id: str = hello["session_id"]
        self.pid: int = hello["pid"]

    def _readline(self, timeout: float | None = None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.close()
            raise TimeoutError(f"peer process gave no answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"peer process exited with code {self.proc.wait()}")
        return json.loads(line)

    def call(self, cmd: str, timeout: float | None = 60.0, **args: Any) -> dict:
        """Send one command and return its reply; raises `PeerError` with the peer's message."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._readline(timeout)
        if not reply.pop("ok"):
            raise PeerError(reply["error"])
        return reply

    def alloc(self, nbytes: int, managed: bool = False, register: bool = True, fill: int = 0) -> int:
        """Allocate (managed: from an engine memfd buffer; else a numpy array) and register; the address."""
        return self.call("alloc", nbytes=nbytes, managed=managed, register=register, fill=fill)["ptr"]

    def checksum(self, ptr: int, nbytes: int) -> int:
        return self.call("checksum", ptr=ptr, nbytes=nbytes)["crc32"]

    def read(self, ptr: int, nbytes: int) -> bytes:
        return bytes.fromhex(self.call("read", ptr=ptr, nbytes=nbytes)["hex"])

    def stats(self) -> dict:
        return self.call("stats")

    def close(self) -> None:
        """Ask the peer to exit; kill it if it does not within 5 s. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f and not f.closed:
                f.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--engine-args", type=json.loads, default={}, help="JSON: more TransferEngine arguments")
    args = ap.parse_args()
    serve(args.protocol, args.timeout, args.engine_args)


if __name__ == "__main__":
    main()
