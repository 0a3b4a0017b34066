"""What `epd-lab bench transfer` and its GPU twin (`bench.transfer_cuda`) share: a write timed over repeats,
the row one measured point makes, and how rows and target ratios print."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Row:
    """One measured point; `size` is the total bytes of one transfer, `blocks` how many blocks."""

    path: str
    size: int
    blocks: int
    gbps: float
    rtt_us: float | None
    gbps_min: float
    gbps_max: float
    repeats: int


def measure(fn: Callable[[], None], budget_s: float, min_reps: int = 5, max_reps: int = 400) -> list[float]:
    """Seconds of each call of `fn` after two warm-up calls: at least `min_reps`, more while `budget_s` lasts."""
    fn()
    fn()  # warm: connections, mappings, page tables
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def to_row(path: str, size: int, blocks: int, times: list[float]) -> Row:
    """The point `times` make: GB/s of the median, slowest and fastest; the round trip for one 4 KiB write."""
    med = statistics.median(times)
    rtt = med * 1e6 if size == 4 * KiB and blocks == 1 and path != "memcpy" else None
    return Row(path, size, blocks, size / med / 1e9, rtt, size / max(times) / 1e9, size / min(times) / 1e9,
               len(times))


def format_row(r: Row) -> str:
    """One progress line."""
    rtt = f"{r.rtt_us:8.1f}" if r.rtt_us is not None else "       -"
    return (f"  {r.path:15s} {size_label(r.size):>8s} x{r.blocks:<4d} {r.gbps:7.2f} GB/s "
            f"[{r.gbps_min:6.2f} .. {r.gbps_max:6.2f}]  rtt {rtt} us  (n={r.repeats})")


def size_label(n: int) -> str:
    """``4 KiB``, ``16 MiB``: how sizes are named in rows and ratios."""
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def format_ratios(result: dict) -> str:
    """The result's ``ratios`` as a table: value, target, and ok, MISS or report."""
    lines = ["", "targets (ratios of medians, this run):"]
    for r in result["ratios"]:
        if r["value"] is None:
            lines.append(f"  {r['name']:48s}      -   (a side was not measured)")
            continue
        verdict = "report" if r["target"] == 0.0 else ("ok" if r["ok"] else "MISS")
        cmp = "<=" if "rtt" in r["name"] else ">="
        lines.append(f"  {r['name']:48s} {r['value']:6.2f}   target {cmp} {r['target']:.1f}   {verdict}")
    return "\n".join(lines)
