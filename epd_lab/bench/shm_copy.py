"""`python -m epd_lab.bench.shm_copy`: the shm path's two copies side by side on this machine, quickly.

It needs numpy and the built native module, nothing else (no pyzmq, msgspec or torch), and runs from
the repository root in well under a minute. It prints:

1. the machine, the copy policy this process settled (`epd_lab.transfer.shm_copy.ensure`: from
   ``EPD_SHM_COPY``, the cache file or a calibration), and a fresh calibration with its choice;
2. in one process, into a memfd mapping like a managed buffer: numpy.copyto, ``memcpy`` and ``stream``;
3. between two processes through the engine, set up as `epd-lab bench transfer` does: numpy.copyto (the
   target's reference, ``memcpy`` in that benchmark), ``shm`` with each copy forced and with the
   chosen policy, and ``shm_registered``.

GB/s are medians over the repeats, with the slowest and fastest repeat. Variants alternate, so that
drift from other load spreads over all of them. The target is shm at 0.8x numpy.copyto or better at
16 and 256 MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from typing import Callable

import numpy as np

from epd_lab import _native
from epd_lab.bench import write_json
from epd_lab.bench.timing import measure
from epd_lab.bench.transfer import _Bench
from epd_lab.machine import machine_info
from epd_lab.transfer import shm_copy

MiB = 1 << 20
SIZES = (16 * MiB, 256 * MiB)
TARGET = 0.8


def describe(policy: dict) -> str:
    """One line for a policy as `epd_lab.transfer.shm_copy.current` reports it."""
    large = f"writes of {_size(policy['stream_batch_min'])} and more"
    if policy["large_copy"] == "stream":
        return f"stream for the blocks of {_size(policy['stream_min'])} and more in {large}"
    if policy["large_min"] <= policy["stream_min"]:
        return "memcpy for everything"
    return f"memcpy for blocks of {_size(policy['large_min'])} and more, stream for smaller ones, in {large}"


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB"


def _stats(size: int, times: list[float]) -> dict:
    return {"gbps": size / statistics.median(times) / 1e9, "gbps_min": size / max(times) / 1e9,
            "gbps_max": size / min(times) / 1e9, "repeats": len(times)}


def _print(title: str, table: dict[int, dict[str, dict]]) -> None:
    print(f"\n{title} (GB/s: median [slowest .. fastest repeat], ratio to numpy.copyto)")
    for size, rows in table.items():
        print(f"  {_size(size)}")
        ref = rows["numpy.copyto"]["gbps"]
        for name, st in rows.items():
            print(f"    {name:16s} {st['gbps']:6.2f} [{st['gbps_min']:6.2f} .. {st['gbps_max']:6.2f}]  "
                  f"{st['gbps'] / ref:5.2f}x")


def _rotated(names: list[str], r: int) -> list[str]:
    """Round `r`'s order: each variant goes first in turn, so that drift spreads over all of them."""
    k = r % len(names)
    return names[k:] + names[:k]


def in_process(sizes: tuple[int, ...], repeats: int) -> dict[int, dict[str, dict]]:
    """numpy.copyto, memcpy and stream from one buffer into a memfd mapping, per size."""
    span = 2 * max(sizes)
    dst = shm_copy.memfd_array(span, "epd-bench-shm-copy")
    src = np.ones(span, dtype=np.uint8)
    copies: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
        "numpy.copyto": np.copyto, **{c: lambda d, s, c=c: _native.copy_bytes(d, s, c) for c in _native.COPIES}}
    out = {}
    for size in sizes:
        windows = itertools.cycle(range(0, span - size + 1, size))
        times: dict[str, list[float]] = {name: [] for name in copies}
        for r in range(repeats + 1):  # round 0 warms
            for name in _rotated(list(copies), r):
                o = next(windows)
                t0 = time.perf_counter()
                copies[name](dst[o:o + size], src[o:o + size])
                if r:
                    times[name].append(time.perf_counter() - t0)
        out[size] = {name: _stats(size, t) for name, t in times.items()}
    return out


