"""`epd-lab bench serve`: its metrics against hand-computed traces, its arrival schedule, its datasets (vLLM's draws
and JSON forms, prompt lengths in tokens), its result JSON against vLLM's keys and types, its usage errors, and
short real runs (an instant server; a 1E1P1D cluster, vLLM's documented random-mm command against its proxy, and the
monolithic floor, by data URI and by URL)."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pandas
import pytest

from epd_lab.bench.serve import benchmark
from epd_lab.bench.serve import main as serve_main
from epd_lab.bench.serve.arrivals import arrival_offsets
from epd_lab.bench.serve.datasets import (DEFAULT_BUCKETS, SampleRequest, image_dataset, jsonl_dataset, parse_buckets,
                                          parse_mm_limit, parse_resolution, random_mm)
from epd_lab.bench.serve.instant import InstantServer
from epd_lab.bench.serve.media_server import MediaServer
from epd_lab.bench.serve.metrics import (RequestOutput, calculate_metrics, is_good, outputs_from_result,
                                         parse_goodput, percentile_key)
from epd_lab.bench.serve.run import GREEDY, ServeConfig
from epd_lab.bench.serve.tokenizer import ByteTokenizer, get_tokenizer, random_prompt
from epd_lab.bench.serve.rates import placement_answers
from epd_lab.bench.serve.topologies import PLACEMENTS, launch, parse_devices, placement, topology
from epd_lab.launch import Topology
from epd_lab.noise import random_png
from epd_lab.viz import load_placements, load_rates, pareto_front


# ---- metrics, against traces computed by hand ----

def _out(ttft: float, itl: list[float], tokens: int, ok: bool = True, prompt: int = 10) -> RequestOutput:
    """A request whose last token came at ttft + sum(itl) (the client's E2EL)."""
    return RequestOutput(success=ok, error="" if ok else "boom", prompt_len=prompt, output_tokens=tokens, ttft=ttft,
                         itl=itl, latency=ttft + sum(itl))


def test_tpot_is_e2el_minus_ttft_over_the_tokens_after_the_first():
    out = _out(0.100, [0.010, 0.030, 0.020], tokens=4)  # E2EL 0.160
    assert out.latency == pytest.approx(0.160)
    assert out.tpot == pytest.approx(0.060 / 3)
    assert _out(0.1, [], tokens=1).tpot == 0.0  # one token: no TPOT (goodput counts it as 0)


def test_metrics_of_a_hand_computed_trace():
    outs = [_out(0.100, [0.010, 0.030], 3), _out(0.200, [0.020], 2), _out(0.400, [], 1),
            _out(0.300, [0.040, 0.040, 0.040], 4, prompt=20), _out(9.0, [1.0], 2, ok=False)]
    m = calculate_metrics(outs, duration=2.0, slos={}, selected=("ttft", "tpot", "itl", "e2el"),
                          percentiles=(50, 90, 99.9))
    assert (m["completed"], m["failed"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (50, 10)  # the failed one counts nothing
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 5.0 and m["total_token_throughput"] == 30.0
    assert m["request_goodput"] is None  # no SLOs given
    # TTFT 100, 200, 300, 400 ms: mean 250, median 250, population std sqrt(12500), p90 by linear interpolation
    assert m["mean_ttft_ms"] == pytest.approx(250) and m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(12500))
    assert m["p90_ttft_ms"] == pytest.approx(370) and m["p99.9_ttft_ms"] == pytest.approx(399.7)
    # TPOT only for requests of more than one token: 20, 20, 40 ms
    assert m["mean_tpot_ms"] == pytest.approx(80 / 3) and m["median_tpot_ms"] == pytest.approx(20)
    # ITL: every gap of every finished request, 10, 30, 20, 40, 40, 40 ms
    assert m["mean_itl_ms"] == pytest.approx(30) and m["median_itl_ms"] == pytest.approx(35)
    # E2EL 140, 220, 400, 420 ms
    assert m["mean_e2el_ms"] == pytest.approx(295) and m["p50_e2el_ms"] == pytest.approx(310)


def test_goodput_counts_requests_within_every_slo():
    # binary fractions, so that the boundary cases compare exactly
    outs = [_out(0.25, [0.03125, 0.03125], 3),   # TTFT 250, TPOT 31.25, E2EL 312.5 ms
            _out(0.125, [0.015625], 2),          # TTFT 125, TPOT 15.625, E2EL 140.625
            _out(0.5, [], 1),                    # TTFT 500, TPOT 0 (one token), E2EL 500
            _out(0.375, [0.0625] * 3, 4),        # TTFT 375, TPOT 62.5, E2EL 562.5
            _out(0.0625, [0.001], 2, ok=False)]  # failed: never good
    slos = parse_goodput(["ttft:250", "tpot:31.25"])
    assert [is_good(o, slos) for o in outs[:4]] == [True, True, False, False]  # 250 <= 250 is good
    assert calculate_metrics(outs, 2.0, slos)["request_goodput"] == 1.0  # 2 good in 2 s
    assert calculate_metrics(outs, 2.0, {"tpot": 31.25})["request_goodput"] == 1.5  # the one-token one is good
    assert calculate_metrics(outs, 2.0, {"e2el": 500})["request_goodput"] == 1.5
    assert calculate_metrics(outs, 2.0, {"ttft": 100})["request_goodput"] == 0.0


@pytest.mark.parametrize("bad", [["ttft"], ["latency:5"], ["tpot:x"], ["e2el:-1"]])
def test_goodput_refuses_what_it_cannot_read(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_percentile_keys_are_vllms():
    assert percentile_key("ttft", 99) == "p99_ttft_ms" and percentile_key("itl", 99.9) == "p99.9_itl_ms"
    assert percentile_key("e2el", 50.0) == "p50_e2el_ms"


# ---- the arrival schedule (computed, never slept through) ----

@pytest.mark.parametrize("rate", [2.0, 50.0, 400.0])
def test_arrivals_keep_the_rate_in_steady_state(rate):
    offsets = arrival_offsets(20_000, rate, 1.0, seed=3)
    assert np.all(np.diff(offsets) >= 0)
    middle = offsets[2_000:18_000]  # away from both ends, which the final scaling pins
    achieved = (len(middle) - 1) / (middle[-1] - middle[0])
    assert achieved == pytest.approx(rate, rel=0.05)
    assert len(offsets) / offsets[-1] == pytest.approx(rate)  # the last one due at n / rate, as vLLM


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 8.0])
def test_gamma_burstiness_sets_the_gaps_variance(burstiness):
    gaps = np.diff(arrival_offsets(40_000, 10.0, burstiness, seed=5))
    # gamma(k, 1/(rate k)): mean 1/rate, squared coefficient of variation 1/k
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_arrival_edge_cases():
    assert not arrival_offsets(50, math.inf).any()  # inf rate: all at once
    even = arrival_offsets(50, 5.0, math.inf)
    assert np.allclose(np.diff(even), 0.2) and even[0] == pytest.approx(0.2)
    assert np.array_equal(arrival_offsets(100, 3.0, 0.7, seed=1), arrival_offsets(100, 3.0, 0.7, seed=1))
    assert not np.array_equal(arrival_offsets(100, 3.0, 0.7, seed=1), arrival_offsets(100, 3.0, 0.7, seed=2))
    for bad in ((0, 1.0, 1.0), (5, 0.0, 1.0), (5, 1.0, 0.0), (5, -1.0, 1.0)):
        with pytest.raises(ValueError):
            arrival_offsets(*bad)


# ---- datasets ----

def _size(raw: bytes) -> tuple[int, int]:
    from PIL import Image
    import io

    return Image.open(io.BytesIO(raw)).size


def test_random_mm_items_and_buckets():
    buckets = parse_buckets("{(224, 224, 1): 0.5, (112, 336, 1): 0.5}")
    assert buckets == {(224, 224): 0.5, (112, 336): 0.5}
    reqs = random_mm(40, seed=1, input_len=50, output_len=8, range_ratio=0.2, base_items=2, items_range_ratio=0.5,
                     limit_items=3, buckets=buckets)
    counts = [len(r.images) for r in reqs]
    assert min(counts) >= 1 and max(counts) == 3 and len(set(counts)) > 1
    assert all(40 <= len(r.prompt) <= 60 and 6 <= r.output_len <= 10 for r in reqs)
    assert {_size(i) for r in reqs for i in r.images} == {(224, 224), (336, 112)}  # PIL: (width, height)
    assert len({i for r in reqs for i in r.images}) == sum(counts)  # every image distinct: no cache hit
    assert all(r.prompt_len == len(r.prompt) for r in reqs)  # epd_lab's tokenizer: one token per byte
    for bad in ("{(224, 224, 4): 1.0}", "{(20, 224, 1): 1.0}", "{(224, 224, 1): 0.0}", "{'a': 1}", "[1]", "x"):
        with pytest.raises(ValueError, match="bucket"):
            parse_buckets(bad)


def test_random_mm_takes_vllms_json_forms_and_defaults():
    # vLLM's default bucket config has a video bucket at probability 0: dropped, as vLLM drops it
    assert parse_buckets(DEFAULT_BUCKETS) == {(256, 256): 0.5, (720, 1280): 0.5}
    assert parse_buckets('{"(112, 224, 1)": 3, "56,56,1": 1, "(720, 1280, 16)": 0}') == {(112, 224): 0.75,
                                                                                         (56, 56): 0.25}
    assert parse_mm_limit('{"image": 3, "video": 0}') == 3 and parse_mm_limit('{"image": 255, "video": 1}') == 255
    for bad, message in (('{"audio": 1}', "image and video"), ('{"image": -1}', "image limit -1"),
                         ("3", "image and video"), ("{image: 3}", "not JSON"), ('{"video": 2}', "no image limit")):
        with pytest.raises(ValueError, match=message):
            parse_mm_limit(bad)
    reqs = random_mm(30, seed=3, input_len=40, output_len=8, base_items=4, items_range_ratio=1.0,
                     limit_items='{"image": 2, "video": 0}', buckets={(56, 56): 1.0})
    assert max(len(r.images) for r in reqs) == 2 and min(len(r.images) for r in reqs) == 0
    with pytest.raises(ValueError, match="at least 3 images per request, but the image limit is 2"):
        random_mm(1, base_items=3, limit_items=2, buckets={(56, 56): 1.0})


def test_random_draws_the_lengths_vllms_draws():
    """vLLM's docs print "Total generated tokens: 3982" for their random-mm example (seed 42, 100 prompts, 40 tokens
    ± 20%, no images, --ignore-eos): the same seed draws the same lengths here."""
    reqs = random_mm(100, seed=42, input_len=300, output_len=40, range_ratio=0.2, base_items=0, prefix_len=25)
    assert sum(r.output_len for r in reqs) == 3982 and not any(r.images for r in reqs)
    assert all(265 <= r.prompt_len <= 385 for r in reqs)  # 25 + 240..360 tokens


def test_random_prompts_are_tokens_with_a_shared_prefix():
    reqs = random_mm(20, seed=5, input_len=100, output_len=10, range_ratio=0.5, base_items=0, prefix_len=7)
    assert all(57 <= r.prompt_len <= 157 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(ByteTokenizer().encode(r.prompt)) == r.prompt_len for r in reqs)
    assert len({r.prompt[:7] for r in reqs}) == 1 and len({r.prompt[7:17] for r in reqs}) > 1
    assert len({r.prompt_len for r in reqs}) > 5  # lengths drawn in [50, 150], plus the prefix

    class Merging(ByteTokenizer):  # "ab" re-encodes as one token: decode → encode drifts, and is corrected
        def encode(self, text: str) -> list[int]:
            return [300 if part == "ab" else ord(part) for part in re.findall("ab|.", text, re.S)]

        def decode(self, ids) -> str:
            return "".join("ab" if i == 300 else chr(i) for i in ids)

    merging = Merging()
    merging.allowed_ids = np.array([ord("a"), ord("b")])
    text, tokens = random_prompt(merging, np.random.default_rng(0), 50, offset=0, index=0)
    assert tokens == len(merging.encode(text)) and 45 <= tokens <= 50  # at most a few off, as vLLM's
    assert get_tokenizer("epd-lab-tiny-qwen2-vl").name == "epd-lab-tiny-qwen2-vl"
    assert isinstance(get_tokenizer("Qwen/Qwen2-VL-2B-Instruct", owned_by="epd_lab"), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer '/nonexistent/tok' cannot be loaded"):
        get_tokenizer("/nonexistent/tok")


def test_image_dataset_and_resolutions():
    reqs = image_dataset(3, seed=2, image_count=2, resolution="120x200", input_len=10, output_len=4)
    assert [len(r.images) for r in reqs] == [2, 2, 2] and _size(reqs[0].images[0]) == (200, 120)
    assert parse_resolution("720p") == (720, 1280)
    with pytest.raises(ValueError):
        parse_resolution("10x10")


def test_jsonl_dataset_reads_paths_and_keeps_urls(tmp_path):
    raw = random_png(1, 64)
    (tmp_path / "a.png").write_bytes(raw)
    lines = [{"prompt": "one", "images": ["a.png", "https://example.org/b.jpg"], "output_len": 3}, {"prompt": "two"}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = jsonl_dataset(path, 5, output_len=7)
    assert reqs == [SampleRequest("one", [raw, "https://example.org/b.jpg"], 3), SampleRequest("two", [], 7)]
    path.write_text('{"prompt": "ok"}\n{"images": []}\n')
    with pytest.raises(ValueError, match="data.jsonl:2"):
        jsonl_dataset(path, 5)


def test_media_server_serves_what_it_holds():
    raw = random_png(4, 32)
    with MediaServer() as media:
        url = media.add(raw)
        assert url.startswith("http://127.0.0.1:") and url.endswith(".png")
        answer = httpx.get(url)
        assert answer.content == raw and answer.headers["content-type"] == "image/png"
        assert httpx.get(media.url + "/m/404.png").status_code == 404
        media.clear()  # forgotten, and its name is not given to the next image
        assert httpx.get(url).status_code == 404 and media.add(raw) != url
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)


def test_pareto_front_keeps_the_points_nothing_beats():
    import pandas as pd

    points = pd.DataFrame({"x": [1, 2, 3, 4, 2.5], "y": [5, 3, 4, 1, 3]})
    assert pareto_front(points, "x", "y")[["x", "y"]].values.tolist() == [[1, 5], [2, 3], [4, 1]]


# ---- the result JSON and a real run against a server that answers at once ----

# The keys of `vllm bench serve`'s result JSON (vllm/benchmarks/serve.py) that this bench shares, with their meaning:
# run settings, counts, throughputs, the per-request lists, and each metric's statistics.
VLLM_KEYS = ("date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")))
# What vLLM's current `bench serve` saves without --save-detailed, with each value's type (its own plotting reads
# these): the run's settings, counts, throughputs, latencies and queue_times, and the default metrics' statistics.
VLLM_SAVED = {"date": str, "endpoint_type": str, "backend": str, "label": (str, type(None)), "model_id": str,
              "tokenizer_id": (str, type(None)), "num_prompts": int, "request_rate": (float, int, str),
              "burstiness": (float, int), "max_concurrency": (int, type(None)), "duration": float, "completed": int,
              "failed": int, "total_input_tokens": int, "total_output_tokens": int, "request_throughput": float,
              "request_goodput": (float, type(None)), "output_throughput": float, "total_token_throughput": float,
              "latencies": list, "queue_times": list, "max_output_tokens_per_s": float,
              "max_concurrent_requests": int, "rtfx": float,
              **{f"{stat}_{m}_ms": float for m in ("ttft", "tpot", "itl") for stat in ("mean", "median", "std", "p99")}}
