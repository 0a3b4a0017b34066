"""What every campaign leg shares: the chat requests it sends (and how each one ended), the prompts and their
solo answers, and the sampler of pool levels and RSS over time.

Pool levels come from each server's ``/metrics`` (Prometheus text): the gauges that must return to their idle
value once nothing is in flight (`LEAK_GAUGES`: embeddings held for ``/send``, KV blocks used or quarantined,
requests admitted or in flight, KV requests held for decode, the proxy's in-flight per backend, the transfer
engines' registrations, pinning writes and managed buffers), plus informative ones
(`INFO_GAUGES`: the encoder's embedding cache bytes). RSS is read from ``/proc/<pid>/status``.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import aiohttp
import httpx
import numpy as np

from epd_lab import security
from epd_lab.launch import Cluster
from epd_lab.machine import machine_info
from epd_lab.noise import image_uri
from epd_lab.servers.openai_api import MODEL_ID

# /metrics gauges (name suffixes after "epd_<role>_") that must be back at their idle value after the last answer
LEAK_GAUGES = ("embeddings_held", "kv_blocks_used", "kv_blocks_quarantined", "inflight", "admitted",
               "kv_blocks_reserved", "kv_admission_admitted",  # decode's KV reservations
               "kv_requests_held", "active_requests", "backend_inflight", "engine_regions",
               "engine_writes_in_flight", "engine_managed_buffers")
INFO_GAUGES = ("cache_bytes", "queue_length")
Progress = Callable[[str], None]


@dataclass(slots=True)
class Outcome:
    """One chat request as the client saw it. `kind`: ``ok``, ``refused`` (503), ``rejected`` (another 4xx,
    expected for bad input), ``error`` (5xx, an error event in the stream, a broken connection), ``timeout``
    (the client gave up) or ``aborted`` (the client cancelled the stream on purpose)."""

    index: int
    prompt: int  # index into the prompts; -1 for a bad input
    kind: str = "error"
    status: int | None = None
    t_start: float = 0.0  # seconds since the leg began
    latency_s: float = 0.0
    text: str = ""
    error: str = ""
    clear: bool = False  # an error that says what went wrong (an OpenAI error object or a stream error event)
    matches: bool | None = None  # the answer equals its solo answer (None: not an answer)
    tag: str = ""  # what the leg made of it (bad input kind, in-flight / during-fault / after-recovery)

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Prompts:
    """`count` distinct chat prompts (an image of `image_size`² and a text each, `images` images in each),
    deterministic in `seed`; `solo` holds each one's answer sent alone, `reference` the monolithic model's."""

    seed: int
    count: int = 8
    image_size: int = 224
    images: int = 1
    max_tokens: int = 8
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    solo: list[str | None] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        texts = ("what is in this picture?", "describe the image", "name three colours you see", "count the shapes")
        for i in range(self.count):
            content = [{"type": "image_url", "image_url": {"url": image_uri(self.seed * 7919 + i * 31 + j,
                                                                           self.image_size)}}
                       for j in range(self.images)]
            content.append({"type": "text", "text": rng.choice(texts)})
            self.messages.append([{"role": "user", "content": content}])

    def body(self, i: int, stream: bool = True) -> dict[str, Any]:
        """The request body of prompt `i` (greedy)."""
        return {"model": MODEL_ID, "messages": self.messages[i], "max_tokens": self.max_tokens, "temperature": 0,
                "stream": stream}

    def compute_reference(self) -> None:
        """The monolithic model's answer to every prompt, in this process (`servers.reference`)."""
        from epd_lab.models import configure_torch, load_model
        from epd_lab.servers.reference import monolithic_chat

        configure_torch()
        model = load_model()
        self.reference = [monolithic_chat(model, m, self.max_tokens) for m in self.messages]

    async def compute_solo(self, proxy_url: str, timeout: float) -> list[Outcome]:
        """Each prompt sent alone, one after another, through the proxy; `solo` keeps the answers."""
        outcomes = []
        async with client_session(1) as session:
            for i in range(self.count):
                outcomes.append(await chat(session, proxy_url, self.body(i), timeout, index=i, prompt=i))
        self.solo = [o.text if o.kind == "ok" else None for o in outcomes]
        return outcomes


def auth_headers() -> dict[str, str]:
    """The bearer header when this process's environment holds the shared secret (the cluster's servers
    inherit it from here, `epd_lab.security`); none otherwise."""
    return security.bearer_header(security.load_secret())


