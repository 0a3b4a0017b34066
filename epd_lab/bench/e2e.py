"""`epd-lab bench e2e`: TTFT, TPOT and requests/s, monolithic vs E→P→D through the proxy.

- ``monolithic``: one process, the same model on the same device in the same dtype, the same prompt (the
  chat template the proxy renders, so the same 140 tokens with one 224² image); TTFT = PNG decode +
  preprocessing + the ViT + one forward (the first token), TPOT = one decode step on that cache. No HTTP:
  this is the floor. On a GPU every timed region ends on a host read of the chosen token (`int(argmax)`),
  which waits for the kernels queued before it.
- ``epd/<backend>``: 2 encoders + a prefill server + a decode server + the proxy, on loopback, every model
  role on `--device`; timed requests go through `StreamClient` (a kept-alive socket, httptools parsing the
  answer as it arrives, bodies rendered before the clock starts), streamed; TTFT = until the first content
  chunk, TPOT = the rest divided by the remaining tokens. Concurrency 1, 4, 16 (threads), `--requests` per
  level. The warm-up's answer, asked through the official `openai` client, is checked against the monolithic
  use of the same runtime on the same device.
- ``paired`` (`--pairs N`): after each point's levels, N rounds at concurrency 1 of one request through the proxy
  and one through the floor, alternating, so that their difference does not drift with the host (`paired`).
- ``kv_transfer``: a `--kv-tokens` text prompt (512) prefilled and decoded by the first cluster's servers
  directly; the decode server's `kv_transfer` span (side-channel round trip + one batch write), its bytes and
  GB/s.

Every request is `--images` images of `--image-size`² (one of 224²: 64 image tokens) plus text,
`--max-tokens` greedy tokens; the first request of each level is a warm-up. Both options take a list
(``--images 1,4,8 --image-size 448,896``): every pair is a grid point, measured by the floor and by each
backend's one cluster in turn (rows carry ``images`` and ``image_size``). The KV caches and the encoders'
``max_held_bytes`` are sized so the largest point at the highest level fits. Each level's requests are
rendered before it is timed (uncompressed PNGs of noise, base64 and JSON: the client's encoding is not measured).
`--model` takes a shape (qwen2-vl-2b, qwen2-vl-7b: the real sizes with random weights, e.g. 896² is
1,024 tokens of 3,584 bf16 values, 7 MiB, per image on 7B) or a local directory.

`--media` says how a request carries its images: ``data-uri`` (default: base64 inside the JSON, which the proxy
and the prefill relay to the encoders) or ``url`` (served by the bench's `MediaServer` on loopback; the encoders
fetch them, and the floor fetches its images the same way, with the same client, inside its timed region).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import httpx
import msgspec
import numpy as np
import pandas as pd
import torch
from PIL import Image

from epd_lab.bench import write_json
from epd_lab.bench.awake import cpus_awake
from epd_lab.bench.serve.media_server import MediaServer
from epd_lab.ep.media import MediaPolicy, fetch_media
from epd_lab.ep.messages import BACKENDS, DTYPES
from epd_lab.ep.receiver import RECV_BUFFERS, resolve_recv_buffer
from epd_lab.http.client import Connection, header_lines, request_bytes
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.kv import PagedKVCache, blocks_needed
from epd_lab.models import (
    DTYPE_NAMES,
    build_input_ids,
    configure_torch,
    image_grid,
    model_device,
    open_model,
    preprocess,
    resolve_device,
    resolve_dtype,
)
from epd_lab.models.runtime import RUNTIMES, open_runtime
from epd_lab.noise import data_uri, random_png
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.reference import monolithic_chat
from epd_lab.servers.text import messages_to_prompt
from epd_lab.models.catalog import use_device
from epd_lab.servers.model_settings import DEVICE_HELP, MODEL_HELP
from epd_lab.trace import TRANSFER_STAGES, critical_path, summarize_critical_paths

TEXT = "what is in this picture?"
BLOCK_SIZE = 16  # tokens per KV block: the roles' default (--block-size), the floor's too
CONCURRENCY = (1, 4, 16)
MIN_IMAGE_SIZE = 56  # the processor's smallest image side (MIN_PIXELS = 56²)
MEDIA = ("data-uri", "url")
# the floor's TTFT in host marks (`stages_ms`): the fetch, the PNG decode with the preprocessing, the tower's
# call, then the prefill to the first token's read (which waits for whatever GPU work the tower left queued)
FLOOR_STAGES = ("fetch", "preprocess", "encode", "prefill")
# image seeds of the paired rounds (`paired`): apart from the floor's (1000 + r) and the levels' (10,000 x level + r)
PAIRED_SEEDS = (1_000_000, 2_000_000)


@dataclass(frozen=True)
class Setup:
    """What every path of one run shares: the model, where it runs, and the requests' images.

    Args:
        device: cpu, cuda or cuda:N, for the floor and every model role of the clusters.
        model: tiny, a shape name (qwen2-vl-2b, qwen2-vl-7b) or a local model directory.
        dtype: auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16.
        image_size: the side of each square random RGB image, pixels.
        images: images per request.
        kv_tokens: the text prompt's length in the `kv_transfer` part (tokens: one per byte).
        runtime: the model runtime of the floor and of every model role (`epd_lab.models.runtime`).
        media: how a request carries its images: ``data-uri`` (inside the JSON) or ``url`` (fetched by the
            encoders, and by the floor, from the bench's media server).
        recv_buffer: where the prefill's E→P receive buffer lives (`epd_lab.ep.receiver.RECV_BUFFERS`; ``auto``:
            pinned host memory on CUDA, pageable on the CPU).
        gated_prefill: the prefill's ``--gated-prefill`` (a lone request's forward queued on the GPU before its
            embeddings land).
        cpus_awake: a ``SCHED_IDLE`` spinner on every CPU for the whole run, floor included
            (`epd_lab.bench.awake`: a wake-up lands on a running vCPU, not a halted one).
    """

    device: str = "cpu"
    model: str = "tiny"
    dtype: str = "auto"
    image_size: int = 224
    images: int = 1
    kv_tokens: int = 512
    runtime: str = "fast"
    media: str = "data-uri"
    recv_buffer: str = "auto"
    gated_prefill: bool = False
    cpus_awake: bool = False

    def __post_init__(self) -> None:
        if self.image_size < MIN_IMAGE_SIZE:
            raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE}, got {self.image_size}")
        for name in ("images", "kv_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        resolve_dtype(self.dtype, self.device)  # a bad name fails here, not in a server
        if self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}")
        if self.media not in MEDIA:
            raise ValueError(f"unknown media {self.media!r}; choose one of {', '.join(MEDIA)}")
        resolve_recv_buffer(self.recv_buffer, self.device)  # a buffer this device cannot have fails here

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype `auto` means on this device."""
        return DTYPES[resolve_dtype(self.dtype, self.device)]

    def topology(self, **kwargs) -> Topology:
        """A Topology with every model role on this device, in this dtype, running this model."""
        return Topology(device=self.device, model=self.model, dtype=self.dtype, runtime=self.runtime, **kwargs)


