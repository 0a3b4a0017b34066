"""`TransferEngine`: one-sided writes into memory a peer registered beforehand (the Mooncake model).

The API follows Mooncake's Python binding as the seeds use it (`session_id`, `register`, `deregister`,
`transfer_sync_write`, `batch_transfer_sync_write`, `batch_transfer_async_write`,
`get_batch_transfer_status`, `allocate_managed_buffer`), with one deliberate difference: failures raise
(see `epd_lab.transfer.errors`) instead of returning negative codes that callers forget to check.

Every engine is also a memory owner: it listens on `session_id` and places incoming writes into its
registered memory after checking them against its registration table. Paths to a peer:

- ``shm``: same host. Writes into the peer's managed buffers are one copy into a shared mapping
  (memcpy, or streaming stores for large writes, as `epd_lab.transfer.shm_copy` chose for this
  machine); writes into memory the peer registered from elsewhere go through ``process_vm_writev``.
  Both check the registration table the peer publishes (and pin the region so a deregister waits
  for them).
- ``tcp``: any host. Header + bytes; the peer's server thread receives straight into the destination.
- ``verbs``: RDMA WRITE over an RC QP (see `epd_lab.transfer.verbs`); needs an RDMA device.
- ``cuda``: GPU memory (`epd_lab.transfer.cuda`): device-to-device copies into a same-host peer's GPU
  memory through CUDA IPC, checked against the same published table as shm. ``auto`` takes it for GPU
  memory on the same host; GPU sources to host memory or to another host are staged through pinned memory.

"Same host" is what the kernel says (the peer's registration table opens through ``/proc``), unless both
engines name their host in ``EPD_HOST_ID`` (`ENV_HOST_ID`; the Ray launcher sets it to the Ray node id): then
two different names mean two hosts, and ``auto`` takes tcp even where one kernel runs both, as emulated
hosts on one machine do. ``shm`` and ``cuda`` are refused there with that reason.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from epd_lab import _native, security
from epd_lab.transfer import cuda, shm_copy
from epd_lab.transfer.buffers import buffer_info
from epd_lab.transfer.counters import WriteCounters
from epd_lab.transfer.errors import AuthenticationError, PeerUnreachable, TransferError, TransportUnavailable
from epd_lab.transfer.registration import Registration

PROTOCOLS = ("auto", "tcp", "shm", "verbs", "cuda")
ENV_HOST_ID = "EPD_HOST_ID"
HOST_CONTROL = b"HOST/id"  # a control request: the peer answers its host id (empty: not named)
MAX_CONNECTIONS = 256  # served at once by an engine's port (one thread each)
IDLE_TIMEOUT = 30.0  # seconds a connection may idle between requests

log = logging.getLogger(__name__)


class TransferStatus(Enum):
    """State of an asynchronous batch (`get_batch_transfer_status`)."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


def strided_pieces(srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int], counts: Sequence[int],
                   src_strides: Sequence[int], dst_strides: Sequence[int], rkeys: Sequence[int] | None = None,
                   ) -> tuple[list[int], list[int], list[int], list[int] | None]:
    """Strided entries (see `TransferEngine.batch_transfer_sync_write_strided`) as one (src, dst, length[, key])
    per piece: what a path without strided writes takes."""
    out: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for i, count in enumerate(counts):
        for k in range(count):
            out[0].append(srcs[i] + k * src_strides[i])
            out[1].append(dsts[i] + k * dst_strides[i])
            out[2].append(lengths[i])
            out[3].append(rkeys[i] if rkeys else 0)
    return out[0], out[1], out[2], out[3] if rkeys else None


def parse_session_id(session_id: str) -> tuple[str, int]:
    """Split ``"host:port"`` (IPv6 as ``"[::1]:port"``) and check it."""
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"session_id {session_id!r} is not 'host:port'")
    return host.strip("[]"), int(port)


