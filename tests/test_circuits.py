"""`epd_lab.serving.Circuits`, in this process: which backends are up in a caller's order, and the probe schedule
the proxy, the front and the receiver share. Their I/O over it runs through real processes in `test_proxy.py`,
`test_xpyd.py`, `test_faults.py` and `test_epd.py`.
"""
from __future__ import annotations

import concurrent.futures
import threading

from epd_lab.serving import STALL_MISSES, Circuits


def test_up_lists_the_backends_in_ring_order_less_those_tried_refused_or_stalled():
    circuits = Circuits(4, retry_after=60.0)
    assert circuits.up() == [0, 1, 2, 3] and len(circuits) == 4
    assert circuits.up(start=2) == [2, 3, 0, 1]  # a rotating caller's next position first
    assert circuits.up({3}, start=2) == [2, 0, 1]
    circuits.liveness[0].refused()  # left out for retry_after
    for _ in range(STALL_MISSES):
        circuits.liveness[2].probed(False, now=circuits.liveness[2].heard_at + 60.0)
    assert circuits.liveness[2].stalled
    assert circuits.up(start=2) == [3, 1]
    assert circuits.up({1, 3}) == []
    circuits.liveness[2].probed(True)  # answered again: up again
    assert circuits.up(start=2) == [2, 3, 1]


def test_a_tick_probes_each_backend_whose_last_probe_is_over_and_no_other():
    circuits = Circuits(3, retry_after=1.0)
    frozen = threading.Event()
    started: list[int] = []
    last: dict[int, concurrent.futures.Future] = {}

    def probe(i: int) -> None:
        if i == 1:
            frozen.wait(10)  # a probe of a frozen backend, still waiting for its answer

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        def start(i: int) -> concurrent.futures.Future:
            started.append(i)
            last[i] = pool.submit(probe, i)
            return last[i]

        circuits.probe_due(start)
        assert started == [0, 1, 2]
        concurrent.futures.wait((last[0], last[2]))
        circuits.probe_due(start)  # 1 is not piled with probes; the others are probed again meanwhile
        assert started == [0, 1, 2, 0, 2]
        frozen.set()
        concurrent.futures.wait(last.values())
        circuits.probe_due(start)
        assert started == [0, 1, 2, 0, 2, 0, 1, 2]


def test_cancel_probes_cancels_those_under_way():
    circuits = Circuits(2, retry_after=1.0)
    futures = [concurrent.futures.Future() for _ in range(2)]
    circuits.probe_due(futures.__getitem__)
    circuits.cancel_probes()
    assert all(f.cancelled() for f in futures)
