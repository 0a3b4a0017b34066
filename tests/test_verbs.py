"""The verbs transport.

What runs everywhere: device discovery that answers [] without a device, the reason and the
alternatives when the transport is unavailable, the control messages and the owner's range table.
What needs an RDMA device is marked `rdma` and skips with the reason: none of this project's
machines has one, so those tests were written against the verbs semantics but never run.
With Soft-RoCE (`sudo rdma link add rxe0 type rxe netdev eth0`) they run on loopback.
"""
from __future__ import annotations

import ctypes
import itertools
import multiprocessing
import multiprocessing.connection
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from epd_lab.transfer import verbs
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
except ImportError:
    _verbs = None  # type: ignore[assignment]

needs_binding = pytest.mark.skipif(_verbs is None, reason=str(verbs.unavailable_reason()))

GID = bytes(range(16))


@pytest.fixture
def no_device() -> None:
    if verbs.list_devices():
        pytest.skip("this machine has an RDMA device")


@pytest.fixture
def not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "_verbs", None)
    monkeypatch.setattr(verbs, "_IMPORT_ERROR", "No module named 'epd_lab._verbs'")


def _assert_names_alternatives(reason: str) -> None:
    assert reason.endswith(".")
    for alternative in ('protocol="shm"', 'protocol="tcp"', 'protocol="mooncake"'):
        assert alternative in reason
    assert "rdma link add rxe0 type rxe" in reason


# ---- discovery and unavailability (run here) -----------------------------------------------------


@needs_binding
def test_get_device_list_answers_without_raising() -> None:
    devices = _verbs.get_device_list()
    assert isinstance(devices, list)
    for device in devices:
        assert set(device) == {"name", "guid", "ports"}
        for port in device["ports"]:
            assert {"state", "lid", "active_mtu", "gid"} <= set(port)


def test_list_devices_is_the_binding_list_or_empty() -> None:
    expected = _verbs.get_device_list() if _verbs is not None else []
    assert verbs.list_devices() == expected


def test_list_devices_empty_when_not_built(not_built: None) -> None:
    assert verbs.list_devices() == []


def test_unavailable_reason_without_device(no_device: None) -> None:
    reason = verbs.unavailable_reason()
    assert reason is not None
    _assert_names_alternatives(reason)
    if _verbs is not None:
        assert "ibv_get_device_list returned none" in reason


def test_unavailable_reason_when_not_built(not_built: None) -> None:
    reason = verbs.unavailable_reason()
    assert reason is not None
    assert "not built" in reason and "libibverbs" in reason
    _assert_names_alternatives(reason)


def test_transport_unavailable_without_device(no_device: None) -> None:
    with pytest.raises(TransportUnavailable) as raised:
        verbs.VerbsTransport()
    assert str(raised.value) == verbs.unavailable_reason()


def test_transport_unavailable_when_not_built(not_built: None) -> None:
    with pytest.raises(TransportUnavailable, match="not built"):
        verbs.VerbsTransport()


@needs_binding
def test_context_without_device_is_a_system_error(no_device: None) -> None:
    with pytest.raises(TransferError) as raised:
        _verbs.Context()
    assert raised.value.errno is not None  # ENOSYS without kernel support, ENODEV with none


@needs_binding
def test_binding_helpers() -> None:
    assert _verbs.format_gid(GID) == "0001:0203:0405:0607:0809:0a0b:0c0d:0e0f"
    with pytest.raises(ValueError):
        _verbs.format_gid(GID[:15])
    assert _verbs.wc_status_str(_verbs.WC_REM_ACCESS_ERR) == "remote access error"
    assert _verbs.wc_status_str(_verbs.WC_SUCCESS) == "success"
    with pytest.raises(TypeError):
        _verbs.PD(None)  # type: ignore[arg-type]


# ---- control messages (run here) ----------------------------------------------------------------

