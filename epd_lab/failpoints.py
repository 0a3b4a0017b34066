"""Failpoints: named places in the protocols where a process can be made to stop itself, so that a fault
campaign (`epd_lab.campaign.faults`) acts at that precise step.

    failpoint("encoder.before_encode_reply")   # one line at the step; nothing happens unless armed

Armed by the environment variable ``EPD_FAILPOINTS``, read once at import:

- ``EPD_FAILPOINTS="encoder.before_notify,decode.mid_stream"``: each named point stops the process
  (``SIGSTOP`` sent to the thread that reached it, which stops them all) the first time it is reached;
- ``EPD_FAILPOINTS="@/some/dir"``: points are armed at run time, per process: while the file
  ``/some/dir/<pid>`` names a point, the process stops the first time it reaches that point and deletes the
  file (one stop per arming). The campaign starts a whole cluster this way and arms only its victim.

Whoever armed the point sees the process stopped (state ``T`` in ``/proc/<pid>/stat``, `wait_stopped`) and
then kills it, keeps it frozen or resumes it with ``SIGCONT``. Unset, `failpoint` returns at once.
"""
from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["POINTS", "arm", "disarm", "failpoint", "is_stopped", "wait_stopped"]

# every point placed in the code, by the step of the protocol it stands at
POINTS: dict[str, str] = {
    "encoder.before_encode_reply": "the encoder has read the media, /encode not answered yet",
    "prefill.between_encode_and_send": "the prefill has every /encode answer and its buffer registered, "
                                       "no /send posted",
    "encoder.write": "the encoder starts the one-sided write of an embedding",
    "encoder.before_notify": "the encoder is about to PUSH the notification (after the write)",
    "prefill.kv_handshake": "the prefill's side channel has decode's metadata, nothing answered",
    "prefill.kv_write": "the prefill starts the batch write of KV blocks into decode's cache",
    "decode.mid_stream": "decode has streamed its first token",
}

_SETTING = os.environ.get("EPD_FAILPOINTS", "")
_DIR = _SETTING[1:] if _SETTING.startswith("@") else ""
_ONCE = set() if _DIR else {p for p in _SETTING.split(",") if p}
_lock = threading.Lock()


def failpoint(name: str) -> None:
    """Stop this process here when `name` is armed (see the module's docstring); otherwise nothing."""
    if not _SETTING:
        return
    if _DIR:
        path = os.path.join(_DIR, str(os.getpid()))
        with _lock:
            try:
                with open(path) as f:
                    if f.read().strip() != name:
                        return
                os.unlink(path)
            except FileNotFoundError:
                return
    else:
        with _lock:
            if name not in _ONCE:
                return
            _ONCE.discard(name)
    # To this thread, not the process: a process-directed signal is taken by the main thread, and this one ran on
    # past the point (into the write it stands before) until the group stop reached it, microseconds to ms later.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def arm(directory: str, pid: int, name: str) -> None:
    """Arm point `name` in process `pid`, started with ``EPD_FAILPOINTS=@<directory>``."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; points: {', '.join(POINTS)}")
    tmp = os.path.join(directory, f".{pid}.tmp")
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, os.path.join(directory, str(pid)))  # atomic: the process never reads half a name


def disarm(directory: str, pid: int) -> None:
    """Take back an arming that did not fire."""
    try:
        os.unlink(os.path.join(directory, str(pid)))
    except FileNotFoundError:
        pass


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (state T); False when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_stopped(pid: int, timeout: float) -> bool:
    """Wait until `pid` stopped itself (a failpoint fired); False after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_stopped(pid):
            return True
        time.sleep(0.005)
    return False
