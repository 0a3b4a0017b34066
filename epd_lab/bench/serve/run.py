"""The benchmark loop of `epd-lab bench serve`: send `SampleRequest`s on an arrival schedule, gather the metrics.

`benchmark` is the whole run against one endpoint: ``num_warmups`` warm-up requests first (vLLM's; none by
default), then requests due at `arrival_offsets` (each sent when due, its body built then), at most
``max_concurrency`` in flight (the rest wait, as vLLM's semaphore), a progress bar, and the result dict whose
shared keys are `vllm bench serve`'s (`metrics.calculate_metrics`). Beside them, under
``epd_lab``: the client's own costs (building bodies; the bench process's CPU per request; how late each request
left against its schedule) and, where the endpoint is an epd_lab server, its own spans (`server_report`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aiohttp
import httpx
import numpy as np
import PIL.Image

from epd_lab.bench.serve.arrivals import arrival_offsets
from epd_lab.bench.serve.client import BACKENDS, MEDIA_MODES, request_body, send_request
from epd_lab.bench.serve.datasets import SampleRequest
from epd_lab.bench.serve.media_server import MediaServer
from epd_lab.bench.serve.metrics import METRICS, RequestOutput, calculate_metrics
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.trace import bare_request_id, collect, summarize_critical_paths

T = TypeVar("T")
GREEDY = {"temperature": 0.0}  # the sampling that makes answers equal the monolithic model's


@dataclass(slots=True)
class ServeConfig:
    """How to send: where, how fast, how many at once, how images travel; checked on construction.

    Args:
        base_url: the server's root (``http://host:port``); requests go to ``base_url + endpoint``.
        model: the ``model`` field of each request.
        backend: vLLM's request backend, ``openai-chat`` or ``openai`` (`client.BACKENDS`).
        endpoint: the path requests go to (None: the backend's own).
        request_rate: requests per second (inf: all at once).
        burstiness: the gamma shape of the inter-arrival gaps (1: Poisson).
        max_concurrency: at most this many in flight (None: no bound).
        media: ``data-uri`` (images inside the JSON) or ``url`` (served by a `MediaServer` on loopback).
        slos: goodput's SLOs in ms (``ttft``, ``tpot``, ``e2el``); empty: no goodput.
        percentile_metrics, metric_percentiles: which metrics get mean/median/std/percentiles, and which.
        seed: the arrival schedule's seed.
        progress: show a progress bar.
        api_key: sent as ``Authorization: Bearer`` when set.
        ignore_eos: send ``ignore_eos: true`` (vLLM's ``--ignore-eos``).
        sampling: sampling parameters sent as they are (``temperature``, ``top_p``, ``top_k``); empty: the server's
            defaults, as vLLM (`GREEDY` for answers equal to the monolithic model's).
        num_warmups: warm-up requests before the run, not counted.
        tokenizer: counts the output tokens of a server that gives no ``usage``; its name is ``tokenizer_id``.
        label: vLLM's ``label`` of the result.
        served_model_name: the ``model`` field sent, where it is not `model` (vLLM's ``--served-model-name``).
        headers: headers of every request, over the bench's own (vLLM's ``--header``).
    """

    base_url: str
    model: str = MODEL_ID
    endpoint: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    media: str = "data-uri"
    slos: dict[str, float] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    seed: int = 0
    progress: bool = True
    api_key: str | None = None
    backend: str = "openai-chat"
    ignore_eos: bool = False
    sampling: dict[str, float] = field(default_factory=dict)
    num_warmups: int = 0
    tokenizer: Any = None
    label: str | None = None
    served_model_name: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        self.endpoint = self.endpoint or BACKENDS[self.backend]
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be http(s)://..., got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/")
        if self.media not in MEDIA_MODES:
            raise ValueError(f"media must be one of {', '.join(MEDIA_MODES)}, got {self.media!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in self.percentile_metrics:
            if name not in METRICS:
                raise ValueError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")
        for q in self.metric_percentiles:
            if not 0 < q < 100:
                raise ValueError(f"percentiles lie in (0, 100), got {q}")
        arrival_offsets(1, self.request_rate, self.burstiness)  # a bad rate or burstiness fails here


class _Progress:
    """tqdm where installed, else a line every tenth of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self._bar = total, 0, None
        self.enabled = enabled
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc="bench serve", unit="req")

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update()
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"  {self.done}/{self.total} requests", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _run(requests: Sequence[SampleRequest], config: ServeConfig, url_of: Callable[[bytes], str] | None,
               offsets: np.ndarray) -> tuple[list[RequestOutput], float]:
    outputs = [RequestOutput() for _ in requests]
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    headers |= config.headers
    progress = _Progress(len(requests), config.progress)
    url = config.base_url + config.endpoint
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)

    extra: dict[str, Any] = ({"ignore_eos": True} if config.ignore_eos else {}) | config.sampling

    async def one(req: SampleRequest, out: RequestOutput) -> None:
        arrival = time.perf_counter()
        out.prompt_len = req.prompt_len
        async with limit:
            t0 = time.perf_counter()
            body = request_body(req, config.served_model_name or config.model, config.backend, url_of, extra)
            out.client_encode_s = time.perf_counter() - t0
            await send_request(session, url, body, out, headers)
        out.queue_time = out.start_time - arrival
        if out.success and not out.output_tokens:  # no usage from the server: count as vLLM does
            out.output_tokens = len(config.tokenizer.encode(out.generated_text)) if config.tokenizer else 1
        progress.update()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for req, out, offset in zip(requests, outputs, offsets):
            out.scheduled = start + offset
            delay = out.scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, out)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return outputs, duration