REQUESTS: list[verbs.Request] = [
    verbs.QpConnect(qpn=0x123, psn=(1 << 24) - 1, lid=7, gid=GID, mtu=4096),
    verbs.RkeyRequest(addr=(1 << 64) - 1, length=1),
    verbs.QpDisconnect(qpn=0x123),
]
REPLIES: list[verbs.Reply] = [
    verbs.QpConnectReply(qpn=0x456, psn=0, lid=0, gid=GID, mtu=1024),
    verbs.RkeyReply(rkey=0xFFFFFFFF, addr=0x7F0000000000, length=1 << 30),
    verbs.QpDisconnectReply(),
    verbs.ErrorReply("remote_access", "[0x10, 0x20) is not inside one region registered by the owner"),
    verbs.ErrorReply("transfer", "ibv_create_qp failed: Cannot allocate memory (errno 12)", 12),
]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(message: verbs.Request) -> None:
    assert verbs.decode_request(verbs.encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(message: verbs.Reply) -> None:
    assert verbs.decode_reply(verbs.encode(message)) == message


MALFORMED_REQUESTS = {
    "empty": b"",
    "truncated": verbs.encode(REQUESTS[0])[:-3],
    "not msgpack of a struct": b"\x01",
    "pickle": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94.",
    "a reply": verbs.encode(REPLIES[1]),
    "unknown type": msgspec.msgpack.encode({"type": "rdma_read", "addr": 1, "length": 2}),
    "extra field": msgspec.msgpack.encode({"type": "rkey", "addr": 1, "length": 2, "rkey": 3}),
    "missing field": msgspec.msgpack.encode({"type": "rkey", "addr": 1}),
    "zero length": verbs.encode(verbs.RkeyRequest(addr=1, length=0)),
    "negative addr": verbs.encode(verbs.RkeyRequest(addr=-1, length=1)),
    "qpn over 24 bits": verbs.encode(verbs.QpDisconnect(qpn=1 << 24)),
    "short gid": verbs.encode(verbs.QpConnect(qpn=1, psn=1, lid=1, gid=GID[:15], mtu=1024)),
    "odd mtu": verbs.encode(
        verbs.QpConnect(qpn=1, psn=1, lid=1, gid=GID, mtu=1500)  # type: ignore[arg-type]
    ),
    "lid over 16 bits": verbs.encode(verbs.QpConnect(qpn=1, psn=1, lid=1 << 16, gid=GID, mtu=1024)),
}


@pytest.mark.parametrize("data", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS.keys())
def test_malformed_request_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed verbs control request"):
        verbs.decode_request(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        verbs.encode(REQUESTS[1]),
        msgspec.msgpack.encode({"type": "error", "kind": "oops", "message": ""}),
    ],
    ids=["empty", "a request", "unknown error kind"],
)
def test_malformed_reply_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed verbs control reply"):
        verbs.decode_reply(data)


# ---- the owner's range table (run here) ---------------------------------------------------------


def test_regions_find_only_ranges_inside_one_region() -> None:
    regions: verbs._Regions[str] = verbs._Regions()
    regions.add(0x1000, 0x100, "a")
    regions.add(0x1100, 0x100, "b")  # adjacent to a
    assert regions.find(0x1000, 0x100) == (0x1000, 0x100, "a")
    assert regions.find(0x10FF, 1) == (0x1000, 0x100, "a")
    assert regions.find(0x1100, 1) == (0x1100, 0x100, "b")
    assert regions.find(0x10FF, 2) is None  # straddles a and b: no single rkey covers it
    assert regions.find(0xFFF, 2) is None
    assert regions.find(0x11FF, 2) is None
    assert regions.find(0x5000, 1) is None


def test_regions_refuse_overlap_and_unknown_starts() -> None:
    regions: verbs._Regions[str] = verbs._Regions()
    regions.add(0x1000, 0x100, "a")
    for addr, length in [(0x1000, 0x100), (0xF00, 0x101), (0x10FF, 0x10), (0x1010, 0x10), (0x0, 0x10000)]:
        with pytest.raises(RegistrationError, match="overlaps"):
            regions.add(addr, length, "x")
    regions.add(0xF00, 0x100, "before")  # touching is not overlapping
    with pytest.raises(RegistrationError, match="not the start"):
        regions.pop(0x1001)
    assert regions.pop(0x1000) == "a"
    assert regions.find(0x1000, 1) is None
    assert len(regions) == 1


def test_regions_discard_overlapping() -> None:
    regions: verbs._Regions[int] = verbs._Regions()
    regions.add(0x1000, 0x100, 1)
    regions.add(0x1100, 0x100, 2)
    regions.add(0x1300, 0x100, 3)
    regions.discard_overlapping(0x10F0, 0x20)
    assert len(regions) == 1 and regions.find(0x1300, 1) == (0x1300, 0x100, 3)


