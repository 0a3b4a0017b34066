"""Writes land in the peer's registered memory, checked by the owner, on every path (two processes)."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pytest

import epd_lab.transfer
from epd_lab.transfer import (
    ENGINES,
    RegistrationError,
    RemoteAccessError,
    TransferEngine,
    TransferStatus,
    open_engine,
    register_transport,
    registry,
    transports,
)
from epd_lab.transfer.peer import PeerProcess
from helpers import find_circle, freeze

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


@pytest.mark.parametrize("theirs, path", [("node-a", "shm"), ("node-b", "tcp"), ("", "shm")],
                         ids=["same-host", "other-host", "unnamed"])
def test_auto_follows_the_host_ids_the_engines_name(monkeypatch, theirs, path):
    """Two engines that name different hosts in EPD_HOST_ID (Ray nodes on one machine) write over tcp though one
    kernel runs both; the same name, or a peer that names none, leaves the choice to the kernel (shm here)."""
    from epd_lab.transfer import TransportUnavailable

    with PeerProcess(protocol="auto", timeout=2.0, env={**os.environ, "EPD_HOST_ID": theirs}) as peer:
        monkeypatch.setenv("EPD_HOST_ID", "node-a")
        dst = peer.alloc(4096)
        src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
        with TransferEngine(protocol="auto", timeout=2.0) as e:
            e.register_buffer(src)
            e.transfer_sync_write(peer.session_id, src.ctypes.data, dst, 4096)
            assert e.path_to(peer.session_id) == path
            assert e.stats()[f"bytes_out_{path}"] == 4096
        assert peer.checksum(dst, 4096) == zlib.crc32(src)
        if path == "tcp":
            with TransferEngine(protocol="shm", timeout=2.0) as e:
                with pytest.raises(TransportUnavailable, match="on host 'node-b'.*EPD_HOST_ID"):
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


# ---- transports by name (epd_lab.transfer.registry) and the import graph of the package ----

PKG = "epd_lab.transfer"
PKG_DIR = Path(epd_lab.transfer.__file__).parent


def _module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes that run when the module is imported: all but function bodies (class bodies run)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _package_imports(nodes: Iterable[ast.AST]) -> set[str]:
    """The modules of epd_lab.transfer these import statements name, short (``engine``); the package
    itself is ``__init__``, and ``from epd_lab.transfer import verbs`` names ``verbs``."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative; nothing in the package sits deeper than one level
                module = f"{PKG}.{module}".rstrip(".")
            names = [f"{module}.{a.name}" if module == PKG and (PKG_DIR / f"{a.name}.py").exists() else module
                     for a in node.names]
        else:
            continue
        found.update("__init__" if n == PKG else n.removeprefix(f"{PKG}.") for n in names
                     if n == PKG or n.startswith(f"{PKG}."))
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports anywhere in it, lazy imports inside functions included:
    a lazy import still makes the two modules depend on each other (one such circle was found here)."""
    return {path.stem: _package_imports(ast.walk(ast.parse(path.read_text())))
            for path in sorted(PKG_DIR.glob("*.py"))}


def test_the_transfer_package_imports_no_circle():
    graph = _import_graph()
    # the scan sees module-level imports and lazy ones inside functions (engine's verbs)
    assert {"registration", "verbs"} <= graph["engine"]
    assert "registration" in graph["mooncake"] and "mooncake" not in graph["engine"]
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))
    assert find_circle({**graph, "registration": {"engine"}}) is not None  # and it would find one


def test_no_transport_imports_the_registry_at_module_level():
    targets = {t.module_path for t in registry._TRANSPORTS.values()}
    assert targets == {"epd_lab.transfer.engine", "epd_lab.transfer.mooncake"}
    for module in targets:
        path = PKG_DIR / f"{module.rpartition('.')[2]}.py"
        assert "registry" not in _package_imports(_module_level(ast.parse(path.read_text()))), module


def test_the_builtin_transports_are_the_engine_protocols_and_mooncake():
    from epd_lab.transfer.engine import PROTOCOLS

    assert ENGINES == transports() == (*PROTOCOLS, "mooncake")


def test_opening_an_engine_imports_only_its_transport():
    """In a fresh process: neither listing the transports nor opening ``tcp`` imports Mooncake's adapter."""
    code = textwrap.dedent("""
        import sys
        from epd_lab.transfer import registry
        print("mooncake" in registry.transports(), "epd_lab.transfer.mooncake" in sys.modules)
        with registry.open_engine("tcp", "127.0.0.1", 1.0) as e:
            print(type(e).__name__, e.protocol, "epd_lab.transfer.mooncake" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False", "TransferEngine", "tcp", "False"]


@pytest.fixture
def scratch_registry(monkeypatch, tmp_path):
    """The registry as it is, restored after the test; `tmp_path` importable."""
    monkeypatch.setattr(registry, "_TRANSPORTS", dict(registry._TRANSPORTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("fake_transport", None)


def test_register_transport_by_module_path(scratch_registry):
    (scratch_registry / "fake_transport.py").write_text(textwrap.dedent("""
        class FakeEngine:
            def __init__(self, hostname, protocol, *, timeout):
                self.args = (hostname, protocol, timeout)
    """))
    register_transport("fake", "fake_transport", "FakeEngine")
    register_transport("fake", "fake_transport", "FakeEngine")  # the same again (a re-run cell): a no-op
    assert "fake_transport" not in sys.modules  # registering imports nothing
    assert transports() == (*ENGINES, "fake")
    engine = open_engine("fake", "10.0.0.1", 2.5)
    assert type(engine).__module__ == "fake_transport"
    assert engine.args == ("10.0.0.1", "fake", 2.5)


def test_a_name_registered_to_another_target_is_refused(scratch_registry):
    with pytest.raises(ValueError, match=r"'tcp' is already registered as epd_lab\.transfer\.engine\.TransferEngine"):
        register_transport("tcp", "fake_transport", "FakeEngine")
    assert transports() == ENGINES


def test_an_unknown_transport_names_the_choices(scratch_registry):
    register_transport("fake", "fake_transport", "FakeEngine")
    with pytest.raises(ValueError, match="unknown transport 'rdma'") as err:
        open_engine("rdma")
    for name in (*ENGINES, "fake"):
        assert f"{name}," in f"{err.value},"
    assert "fake_transport" not in sys.modules
