"""`MooncakeTransferEngine`: the real Mooncake transfer engine behind epd_lab's engine API.

Mooncake's Python binding (``mooncake.engine.TransferEngine``, PyPI ``mooncake-transfer-engine``)
returns negative ints and logs the reason; this adapter keeps the method names and semantics of
`epd_lab.transfer.TransferEngine` and raises `epd_lab.transfer.errors` instead:

- `register` / `deregister` misuse → `RegistrationError` (Mooncake: -1 zero length, -7
  ERR_ADDRESS_OVERLAPPED for overlap *and* for a double registration, -3 ERR_ADDRESS_NOT_REGISTERED for
  an unknown pointer).
- A failed write → `TransferError`. Mooncake returns -1 for every transfer failure and gives no reason
  to the caller, so the adapter classifies: `TransferTimeout` when the call ran for the whole transfer
  timeout, `PeerUnreachable` when a probe (``send_probe``) of the peer then fails, else a plain
  `TransferError` (peer up, write refused: most often a destination outside the peer's registrations).
- Sources must lie inside memory registered with this engine (`RegistrationError` otherwise), as in
  ours: Mooncake's tcp transport itself sends from any address (measured: an unregistered source
  writes fine, rc 0).
- `allocate_managed_buffer` returns page-aligned anonymous memory that is *not* registered, as ours.
  Mooncake's own ``allocate_managed_buffer`` registers the buffer itself, so registering a part of it
  would fail with -7; the adapter therefore does not use it.

Measured here (mooncake-transfer-engine-non-cuda 0.3.13.post1, ``initialize("127.0.0.1",
"P2PHANDSHAKE", "tcp", "")``, two processes on loopback, 2 vCPUs; times are wall-clock seconds around
one Python call):

(a) A write outside the peer's registered memory (90 bytes past the end of a 1 MiB region, at
    0x1000, at base + 16 MiB; also one bad entry in a batch of two) returns -1 within 0.000-0.005 s.
    The peer refuses it ("remote-supplied address ... is not within any registered buffer"), logs it
    and stays up; a valid write right after one refusal succeeds in 0.000 s. After four consecutive
    failed writes to one peer Mooncake backs off from it for about a second: the next valid write
    returned -1 at once (0.000 s, nothing logged) in 5 of 6 runs and succeeded after 1.000 s in the
    sixth; the write after that succeeded after 1.000-1.002 s (2 runs measured); a valid write 0.5 s
    after the fourth failure succeeded after 0.504 s.
(b) A dead peer (SIGKILL after a successful write): -1 after 0.000-0.005 s, twice in a row; a third
    call (a batch) -1 after 1.000-1.075 s (Connection refused, the back-off above). A never-existing
    peer (127.0.0.1:1): -1 after 0.000 s. ``send_probe`` of a dead peer returns -102 (ERR_SOCKET) in
    0.000 s, of a live one 0 in 0.000 s.
(c) A frozen peer (SIGSTOP after a successful write), with a connection already open: -1 after
    30.000 s with the default timeout (4 KiB and 1 MiB writes alike, 30.001 s for 1 MiB); -1 after
    5.000 s / 5.001 s with ``MC_TRANSFER_TIMEOUT=5`` (Mooncake's floor: smaller values are raised to
    5). The waiting call busy-polls: one CPU core at ~100 % for the whole wait. A fresh engine whose
    first contact with the frozen peer is the handshake: -1 after 60.200 s with
    ``MC_TRANSFER_TIMEOUT=5``, and after 61.851 s with ``MC_HANDSHAKE_CONNECT_TIMEOUT=3`` added (the
    handshake's read is bounded by neither).
    See `MooncakeTransferEngine` for ``timeout``.

Writes with a zero length or an empty batch return 0 in Mooncake; the adapter refuses them with
`ValueError`, as ours does. Dropping a Mooncake engine (`close`) took 0.013-1.02 s, usually ~1.0 s;
its port is closed afterwards.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import threading
import time
from typing import Any, Sequence

from epd_lab import security
from epd_lab.transfer.buffers import buffer_info
from epd_lab.transfer.counters import WriteCounters
from epd_lab.transfer.errors import (
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from epd_lab.transfer.registration import Registration

PROTOCOLS = ("auto", "tcp", "rdma")
_DEFAULT_TIMEOUT_S = 30  # Mooncake's transfer timeout when MC_TRANSFER_TIMEOUT is unset
_MIN_TIMEOUT_S = 5  # Mooncake raises smaller MC_TRANSFER_TIMEOUT values to this
_CODES = {-1: "invalid argument", -3: "address not registered", -7: "address overlapped"}


@functools.cache
def _load() -> tuple[Any, str | None]:
    """Import Mooncake once: ``(engine class, None)`` or ``(None, why not)``."""
    # Mooncake logs INFO/WARNING lines on every engine start; keep errors only unless asked otherwise.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "mooncake":
            return None, ("the Mooncake package is not installed "
                          "(pip install 'epd-lab[mooncake]', i.e. mooncake-transfer-engine-non-cuda)")
        return None, f"mooncake.engine does not import: {exc}"
    except ImportError as exc:
        # engine.so links libibverbs.so.1 and libnuma.so.1 even for tcp: a loader error names them
        if "libibverbs" in str(exc):
            return None, f"mooncake.engine needs libibverbs (apt-get install libibverbs1): {exc}"
        return None, f"mooncake.engine does not import: {exc}"
    return TransferEngine, None


def available() -> bool:
    """True when the Mooncake engine imports here."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the Mooncake engine cannot be used here, or None when it can."""
    return _load()[1]