VLLM_DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def test_result_json_has_vllms_keys_against_an_instant_server():
    reqs = image_dataset(30, seed=0, image_count=1, resolution="64x64", input_len=8, output_len=5)
    with InstantServer(tokens=5) as server:
        config = ServeConfig(server.url, request_rate=200.0, slos=parse_goodput(["ttft:10000", "tpot:10000"]),
                             percentile_metrics=("ttft", "tpot", "itl", "e2el"), progress=False)
        result = json.loads(json.dumps(benchmark(reqs, config)))
    assert set(VLLM_KEYS) <= set(result)
    assert (result["completed"], result["failed"], result["num_prompts"]) == (30, 0, 30)
    assert result["total_output_tokens"] == 150 and result["output_lens"] == [5] * 30
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs nobody misses
    # vLLM counts every chunk with choices: 5 tokens and the finish chunk, 5 gaps (the usage event has none)
    assert len(result["itls"]) == 30 and all(len(itl) == 5 for itl in result["itls"])
    assert result["rtfx"] == 0.0 and len(result["queue_times"]) == 30
    assert result["request_rate"] == 200.0 and result["epd_lab"]["server"] is None  # not an epd_lab server
    again = calculate_metrics(outputs_from_result(result), result["duration"], {"ttft": 10000})
    assert again["completed"] == 30 and again["mean_ttft_ms"] == pytest.approx(result["mean_ttft_ms"])
    with pytest.raises(ValueError, match="saved without --save-detailed"):
        outputs_from_result({k: v for k, v in result.items() if k not in VLLM_DETAILED})