@dataclass
class _Peer:
    """What this engine holds for one remote session: the path and its connections."""

    session_id: str
    path: str
    host: str
    port: int
    timeout_ms: int
    secret: bytes = b""  # the shared-secret handshake's, run on every new connection
    shm: Any = None  # _native.ShmPeer
    verbs: Any = None  # verbs.VerbsPeer
    hello: Any = None  # (pid, table_fd, nonce) of a same-host peer
    idle: list = field(default_factory=list)  # idle _native.TcpConn
    lock: threading.Lock = field(default_factory=threading.Lock)

    def conn(self) -> "_native.TcpConn":
        """An idle connection the peer has not closed (its idle timeout closes pooled ones), else a new one."""
        while True:
            with self.lock:
                conn = self.idle.pop() if self.idle else None
            if conn is None:
                return self.connect()
            if conn.alive:
                return conn
            conn.close()

    def connect(self) -> "_native.TcpConn":
        return _native.TcpConn(self.host, self.port, self.timeout_ms, self.secret)

    def control(self, request: bytes) -> bytes:
        """A control request to the peer's engine (the verbs QP exchange and rkey lookups)."""
        conn = self.conn()
        try:
            return conn.control(request)
        finally:
            self.give_back(conn)

    def give_back(self, conn: "_native.TcpConn") -> None:
        if conn.broken:
            conn.close()
            return
        with self.lock:
            self.idle.append(conn)

    def close(self) -> None:
        with self.lock:
            conns, self.idle = self.idle, []
        for c in conns:
            c.close()
        for obj in (self.shm, self.verbs):
            if obj is not None:
                obj.close()


