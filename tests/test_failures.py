"""Dead, frozen and unreachable peers fail within the timeout; garbage on the port never writes anywhere;
a deregister waits for a write in flight."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from epd_lab._native import OP_WRITE, ST_OK, ST_REFUSED, WIRE_MAGIC, WIRE_VERSION
from epd_lab.transfer import PeerUnreachable, TransferEngine, TransferTimeout, parse_session_id
from epd_lab.transfer.peer import PeerError, PeerProcess
from epd_lab.wire_types import WIRE_REP, WIRE_REQ
from helpers import free_port, freeze, proc_state, wait_for

MiB = 1 << 20


def write_header(seq: int, addr: int, length: int, magic: int = WIRE_MAGIC, version: int = WIRE_VERSION) -> bytes:
    """The header of an engine WRITE (epd_wire_req) as a raw client sends it, with no secret."""
    return WIRE_REQ.pack(magic, version, OP_WRITE, seq, addr, length, 0)


@pytest.fixture
def src():
    a = np.arange(MiB, dtype=np.uint32).view(np.uint8)[:MiB].copy()
    return a


def raw_conn(session_id: str) -> socket.socket:
    s = socket.create_connection(parse_session_id(session_id), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_unreachable_peer_fails_fast(src):
    port = free_port()
    with TransferEngine(timeout=1.0) as e:
        e.register_buffer(src)
        with pytest.raises(PeerUnreachable, match="connect"):
            e.transfer_sync_write(f"127.0.0.1:{port}", src.ctypes.data, 0x1000, 16)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_dead_peer_is_an_error(src, protocol):
    with PeerProcess(protocol="tcp") as peer, TransferEngine(protocol=protocol, timeout=1.0) as e:
        e.register_buffer(src)
        dst = peer.alloc(MiB, managed=True)
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
        peer.proc.kill()
        peer.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable):
            e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
        assert time.monotonic() - t0 < 5
        assert e.stats()["failures_out"] == 1


def test_frozen_peer_times_out_over_tcp(src):
    """Mooncake waits 30 s here (5 s at its floor); we fail after the engine's timeout."""
    with PeerProcess(protocol="tcp") as peer, TransferEngine(protocol="tcp", timeout=0.5) as e:
        e.register_buffer(src)
        dst = peer.alloc(MiB)
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
        freeze(peer.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="no progress for 500 ms"):
                e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
            assert time.monotonic() - t0 < 5
            # a fresh engine whose first contact is the frozen peer (Mooncake: 60 s) fails the same way
            with TransferEngine(protocol="auto", timeout=0.5) as fresh:
                with pytest.raises(TransferTimeout):
                    fresh.path_to(peer.session_id)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        # the peer thawed: the engine reconnects and writes again
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
        assert peer.checksum(dst, MiB) == zlib.crc32(src)


def test_garbage_on_the_port_never_writes(peer):
    dst = peer.alloc(MiB, fill=0x5A)
    want = zlib.crc32(bytes([0x5A]) * MiB)
    outside = peer.alloc(MiB, register=False, fill=0x5A)  # exists in the peer, but is not registered
    rng = np.random.default_rng(7)
    # random bytes, a wrong magic, a wrong version, a truncated header
    for junk in (rng.bytes(4096), write_header(0, dst, 16, magic=0xDEADBEEF) + bytes(16),
                 write_header(0, dst, 16, version=99) + bytes(16), write_header(0, dst, 16)[:20]):
        with raw_conn(peer.session_id) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(64) == b""  # the engine closed the connection without answering
    # a forged, well-formed write into unregistered memory is refused and drained
    with raw_conn(peer.session_id) as s:
        s.sendall(write_header(42, outside, 4096) + bytes(4096))
        magic, status, seq, _ = WIRE_REP.unpack(s.recv(WIRE_REP.size, socket.MSG_WAITALL))
        assert (magic, status, seq) == (WIRE_MAGIC, ST_REFUSED, 42)
        # an absurd length is not drained: the connection is closed
        s.sendall(write_header(43, outside, 1 << 50))
        assert s.recv(64) == b""
    assert peer.checksum(dst, MiB) == want
    assert peer.checksum(outside, MiB) == want
    assert peer.stats()["writes_refused"] == 2
    # and the engine still serves real writes
    src = np.ones(4096, dtype=np.uint8)
    with TransferEngine(protocol="tcp") as e:
        e.register_buffer(src)
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, 4096)
    assert peer.read(dst, 4) == b"\x01" * 4


