"""`epd-lab sweep rates`: `bench serve` over request rates and topologies, for goodput-vs-rate and TTFT/TPOT fronts.

    epd-lab sweep rates --topologies monolithic,1e1p1d,2e1p1d --rates 1,2,4,8 --num-prompts 64 \\
        --image-count 4 --image-resolution 448x448 --goodput ttft:1000 tpot:20 --out data/bench/goodput-cpu-tiny

Each topology's cluster starts once (`topologies.launch`), answers warm-up requests sent all at once, then takes
every rate in turn, lowest first. Each rate's requests come from a seed of their own, and every image is distinct, so
no request hits an encoder's embedding cache (unless ``--image-repeat-fraction`` asks for repeats; with
``--mm-global-cache`` the encoders share the global cache: one call with it, one without, compare the two);
every topology gets the same requests at a rate. Every point's result
(`run.benchmark`, vLLM's keys) goes to ``OUT/<topology>/rate-<r>.json`` (no ``=`` in the name: some result
transfers do not carry such names back); ``OUT/rates.csv`` has a row per point (`point_row`) and ``OUT/sweep.json`` the
settings. A later call into the same folder replaces the rows of the
topologies it runs and keeps the others (a time limit per run may allow one topology per call). The per-request lists in
each JSON let goodput be recomputed for
any other SLOs afterwards (`epd_lab.viz.goodput`). On several GPUs, ``--devices monolithic1=cuda:1`` (or
``encoder=cuda:1``) places a role or a process over ``--device`` for every topology of the call: one placement per
call, each into its own ``--out`` (two placements of ``1e1p1d`` would share ``OUT/1e1p1d/``; docs/gpu.md).

``--placements 2xmonolithic,e-gpu1,d-gpu1,spread --gpus cuda:0,cuda:1`` runs the deployments at equal GPUs
(`topologies.PLACEMENTS`) instead, one after the other, each into ``OUT/<placement>/``, the same requests at each
rate; ``OUT/answers.json`` then says, per rate, how many answers each placement in ``OUT`` (an earlier call's too)
gave that equal the reference placement's (`placement_answers`: greedy, every split must answer as the monolithic
model does). The exit status is 1 when one did not.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pandas as pd

from epd_lab.bench.serve.datasets import image_dataset, repeated_images
from epd_lab.bench.serve.metrics import parse_goodput
from epd_lab.bench.serve.run import GREEDY, ServeConfig, benchmark
from epd_lab.bench.serve.topologies import PLACEMENTS, launch, parse_devices, placement, topology

SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_e2el_ms", "p99_e2el_ms")


def point_row(name: str, rate: float, result: dict) -> dict:
    """One sweep point's row: topology, rate, and the result's summary keys."""
    return {"topology": name, "request_rate": rate, **{k: result.get(k) for k in SUMMARY_KEYS},
            "achieved_rate": result["epd_lab"]["achieved_rate"]}


def rate_sweep(topologies: Sequence[str], rates: Sequence[float], make_requests: Callable[[int], list],
               config: ServeConfig, out: str | Path, launch_options: dict | None = None,
               settings: dict | None = None, log: Callable[[str], None] = print) -> pd.DataFrame:
    """Run every rate on every topology (see the module docstring); returns the rows of ``rates.csv``.
    `make_requests(seed)` gives one rate's requests; `settings` (what they are: image count, resolution, ...) go
    to ``sweep.json`` with the topologies, rates and SLOs."""
    out = Path(out)
    options = launch_options or {}
    for name in topologies:
        topology(name, **options)  # an unknown name fails before any cluster starts
    out.mkdir(parents=True, exist_ok=True)
    meta = {**(settings or {}), "topologies": list(topologies), "rates": sorted(rates), "goodput": config.slos,
            "media": config.media, "burstiness": config.burstiness}
    if (out / "sweep.json").exists():  # the topologies of earlier calls into the same folder, in order
        earlier = json.loads((out / "sweep.json").read_text()).get("topologies", [])
        meta["topologies"] = [*earlier, *(t for t in topologies if t not in earlier)]
    (out / "sweep.json").write_text(json.dumps(meta, indent=1) + "\n")
    rows = []
    for name in topologies:
        with launch(name, **options) as cluster:
            base = replace(config, base_url=cluster.proxy_url, progress=False)
            # warm-up: a burst, so that every process has served concurrent requests before the first rate
            benchmark(make_requests(10_000), replace(base, request_rate=math.inf, num_warmups=0), server_spans=False)
            for i, rate in enumerate(sorted(rates)):
                result = benchmark(make_requests(i), replace(base, request_rate=rate))
                path = out / name / f"rate-{rate:g}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, default=float) + "\n")
                rows.append(point_row(name, rate, result))
                r = rows[-1]
                goodput = r["request_goodput"] if r["request_goodput"] is None else round(r["request_goodput"], 2)
                log(f"  {name:12s} rate {rate:6g}: {r['completed']} done, {r['request_throughput']:.2f} req/s, "
                    f"goodput {goodput}, TTFT p50 {r['median_ttft_ms']:.1f} ms, TPOT p50 {r['median_tpot_ms']:.2f} ms")
    table = pd.DataFrame(rows)
    if (out / "rates.csv").exists():  # an earlier call's other topologies stay (one call per topology fits a budget)
        earlier = pd.read_csv(out / "rates.csv")
        table = pd.concat([earlier[~earlier["topology"].isin(topologies)], table], ignore_index=True)
    table.to_csv(out / "rates.csv", index=False)
    return table


def placement_sweep(placements: Sequence[str], gpus: Sequence[str], rates: Sequence[float],
                    make_requests: Callable[[int], list], config: ServeConfig, out: str | Path,
                    launch_options: dict | None = None, settings: dict | None = None,
                    log: Callable[[str], None] = print) -> dict:
    """`rate_sweep` of each placement (`topologies.placement` over `gpus`) into ``OUT/<placement>/``, then
    `placement_answers` over every placement in ``OUT`` (an earlier call's too); returns what it wrote to
    ``OUT/answers.json``."""
    out = Path(out)
    placed = {name: placement(name, gpus) for name in placements}  # an unknown name fails before any cluster
    for name, (topology_name, device, devices) in placed.items():
        log(f"placement {name}: {topology_name} on {device}, {devices}")
        rate_sweep([topology_name], rates, make_requests, config, out / name,
                   {**(launch_options or {}), "device": device, "devices": devices},
                   {**(settings or {}), "placement": name, "device": device, "devices": devices}, log)
    answers = placement_answers(out)
    (out / "answers.json").write_text(json.dumps(answers, indent=1) + "\n")
    log(f"answers equal to {answers['reference']}'s: {answers['all_equal']}")
    return answers


def placement_answers(out: str | Path) -> dict:
    """The answers of every placement swept into `out`, compared per rate with the reference placement's
    (``2xmonolithic`` where it ran, else the first in `PLACEMENTS` order) on the requests both answered: how many
    were compared and how many equal. ``all_equal``: every compared answer was, and some were compared."""
    out = Path(out)
    present = [name for name in PLACEMENTS if (out / name / "rates.csv").exists()]
    if not present:
        raise ValueError(f"no placement was swept into {out}")

    def texts(path: Path) -> list[str | None]:
        result = json.loads(path.read_text())
        return [None if error else text for text, error in zip(result["generated_texts"], result["errors"])]

    reference, by_rate, compared = present[0], {}, []
    for path in sorted((out / reference / PLACEMENTS[reference][0]).glob("rate-*.json")):
        ref = texts(path)
        by_rate[path.stem.removeprefix("rate-")] = row = {}
        for name in present[1:]:
            other = out / name / PLACEMENTS[name][0] / path.name
            if other.exists():
                pairs = [(a, b) for a, b in zip(ref, texts(other)) if a is not None and b is not None]
                row[name] = {"compared": len(pairs), "equal": sum(a == b for a, b in pairs)}
                compared.append(row[name])
    return {"reference": reference, "placements": present, "rates": by_rate,
            "all_equal": bool(compared) and all(c["compared"] and c["equal"] == c["compared"] for c in compared)}


def main(argv: list[str] | None = None) -> int:
    """``epd-lab sweep rates ...``: see the module docstring."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab sweep rates", description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default="monolithic,1e1p1d,2e1p1d")
    ap.add_argument("--rates", required=True, help="requests/s, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--image-count", type=int, default=1)
    ap.add_argument("--image-resolution", default="448x448")
    ap.add_argument("--random-input-len", type=int, default=64)
    ap.add_argument("--random-output-len", type=int, default=16)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--media", choices=("data-uri", "url"), default="url")
    ap.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    ap.add_argument("--launch-backend", default="mooncake", help="the launched clusters' E→P backend")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--devices", type=parse_devices, default={}, metavar="NAME=DEVICE[,...]",
                    help="roles' or processes' own devices over --device (monolithic1=cuda:1), for every topology "
                    "of the call: a name one of them does not start is refused")
    ap.add_argument("--placements", default=None, metavar="NAME[,...]",
                    help=f"the placements at equal GPUs over --gpus instead of --topologies: "
                         f"{','.join(PLACEMENTS)}, or all")
    ap.add_argument("--gpus", default="cuda:0,cuda:1", metavar="DEV0,DEV1", help="the two devices of --placements")
    ap.add_argument("--launch-model", default=None)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks of each prefill, decode or floor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mm-global-cache", action="store_true", help="the encoders share the global embedding cache "
                    "(a mooncake_master per cluster); run once with and once without, into two --out folders")
    ap.add_argument("--image-repeat-fraction", type=float, default=None, help="requests repeat an earlier image "
                    "of their rate's requests at this share (the image-repeat dataset, one image each); unset: every "
                    "image distinct")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
        config = ServeConfig("http://placeholder", burstiness=args.burstiness, media=args.media,
                             slos=parse_goodput(args.goodput), percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                             seed=args.seed, ignore_eos=True, sampling=GREEDY, num_warmups=1)
    except ValueError as exc:
        ap.error(str(exc))

    def make_requests(seed: int) -> list:
        if args.image_repeat_fraction is not None:
            return repeated_images(args.num_prompts, args.seed * 1000 + seed, args.image_repeat_fraction,
                                   resolution=args.image_resolution, input_len=args.random_input_len,
                                   output_len=args.random_output_len)
        return image_dataset(args.num_prompts, args.seed * 1000 + seed, args.image_count, args.image_resolution,
                             args.random_input_len, args.random_output_len)

    options = {"backend": args.launch_backend, "device": args.device, "devices": args.devices,
               "model": args.launch_model,
               "media_url": args.media == "url", "kv_blocks": args.kv_blocks,
               **({"mm_global_cache": True} if args.mm_global_cache else {})}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "rates", "topologies", "goodput")}
    if args.placements is None:
        rate_sweep(args.topologies.split(","), rates, make_requests, config, args.out, options, settings)
        return 0
    if args.devices:
        ap.error("--devices places the roles of --topologies; --placements places its own over --gpus")
    placements = list(PLACEMENTS) if args.placements == "all" else args.placements.split(",")
    gpus = args.gpus.split(",")
    try:  # a usage error before any cluster starts (placement_sweep checks again, for its other callers)
        for name in placements:
            placement(name, gpus)
    except ValueError as exc:
        ap.error(str(exc))
    answers = placement_sweep(placements, gpus, rates, make_requests, config, args.out, options, settings)
    return 0 if answers["all_equal"] or len(answers["placements"]) == 1 else 1