def test_max_concurrency_bounds_the_requests_in_flight():
    reqs = image_dataset(12, seed=0, image_count=0, resolution="64x64", input_len=8, output_len=3)
    with InstantServer(tokens=3) as server:
        result = benchmark(reqs, ServeConfig(server.url, max_concurrency=1, progress=False, percentile_metrics=(
            "ttft", "client_queue_time", "e2el_including_client_queue")))
    assert result["completed"] == 12 and result["max_concurrent_requests"] == 1
    assert max(result["queue_times"]) > 0  # all due at once: the later ones waited for the one slot
    assert result["p99_client_queue_time_ms"] > 0 and "mean_e2el_including_client_queue_ms" not in result  # rate inf


def test_topologies_by_name():
    assert topology("monolithic").monolithic and topology("2e1p1d").encoders == 2
    assert topology("1e1p1d", media_url=True).settings == {"encoder": {"media_private_hosts": True}}
    with pytest.raises(ValueError):
        topology("3x")
    with pytest.raises(ValueError):
        Topology(monolithic=True, proxy=True, prefills=1, decodes=1)


def test_replicas_and_devices_by_name():
    replicas = topology("2xmonolithic", device="cuda:0", devices=parse_devices("monolithic1=cuda:1"))
    assert (replicas.monolithic, replicas.replicas, replicas.device) == (True, 2, "cuda:0")
    assert replicas.settings == {"monolithic": {"media_private_hosts": False}, "monolithic1": {"device": "cuda:1"}}
    e_apart = topology("1e1p1d", device="cuda:0", devices={"encoder": "cuda:1"})
    assert e_apart.role_settings("encoder", "encoder0").device == "cuda:1"
    assert e_apart.role_settings("prefill", "prefill0").device == "cuda:0"
    with pytest.raises(ValueError, match="unknown role or process 'monolithic1'"):
        topology("1e1p1d", devices={"monolithic1": "cuda:1"})
    with pytest.raises(ValueError, match="not NAME=DEVICE"):
        parse_devices("encoder0")


