"""Shared fixtures: peer engines in real child processes on loopback, engines in this process, one torch thread, the
tiny model; and which tests are slow (``-m "not slow"``: `make test-quick`)."""
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


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen2-VL as every role loads it, after configure_torch(1) as every role runs (bit-identical
    tokens and logits across processes); the thread count is restored after the module."""
    import torch

    from epd_lab.models import configure_torch, load_model

    before = torch.get_num_threads()
    configure_torch(1)
    yield load_model()
    torch.set_num_threads(before)


# Modules whose tests start clusters of server processes, a browser, a campaign leg or a fuzz leg (tens of seconds
# to minutes each on 2 vCPUs). Marked slow: `make test-quick` (`pytest -m "not slow"`) leaves them out, `make test`
# runs everything. So are the notebooks (nbval runs each whole).
SLOW_MODULES = {
    "test_bench_e2e_device.py", "test_bench_serve.py", "test_bounds.py", "test_browser.py", "test_campaign.py",
    "test_cli_first_hour.py", "test_demo.py", "test_e2e.py", "test_epd.py", "test_failures.py", "test_faults.py",
    "test_floor.py", "test_front.py", "test_fuzz.py", "test_global_cache.py", "test_global_cache_ray.py",
    "test_gpu_roles.py", "test_kv_deadline.py", "test_layout.py", "test_links.py", "test_overload.py", "test_pd.py",
    "test_prometheus.py", "test_ray.py", "test_ray_heal.py", "test_ray_netns.py", "test_secret.py", "test_serving.py",
    "test_supervisor.py", "test_sweep.py", "test_tp.py", "test_tp_encoder.py", "test_tp_servers.py", "test_trace.py",
    "test_xpyd.py",
}
# Single slow tests in otherwise quick modules (the Triton kernels run in Triton's CPU interpreter: 10-20 s each).
SLOW_TESTS = {
    "test_runtime.py::test_the_vision_tower_on_triton_kernels_equals_torch_ops_in_the_interpreter",
    "test_runtime.py::test_the_model_on_triton_kernels_equals_torch_ops_in_the_interpreter",
    "test_runtime.py::test_triton_kernels_match_the_torch_ops_in_the_interpreter",
}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if (item.path.name in SLOW_MODULES or item.path.suffix == ".ipynb"
                or f"{item.path.name}::{item.originalname}" in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
