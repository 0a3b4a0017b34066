"""Every test run, the notebooks' too (nbval), keeps Jupyter's and IPython's dirs out of the user's home."""
from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    root = tempfile.mkdtemp(prefix="epd-lab-jupyter-")
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        os.environ.setdefault(var, os.path.join(root, var.lower()))