class TransferEngine:
    """A transfer engine on this host; see the module docstring.

    Args:
        hostname: address to listen on and to publish in `session_id` (loopback by default).
        protocol: ``"auto"`` (verbs where an RDMA device exists, else shm for a same-host peer, else tcp;
            cuda for GPU memory of a same-host peer), or force ``"tcp"``, ``"shm"``, ``"verbs"`` or
            ``"cuda"`` (shm for host memory, cuda for GPU memory; needs a GPU and a same-host peer).
        port: 0 lets the OS choose.
        timeout: seconds a peer may make no progress before a transfer fails (idle timeout), also the
            bound on connecting and on a deregister waiting for writes in flight.
        async_workers: threads for `batch_transfer_async_write`.
        max_connections: connections this engine's port serves at once, one thread each; more are closed at
            once and counted (``conns_refused``). 0: no cap.
        idle_timeout: seconds a connection may send no request before it is closed and counted
            (``conns_idle_closed``); a writer whose pooled connection was closed reconnects by itself. 0: never.
        secret: the shared secret of the port's handshake (`epd_lab.security`); None takes ``EPD_SECRET`` /
            ``EPD_SECRET_FILE`` from the environment, as every role does. With a secret, a peer must prove it
            before any request (failures: ``auth_failures``), and this engine proves it to the peers it writes to.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "auto", *, port: int = 0,
                 timeout: float = 5.0, async_workers: int = 4, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout: float = IDLE_TIMEOUT, secret: bytes | str | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)} "
                             f"(open_engine('mooncake') gives the real Mooncake engine behind the same API)")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if max_connections < 0 or idle_timeout < 0:
            raise ValueError(f"max_connections and idle_timeout must not be negative, got {max_connections}, "
                             f"{idle_timeout}")
        self.hostname = hostname
        self.protocol = protocol
        self.timeout = timeout
        self.host_id = os.environ.get(ENV_HOST_ID, "")
        self.max_connections, self.idle_timeout = max_connections, idle_timeout
        self._secret = security.resolve(secret) or b""
        if protocol == "cuda":
            from epd_lab.transfer import cuda_runtime

            reason = cuda_runtime.unavailable_reason()
            if reason is not None:
                raise TransportUnavailable(f"protocol='cuda': {reason}; use 'auto', 'shm' or 'tcp' for host memory")
        self._verbs = self._open_verbs(protocol)
        if protocol in ("auto", "shm", "cuda"):
            # now, not at the first shm peer: a calibration (1.7 s on a 2-vCPU AMD EPYC) inside a request's first
            # write made that request miss a 2 s side-channel timeout
            shm_copy.ensure()
        self._owner = _native.Owner(hostname, port, max(1, int(timeout * 1000)), max_connections,
                                    int(math.ceil(idle_timeout * 1000)), self._secret)
        self._owner.control_handler = self._on_control
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._auth_logged: set[str] = set()  # peers whose refusal was logged
        self._pool = ThreadPoolExecutor(max_workers=async_workers, thread_name_prefix="epd-transfer")
        self._batches: dict[int, Future] = {}
        self._batch_ids = itertools.count(1)
        self._out = WriteCounters()
        self._cuda: cuda.CudaTransport | None = None  # made when GPU memory is first involved

    @staticmethod
    def _open_verbs(protocol: str):
        if protocol not in ("verbs", "auto"):
            return None
        from epd_lab.transfer import verbs

        if protocol == "auto" and verbs.unavailable_reason() is not None:
            return None
        return verbs.VerbsTransport()  # raises TransportUnavailable with the reason and the alternatives

    # ---- identity ----
    @property
    def session_id(self) -> str:
        """``"host:rpc_port"``: what peers pass to write into this engine's memory."""
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{host}:{self._owner.port}"

    def get_rpc_port(self) -> int:
        """The port this engine listens on (Mooncake's name)."""
        return self._owner.port

    # ---- registration (owner side) ----
    def register(self, ptr: int, length: int) -> int:
        """Register ``[ptr, ptr+length)`` so peers may write into it (and this engine may write from it).

        Returns the registration's key, unique for this engine's lifetime (the rkey's role): a writer
        that passes it (`rkey=`) can only land in this registration, never in a later one that reuses
        the address after a deregister. Raises `RegistrationError` on zero length, overlap or double
        registration.
        """
        device = cuda.device_of(ptr)  # None for host memory, and in any process without CUDA
        key = self._owner.register(ptr, length)
        if device is not None:
            try:
                self._cuda_transport().export(ptr, length, device, key)
            except BaseException:
                self._owner.deregister(ptr)
                raise
        elif self._verbs is not None:
            try:
                self._verbs.register(ptr, length)
            except BaseException:
                self._owner.deregister(ptr)
                raise
        return key

    def deregister(self, ptr: int) -> None:
        """Deregister the region starting at `ptr`. When it returns, no write can land there any more
        (it waits, up to the timeout, for writes already in flight). Raises on an unknown pointer."""
        gpu = self._cuda is not None and self._cuda.owns(ptr)
        if self._verbs is not None and not gpu:
            self._verbs.deregister(ptr)
        self._owner.deregister(ptr)
        if gpu:
            self._cuda.unexport(ptr)

    def registrations(self) -> list[tuple[int, int, str]]:
        """The registration table: ``(address, length, "managed" | "external")`` per region."""
        return self._owner.regions()

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate `length` bytes that same-host peers map directly (memcpy speed). Not registered:
        register the parts you hand out, and deregister them after use."""
        return self._owner.allocate_managed(length)

    def free_managed_buffer(self, ptr: int) -> None:
        """Free a managed buffer; fails while a region inside it is still registered."""
        self._owner.free_managed(ptr)

    # ---- writes (writer side) ----
    def transfer_sync_write(self, session_id: str, src_ptr: int, dst_ptr: int, length: int, rkey: int = 0) -> None:
        """Write `length` bytes from local registered memory at `src_ptr` to the peer's `dst_ptr`.
        Returns once the bytes are in place in the peer's memory. With `rkey` (the key the peer's
        `register` returned) the write lands only in that registration."""
        self.batch_transfer_sync_write(session_id, (src_ptr,), (dst_ptr,), (length,), (rkey,) if rkey else None)

    def batch_transfer_sync_write(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                                  lengths: Sequence[int], rkeys: Sequence[int] | None = None) -> None:
        """Write several blocks in one call (`rkeys`: one key per block, 0 for bounds only). The batch
        fails as a whole on the first refused or failed block; which of the other blocks landed is
        then unspecified."""
        peer = self._peer(session_id)

        def write() -> int:
            if self._cuda is not None or cuda.gpu_memory_possible():
                n = self._cuda_transport().write(
                    peer.session_id, peer.hello if peer.path == "shm" else None, peer.control, srcs, dsts, lengths,
                    rkeys, lambda staged: self._host_write(peer, staged, dsts, lengths, rkeys))
                if n is not None:
                    return n
            return self._host_write(peer, srcs, dsts, lengths, rkeys)
        self._counted(session_id, peer, len(lengths), write)

    def batch_transfer_sync_write_strided(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                                          lengths: Sequence[int], counts: Sequence[int], src_strides: Sequence[int],
                                          dst_strides: Sequence[int], rkeys: Sequence[int] | None = None) -> None:
        """Strided writes in one call: entry i is `counts[i]` pieces of `lengths[i]` bytes, piece k from
        ``srcs[i] + k * src_strides[i]`` to ``dsts[i] + k * dst_strides[i]`` (strides at least a piece). The peer
        checks each entry's whole destination extent as one write. A head slice of every token of a run of KV
        blocks is one entry. Over shm and tcp the pieces go in native code (a system call or a memcpy per piece
        batch, not a Python entry each); over other paths (verbs, GPU memory) they go as one batch of pieces.
        Fails as a whole as `batch_transfer_sync_write`."""
        peer = self._peer(session_id)
        if peer.path not in ("shm", "tcp") or self._cuda is not None or cuda.gpu_memory_possible():
            self.batch_transfer_sync_write(session_id, *strided_pieces(srcs, dsts, lengths, counts, src_strides,
                                                                       dst_strides, rkeys))
            return
        if peer.path == "shm":
            self._counted(session_id, peer, len(lengths), lambda: peer.shm.write_strided(
                self._owner, srcs, dsts, lengths, counts, src_strides, dst_strides, rkeys))
        else:
            self._counted(session_id, peer, len(lengths), lambda: self._tcp_write(peer, lambda conn: conn.write_strided(
                self._owner, srcs, dsts, lengths, counts, src_strides, dst_strides, rkeys)))

    def _counted(self, session_id: str, peer: _Peer, entries: int, write: Callable[[], int]) -> None:
        """Run `write` (it returns the bytes written) and count it, or its failure, in the writer's counters; a peer
        found unreachable is dropped (its next write reconnects)."""
        try:
            n = write()
        except PeerUnreachable:
            self._drop_peer(session_id)
            self._out.count(failed=True)
            raise
        except AuthenticationError as exc:
            self._log_auth_failure(session_id, exc)
            self._out.count(failed=True)
            raise
        except (TransferError, ValueError):
            self._out.count(failed=True)
            raise
        self._out.count(entries, n, path=peer.path)

    def _host_write(self, peer: _Peer, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                    rkeys: Sequence[int] | None) -> int:
        if peer.path == "shm":
            return peer.shm.write(self._owner, srcs, dsts, lengths, rkeys)
        if peer.path == "verbs":
            peer.verbs.write_batch(srcs, dsts, lengths, self.timeout)  # the NIC checks its own rkeys
            return sum(lengths)
        return self._tcp_write(peer, lambda conn: conn.write(self._owner, srcs, dsts, lengths, rkeys))

    def _cuda_transport(self) -> "cuda.CudaTransport":
        if self._cuda is None:
            with self._lock:
                if self._cuda is None:
                    self._cuda = cuda.CudaTransport(self._owner.covers, self._owner.register, self._owner.deregister)
        return self._cuda

    def _tcp_write(self, peer: _Peer, write: Callable[["_native.TcpConn"], int]) -> int:
        """`write` on a pooled connection to `peer`; returns its bytes."""
        conn = peer.conn()
        try:
            return write(conn)
        except PeerUnreachable:
            # The peer may have closed this pooled connection for idleness just as the write went out (the
            # `alive` check in `conn` catches all but that instant). Nothing was placed on a closed
            # connection, and writing the same bytes again is harmless: once more on a new connection.
            conn.close()
            conn = peer.connect()
            return write(conn)
        finally:
            peer.give_back(conn)

    def batch_transfer_async_write(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                                   lengths: Sequence[int], rkeys: Sequence[int] | None = None) -> int:
        """Submit a batch; returns a batch id for `get_batch_transfer_status` / `wait_batch`."""
        srcs, dsts, lengths = list(srcs), list(dsts), list(lengths)
        rkeys = list(rkeys) if rkeys is not None else None
        fut = self._pool.submit(self.batch_transfer_sync_write, session_id, srcs, dsts, lengths, rkeys)
        batch_id = next(self._batch_ids)
        self._batches[batch_id] = fut
        return batch_id

    def get_batch_transfer_status(self, batch_id: int) -> TransferStatus:
        """PENDING, COMPLETED or FAILED (`wait_batch` gives the error)."""
        fut = self._batch(batch_id)
        if not fut.done():
            return TransferStatus.PENDING
        return TransferStatus.FAILED if fut.exception() is not None else TransferStatus.COMPLETED

    def wait_batch(self, batch_id: int, timeout: float | None = None) -> None:
        """Wait for a batch, forget it, and raise its error if it failed."""
        fut = self._batch(batch_id)
        try:
            fut.result(timeout)  # raises the transfer's error, or TimeoutError while still pending
        finally:
            if fut.done():
                self._batches.pop(batch_id, None)

    def _batch(self, batch_id: int) -> Future:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise ValueError(f"unknown batch id {batch_id}") from None

    # ---- tensors and arrays ----
    def register_buffer(self, obj: Any) -> Registration:
        """Register a contiguous torch tensor, numpy array or buffer; returns ``(ptr, nbytes, key)``."""
        ptr, nbytes = buffer_info(obj)
        return Registration(ptr, nbytes, self.register(ptr, nbytes))

    def deregister_buffer(self, obj: Any) -> None:
        """Deregister what `register_buffer` registered."""
        self.deregister(buffer_info(obj)[0])

    def write_buffer(self, session_id: str, src: Any, dst_ptr: int, rkey: int = 0) -> int:
        """Write a whole registered tensor/array to the peer's `dst_ptr`; returns the bytes written."""
        ptr, nbytes = buffer_info(src)
        self.transfer_sync_write(session_id, ptr, dst_ptr, nbytes, rkey)
        return nbytes

    # ---- peers ----
    def path_to(self, session_id: str) -> str:
        """The path writes to this session take: ``"shm"``, ``"tcp"`` or ``"verbs"``."""
        return self._peer(session_id).path

    def _peer(self, session_id: str) -> _Peer:
        peer = self._peers.get(session_id)
        if peer is not None:
            return peer
        if self._owner.closed:
            raise ValueError("the engine is closed")
        host, port = parse_session_id(session_id)
        peer = _Peer(session_id, "tcp", host, port, self._owner.timeout_ms, self._secret)
        try:
            conn = peer.conn()  # raises PeerUnreachable / TransferTimeout / AuthenticationError
        except AuthenticationError as exc:
            self._log_auth_failure(session_id, exc)
            raise
        try:
            self._choose_path(peer, conn)
        except BaseException as exc:
            conn.close()
            peer.close()
            if isinstance(exc, AuthenticationError):
                self._log_auth_failure(session_id, exc)
            raise
        peer.give_back(conn)
        with self._lock:
            kept = self._peers.setdefault(session_id, peer)
        if kept is not peer:  # another thread connected first
            peer.close()
        return kept

    def _choose_path(self, peer: _Peer, conn: "_native.TcpConn") -> None:
        if self._verbs is not None:
            peer.verbs = self._verbs.connect(peer.control)
            peer.path = "verbs"
            return
        if self.protocol not in ("shm", "auto", "cuda"):
            return
        if self.host_id:  # asked only when named: the local launcher's engines pay no extra round trip
            theirs = conn.control(HOST_CONTROL).decode(errors="replace")
            if theirs and theirs != self.host_id:
                if self.protocol != "auto":
                    raise TransportUnavailable(
                        f"protocol={self.protocol!r} needs the peer {peer.session_id} on this host, but it is on "
                        f"host {theirs!r} and this engine on {self.host_id!r} ({ENV_HOST_ID}); use 'tcp' or 'auto'")
                return
        pid, table_fd, nonce = conn.hello()
        try:
            peer.shm = _native.ShmPeer(pid, table_fd, nonce, self._owner.timeout_ms)
        except PeerUnreachable as exc:
            if self.protocol in ("shm", "cuda"):
                raise TransportUnavailable(
                    f"protocol={self.protocol!r} needs the peer {peer.session_id} on this host: {exc}; "
                    f"use protocol='tcp' (any host) or 'auto'") from exc
            return
        peer.path, peer.hello = "shm", (pid, table_fd, nonce)

    def _log_auth_failure(self, session_id: str, exc: AuthenticationError) -> None:
        """One log line per peer that refused this engine's secret (or lack of one); the error names no secret."""
        with self._lock:
            first = session_id not in self._auth_logged
            self._auth_logged.add(session_id)
        if first:
            log.error("transfer to %s failed authentication: %s", session_id, exc)

    def _drop_peer(self, session_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(session_id, None)
        if peer is not None:
            peer.close()
        if self._cuda is not None:
            self._cuda.detach(session_id)

    def _on_control(self, request: bytes) -> bytes:
        if request == HOST_CONTROL:
            return self.host_id.encode()
        if request.startswith(cuda.CONTROL_PREFIX):  # an engine without GPU memory exports nothing
            return self._cuda.handle_control(request) if self._cuda is not None else b"[]"
        if self._verbs is None:
            raise TransportUnavailable("this engine has no verbs transport")
        return self._verbs.handle_control(request)

    # ---- counters and lifetime ----
    def stats(self) -> dict[str, int]:
        """Counters: ``regions``, ``registered_bytes``, ``writes_in``, ``bytes_in`` (written into this
        engine by peers), ``writes_refused`` (incoming writes refused by the registration check),
        ``writes_in_flight`` (incoming writes placing bytes right now),
        ``managed_buffers``, ``managed_bytes``, ``deregister_timeouts``, ``pins_reaped`` (pins of same-host
        writers that died mid-write, dropped by this owner: their process is gone); of its port: ``conns_active``,
        ``conns_accepted``, ``conns_refused`` (past `max_connections`), ``conns_idle_closed`` (past
        `idle_timeout`), ``auth_failures`` (failed the secret handshake or skipped it), with the limits
        ``max_connections`` and ``idle_timeout_ms``; and ``writes_out``, ``bytes_out``, ``failures_out`` (this
        engine as a writer)."""
        return {**self._owner.stats(), "max_connections": self.max_connections,
                "idle_timeout_ms": int(math.ceil(self.idle_timeout * 1000)), **self._out.snapshot(),
                **(self._cuda.stats() if self._cuda else {})}

    def close(self) -> None:
        """Stop serving, drop peer connections and free managed buffers. Idempotent."""
        if self._owner.closed:
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        if self._verbs is not None:
            self._verbs.close()
        if self._cuda is not None:
            self._cuda.close()
        self._owner.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # a notebook cell that re-creates an engine must not leave the old server thread running
        owner = getattr(self, "_owner", None)
        if owner is not None and not owner.closed:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._owner.closed else self.session_id
        return f"TransferEngine({state}, protocol={self.protocol!r})"