def benchmark(requests: Sequence[SampleRequest], config: ServeConfig, server_spans: bool = True) -> dict:
    """Run `requests` against `config.base_url`; returns the result (see the module docstring). The first request
    is sent ``config.num_warmups`` times at once before the run, not counted (vLLM's warm-up; its images changed by
    a pixel, see `_fresh`); unlike vLLM, the run stops when none of them is answered. With `server_spans`, an
    epd_lab endpoint's spans of these requests are summarized under ``epd_lab.server``."""
    if not requests:
        raise ValueError("no requests to send")
    if config.num_warmups:
        warm = benchmark([_fresh(requests[0])] * config.num_warmups,
                         replace(config, request_rate=math.inf, progress=False, num_warmups=0), False)
        if not warm["completed"]:
            raise RuntimeError(f"the warm-up request failed: {warm['errors'][0]}")
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    with contextlib.ExitStack() as stack:
        url_of = None
        if config.media == "url":
            media = stack.enter_context(MediaServer())
            urls: dict[int, str] = {}
            # registered before the clock starts: a deployment's images already lie behind their URLs
            for req in requests:
                for item in req.images:
                    if isinstance(item, bytes):
                        urls[id(item)] = media.add(item)
            url_of = lambda raw: urls[id(raw)]  # noqa: E731 - the lookup the body builder calls
        cpu0 = time.process_time()
        outputs, duration = _run_to_end(_run(requests, config, url_of, offsets))
        cpu = time.process_time() - cpu0
    # as vLLM: the queue metrics only where requests could queue (a concurrency bound), the E2EL with the queue only
    # where they also arrived over time
    selected = [m for m in config.percentile_metrics if not (
        (m in ("client_queue_time", "e2el_including_client_queue") and config.max_concurrency is None)
        or (m == "e2el_including_client_queue" and math.isinf(config.request_rate)))]
    result = calculate_metrics(outputs, duration, config.slos, selected, config.metric_percentiles)
    result |= vllm_fields(outputs, duration, config)
    ok = [o for o in outputs if o.success]
    lags = [max(0.0, o.start_time - o.scheduled) for o in outputs]
    result["epd_lab"] = {
        "media": config.media, "images": sum(len(r.images) for r in requests),
        "image_bytes": sum(len(i) for r in requests for i in r.images if isinstance(i, bytes)),
        "client_encode_ms": _stats([o.client_encode_s * 1e3 for o in outputs]),
        "bench_cpu_ms_per_request": cpu * 1e3 / len(outputs),
        "send_lag_ms": _stats([lag * 1e3 for lag in lags]) if config.max_concurrency is None else None,
        "achieved_rate": (len(outputs) - 1) / (max(o.start_time for o in outputs) - min(o.start_time for o in outputs))
        if len(outputs) > 1 and not math.isinf(config.request_rate) else None,
        "server": server_report(config.base_url, [o.response_id for o in ok]) if server_spans and ok else None,
    }
    return result