# ---- the transport's logic over a fake binding (run here) ---------------------------------------
# A stand-in for epd_lab._verbs in plain Python: memmove plays the NIC, a dict the fabric. These
# tests check the transport's own logic (the QP exchange, the owner's bounds check, the rkey cache,
# send-queue windows, reconnecting after an error); they say nothing about libibverbs itself, which
# only the rdma tests below exercise.

_LOC_PROT_ERR, _WR_FLUSH_ERR, _REM_ACCESS_ERR, _RETRY_EXC_ERR = 4, 5, 10, 12  # enum ibv_wc_status
_WC_TEXT = {
    0: "success",
    _LOC_PROT_ERR: "local protection error",
    _WR_FLUSH_ERR: "Work Request Flushed Error",
    _REM_ACCESS_ERR: "remote access error",
    _RETRY_EXC_ERR: "transport retry counter exceeded",
}
_FAKE_MAX_WR = 8  # a shallow send queue, so that batches span several windows
_FAKE_MAX_MSG = 4096  # a small max_msg_sz, so that large writes are split


class _Fabric:
    def __init__(self) -> None:
        self.qps: dict[int, _FakeQP] = {}
        self.mrs: dict[int, _FakeMR] = {}
        self.numbers = itertools.count(0x100)
        self.frozen = False  # no completion ever arrives


class _FakeContext:
    fabric: _Fabric  # set per test
    name = "fake0"

    def __init__(self, name: str | None = None) -> None:
        self.children: list[Any] = []

    def query_port(self, port_num: int) -> dict[str, Any]:
        return {"port": port_num, "state": "active", "lid": 1, "active_mtu": 4096, "max_mtu": 4096,
                "max_msg_sz": _FAKE_MAX_MSG, "gid_tbl_len": 1, "link_layer": "infiniband"}

    def query_device(self) -> dict[str, Any]:
        return {"max_qp_wr": _FAKE_MAX_WR, "max_cqe": 1024, "phys_port_cnt": 1}

    def query_gid(self, port_num: int, index: int) -> bytes:
        return GID

    def close(self) -> None:
        for child in self.children:
            child.close()


class _FakePD:
    def __init__(self, context: _FakeContext) -> None:
        self.context = context
        context.children.append(self)

    def close(self) -> None:
        pass


class _FakeMR:
    def __init__(self, pd: _FakePD, addr: int, length: int, access: int) -> None:
        self.pd, self.addr, self.length, self.access = pd, addr, length, access
        self.fabric = pd.context.fabric
        self.lkey = self.rkey = next(self.fabric.numbers)
        self.fabric.mrs[self.rkey] = self
        pd.context.children.append(self)

    def holds(self, pd: _FakePD, addr: int, length: int) -> bool:
        return self.pd is pd and self.addr <= addr and addr + length <= self.addr + self.length

    def close(self) -> None:
        self.fabric.mrs.pop(self.rkey, None)


class _FakeCQ:
    def __init__(self, context: _FakeContext, cqe: int = 256) -> None:
        self.cqe = cqe
        self.entries: list[tuple[int, int, int, _FakeQP, int]] = []
        context.children.append(self)

    def poll(self, max_entries: int = 16, timeout_s: float = 0.0) -> list[tuple[int, int, int]]:
        if not self.entries:
            time.sleep(min(timeout_s, 0.001))
        polled, self.entries = self.entries[:max_entries], self.entries[max_entries:]
        for _, _, _, qp, retired in polled:
            qp.outstanding -= retired  # a completion frees its send-queue slots when polled
        return [entry[:3] for entry in polled]

    def close(self) -> None:
        pass


