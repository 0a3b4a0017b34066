"""Writes land in the peer's registered memory, checked by the owner, on every path (two processes)."""
from __future__ import annotations

import os
import signal
import zlib

import numpy as np
import pytest

from epd_lab.transfer import RegistrationError, RemoteAccessError, TransferEngine, TransferStatus
from procs import freeze

MiB = 1 << 20


def src_crc(writer, offset: int, n: int) -> int:
    return zlib.crc32(writer.src[offset:offset + n])


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
@pytest.mark.parametrize("size", [1, 4096, MiB + 3, 4 * MiB])
def test_write_lands_in_peer_memory(peer, writer, managed, size):
    dst = peer.alloc(4 * MiB, managed=managed)
    writer.transfer_sync_write(peer.session_id, writer.src.ctypes.data, dst, size)
    # the writer has returned: the bytes are in place, and nothing else was touched
    assert peer.checksum(dst, size) == src_crc(writer, 0, size)
    assert peer.read(dst + size, 1) == b"\0" if size < 4 * MiB else True
    assert writer.path_to(peer.session_id) == writer.protocol
    s = peer.stats()
    assert (s["writes_in"], s["bytes_in"], s["writes_refused"]) == (1, size, 0)
    assert writer.stats()["bytes_out"] == size


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_scattered_batch(peer, writer, managed):
    block, n = 4096, 256
    dst = peer.alloc(2 * n * block, managed=managed)
    order = np.random.default_rng(3).permutation(n)
    srcs = [writer.src.ctypes.data + i * block for i in range(n)]
    dsts = [dst + int(j) * 2 * block for j in order]
    writer.batch_transfer_sync_write(peer.session_id, srcs, dsts, [block] * n)
    got = peer.read(dst, 2 * n * block)
    for i, j in enumerate(order):
        assert got[2 * j * block:(2 * j + 1) * block] == writer.src[i * block:(i + 1) * block].tobytes()
        assert got[(2 * j + 1) * block:(2 * j + 2) * block] == bytes(block)  # the gaps stay untouched
    assert peer.stats()["writes_in"] == n


def test_async_batch_status(peer, writer):
    dst = peer.alloc(MiB)
    bid = writer.batch_transfer_async_write(peer.session_id, [writer.src.ctypes.data], [dst], [MiB])
    assert writer.get_batch_transfer_status(bid) in (TransferStatus.PENDING, TransferStatus.COMPLETED)
    writer.wait_batch(bid, timeout=10)
    assert peer.checksum(dst, MiB) == src_crc(writer, 0, MiB)
    bad = writer.batch_transfer_async_write(peer.session_id, [writer.src.ctypes.data], [dst + 1], [MiB])
    with pytest.raises(RemoteAccessError):
        writer.wait_batch(bad, timeout=10)
    with pytest.raises(ValueError, match="unknown batch"):
        writer.get_batch_transfer_status(bad)  # forgotten after wait_batch


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_owner_refuses_writes_outside_its_registrations(peer, writer, managed):
    dst = peer.alloc(MiB, managed=managed)
    src = writer.src.ctypes.data
    cases = [(dst + MiB - 10, 11), (dst - 1, 2), (dst + MiB, 1), (dst + 2 * MiB, 4096)]
    for addr, n in cases:
        with pytest.raises(RemoteAccessError, match="not inside memory it registered"):
            writer.transfer_sync_write(peer.session_id, src, addr, n)
    # a batch with one bad block fails as a whole
    with pytest.raises(RemoteAccessError):
        writer.batch_transfer_sync_write(peer.session_id, [src, src], [dst, dst + MiB], [16, 16])
    # the owner counted every refusal, kept serving, and its memory holds no byte of the refused writes
    s = peer.stats()
    assert s["writes_refused"] == len(cases) + 1
    assert peer.checksum(dst + 16, MiB - 16) == zlib.crc32(bytes(MiB - 16))
    writer.transfer_sync_write(peer.session_id, src, dst, 4096)
    assert peer.checksum(dst, 4096) == src_crc(writer, 0, 4096)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_deregistered_memory_refuses_writes(peer, writer, managed):
    dst = peer.alloc(MiB, managed=managed)
    writer.transfer_sync_write(peer.session_id, writer.src.ctypes.data, dst, MiB)
    peer.call("deregister", ptr=dst)
    with pytest.raises(RemoteAccessError):
        writer.transfer_sync_write(peer.session_id, writer.src.ctypes.data, dst, 16)
    peer.call("register", ptr=dst, nbytes=MiB)
    writer.transfer_sync_write(peer.session_id, writer.src.ctypes.data, dst, 16)