def _image(seed: int | tuple[int, ...], size: int = 224) -> bytes:
    """A random RGB image of `size`² as PNG bytes, stored uncompressed (noise gains nothing from a deflate)."""
    return random_png(seed, size, compress_level=0)


def _images(seed: int, setup: Setup) -> list[bytes]:
    """One request's images (`setup.images` of them): seeded by `seed` and the image count, so that no grid point
    sends an image another one did (the encoders cache embeddings by image)."""
    return [_image((seed, setup.images, i), setup.image_size) for i in range(setup.images)]


class Media:
    """How a run's requests carry their images (`Setup.media`); a context manager. By URL it owns the
    `MediaServer` that serves them, and the floor fetches through the encoders' own `fetch_media`."""

    def __init__(self, kind: str = "data-uri") -> None:
        self.kind = kind
        self.server = MediaServer() if kind == "url" else None
        self._policy = MediaPolicy(private_hosts=True)  # the encoders' policy in this bench: loopback allowed

    def item(self, raw: bytes) -> str:
        """What a request names for the image `raw`: a data: URI, or the URL it is served at."""
        return data_uri(raw) if self.server is None else self.server.add(raw)

    def messages(self, raws: list[bytes]) -> list[dict]:
        """The chat request: the images (as `item`), then the text."""
        content = [{"type": "image_url", "image_url": {"url": self.item(r)}} for r in raws]
        return [{"role": "user", "content": [*content, {"type": "text", "text": TEXT}]}]

    def raw(self, item: str) -> bytes:
        """The bytes the floor decodes: fetched by URL as an encoder fetches them, else the bytes themselves."""
        return fetch_media(item, timeout=60, max_bytes=1 << 30, policy=self._policy)

    def forget(self) -> None:
        """Stop serving the images added so far (a level's, once measured): memory stays one level's."""
        if self.server is not None:
            self.server.clear()

    def close(self) -> None:
        """Stop the media server, if any."""
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> "Media":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _messages(raws: list[bytes]) -> list[dict]:
    """The chat request with its images as data: URIs (the prompt's text around the images is the same by URL)."""
    return Media().messages(raws)


def _summary(values: list[float]) -> dict:
    q = np.percentile(values, [50, 90, 99])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "min": float(min(values)),
            "max": float(max(values)), "n": len(values)}


