"""`epd-lab demo` (`make demo`): a loopback transfer between two processes, path by path.

A peer process allocates and registers memory; this process writes into it with each path of the
engine, checks the bytes landed (crc32 on both sides), shows a refused write outside the peer's
registrations, and prints the peer's counters. Later stages of the project grow this into E→P→D.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

from epd_lab.transfer import RemoteAccessError, TransferEngine
from epd_lab.transfer.peer import PeerProcess

MiB = 1 << 20


def run(nbytes: int = 64 * MiB, repeats: int = 5) -> None:
    """Write `nbytes` `repeats` times over each path and print what moved and how fast."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    want = zlib.crc32(src)
    with PeerProcess(protocol="tcp") as peer:
        print(f"peer process pid {peer.pid} listening at {peer.session_id}")
        targets = {"managed": peer.alloc(nbytes, managed=True), "external": peer.alloc(nbytes)}
        print(f"peer registered 2 x {nbytes // MiB} MiB: a managed (memfd) buffer at 0x{targets['managed']:x} "
              f"and a numpy array at 0x{targets['external']:x}")
        print(f"\n{'path':16s} {'target':9s} {'moved':>9s} {'median':>10s} {'bytes ok':>9s}")
        for protocol, target in (("shm", "managed"), ("shm", "external"), ("tcp", "external")):
            dst = targets[target]
            peer.call("fill", ptr=dst, nbytes=nbytes, value=0)
            with TransferEngine(protocol=protocol) as engine:
                engine.register_buffer(src)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    engine.transfer_sync_write(peer.session_id, src.ctypes.data, dst, nbytes)
                    times.append(time.perf_counter() - t0)
                path = engine.path_to(peer.session_id)
                ok = peer.checksum(dst, nbytes) == want
                name = "shm_registered" if path == "shm" and target == "external" else path
                gbps = nbytes / float(np.median(times)) / 1e9
                print(f"{name:16s} {target:9s} {repeats * nbytes // MiB:6d} MiB {gbps:6.2f} GB/s {str(ok):>9s}")
                try:
                    engine.transfer_sync_write(peer.session_id, src.ctypes.data, dst + nbytes, 4096)
                except RemoteAccessError as exc:
                    refused = str(exc)
        print(f"\na write past the end of the peer's buffer: refused ({refused})")
        stats = peer.stats()
        print(f"peer counters: {stats['writes_in']} writes in, {stats['bytes_in'] // MiB} MiB in, "
              f"{stats['writes_refused']} refused, {stats['regions']} regions registered")
