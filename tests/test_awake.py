"""`epd_lab.bench.awake`: SCHED_IDLE spinners, one per CPU, gone when the block ends or their parent dies."""
import os
import signal
import subprocess
import sys
import time

import pytest

from epd_lab.bench.awake import cpus_awake
from helpers import alive


def test_one_spinner_per_cpu_pinned_at_sched_idle_and_reaped_after():
    cpus = sorted(os.sched_getaffinity(0))
    with cpus_awake() as spinners:
        assert sorted(spinners) == cpus
        for cpu, pid in spinners.items():
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
            assert os.sched_getaffinity(pid) == {cpu}
            assert alive(pid)
    assert not any(alive(pid) for pid in spinners.values())


def test_a_subset_of_cpus_and_a_raising_block_leave_no_spinner():
    cpu = min(os.sched_getaffinity(0))
    with pytest.raises(RuntimeError, match="boom"):
        with cpus_awake({cpu}) as spinners:
            assert list(spinners) == [cpu]
            raise RuntimeError("boom")
    assert not alive(spinners[cpu])


def test_spinners_exit_by_themselves_when_their_parent_is_killed():
    code = ("import sys; from epd_lab.bench.awake import cpus_awake\n"
            "with cpus_awake() as s:\n"
            "    print(' '.join(map(str, s.values())), flush=True); sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids and all(alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
