"""Which copy the shm path uses for large writes into a peer's managed buffer, chosen per machine.

native/epd_core.c has two copies: glibc's ``memcpy`` and ``stream``, a streaming-store (non-temporal)
copy (AVX2 or SSE2, chosen at run time), which writes each destination line without reading it into
the cache first. Which one is faster for large calls depends on the CPU. On AMD EPYC ``stream`` beats
numpy.copyto (glibc) by 1.3-2.2x at 16 and 256 MiB. On Intel Xeon, glibc's own non-temporal loop
beat it at 256 MiB (``stream`` at 0.72-0.82x). So the first engine of a process that may use shm settles
the policy as it opens (`ensure`), before any request could wait on it:

1. ``EPD_SHM_COPY=memcpy`` or ``stream`` forces that copy for every large call (for experiments);
   ``auto``, the default, goes on.
2. A cache file for this machine is used: ``$XDG_CACHE_HOME/epd_lab/shm-copy-<key>.json``
   (``~/.cache`` without XDG_CACHE_HOME), keyed by the CPU's vendor, model name and flags, the C
   library and the copies' version. A file that does not parse, or that names another machine, is
   ignored and measured again.
3. Otherwise `calibrate` measures (0.3-0.6 s on Intel, 1.7 s on a 2-vCPU AMD EPYC, with twice the largest size held meanwhile): alternating
   repeats of both copies at 16 and 64 MiB and at a size past glibc's non-temporal threshold (where its
   memcpy switches to a loop of its own: 151 MiB on an Intel Xeon here, 240 MiB on the AMD EPYC), into a
   memfd mapping like a managed buffer. `choose` turns them into the policy, which is written to the
   cache atomically. Delete the file to measure again.

What the policy decides: in a write of 4 MiB or more, blocks of ``large_min`` bytes or more take
``large_copy``, and smaller blocks of 4 KiB or more (a scattered batch's) stream, since glibc would copy
each of them with cached stores. Smaller writes and blocks always use memcpy, which leaves the bytes in
the cache for the receiver. ``EPD_SHM_COPY`` sets ``large_min`` to 0: one copy for all of them.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import mmap
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from epd_lab import _native

ENV = "EPD_SHM_COPY"
MiB = 1 << 20
SIZES = (16 * MiB, 64 * MiB)  # always calibrated: the targets' 16 MiB, and a large call below glibc's switch
LARGEST = 512 * MiB  # the most a calibration measures past glibc's switch
REPEATS = 5
CACHE_VERSION = 1

_lock = threading.Lock()
_settled: dict[str, Any] | None = None  # how this process's policy was chosen; None until `ensure`


def cpu_info() -> dict[str, Any]:
    """``vendor``, ``model`` and ``flags`` of the first CPU in /proc/cpuinfo (empty where unreadable)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the first processor's block ends
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    return {"vendor": fields.get("vendor_id", ""), "model": fields.get("model name", ""),
            "flags": fields.get("flags", "").split()}