def open_floor_model(setup: Setup) -> torch.nn.Module:
    """The floor's model: `setup`'s model on its device in its dtype, that device made the current one (as in every
    role: what names no device runs on the floor's GPU)."""
    configure_torch()
    return open_model(setup.model, dtype=setup.torch_dtype, device=use_device(setup.device))


class Floor:
    """The floor of one grid point, open for as many requests as asked: the same model in this process, its own
    paged cache and runtime (`setup.runtime`); a context manager (the runtime's graphs and the cache go with it).
    `request(seed)` times one request; by URL (`media`) its images are fetched inside its TTFT."""

    def __init__(self, model: torch.nn.Module, setup: Setup, max_tokens: int, media: Media) -> None:
        self.model, self.setup, self.max_tokens, self.media = model, setup, max_tokens, media
        # the text around the images as the proxy renders the chat request: the floor prefills it too
        self.prompt, _ = messages_to_prompt(_messages([b""] * setup.images))
        prompt_len = len(build_input_ids(self.prompt, [image_grid((setup.image_size,) * 2)] * setup.images).view(-1))
        self.table = list(range(blocks_needed(prompt_len + max_tokens, BLOCK_SIZE)))
        self.cache = PagedKVCache.from_config(model.config, num_blocks=len(self.table), block_size=BLOCK_SIZE,
                                              dtype=setup.torch_dtype, device=model_device(model))
        try:
            self.runtime = open_runtime(setup.runtime, model, self.cache)
        except BaseException:
            self.cache.close()
            raise
        self.sizes: dict = {}  # one request's prompt and embedding sizes, once one ran

    def request(self, seed: int) -> tuple[float, float, dict[str, float]]:
        """One request of images seeded by `seed`: its TTFT and TPOT (ms), and its TTFT by `FLOOR_STAGES`."""
        rt, device, table = self.runtime, model_device(self.model), self.table
        items = [self.media.item(raw) for raw in _images(seed, self.setup)]
        t0 = time.perf_counter()
        raws = [self.media.raw(item) for item in items]
        t_fetched = time.perf_counter()
        pixel_values, grid = preprocess([Image.open(io.BytesIO(raw)) for raw in raws], device)
        t_preprocessed = time.perf_counter()
        embeds = rt.encode(pixel_values, grid)
        t_encoded = time.perf_counter()
        input_ids = build_input_ids(self.prompt, grid.tolist())
        result = rt.prefill(input_ids, embeds, grid, table)
        token = int(result.logits.argmax(-1))  # a host read: waits for the GPU's work
        t1 = time.perf_counter()
        for i in range(self.max_tokens - 1):
            token = int(rt.decode([token], [result.next_position + i], [table], [result.prompt_len + i + 1]).argmax(-1))
        t2 = time.perf_counter()
        self.sizes = {"prompt_tokens": input_ids.shape[-1], "image_tokens": int(embeds.shape[0]),
                      "embedding_bytes": embeds.nbytes}
        stages = {name: (b - a) * 1e3
                  for name, (a, b) in zip(FLOOR_STAGES, itertools.pairwise((t0, t_fetched, t_preprocessed, t_encoded,
                                                                           t1)))}
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / max(1, self.max_tokens - 1), stages

    def reference(self) -> str:
        """The answer to the clusters' checked request (`_images(0, ...)`), by this runtime."""
        return monolithic_chat(self.model, _messages(_images(0, self.setup)), self.max_tokens, runtime=self.runtime)

    def close(self) -> None:
        """Drop the runtime and the cache. Idempotent."""
        self.runtime.close()
        self.cache.close()

    def __enter__(self) -> "Floor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def monolithic(requests: int, max_tokens: int, setup: Setup = Setup(), model: torch.nn.Module | None = None,
               media: Media | None = None) -> dict:
    """The floor (`Floor`): TTFT and TPOT of the same model in this process, one request at a time (`model`, else
    `open_floor_model`). Also holds the reference answer to the clusters' checked request (``reference``), one
    request's prompt length (``prompt_tokens``) and the size of its embeddings (``image_tokens``,
    ``embedding_bytes``)."""
    model = open_floor_model(setup) if model is None else model
    media = media or Media()
    ttft, tpot = [], []
    stages: dict[str, list[float]] = {name: [] for name in FLOOR_STAGES}
    with Floor(model, setup, max_tokens, media) as floor:
        for r in range(requests + 1):
            first, step, marks = floor.request(1000 + r)
            if r:  # the first is a warm-up
                ttft.append(first)
                tpot.append(step)
                for name, ms in marks.items():
                    stages[name].append(ms)
        media.forget()
        reference = floor.reference()
    return {"path": "monolithic", "concurrency": 1, **_point(setup), "media": media.kind, "ttft_ms": _summary(ttft),
            "tpot_ms": _summary(tpot), "stages_ms": {name: _summary(v) for name, v in stages.items()},
            "requests_per_s": 1e3 / (statistics.median(ttft) + statistics.median(tpot) * (max_tokens - 1)),
            "reference": reference, **floor.sizes}