class _FakeQP:
    def __init__(self, pd: _FakePD, cq: _FakeCQ, max_send_wr: int = 128) -> None:
        self.pd, self.cq, self.max_send_wr = pd, cq, max_send_wr
        self.fabric = pd.context.fabric
        self.qp_num = next(self.fabric.numbers)
        self.fabric.qps[self.qp_num] = self
        self.state, self.access, self.remote_qpn, self.outstanding = "reset", 0, -1, 0
        pd.context.children.append(self)

    def to_init(self, port_num: int, access: int = 2) -> None:
        self.state, self.access = "init", access

    def to_rtr(self, remote_qpn: int, remote_psn: int, remote_lid: int, remote_gid: bytes | None,
               gid_index: int, port_num: int, mtu: int) -> None:
        assert self.state == "init" and mtu == 4096
        self.state, self.remote_qpn = "rtr", remote_qpn

    def to_rts(self, psn: int) -> None:
        assert self.state == "rtr"
        self.state = "rts"

    def post_rdma_write(self, wr_id: int, local_addr: int, length: int, lkey: int, remote_addr: int,
                        rkey: int, signaled: bool = True) -> None:
        assert 0 < length <= _FAKE_MAX_MSG
        if self.outstanding == self.max_send_wr:
            raise TransferError("ibv_post_send(RDMA_WRITE) failed: Cannot allocate memory (errno 12)", 12)
        self.outstanding += 1
        if self.fabric.frozen:
            return
        status = self._execute(local_addr, length, lkey, remote_addr, rkey)
        if status != 0:
            self.state = "error"
        if status != 0 or signaled:
            self.cq.entries.append((wr_id, status, 0, self, self.outstanding))

    def _execute(self, local_addr: int, length: int, lkey: int, remote_addr: int, rkey: int) -> int:
        if self.state != "rts":
            return _WR_FLUSH_ERR
        local = self.fabric.mrs.get(lkey)
        if local is None or not local.holds(self.pd, local_addr, length):
            return _LOC_PROT_ERR
        remote_qp = self.fabric.qps.get(self.remote_qpn)
        if remote_qp is None or remote_qp.remote_qpn != self.qp_num:
            return _RETRY_EXC_ERR  # nobody acknowledges
        remote = self.fabric.mrs.get(rkey)
        if remote is None or not remote.access & 2 or not remote.holds(remote_qp.pd, remote_addr, length):
            remote_qp.state = "error"
            return _REM_ACCESS_ERR
        ctypes.memmove(remote_addr, local_addr, length)
        return 0

    def close(self) -> None:
        self.fabric.qps.pop(self.qp_num, None)


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> _Fabric:
    """Swap epd_lab._verbs for the fake in the transport module."""
    fabric = _Fabric()
    monkeypatch.setattr(_FakeContext, "fabric", fabric, raising=False)
    fake = types.SimpleNamespace(
        Context=_FakeContext, PD=_FakePD, MR=_FakeMR, CQ=_FakeCQ, QP=_FakeQP,
        ACCESS_LOCAL_WRITE=1, ACCESS_REMOTE_WRITE=2, ACCESS_REMOTE_READ=4,
        WC_SUCCESS=0, WC_WR_FLUSH_ERR=_WR_FLUSH_ERR, WC_REM_ACCESS_ERR=_REM_ACCESS_ERR,
        WC_RETRY_EXC_ERR=_RETRY_EXC_ERR, wc_status_str=_WC_TEXT.__getitem__,
        get_device_list=lambda: [{"name": "fake0", "guid": "0000:0000:0000:0001", "ports": []}],
    )
    monkeypatch.setattr(verbs, "_verbs", fake)
    return fabric


class _Control:
    """The engine's TCP channel in one process: straight into the owner's handle_control, counted."""

    def __init__(self, owner: verbs.VerbsTransport) -> None:
        self.owner = owner
        self.sent: list[str] = []

    def __call__(self, request: bytes) -> bytes:
        self.sent.append(type(verbs.decode_request(request)).__name__)
        return self.owner.handle_control(request)


@dataclass
class _Pair:
    owner: verbs.VerbsTransport
    writer: verbs.VerbsTransport
    dst: np.ndarray
    src: np.ndarray
    control: _Control


@pytest.fixture
def pair(fabric: _Fabric) -> Iterator[_Pair]:
    with verbs.VerbsTransport() as owner, verbs.VerbsTransport() as writer:
        dst = np.zeros(64 << 10, dtype=np.uint8)
        src = np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8)
        owner.register(dst.ctypes.data, dst.nbytes)
        writer.register(src.ctypes.data, src.nbytes)
        yield _Pair(owner, writer, dst, src, _Control(owner))


