"""A role process, wherever it is started: launched in its own session, tied to its starter's life, its URL
read from the one JSON line it prints once it serves, stopped with its whole session.

Both launchers use it: `epd_lab.launch` in this process, `epd_lab.launch_ray` inside a Ray actor on the
role's node. Light on imports on purpose: a Ray actor imports this module, not the roles' (torch).
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["await_url", "die_with_parent", "spawn", "stop_all", "tail"]


def spawn(cmd: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen:
    """Start `cmd` (a role's command line) in its own session, its stderr to `log`, its stdout a pipe for the
    URL it announces (`await_url`)."""
    with open(log, "wb") as err:
        return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                preexec_fn=die_with_parent, env=dict(env))


def await_url(proc: subprocess.Popen, name: str, log: Path, timeout: float) -> str:
    """The URL `proc` announces once it serves; `RuntimeError` if it exits first, `TimeoutError` if it stays
    silent for `timeout` s (both with the log's tail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} while starting; log:\n{tail(log)}")
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if line:
                return json.loads(line)["url"]
    raise TimeoutError(f"{name} did not come up within {timeout} s; log:\n{tail(log)}")


def stop_all(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every process (its whole session), SIGKILL what is left after `grace` s, close their pipes."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
        if p.stdout:
            p.stdout.close()


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies, even by SIGKILL, so a
    killed notebook kernel (or Ray actor) leaves no role behind (Linux's PR_SET_PDEATHSIG). The signal
    follows the *thread* that started the child: start roles from a thread that outlives them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, n: int = 20) -> str:
    """The log's last `n` lines, led by its first error line when that is further up (a failed start
    ends with the server's own shutdown traceback, below the error that caused it)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    first = next((ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)), None)
    last = lines[-n:]
    return "\n".join(([first, "..."] if first and first not in last else []) + last)
