"""Process helpers shared by the tests."""
from __future__ import annotations

import os
import signal
import time


def freeze(pid: int) -> None:
    """SIGSTOP and wait until the kernel reports the process stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.001)