def test_fake_write_batch_lands_and_caches_the_rkey(pair: _Pair) -> None:
    src, dst = pair.src.ctypes.data, pair.dst.ctypes.data
    with pair.writer.connect(pair.control) as peer:
        peer.write(src, dst + 10, 10_000, timeout=5.0)  # split at max_msg_sz into 3 work requests
        pieces = 40  # five windows of the fake's send queue
        peer.write_batch([src + 20_000 + i * 100 for i in range(pieces)],
                         [dst + 20_000 + (pieces - 1 - i) * 100 for i in range(pieces)],
                         [100] * pieces, timeout=5.0)
    np.testing.assert_array_equal(pair.dst[10:10_010], pair.src[:10_000])
    landed = pair.dst[20_000:20_000 + pieces * 100].reshape(pieces, 100)
    np.testing.assert_array_equal(landed[::-1], pair.src[20_000:20_000 + pieces * 100].reshape(pieces, 100))
    assert pair.control.sent == ["QpConnect", "RkeyRequest", "QpDisconnect"]


def test_fake_owner_refuses_a_range_outside_its_memory(pair: _Pair) -> None:
    src, dst = pair.src.ctypes.data, pair.dst.ctypes.data
    with pair.writer.connect(pair.control) as peer:
        with pytest.raises(RemoteAccessError, match="not inside one region registered by the owner"):
            peer.write(src, dst + pair.dst.nbytes - 8, 16, timeout=5.0)
        assert pair.owner.num_refused == 1
        peer.write(src, dst, 16, timeout=5.0)  # the owner stayed up, the connection too
    assert pair.control.sent.count("QpConnect") == 1


def test_fake_stale_rkey_fails_then_reconnects(pair: _Pair) -> None:
    src, dst = pair.src.ctypes.data, pair.dst.ctypes.data
    with pair.writer.connect(pair.control) as peer:
        peer.write(src, dst, 16, timeout=5.0)
        pair.owner.deregister(dst)
        pair.owner.register(dst, pair.dst.nbytes)  # a new rkey for the same memory
        with pytest.raises(RemoteAccessError, match="remote access error"):
            peer.write(src, dst, 16, timeout=5.0)  # the cached rkey is stale: the "NIC" refuses
        assert pair.owner._owner_qps == {}  # the broken QP pair was torn down on both sides
        peer.write(src + 16, dst + 16, 16, timeout=5.0)
    np.testing.assert_array_equal(pair.dst[:32], pair.src[:32])
    assert pair.control.sent.count("QpConnect") == 2


def test_fake_grown_region_replaces_the_cached_one(pair: _Pair) -> None:
    src, dst = pair.src.ctypes.data, pair.dst.ctypes.data
    pair.owner.deregister(dst)
    pair.owner.register(dst, 1000)
    with pair.writer.connect(pair.control) as peer:
        peer.write(src, dst, 16, timeout=5.0)  # caches [dst, dst + 1000)
        pair.owner.deregister(dst)
        pair.owner.register(dst, 2000)
        peer.write(src, dst + 1500, 16, timeout=5.0)  # outside the cached range: asks again
    np.testing.assert_array_equal(pair.dst[1500:1516], pair.src[:16])


def test_fake_dead_owner_is_unreachable(pair: _Pair) -> None:
    peer = pair.writer.connect(pair.control)
    peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 16, timeout=5.0)
    pair.owner.close()
    with pytest.raises(PeerUnreachable, match="retry counter exceeded"):
        peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 16, timeout=5.0)
    with pytest.raises(TransferError, match="transport is closed"):
        peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 16, timeout=5.0)  # reconnect refused


def test_fake_no_completion_is_a_timeout(pair: _Pair, fabric: _Fabric) -> None:
    with pair.writer.connect(pair.control) as peer:
        fabric.frozen = True
        with pytest.raises(TransferTimeout):
            peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 16, timeout=0.05)


def test_fake_misuse_fails_before_anything_is_posted(pair: _Pair) -> None:
    unregistered = np.ones(64, dtype=np.uint8)
    with pair.writer.connect(pair.control) as peer:
        with pytest.raises(RegistrationError, match="not inside memory registered"):
            peer.write(unregistered.ctypes.data, pair.dst.ctypes.data, 64, timeout=5.0)
        with pytest.raises(ValueError, match="differ in length"):
            peer.write_batch([1], [], [1], timeout=5.0)
        with pytest.raises(ValueError, match="length must be > 0"):
            peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 0, timeout=5.0)
    with pytest.raises(ValueError, match="closed"):
        peer.write(pair.src.ctypes.data, pair.dst.ctypes.data, 1, timeout=5.0)


