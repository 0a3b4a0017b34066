"""The `cuda` transport: GPU memory written through CUDA IPC, checked against the owner's published table.

The table check (`epd_lab.transfer.cuda_table`) runs on every machine against a real owner process: it
must see what the native owner registered and refuse and pin as the shm path does. What needs a GPU is
marked `cuda` and skips with the reason where there is none (CI has no GPU); it runs on the device
machine, whose log is committed under data/bench/logs/.
"""
from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest

from epd_lab.transfer import RemoteAccessError, TransferEngine, TransportUnavailable, open_engine
from epd_lab.transfer.cuda_runtime import unavailable_reason
from epd_lab.transfer.cuda_table import PeerTable
from epd_lab.transfer.peer import PeerProcess

NO_GPU = unavailable_reason()


def gpu(test):
    """Mark a test `cuda` and skip it, with the reason, where there is no GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")(test))


KiB, MiB = 1 << 10, 1 << 20


# ---- the table check, on every machine ----------------------------------------------------------------

@pytest.fixture
def host_peer():
    with PeerProcess(protocol="tcp") as p:
        yield p


def _table(peer: PeerProcess) -> PeerTable:
    """Map the peer's table as the cuda transport does: HELLO over the engine's own connection."""
    from epd_lab import _native
    from epd_lab.transfer import parse_session_id

    host, port = parse_session_id(peer.session_id)
    conn = _native.TcpConn(host, port, 5000)
    try:
        return PeerTable(*conn.hello())
    finally:
        conn.close()


def test_table_sees_the_native_owners_registrations_and_keys(host_peer):
    a = host_peer.call("alloc", nbytes=MiB)
    table = _table(host_peer)
    try:
        d = np.array([a["ptr"], a["ptr"] + MiB - 4096], dtype=np.uint64)
        ln = np.array([4096, 4096], dtype=np.uint64)
        table.pin(d, ln, [a["key"], a["key"]]).release(landed=True)
        s = host_peer.stats()
        assert (s["writes_in"], s["bytes_in"], s["writes_refused"]) == (2, 8192, 0)
        with pytest.raises(RemoteAccessError, match="under that key"):
            table.pin(d[:1], ln[:1], [a["key"] + 1])  # a key the owner never gave for this region
        with pytest.raises(RemoteAccessError, match="not inside memory it registered"):
            table.pin(d[1:] + np.uint64(1), ln[1:])  # one byte past the end
        assert host_peer.stats()["writes_refused"] == 2
        many = np.arange(64, dtype=np.uint64) * np.uint64(4096) + np.uint64(a["ptr"])  # the vectorised path
        table.pin(many, np.full(64, 4096, dtype=np.uint64), np.full(64, a["key"], dtype=np.uint64)).release(True)
        with pytest.raises(RemoteAccessError):
            table.pin(many + np.uint64(MiB - 64 * 4096 + 1), np.full(64, 4096, dtype=np.uint64))  # the last one out
        s = host_peer.stats()
        assert (s["writes_in"], s["writes_refused"]) == (2 + 64, 3)
    finally:
        table.close()


def test_table_refuses_deregistered_memory(host_peer):
    ptr = host_peer.alloc(MiB)
    table = _table(host_peer)
    try:
        one = (np.array([ptr], dtype=np.uint64), np.array([64], dtype=np.uint64))
        table.pin(*one).release(landed=False)
        host_peer.call("deregister", ptr=ptr)
        with pytest.raises(RemoteAccessError):
            table.pin(*one)
        assert host_peer.stats()["writes_refused"] == 1
    finally:
        table.close()


def test_a_pin_holds_the_owners_deregister_until_released(host_peer):
    ptr = host_peer.alloc(MiB)
    table = _table(host_peer)
    try:
        pins = table.pin(np.array([ptr], dtype=np.uint64), np.array([MiB], dtype=np.uint64))
        threading.Timer(0.5, pins.release, kwargs={"landed": True}).start()
        t0 = time.monotonic()
        host_peer.call("deregister", ptr=ptr)  # waits for the pinned write, as for an shm write in flight
        assert time.monotonic() - t0 >= 0.4
        assert host_peer.stats()["writes_in"] == 1
    finally:
        table.close()


def test_table_of_another_process_is_refused_on_a_wrong_nonce(host_peer):
    from epd_lab import _native
    from epd_lab.transfer import PeerUnreachable, parse_session_id

    conn = _native.TcpConn(*parse_session_id(host_peer.session_id), 5000)
    pid, fd, nonce = conn.hello()
    conn.close()
    with pytest.raises(PeerUnreachable, match="does not match its HELLO"):
        PeerTable(pid, fd, nonce ^ 1)


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is here: the transport is available")
def test_cuda_protocol_without_a_gpu_says_why():
    with pytest.raises(TransportUnavailable, match="protocol='cuda'"):
        open_engine("cuda")


# ---- with a GPU (marked cuda) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_peer():
    from epd_lab.transfer.cuda_peer import CudaPeerProcess

    with CudaPeerProcess(protocol="auto", timeout=10.0) as p:
        yield p


@pytest.fixture(scope="module")
def gpu_writer():
    import torch

    src = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda")
    with TransferEngine(protocol="auto", timeout=10.0) as eng:
        eng.register(src.data_ptr(), src.numel())
        yield eng, src


def _crc(t) -> int:
    return zlib.crc32(t.cpu().numpy())


@gpu
@pytest.mark.parametrize("size", [1, 4096, MiB + 3, 32 * MiB])
def test_gpu_write_lands_in_peer_gpu_memory(gpu_peer, gpu_writer, size):
    eng, src = gpu_writer
    dst = gpu_peer.cuda_alloc(size + 64)
    try:
        eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr() + 7, dst + 64, size)
        assert gpu_peer.cuda_checksum(dst + 64, size) == _crc(src[7:7 + size])
        assert gpu_peer.cuda_read(dst, 64) == bytes(64)  # nothing before the destination
        assert eng.stats()["cuda_bytes_out"] >= size
    finally:
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_scattered_batch_is_one_kernel_and_lands_in_order(gpu_peer, gpu_writer):
    eng, src = gpu_writer
    blocks, block = 256, 64 * KiB
    dst = gpu_peer.cuda_alloc(2 * blocks * block)
    order = np.random.default_rng(0).permutation(blocks)
    try:
        srcs = [src.data_ptr() + i * block for i in range(blocks)]
        dsts = [dst + int(j) * 2 * block for j in order]
        eng.batch_transfer_sync_write(gpu_peer.session_id, srcs, dsts, [block] * blocks)
        for i in (0, 17, 255):
            assert gpu_peer.cuda_checksum(dsts[i], block) == _crc(src[i * block:(i + 1) * block])
        assert gpu_peer.cuda_read(dst + int(np.flatnonzero(order == 0)[0]) * 2 * block + block, 16) == bytes(16)
        # odd sizes and offsets take the kernel's byte path
        eng.batch_transfer_sync_write(gpu_peer.session_id, [s + 3 for s in srcs[:8]], [d + 5 for d in dsts[:8]],
                                      [1001] * 8)
        assert gpu_peer.cuda_checksum(dsts[3] + 5, 1001) == _crc(src[3 * block + 3:3 * block + 1004])
    finally:
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_a_thread_that_made_no_cuda_call_registers_and_writes(gpu_peer):
    """A server's new pool thread: its first CUDA work is the engine's driver calls (the allocation lookup of a
    registration's export, the batch kernel's launch), which need a current context. The first H200 run of the
    roles failed 2 of 16 sends at concurrency 16 with driver error 201 there."""
    import torch

    blocks, block = 16, 64 * KiB
    src = torch.randint(0, 256, (blocks * block,), dtype=torch.uint8, device="cuda")
    dst = gpu_peer.cuda_alloc(blocks * block)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with TransferEngine(protocol="auto", timeout=10.0) as eng:
                eng.register(src.data_ptr(), src.numel())
                eng.batch_transfer_sync_write(gpu_peer.session_id, [src.data_ptr() + i * block for i in range(blocks)],
                                              [dst + i * block for i in range(blocks)], [block] * blocks)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join(60)
        assert not t.is_alive() and not errors, errors
        assert gpu_peer.cuda_checksum(dst, blocks * block) == _crc(src)
    finally:
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_gpu_writes_outside_or_after_deregister_are_refused_and_counted(gpu_peer, gpu_writer):
    eng, src = gpu_writer
    dst = gpu_peer.cuda_alloc(MiB)
    refused = gpu_peer.stats()["writes_refused"]
    with pytest.raises(RemoteAccessError):
        eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), dst + MiB - 8, 16)  # past the end
    with pytest.raises(RemoteAccessError):
        eng.batch_transfer_sync_write(gpu_peer.session_id, [src.data_ptr()] * 8,
                                      [dst + i * 4096 for i in range(7)] + [dst + MiB], [4096] * 8)
    gpu_peer.call("deregister", ptr=dst)
    with pytest.raises(RemoteAccessError):
        eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), dst, 4096)
    assert gpu_peer.stats()["writes_refused"] == refused + 3
    assert gpu_peer.cuda_read(dst, 16) == bytes(16)  # nothing landed
    gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_gpu_source_to_peer_host_memory_is_staged(gpu_peer, gpu_writer):
    eng, src = gpu_writer
    dst = gpu_peer.alloc(4 * MiB)
    eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), dst, 4 * MiB)
    assert gpu_peer.checksum(dst, 4 * MiB) == _crc(src[:4 * MiB])
    assert eng.stats()["cuda_staged_bytes"] >= 4 * MiB


@gpu
def test_host_source_to_peer_gpu_memory(gpu_peer, gpu_writer):
    eng, _ = gpu_writer
    host = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8)
    eng.register(host.ctypes.data, MiB)
    dst = gpu_peer.cuda_alloc(MiB)
    try:
        eng.transfer_sync_write(gpu_peer.session_id, host.ctypes.data, dst, MiB)
        assert gpu_peer.cuda_checksum(dst, MiB) == zlib.crc32(host)
    finally:
        eng.deregister(host.ctypes.data)
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_tcp_peer_refuses_gpu_destination_with_the_reason(gpu_peer):
    import torch

    src = torch.ones(4096, dtype=torch.uint8, device="cuda")
    dst = gpu_peer.cuda_alloc(4096)
    try:
        with TransferEngine(protocol="tcp") as eng:  # as if the peer were on another host
            eng.register(src.data_ptr(), 4096)
            with pytest.raises(TransportUnavailable, match="another host"):
                eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), dst, 4096)
    finally:
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_cuda_protocol_opens_and_deregister_unexports(gpu_peer):
    import torch

    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    with open_engine("cuda") as eng:
        eng.register(t.data_ptr(), MiB)
        assert eng.stats()["cuda_regions"] == 1
        eng.deregister(t.data_ptr())
        assert (eng.stats()["cuda_regions"], eng.stats()["cuda_exports"]) == (0, 0)



@gpu
def test_write_into_the_peers_memory_on_another_gpu(gpu_peer, gpu_writer):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (kind nvidia-h200-x2)")
    eng, src = gpu_writer
    dst = gpu_peer.cuda_alloc(4 * MiB, device=1)
    try:
        eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), dst, 4 * MiB)  # peer to peer, through IPC
        eng.batch_transfer_sync_write(gpu_peer.session_id, [src.data_ptr() + i * 4096 for i in range(64)],
                                      [dst + (63 - i) * 4096 for i in range(64)], [4096] * 64)
        assert gpu_peer.cuda_checksum(dst + 64 * 4096, 4 * MiB - 64 * 4096) == _crc(src[64 * 4096:4 * MiB])
        assert gpu_peer.cuda_checksum(dst, 4096) == _crc(src[63 * 4096:64 * 4096])
    finally:
        gpu_peer.call("deregister", ptr=dst)
        gpu_peer.call("cuda_free", ptr=dst)


@gpu
def test_an_address_registered_again_in_a_new_allocation_is_written_there(gpu_peer, gpu_writer):
    eng, src = gpu_writer
    size = 96 * MiB  # a segment of its own, which empty_cache gives back to the driver
    first = gpu_peer.cuda_alloc(size)
    eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr(), first, MiB)  # maps the first allocation
    gpu_peer.call("deregister", ptr=first)
    gpu_peer.call("cuda_free", ptr=first, release=True)
    second = gpu_peer.cuda_alloc(size)  # often at the same address, always under a new IPC handle and key
    try:
        eng.transfer_sync_write(gpu_peer.session_id, src.data_ptr() + MiB, second, MiB)
        assert gpu_peer.cuda_checksum(second, MiB) == _crc(src[MiB:2 * MiB])
    finally:
        gpu_peer.call("deregister", ptr=second)
        gpu_peer.call("cuda_free", ptr=second, release=True)
