"""Register/deregister errors are raised, never swallowed; the registration table and counters."""
from __future__ import annotations

import numpy as np
import pytest

from epd_lab.transfer import (
    PROTOCOLS,
    RegistrationError,
    TransferEngine,
    as_array,
    buffer_info,
    parse_session_id,
)


def test_session_id_is_host_and_port(engine):
    host, port = parse_session_id(engine.session_id)
    assert host == "127.0.0.1" and port == engine.get_rpc_port() > 0


@pytest.mark.parametrize("bad", ["", "host", "host:", ":80", "host:http", "host:70000"])
def test_malformed_session_id(bad):
    with pytest.raises(ValueError, match="host:port"):
        parse_session_id(bad)


def test_unknown_protocol_names_the_choices():
    with pytest.raises(ValueError) as err:
        TransferEngine(protocol="rdma")
    for name in PROTOCOLS:
        assert name in str(err.value)


def test_register_errors(engine):
    a = np.zeros(8192, dtype=np.uint8)
    ptr = a.ctypes.data
    with pytest.raises(RegistrationError, match="0 bytes"):
        engine.register(ptr, 0)
    with pytest.raises(RegistrationError, match="null"):
        engine.register(0, 16)
    engine.register(ptr, 4096)
    with pytest.raises(RegistrationError, match="already registered"):
        engine.register(ptr, 4096)
    with pytest.raises(RegistrationError, match="overlaps"):
        engine.register(ptr + 100, 4096)
    with pytest.raises(RegistrationError, match="overlaps"):
        engine.register(ptr - 100, 200)
    engine.register(ptr + 4096, 4096)  # adjacent is fine
    with pytest.raises(RegistrationError, match="not the start"):
        engine.deregister(ptr + 1)
    assert sorted(engine.registrations()) == [(ptr, 4096, "external"), (ptr + 4096, 4096, "external")]
    engine.deregister(ptr)
    with pytest.raises(RegistrationError, match="not the start"):
        engine.deregister(ptr)
    engine.deregister(ptr + 4096)
    assert engine.registrations() == []


def test_stats_count_registrations(engine):
    a = np.zeros(1 << 20, dtype=np.uint8)
    engine.register_buffer(a)
    s = engine.stats()
    assert (s["regions"], s["registered_bytes"]) == (1, 1 << 20)
    engine.deregister_buffer(a)
    assert engine.stats()["regions"] == 0


def test_managed_buffer_lifecycle(engine):
    ptr = engine.allocate_managed_buffer(1 << 20)
    view = as_array(ptr, 1 << 20)
    view[:] = 7  # it is ordinary memory of this process
    engine.register(ptr + 4096, 8192)
    assert engine.registrations() == [(ptr + 4096, 8192, "managed")]
    with pytest.raises(RegistrationError, match="still holds"):
        engine.free_managed_buffer(ptr)
    engine.deregister(ptr + 4096)
    assert engine.stats()["managed_bytes"] == 1 << 20
    engine.free_managed_buffer(ptr)
    with pytest.raises(RegistrationError, match="not a managed buffer"):
        engine.free_managed_buffer(ptr)
    with pytest.raises(RegistrationError, match="0 bytes"):
        engine.allocate_managed_buffer(0)
    assert engine.stats()["managed_buffers"] == 0


def test_buffer_info_of_tensors_and_arrays():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32)
    assert buffer_info(t) == (t.data_ptr(), 48)
    with pytest.raises(ValueError, match="contiguous"):
        buffer_info(t.view(3, 4).t())
    with pytest.raises(ValueError, match="only host and CUDA memory"):  # no address to register
        buffer_info(torch.empty(4, device="meta"))
    a = np.arange(10, dtype=np.int64)
    assert buffer_info(a) == (a.ctypes.data, 80)
    with pytest.raises(ValueError, match="contiguous"):
        buffer_info(a[::2])
    b = bytearray(b"abc")
    assert buffer_info(b)[1] == 3


def test_close_is_idempotent_and_final():
    e = TransferEngine()
    e.close()
    e.close()
    assert "closed" in repr(e)
    with pytest.raises(ValueError, match="closed"):
        e.register(np.zeros(8, dtype=np.uint8).ctypes.data, 8)


def test_closed_engine_frees_its_port():
    import socket

    with TransferEngine() as e:
        port = e.get_rpc_port()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_verbs_protocol_without_a_device_names_the_alternatives():
    from epd_lab.transfer import TransportUnavailable, verbs

    if verbs.unavailable_reason() is None:
        pytest.skip("an RDMA device exists here")
    with pytest.raises(TransportUnavailable) as err:
        TransferEngine(protocol="verbs")
    for alternative in ('"shm"', '"tcp"', '"mooncake"', "rdma link add"):
        assert alternative in str(err.value)
    with TransferEngine(protocol="auto") as e:  # auto never picks verbs without a device
        assert e._verbs is None