def test_fake_register_refuses_overlap_and_unknown(pair: _Pair) -> None:
    with pytest.raises(RegistrationError, match="overlaps"):
        pair.owner.register(pair.dst.ctypes.data + 100, 10)
    with pytest.raises(RegistrationError, match="not the start"):
        pair.owner.deregister(pair.dst.ctypes.data + 1)
    with pytest.raises(RegistrationError, match="null or empty"):
        pair.owner.register(pair.dst.ctypes.data, 0)


def test_fake_owner_answers_garbage_with_an_error_reply(pair: _Pair) -> None:
    reply = verbs.decode_reply(pair.owner.handle_control(b"\x80\x04garbage"))
    assert isinstance(reply, verbs.ErrorReply) and reply.kind == "protocol"


def test_fake_close_is_idempotent_and_closes_peers(pair: _Pair) -> None:
    peer = pair.writer.connect(pair.control)
    pair.writer.close()
    assert pair.owner._owner_qps == {}  # the peer said goodbye
    pair.writer.close()
    peer.close()
    with pytest.raises(ValueError, match="closed"):
        pair.writer.register(pair.src.ctypes.data, 1)


# ---- with an RDMA device (marked rdma; skipped here with the reason) ----------------------------

OWNER_SIZE = 4 << 20
REPLY_TIMEOUT_S = 30.0


@pytest.fixture
def writer() -> Iterator[verbs.VerbsTransport]:
    """The writer's transport on the first device; skips, with the reason, where there is none."""
    reason = verbs.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)  # "No RDMA devices found: ..." or "... not built ..."
    try:
        transport = verbs.VerbsTransport()
    except TransportUnavailable as exc:  # a device whose port is not active
        pytest.skip(str(exc))
    with transport:
        yield transport


def _send(conn: multiprocessing.connection.Connection, obj: object) -> None:
    conn.send_bytes(msgspec.msgpack.encode(obj))  # msgpack, never pickle, even between test processes


def _recv(conn: multiprocessing.connection.Connection) -> Any:
    return msgspec.msgpack.decode(conn.recv_bytes())


def _owner_main(conn: multiprocessing.connection.Connection) -> None:
    """The owner process: registers two buffers and serves control requests and test commands."""
    with verbs.VerbsTransport() as transport:
        buffers = [np.zeros(OWNER_SIZE, dtype=np.uint8) for _ in range(2)]
        addrs = [b.ctypes.data for b in buffers]
        for addr in addrs:
            transport.register(addr, OWNER_SIZE)
        _send(conn, addrs)
        while True:
            command, *args = _recv(conn)
            if command == "control":
                _send(conn, transport.handle_control(args[0]))
            elif command == "read":
                _send(conn, buffers[args[0]].tobytes())
            elif command == "deregister":
                transport.deregister(addrs[args[0]])
                _send(conn, None)
            elif command == "num_refused":
                _send(conn, transport.num_refused)
            else:
                return


@dataclass
class _Owner:
    conn: multiprocessing.connection.Connection
    addrs: list[int]

    def ask(self, *command: object) -> Any:
        _send(self.conn, command)
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the owner process did not answer {command[0]!r}")
        return _recv(self.conn)

    def control(self, request: bytes) -> bytes:
        """What the engine's TCP channel does: carry a request to handle_control, bring the reply."""
        return self.ask("control", request)


@pytest.fixture
def owner(writer: verbs.VerbsTransport) -> Iterator[_Owner]:
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=_owner_main, args=(child_conn,), daemon=True)
    process.start()
    try:
        if not conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError("the owner process did not start")
        yield _Owner(conn, _recv(conn))
        _send(conn, ("stop",))
        process.join(REPLY_TIMEOUT_S)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


