"""`epd-lab whatif`: calibrate the model from recorded runs, predict a rate sweep, compare it with a measured one,
ask the what-ifs.

    epd-lab whatif calibrate data/bench/goodput-cpu-tiny-1x224 data/bench/goodput-cpu-tiny-4x448 \\
        --machine cpu-intel-xeon --device-slots 2 --host-on-device --out data/calibration/cpu-intel-xeon.json
    epd-lab whatif run --calibration data/calibration/cpu-intel-xeon.json --topologies monolithic,1e1p1d \\
        --rates 4,8,16 --num-prompts 48 --image-count 1 --image-resolution 224x224 --goodput ttft:100 tpot:10 \\
        --out out/predicted
    epd-lab whatif run --calibration data/calibration/cpu-intel-xeon.json --topologies 1e1p1d --rates 2,4 \\
        --dataset-name random-mm --random-mm-limit-mm-per-prompt '{"image": 3, "video": 0}' \\
        --random-mm-bucket-config '{(224, 224, 1): 0.5, (448, 448, 1): 0.5}' --out out/predicted-mm
    epd-lab whatif compare out/predicted data/bench/goodput-cpu-tiny-1x224
    epd-lab whatif ask --calibration data/calibration/h200.json --out data/whatif/h200-whatifs
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from epd_lab.bench.serve import parser as serve_parser
from epd_lab.bench.serve.metrics import parse_goodput
from epd_lab.bench.serve.tokenizer import BYTES, get_tokenizer
from epd_lab.bench.serve.topologies import parse_devices
from epd_lab.whatif.calibration import Calibration, Link, fit, read_point, runtime_slope
from epd_lab.machine import commit
from epd_lab.whatif.run import compare, predict_sweep, tune_slots
from epd_lab.whatif.scenarios import WHATIFS, answer


def _points(paths: list[str]) -> tuple[list, int]:
    """Every ``rate-*.json`` (or ``.json.gz``) under the given folders (or the files given), and the runs'
    ``--random-input-len``."""
    points, input_len = [], 64
    for name in paths:
        path = Path(name)
        files = sorted([*path.glob("*/rate-*.json"), *path.glob("*/rate-*.json.gz")]) if path.is_dir() else [path]
        if path.is_dir() and (path / "sweep.json").exists():
            input_len = json.loads((path / "sweep.json").read_text()).get("random_input_len", input_len)
        points += [read_point(f) for f in files]
    return points, input_len


# `bench serve`'s workload flags that `whatif run` takes, from bench serve's own parser (names, types, meanings,
# help), with `sweep rates`' defaults where it has the flag and epd_lab's byte tokenizer (no server to ask for its
# model's). Not taken: --max-concurrency (the model's client sends each request when due), and the image-repeat
# (the model has no embedding cache) and jsonl datasets.
WORKLOAD_FLAGS = ("num_prompts", "burstiness", "seed", "dataset_name", "tokenizer", "random_input_len",
                  "random_output_len", "input_len", "output_len", "random_range_ratio", "random_prefix_len",
                  "random_mm_base_items_per_request", "random_mm_num_mm_items_range_ratio",
                  "random_mm_limit_mm_per_prompt", "random_mm_bucket_config", "image_count", "image_resolution",
                  "goodput")
WORKLOAD_DEFAULTS = {"num_prompts": 32, "dataset_name": "image", "random_input_len": 64, "random_output_len": 16,
                     "tokenizer": BYTES}
WHATIF_DATASETS = ("random", "random-mm", "image")


def _bench_serve_flags(target: argparse.ArgumentParser) -> None:
    """`WORKLOAD_FLAGS` added to `target` as `bench serve`'s parser defines them, with `WORKLOAD_DEFAULTS`."""
    actions = {action.dest: action for action in serve_parser()._actions}
    for dest in WORKLOAD_FLAGS:
        a = actions[dest]
        kw = {"dest": dest, "nargs": a.nargs, "type": a.type, "choices": a.choices, "metavar": a.metavar,
              "default": WORKLOAD_DEFAULTS.get(dest, a.default), "help": a.help}
        if dest == "dataset_name":
            kw["choices"] = WHATIF_DATASETS
        if dest == "tokenizer":
            kw["help"] = ("the tokenizer prompt lengths are drawn in, as bench serve's --tokenizer: a Hugging Face "
                          f"name or directory, or {BYTES} (epd_lab's models)")
        target.add_argument(*a.option_strings, **{k: v for k, v in kw.items() if v is not None or k == "default"})