# ---- short real runs: 1E1P1D and the monolithic floor, by data URI and by URL ----

@pytest.fixture(scope="module")
def requests():
    return image_dataset(4, seed=7, image_count=2, resolution="112x112", input_len=20, output_len=6)


@pytest.fixture(scope="module")
def epd_cluster():
    with launch("1e1p1d", media_url=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def epd_answers(requests, epd_cluster):
    answers = {}
    for media in ("data-uri", "url"):
        answers[media] = benchmark(requests, ServeConfig(epd_cluster.proxy_url, max_concurrency=1, media=media,
                                                         progress=False, sampling=GREEDY, num_warmups=1))
    return answers


@pytest.mark.parametrize("media", ["data-uri", "url"])
def test_a_1e1p1d_cluster_serves_the_bench(epd_answers, media):
    result = epd_answers[media]
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["output_lens"] == [6] * 4
    server = result["epd_lab"]["server"]
    assert server is not None and {"load", "vit", "prefill", "ttft"} <= set(server["critical_path_ms"])
    assert server["proxy_parse_to_load_ms"] is not None  # the proxy's parse and the encoder's load both seen


def test_images_by_url_give_the_answers_data_uris_give(epd_answers):
    assert epd_answers["url"]["generated_texts"] == epd_answers["data-uri"]["generated_texts"]


def test_the_monolithic_floor_answers_as_the_split_does(requests, epd_answers):
    with launch("monolithic", media_url=True) as cluster:
        result = benchmark(requests, ServeConfig(cluster.proxy_url, max_concurrency=1, media="url", progress=False,
                                                 sampling=GREEDY))
    assert result["completed"] == 4
    assert result["generated_texts"] == epd_answers["data-uri"]["generated_texts"]
    assert result["epd_lab"]["server"]["critical_path_ms"]["prefill"] > 0


def test_two_monolithic_replicas_answer_as_the_split_does(requests, epd_answers):
    with launch("2xmonolithic", media_url=True) as cluster:
        result = benchmark(requests, ServeConfig(cluster.proxy_url, max_concurrency=1, media="url", progress=False,
                                                 sampling=GREEDY))
        served = [r["served"] for r in httpx.get(cluster.proxy_url + "/health", timeout=10).json()["replicas"]]
    assert result["completed"] == 4 and min(served) > 0  # both replicas took requests
    assert result["generated_texts"] == epd_answers["data-uri"]["generated_texts"]


def test_encoders_refuse_the_bench_urls_unless_their_policy_allows_loopback(requests):
    with launch("1e1p1d", media_url=False) as cluster:
        config = ServeConfig(cluster.proxy_url, media="url", progress=False)
        result = benchmark(requests[:1], config)
        assert result["completed"] == 0 and "public addresses only" in result["errors"][0]
        with pytest.raises(RuntimeError, match="warm-up request failed.*public addresses only"):
            benchmark(requests[:1], replace(config, num_warmups=2))


def _bench(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_the_command_line_writes_its_result(tmp_path, capsys):
    out = _bench("--instant", "--backend", "openai-chat", "--num-prompts", "6", "--request-rate", "50",
                 "--dataset-name", "random-mm", "--random-mm-base-items-per-request", "2", "--random-mm-bucket-config",
                 "{(64, 96, 1): 1.0}", "--random-output-len", "4", "--random-input-len", "30", "--goodput",
                 "ttft:5000", "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir",
                 str(tmp_path), "--result-filename", "r.json", "--disable-tqdm", "--metadata", "run=a",
                 "--percentile-metrics", "ttft,tpot,itl,e2el,client_queue_time")
    assert out.returncode == 0, out.stderr
    assert "Request goodput (req/s):" in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["epd_lab"]["images"] == 12 and "p50_ttft_ms" in result
    assert set(VLLM_DETAILED) <= set(result) and result["backend"] == result["endpoint_type"] == "openai-chat"
    assert result["run"] == "a" and "p50_client_queue_time_ms" not in result  # no concurrency bound: no queue
    for argv, message in ((["--instant", "--launch", "1e1p1d"], "give one of --launch, --instant"),
                          (["--instant", "--base-url", "http://127.0.0.1:1"], "--base-url is the server's"),
                          (["--instant", "--dataset-name", "random-mm"], "--backend openai posts /v1/completions"),
                          (["--instant", "--random-mm-bucket-config", "{(720, 1280, 16): 0.5}"], "no video path"),
                          (["--instant", "--random-mm-limit-mm-per-prompt", "3"], "image and video"),
                          (["--instant", "--backend", "tgi"], "invalid choice: 'tgi'"),
                          (["--launch", "1e1p1d", "--backend", "zmq_to_scheduler"], "give it as --launch-backend"),
                          (["--instant", "--extra-body", "[1]"], "'[1]' is not a JSON object"),
                          (["--instant", "--header", "x-a"], "--header takes KEY=VALUE, got 'x-a'"),
                          (["--base-url", "http://127.0.0.1:9"], "127.0.0.1:9/v1/models gave no model")):
        _refused(capsys, [*argv, "--num-prompts", "1"], message)


def _refused(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    """The command line (in this process) exits 2 with `message` in its one-line usage error."""
    with pytest.raises(SystemExit) as exited:
        serve_main(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and message in error, (argv, error)


def test_a_server_without_completions_is_refused_for_the_openai_backend(capsys):
    with MediaServer() as media:  # answers GETs of its images only (a POST: 501)
        _refused(capsys, ["--base-url", media.url, "--model", "m", "--tokenizer", "bytes", "--num-prompts", "1"],
                 "answered 501: the server has no /v1/completions")


def test_a_vllm_docs_command_runs_against_a_running_proxy(epd_cluster, tmp_path):
    """vLLM's random-mm example (docs: "Synthetic Random Images (random-mm)"), no --model, with smaller images, texts
    and counts for the CPU; then the text-only random dataset on vLLM's default backend (/v1/completions)."""
    port = epd_cluster.proxy_url.rsplit(":", 1)[1]
    out = _bench("--host", "127.0.0.1", "--port", port, "--dataset-name", "random-mm", "--num-prompts", "3",
                 "--max-concurrency", "2", "--random-prefix-len", "5", "--random-input-len", "30",
                 "--random-output-len", "4", "--random-range-ratio", "0.2", "--random-mm-base-items-per-request", "1",
                 "--random-mm-num-mm-items-range-ratio", "0", "--random-mm-limit-mm-per-prompt",
                 '{"image":3,"video":0}', "--random-mm-bucket-config",
                 '{"(112, 112, 1)": 0.25, "(56, 112, 1)": 0.75, "(720, 1280, 16)": 0.0}', "--request-rate", "inf",
                 "--ignore-eos", "--endpoint-type", "openai-chat", "--endpoint", "/v1/chat/completions", "--seed",
                 "42", "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("openai-chat-infqps-concurrency2-epd-lab-tiny-qwen2-vl-*.json")  # vLLM's file name
    result = json.loads(path.read_text())
    for key, kind in VLLM_SAVED.items():
        assert isinstance(result[key], kind), (key, result[key])
    assert not set(VLLM_DETAILED) & set(result)  # per-request lists only with --save-detailed, as vLLM
    assert (result["completed"], result["failed"], result["model_id"]) == (3, 0, "epd-lab-tiny-qwen2-vl")
    assert result["tokenizer_id"] == "epd-lab-tiny-qwen2-vl" and result["request_rate"] == "inf"
    # 4 tokens ± 20% asked (3-5), every one given (ignore_eos)
    assert 9 <= result["total_output_tokens"] <= 15 and len(result["latencies"]) == len(result["queue_times"]) == 3
    # the server's prompt: the 29-41 tokens of text, the chat template and each image's tokens
    assert result["total_input_tokens"] > 3 * 29
    text = _bench("--base-url", epd_cluster.proxy_url, "--num-prompts", "2", "--input-len", "20", "--output-len",
                  "3", "--temperature", "0", "--extra-body", '{"seed": 3}', "--save-result", "--result-dir",
                  str(tmp_path), "--result-filename", "text.json", "--disable-tqdm", timeout=300)
    assert text.returncode == 0, text.stdout + text.stderr
    result = json.loads((tmp_path / "text.json").read_text())
    assert (result["backend"], result["completed"], result["total_output_tokens"]) == ("openai", 2, 6)


def test_load_rates_recomputes_goodput_and_reads_rates_csv_where_a_point_s_json_is_missing(tmp_path):
    """A committed sweep read point by point: goodput recomputed from the per-request lists with the sweep's own
    SLOs equals what the sweep wrote in rates.csv. Where a point's JSON is missing (an H200 sweep whose files did
    not come back) its row comes from rates.csv, and other SLOs cannot be asked of it."""
    committed = Path(__file__).resolve().parents[1] / "data" / "bench" / "goodput-cpu-tiny-1x224"
    csv = pandas.read_csv(committed / "rates.csv")
    table = load_rates(committed)
    assert len(table) == len(csv) and table["request_goodput"].tolist() == pytest.approx(
        csv["request_goodput"].tolist())
    sweep = tmp_path / "sweep"
    shutil.copytree(committed, sweep)
    point = csv.iloc[0]
    (sweep / point["topology"] / f"rate-{point['request_rate']:g}.json").unlink()
    row = load_rates(sweep).iloc[0]
    assert (row["request_goodput"], row["p50_ttft_ms"], row["p99_tpot_ms"]) == pytest.approx(
        (point["request_goodput"], point["median_ttft_ms"], point["p99_tpot_ms"]))
    with pytest.raises(ValueError, match="cannot be recomputed"):
        load_rates(sweep, {"ttft": 1.0})


def test_every_placement_places_processes_its_topology_starts():
    """The placements at equal GPUs, over two devices: what runs on the second is a process or role of the placement's
    topology (`Topology` refuses other names); an unknown placement or another count of devices is refused."""
    assert set(PLACEMENTS) == {"2xmonolithic", "e-gpu1", "d-gpu1", "spread"}
    for name in PLACEMENTS:
        topology_name, device, devices = placement(name, ["cuda:0", "cuda:1"])
        placed = topology(topology_name, device=device, devices=devices)
        assert device == "cuda:0" and set(devices.values()) == {"cuda:1"}
        assert all(placed.settings[process]["device"] == "cuda:1" for process in devices)
    assert placement("spread", ["a", "b"])[2] == {"encoder1": "b", "decode": "b"}
    with pytest.raises(ValueError, match="unknown placement"):
        placement("3xmonolithic", ["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="two devices"):
        placement("e-gpu1", ["cuda:0"])


def test_placements_sweep_answers_as_the_monolithic_replicas_and_a_difference_shows(tmp_path):
    """Two placements swept through the command line (every device the CPU here: the same processes and hops as
    on two GPUs, untested there), the same requests at each rate; answers.json compares them with 2xmonolithic's.
    An answer changed afterwards is counted unequal."""
    out = tmp_path / "x2"
    run = subprocess.run([sys.executable, "-m", "epd_lab.cli", "sweep", "rates", "--placements", "2xmonolithic,d-gpu1",
                          "--gpus", "cpu,cpu", "--rates", "20", "--num-prompts", "4", "--image-count", "1",
                          "--image-resolution", "64x64", "--random-output-len", "4", "--goodput", "ttft:5000",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = json.loads((out / "answers.json").read_text())
    assert answers["reference"] == "2xmonolithic" and answers["placements"] == ["2xmonolithic", "d-gpu1"]
    assert answers["rates"] == {"20": {"d-gpu1": {"compared": 4, "equal": 4}}} and answers["all_equal"]
    meta = json.loads((out / "d-gpu1" / "sweep.json").read_text())
    assert (meta["placement"], meta["device"], meta["devices"]) == ("d-gpu1", "cpu", {"decode": "cpu"})
    table, read = load_placements(out)
    assert read == answers and sorted(table["topology"]) == ["2xmonolithic", "d-gpu1"]
    assert (table["completed"] == 4).all() and (table["request_goodput"] > 0).all()
    point = out / "d-gpu1" / "1e1p1d" / "rate-20.json"
    result = json.loads(point.read_text())
    result["generated_texts"][2] += "!"
    point.write_text(json.dumps(result))
    changed = placement_answers(out)
    assert changed["rates"]["20"]["d-gpu1"] == {"compared": 4, "equal": 3} and not changed["all_equal"]
    with pytest.raises(ValueError, match="no placement"):
        placement_answers(tmp_path)
