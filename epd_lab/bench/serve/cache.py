"""What the encoders' embedding cache did over a bench run: their ``/metrics`` counters before and after, as hit
rates per level (`hit_rates`), for ``bench serve --mm-global-cache off|on|both``.

`encoder_stage_ms` compares what a part costs the encoder when L3 answers it against when the ViT does.

Every media item an encoder takes is looked up in L1 once (`mm_cache_l1_*`); those L1 misses go on to L2 (with
the global cache) and L3 (with a master). The hit rate is the items any level answered over the items taken.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from epd_lab import security

if TYPE_CHECKING:
    import pandas as pd

COUNTERS = ("l1_hits", "l1_misses", "l2_hits", "l3_hits", "l3_misses", "l3_fallbacks", "l3_integrity_failures",
            "l3_prefetch_seconds", "l3_bytes_got", "l3_bytes_put", "l3_puts")


def cache_counts(encoder_urls: Sequence[str], timeout: float = 10.0) -> dict[str, float]:
    """The `COUNTERS` summed over the encoders (``epd_lab:encoder_mm_cache_<name>_total``)."""
    headers = security.bearer_header(security.load_secret())
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in encoder_urls:
        text = httpx.get(url + "/metrics", headers=headers, timeout=timeout).text
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]  # its labels: the model's name
            short = name.removeprefix("epd_lab:encoder_mm_cache_").removesuffix("_total")
            if name.startswith("epd_lab:encoder_mm_cache_") and short in totals:
                totals[short] += float(value)
    return totals


def hit_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters' growth between two `cache_counts`, with ``items`` (every item taken), ``hit_rate`` (any
    level's) and each level's ``<level>_hit_rate`` over ``items``."""
    delta = {k: after[k] - before[k] for k in COUNTERS}
    items = delta["l1_hits"] + delta["l1_misses"]
    hits = delta["l1_hits"] + delta["l2_hits"] + delta["l3_hits"]
    out = {**delta, "items": items, "hit_rate": hits / items if items else 0.0}
    for level in ("l1", "l2", "l3"):
        out[f"{level}_hit_rate"] = delta[f"{level}_hits"] / items if items else 0.0
    return out


def encoder_stage_ms(frame: pd.DataFrame) -> dict:
    """The encoder's own stage per part, in ms, from the images read (``load``'s end) to the embedding in hand
    (the end of ``store_get`` or ``vit``), over the parts of `frame` (spans, `epd_lab.trace.collect`): ``hit``,
    parts L3 answered whole (``store_get``, no ``vit``: lookup, get, check, assembly), ``miss``, parts the ViT
    encoded (lookup, decode, ViT, assembly); each with its count, p50 and p99, and ``hit_over_miss_p50``."""
    spans = frame[frame["node"].str.startswith("encoder")]
    costs: dict[str, list[float]] = {"hit": [], "miss": []}
    for _, part in spans.groupby("req_id"):
        stages = set(part["stage"])
        kind = "hit" if "store_get" in stages and "vit" not in stages else "miss" if "decode" in stages else None
        if kind is None or "load" not in stages:
            continue
        start = part.loc[part["stage"] == "load", "t_end_ns"].max()
        end = part.loc[part["stage"].isin(("store_get", "vit")), "t_end_ns"].max()
        costs[kind].append((end - start) / 1e6)
    out: dict = {}
    for kind, values in costs.items():
        ordered = sorted(values)
        out[kind] = {"parts": len(values),
                     "p50": ordered[len(ordered) // 2] if ordered else None,
                     "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None}
    if out["hit"]["p50"] is not None and out["miss"]["p50"]:
        out["hit_over_miss_p50"] = out["hit"]["p50"] / out["miss"]["p50"]
    return out
