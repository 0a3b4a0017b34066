"""`MooncakeTransferEngine` against a real Mooncake peer in another process, on loopback.

The peer is `_peer_main` below, started as ``python tests/test_mooncake.py --peer SIZE``; it talks JSON
lines over stdin/stdout. Skipped where Mooncake does not import.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from epd_lab.transfer import mooncake
from epd_lab.transfer.errors import PeerUnreachable, RegistrationError, TransferError, TransferTimeout
from epd_lab.transfer.mooncake import MooncakeTransferEngine
from helpers import freeze

if not mooncake.available():
    pytest.skip(f"Mooncake is unavailable: {mooncake.unavailable_reason()}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
PEER_SIZE = 1 << 20
REPLY_TIMEOUT_S = 15.0


def _peer_main(size: int) -> None:
    """The peer: register `size` zeroed bytes, announce them, then answer read/sha256/exit requests."""
    buf = np.zeros(size, dtype=np.uint8)
    with MooncakeTransferEngine(timeout=5) as engine:
        engine.register(buf.ctypes.data, size)
        hello = {"session_id": engine.session_id, "addr": buf.ctypes.data, "size": size}
        print(json.dumps(hello), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "read":
                start = req["offset"]
                reply: dict[str, Any] = {"hex": buf[start:start + req["length"]].tobytes().hex()}
            elif req["op"] == "sha256":
                reply = {"sha256": hashlib.sha256(buf.tobytes()).hexdigest()}
            elif req["op"] == "exit":
                engine.deregister(buf.ctypes.data)
                print(json.dumps({"ok": True}), flush=True)
                return
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
            print(json.dumps(reply), flush=True)


class Peer:
    """A running peer process and its announced buffer."""

    def __init__(self, size: int) -> None:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        # bufsize=0: select() then sees exactly what the peer wrote, no bytes hidden in a Python buffer
        self.proc = subprocess.Popen([sys.executable, __file__, "--peer", str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        hello = self._reply()
        self.session_id: str = hello["session_id"]
        self.addr: int = hello["addr"]
        self.size: int = hello["size"]

    def _reply(self) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"peer sent nothing within {REPLY_TIMEOUT_S} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"peer exited (rc={self.proc.poll()})")
        return json.loads(line)

    def request(self, **req: Any) -> dict[str, Any]:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        return self._reply()

    def read(self, offset: int, length: int) -> bytes:
        return bytes.fromhex(self.request(op="read", offset=offset, length=length)["hex"])

    def stop(self) -> None:
        """Ask the peer to exit; kill it if it does not (frozen, dead or stuck). Always reaps it."""
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)  # harmless when it is not stopped
                self.request(op="exit")
                self.proc.wait(timeout=REPLY_TIMEOUT_S)
        except (OSError, TimeoutError, EOFError, subprocess.TimeoutExpired, ValueError):
            pass  # teardown: whatever went wrong, the kill below ends it
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer(PEER_SIZE)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def engine() -> Iterator[MooncakeTransferEngine]:
    with MooncakeTransferEngine(timeout=5) as e:
        yield e


@pytest.fixture
def source(engine: MooncakeTransferEngine) -> Iterator[np.ndarray]:
    """64 KiB of random bytes registered with `engine`."""
    arr = np.random.default_rng(0).integers(0, 256, 64 << 10, dtype=np.uint8)
    engine.register(arr.ctypes.data, arr.nbytes)
    yield arr
    if not engine.closed and any(p == arr.ctypes.data for p, _, _ in engine.registrations()):
        engine.deregister(arr.ctypes.data)


def test_available() -> None:
    assert mooncake.available()
    assert mooncake.unavailable_reason() is None


def test_transfer_sync_write_lands_in_peer(engine: MooncakeTransferEngine, source: np.ndarray,
                                           peer: Peer) -> None:
    engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr + 4096, source.nbytes)
    assert peer.read(4096, source.nbytes) == source.tobytes()
    expected = np.zeros(peer.size, dtype=np.uint8)
    expected[4096:4096 + source.nbytes] = source
    assert peer.request(op="sha256")["sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()
    assert engine.stats()["writes_out"] == 1 and engine.stats()["bytes_out"] == source.nbytes


def test_batch_transfer_sync_write(engine: MooncakeTransferEngine, source: np.ndarray, peer: Peer) -> None:
    src = source.ctypes.data
    # (source offset, destination offset, length)
    blocks = [(0, 0, 1000), (5000, 200_000, 3000), (60_000, peer.size - 5536, 5536)]
    engine.batch_transfer_sync_write(peer.session_id, [src + s for s, _, _ in blocks],
                                     [peer.addr + d for _, d, _ in blocks], [n for _, _, n in blocks])
    for s, d, n in blocks:
        assert peer.read(d, n) == source[s:s + n].tobytes()
    expected = np.zeros(peer.size, dtype=np.uint8)
    for s, d, n in blocks:
        expected[d:d + n] = source[s:s + n]
    assert peer.request(op="sha256")["sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()


def test_write_from_managed_buffer(engine: MooncakeTransferEngine, peer: Peer) -> None:
    ptr = engine.allocate_managed_buffer(8192)
    payload = bytes(range(256)) * 32
    ctypes.memmove(ptr, payload, len(payload))
    engine.register(ptr, len(payload))
    try:
        engine.transfer_sync_write(peer.session_id, ptr, peer.addr, len(payload))
    finally:
        engine.deregister(ptr)
        engine.free_managed_buffer(ptr)
    assert peer.read(0, len(payload)) == payload
    assert engine.stats()["managed_buffers"] == 0


def test_register_misuse_raises(engine: MooncakeTransferEngine) -> None:
    arr = np.zeros(4096, dtype=np.uint8)
    base = arr.ctypes.data
    with pytest.raises(RegistrationError):
        engine.register(base, 0)
    engine.register(base, 4096)
    with pytest.raises(RegistrationError):
        engine.register(base, 4096)  # double registration
    with pytest.raises(RegistrationError):
        engine.register(base + 100, 100)  # overlap
    engine.deregister(base)
    with pytest.raises(RegistrationError):
        engine.deregister(base)  # already gone
    with pytest.raises(RegistrationError):
        engine.deregister(base + 8)  # never registered
    assert engine.stats()["regions"] == 0


def test_managed_buffer_misuse_raises(engine: MooncakeTransferEngine) -> None:
    ptr = engine.allocate_managed_buffer(4096)
    engine.register(ptr, 1024)
    with pytest.raises(RegistrationError):
        engine.free_managed_buffer(ptr)  # a region inside it is still registered
    engine.deregister(ptr)
    engine.free_managed_buffer(ptr)
    with pytest.raises(RegistrationError):
        engine.free_managed_buffer(ptr)


def test_write_argument_misuse_raises(engine: MooncakeTransferEngine, source: np.ndarray) -> None:
    unregistered = np.zeros(64, dtype=np.uint8)
    # argument checks come before any contact with the peer, so no peer is needed
    target = "127.0.0.1:1"
    with pytest.raises(RegistrationError):
        engine.transfer_sync_write(target, unregistered.ctypes.data, 0x1000, 64)
    with pytest.raises(RegistrationError):
        engine.transfer_sync_write(target, source.ctypes.data + source.nbytes - 8, 0x1000, 64)  # past the end
    with pytest.raises(ValueError):
        engine.transfer_sync_write(target, source.ctypes.data, 0x1000, 0)
    with pytest.raises(ValueError):
        engine.batch_transfer_sync_write(target, [], [], [])
    with pytest.raises(ValueError):
        engine.batch_transfer_sync_write(target, [source.ctypes.data], [0x1000, 0x2000], [8])


def test_write_outside_peer_registration(engine: MooncakeTransferEngine, source: np.ndarray,
                                         peer: Peer) -> None:
    with pytest.raises(TransferError) as info:
        engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr + peer.size - 10, 100)
    assert not isinstance(info.value, (PeerUnreachable, TransferTimeout))
    with pytest.raises(TransferError):
        engine.transfer_sync_write(peer.session_id, source.ctypes.data, 0x1000, 100)
    assert engine.stats()["failures_out"] == 2
    # the peer stays up and later valid writes still land
    engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr, 100)
    assert peer.read(0, 100) == source[:100].tobytes()


def test_dead_peer_raises_peer_unreachable(engine: MooncakeTransferEngine, source: np.ndarray,
                                           peer: Peer) -> None:
    engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr, 4096)
    peer.proc.kill()
    peer.proc.wait()
    with pytest.raises(PeerUnreachable):
        engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr, 4096)
    with pytest.raises(PeerUnreachable):
        engine.transfer_sync_write("127.0.0.1:1", source.ctypes.data, peer.addr, 4096)


def test_frozen_peer_raises_timeout(engine: MooncakeTransferEngine, source: np.ndarray, peer: Peer) -> None:
    # connect first: a first contact with a frozen peer waits in Mooncake's handshake (60 s measured)
    engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr, 4096)
    freeze(peer.proc.pid)  # SIGSTOP lands asynchronously: a small write could still be served before it
    with pytest.raises(TransferTimeout):  # after engine.timeout = 5 s
        engine.transfer_sync_write(peer.session_id, source.ctypes.data, peer.addr, 4096)


def test_close_is_idempotent_and_stops_the_server() -> None:
    engine = MooncakeTransferEngine(timeout=5)
    port = engine.get_rpc_port()
    arr = np.zeros(4096, dtype=np.uint8)
    engine.register(arr.ctypes.data, arr.nbytes)
    engine.allocate_managed_buffer(4096)
    engine.close()
    engine.close()
    assert engine.closed
    with pytest.raises(ValueError):
        engine.register(arr.ctypes.data, arr.nbytes)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0



@pytest.mark.parametrize(("timeout", "whole"), [(0.5, 5), (6.2, 7)])
def test_open_engine_rounds_the_timeout_up_to_whole_seconds_and_mooncakes_floor(timeout: float, whole: int) -> None:
    from epd_lab.transfer import open_engine

    with open_engine("mooncake", "127.0.0.1", timeout) as engine:
        assert type(engine) is MooncakeTransferEngine
        assert (engine.timeout, engine.protocol, engine.hostname) == (whole, "tcp", "127.0.0.1")

if __name__ == "__main__" and sys.argv[1:2] == ["--peer"]:
    _peer_main(int(sys.argv[2]))