def _link(text: str | None) -> Link | None:
    """``LATENCY_MS[:GBPS]`` → `Link`."""
    if text is None:
        return None
    latency, _, gbps = text.partition(":")
    return Link(float(latency), float(gbps) if gbps else math.inf)


def main(argv: list[str] | None = None) -> int:
    """``epd-lab whatif calibrate|run|compare|ask ...``: see the module docstring."""
    ap = argparse.ArgumentParser(prog="epd-lab whatif", description=" ".join(__doc__.split("\n\n")[0].split()),
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="what", required=True)
    cal = sub.add_parser("calibrate", allow_abbrev=False,
                         help="fit a calibration JSON from bench serve / sweep rates results")
    cal.add_argument("sources", nargs="+", help="sweep folders (their */rate-*.json) or result JSONs")
    cal.add_argument("--machine", required=True, help="the calibration's name, e.g. h200-qwen2-vl-2b")
    cal.add_argument("--device-slots", type=float, default=1, help="stages one device runs at once (GPU 1, CPU cores)")
    cal.add_argument("--tune-slots", action="store_true", help="fit the device's effective slots (0.5 to 2) to the "
                     "source sweeps' TTFT p50 and goodput instead (a CPU shared with the client and other work)")
    cal.add_argument("--host-on-device", action="store_true", help="host work takes a device slot (a CPU machine)")
    cal.add_argument("--decode-max-batch", type=int, default=16)
    cal.add_argument("--runtime", default=None, metavar="JSON:MODEL:RUNTIME", help="a bench runtime result whose "
                     "decode steps at 1 and 16 in a batch give the step's cost per request (e.g. "
                     "data/bench/runtime-cpu-intel-xeon.json:tiny:hf)")
    cal.add_argument("--embed-bytes-per-token", type=int, default=None)
    cal.add_argument("--kv-bytes-per-token", type=int, default=None)
    cal.add_argument("--out", required=True)
    run = sub.add_parser("run", allow_abbrev=False,
                         help="predict sweep rates (same workload arguments, same result keys)")
    run.add_argument("--calibration", required=True)
    run.add_argument("--topologies", default="monolithic,1e1p1d,2e1p1d")
    run.add_argument("--rates", required=True, help="requests/s, comma-separated")
    _bench_serve_flags(run)
    run.add_argument("--placement", type=parse_devices, default={}, metavar="ROLE=DEVICE[,...]",
                     help="roles' devices (encoder=gpu1, or encoder1=gpu2); the rest share one device")
    run.add_argument("--ep-link", default=None, metavar="MS[:GBPS]", help="E→P link (default: the calibration's)")
    run.add_argument("--pd-link", default=None, metavar="MS[:GBPS]", help="P→D link (default: the calibration's)")
    run.add_argument("--encoder-tp", type=int, default=1)
    run.add_argument("--out", required=True)
    ask = sub.add_parser("ask", allow_abbrev=False,
                         help="the what-ifs (equal GPUs, encoders per prefill, RDMA, TP) with error bars")
    ask.add_argument("--calibration", required=True)
    ask.add_argument("--rates", default=",".join(str(r) for r in range(2, 50, 2)))
    ask.add_argument("--num-prompts", type=int, default=64)
    ask.add_argument("--image-count", type=int, default=4)
    ask.add_argument("--image-resolution", default="448x448")
    ask.add_argument("--goodput", nargs="+", default=["ttft:300", "tpot:30"], metavar="NAME:MS")
    ask.add_argument("--spread", type=float, default=0.15, help="± share the device costs are scaled by")
    ask.add_argument("--out", required=True, help="folder: whatifs.csv (per rate), capacity.csv, inputs.json")
    cmp = sub.add_parser("compare", allow_abbrev=False,
                         help="relative error of a predicted sweep against a measured one")
    cmp.add_argument("predicted")
    cmp.add_argument("measured")
    cmp.add_argument("--csv", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.what == "calibrate":
        points, input_len = _points(args.sources)
        shape = {k: getattr(args, k) for k in ("embed_bytes_per_token", "kv_bytes_per_token")
                 if getattr(args, k) is not None}
        try:
            slope = None
            if args.runtime:
                path, model, runtime = args.runtime.split(":")
                slope = runtime_slope(path, model, runtime)
            c = fit(points, args.machine, args.device_slots, args.host_on_device, args.decode_max_batch, input_len,
                    slope, **shape)
            if args.runtime:
                c.sources.append(path)
        except ValueError as exc:
            ap.error(str(exc))
        if args.tune_slots:
            c = tune_slots(c, [s for s in args.sources if (Path(s) / "rates.csv").exists()])
        c.save(args.out)
        print(c.to_json(), end="")
        return 0
    if args.what == "run":
        c = Calibration.load(args.calibration)
        try:
            slos = parse_goodput(args.goodput)
            rates = [float(r) for r in args.rates.split(",")]
        except ValueError as exc:
            ap.error(str(exc))
        if args.input_len is not None:  # vLLM's aliases, as bench serve takes them
            args.random_input_len = args.input_len
        if args.output_len is not None:
            args.random_output_len = args.output_len
        mm = None
        if args.dataset_name in ("random", "random-mm"):  # bench serve's `load_requests`: random is random-mm's text
            mm = {"range_ratio": args.random_range_ratio, "prefix_len": args.random_prefix_len,
                  "base_items": 0 if args.dataset_name == "random" else args.random_mm_base_items_per_request,
                  "items_range_ratio": args.random_mm_num_mm_items_range_ratio,
                  "limit_items": args.random_mm_limit_mm_per_prompt, "buckets": args.random_mm_bucket_config}
        options = {"placement": args.placement, "ep_link": _link(args.ep_link), "pd_link": _link(args.pd_link),
                   "encoder_tp": args.encoder_tp}
        try:
            table = predict_sweep(c, args.topologies.split(","), rates, args.out, slos, options,
                                  burstiness=args.burstiness, num_prompts=args.num_prompts, seed=args.seed,
                                  image_count=args.image_count, image_resolution=args.image_resolution,
                                  input_len=args.random_input_len, output_len=args.random_output_len, random_mm=mm,
                                  tokenizer=get_tokenizer(args.tokenizer))
        except ValueError as exc:
            ap.error(str(exc))
        print(table.to_string(index=False))
        return 0
    if args.what == "ask":
        c = Calibration.load(args.calibration)
        rates = [float(r) for r in args.rates.split(",")]
        slos = parse_goodput(args.goodput)
        per_rate, summary = answer(c, WHATIFS, rates, slos, num_prompts=args.num_prompts, spread=args.spread,
                                   image_count=args.image_count, image_resolution=args.image_resolution)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        per_rate.drop(columns="assumes").round(3).to_csv(out / "whatifs.csv", index=False)  # assumes: capacity.csv
        summary.to_csv(out / "capacity.csv", index=False)
        inputs = {k: v for k, v in vars(args).items() if k not in ("what", "out")} | {"commit": commit()}
        (out / "inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")
        print(summary.drop(columns="assumes").to_string(index=False))
        return 0
    table = compare(args.predicted, args.measured)
    if args.csv:
        table.round(4).to_csv(args.csv, index=False)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0
