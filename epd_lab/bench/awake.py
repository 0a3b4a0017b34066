"""Idle CPUs that poll instead of halting while a measurement runs: the kernel's ``idle=poll``, from user space.

On a virtual machine an idle vCPU halts, and waking a thread on it costs an exit to the host and the host's
wake-up of that vCPU: 56-83 µs after 1-5 ms of idle on the H200's Firecracker guest, whose kernel has no cpuidle
driver, so ``/dev/cpu_dma_latency`` changes nothing there (docs/gpu-results.md). A lone split request
crosses about eight more thread and process wake-ups than the monolithic floor, each after the idle spell the
GPU work leaves on the host.

`cpus_awake` starts one spinner process per CPU this process may run on, each pinned to its CPU at the
``SCHED_IDLE`` policy: any other thread that wakes preempts it at once, and the scheduler places wakees on CPUs
that run only ``SCHED_IDLE`` work as on idle ones (``sched_idle_cpu``), so a wake-up lands on a running vCPU
instead of a halted one. The spinners cost the host that many busy vCPUs (and SMT siblings' share of a core):
a measurement condition, named in the JSON of what ran under it, not a default. A spinner exits by itself when
its parent is gone (it checks its parent every few milliseconds), so a killed bench leaves none behind.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# the spinner: pinned, SCHED_IDLE, then a busy loop (no PAUSE, which a hypervisor may trap) until its parent is gone
_SPIN = """
import os, sys
cpu, parent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
sys.stdout.write("ready\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(20000):
        pass
"""


@contextlib.contextmanager
def cpus_awake(cpus: set[int] | None = None) -> Iterator[dict[int, int]]:
    """Keep `cpus` (default: every CPU this process may run on) polling while the block runs; yields each CPU's
    spinner's pid, by CPU.

    Each spinner has set its affinity and policy before the block starts; all are killed and reaped when it
    ends. Raises `OSError` where the policy cannot be set (the spinners started so far are stopped first).
    """
    chosen = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    procs: list[subprocess.Popen] = []
    try:
        for cpu in chosen:
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
        for cpu, proc in zip(chosen, procs):
            if proc.stdout.readline() != b"ready\n":
                err = proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise OSError(f"the spinner for CPU {cpu} did not start: {err[-1] if err else 'no output'}")
        yield {cpu: proc.pid for cpu, proc in zip(chosen, procs)}
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
