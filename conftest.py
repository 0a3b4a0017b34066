"""Every test run, the notebooks' too (nbval), keeps Jupyter's and IPython's dirs and the shm copy's cache out of
the user's home."""
from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    from epd_lab.sweep import JUPYTER_DIRS

    root = tempfile.mkdtemp(prefix="epd-lab-jupyter-")
    for var, sub in JUPYTER_DIRS.items():
        os.environ.setdefault(var, os.path.join(root, sub))
    # The shm copy's calibration cache (transfer.shm_copy) goes here too, shared by the run's processes.
    os.environ.setdefault("XDG_CACHE_HOME", os.path.join(root, "cache"))


def pytest_collection_modifyitems(items) -> None:
    # A notebook cell may start a cluster or run a nested sweep: a wider bound than a unit test's.
    import pytest

    from epd_lab.ep.store import unavailable_reason

    store_missing = unavailable_reason()  # the global embedding cache's notebook needs a real mooncake_master
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.endswith(".ipynb"):
            item.add_marker(pytest.mark.timeout(600))
        if path.endswith("12_global_embedding_cache.ipynb") and store_missing:
            item.add_marker(pytest.mark.skip(reason=f"Mooncake Store is unavailable: {store_missing}"))
