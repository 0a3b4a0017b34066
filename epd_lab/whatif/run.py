"""Predictions in `bench serve`'s terms: the same workloads and arrivals, results with the same keys.

`workload` builds the requests `sweep rates` / `bench serve` would send (the `image` dataset, or vLLM's `random-mm`
drawn with the same generator calls, images by size only), due at the same `arrival_offsets`. `predict` runs them
through `model.simulate` and returns a result dict with vLLM's keys (`metrics.calculate_metrics`), so
`viz.load_rates`, `rates.point_row` and a notebook read predicted and measured results alike. `compare` puts a
predicted sweep beside a measured one, metric by metric.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from epd_lab.bench.serve.arrivals import arrival_offsets
from epd_lab.bench.serve.datasets import _around, parse_buckets, parse_resolution, random_text
from epd_lab.bench.serve.metrics import calculate_metrics
from epd_lab.bench.serve.rates import point_row
from epd_lab.machine import commit
from epd_lab.whatif.calibration import Calibration
from epd_lab.whatif.model import Cluster, SimRequest, simulate

COMPARED = ("request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def workload(num_prompts: int, rate: float, burstiness: float = 1.0, seed: int = 0, image_count: int = 1,
             image_resolution: str = "448x448", input_len: int = 64, output_len: int = 16,
             random_mm: Mapping | None = None) -> list[SimRequest]:
    """The requests of one run. `random_mm`: ``{"base_items", "items_range_ratio", "limit_items", "buckets",
    "range_ratio"}`` for vLLM's dataset (its sizes and lengths drawn as `datasets.random_mm` draws them); without it
    the `image` dataset. Arrivals as `bench serve` schedules them (`seed` is the schedule's)."""
    offsets = arrival_offsets(num_prompts, rate, burstiness, seed)
    if random_mm is None:
        h, w = parse_resolution(image_resolution)
        return [SimRequest(float(t), (float(h * w),) * image_count, input_len, output_len) for t in offsets]
    buckets = parse_buckets(random_mm.get("buckets") or {(448, 448, 1): 1.0})
    sizes, weights = list(buckets), np.asarray(list(buckets.values()))
    ratio = float(random_mm.get("range_ratio", 0.0))
    rng = np.random.default_rng(seed)
    out = []
    for t in offsets:
        count = min(int(random_mm.get("limit_items", 8)),
                    _around(rng, int(random_mm.get("base_items", 1)), float(random_mm.get("items_range_ratio", 0)),
                            low=0))
        picks = rng.choice(len(sizes), size=count, p=weights / weights.sum())
        chars = _around(rng, input_len, ratio)
        random_text(rng, chars)  # the same draws as the dataset's, so the next lengths match
        out.append(SimRequest(float(t), tuple(float(sizes[k][0] * sizes[k][1]) for k in picks), chars,
                              _around(rng, output_len, ratio)))
    return out


def predict(cal: Calibration, cluster: Cluster, requests: Sequence[SimRequest], rate: float,
            slos: Mapping[str, float] | None = None, burstiness: float = 1.0,
            percentiles: Sequence[float] = (50, 90, 99), label: str = "") -> dict:
    """One predicted run as a `bench serve` result (vLLM's keys; ours under ``epd_lab``)."""
    outputs = simulate(cal, cluster, requests)
    done = [o for o in outputs if o.success]
    end = max((o.start_time + o.latency for o in done), default=0.0)
    duration = max(end, requests[-1].arrival if requests else 0.0) or 1e-9
    result = calculate_metrics(outputs, duration, dict(slos or {}), ("ttft", "tpot", "itl", "e2el"), percentiles)
    first = requests[0].arrival if requests else 0.0
    result |= {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S"), "backend": "whatif",
        "endpoint_type": "whatif", "label": label or None, "model_id": cal.machine, "num_prompts": len(requests),
        "request_rate": rate, "burstiness": burstiness, "max_concurrency": None, "duration": duration,
        "goodput": dict(slos or {}) or None,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": ["" for _ in outputs], "errors": [o.error for o in outputs],
        "epd_lab": {"achieved_rate": (len(requests) - 1) / (requests[-1].arrival - first)
                    if len(requests) > 1 and requests[-1].arrival > first else rate,
                    "whatif": {"calibration": cal.machine, "calibration_sources": len(cal.sources),
                               "cluster": _cluster_dict(cluster), "commit": commit()}},
    }
    return result


def _cluster_dict(cluster: Cluster) -> dict:
    d = {k: v for k, v in vars(cluster).items() if k not in ("ep_link", "pd_link")}
    d["placement"] = dict(cluster.placement)
    for k in ("ep_link", "pd_link"):
        link = getattr(cluster, k)
        d[k] = None if link is None else {"latency_ms": link.latency_ms,
                                           "gbps": "inf" if math.isinf(link.gbps) else link.gbps}
    return d


def predict_sweep(cal: Calibration, topologies: Sequence[str], rates: Sequence[float], out: str | Path,
                  slos: Mapping[str, float] | None = None, cluster_options: Mapping | None = None,
                  **workload_args: object) -> pd.DataFrame:
    """`sweep rates`, predicted: ``OUT/<topology>/rate-<r>.json``, ``OUT/rates.csv`` and ``OUT/sweep.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in topologies:
        cluster = Cluster.parse(name, **dict(cluster_options or {}))
        for rate in sorted(rates):
            requests = workload(rate=rate, **workload_args)  # type: ignore[arg-type]
            result = predict(cal, cluster, requests, rate, slos, float(workload_args.get("burstiness", 1.0)),
                             label=name)
            path = out / name / f"rate-{rate:g}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, default=float) + "\n")
            rows.append(point_row(name, rate, result))
    meta = {**{k: v for k, v in workload_args.items()}, "topologies": list(topologies), "rates": sorted(rates),
            "goodput": dict(slos or {}), "calibration": cal.machine, "commit": commit(),
            "cluster_options": {k: str(v) for k, v in (cluster_options or {}).items()},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    (out / "sweep.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    table = pd.DataFrame(rows)
    table.to_csv(out / "rates.csv", index=False)
    return table


def tune_slots(cal: Calibration, sweeps: Sequence[str | Path], grid: Sequence[float] | None = None) -> Calibration:
    """`cal` with the ``device_slots`` (effective parallel stages of the shared device, fractional allowed) that
    best predicts the recorded sweeps (folders with ``sweep.json`` and ``rates.csv``): the least mean absolute log
    error of TTFT p50 and goodput over their points. For a host whose cores the roles, the client and other work
    share, where the nominal core count overstates what the servers get."""
    grid = grid or [round(0.5 + 0.1 * i, 1) for i in range(16)]  # 0.5 (a host others load too) to 2 cores
    best, best_err = cal.device_slots, math.inf
    for slots in grid:
        trial = replace(cal, device_slots=slots)
        errs = []
        for sweep in sweeps:
            meta = json.loads((Path(sweep) / "sweep.json").read_text())
            measured = pd.read_csv(Path(sweep) / "rates.csv")
            for row in measured.itertuples():
                requests = workload(meta["num_prompts"], row.request_rate, meta.get("burstiness", 1.0),
                                    meta.get("seed", 0), meta["image_count"], meta["image_resolution"],
                                    meta.get("random_input_len", 64), meta.get("random_output_len", 16))
                got = predict(trial, Cluster.parse(row.topology), requests, row.request_rate, meta["goodput"])
                errs.append(abs(math.log(max(got["median_ttft_ms"], 1e-6) / row.median_ttft_ms)))
                errs.append(abs(math.log(max(got["request_goodput"], 1e-3) / max(row.request_goodput, 1e-3))))
        err = float(np.mean(errs))
        if err < best_err:
            best, best_err = slots, err
    return replace(cal, device_slots=best, meta={**cal.meta, "slots_tuned_on": [str(s) for s in sweeps],
                                                  "slots_grid": list(grid), "slots_mean_abs_log_error": best_err})


def compare(predicted: str | Path | pd.DataFrame, measured: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Predicted against measured `rates.csv` rows, per topology and rate: each metric of `COMPARED` both ways and
    its relative error ``(predicted − measured) / measured``."""
    p = predicted if isinstance(predicted, pd.DataFrame) else pd.read_csv(Path(predicted) / "rates.csv")
    m = measured if isinstance(measured, pd.DataFrame) else pd.read_csv(Path(measured) / "rates.csv")
    both = p.merge(m, on=["topology", "request_rate"], suffixes=("_pred", "_meas"))
    table = both[["topology", "request_rate"]].copy()
    for key in COMPARED:
        table[f"{key}_pred"] = both[f"{key}_pred"]
        table[f"{key}_meas"] = both[f"{key}_meas"]
        table[f"{key}_err"] = (both[f"{key}_pred"] - both[f"{key}_meas"]) / both[f"{key}_meas"]
    return table