def test_deregister_waits_for_a_write_in_flight():
    with PeerProcess(protocol="tcp", timeout=3.0) as peer:
        dst = peer.alloc(MiB)
        payload = bytes(range(256)) * (MiB // 256)
        with raw_conn(peer.session_id) as s:
            s.sendall(write_header(1, dst, MiB) + payload[: MiB // 2])

            def finish() -> None:
                time.sleep(0.5)
                s.sendall(payload[MiB // 2:])

            wait_for(lambda: peer.stats()["writes_in_flight"] == 1, 10, "the owner pinned the region for the write",
                     interval=0.01)
            t = threading.Thread(target=finish)
            t.start()
            peer.call("deregister", ptr=dst)  # returns only once the write in flight has landed
            t.join()
            assert WIRE_REP.unpack(s.recv(WIRE_REP.size, socket.MSG_WAITALL))[1] == ST_OK
        assert peer.checksum(dst, MiB) == zlib.crc32(payload)
        assert peer.stats()["deregister_timeouts"] == 0


def test_a_stalled_tcp_writer_is_cut_off():
    """A writer that stops mid-payload loses its connection after the idle timeout, which releases the
    region: the deregister waiting for it returns."""
    with PeerProcess(protocol="tcp", timeout=0.5) as peer:
        dst = peer.alloc(MiB)
        with raw_conn(peer.session_id) as s:
            s.sendall(write_header(1, dst, MiB) + bytes(1000))  # then the writer stalls
            wait_for(lambda: peer.stats()["writes_in_flight"] == 1, 10, "the stalled write in flight", interval=0.01)
            t0 = time.monotonic()
            peer.call("deregister", ptr=dst, timeout=10)
            assert time.monotonic() - t0 < 5
            assert s.recv(64) == b""
        s = peer.stats()
        assert (s["deregister_timeouts"], s["regions"], s["writes_in_flight"]) == (0, 0, 0)


FROZEN_WRITER = """
import sys, numpy as np
from epd_lab.transfer import RemoteAccessError, TransferEngine
sid, dst, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
src = np.ones(n, dtype=np.uint8)
with TransferEngine(protocol="shm") as e:
    e.register_buffer(src)
    print("ready", flush=True)
    while True:
        try:
            e.transfer_sync_write(sid, src.ctypes.data, dst, n)
        except RemoteAccessError:  # between a deregister and the register that follows it
            pass
"""


@contextlib.contextmanager
def _writer(peer: PeerProcess, dst: int, n: int) -> Iterator[subprocess.Popen]:
    """A `FROZEN_WRITER` process writing `n` bytes to `dst` in `peer` over and over, once it said it is ready;
    killed and reaped on exit."""
    w = subprocess.Popen([sys.executable, "-c", FROZEN_WRITER, peer.session_id, str(dst), str(n)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        yield w
    finally:
        w.kill()
        w.wait()
        w.stdout.close()


def test_deregister_of_a_frozen_shm_writer_is_bounded():
    """An shm writer frozen mid-copy pins the region; deregister gives up after twice the timeout and
    says so (the one case where late bytes can still land: in pool memory, never elsewhere)."""
    n = 256 * MiB
    with PeerProcess(protocol="tcp", timeout=0.5) as peer:
        dst = peer.alloc(n, managed=True)
        with _writer(peer, dst, n) as w:
            # attached: its first shm peer may calibrate the copy first (alone, this test then missed mid-copy)
            wait_for(lambda: peer.stats()["writes_in"], 60, "the writer never wrote")
            for _ in range(20):  # a 256 MiB copy takes ~25 ms and the loop ~10 us: freeze until mid-copy
                time.sleep(0.05)
                freeze(w.pid)
                try:
                    peer.call("deregister", ptr=dst, timeout=10)
                except PeerError as exc:
                    assert "stalled mid-write" in str(exc)
                    break
                os.kill(w.pid, signal.SIGCONT)
                peer.call("register", ptr=dst, nbytes=n)
            else:
                pytest.fail("never froze the writer mid-copy in 20 tries")
        s = peer.stats()
        assert (s["deregister_timeouts"], s["regions"]) == (1, 0)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_a_shm_writer_killed_mid_write_leaves_no_pin(managed):
    """A same-host writer killed mid-copy never releases its pins; the owner sees its process gone and drops
    them: writes_in_flight goes back to 0 (while the writer is still an unreaped zombie too) and the region
    deregisters at once, with no timeout. Managed memory is a memcpy into the mapping, external memory a
    process_vm_writev: both pin."""
    n = 256 * MiB
    with PeerProcess(protocol="tcp", timeout=2.0) as peer:
        dst = peer.alloc(n, managed=managed)
        with _writer(peer, dst, n) as w:
            # attached: its first shm peer may calibrate the copy first
            wait_for(lambda: peer.stats()["writes_in"], 60, "the writer never wrote")
            for _ in range(40):  # a 256 MiB copy takes ~25-50 ms and the loop ~10 us: freeze until mid-copy
                time.sleep(0.03)
                freeze(w.pid)
                if peer.stats()["writes_in_flight"] == 1:
                    break
                os.kill(w.pid, signal.SIGCONT)
            else:
                pytest.fail("never froze the writer mid-copy in 40 tries")
            assert peer.stats()["writes_in_flight"] == 1  # frozen, alive: its pin holds
            os.kill(w.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10  # for both waits
            wait_for(lambda: proc_state(w.pid) == "Z", 10, "the killed writer exited", interval=0.005)
            # a zombie, its pid not reaped yet: gone once its last thread has exited (its pidfd then polls readable)
            s = wait_for(lambda: (st := peer.stats())["writes_in_flight"] == 0 and st, deadline - time.monotonic(),
                         "the dead writer's pin dropped", interval=0.01)
            assert s["pins_reaped"] == 1
            peer.call("deregister", ptr=dst, timeout=10)  # would wait 2 x 2 s and fail with "stalled mid-write"
        s = peer.stats()
        assert (s["deregister_timeouts"], s["regions"], s["writes_in_flight"]) == (0, 0, 0)
        peer.call("register", ptr=dst, nbytes=n)  # the address takes a new registration, unpinned
        assert peer.stats()["writes_in_flight"] == 0
