"""Mooncake Store as the encoders' shared embedding level (L3 of `epd_lab.ep.global_cache`): its master process,
the client an encoder's rank 0 opens, and the object format that lets a reader check what it got.

    with MooncakeMaster() as master:                     # the real mooncake_master, on ports the OS gave
        with StoreClient(master.address, timeout=2.0) as store:
            store.put(key, embedding)                    # one object: a header (digest, dtype, shape), the bytes
            store.exists([key])                          # [True]
            store.get(key)                               # the tensor, its length and sha256 checked; or None

The master keeps only the object index; the bytes lie in the segments the clients mount (each client gives
``segment_bytes`` of its host memory to the pool), and a reader fetches them from the writer's segment through
Mooncake's transfer engine (tcp here, RDMA where present). Without a metadata server the clients find each other
by ``P2PHANDSHAKE``. When the segments are full the master evicts objects (its high watermark); a put of a key
already stored is a no-op (Mooncake keeps the first object), which suits content-addressed keys.

Object format (`pack` / `unpack`): ``MAGIC``, a 4-byte little-endian header length, a msgpack `ObjectHeader`
(the key, dtype, shape, payload length, the payload's sha256), then the payload. A reader refuses an object
whose header does not parse, names another key, or whose payload's length or digest differ (`IntegrityError`):
the caller counts it a miss and runs the ViT.

Every store call runs in a thread and is waited for at most ``timeout`` seconds (a master killed mid-run makes a
put block for seconds, measured 4.3 s): a call that does not answer in time is a failure, never a wait past the
request's deadline. The client reconnects by itself once a restarted master answers (about 2 s here).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.util
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import msgspec
import torch

from epd_lab.procs import die_with_parent

MAGIC = b"EPDE"
_LEN = struct.Struct("<I")
_MAX_HEADER = 4096  # a header is a key, a dtype and a shape: far below this
SEGMENT_BYTES = 256 << 20  # default host memory each client gives to the pool
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses a smaller segment
LOCAL_BUFFER_BYTES = 64 << 20  # the client's own staging buffer: above any embedding an encoder sends
_START_TRIES = 3  # ports are picked free then handed to the master: another process may take one meanwhile


class IntegrityError(ValueError):
    """A stored object that is not what its key promises: bad header, another key, wrong length or digest."""


class StoreUnavailable(RuntimeError):
    """Mooncake Store cannot be used: the module is missing, or the master did not answer the setup."""


class ObjectHeader(msgspec.Struct, array_like=True, frozen=True):
    """What a stored embedding object says of its payload."""

    key: str
    dtype: str  # torch's name without the prefix: "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    sha256: bytes


def pack(key: str, tensor: torch.Tensor) -> bytes:
    """`tensor` (any device; copied to the host) as one store object under `key`."""
    payload = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    header = msgspec.msgpack.encode(ObjectHeader(key, str(tensor.dtype).removeprefix("torch."),
                                                 tuple(tensor.shape), len(payload),
                                                 hashlib.sha256(payload).digest()))
    return b"".join((MAGIC, _LEN.pack(len(header)), header, payload))


def unpack(key: str, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor of object `data` fetched under `key`, on the host; `IntegrityError` if the object is not whole
    and exactly what was put under `key`."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LEN.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise IntegrityError(f"{key}: not an embedding object ({len(view)} bytes)")
    (hlen,) = _LEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LEN.size + hlen
    if hlen > _MAX_HEADER or start > len(view):
        raise IntegrityError(f"{key}: header length {hlen} does not fit the object's {len(view)} bytes")
    try:
        header = msgspec.msgpack.decode(view[len(MAGIC) + _LEN.size:start], type=ObjectHeader)
        dtype = getattr(torch, header.dtype)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(header.dtype)
    except (msgspec.DecodeError, msgspec.ValidationError, AttributeError, TypeError) as exc:
        raise IntegrityError(f"{key}: unreadable header: {exc}") from None
    if header.key != key:
        raise IntegrityError(f"{key}: the object is of another key ({header.key})")
    payload = view[start:]
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in header.shape:
        count *= dim
    if len(payload) != header.nbytes or header.nbytes != count * itemsize:
        raise IntegrityError(f"{key}: {len(payload)} payload bytes, the header says {header.nbytes} of shape "
                             f"{list(header.shape)} {header.dtype}")
    if hashlib.sha256(payload).digest() != header.sha256:
        raise IntegrityError(f"{key}: the payload's sha256 differs from the one it was put with")
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(header.shape) if count else \
        torch.empty(header.shape, dtype=dtype)


def _load() -> Any:
    """The Mooncake store class; `StoreUnavailable` saying why when it does not import."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreUnavailable(f"mooncake.store does not import ({exc}); install the Mooncake wheel "
                               f"(mooncake-transfer-engine)") from None
    return MooncakeDistributedStore