def client_session(concurrency: int) -> aiohttp.ClientSession:
    """One aiohttp session for a leg's requests, `concurrency` connections at most."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, concurrency)), headers=auth_headers())


async def chat(session: aiohttp.ClientSession, proxy_url: str, body: dict[str, Any], timeout: float, *,
               index: int = 0, prompt: int = -1, abort_after: int | None = None, t0: float | None = None,
               tag: str = "", headers: dict[str, str] | None = None, raw: bytes | None = None) -> Outcome:
    """POST `body` to the proxy's ``/v1/chat/completions`` and read its answer (SSE when streamed).
    `abort_after`: cancel the stream after that many content chunks (a client abort). `timeout`: the
    client's own bound for the whole request. `headers`: extra request headers (a deadline); `raw`: `body`
    encoded once already (a burst of a thousand would otherwise spend seconds of the client's own loop encoding
    the same images, and count them in every latency)."""
    out = Outcome(index, prompt, tag=tag)
    start = time.monotonic()
    out.t_start = start - (t0 if t0 is not None else start)
    chunks: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            post = (session.post(proxy_url + "/v1/chat/completions", json=body, headers=headers) if raw is None else
                    session.post(proxy_url + "/v1/chat/completions", data=raw,
                                 headers={"content-type": "application/json", **(headers or {})}))
            async with post as resp:
                out.status = resp.status
                if resp.status != 200:
                    raw = await resp.read()
                    out.error, out.clear = _error_of(raw)
                    out.kind = ("refused" if resp.status == 503 else
                                "rejected" if 400 <= resp.status < 500 else "error")
                elif not body.get("stream"):
                    answer = json.loads(await resp.read())
                    chunks.append(answer["choices"][0]["message"]["content"] or "")
                    out.kind = "ok"
                else:
                    out.kind = await _read_sse(resp, chunks, out, abort_after)
    except TimeoutError:
        out.kind, out.error = "timeout", f"no complete answer within the client's {timeout} s"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as exc:
        out.kind, out.error = "error", f"{type(exc).__name__}: {exc}"
    out.latency_s = time.monotonic() - start
    out.text = "".join(chunks)
    return out


async def _read_sse(resp: aiohttp.ClientResponse, chunks: list[str], out: Outcome, abort_after: int | None) -> str:
    """The stream's events into `chunks`; the outcome's kind."""
    buffer = b""
    content_chunks = 0
    async for piece in resp.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            if data == b"[DONE]":
                return "ok" if not out.error else "error"
            obj = json.loads(data)
            if "error" in obj:
                out.error, out.clear = _error_of(data)
                continue
            for choice in obj.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    chunks.append(text)
                    content_chunks += 1
            if abort_after is not None and content_chunks >= abort_after:
                resp.close()  # the client goes away mid-stream
                return "aborted"
    out.error = out.error or "the stream ended without [DONE]"
    return "error"


def _error_of(raw: bytes) -> tuple[str, bool]:
    """An error body's message, and whether it was an OpenAI error object with a message."""
    try:
        obj = json.loads(raw)
        message = obj["error"]["message"]
        return str(message), bool(message)
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace") or "(empty body)", False


def judge(outcomes: list[Outcome], expected: list[str | None]) -> None:
    """Set `matches` of every ok answer: whether it equals `expected` for its prompt."""
    for o in outcomes:
        if o.kind == "ok" and o.prompt >= 0:
            o.matches = expected[o.prompt] is not None and o.text == expected[o.prompt]


def role_urls(cluster: Cluster) -> dict[str, str]:
    """Process name → base URL."""
    return dict(zip(cluster.process_names(), cluster.urls()))


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges of a Prometheus text exposition: name → value (labelled samples of one name summed)."""
    gauges: set[str] = set()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind == "gauge":
                gauges.add(name)
        elif line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name in gauges:
                values[name] = values.get(name, 0.0) + float(value)
    return values


def pool_levels(text: str) -> dict[str, float]:
    """The pool gauges (`LEAK_GAUGES`, `INFO_GAUGES`) of one server's /metrics, by short name."""
    out = {}
    for name, value in parse_metrics(text).items():
        short = name.split("_", 2)[2] if name.count("_") >= 2 else name
        if short in LEAK_GAUGES or short in INFO_GAUGES:
            out[short] = value
    return out


