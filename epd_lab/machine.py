"""What a measurement ran on: the record every bench and campaign leg writes beside its numbers."""
from __future__ import annotations

import glob
import os
import platform
import subprocess

import numpy as np

from epd_lab.transfer import shm_copy

# the flags copies depend on, and whether the CPU is virtual
COPY_FLAGS = ("sse2", "avx", "avx2", "avx512f", "avx512bw", "erms", "fsrm", "hypervisor")
MPS_COMM = "nvidia-cuda-mps"  # the MPS control daemon's name as /proc/<pid>/comm holds it (15 characters)


def machine_info(gpu: bool = False) -> dict:
    """What the numbers were measured on: the host; with `gpu`, also the first GPU, its count, memory and SMs,
    torch, CUDA and driver versions, and whether an MPS daemon runs."""
    cpu = shm_copy.cpu_info()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = {"host": platform.node(), "cpu": cpu["model"], "vendor": cpu["vendor"],
            "cpu_flags": [f for f in COPY_FLAGS if f in cpu["flags"]], "cores": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "kernel": platform.release(), "libc": shm_copy.libc_version(),
            "memcpy_nt_threshold": shm_copy.memcpy_nt_threshold(), "python": platform.python_version(),
            "numpy": np.__version__}
    return {**info, **_gpu_info()} if gpu else info


def _gpu_info() -> dict:
    import torch  # only here: the CPU benches and the campaign need no torch for their record

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1), "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver, "mps": mps_daemon()}


def mps_daemon() -> bool:
    """Whether an MPS control daemon (``nvidia-cuda-mps-control -d``) runs on this host: the GPU's processes are
    then its clients, sharing one context. Its process is looked for, not its control pipe, which stays behind
    after the daemon quits."""
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                if f.read().strip() == MPS_COMM:
                    return True
        except OSError:  # the process ended meanwhile
            continue
    return False


def commit() -> str | None:
    """The commit the numbers were measured at: ``EPD_LAB_COMMIT`` when set (a copy of the tree whose .git is
    older than its files names its own), else git's HEAD; None outside a checkout."""
    try:
        return os.environ.get("EPD_LAB_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