def test_unregistered_source_is_refused_locally(peer, writer):
    dst = peer.alloc(4096)
    other = np.ones(4096, dtype=np.uint8)
    with pytest.raises(RegistrationError, match="source"):
        writer.transfer_sync_write(peer.session_id, other.ctypes.data, dst, 4096)
    with pytest.raises(ValueError, match="positive"):
        writer.transfer_sync_write(peer.session_id, writer.src.ctypes.data, dst, 0)
    with pytest.raises(ValueError, match="equal"):
        writer.batch_transfer_sync_write(peer.session_id, [1, 2], [3], [4])
    assert peer.stats()["writes_in"] == 0


def test_shm_write_lands_while_the_owner_is_frozen(peer):
    """As with RDMA, the owner's CPU takes no part: a SIGSTOPped owner still receives the bytes."""
    dst = peer.alloc(MiB, managed=True)
    src = np.full(MiB, 42, dtype=np.uint8)
    with TransferEngine(protocol="shm", timeout=2.0) as e:
        e.register_buffer(src)
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, 16)  # connect while it runs
        freeze(peer.pid)
        try:
            e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, MiB)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
    assert peer.checksum(dst, MiB) == zlib.crc32(src)


def test_tensors_both_ways(peer):
    torch = pytest.importorskip("torch")
    emb = torch.randn(64, 256, dtype=torch.bfloat16)
    nbytes = emb.numel() * emb.element_size()
    dst = peer.alloc(nbytes, managed=True)
    with TransferEngine(protocol="auto") as e:
        e.register_buffer(emb)
        assert e.write_buffer(peer.session_id, emb, dst) == nbytes
        assert e.path_to(peer.session_id) == "shm"
        back = torch.frombuffer(bytearray(peer.read(dst, nbytes)), dtype=torch.bfloat16).view(64, 256)
        assert torch.equal(back, emb)
        # the peer writes back into this engine's registered tensor
        out = torch.zeros_like(emb)
        e.register_buffer(out)
        peer.call("write", session_id=e.session_id, src=dst, dst=out.data_ptr(), nbytes=nbytes)
        assert torch.equal(out, emb)
        assert e.stats()["bytes_in"] == nbytes


def test_auto_uses_tcp_when_shm_attach_fails(peer, monkeypatch):
    """`auto` falls back to tcp for a peer whose table cannot be mapped (another host); `shm` refuses."""
    from epd_lab import _native
    from epd_lab.transfer import PeerUnreachable, TransportUnavailable

    def no_map(*args):
        raise PeerUnreachable("cannot open the peer's registration table (another host)")

    monkeypatch.setattr(_native, "ShmPeer", no_map)
    dst = peer.alloc(4096)
    src = np.ones(4096, dtype=np.uint8)
    with TransferEngine(protocol="auto") as e:
        e.register_buffer(src)
        e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, 4096)
        assert e.path_to(peer.session_id) == "tcp"
    with TransferEngine(protocol="shm") as e:
        with pytest.raises(TransportUnavailable, match="protocol='tcp'"):
            e.path_to(peer.session_id)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_a_write_naming_an_old_registration_is_refused(peer, writer, managed):
    """Keys play the rkey's role: after deregister + register at the same address, a write that names
    the old registration is refused, while bounds-only writes (key 0) and the new key land."""
    reply = peer.call("alloc", nbytes=MiB, managed=managed)
    dst, old_key = reply["ptr"], reply["key"]
    src = writer.src.ctypes.data
    writer.transfer_sync_write(peer.session_id, src, dst, 4096, rkey=old_key)
    peer.call("deregister", ptr=dst)
    new_key = peer.call("register", ptr=dst, nbytes=MiB)["key"]
    assert new_key != old_key
    with pytest.raises(RemoteAccessError, match="under that key"):
        writer.transfer_sync_write(peer.session_id, src, dst, 4096, rkey=old_key)
    with pytest.raises(RemoteAccessError):
        writer.batch_transfer_sync_write(peer.session_id, [src, src], [dst, dst + 4096], [16, 16], [new_key, old_key])
    writer.transfer_sync_write(peer.session_id, src, dst, 4096, rkey=new_key)
    writer.transfer_sync_write(peer.session_id, src, dst, 4096)
    assert peer.stats()["writes_refused"] == 2
