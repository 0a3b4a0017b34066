"""How much a sleeping CPU adds to one cross-process hop, and what the kernel's PM QoS request or polling
CPUs take off.

A ping-pong of one byte between two processes over a socketpair: the round trip after idle gaps of 0, 1 and
5 ms (the gaps between a lone request's hops), in three conditions: the CPUs free to enter their idle states
(``idle``); ``/dev/cpu_dma_latency`` held at 0 µs (``qos0``: the PM QoS request of tuned's latency-performance
profile, which a cpuidle driver honours by polling instead of halting; released when the file closes; skipped
where the file cannot be opened); a ``SCHED_IDLE`` spinner on every CPU (``awake``: `epd_lab.bench.awake`,
user-space idle=poll). The conditions' order rotates per round. Prints one JSON object.

    python3 scripts/wakeup_latency.py [--rounds 4] [--json PATH]   # epd_lab importable (venv or PYTHONPATH=.)
    python3 scripts/wakeup_latency.py --hold -- CMD ARGS...   # run CMD with the QoS request held (root)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

from epd_lab.bench.awake import cpus_awake
from epd_lab.transfer.shm_copy import cpu_info

QOS_PATH = "/dev/cpu_dma_latency"
GAPS_S = (0.0, 0.001, 0.005)


@contextlib.contextmanager
def latency_qos(usec: int = 0) -> Iterator[None]:
    """Hold the kernel's CPU latency request at `usec` while the block runs (needs write access)."""
    fd = os.open(QOS_PATH, os.O_WRONLY)
    try:
        os.write(fd, struct.pack("i", usec))
        yield
    finally:
        os.close(fd)


def ping_pong(n: int, gap_s: float) -> list[float]:
    """`n` one-byte round trips to a forked echo process, `gap_s` of sleep before each; µs each."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo
        a.close()
        while data := b.recv(64):
            b.send(data)
        os._exit(0)
    b.close()
    out = []
    try:
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            a.send(b"x")
            a.recv(64)
            out.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        a.close()
        os.waitpid(pid, 0)
    return out


def measure(rounds: int, n: int) -> dict:
    conditions = {"idle": contextlib.nullcontext, "qos0": latency_qos, "awake": cpus_awake}
    if not os.access(QOS_PATH, os.W_OK):
        del conditions["qos0"]
    names = list(conditions)
    cells: dict[str, list[float]] = {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with conditions[name]():
                for gap in GAPS_S:
                    cells.setdefault(f"{name}/gap{gap * 1e3:g}ms", []).extend(ping_pong(n if gap else 10 * n, gap))
    rows = {}
    for key, xs in cells.items():
        xs.sort()
        rows[key] = {"p50_us": statistics.median(xs), "p10_us": xs[len(xs) // 10], "p90_us": xs[len(xs) * 9 // 10],
                     "n": len(xs)}
    return {"what": "one-byte socketpair round trip between two processes after an idle gap",
            "cpu": cpu_info()["model"], "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpuidle": _read("/sys/devices/system/cpu/cpuidle/current_driver"), "rounds": rounds, "cells": rows}


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError):
        with open(path) as f:
            return f.read().strip()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=300, help="round trips per gapped cell per round (10x without a gap)")
    ap.add_argument("--json")
    ap.add_argument("--hold", action="store_true", help="run the command after -- with the QoS request held")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.hold:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        with latency_qos():
            return subprocess.call(cmd)
    result = measure(args.rounds, args.n)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