def unavailable_reason() -> str | None:
    """Why Mooncake Store cannot run here (the module or the master binary missing), or None."""
    try:
        _load()
    except StoreUnavailable as exc:
        return str(exc)
    return None if master_binary() else "no mooncake_master binary: neither in the mooncake package nor on PATH"


def master_binary() -> str | None:
    """The ``mooncake_master`` executable: the one inside the installed ``mooncake`` package (found without
    importing it; a ``pip install --target`` leaves no script on PATH), else a script beside this Python or on
    PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "mooncake_master"
        if os.access(binary, os.X_OK):
            return str(binary)
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """A real ``mooncake_master`` process; a context manager (stopped, and waited for, on exit).

    Args:
        host: the address it binds: ``127.0.0.1`` (one host), or a node's address that other hosts reach.
        port: its RPC port; 0 (default): one the OS gives (tried again on another if taken meanwhile).
        log: where its output goes (its glog lines); None: discarded.
        timeout: seconds for it to listen.
        lease_ttl_ms: how long an object read stays leased (not evicted) after a read.

    Its metrics server, on by default on 0.0.0.0:9003 (a fixed port), is bound to `host` on a port of its own.
    `restart` starts it again on the same port (the clients reconnect there)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log: Path | None = None, timeout: float = 10.0,
                 lease_ttl_ms: int = 1000) -> None:
        binary = master_binary()
        if binary is None:
            raise StoreUnavailable("no mooncake_master binary: neither in the mooncake package nor on PATH")
        self.binary, self.host, self.log, self.timeout, self.lease_ttl_ms = binary, host, log, timeout, lease_ttl_ms
        self.proc: subprocess.Popen | None = None
        self.port = port
        for attempt in range(1 if port else _START_TRIES):
            self.port = port or _free_port(host)
            try:
                self._start()
                break
            except StoreUnavailable:
                if port or attempt == _START_TRIES - 1:
                    raise

    @property
    def address(self) -> str:
        """``host:port``, what a client's ``master_server_addr`` is."""
        return f"{self.host}:{self.port}"

    def _start(self) -> None:
        cmd = [self.binary, f"--rpc_port={self.port}", f"--rpc_address={self.host}",
               f"--metrics_port={_free_port(self.host)}", f"--metrics_host={self.host}",
               "--enable_http_metadata_server=false", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
               "--logtostderr"]
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + self.timeout
        while not _listening(self.host, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise StoreUnavailable(f"mooncake_master did not listen on {self.address} within {self.timeout} s")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL it (a crash), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Start it again on the same port (after `kill` or `stop`); its index starts empty."""
        self.stop()
        self._start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        self.stop()


class StoreClient:
    """A Mooncake Store client: this process's segment mounted into the pool, puts and gets bounded in time.

    Args:
        master: the master's ``host:port``.
        timeout: seconds any one call is waited for (and the probe of the master before the setup).
        local_hostname: the address the other clients reach this one's segment at.
        segment_bytes: host memory this client gives to the pool (at least ``MIN_SEGMENT_BYTES``).
        threads: calls that may run at once (gets of a request's items in parallel, puts behind them).

    Raises `StoreUnavailable` when the module is missing, the master's port does not answer within `timeout`, or
    the setup fails."""

    def __init__(self, master: str, timeout: float = 2.0, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = SEGMENT_BYTES, threads: int = 4) -> None:
        cls = _load()
        self.master, self.timeout = master, timeout
        # the setup holds the GIL while it retries an unreachable master (90 s measured): a bounded probe of the
        # master's port first, so that a wrong address or a master not yet up costs at most `timeout`
        host, _, port = master.rpartition(":")
        if not _listening(host, int(port), timeout):
            raise StoreUnavailable(f"Mooncake Store master {master} is not reachable (no answer within {timeout} s)")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="epd-store")
        self._store = cls()
        rc = self._store.setup(local_hostname, "P2PHANDSHAKE", segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master)
        if rc != 0:
            self.close()
            raise StoreUnavailable(f"Mooncake Store setup against master {master} failed (rc {rc})")

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` in this client's threads (a prefetch or a put)."""
        return self._pool.submit(fn, *args)

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._pool.submit(fn, *args).result(self.timeout)

    def exists(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: stored (True), not (False), or unknown (None: the master failed or did not answer in time)."""
        try:
            found = self._call(self._store.batch_is_exist, list(keys))
        except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError):
            return [None] * len(keys)
        return [None if rc < 0 else bool(rc) for rc in found]

    def get_raw(self, key: str) -> bytes:
        """The object's bytes as stored (b"" when absent or the fetch failed); blocking, not bounded: run it in
        `submit` and bound the wait."""
        return self._store.get(key)

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor stored under `key`, checked (`unpack`); None when absent or the fetch failed. Raises
        `IntegrityError` for an object that is not what `key` promises. Blocking (a prefetch thread runs it)."""
        data = self._store.get(key)
        return unpack(key, data) if data else None

    def put(self, key: str, tensor: torch.Tensor) -> int:
        """Store `tensor` under `key` (`pack`); Mooncake's return code (0: stored or already there). Blocking."""
        return self._store.put(key, pack(key, tensor))

    def put_raw(self, key: str, data: bytes, replace: bool = False) -> int:
        """Store `data` as it is under `key` (`replace`: over an object already there); Mooncake's return code."""
        return (self._store.upsert if replace else self._store.put)(key, data)

    def close(self) -> None:
        """Unmount this client's segment and stop its threads. Idempotent."""
        pool = getattr(self, "_pool", None)
        if pool is not None:  # calls running end first (Mooncake bounds them): none uses a closed store
            pool.shutdown(wait=True, cancel_futures=True)
        store, self._store = getattr(self, "_store", None), None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def local_hostname_for(master: str) -> str:
    """The address this host's store segment is reached at: loopback for a master on loopback, else the address
    this host reaches the master from (its interface on that network)."""
    host = master.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(master.rsplit(":", 1)[1])))  # no packet: only the route is chosen
        return s.getsockname()[0]


__all__ = ["IntegrityError", "MAGIC", "MooncakeMaster", "ObjectHeader", "StoreClient", "StoreUnavailable",
           "MIN_SEGMENT_BYTES", "local_hostname_for", "master_binary", "pack", "unavailable_reason", "unpack"]


def main(argv: list[str] | None = None) -> int:
    """``python -m epd_lab.ep.store``: run a master (for encoders on other hosts: ``--host`` an address they
    reach), print ``{"address": "HOST:PORT", "pid": ...}``, serve until Ctrl-C or SIGTERM."""
    import argparse
    import json
    import signal

    ap = argparse.ArgumentParser(prog="python -m epd_lab.ep.store", description=main.__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="its RPC port (0: one the OS gives)")
    ap.add_argument("--log", type=Path, default=None, help="a file for its log lines (default: discarded)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the with block stops the master
    with MooncakeMaster(args.host, args.port, args.log) as master:
        print(json.dumps({"address": master.address, "pid": master.proc.pid}), flush=True)
        try:
            while master.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