def _run_to_end(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on an event loop of its own: in this thread, or in another one where this thread already runs a
    loop (a notebook's kernel)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-serve") as pool:
        return pool.submit(asyncio.run, coro).result()


def _fresh(req: SampleRequest) -> SampleRequest:
    """`req` with every image's first pixel changed: the same work for the servers, but no embedding that the run's
    own request could then find in an encoder's cache (URLs stay as they are)."""
    images: list[bytes | str] = []
    for item in req.images:
        if isinstance(item, bytes):
            pixels = np.asarray(PIL.Image.open(io.BytesIO(item)).convert("RGB")).copy()
            pixels[0, 0, 0] ^= 1
            buf = io.BytesIO()
            PIL.Image.fromarray(pixels).save(buf, "PNG", compress_level=0)
            item = buf.getvalue()
        images.append(item)
    return SampleRequest(req.prompt, images, req.output_len, req.prompt_len)


def vllm_fields(outputs: list[RequestOutput], duration: float, config: ServeConfig) -> dict:
    """The per-request lists and run settings of vLLM's result JSON, and its peak concurrency and tokens/s."""
    ok = [o for o in outputs if o.success]
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    per_second: dict[int, int] = {}
    t0 = min((o.start_time for o in ok), default=0.0)
    for o in ok:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": config.backend, "endpoint_type": config.backend,
            "label": config.label, "model_id": config.model,
            "tokenizer_id": config.tokenizer.name if config.tokenizer else None, "num_prompts": len(outputs),
            "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
            "burstiness": config.burstiness, "max_concurrency": config.max_concurrency, "duration": duration,
            "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "queue_times": [o.queue_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
            "max_output_tokens_per_s": float(max(per_second.values(), default=0)), "max_concurrent_requests": peak,
            "goodput": config.slos or None}


def _stats(values: list[float]) -> dict[str, float]:
    q = np.percentile(values, [50, 99]) if values else [math.nan, math.nan]
    return {"mean": float(np.mean(values)) if values else math.nan, "p50": float(q[0]), "p99": float(q[1]),
            "max": max(values, default=math.nan)}


def server_report(base_url: str, response_ids: list[str]) -> dict | None:
    """Where the endpoint is an epd_lab server (it answers ``/v1/spans``): per stage, the median ms on the TTFT's
    critical path over these requests (`epd_lab.trace.summarize_critical_paths`), and per request the gap from the
    proxy's parse to the first image being read (``proxy_parse_to_load_ms``: the hops that carry the request's
    images or their URLs to the encoder). None for another server."""
    frame = collect([base_url])
    if frame.attrs["unreachable"] or frame.empty:
        return None
    ids = {bare_request_id(r) for r in response_ids}
    frame = frame[frame["request"].isin(ids)]
    if not (frame["stage"] == "ttft").any():
        return None
    table = summarize_critical_paths(frame, sorted(set(frame.loc[frame["stage"] == "ttft", "request"])))
    gaps = []
    for _, rows in frame.groupby("request"):
        parse, load = rows[rows["stage"] == "proxy_parse"], rows[rows["stage"] == "load"]
        if len(parse) and len(load):
            gaps.append((load["t_start_ns"].min() - parse["t_end_ns"].max()) / 1e6)
    return {"critical_path_ms": {stage: float(row["median_ms"]) for stage, row in table.iterrows()},
            "proxy_parse_to_load_ms": _stats(gaps) if gaps else None, "requests": len(table.attrs["requests"])
            if "requests" in table.attrs else None}


def first_model(base_url: str, api_key: str | None = None) -> tuple[str, str | None]:
    """The server's first ``/v1/models`` entry → (its id, its ``owned_by``), as vLLM picks the model when
    ``--model`` is not given. `ValueError` in one line when the server does not list one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        answer = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        answer.raise_for_status()
        entry = answer.json()["data"][0]
        return str(entry["id"]), entry.get("owned_by")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{base_url}/v1/models gave no model ({type(exc).__name__}: {exc}); give --model") from None


def check_endpoint(config: ServeConfig) -> None:
    """`ValueError` in one line when the server has no ``config.endpoint`` (it answers an empty body with 404, 405
    or 501): ``--backend openai`` against a server without ``/v1/completions`` fails here, not request by request."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    url = f"{config.base_url}{config.endpoint}"
    try:
        status = httpx.post(url, content=b"{}", headers={"Content-Type": "application/json", **headers},
                            timeout=30).status_code
    except httpx.HTTPError as exc:
        raise ValueError(f"{url}: {type(exc).__name__}: {exc}") from None
    if status in (404, 405, 501):
        raise ValueError(f"{url} answered {status}: the server has no {config.endpoint} for --backend "
                         f"{config.backend}" + (" (use --backend openai-chat)" if config.backend == "openai" else ""))
