"""The `verbs` transport: one-sided RDMA WRITE over libibverbs RC queue pairs (`epd_lab._verbs`).

The owner of memory registers it (ibv_reg_mr with LOCAL_WRITE | REMOTE_WRITE) and answers two
control requests that reach it over the engine's TCP channel (`handle_control`): a QP-connect
exchange, and an rkey lookup in which the owner checks the range against its own registrations
(the bounds check; the NIC then enforces the rkey). The writer connects one RC QP per owner
(`connect`), posts IBV_WR_RDMA_WRITE and polls its completion; the owner's CPU takes no part in
placing the bytes. Control messages are msgspec msgpack structs with a type tag.

This path was compiled here but never run against hardware: no machine of this project has an
RDMA device, so the tests that need one skip and say why.
"""
from __future__ import annotations

import bisect
import itertools
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

import msgspec

from epd_lab.transfer.errors import (
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)

try:
    from epd_lab import _verbs
except ImportError as exc:  # compiled only where the libibverbs headers existed at build time
    _verbs = None  # type: ignore[assignment]
    _IMPORT_ERROR: str | None = str(exc)
else:
    _IMPORT_ERROR = None

__all__ = [
    "ErrorReply", "QpConnect", "QpConnectReply", "QpDisconnect", "QpDisconnectReply", "RkeyReply",
    "RkeyRequest", "VerbsPeer", "VerbsTransport", "decode_reply", "decode_request", "encode",
    "list_devices", "unavailable_reason",
]

_ALTERNATIVES = (
    'Use protocol="shm" (same host), protocol="tcp" (any host) or protocol="mooncake" instead, '
    "or create a Soft-RoCE device over an Ethernet interface: "
    "`sudo rdma link add rxe0 type rxe netdev eth0`."
)
_PSN_LIMIT = 1 << 24  # PSNs and QP numbers are 24-bit
_MAX_SEND_WR = 256  # work requests in flight per QP; also the CQ depth


def list_devices() -> list[dict[str, Any]]:
    """The RDMA devices with their ports; [] when the binding is not built or no device exists."""
    return _verbs.get_device_list() if _verbs is not None else []


def unavailable_reason() -> str | None:
    """None when an RDMA device exists; otherwise a sentence saying why not and what to use instead."""
    if _verbs is None:
        return (
            f"The verbs transport is not built: epd_lab._verbs could not be imported ({_IMPORT_ERROR}); "
            "it is compiled only where the libibverbs headers (libibverbs-dev) exist at build time. "
            + _ALTERNATIVES
        )
    if not _verbs.get_device_list():
        return "No RDMA devices found: ibv_get_device_list returned none. " + _ALTERNATIVES
    return None


# ---- control messages (over the engine's TCP channel) -----------------------------------------

U16 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
U24 = Annotated[int, msgspec.Meta(ge=0, lt=_PSN_LIMIT)]
U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1 by themselves
Length = Annotated[int, msgspec.Meta(ge=1)]
Gid = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Mtu = Literal[256, 512, 1024, 2048, 4096]


class _Message(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    pass


class QpConnect(_Message, tag="qp_connect"):
    """Writer -> owner: the writer's QP; the owner creates a QP connected to it."""

    qpn: U24
    psn: U24
    lid: U16
    gid: Gid
    mtu: Mtu  # the writer port's active MTU in bytes; both sides use the smaller


class QpConnectReply(_Message, tag="qp_connect_reply"):
    """Owner -> writer: the owner's QP, already connected to the writer's."""

    qpn: U24
    psn: U24
    lid: U16
    gid: Gid
    mtu: Mtu


class RkeyRequest(_Message, tag="rkey"):
    """Writer -> owner: the rkey for writing [addr, addr + length)."""

    addr: U64
    length: Length


class RkeyReply(_Message, tag="rkey_reply"):
    """The registered region holding the asked range; the writer caches it for later writes."""

    rkey: U32
    addr: U64
    length: Length


class QpDisconnect(_Message, tag="qp_disconnect"):
    """Writer -> owner: destroy the owner's QP `qpn` (from QpConnectReply)."""

    qpn: U24


class QpDisconnectReply(_Message, tag="qp_disconnect_reply"):
    pass


class ErrorReply(_Message, tag="error"):
    """Owner -> writer: the request was refused; `kind` names the error the writer raises."""

    kind: Literal["remote_access", "protocol", "transfer"]
    message: str
    errno: int | None = None


Request = Union[QpConnect, RkeyRequest, QpDisconnect]
Reply = Union[QpConnectReply, RkeyReply, QpDisconnectReply, ErrorReply]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    """msgpack bytes of a control message, tagged with its type."""
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    """A control request, validated; ProtocolError for anything else."""
    try:
        return _request_decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"malformed verbs control request: {exc}") from None


