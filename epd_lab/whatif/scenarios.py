"""What-ifs that cannot run here, each a row with the inputs it assumed.

`WHATIFS` holds the questions asked of a GPU calibration: the encoder on a GPU of its own against two monolithic
replicas at equal GPUs, 1-4 encoders per prefill each on a GPU of its own, RDMA links between hosts, an encoder's TP
group. `ask` runs one over rates and arrival seeds, with the calibration's device costs scaled by ±`spread` (the
error bars: the model's measured TTFT error on validation points, docs/whatif.md), and returns per rate the median,
lowest and highest goodput and TTFT p50 over those runs. `capacity` is the highest rate whose median goodput keeps
≥ 90% of the rate.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from epd_lab.whatif.calibration import Calibration, Linear, Link
from epd_lab.whatif.model import Cluster
from epd_lab.whatif.run import predict, workload


@dataclass(frozen=True)
class WhatIf:
    """One question: a topology name, the `Cluster` options it changes, and the assumptions in words."""

    name: str
    topology: str
    options: dict = field(default_factory=dict)
    gpus: int = 1
    assumes: str = ""


def _rdma(gbps: float) -> dict:
    # ~5 µs one way for a verbs WRITE between hosts, plus the bytes at line rate (no contention on the wire)
    return {"ep_link": Link(0.005, gbps), "pd_link": Link(0.005, gbps)}


WHATIFS: tuple[WhatIf, ...] = (
    WhatIf("floor, 1 GPU", "monolithic", gpus=1, assumes="measured topology: the floor on one GPU"),
    WhatIf("1e1p1d, 1 GPU", "1e1p1d", gpus=1, assumes="measured topology: all roles time-slice one GPU"),
    WhatIf("2 × floor, 2 GPUs", "2xmonolithic", {"placement": {"monolithic1": "gpu1"}}, 2,
           "two replicas, one per GPU, round-robin front adds no cost"),
    WhatIf("1e1p1d, encoder on its own GPU", "1e1p1d", {"placement": {"encoder": "gpu1"}}, 2,
           "encoder alone on GPU 1; prefill and decode time-slice GPU 0; E→P link as calibrated (one host)"),
    WhatIf("2e1p1d, encoders on GPU 1", "2e1p1d", {"placement": {"encoder": "gpu1"}}, 2,
           "both encoders time-slice GPU 1; prefill and decode share GPU 0"),
    *(WhatIf(f"{n}e1p1d, each encoder on its own GPU", f"{n}e1p1d",
             {"placement": {f"encoder{i}": f"gpu{i + 1}" for i in range(n)}}, n + 1,
             f"{n} encoder(s) per prefill, one GPU each; prefill and decode share GPU 0")
      for n in (2, 3, 4)),  # one encoder on its own GPU is the row above
    WhatIf("1e1p1d own GPUs, RDMA 200 Gb/s", "1e1p1d", {"placement": {"encoder": "gpu1", "decode": "gpu2"},
                                                       **_rdma(200)}, 3,
           "E, P, D on three hosts; E→P and P→D over 200 Gb/s RDMA: 5 µs + bytes at line rate; "
           "bytes: image tokens × hidden × bf16, prompt tokens × the 2B model's KV bytes per token"),
    WhatIf("1e1p1d own GPUs, RDMA 400 Gb/s", "1e1p1d", {"placement": {"encoder": "gpu1", "decode": "gpu2"},
                                                       **_rdma(400)}, 3, "as the 200 Gb/s row at 400 Gb/s"),
    WhatIf("1e1p1d own GPUs, TCP 25 Gb/s", "1e1p1d", {"placement": {"encoder": "gpu1", "decode": "gpu2"},
                                                     "ep_link": Link(0.05, 25), "pd_link": Link(0.05, 25)}, 3,
           "as the RDMA rows over 25 Gb/s TCP with 50 µs one way"),
    WhatIf("1e1p1d, encoder TP 2 on its own GPUs", "1e1p1d", {"placement": {"encoder": "gpu1"}, "encoder_tp": 2},
           3, "the tower split over 2 ranks at 80% efficiency (not measured on GPUs: tensor parallelism has run on "
           "the CPU only)"),
)


def _scaled(cal: Calibration, factor: float) -> Calibration:
    """`cal` with its device work (tower, prefill, decode step) scaled by `factor`."""
    def s(line: Linear) -> Linear:
        return replace(line, a=line.a * factor, b=line.b * factor)
    return replace(cal, vit=s(cal.vit), prefill=s(cal.prefill), decode_step=s(cal.decode_step))


def ask(cal: Calibration, whatif: WhatIf, rates: Sequence[float], slos: dict[str, float], num_prompts: int = 64,
        seeds: Sequence[int] = (0, 1, 2), spread: float = 0.15, **workload_args: object) -> pd.DataFrame:
    """`whatif` over `rates`: per rate the median, lowest and highest goodput and TTFT p50 over `seeds` × device
    costs scaled by 1 − `spread`, 1, 1 + `spread`."""
    rows = []
    for rate in rates:
        goodputs, ttfts = [], []
        for seed in seeds:
            requests = workload(num_prompts, rate, seed=seed, **workload_args)  # type: ignore[arg-type]
            for factor in (1 - spread, 1.0, 1 + spread):
                r = predict(_scaled(cal, factor), Cluster.parse(whatif.topology, **whatif.options), requests, rate,
                            slos)
                goodputs.append(r["request_goodput"])
                ttfts.append(r["median_ttft_ms"])
        rows.append({"what_if": whatif.name, "gpus": whatif.gpus, "request_rate": rate,
                     "goodput": float(np.median(goodputs)), "goodput_low": min(goodputs),
                     "goodput_high": max(goodputs), "ttft_p50_ms": float(np.median(ttfts)),
                     "ttft_p50_low": min(ttfts), "ttft_p50_high": max(ttfts), "assumes": whatif.assumes})
    return pd.DataFrame(rows)


def capacity(table: pd.DataFrame, share: float = 0.9) -> float:
    """The highest rate of `table` (one what-if) whose median goodput is at least `share` of the rate (0: none)."""
    ok = table[table["goodput"] >= share * table["request_rate"]]["request_rate"]
    return float(ok.max()) if len(ok) else 0.0


def answer(cal: Calibration, whatifs: Sequence[WhatIf], rates: Sequence[float], slos: dict[str, float],
           **kw: object) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every what-if over `rates`: the per-rate table and one row each with its capacity (rate with ≥ 90% goodput),
    capacity per GPU, and the capacity at the bounds of the error bars."""
    tables = [ask(cal, w, rates, slos, **kw) for w in whatifs]
    summary = []
    for w, t in zip(whatifs, tables):
        low = capacity(t.assign(goodput=t["goodput_low"]))
        high = capacity(t.assign(goodput=t["goodput_high"]))
        cap = capacity(t)
        summary.append({"what_if": w.name, "topology": w.topology, "gpus": w.gpus, "capacity_req_s": cap,
                        "capacity_low": low, "capacity_high": high,
                        "capacity_per_gpu": cap / w.gpus if w.gpus else math.nan, "assumes": w.assumes})
    return pd.concat(tables, ignore_index=True), pd.DataFrame(summary)