def _source(writer: verbs.VerbsTransport, size: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    writer.register(data.ctypes.data, size)
    return data


@pytest.mark.rdma
@pytest.mark.parametrize("size", [1, 4096, 1 << 20])
def test_write_lands_in_owner_memory(writer: verbs.VerbsTransport, owner: _Owner, size: int) -> None:
    src = _source(writer, size)
    offset = 123
    with writer.connect(owner.control) as peer:
        peer.write(src.ctypes.data, owner.addrs[0] + offset, size, timeout=10.0)
    landed = owner.ask("read", 0)
    assert landed[offset:offset + size] == src.tobytes()
    assert landed[:offset] == bytes(offset)


@pytest.mark.rdma
def test_write_batch_spans_several_windows(writer: verbs.VerbsTransport, owner: _Owner) -> None:
    count, piece = 600, 1000  # more writes than one send-queue window
    src = _source(writer, count * piece)
    srcs = [src.ctypes.data + i * piece for i in range(count)]
    dsts = [owner.addrs[1] + (count - 1 - i) * piece for i in range(count)]  # reversed order
    with writer.connect(owner.control) as peer:
        peer.write_batch(srcs, dsts, [piece] * count, timeout=30.0)
    landed = np.frombuffer(owner.ask("read", 1), dtype=np.uint8)[: count * piece].reshape(count, piece)
    np.testing.assert_array_equal(landed[::-1], src.reshape(count, piece))


@pytest.mark.rdma
def test_write_outside_registered_memory_is_refused(writer: verbs.VerbsTransport, owner: _Owner) -> None:
    src = _source(writer, 64)
    with writer.connect(owner.control) as peer:
        with pytest.raises(RemoteAccessError, match="not inside one region"):
            peer.write(src.ctypes.data, owner.addrs[0] + OWNER_SIZE - 8, 16, timeout=10.0)
        assert owner.ask("num_refused") == 1
        peer.write(src.ctypes.data, owner.addrs[0], 64, timeout=10.0)  # the owner stayed up
    assert owner.ask("read", 0)[:64] == src.tobytes()


@pytest.mark.rdma
def test_stale_rkey_is_refused_by_the_nic(writer: verbs.VerbsTransport, owner: _Owner) -> None:
    src = _source(writer, 64)
    with writer.connect(owner.control) as peer:
        peer.write(src.ctypes.data, owner.addrs[1], 64, timeout=10.0)  # caches the rkey
        owner.ask("deregister", 1)
        with pytest.raises(RemoteAccessError, match="remote access error"):
            peer.write(src.ctypes.data, owner.addrs[1], 64, timeout=10.0)
        peer.write(src.ctypes.data, owner.addrs[0], 64, timeout=10.0)  # reconnects
    assert owner.ask("read", 0)[:64] == src.tobytes()


@pytest.mark.rdma
def test_source_must_be_registered(writer: verbs.VerbsTransport, owner: _Owner) -> None:
    unregistered = np.ones(64, dtype=np.uint8)
    with writer.connect(owner.control) as peer:
        with pytest.raises(RegistrationError, match="not inside memory registered"):
            peer.write(unregistered.ctypes.data, owner.addrs[0], 64, timeout=10.0)


@pytest.mark.rdma
def test_binding_loopback_write_and_close_cascade(writer: verbs.VerbsTransport) -> None:
    """Two QPs of one context connected to each other: the binding alone, without the transport."""
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    ctx = _verbs.Context(writer.device)
    port = ctx.query_port(1)
    gid = ctx.query_gid(1, 0)
    pd = _verbs.PD(ctx)
    cq = _verbs.CQ(ctx, 16)
    src_mr = _verbs.MR(pd, src.ctypes.data, src.nbytes, _verbs.ACCESS_LOCAL_WRITE)
    remote_write = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE
    dst_mr = _verbs.MR(pd, dst.ctypes.data, dst.nbytes, remote_write)
    a, b = _verbs.QP(pd, cq, 16), _verbs.QP(pd, cq, 16)
    for qp, peer in ((a, b), (b, a)):
        qp.to_init(1)
        qp.to_rtr(peer.qp_num, 0, port["lid"], gid, 0, 1, port["active_mtu"])
        qp.to_rts(0)
    assert cq.poll(4, timeout_s=0.0) == []
    a.post_rdma_write(7, src.ctypes.data, 256, src_mr.lkey, dst.ctypes.data, dst_mr.rkey)
    assert cq.poll(4, timeout_s=10.0) == [(7, _verbs.WC_SUCCESS, 0)]
    np.testing.assert_array_equal(dst, src)

    ctx.close()  # closes the QPs, MRs, CQ and PD first
    for closed_attr in (lambda: a.qp_num, lambda: src_mr.lkey, lambda: cq.cqe):
        with pytest.raises(ValueError, match="closed"):
            closed_attr()
    for obj in (a, b, src_mr, dst_mr, cq, pd, ctx):
        obj.close()  # idempotent
