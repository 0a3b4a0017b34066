"""Predictions in `bench serve`'s terms: the same workloads and arrivals, results with the same keys.

`workload` builds the requests `sweep rates` / `bench serve` would send, due at the same `arrival_offsets`: the
`image` dataset, or vLLM's `random` and `random-mm`, each drawn by `bench serve`'s own dataset functions
(`datasets.image_dataset`, `datasets.random_mm`) for the same seed, so every request has the dataset's prompt
length (tokens of the bench's tokenizer), output length and image sizes; the model keeps images by size only.
`predict` runs them through `model.simulate` and returns a result dict with `bench serve`'s keys
(`metrics.calculate_metrics` and the run's per-request lists), so `viz.load_rates`, `rates.point_row` and a
notebook read predicted and measured results alike. `compare` puts a predicted sweep beside a measured one, metric
by metric.
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

from epd_lab.bench.serve import datasets
from epd_lab.bench.serve.arrivals import arrival_offsets
from epd_lab.bench.serve.metrics import calculate_metrics
from epd_lab.bench.serve.rates import point_row
from epd_lab.bench.serve.run import ServeConfig, vllm_fields
from epd_lab.bench.serve.tokenizer import BYTES, ByteTokenizer, Tokenizer
from epd_lab.machine import commit
from epd_lab.whatif.calibration import Calibration
from epd_lab.whatif.model import Cluster, SimRequest, simulate

COMPARED = ("request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")
# the keyword arguments of `datasets.random_mm` that `dataset`'s `random_mm` may set
RANDOM_MM_KEYS = ("range_ratio", "base_items", "items_range_ratio", "limit_items", "buckets", "prefix_len")


def dataset(num_prompts: int, seed: int = 0, image_count: int = 1, image_resolution: str = "448x448",
            input_len: int = 64, output_len: int = 16, random_mm: Mapping | None = None,
            tokenizer: Tokenizer | None = None) -> list[SimRequest]:
    """`bench serve`'s dataset for `seed` as `SimRequest`s due at 0: each request's images (pixels), prompt length
    (tokens of `tokenizer`; none: epd_lab's bytes) and output length. `random_mm`: keyword arguments of
    `datasets.random_mm` (`RANDOM_MM_KEYS`; ``limit_items`` as ``--random-mm-limit-mm-per-prompt`` gives it,
    ``buckets`` as ``--random-mm-bucket-config`` does, text or dict, none: vLLM's default; ``base_items`` 0: the
    text-only ``random`` dataset); without it the ``image`` dataset. `ValueError` for what `bench serve` refuses."""
    tokenizer = tokenizer or ByteTokenizer()
    if random_mm is None:
        height, width = datasets.parse_resolution(image_resolution)
        # the dataset's own prompts; its images are all of one size, drawn from no generator: none is rendered
        drawn = datasets.image_dataset(num_prompts, seed, 0, image_resolution, input_len, output_len, tokenizer)
        return [SimRequest(0.0, (float(height * width),) * image_count, req.prompt_len, req.output_len)
                for req in drawn]
    unknown = set(random_mm) - set(RANDOM_MM_KEYS)
    if unknown:
        raise ValueError(f"random_mm: unknown keys {sorted(unknown)}; known: {', '.join(RANDOM_MM_KEYS)}")
    buckets = datasets.parse_buckets(random_mm.get("buckets") or datasets.DEFAULT_BUCKETS)
    sizes = list(buckets)
    # `datasets.random_mm` itself, its bucket k's images rendered 1 × (k + 1) pixels: its draws depend on the
    # buckets' order and probabilities only (each image's noise comes from a generator of its own), so the requests
    # are the dataset's without full-size noise rendered; an image's width (in its PNG header) names its bucket
    stand_ins = {(1, k + 1): p for k, p in enumerate(buckets.values())}
    options = {k: v for k, v in random_mm.items() if k != "buckets"}
    drawn = datasets.random_mm(num_prompts, seed, input_len, output_len, buckets=stand_ins, tokenizer=tokenizer,
                               **options)
    return [SimRequest(0.0, tuple(float(np.prod(sizes[_png_width(image) - 1])) for image in req.images),
                       req.prompt_len, req.output_len) for req in drawn]


def _png_width(png: bytes | str) -> int:
    """A PNG's width, from its header (8 bytes of signature, the IHDR chunk's length and type, then the width)."""
    assert isinstance(png, bytes) and png[12:16] == b"IHDR", "not a PNG the dataset rendered"
    return int.from_bytes(png[16:20], "big")


def workload(num_prompts: int, rate: float, burstiness: float = 1.0, seed: int = 0, image_count: int = 1,
             image_resolution: str = "448x448", input_len: int = 64, output_len: int = 16,
             random_mm: Mapping | None = None, tokenizer: Tokenizer | None = None,
             requests: Sequence[SimRequest] | None = None) -> list[SimRequest]:
    """The requests of one run: `dataset` (or the `requests` it gave already, for the same arguments) due at
    `bench serve`'s `arrival_offsets` for `rate`, `burstiness` and `seed` (`seed` draws the dataset too, as in
    `bench serve`)."""
    drawn = requests if requests is not None else dataset(num_prompts, seed, image_count, image_resolution,
                                                          input_len, output_len, random_mm, tokenizer)
    offsets = arrival_offsets(len(drawn), rate, burstiness, seed)
    return [replace(req, arrival=float(t)) for req, t in zip(drawn, offsets)]


def predict(cal: Calibration, cluster: Cluster, requests: Sequence[SimRequest], rate: float,
            slos: Mapping[str, float] | None = None, burstiness: float = 1.0,
            percentiles: Sequence[float] = (50, 90, 99), label: str = "", tokenizer_id: str | None = None) -> dict:
    """One predicted run as a `bench serve` result: vLLM's keys (`metrics.calculate_metrics`, then `bench serve`'s
    own per-request lists and peaks, `run.vllm_fields`, from the model's outputs), ours under ``epd_lab``.
    `tokenizer_id`: the tokenizer the prompt lengths were drawn in (none: epd_lab's bytes). The client sends every
    request when due (no ``--max-concurrency``), so each ``queue_times`` entry is 0."""
    outputs = simulate(cal, cluster, requests)
    done = [o for o in outputs if o.success]
    end = max((o.start_time + o.latency for o in done), default=0.0)
    duration = max(end, requests[-1].arrival if requests else 0.0) or 1e-9
    result = calculate_metrics(outputs, duration, dict(slos or {}), ("ttft", "tpot", "itl", "e2el"), percentiles)
    client = ServeConfig("http://whatif", cal.machine, request_rate=rate, burstiness=burstiness,
                         slos=dict(slos or {}), label=label or None)
    result |= vllm_fields(outputs, duration, client)
    first = requests[0].arrival if requests else 0.0
    result |= {
        "backend": "whatif", "endpoint_type": "whatif", "tokenizer_id": tokenizer_id or BYTES,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "epd_lab": {"achieved_rate": (len(requests) - 1) / (requests[-1].arrival - first)
                    if len(requests) > 1 and requests[-1].arrival > first else rate,
                    "images": sum(len(r.pixels) for r in requests),
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
                  burstiness: float = 1.0, **dataset_args: object) -> pd.DataFrame:
    """`sweep rates`, predicted: ``OUT/<topology>/rate-<r>.json``, ``OUT/rates.csv`` and ``OUT/sweep.json``.
    `dataset_args`: `dataset`'s; the dataset is drawn once, every rate sending its requests at its own arrivals."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn = dataset(**dataset_args)  # type: ignore[arg-type]
    tokenizer = dataset_args.get("tokenizer")
    tokenizer_id = getattr(tokenizer, "name", None)
    seed = int(dataset_args.get("seed", 0))  # type: ignore[call-overload]
    rows = []
    for name in topologies:
        cluster = Cluster.parse(name, **dict(cluster_options or {}))
        for rate in sorted(rates):
            requests = workload(len(drawn), rate, burstiness, seed, requests=drawn)
            result = predict(cal, cluster, requests, rate, slos, burstiness, label=name, tokenizer_id=tokenizer_id)
            path = out / name / f"rate-{rate:g}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, default=float) + "\n")
            rows.append(point_row(name, rate, result))
    names = {"input_len": "random_input_len", "output_len": "random_output_len"}  # as sweep rates' sweep.json
    meta = {**{names.get(k, k): v for k, v in dataset_args.items() if k != "tokenizer"}, "burstiness": burstiness,
            "tokenizer": tokenizer_id or BYTES, "topologies": list(topologies), "rates": sorted(rates),
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