def _effective_timeout(timeout: int | None) -> int:
    """The transfer timeout Mooncake will apply, read as it reads it (atoi, floor of 5 s)."""
    if timeout is not None:
        return timeout
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return _DEFAULT_TIMEOUT_S
    try:
        return max(_MIN_TIMEOUT_S, int(raw))
    except ValueError:
        return _MIN_TIMEOUT_S


class MooncakeTransferEngine:
    """Mooncake's transfer engine with the API of `epd_lab.transfer.TransferEngine`.

    Args:
        hostname: address the engine listens on and publishes in `session_id`.
        protocol: ``"auto"`` (= ``"tcp"``), ``"tcp"``, or ``"rdma"`` (needs an RDMA device; none here).
        timeout: whole seconds, at least 5, a transfer may take before it fails (Mooncake adds 1 s per
            GiB); None keeps Mooncake's own (``MC_TRANSFER_TIMEOUT``, else 30 s). It does not bound the
            handshake with a peer that has never been contacted (60 s measured against a frozen peer).

    Raises:
        TransportUnavailable: Mooncake does not import here, or its ``initialize`` failed.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "auto", *,
                 timeout: int | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
        if timeout is not None and (int(timeout) != timeout or timeout < _MIN_TIMEOUT_S):
            raise ValueError(f"timeout must be a whole number of seconds >= {_MIN_TIMEOUT_S} "
                             f"(Mooncake's floor), got {timeout}")
        cls, reason = _load()
        if cls is None:
            raise TransportUnavailable(f"Mooncake is unavailable: {reason}")
        self.hostname = hostname
        self.protocol = "tcp" if protocol == "auto" else protocol
        self.timeout = _effective_timeout(None if timeout is None else int(timeout))
        self._engine = self._create(cls, timeout)
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            self._engine = None
            raise TransportUnavailable(f"Mooncake initialize({hostname!r}, {self.protocol!r}) returned {rc}")
        self._port = self._engine.get_rpc_port()
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}  # ptr -> length, what this engine registered
        self._managed: dict[int, tuple[mmap.mmap, ctypes.Array]] = {}  # ptr -> (mapping, its export)
        self._out = WriteCounters()

    @staticmethod
    def _create(cls: Any, timeout: int | None) -> Any:
        # Mooncake reads MC_TRANSFER_TIMEOUT once, in the engine's constructor: set it just for that.
        if timeout is None:
            return cls()
        saved = os.environ.get("MC_TRANSFER_TIMEOUT")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(int(timeout))
        try:
            return cls()
        finally:
            if saved is None:
                del os.environ["MC_TRANSFER_TIMEOUT"]
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = saved

    # ---- identity ----
    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._engine is None

    @property
    def session_id(self) -> str:
        """``"host:rpc_port"``: what peers pass to write into this engine's memory."""
        return f"{self.hostname}:{self._port}"

    def get_rpc_port(self) -> int:
        """The port Mooncake's RPC/handshake server listens on."""
        return self._port

    def _live(self) -> Any:
        if self._engine is None:
            raise ValueError("the engine is closed")
        return self._engine

    # ---- registration ----
    def register(self, ptr: int, length: int) -> int:
        """Register ``[ptr, ptr+length)`` so peers may write into it and this engine may write from it.

        Returns 0: Mooncake's API has no per-registration key, so writes into it are checked for
        bounds only (a late write can land in a later registration at the same address). Raises
        `RegistrationError` on a non-positive length, overlap or double registration.
        """
        engine = self._live()
        if length <= 0:
            raise RegistrationError(f"cannot register {length} bytes at 0x{ptr:x}: length must be positive")
        rc = engine.register_memory(ptr, length)
        if rc != 0:
            raise RegistrationError(f"Mooncake register_memory(0x{ptr:x}, {length}) returned {rc} "
                                    f"({_CODES.get(rc, 'error')})")
        with self._lock:
            self._regions[ptr] = length
        return 0

    def deregister(self, ptr: int) -> None:
        """Deregister the region that starts at `ptr`; raises `RegistrationError` on an unknown pointer."""
        engine = self._live()
        rc = engine.unregister_memory(ptr)
        if rc != 0:
            raise RegistrationError(f"Mooncake unregister_memory(0x{ptr:x}) returned {rc} "
                                    f"({_CODES.get(rc, 'error')})")
        with self._lock:
            self._regions.pop(ptr, None)

    def registrations(self) -> list[tuple[int, int, str]]:
        """The regions this engine registered: ``(address, length, "managed" | "external")``."""
        with self._lock:
            return [(p, n, "managed" if self._in_managed(p, n) else "external")
                    for p, n in sorted(self._regions.items())]

    def _in_managed(self, ptr: int, length: int) -> bool:
        return any(b <= ptr and ptr + length <= b + len(m) for b, (m, _) in self._managed.items())

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate `length` page-aligned bytes owned by this engine. Not registered: register the parts
        you hand out, and deregister them after use (as with `TransferEngine`)."""
        self._live()
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        mapping = mmap.mmap(-1, length)
        export = (ctypes.c_char * length).from_buffer(mapping)  # pins the mapping while handed out
        ptr = ctypes.addressof(export)
        with self._lock:
            self._managed[ptr] = (mapping, export)
        return ptr

    def free_managed_buffer(self, ptr: int) -> None:
        """Free a managed buffer; fails while a region inside it is still registered."""
        self._live()
        with self._lock:
            if ptr not in self._managed:
                raise RegistrationError(f"0x{ptr:x} is not a managed buffer of this engine")
            size = len(self._managed[ptr][0])
            inside = [p for p, n in self._regions.items() if ptr <= p < ptr + size]
            if inside:
                raise RegistrationError(f"managed buffer 0x{ptr:x} still has {len(inside)} registered "
                                        f"region(s) (first at 0x{inside[0]:x}); deregister them first")
            mapping, export = self._managed.pop(ptr)
        del export  # the export must go before the mapping can close
        mapping.close()

    # ---- writes ----
    def register_buffer(self, obj: Any) -> Registration:
        """Register a contiguous torch tensor, numpy array or buffer; returns ``(ptr, nbytes, 0)``."""
        ptr, nbytes = buffer_info(obj)
        return Registration(ptr, nbytes, self.register(ptr, nbytes))

    def deregister_buffer(self, obj: Any) -> None:
        """Deregister what `register_buffer` registered."""
        self.deregister(buffer_info(obj)[0])

    def path_to(self, session_id: str) -> str:
        """Always ``"mooncake"``: Mooncake's own transport (tcp here) carries every write."""
        return "mooncake"

    def transfer_sync_write(self, session_id: str, src_ptr: int, dst_ptr: int, length: int, rkey: int = 0) -> None:
        """Write `length` bytes from local registered memory at `src_ptr` to the peer's `dst_ptr`;
        returns once Mooncake reports the write complete. `rkey` must be 0 (see `register`)."""
        self.batch_transfer_sync_write(session_id, (src_ptr,), (dst_ptr,), (length,), (rkey,) if rkey else None)

    def batch_transfer_sync_write(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                                  lengths: Sequence[int], rkeys: Sequence[int] | None = None) -> None:
        """Write several blocks in one Mooncake batch; the batch fails as a whole."""
        if rkeys is not None and any(rkeys):
            raise TransportUnavailable("Mooncake's API carries no per-registration key; pass rkey=0")
        engine = self._live()
        srcs, dsts, lengths = list(srcs), list(dsts), list(lengths)
        n = len(srcs)
        if n == 0 or len(dsts) != n or len(lengths) != n:
            raise ValueError(f"need equal, non-empty lists of sources, destinations and lengths "
                             f"(got {len(srcs)}, {len(dsts)}, {len(lengths)})")
        for i, (src, length) in enumerate(zip(srcs, lengths)):
            if length <= 0:
                raise ValueError(f"length {length} of write {i}: must be positive")
            if not self._covers(src, length):
                raise RegistrationError(f"source 0x{src:x} ({length} bytes) of write {i} is not inside "
                                        f"memory registered with this engine; register() it first")
        start = time.monotonic()
        if n == 1:
            rc = engine.transfer_sync_write(session_id, srcs[0], dsts[0], lengths[0])
        else:
            rc = engine.batch_transfer_sync_write(session_id, srcs, dsts, lengths)
        if rc != 0:
            self._out.count(failed=True)
            raise self._failure(engine, session_id, rc, time.monotonic() - start, n, sum(lengths))
        self._out.count(n, sum(lengths))

    def _covers(self, ptr: int, length: int) -> bool:
        with self._lock:
            return any(p <= ptr and ptr + length <= p + n for p, n in self._regions.items())

    def _failure(self, engine: Any, session_id: str, rc: int, elapsed: float, n: int,
                 nbytes: int) -> TransferError:
        """Name a Mooncake failure (it returns -1 for all of them) from what can be observed."""
        what = (f"Mooncake write of {n} block(s), {nbytes} bytes, to {session_id} returned {rc} "
                f"after {elapsed:.3f} s")
        if elapsed >= self.timeout:
            return TransferTimeout(f"{what}: no completion within the {self.timeout} s transfer timeout "
                                   f"(peer frozen or overloaded)")
        # a dead or unknown peer refuses the probe at once (-102 measured); a live one answers 0
        probe = engine.send_probe(session_id)
        if probe != 0:
            return PeerUnreachable(f"{what}; probing the peer returned {probe}: it is dead or unreachable")
        return TransferError(f"{what}; the peer is up and refused or failed the write (most often: a "
                             f"destination outside its registered memory; Mooncake's log says which)")

    # ---- counters and lifetime ----
    def stats(self) -> dict[str, int]:
        """Counters: ``regions``, ``registered_bytes``, ``managed_buffers``, ``managed_bytes`` and, as a
        writer, ``writes_out``, ``bytes_out``, ``failures_out``. Mooncake does not count incoming writes,
        so the ``*_in`` and ``writes_refused`` counters of `TransferEngine` are absent."""
        with self._lock:
            return {
                "regions": len(self._regions),
                "registered_bytes": sum(self._regions.values()),
                "managed_buffers": len(self._managed),
                "managed_bytes": sum(len(m) for m, _ in self._managed.values()),
                **self._out.snapshot(),
            }

    def close(self) -> None:
        """Deregister what is still registered, free managed buffers and stop Mooncake's server (its
        port closes). Idempotent. Raises `RegistrationError` after the teardown if a deregistration
        failed."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        failed = [(p, rc) for p in list(self._regions) if (rc := engine.unregister_memory(p)) != 0]
        self._regions.clear()
        managed, self._managed = self._managed, {}
        while managed:
            mapping, export = managed.popitem()[1]
            del export  # the export must go before the mapping can close
            mapping.close()
        del engine  # the last reference: Mooncake's destructor stops its threads and closes the port
        if failed:
            raise RegistrationError("Mooncake unregister_memory failed at close: "
                                    + ", ".join(f"0x{p:x} -> {rc}" for p, rc in failed))

    def __enter__(self) -> "MooncakeTransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # a re-run notebook cell must not leave the old engine's server and registrations behind
        if getattr(self, "_engine", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.session_id
        return f"MooncakeTransferEngine({state}, protocol={self.protocol!r})"


def open_mooncake(hostname: str = "127.0.0.1", protocol: str = "mooncake", *,
                  timeout: float = 5.0) -> MooncakeTransferEngine:
    """`open_engine`'s way in (transport ``mooncake`` in `epd_lab.transfer.registry`).

    Args:
        hostname: as for `MooncakeTransferEngine`.
        protocol: ``"mooncake"`` (the registry's name: Mooncake's ``auto``) or one of `PROTOCOLS`.
        timeout: seconds, as every role passes it; rounded up to whole seconds and to Mooncake's
            floor of 5, since Mooncake takes no less.

    Raises:
        TransportUnavailable: a shared secret is set (``EPD_SECRET``): Mooncake's port has no handshake, so
            it would take writes from anyone who reaches it.
    """
    if security.load_secret() is not None:
        raise TransportUnavailable("the Mooncake engine cannot check the shared secret (EPD_SECRET is set): its "
                                   "port would accept writes from anyone; use transport 'auto', 'shm' or 'tcp'")
    return MooncakeTransferEngine(hostname, "auto" if protocol == "mooncake" else protocol,
                                  timeout=max(_MIN_TIMEOUT_S, math.ceil(timeout)))
