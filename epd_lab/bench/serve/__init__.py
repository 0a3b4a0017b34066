"""`epd-lab bench serve`: a serving benchmark in the field's own terms, against any OpenAI-compatible endpoint.

    epd-lab bench serve --backend openai-chat --base-url http://127.0.0.1:8000 --dataset-name random-mm \\
        --random-mm-bucket-config '{(448, 448, 1): 1.0}' --num-prompts 200 --request-rate 4 --save-result
    epd-lab bench serve --launch 1e1p1d --media url ...     # an epd_lab cluster of its own, images by URL
    epd-lab bench serve --launch 2e1p1d --dataset-name image-repeat --image-repeat-fraction 0.5 \\
        --mm-global-cache both --temperature 0 ...           # the same requests, the global cache off then on

Flags shared with `vllm bench serve` have its names, meanings and defaults (docs/bench-serve.md lists each, and
where this bench differs), and so do the result JSON's shared keys (`metrics`); as vLLM, ``OPENAI_API_KEY`` in the
environment is sent as the bearer token. The modules: `arrivals` (the open-loop schedule), `datasets` (random,
random-mm, image, image-repeat, jsonl), `tokenizer` (prompt lengths in tokens), `cache` (the encoders' cache
counters over a run), `client` (one streamed request, timed), `media_server` (images by URL), `metrics`, `run` (the
loop and the report), `instant` (a server that answers at once, for the bench's own cost), `topologies` (the
clusters ``--launch`` starts).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from epd_lab.bench.serve.cache import cache_counts, encoder_stage_ms, hit_rates
from epd_lab.bench.serve.client import BACKENDS, MEDIA_MODES
from epd_lab.bench.serve.datasets import (DATASETS, DEFAULT_BUCKETS, SampleRequest, image_dataset, jsonl_dataset,
                                          parse_buckets, random_mm, repeated_images)
from epd_lab.bench.serve.metrics import METRICS, parse_goodput
from epd_lab.bench.serve.run import ServeConfig, benchmark, check_endpoint, first_model
from epd_lab.bench.serve.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer
from epd_lab.bench.serve.topologies import launch, parse_devices
from epd_lab.ep.messages import BACKENDS as EP_BACKENDS
from epd_lab.machine import commit, machine_info
from epd_lab.servers.openai_api import MODEL_ID

__all__ = ["ServeConfig", "benchmark", "load_requests", "main", "summary_lines"]
CACHE_MODES = ("off", "on", "both")
# What vLLM drops from the saved result without --save-detailed (it keeps latencies and queue_times)
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def load_requests(args: argparse.Namespace, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """The dataset the arguments name, as `SampleRequest`s, prompt lengths counted by `tokenizer` (none: epd_lab's
    bytes)."""
    if args.dataset_name in ("random", "random-mm"):
        text_only = args.dataset_name == "random"
        return random_mm(args.num_prompts, args.seed, args.random_input_len, args.random_output_len,
                         args.random_range_ratio, 0 if text_only else args.random_mm_base_items_per_request,
                         args.random_mm_num_mm_items_range_ratio, args.random_mm_limit_mm_per_prompt,
                         parse_buckets(args.random_mm_bucket_config), args.random_prefix_len, tokenizer)
    if args.dataset_name == "image":
        return image_dataset(args.num_prompts, args.seed, args.image_count, args.image_resolution,
                             args.random_input_len, args.random_output_len, tokenizer)
    if args.dataset_name == "image-repeat":
        return repeated_images(args.num_prompts, args.seed, args.image_repeat_fraction, args.image_pool_size,
                               args.image_zipf, args.image_resolution, args.random_input_len, args.random_output_len,
                               tokenizer)
    if not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    requests = jsonl_dataset(args.dataset_path, args.num_prompts, args.random_output_len)
    for req in requests:  # counted as vLLM counts a custom dataset's prompts (the server's usage overrides it)
        req.prompt_len = len((tokenizer or ByteTokenizer()).encode(req.prompt))
    return requests


def summary_lines(result: dict) -> list[str]:
    """vLLM's printout of a result: counts, throughputs, then each metric's mean, median and percentiles."""
    lines = [f"{'Successful requests:':40s} {result['completed']}", f"{'Failed requests:':40s} {result['failed']}",
             f"{'Benchmark duration (s):':40s} {result['duration']:.2f}",
             f"{'Total input tokens:':40s} {result['total_input_tokens']}",
             f"{'Total generated tokens:':40s} {result['total_output_tokens']}",
             f"{'Request throughput (req/s):':40s} {result['request_throughput']:.2f}"]
    if result["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':40s} {result['request_goodput']:.2f}")
    lines += [f"{'Output token throughput (tok/s):':40s} {result['output_throughput']:.2f}",
              f"{'Peak output token throughput (tok/s):':40s} {result['max_output_tokens_per_s']:.2f}",
              f"{'Peak concurrent requests:':40s} {result['max_concurrent_requests']:.2f}",
              f"{'Total token throughput (tok/s):':40s} {result['total_token_throughput']:.2f}"]
    for name in METRICS:
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std")]
        lines += [f"{k.replace('_ms', '').replace('_', ' ') + ' (ms):':40s} {result[k]:.2f}" for k in keys]
    own = result["epd_lab"]
    lines.append(f"{'Client encoding per request, p50 (ms):':40s} {own['client_encode_ms']['p50']:.3f}")
    lines.append(f"{'Bench CPU per request (ms):':40s} {own['bench_cpu_ms_per_request']:.3f}")
    if own.get("server") and own["server"].get("proxy_parse_to_load_ms"):
        lines.append(f"{'Server proxy_parse->load gap, p50 (ms):':40s} "
                     f"{own['server']['proxy_parse_to_load_ms']['p50']:.3f}")
    return lines


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (inf: all at once), got {text}")
    return value


def _backend(text: str) -> str:
    if text in EP_BACKENDS:
        raise argparse.ArgumentTypeError(f"{text!r} is an E→P backend: give it as --launch-backend (--backend is "
                                         f"vLLM's request backend: {' or '.join(BACKENDS)})")
    return text


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line's options, grouped: where to send, the load, sampling, the dataset, the report."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench serve", description=__doc__.splitlines()[0])
    where = ap.add_argument_group("where (vLLM's)")
    where.add_argument("--backend", "--endpoint-type", dest="backend", type=_backend, choices=BACKENDS,
                       default="openai",
                       help="vLLM's request backend: openai-chat (/v1/chat/completions, text and images) or openai "
                       "(/v1/completions, text only); --endpoint-type is its older name")
    where.add_argument("--base-url", help="the server's root, e.g. http://127.0.0.1:8000 (default: from --host and "
                       "--port)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument("--endpoint", default=None, help="the path requests go to (default: the backend's own)")
    where.add_argument("--model", default=None, help="the model field of each request (default: the server's "
                       "first /v1/models entry)")
    where.add_argument("--tokenizer", default=None, help="counts prompt tokens: a Hugging Face name or directory, "
                       "or bytes (epd_lab's models; default: the model's, bytes for an epd_lab server)")
    where.add_argument("--label", default=None, help="the result's label and file name prefix (default: --backend)")
    where.add_argument("--served-model-name", default=None, help="the model field of each request, where it is not "
                       "--model's (which then names the tokenizer)")
    where.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE", help="headers of every request")
    own = ap.add_argument_group("where (epd_lab's)")
    own.add_argument("--launch", metavar="TOPOLOGY", help="start an epd_lab cluster on loopback: monolithic, "
                     "Nxmonolithic (2xmonolithic: replicas behind a round-robin front), or NeMpKd (1e1p1d, 2e1p1d: "
                     "encoders, prefills, decodes behind the proxy)")
    own.add_argument("--launch-backend", choices=EP_BACKENDS, default="mooncake",
                     help="the launched cluster's E→P backend")
    own.add_argument("--launch-model", help="the model the launched cluster loads: tiny (default), a shape "
                     "(qwen2-vl-2b) or a local directory")
    own.add_argument("--device", default="cpu", help="the launched cluster's device")
    own.add_argument("--devices", type=parse_devices, default={}, metavar="NAME=DEVICE[,...]",
                     help="roles' or processes' own devices over --device, e.g. monolithic1=cuda:1 or encoder=cuda:1")
    own.add_argument("--instant", action="store_true", help="against a server that answers at once (the bench's "
                     "own cost)")
    own.add_argument("--mm-global-cache", choices=CACHE_MODES, default="off", help="the launched cluster's global "
                     "embedding cache (a mooncake_master of its own): off, on, or both (the same requests against a "
                     "cluster with it off, then a fresh one with it on; the saved JSON holds both results)")
    own.add_argument("--media", choices=MEDIA_MODES, default="data-uri", help="images inside the request, or by "
                     "URL from a media server on 127.0.0.1")
    load = ap.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=1000)
    load.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=0, help="warm-up requests (the first request's, its "
                      "images changed by a pixel) before the run")
    sampling = ap.add_argument_group("sampling (sent only when given: else the server's defaults)")
    sampling.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (always, for random and "
                          "random-mm, as vLLM)")
    sampling.add_argument("--temperature", type=float, default=None, help="0: greedy, the answers of the "
                          "monolithic model (epd_lab's servers default to 1.0, OpenAI's)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON", help="more fields of "
                          "every request body, e.g. '{\"seed\": 1}' (over the sampling flags, as vLLM)")
    data = ap.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", help="jsonl: the file")
    data.add_argument("--random-input-len", type=int, default=1024, help="tokens of text per request")
    data.add_argument("--random-output-len", type=int, default=128, help="tokens asked per request")
    data.add_argument("--input-len", type=int, default=None, help="sets --random-input-len, as vLLM")
    data.add_argument("--output-len", type=int, default=None, help="sets --random-output-len, as vLLM")
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="input and output lengths drawn in "
                      "[len (1 - r), len (1 + r)]")
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares, "
                      "before its own --random-input-len")
    data.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    data.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    data.add_argument("--random-mm-limit-mm-per-prompt", default='{"image": 255, "video": 1}',
                      help='JSON, e.g. \'{"image": 3, "video": 0}\' (video: no effect, see the bucket config)')
    data.add_argument("--random-mm-bucket-config", default=DEFAULT_BUCKETS, help="{(height, width, frames): "
                      "probability, ...}; a video bucket (frames > 1) must have probability 0")
    data.add_argument("--image-count", type=int, default=1)
    data.add_argument("--image-resolution", default="448x448")
    data.add_argument("--image-repeat-fraction", type=float, default=0.5, help="image-repeat: the share of "
                      "requests whose image was sent before")
    data.add_argument("--image-pool-size", type=int, default=64, help="image-repeat: repeats come from the last N "
                      "distinct images (with --image-zipf: the pool all images come from)")
    data.add_argument("--image-zipf", type=float, default=None, metavar="S", help="image-repeat: draw every image "
                      "from the pool by Zipf's law with exponent S instead of a repeat fraction")
    out = ap.add_argument_group("report")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"of {','.join(METRICS)}; the queue "
                     "metrics only with --max-concurrency, the last only with a finite --request-rate too")
    out.add_argument("--metric-percentiles", default="99")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true", help="keep the per-request lists in the saved result "
                     "(input_lens, output_lens, start_times, ttfts, itls, generated_texts, errors)")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="written into the result")
    return ap


def _config(args: argparse.Namespace,
            ap: argparse.ArgumentParser) -> tuple[ServeConfig, list[SampleRequest], dict[str, str]]:
    """The run's settings, requests and ``--metadata`` from the arguments: the URL, the model (the server's first
    when not given), its tokenizer, the dataset. Usage errors exit through `ap.error`, in one line."""
    if args.launch and args.instant:
        ap.error("give one of --launch, --instant")
    if (args.launch or args.instant) and args.base_url:
        ap.error("--base-url is the server's; --launch and --instant start their own")
    if args.dataset_path and args.dataset_name != "jsonl":
        ap.error(f"--dataset-name {args.dataset_name} takes no --dataset-path")
    args.random_input_len = args.random_input_len if args.input_len is None else args.input_len
    args.random_output_len = args.random_output_len if args.output_len is None else args.output_len
    api_key = os.environ.get("OPENAI_API_KEY")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        owned_by = None
        model = args.model or (MODEL_ID if args.launch or args.instant else None)
        if model is None:
            model, owned_by = first_model(base_url, api_key)
        tokenizer = get_tokenizer(args.tokenizer or model, owned_by)
        requests = load_requests(args, tokenizer)
        if args.backend == "openai" and any(r.images for r in requests):
            raise ValueError(f"--backend openai posts /v1/completions, which takes text only; --dataset-name "
                             f"{args.dataset_name} has images: use --backend openai-chat")
        sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                      ("top_k", args.top_k)) if v is not None} | (args.extra_body or {})
        config = ServeConfig(base_url, model, args.endpoint, args.request_rate, args.burstiness, args.max_concurrency,
                             args.media, parse_goodput(args.goodput), tuple(args.percentile_metrics.split(",")),
                             tuple(float(q) for q in args.metric_percentiles.split(",")), args.seed,
                             not args.disable_tqdm, api_key, args.backend,
                             args.ignore_eos or args.dataset_name in ("random", "random-mm"), sampling,
                             args.num_warmups, tokenizer, args.label, args.served_model_name,
                             _pairs("--header", args.header))
        metadata = _pairs("--metadata", args.metadata)
        if not (args.launch or args.instant):
            check_endpoint(config)
    except ValueError as exc:
        ap.error(str(exc))
    if "temperature" not in sampling:
        print("note: no --temperature: the server's default applies (epd_lab's: 1.0, sampled); --temperature 0 "
              "for greedy answers, equal to the monolithic model's")
    return config, requests, metadata


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items → a dict; `ValueError` naming an item without ``=``."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def main(argv: list[str] | None = None) -> int:
    """``epd-lab bench serve``: run, print vLLM's summary, save the JSON when asked."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.mm_global_cache != "off" and not args.launch:
        ap.error("--mm-global-cache is the launched cluster's: give --launch")
    config, requests, metadata = _config(args, ap)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.mm_global_cache]
    results = [metadata | _run_once(args, requests, config, cache) for cache in modes]  # as vLLM: results win
    for cache, one in zip(modes, results):
        if len(modes) > 1:
            print(f"---- global embedding cache {'on' if cache else 'off'} ----")
        print("\n".join(summary_lines(one)))
    result = results[-1]
    if len(modes) > 1:
        result = {"cache_off": results[0], "cache_on": results[1],
                  "comparison": cache_comparison(*results, greedy=config.sampling.get("temperature") == 0)}
        print(json.dumps(result["comparison"], indent=1))
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
                                        f"{config.model.split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = result if args.save_detailed else _without_details(result)
        path.write_text(json.dumps(saved, indent=1, default=float) + "\n")
        print(f"wrote {path}")
    return 0 if all(r["completed"] for r in results) else 1


