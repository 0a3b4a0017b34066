"""Helpers shared by the tests: a free loopback port, a polling wait, a child's next line, a frozen process, a
circle in a graph.

Random-noise test images come from `epd_lab.noise`; the `one_thread` fixture lives in ``conftest.py``.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from typing import Any, Callable


def free_port() -> int:
    """A loopback port nothing listens on (bound once by the OS, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float = 5.0,
             what: str | Callable[[], str] = "condition not reached", interval: float = 0.05) -> Any:
    """Poll `condition` every `interval` s until it returns something true, and return that (for state a server
    settles just after the client saw its answer); after `timeout` s, an AssertionError naming what was waited for:
    `what`, or what it returns then if it is a function (to show the state that was not reached)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what() if callable(what) else what} (waited {timeout} s)")
        time.sleep(interval)
    return value


def read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line `proc` prints on its stdout (a text pipe), waited for at most `timeout` s; a process that
    exits before it fails at once. `what` names the line in the failure."""
    wait_for(lambda: select.select([proc.stdout], [], [], 0.1)[0], timeout, what, interval=0)
    line = proc.stdout.readline()
    assert line, f"pid {proc.pid} exited with {proc.wait(10)} before {what}"
    return line


def proc_state(pid: int) -> str:
    """The process's state letter in ``/proc/<pid>/stat`` (``T`` stopped, ``Z`` a zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def freeze(pid: int) -> None:
    """SIGSTOP and wait until the kernel reports the process stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: proc_state(pid) == "T", 5, f"pid {pid} stopped", interval=0.001)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if (found := visit(nxt, path + [node])) is not None:
                return found
        done.add(node)
        return None

    return next((c for n in sorted(graph) if (c := visit(n, [])) is not None), None)