def decode_reply(data: bytes) -> Reply:
    """A control reply, validated; ProtocolError for anything else."""
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed verbs control reply: {exc}") from None


def _raise_for(reply: ErrorReply) -> None:
    if reply.kind == "remote_access":
        raise RemoteAccessError(reply.message)
    if reply.kind == "protocol":
        raise ProtocolError(reply.message)
    raise TransferError(reply.message, reply.errno)


# ---- registered ranges --------------------------------------------------------------------------

_T = TypeVar("_T")


class _Regions(Generic[_T]):
    """Non-overlapping [addr, addr + length) ranges with a value each (an MR, or a cached rkey)."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted
        self._entries: dict[int, tuple[int, _T]] = {}  # start -> (length, value)

    def __len__(self) -> int:
        return len(self._starts)

    def _overlapping(self, addr: int, length: int) -> list[int]:
        # Non-overlapping ranges sorted by start are sorted by end too: walk back from the last
        # range starting before the end of the query until one ends before its start.
        found = []
        i = bisect.bisect_left(self._starts, addr + length)
        while i > 0 and self._starts[i - 1] + self._entries[self._starts[i - 1]][0] > addr:
            found.append(self._starts[i - 1])
            i -= 1
        return found

    def check_free(self, addr: int, length: int) -> None:
        """RegistrationError if [addr, addr + length) overlaps a range already here."""
        if self._overlapping(addr, length):
            raise RegistrationError(f"[{addr:#x}, {addr + length:#x}) overlaps a registered region")

    def add(self, addr: int, length: int, value: _T) -> None:
        self.check_free(addr, length)
        bisect.insort(self._starts, addr)
        self._entries[addr] = (length, value)

    def pop(self, addr: int) -> _T:
        """Remove the range starting at `addr`; RegistrationError if none does."""
        try:
            _, value = self._entries.pop(addr)
        except KeyError:
            raise RegistrationError(f"{addr:#x} is not the start of a registered region") from None
        del self._starts[bisect.bisect_left(self._starts, addr)]
        return value

    def discard_overlapping(self, addr: int, length: int) -> None:
        for start in self._overlapping(addr, length):
            self.pop(start)

    def find(self, addr: int, length: int) -> tuple[int, int, _T] | None:
        """(start, length, value) of the one range that holds all of [addr, addr + length)."""
        i = bisect.bisect_right(self._starts, addr)
        if i == 0:
            return None
        start = self._starts[i - 1]
        region_length, value = self._entries[start]
        if addr + length > start + region_length:
            return None
        return start, region_length, value

    def clear(self) -> None:
        self._starts.clear()
        self._entries.clear()


# ---- the transport -------------------------------------------------------------------------------


class VerbsTransport:
    """One port of one RDMA device: registered memory, the owner's side of connections, and peers.

    `gid_index` picks the source GID; on RoCE it selects v1/v2 and the IP family
    (`show_gids` lists them). Thread-safe: the engine may call `handle_control` from its server
    thread while the user registers memory.
    """

    def __init__(self, device: str | None = None, port_num: int = 1, gid_index: int = 0) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise TransportUnavailable(reason)
        self._context = _verbs.Context(device)
        try:
            port = self._context.query_port(port_num)
            if port["state"] != "active":
                raise TransportUnavailable(
                    f"Port {port_num} of RDMA device {self._context.name} is {port['state']}, not active. "
                    + _ALTERNATIVES
                )
            limits = self._context.query_device()
            self._gid = self._context.query_gid(port_num, gid_index)
            self._pd = _verbs.PD(self._context)
        except BaseException:
            self._context.close()
            raise
        self.port_num = port_num
        self.gid_index = gid_index
        self._lid: int = port["lid"]
        self._mtu: int = port["active_mtu"]
        self._link_layer: str = port["link_layer"]
        self._max_msg_sz: int = port["max_msg_sz"]
        self._max_send_wr = min(_MAX_SEND_WR, limits["max_qp_wr"], limits["max_cqe"])
        self._lock = threading.Lock()
        self._regions: _Regions[_verbs.MR] = _Regions()
        self._owner_cq: _verbs.CQ | None = None  # made with the first incoming connection
        self._owner_qps: dict[int, _verbs.QP] = {}
        self._peers: weakref.WeakSet[VerbsPeer] = weakref.WeakSet()
        self._closed = False
        self.num_refused = 0  # rkey lookups refused by the bounds check

    @property
    def device(self) -> str:
        return self._context.name

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("VerbsTransport is closed")

    # -- memory --

    def register(self, addr: int, length: int) -> None:
        """Register [addr, addr + length) for local use (lkey) and remote writes (rkey)."""
        if addr <= 0 or length <= 0:
            raise RegistrationError(f"cannot register addr={addr:#x} length={length}: null or empty")
        with self._lock:
            self._check_open()
            self._regions.check_free(addr, length)  # before the NIC pins anything
            mr = _verbs.MR(self._pd, addr, length, _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE)
            self._regions.add(addr, length, mr)

    def deregister(self, addr: int) -> None:
        """Deregister the region that starts at `addr`; writers holding its rkey then fail."""
        with self._lock:
            self._check_open()
            self._regions.pop(addr).close()

    def _lkey(self, addr: int, length: int) -> int:
        with self._lock:
            found = self._regions.find(addr, length)
        if found is None:
            raise RegistrationError(
                f"source [{addr:#x}, {addr + length:#x}) is not inside memory registered with this transport"
            )
        return found[2].lkey

    # -- owner side --

    def _port_info(self) -> dict[str, Any]:
        return {"lid": self._lid, "gid": self._gid, "mtu": self._mtu}

    def _bring_up(self, qp: _verbs.QP, remote: QpConnect | QpConnectReply, psn: int, access: int) -> None:
        # RoCE has no LIDs: the GID (an IP address) is the route. InfiniBand routes by LID.
        gid = remote.gid if self._link_layer == "ethernet" or remote.lid == 0 else None
        qp.to_init(self.port_num, access)
        qp.to_rtr(remote.qpn, remote.psn, remote.lid, gid, self.gid_index, self.port_num,
                  min(self._mtu, remote.mtu))
        qp.to_rts(psn)

    def handle_control(self, request: bytes) -> bytes:
        """Answer one control request from a writer (the owner's side). Never raises for what a
        peer sent: malformed bytes and failures become an ErrorReply."""
        reply: Reply
        try:
            message = decode_request(request)
            with self._lock:
                if self._closed:
                    raise TransferError("the owner's verbs transport is closed")
                if isinstance(message, QpConnect):
                    reply = self._accept(message)
                elif isinstance(message, RkeyRequest):
                    reply = self._lookup(message)
                else:  # QpDisconnect
                    qp = self._owner_qps.pop(message.qpn, None)
                    if qp is not None:
                        qp.close()
                    reply = QpDisconnectReply()
        except ProtocolError as exc:
            reply = ErrorReply("protocol", str(exc))
        except TransferError as exc:
            reply = ErrorReply("transfer", str(exc), exc.errno)
        return encode(reply)

    def _accept(self, request: QpConnect) -> QpConnectReply:
        if self._owner_cq is None:
            # The responder of an RDMA WRITE gets no completions; the CQ exists because a QP needs one.
            self._owner_cq = _verbs.CQ(self._context, 1)
        qp = _verbs.QP(self._pd, self._owner_cq, max_send_wr=1)
        psn = secrets.randbelow(_PSN_LIMIT)
        try:
            self._bring_up(qp, request, psn, _verbs.ACCESS_REMOTE_WRITE)
        except BaseException:
            qp.close()
            raise
        self._owner_qps[qp.qp_num] = qp
        return QpConnectReply(qpn=qp.qp_num, psn=psn, **self._port_info())

    def _lookup(self, request: RkeyRequest) -> RkeyReply | ErrorReply:
        found = self._regions.find(request.addr, request.length)
        if found is None:
            self.num_refused += 1
            end = request.addr + request.length
            return ErrorReply(
                "remote_access",
                f"[{request.addr:#x}, {end:#x}) is not inside one region registered by the owner",
            )
        start, length, mr = found
        return RkeyReply(rkey=mr.rkey, addr=start, length=length)

    # -- writer side --

    def connect(self, control: Callable[[bytes], bytes]) -> VerbsPeer:
        """Connect a QP to an owner; `control` carries a request to its handle_control and returns
        the reply (the engine's TCP channel)."""
        self._check_open()
        peer = VerbsPeer(self, control)
        self._peers.add(peer)
        return peer

    def close(self) -> None:
        """Close the peers, then every QP, CQ and MR, the PD and the device. Idempotent."""
        if self._closed:
            return
        for peer in list(self._peers):
            peer.close()
        with self._lock:
            self._closed = True
            self._owner_qps.clear()
            self._regions.clear()
            self._context.close()  # closes its PD, CQs, MRs and QPs first

    def __enter__(self) -> VerbsTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<VerbsTransport {self._context.name}:{self.port_num} closed>"
        return (f"<VerbsTransport {self._context.name}:{self.port_num} {len(self._regions)} regions, "
                f"{len(self._owner_qps)} owner QPs>")


@dataclass
class _Connection:
    qp: _verbs.QP
    cq: _verbs.CQ
    remote_qpn: int  # the owner's QP, destroyed on QpDisconnect


class VerbsPeer:
    """The writer's end of one RC connection to an owner.

    After a failed or timed-out write the QP is in error (or holds stale work): it is dropped,
    and the next write connects a new one through `control`.
    """

    def __init__(self, transport: VerbsTransport, control: Callable[[bytes], bytes]) -> None:
        self._transport = transport
        self._control = control
        self._lock = threading.Lock()
        self._rkeys: _Regions[int] = _Regions()  # the owner's regions already looked up -> rkey
        self._wr_ids = itertools.count(1)
        self._closed = False
        self._conn: _Connection | None = self._connect()

    def _request(self, message: Request) -> Reply:
        reply = decode_reply(self._control(encode(message)))
        if isinstance(reply, ErrorReply):
            _raise_for(reply)
        return reply

    def _connect(self) -> _Connection:
        t = self._transport
        cq = _verbs.CQ(t._context, t._max_send_wr)
        qp = _verbs.QP(t._pd, cq, max_send_wr=t._max_send_wr)
        psn = secrets.randbelow(_PSN_LIMIT)
        reply: Reply | None = None
        try:
            reply = self._request(QpConnect(qpn=qp.qp_num, psn=psn, **t._port_info()))
            if not isinstance(reply, QpConnectReply):
                raise ProtocolError(f"expected a qp_connect_reply, got {type(reply).__name__}")
            t._bring_up(qp, reply, psn, 0)  # the owner may not write back through this QP
        except BaseException:
            qp.close()
            cq.close()
            if isinstance(reply, QpConnectReply):
                self._disconnect(reply.qpn)
            raise
        return _Connection(qp, cq, reply.qpn)

    def _disconnect(self, remote_qpn: int) -> None:
        try:
            self._request(QpDisconnect(qpn=remote_qpn))
        except TransferError:
            pass  # the owner is unreachable or already closed: its QP went with it

    def _drop(self, conn: _Connection) -> None:
        """Forget the connection: queued work, cached rkeys and the owner's QP."""
        self._conn = None
        conn.qp.close()
        conn.cq.close()
        self._rkeys.clear()
        self._disconnect(conn.remote_qpn)

    def _rkey(self, addr: int, length: int) -> int:
        found = self._rkeys.find(addr, length)
        if found is not None:
            return found[2]
        reply = self._request(RkeyRequest(addr=addr, length=length))
        if not isinstance(reply, RkeyReply) or not (
            reply.addr <= addr and addr + length <= reply.addr + reply.length
        ):
            raise ProtocolError(f"rkey reply {reply!r} does not cover [{addr:#x}, +{length})")
        # The owner may have re-registered: its current region replaces stale overlapping ones.
        self._rkeys.discard_overlapping(reply.addr, reply.length)
        self._rkeys.add(reply.addr, reply.length, reply.rkey)
        return reply.rkey

    def write(self, src: int, dst: int, length: int, timeout: float) -> None:
        """RDMA WRITE `length` bytes from local `src` (registered here) to the owner's `dst`."""
        self.write_batch([src], [dst], [length], timeout)

    def write_batch(self, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                    timeout: float) -> None:
        """Write every (src, dst, length); returns when all completed, raises on the first failure.

        Writes are posted in windows of the send queue's depth with only the last one signaled:
        RC completes in order, so its completion covers the window.
        """
        if not len(srcs) == len(dsts) == len(lengths):
            raise ValueError(
                f"srcs, dsts and lengths differ in length: {len(srcs)}, {len(dsts)}, {len(lengths)}"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        with self._lock:
            if self._closed:
                raise ValueError("VerbsPeer is closed")
            deadline = time.monotonic() + timeout
            conn = self._conn or self._connect()
            self._conn = conn
            work = self._prepare(srcs, dsts, lengths)
            window = min(conn.qp.max_send_wr, conn.cq.cqe)
            try:
                for first in range(0, len(work), window):
                    chunk = work[first:first + window]
                    for i, (src, lkey, dst, rkey, n) in enumerate(chunk):
                        wr_id = next(self._wr_ids)
                        conn.qp.post_rdma_write(wr_id, src, n, lkey, dst, rkey, i == len(chunk) - 1)
                    self._wait(conn, wr_id, deadline, timeout)
            except BaseException:
                # An error completion leaves the QP in error, a timeout leaves work queued:
                # either way this connection is done.
                self._drop(conn)
                raise

    def _prepare(self, srcs: Sequence[int], dsts: Sequence[int],
                 lengths: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
        # Every key is resolved before anything is posted, so misuse fails with nothing in flight.
        max_msg = self._transport._max_msg_sz
        work = []
        for src, dst, length in zip(srcs, dsts, lengths):
            if length <= 0:
                raise ValueError(f"length must be > 0, got {length}")
            lkey = self._transport._lkey(src, length)
            rkey = self._rkey(dst, length)
            for offset in range(0, length, max_msg):
                work.append((src + offset, lkey, dst + offset, rkey, min(max_msg, length - offset)))
        return work

    def _wait(self, conn: _Connection, wr_id: int, deadline: float, timeout: float) -> None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"RDMA WRITE to QP {conn.remote_qpn} not complete after {timeout} s")
            for done_id, status, vendor_err in conn.cq.poll(conn.cq.cqe, remaining):
                if status != _verbs.WC_SUCCESS:
                    raise _completion_error(status, vendor_err)
                if done_id == wr_id:
                    return

    def close(self) -> None:
        """Destroy the QP and tell the owner to destroy its end. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._conn is not None:
                self._drop(self._conn)
        self._transport._peers.discard(self)

    def __enter__(self) -> VerbsPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _completion_error(status: int, vendor_err: int) -> TransferError:
    text = f"RDMA WRITE failed: {_verbs.wc_status_str(status)} (status {status}, vendor_err {vendor_err:#x})"
    if status == _verbs.WC_REM_ACCESS_ERR:
        return RemoteAccessError(text + ": the owner's NIC refused the rkey or the range")
    if status == _verbs.WC_RETRY_EXC_ERR:
        return PeerUnreachable(text + ": the owner stopped acknowledging (dead or unreachable)")
    return TransferError(text)