def refusal_counts(text: str) -> dict[str, float]:
    """A server's refusals from its /metrics: ``refused_total`` by reason (every role's admission, the proxy's
    by code; decode's KV admission's as ``kv_<reason>``) and the encoder's ``refused_held_bytes_total`` as ``held_bytes``; zeros left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "_refused_" not in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        if name_labels.endswith("_refused_held_bytes_total"):
            reason = "held_bytes"
        elif "_refused_total{" in name_labels:
            reason = name_labels.split('reason="', 1)[1].split('"', 1)[0]
            if "_kv_admission_refused_total{" in name_labels:  # decode's second admission: its KV pool
                reason = "kv_" + reason
        else:
            continue
        if float(value):
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def refusals(cluster: Cluster) -> dict[str, dict[str, float]]:
    """Every live server's refusals by reason (`refusal_counts`), by process name: reported beside a leg's
    targets (a refusal is an answer, not a failure, but how many there were belongs in the report)."""
    out = {}
    with httpx.Client(timeout=5.0, headers=auth_headers()) as http:
        for name, url in role_urls(cluster).items():
            try:
                out[name] = refusal_counts(http.get(url + "/metrics").text)
            except httpx.HTTPError:
                continue
    return out


def rss_bytes(pid: int) -> int | None:
    """Resident set size of `pid` (``VmRSS``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Sampler:
    """A thread sampling every server's pool levels (`pool_levels`) and every process's RSS each `interval`
    s, and once more at the end; `rows` is a long table ``{t, process, metric, value}`` (t: seconds since `t0`). A server that does not
    answer within the interval is recorded as missing (no row), never waited for."""

    def __init__(self, cluster: Cluster, t0: float, interval: float = 0.25) -> None:
        self.cluster, self.t0, self.interval = cluster, t0, interval
        self.names = cluster.process_names()
        self.urls = role_urls(cluster)
        self.pids = {name: p.pid for name, p in zip(self.names, cluster.procs)}
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=max(0.2, interval), headers=auth_headers())

    def levels(self, names: list[str] | None = None) -> dict[str, dict[str, float]]:
        """One reading of the pool levels of `names` (default all) that answer now."""
        out = {}
        for name in names or self.names:
            if self.cluster.procs[self.names.index(name)].poll() is not None:
                continue
            try:
                r = self._http.get(self.urls[name] + "/metrics")
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                out[name] = pool_levels(r.text)
        return out

    def sample(self) -> dict[str, dict[str, float]]:
        """Read levels and RSS now, append them to `rows`, return the levels."""
        t = time.monotonic() - self.t0
        levels = self.levels()
        for name, values in levels.items():
            self.rows += [{"t": t, "process": name, "metric": k, "value": v} for k, v in values.items()]
        for name, pid in self.pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.rows.append({"t": t, "process": name, "metric": "rss_bytes", "value": rss})
        return levels

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def __enter__(self) -> "Sampler":
        self._thread = threading.Thread(target=self._run, name="campaign-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()  # the end state, however short the run
        self._http.close()


def leaks(idle: dict[str, dict[str, float]], now: dict[str, dict[str, float]]) -> dict[str, float]:
    """``process.metric`` → excess over idle, for every leak gauge above its idle value."""
    out = {}
    for name, values in now.items():
        for metric, value in values.items():
            if metric in LEAK_GAUGES and value > idle.get(name, {}).get(metric, 0.0):
                out[f"{name}.{metric}"] = value - idle.get(name, {}).get(metric, 0.0)
    return out


def wait_idle(sampler: Sampler, idle: dict[str, dict[str, float]], bound_s: float,
              names: list[str] | None = None) -> tuple[float | None, dict[str, float]]:
    """Poll until every leak gauge of `names` is back at its idle level: (seconds it took, None if not within
    `bound_s`; the leaks left at the end)."""
    t0 = time.monotonic()
    while True:
        left = leaks(idle, sampler.levels(names))
        if not left:
            return time.monotonic() - t0, {}
        if time.monotonic() - t0 > bound_s:
            return None, left
        time.sleep(0.05)


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/max and n of `values` (None when empty)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    q = np.percentile(values, [50, 90, 99])
    return {"n": len(values), "p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(max(values))}


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Outcomes by kind."""
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out


def target(name: str, passed: bool, measured: Any, goal: str) -> dict[str, Any]:
    """One target of a leg's verdict."""
    return {"target": name, "passed": bool(passed), "measured": measured, "goal": goal}


def machine() -> dict[str, Any]:
    """Where the leg ran (`epd_lab.machine.machine_info`)."""
    return machine_info()
