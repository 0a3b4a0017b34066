"""Shared fixtures: peer engines in real child processes on loopback, and engines in this process."""
from __future__ import annotations

import numpy as np
import pytest

from epd_lab.transfer import TransferEngine
from epd_lab.transfer.peer import PeerProcess


@pytest.fixture
def peer():
    """A transfer engine in another process (tcp server; its memory is the write target)."""
    with PeerProcess(protocol="tcp", timeout=2.0) as p:
        yield p


@pytest.fixture(params=["tcp", "shm"])
def writer(request):
    """An engine in this process forced onto one path, with a 4 MiB registered random source."""
    with TransferEngine(protocol=request.param, timeout=2.0) as engine:
        src = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
        engine.register_buffer(src)
        engine.src = src  # keep the array alive with the engine
        yield engine


@pytest.fixture
def engine():
    with TransferEngine(timeout=2.0) as e:
        yield e


@pytest.fixture(scope="module")
def one_thread():
    """configure_torch(1), as every role runs (float32 bits depend on the thread count); the count is
    restored after the module."""
    import torch

    from epd_lab.models import configure_torch

    before = torch.get_num_threads()
    configure_torch(1)
    yield
    torch.set_num_threads(before)