def _point(setup: Setup) -> dict:
    """The grid point a row belongs to."""
    return {"image_size": setup.image_size, "images": setup.images}


class _Chat(NamedTuple):
    """One streamed request as the client saw it (ms)."""

    ttft: float
    tpot: float  # after the first content chunk, per further token
    second: float  # from the first content chunk to the second
    response_id: str
    text: str


def _chat(client, messages: list[dict], max_tokens: int) -> _Chat:
    """One request through the official `openai` client (the checked answer: the API is the one users call)."""
    t0 = time.perf_counter()
    times, rid, text = [], "", []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                max_tokens=max_tokens, temperature=0, stream=True):
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return _timed(t0, times, time.perf_counter(), rid, text, max_tokens)


def _timed(t0: float, times: list[float], end: float, rid: str, text: list[str], max_tokens: int) -> _Chat:
    if len(times) < 2:
        raise RuntimeError("the proxy streamed fewer than two content chunks")
    return _Chat((times[0] - t0) * 1e3, (end - times[0]) * 1e3 / max(1, max_tokens - 1),
                 (times[1] - times[0]) * 1e3, rid, "".join(text))


def render(messages: list[dict], max_tokens: int) -> bytes:
    """A streamed chat request's body, encoded before it is timed (as the images' PNG and base64 are)."""
    return msgspec.json.encode({"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True})


class _SSEChunk(msgspec.Struct):
    id: str = ""
    choices: list[dict] = []


class _Events:
    """A streamed chat answer's server-sent events, fed as httptools parses its body: each content chunk timed
    when its line is complete, as the bytes that complete it are read."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.text: list[str] = []
        self.rid = ""
        self.head = b""  # the first bytes, for an error's message
        self._partial = b""

    def feed(self, data: bytes) -> None:
        if len(self.head) < 500:
            self.head += data[:500]
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = msgspec.json.decode(line[6:], type=_SSEChunk)
            self.rid = chunk.id or self.rid
            content = chunk.choices[0].get("delta", {}).get("content") if chunk.choices else None
            if content:
                self.times.append(time.perf_counter())
                self.text.append(content)


class StreamClient:
    """The timed requests' client: a kept-alive socket per thread (`http_client.Connection`), each request one send
    of a body rendered beforehand, the answer parsed by httptools as it arrives and each content chunk timed as
    its line completes (`_Events`). `http.client` (its header parsing and chunked reads in Python) and the `openai`
    client (pydantic, httpx: 6 ms more a request on a 2-vCPU Xeon, about 19 on the H200's host) cost the same
    request more, which the floor never pays: the harness stays out of the measured TTFT."""

    def __init__(self, base_url: str) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self._local = threading.local()

    def chat(self, body: bytes, max_tokens: int) -> _Chat:
        """Stream one rendered request (`render`); raises RuntimeError on an error status."""
        key, request = request_bytes("POST", self.url, body, header_lines({"Content-Type": "application/json"}))
        conn = getattr(self._local, "conn", None)
        for fresh in (conn is None, True):
            if conn is None:
                conn = self._local.conn = Connection(key, timeout=300)
                conn.connect()
            events = _Events()
            t0 = time.perf_counter()
            try:
                status, _, keep_alive = conn.round_trip(request, events.feed)
                break
            except ConnectionError:  # a kept-alive connection the proxy closed while idle: once more, on a new one
                self.close()
                conn = None
                if fresh:
                    raise
        end = time.perf_counter()
        if not keep_alive:
            self.close()
        if status != 200:
            raise RuntimeError(f"the proxy answered {status}: {events.head!r}")
        return _timed(t0, events.times, end, events.rid, events.text, max_tokens)

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class Capacity(NamedTuple):
    """What the clusters must hold at once: the KV blocks of each cache and the embedding bytes of each encoder."""

    kv_blocks: int = 512
    max_held_bytes: int = 512 << 20


def capacity(floors: list[dict], max_tokens: int, concurrency: int, kv_tokens: int,
             block_size: int = BLOCK_SIZE) -> Capacity:
    """The largest grid point (`floors`: its prompt and embedding sizes) at `concurrency` requests in flight, with
    room for as many again (requests whose KV waits for decode while new ones prefill); never below the roles'
    defaults."""
    per_request = max(max(f["prompt_tokens"] for f in floors) + max_tokens, kv_tokens + 2)
    blocks = 2 * concurrency * (-(-per_request // block_size) + 1)
    held = 2 * concurrency * max(f["embedding_bytes"] for f in floors)
    return Capacity(max(Capacity().kv_blocks, blocks), max(Capacity().max_held_bytes, held))


def cluster_for(setup: Setup, backend: str = "mooncake", pipelined: bool = False,
                room: Capacity = Capacity()) -> Cluster:
    """The measured topology: 2 encoders, a prefill server, a decode server and the proxy, every model role on
    `setup.device` (`pipelined`: decode asked while prefill runs), its KV caches and encoders sized by `room`; by
    URL the encoders may fetch from loopback (the bench's media server)."""
    return Cluster(setup.topology(encoders=2, backend=backend, prefills=1, decodes=1, proxy=True, timeout=60,
                                  pipelined=pipelined, kv_blocks=room.kv_blocks,
                                  settings={"encoder": {"max_held_bytes": room.max_held_bytes,
                                                        "media_private_hosts": setup.media == "url"},
                                            "prefill": {"recv_buffer": setup.recv_buffer,
                                                        "gated_prefill": setup.gated_prefill}}))


def epd(cluster: Cluster, requests: int, max_tokens: int, log=print, setup: Setup = Setup(),
        reference: str | None = None, concurrency: tuple[int, ...] = CONCURRENCY,
        media: Media | None = None) -> list[dict]:
    """E→P→D through `cluster`'s proxy at each concurrency level, the images carried as `media` says (default:
    data: URIs). Each row's ``answer_ok`` says whether the checked request's answer equals `reference` (None: not
    checked)."""
    import openai

    media = media or Media()

    rows = []
    path = f"epd/{cluster.topology.backend}" + (" (pipelined)" if cluster.topology.pipelined else "")
    client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=300)
    # warm-up (connections, mappings, caches; on a GPU each process's first kernels at these shapes): two images,
    # which the prefill splits over both encoders, then the checked request
    _chat(client, media.messages([_image((1, i), setup.image_size) for i in range(max(2, setup.images))]), max_tokens)
    answer = _chat(client, media.messages(_images(0, setup)), max_tokens).text
    answer_ok = None if reference is None else answer == reference
    if answer_ok is False:
        log(f"  {path}: the answer differs from the monolithic model's: {answer!r} != {reference!r}")
    for conc in concurrency:
        n = max(requests, conc)
        results: list[_Chat] = []
        lock = threading.Lock()
        payloads = iter([render(media.messages(_images(10_000 * conc + seed, setup)), max_tokens)
                         for seed in range(n)])
        stream = StreamClient(cluster.proxy_url)

        def worker() -> None:
            try:
                while True:
                    with lock:
                        body = next(payloads, None)
                    if body is None:
                        return
                    out = stream.chat(body, max_tokens)
                    with lock:
                        results.append(out)
            finally:
                stream.close()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if len(results) < n:
            raise RuntimeError(f"{path} at concurrency {conc}: {n - len(results)} of {n} requests failed "
                               "(the error is printed above)")
        media.forget()
        rows.append({"path": path, "concurrency": conc, **_point(setup), "media": media.kind,
                     "ttft_ms": _summary([r.ttft for r in results]), "tpot_ms": _summary([r.tpot for r in results]),
                     "second_token_ms": _summary([r.second for r in results]),
                     "requests_per_s": len(results) / wall, "answer_ok": answer_ok})
        log(_fmt(rows[-1]))
        if conc == 1:
            frame, ids = cluster.spans(), [r.response_id for r in results]
            rows[-1]["critical_path"] = cp = _critical_path(frame, ids)
            rows[-1]["gaps"] = gaps = _gaps(frame, ids)
            log(_fmt_path(cp, gaps))
    return rows


def paired(cluster: Cluster, floor: Floor, pairs: int, max_tokens: int, setup: Setup, media: Media,
           log=print) -> dict:
    """Split and floor side by side at concurrency 1: after one warm-up round, `pairs` rounds of one request
    through `cluster`'s proxy and one through `floor`, the two in alternating order, each on images of its own.
    A round's difference cancels what drifts over a run (the host's load, the GPU's clocks), which the floor's own
    block, measured minutes before the cluster's, does not. Each split request's transfer spans
    (`TRANSFER_STAGES` on its TTFT's critical path) are taken out of its own difference."""
    path = f"epd/{cluster.topology.backend}" + (" (pipelined)" if cluster.topology.pipelined else "")
    stream = StreamClient(cluster.proxy_url)
    floors, splits, ids, order = [], [], [], []
    try:
        for i in range(pairs + 1):
            body = render(media.messages(_images(PAIRED_SEEDS[1] + i, setup)), max_tokens)
            if i % 2:
                chat = stream.chat(body, max_tokens)
                first = floor.request(PAIRED_SEEDS[0] + i)[0]
            else:
                first = floor.request(PAIRED_SEEDS[0] + i)[0]
                chat = stream.chat(body, max_tokens)
            if i:
                floors.append(first)
                splits.append(chat.ttft)
                ids.append(chat.response_id)
                order.append("split" if i % 2 else "floor")
    finally:
        stream.close()
    media.forget()
    frame = cluster.spans()
    spans = []
    for rid in ids:
        cp = critical_path(frame, rid)
        spans.append(float(cp.loc[cp["stage"].isin(TRANSFER_STAGES), "dur_ms"].sum()))
    diff = [s - f for s, f in zip(splits, floors)]
    less = [d - s for d, s in zip(diff, spans)]
    out = {"path": path, **_point(setup), "pairs": pairs, "floor_ttft_ms": _summary(floors),
           "split_ttft_ms": _summary(splits), "split_minus_floor_ms": _summary(diff),
           "transfer_spans_ms": _summary(spans), "split_minus_floor_less_spans_ms": _summary(less),
           "rounds": [{"first": o, "floor_ttft_ms": f, "split_ttft_ms": s, "transfer_spans_ms": sp}
                      for o, f, s, sp in zip(order, floors, splits, spans)]}
    log(f"  {out['images']} x {out['image_size']}² {path}, {pairs} alternating pairs: split − floor "
        f"{statistics.median(diff):.2f} ms (p10..p90 {np.percentile(diff, 10):.2f}..{np.percentile(diff, 90):.2f}), "
        f"less its transfer spans {statistics.median(less):.2f} ms")
    return out


def _critical_path(frame: pd.DataFrame, response_ids: list[str]) -> list[dict]:
    """Per stage, the ms on the TTFT's critical path over `response_ids` (`trace.summarize_critical_paths`)."""
    table = summarize_critical_paths(frame, response_ids)
    return [{"stage": stage, **{k: float(v) for k, v in row.items()}} for stage, row in table.iterrows()]


def _gaps(frame: pd.DataFrame, response_ids: list[str]) -> list[dict]:
    """The gaps of the TTFT's critical path by where they lie (``between``): median ms over the requests
    (0 where a request has no such gap), largest first."""
    per_request = [critical_path(frame, rid).query("kind == 'gap'").groupby("between")["dur_ms"].sum()
                   for rid in response_ids]
    table = pd.DataFrame(per_request).fillna(0.0)
    return [{"between": b, "median_ms": float(table[b].median()), "max_ms": float(table[b].max())}
            for b in table.median().sort_values(ascending=False).index]


def _fmt_path(path: list[dict], gaps: list[dict]) -> str:
    lines = ["    TTFT critical path at concurrency 1 (median ms [range], % of TTFT):"]
    lines += [f"      {p['stage']:14s} {p['median_ms']:7.2f} [{p['min_ms']:6.2f} .. {p['max_ms']:6.2f}]  "
              f"{p['median_pct']:5.1f}%" for p in path]
    lines += ["    its gaps, where they lie (median ms, max):"]
    lines += [f"      {g['between']:28s} {g['median_ms']:6.2f}  {g['max_ms']:6.2f}" for g in gaps if g["max_ms"] > 0.05]
    return "\n".join(lines)


def kv_transfer(cluster: Cluster, requests: int, kv_tokens: int = 512) -> dict:
    """The decode server's `kv_transfer` span for a `kv_tokens`-token text prompt, `cluster`'s prefill and decode
    called directly: ms and GB/s per request."""
    p, d = cluster.prefill_urls[0], cluster.decode_urls[0]
    ms, nbytes, blocks = [], 0, 0
    with httpx.Client(timeout=120) as http:
        for r in range(requests + 1):
            rid = uuid.uuid4().hex
            pr = _post(http, p + "/v1/prefill", {"request_id": rid, "prompt": "x" * kv_tokens, "images": [],
                                                 "kv_transfer_params": {"do_remote_decode": True}})
            dr = _post(http, d + "/v1/decode", {"request_id": rid, "max_tokens": 2, "temperature": 0.0, "seed": None,
                                                "stream": False, "kv_transfer_params": pr["kv_transfer_params"]})
            span = next(s for s in dr["spans"] if s[2] == "kv_transfer")
            if r:
                ms.append((span[5] - span[4]) / 1e6)
            nbytes, blocks = span[6], pr["kv_transfer_params"]["num_blocks"]
    return {"prompt_tokens": pr["prompt_len"], "blocks": blocks, "bytes": nbytes, "ms": _summary(ms),
            "gbps": _summary([nbytes / (m * 1e6) for m in ms])}


def _post(http: httpx.Client, url: str, body: dict) -> dict:
    """POST `body`; a server's refusal (e.g. a prompt past the model's positions) raises with its answer."""
    response = http.post(url, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")
    return response.json()


def _fmt(row: dict) -> str:
    return (f"  {row['path']:26s} {row['images']} x {row['image_size']}² conc={row['concurrency']:<3d} "
            f"TTFT p50 {row['ttft_ms']['p50']:8.2f} p90 {row['ttft_ms']['p90']:8.2f}  "
            f"TPOT p50 {row['tpot_ms']['p50']:7.2f} ms  {row['requests_per_s']:6.2f} req/s")


def _release(device: torch.device) -> None:
    """Give the floor's GPU memory back to the driver: the servers are other processes on the same GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(backends: tuple[str, ...], requests: int, max_tokens: int, log=print, pipelined: bool = False,
        setup: Setup = Setup(), concurrency: tuple[int, ...] = CONCURRENCY,
        grid: Sequence[tuple[int, int]] = (), checkpoint: Callable[[dict], None] | None = None,
        pairs: int = 0) -> dict:
    """Measure; returns ``{"machine", "device", "gpu", "model", "dtype", "grid", "rows", "kv_transfer",
    "complete", ...}``. `grid`: the (image_size, images) points, each measured by the floor and by every cluster
    (none: `setup`'s own). `pipelined`: each backend also with decode asked while prefill runs, beside the
    default path. `pairs`: after each point's levels, that many split and floor requests side by side (`paired`;
    the floor's model, and each point's paired floor, then stay on the device beside the servers), in
    ``paired``. `checkpoint`: called with the result so far (``complete`` False) after each grid point, so that a
    run cut short keeps what it measured. Raises ValueError at once where `setup.device` is not here (e.g. cuda
    without a GPU)."""
    device = resolve_device(setup.device)
    points = [replace(setup, image_size=size, images=images) for size, images in grid] or [setup]
    log(f"  {setup.model} on {device} ({_gpu_name(device) or 'no GPU'}), {resolve_dtype(setup.dtype, setup.device)}, "
        f"images x side per request: {', '.join(f'{p.images} x {p.image_size}²' for p in points)}, by {setup.media}")
    # the media server, if any, and the paired rounds' floors (one per point, kept for every backend) live for the run
    with Media(setup.media) as media, contextlib.ExitStack() as held:
        awake = held.enter_context(cpus_awake()) if setup.cpus_awake else None
        model = open_floor_model(setup)
        floors = [monolithic(requests, max_tokens, point, model, media) for point in points]
        if not pairs:
            del model
            _release(device)
        references = [floor.pop("reference") for floor in floors]
        for floor in floors:
            log(_fmt(floor) + f"  ({floor['image_tokens']} image tokens, {floor['embedding_bytes']} bytes)")
        room = capacity(floors, max_tokens, max(concurrency), setup.kv_tokens)
        rows, kv, pair_rows = list(floors), None, []
        paired_floors: dict[int, Floor] = {}  # by point: opened at its first paired rounds (its graphs captured once)

        def result(complete: bool, log=log) -> dict:
            summary = [_summarize(floor, [r for r in rows[len(floors):] if _point(point).items() <= r.items()], log)
                       for floor, point in zip(floors, points)]
            return {"machine": machine_info(gpu=device.type == "cuda"), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "complete": complete, "device": str(device), "gpu": _gpu_name(device), "model": setup.model,
                    "dtype": resolve_dtype(setup.dtype, setup.device), "runtime": setup.runtime,
                    "media": setup.media, "recv_buffer": resolve_recv_buffer(setup.recv_buffer, setup.device),
                    "gated_prefill": setup.gated_prefill, "cpus_awake": None if awake is None else sorted(awake),
                    "media_fetches": None if media.server is None else media.server.requests,
                    "max_tokens": max_tokens, "concurrency": list(concurrency), "kv_blocks": room.kv_blocks,
                    "max_held_bytes": room.max_held_bytes,
                    "answers_equal_monolithic": all(r["answer_ok"] for r in rows[len(floors):]), "grid": summary,
                    "rows": rows, "kv_transfer": kv, "paired": pair_rows}

        for backend in backends:
            for piped in (False, True) if pipelined else (False,):
                with cluster_for(setup, backend, piped, room) as cluster:
                    for i, (point, reference) in enumerate(zip(points, references)):
                        rows += epd(cluster, requests, max_tokens, log, point, reference, concurrency, media)
                        if pairs:
                            if i not in paired_floors:
                                paired_floors[i] = held.enter_context(Floor(model, point, max_tokens, media))
                            pair_rows.append(paired(cluster, paired_floors[i], pairs, max_tokens, point, media, log))
                        if checkpoint is not None:
                            checkpoint(result(False, log=lambda *_: None))
                    if kv is None:  # P→D is the same whatever the E→P backend: measured on the first cluster
                        kv = kv_transfer(cluster, requests, setup.kv_tokens)
        if kv is None:
            with cluster_for(setup, room=room) as cluster:
                kv = kv_transfer(cluster, requests, setup.kv_tokens)
        log(f"  kv_transfer: {kv['prompt_tokens']} tokens, {kv['blocks']} blocks, {kv['bytes']} bytes, "
            f"p50 {kv['ms']['p50']:.3f} ms (p90 {kv['ms']['p90']:.3f}), {kv['gbps']['p50']:.2f} GB/s")
        return result(True)


def _summarize(floor: dict, rows: list[dict], log=print) -> dict:
    """One grid point: its sizes, and each path's TTFT overhead over the floor at concurrency 1 (logged, with the
    time no span covers and the second token against the floor's decode step)."""
    point = f"{floor['images']} x {floor['image_size']}²"
    overhead = {r["path"]: r["ttft_ms"]["p50"] - floor["ttft_ms"]["p50"] for r in rows if r["concurrency"] == 1}
    for r in rows:
        if r["concurrency"] == 1:
            gap = next(p for p in r["critical_path"] if p["stage"] == "gap")
            log(f"  {point} {r['path']}: TTFT overhead over monolithic {overhead[r['path']]:.2f} ms; time covered "
                f"by no span {gap['median_pct']:.1f}% of TTFT ({gap['min_pct']:.1f}..{gap['max_pct']:.1f}%); "
                f"second token {r['second_token_ms']['p50']:.2f} ms after the first, monolithic decode step "
                f"{floor['tpot_ms']['p50']:.2f} ms")
    return {**{k: floor[k] for k in ("image_size", "images", "prompt_tokens", "image_tokens", "embedding_bytes")},
            "answers_equal_monolithic": all(r["answer_ok"] for r in rows), "ttft_overhead_ms": overhead}


def _gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least the level)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pipelined", action="store_true",
                    help="also measure each backend with decode asked while prefill runs")
    ap.add_argument("--device", default="cpu", help=DEVICE_HELP + " (the floor and every model role)")
    ap.add_argument("--model", default="tiny", help=MODEL_HELP)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--image-size", type=_ints, default=(224,),
                    help="side of each request's square image, pixels (224: 64 image tokens; 896: 1,024); a list "
                         "(448,896) measures each")
    ap.add_argument("--images", type=_ints, default=(1,), help="images per request; a list (1,4,8) measures each")
    ap.add_argument("--kv-tokens", type=int, default=512, help="prompt tokens of the kv_transfer part")
    ap.add_argument("--runtime", default="fast", choices=tuple(RUNTIMES),
                    help="the model runtime of the floor and every model role")
    ap.add_argument("--concurrency", type=_ints, default=CONCURRENCY, help="levels, comma-separated (1,4,16)")
    ap.add_argument("--media", default="data-uri", choices=MEDIA,
                    help="how requests carry their images: inside the JSON (data-uri), or by URL from the bench's "
                         "media server (fetched by the encoders and by the floor)")
    ap.add_argument("--recv-buffer", default="auto", choices=RECV_BUFFERS,
                    help="the prefill's E→P receive buffer: host, pinned or device (GPU) memory; auto: pinned on "
                         "CUDA, host on the CPU")
    ap.add_argument("--gated-prefill", action="store_true",
                    help="the prefill queues a lone request's forward on the GPU before its embeddings land "
                         "(the prefill server's --gated-prefill)")
    ap.add_argument("--keep-cpus-awake", action="store_true",
                    help="a SCHED_IDLE spinner on every CPU while the run lasts, floor included, so that a wake-up "
                         "lands on a running vCPU instead of a halted one (epd_lab.bench.awake; a measurement "
                         "condition, recorded as cpus_awake; on the H200's host a wake-up after 5 ms idle took "
                         "50 us instead of 86)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="after each point's levels, this many split and floor requests side by side at concurrency "
                         "1, alternating (the floor's model stays on the device beside the servers)")
    args = ap.parse_args(argv)
    try:
        if args.pairs < 0:
            raise ValueError(f"--pairs must be >= 0, got {args.pairs}")
        setup = Setup(args.device, args.model, args.dtype, args.image_size[0], args.images[0], args.kv_tokens,
                      args.runtime, args.media, args.recv_buffer, args.gated_prefill, args.keep_cpus_awake)
        grid = [(size, images) for size in args.image_size for images in args.images]
        for size, images in grid:
            replace(setup, image_size=size, images=images)  # each point's sizes checked here, not mid-run
        resolve_device(setup.device)  # before any model is built or process started
    except ValueError as exc:
        ap.error(str(exc))
    save = (lambda partial: write_json(args.json, partial)) if args.json else None
    result = run(tuple(args.backends.split(",")), args.requests, args.max_tokens, pipelined=args.pipelined,
                 setup=setup, concurrency=args.concurrency, grid=grid, checkpoint=save, pairs=args.pairs)
    if args.json:
        write_json(args.json, result)
    return 0