def two_process(sizes: tuple[int, ...], budget_s: float, rounds: int, chosen: dict) -> dict[int, dict[str, dict]]:
    """Through the engine into a second process, per size: numpy.copyto, shm under each policy, and
    shm_registered. The chosen policy is in force again on return."""
    out = {}
    with contextlib.ExitStack() as stack:
        bench = _Bench(stack, ("memcpy", "shm", "shm_registered"), max(sizes), timeout=10.0)
        if bench.skipped:
            raise RuntimeError(f"cannot set up the two-process measurement: {bench.skipped}")
        (memcpy, _), (shm, _), (registered, _) = (bench.writers[p] for p in ("memcpy", "shm", "shm_registered"))
        # name: (the policy to set first, or None; the write)
        variants: dict[str, tuple[tuple[str, int] | None, Callable[[int], None]]] = {
            "numpy.copyto": (None, memcpy), "shm memcpy": (("memcpy", 0), shm), "shm stream": (("stream", 0), shm),
            "shm chosen": ((chosen["large_copy"], chosen["large_min"]), shm), "shm_registered": (None, registered)}
        try:
            for size in sizes:
                times: dict[str, list[float]] = {name: [] for name in variants}
                for r in range(rounds):
                    for name in _rotated(list(variants), r):
                        policy, write = variants[name]
                        if policy:
                            shm_copy.set_policy(*policy)
                        times[name] += measure(lambda: write(size), budget_s / rounds, min_reps=3)
                out[size] = {name: _stats(size, t) for name, t in times.items()}
        finally:
            shm_copy.set_policy(chosen["large_copy"], chosen["large_min"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epd_lab.bench.shm_copy", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma-separated")
    ap.add_argument("--repeats", type=int, default=9, help="in-process repeats of each copy per size")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds per two-process point, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two-process points")
    ap.add_argument("--json", metavar="PATH", help="also write everything here")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s)

    machine = machine_info()
    print(f"machine: {machine['cpu']} ({machine['vendor']}), {machine['cores']} cpus, "
          f"flags {' '.join(machine['cpu_flags'])}, {machine['libc']}, "
          f"glibc memcpy non-temporal from {_size(nt) if (nt := machine['memcpy_nt_threshold']) else '?'}")
    chosen = shm_copy.ensure()
    print(f"policy in force: {describe(chosen)} (source: {chosen['source']}, stream copy: {chosen['stream_isa']}"
          f"{', cache ' + chosen['cache'] if chosen['cache'] else ''})")
    t0 = time.perf_counter()
    fresh = shm_copy.calibrate()
    cost = time.perf_counter() - t0
    large_copy, large_min = shm_copy.choose(fresh, machine["memcpy_nt_threshold"])
    print(f"fresh calibration ({cost * 1e3:.0f} ms): "
          + ", ".join(f"{_size(r['size'])}: memcpy {r['memcpy_gbps']:.2f} stream {r['stream_gbps']:.2f} GB/s"
                      for r in fresh)
          + f" -> {describe({**chosen, 'large_copy': large_copy, 'large_min': large_min})}")

    local = in_process(sizes, args.repeats)
    _print("in one process, into a memfd mapping", local)
    remote = two_process(sizes, args.budget, args.rounds, chosen)
    _print("between two processes, through the engine", remote)
    verdicts = [(size, rows["shm chosen"]["gbps"] / rows["numpy.copyto"]["gbps"]) for size, rows in remote.items()]
    print(f"\nshm with the chosen policy / numpy.copyto (target >= {TARGET}): "
          + ", ".join(f"{_size(size)} {r:.2f} {'ok' if r >= TARGET else 'MISS'}" for size, r in verdicts))

    if args.json:
        write_json(args.json, {"machine": machine, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "policy": chosen, "fresh_calibration": {"rows": fresh, "ms": cost * 1e3,
                                                                       "large_copy": large_copy,
                                                                       "large_min": large_min},
                               "in_process": {str(k): v for k, v in local.items()},
                               "two_process": {str(k): v for k, v in remote.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