def _without_details(result: dict) -> dict:
    """`result` without the per-request lists vLLM saves only with ``--save-detailed`` (each of a global cache
    comparison's two results too)."""
    if "cache_off" in result:
        return {**result, "cache_off": _without_details(result["cache_off"]),
                "cache_on": _without_details(result["cache_on"])}
    return {k: v for k, v in result.items() if k not in DETAILED_KEYS}


def _run_once(args: argparse.Namespace, requests: list[SampleRequest], config: ServeConfig, cache: bool) -> dict:
    """One benchmark of `requests`: against a cluster of its own (started with the global cache on or off; the
    encoders' cache counters over the run then go under ``epd_lab.cache``), the instant server or the URL."""
    with contextlib.ExitStack() as stack:
        encoders: list[str] = []
        if args.launch:
            cluster = stack.enter_context(launch(args.launch, backend=args.launch_backend, device=args.device,
                                                 devices=args.devices, model=args.launch_model,
                                                 media_url=args.media == "url", mm_global_cache=cache))
            config = replace(config, base_url=cluster.proxy_url)
            encoders = cluster.encoder_urls
        elif args.instant:
            from epd_lab.bench.serve.instant import InstantServer

            config = replace(config, base_url=stack.enter_context(InstantServer(args.random_output_len)).url)
        before = cache_counts(encoders) if encoders else None
        result = benchmark(requests, config)
        if before is not None:
            result["epd_lab"]["cache"] = {"mm_global_cache": cache, **hit_rates(before, cache_counts(encoders)),
                                          "encoder_stage_ms": encoder_stage_ms(cluster.spans())}
    result["epd_lab"] |= {"dataset": args.dataset_name, "launch": args.launch, "instant": args.instant,
                          "commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "machine": machine_info()}
    return result


def cache_comparison(off: dict, on: dict, greedy: bool = True) -> dict:
    """The global cache off against on, from two results of the same requests: hit rates, TTFT p50/p99, and how
    many answers were the same (`greedy` decoding: every one must be; sampled answers differ anyway)."""
    row = {}
    for name, result in (("off", off), ("on", on)):
        cache = result["epd_lab"].get("cache", {})
        row[name] = {"completed": result["completed"], "failed": result["failed"],
                     "hit_rate": cache.get("hit_rate"), "l3_hit_rate": cache.get("l3_hit_rate"),
                     "median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result.get("p99_ttft_ms"),
                     "encoder_stage_ms": cache.get("encoder_stage_ms"),
                     "mean_ttft_ms": result["mean_ttft_ms"], "median_e2el_ms": result.get("median_e2el_ms")}
    row["ttft_p50_on_over_off"] = row["on"]["median_ttft_ms"] / row["off"]["median_ttft_ms"]
    pairs = [(a, b) for a, b, ea, eb in zip(off["generated_texts"], on["generated_texts"], off["errors"], on["errors"])
             if not ea and not eb]
    row["answers"] = {"compared": len(pairs), "equal": sum(a == b for a, b in pairs), "greedy": greedy}
    return row