def libc_version() -> str:
    """``"glibc 2.36"``, or ``""`` where the C library does not say."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""


def memcpy_nt_threshold() -> int | None:
    """glibc's x86_non_temporal_threshold: from this size on, its memcpy uses its own non-temporal loop
    instead of cached stores (read from the dynamic loader, glibc 2.33+; None where it does not say)."""
    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
        out = subprocess.run(["/lib64/ld-linux-x86-64.so.2", "--list-tunables"], capture_output=True, text=True,
                             timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("glibc.cpu.x86_non_temporal_threshold:"):
                return int(line.split(":", 1)[1].split()[0], 16)
    return None


def calibration_sizes(nt_threshold: int | None) -> tuple[int, ...]:
    """SIZES, plus the first multiple of 64 MiB past `nt_threshold` (256 MiB where it is unknown), capped
    at LARGEST. glibc's memcpy changes its loop there, and on Intel it overtook the stream copy only there:
    a Xeon here measured stream 1.4x memcpy at 64 MiB and 0.78x at 256 MiB."""
    past = 256 * MiB if nt_threshold is None else (nt_threshold // (64 * MiB) + 1) * 64 * MiB
    past = min(past, LARGEST)
    return SIZES + ((past,) if past > SIZES[-1] else ())


def cache_key() -> dict[str, Any]:
    """What a cached calibration is valid for: this CPU, this C library (its memcpy) and these copies."""
    cpu = cpu_info()
    native = _native.copy_policy()
    return {"vendor": cpu["vendor"], "cpu": cpu["model"],
            "flags_sha256": hashlib.sha256(" ".join(sorted(cpu["flags"])).encode()).hexdigest(),
            "libc": libc_version(), "copy_version": native["copy_version"], "stream_isa": native["stream_isa"]}


def cache_path(key: dict[str, Any] | None = None) -> Path:
    """The cache file for `key` (this machine's by default), under $XDG_CACHE_HOME/epd_lab."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec says to ignore a relative path
        base = os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(json.dumps(key or cache_key(), sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / "epd_lab" / f"shm-copy-{digest}.json"


def memfd_array(nbytes: int, name: str) -> np.ndarray:
    """`nbytes` of a fresh memfd mapping as a uint8 array, every page touched (as a managed buffer's
    MAP_POPULATE does): the destination copies are timed into. Unmapped when the last view goes."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        out = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.close(fd)
    out.fill(0)
    return out


def calibrate(sizes: Sequence[int] | None = None, repeats: int = REPEATS) -> list[dict[str, float]]:
    """GB/s of each copy at each size (default: `calibration_sizes` of this machine's glibc):
    ``[{"size", "memcpy_gbps", "stream_gbps"}, ...]``.

    After one uncounted copy of each, the copies alternate (memcpy first in one round, stream first in
    the next) and rotate through buffers as large as the largest size, so that a copy rarely finds its
    bytes still in the cache. The destination is a memfd mapping, as a managed buffer is. Each copy's
    fastest repeat counts: other load only ever slows a copy down, and on a busy machine most repeats
    can be hit, while the fastest rarely is. (Under load here, the medians of 5 once put memcpy 3.7x
    ahead of stream at 16 MiB, the opposite of every quiet run.)"""
    if sizes is None:
        sizes = calibration_sizes(memcpy_nt_threshold())
    if repeats < 1 or not sizes or min(sizes) <= 0:
        raise ValueError(f"need positive sizes and repeats, got sizes={sizes}, repeats={repeats}")
    span = max(sizes)
    dst = memfd_array(span, "epd-shm-copy-calibration")
    src = np.ones(span, dtype=np.uint8)
    for copy in _native.COPIES:
        _native.copy_bytes(dst[:min(sizes)], src[:min(sizes)], copy)
    rows = []
    for size in sizes:
        windows = itertools.cycle(range(0, span - size + 1, size))
        times: dict[str, list[int]] = {c: [] for c in _native.COPIES}
        for rnd in range(repeats):
            for copy in _native.COPIES[::1 if rnd % 2 else -1]:
                o = next(windows)
                t0 = time.perf_counter_ns()
                _native.copy_bytes(dst[o:o + size], src[o:o + size], copy)
                times[copy].append(time.perf_counter_ns() - t0)
        rows.append({"size": size, **{f"{c}_gbps": size / min(times[c]) for c in _native.COPIES}})
    return rows


def choose(measured: Sequence[dict[str, float]], nt_threshold: int | None = None) -> tuple[str, int]:
    """``(large_copy, large_min)`` from `calibrate`'s rows.

    Each calibrated size stands for the calls from its class's lower bound up: the smallest size from
    the 4 MiB where streaming starts, each larger one from the geometric mean with the size below it
    (16 and 64 MiB: 4-32 MiB and 32 MiB on), or from `nt_threshold` where glibc's switch lies between
    the two (memcpy changes there, not at a mean). memcpy takes the calls from the lowest class where it
    won and kept winning at every larger size; otherwise everything streams (a tie keeps ``stream``)."""
    rows = sorted(measured, key=lambda r: r["size"])
    large_min = None
    for i in reversed(range(len(rows))):
        if rows[i]["memcpy_gbps"] <= rows[i]["stream_gbps"]:
            break
        if i == 0:
            large_min = _native.copy_policy()["stream_batch_min"]
        elif nt_threshold is not None and rows[i - 1]["size"] < nt_threshold <= rows[i]["size"]:
            large_min = nt_threshold
        else:
            large_min = math.isqrt(int(rows[i - 1]["size"]) * int(rows[i]["size"]))
    return ("stream", 0) if large_min is None else ("memcpy", large_min)


def read_cache(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached calibration at `path` if it is whole and made for `key`, else None."""
    try:
        data = json.loads(path.read_text())
        ok = (data["version"] == CACHE_VERSION and data["key"] == key and data["large_copy"] in _native.COPIES
              and type(data["large_min"]) is int and data["large_min"] >= 0)
    except (OSError, ValueError, KeyError, TypeError):  # missing, unreadable, not JSON, not our layout
        return None
    return data if ok else None


def write_cache(path: Path, data: dict[str, Any]) -> bool:
    """Write `data` to `path` atomically (a temporary file, then a rename); False where that failed."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:  # an unwritable cache costs the next process one calibration, nothing more
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


def _settle() -> dict[str, Any]:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    modes = ("auto", *_native.COPIES)
    if mode not in modes:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(modes)}")
    if mode != "auto":
        _native.set_copy_policy(mode, 0)
        return {"source": "env", "measured_gbps": None, "cache": None}
    if not _native.copy_policy()["stream_isa"]:  # no streaming stores on this CPU: both copies are memcpy
        _native.set_copy_policy("memcpy", 0)
        return {"source": "platform", "measured_gbps": None, "cache": None}
    key = cache_key()
    path = cache_path(key)
    cached = read_cache(path, key)
    if cached is not None:
        _native.set_copy_policy(cached["large_copy"], cached["large_min"])
        return {"source": "cache", "measured_gbps": cached["measured_gbps"], "cache": str(path)}
    nt_threshold = memcpy_nt_threshold()
    measured = calibrate(calibration_sizes(nt_threshold))
    large_copy, large_min = choose(measured, nt_threshold)
    _native.set_copy_policy(large_copy, large_min)
    data = {"version": CACHE_VERSION, "key": key, "large_copy": large_copy, "large_min": large_min,
            "measured_gbps": measured, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"source": "calibrated", "measured_gbps": measured, "cache": str(path) if write_cache(path, data) else None}


def ensure() -> dict[str, Any]:
    """Settle this process's policy once (see the module docstring); returns `current()`.

    Raises ValueError for an ``EPD_SHM_COPY`` that is not auto, memcpy or stream."""
    global _settled
    with _lock:
        if _settled is None:
            _settled = _settle()
    return current()


def set_policy(large_copy: str, large_min: int = 0) -> None:
    """Force this process's policy (no cache is written); `ensure` keeps it from then on."""
    global _settled
    with _lock:
        _native.set_copy_policy(large_copy, large_min)
        _settled = {"source": "set", "measured_gbps": None, "cache": None}


def current() -> dict[str, Any]:
    """The policy in force (`epd_lab._native.copy_policy`) and how it was chosen: ``source`` (``env``,
    ``cache``, ``calibrated``, ``set``, ``platform``, or ``default`` before any shm peer),
    ``measured_gbps`` (the calibration's rows) and ``cache`` (the file read or written)."""
    how = _settled or {"source": "default", "measured_gbps": None, "cache": None}
    return {**_native.copy_policy(), **how}
