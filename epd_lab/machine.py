"""What a measurement ran on: the record every bench and campaign leg writes beside its numbers."""
from __future__ import annotations

import os
import platform
import subprocess

import numpy as np

from epd_lab.transfer import shm_copy

# the flags copies depend on, and whether the CPU is virtual
COPY_FLAGS = ("sse2", "avx", "avx2", "avx512f", "avx512bw", "erms", "fsrm", "hypervisor")


def machine_info() -> dict:
    """What the numbers were measured on."""
    cpu = shm_copy.cpu_info()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"host": platform.node(), "cpu": cpu["model"], "vendor": cpu["vendor"],
            "cpu_flags": [f for f in COPY_FLAGS if f in cpu["flags"]], "cores": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "kernel": platform.release(), "libc": shm_copy.libc_version(),
            "memcpy_nt_threshold": shm_copy.memcpy_nt_threshold(), "python": platform.python_version(),
            "numpy": np.__version__}


def commit() -> str | None:
    """The commit the numbers were measured at: ``EPD_LAB_COMMIT`` when set (a copy of the tree whose .git is
    older than its files names its own), else git's HEAD; None outside a checkout."""
    try:
        return os.environ.get("EPD_LAB_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
