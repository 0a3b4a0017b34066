"""Per-stage cost models fitted from `bench serve` results, stored as a small JSON per machine.

A calibration is read from result JSONs of `epd-lab bench serve` / `sweep rates` against an epd_lab cluster: each
holds the workload (images, their bytes, prompt tokens, rate) and the servers' spans on the TTFT's critical path
(``epd_lab.server.critical_path_ms``, medians). From the lowest rate of each topology and workload (where little
queues) it fits, by least squares:

- ``load``: the encoder's fetch + image decode, ms per megapixel (host CPU work);
- ``vit``: ``a + b * kpatches`` of one encoder part (a part's images are batched in one tower call);
- ``prefill``: ``a + b * ktokens`` of the prompt (text and image tokens);
- ``decode_step``: ``a + b * batch``, from TPOT against the decode batch Little's law gives at each rate;
- constants: the proxy and hops (``proxy_parse``, ``intake``, ``gap``, ``notify``, ``reassemble``), the E→P
  transfer, the KV write, and the client's own share of TTFT (client TTFT minus the servers' ``ttft`` span).

Each fit carries its error: the relative RMS of fitted against measured over the points it used, and the points'
count. A fit over one distinct covariate value goes through the origin (a single point cannot tell ``a`` from ``b``).
"""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from epd_lab.machine import commit, machine_info

PATCH_PIXELS = 14 * 14  # Qwen2-VL: 14×14 patches, 2×2 merged into one LLM token
TOKEN_PIXELS = 4 * PATCH_PIXELS
HOP_SPANS = ("proxy_parse", "intake", "gap", "notify", "reassemble", "buffer_alloc", "register")


@dataclass
class Linear:
    """``a + b * x`` in ms, with its fit's relative RMS error over `n` points."""

    a: float
    b: float
    rel_rms: float = 0.0
    n: int = 0

    def __call__(self, x: float) -> float:
        return max(0.0, self.a + self.b * x)


@dataclass
class Link:
    """A transport between two roles: one-way latency (ms) and bandwidth (Gb/s; inf: latency only)."""

    latency_ms: float
    gbps: float = math.inf

    def ms(self, nbytes: float) -> float:
        """Time to move `nbytes` one way."""
        return self.latency_ms + (0.0 if math.isinf(self.gbps) else nbytes * 8 / (self.gbps * 1e9) * 1e3)


@dataclass
class Calibration:
    """A machine's cost models (see the module docstring). ``device_slots``: stages one device runs at once (a GPU:
    1, the kernels of roles sharing it time-slice; a CPU: its cores). ``host_on_device``: whether host work (load,
    hops) takes a device slot too (true on a CPU, where the device is the cores)."""

    machine: str
    device_slots: float
    host_on_device: bool
    load_ms_per_mpix: Linear
    vit: Linear  # x: kpatches of one part
    prefill: Linear  # x: ktokens of the prompt
    decode_step: Linear  # x: requests in the batch
    hops_ms: float
    client_ms: float
    ep_link: Link
    pd_link: Link
    # the server's text tokens of a prompt (its chat template included) per unit of the runs' --random-input-len:
    # a token of the bench's tokenizer, or a character in runs made while bench serve drew prompts in characters
    # (every calibration under data/calibration/); for epd_lab's models, whose tokenizer reads one byte a token,
    # the two units are the same
    text_tokens_per_char: float = 1.8
    embed_bytes_per_token: int = 1536 * 2  # E→P: hidden × bf16 (2B)
    kv_bytes_per_token: int = 28 * 2 * 2 * 128 * 2  # P→D: layers × K,V × kv heads × head dim × bf16 (2B)
    decode_max_batch: int = 16
    ep_timeout_s: float = 10.0  # the prefill's E→P deadline: a request whose embeddings take longer fails
    sources: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """The calibration as JSON (``inf`` as the string "inf")."""
        def fix(v: object) -> object:
            if isinstance(v, float) and math.isinf(v):
                return "inf"
            if isinstance(v, dict):
                return {k: fix(x) for k, x in v.items()}
            return v
        return json.dumps(fix(asdict(self)), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A calibration saved by `save`."""
        raw = json.loads(Path(path).read_text())
        for key in ("load_ms_per_mpix", "vit", "prefill", "decode_step"):
            raw[key] = Linear(**raw[key])
        for key in ("ep_link", "pd_link"):
            raw[key] = Link(**{k: float(v) for k, v in raw[key].items()})
        return cls(**raw)


@dataclass
class Point:
    """One recorded `bench serve` result, reduced to what the fits need."""

    source: str
    topology: str
    encoders: int
    rate: float
    images: float  # per request
    pixels: float  # per image
    prompt_tokens: float
    spans: dict[str, float]
    ttft_ms: float
    tpot_ms: float
    decode_ms: float  # median E2EL − TTFT

    @property
    def part_kpatches(self) -> float:
        """kpatches of one encoder part: a request's images spread over the encoders (all in one on the floor)."""
        per_part = math.ceil(self.images / self.encoders) if self.images else 0
        return per_part * self.pixels / PATCH_PIXELS / 1e3


def encoders_of(topology: str) -> int:
    """Encoder processes of a topology name: ``2e1p1d`` → 2, ``monolithic`` → 1 (the floor's own tower)."""
    head = topology.split("e", 1)[0]
    return int(head) if "e" in topology and head.isdigit() else 1


def read_point(path: str | Path, topology: str | None = None) -> Point:
    """A result JSON (or ``.json.gz``) as a `Point`; the topology from the name of its folder unless given."""
    path = Path(path)
    r = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    ours = r["epd_lab"]
    name = topology or path.parent.name
    n = max(1, r["completed"])
    images = ours.get("images", 0) / max(1, r["num_prompts"])
    pixels = ours.get("image_bytes", 0) / max(1, ours.get("images", 1)) / 3  # uncompressed RGB PNGs
    return Point(str(path), name, encoders_of(name), float(r["request_rate"]), images, pixels,
                 r["total_input_tokens"] / n, dict(ours.get("server", {}).get("critical_path_ms", {})),
                 r["median_ttft_ms"], r["median_tpot_ms"], r["median_e2el_ms"] - r["median_ttft_ms"])


def fit_linear(x: Sequence[float], y: Sequence[float]) -> Linear:
    """Least squares ``y = a + b x`` in relative terms (through the origin when `x` has one distinct value), with
    its relative RMS error."""
    x_, y_ = np.asarray(x, float), np.asarray(y, float)
    if len(x_) == 0:
        raise ValueError("no points to fit")
    if len(np.unique(np.round(x_, 9))) < 2:
        b = float((x_ @ y_) / (x_ @ x_)) if (x_ @ x_) > 0 else 0.0
        a = 0.0 if (x_ @ x_) > 0 else float(y_.mean())
    else:  # weighted by 1/y: the relative error is what is reported, so small stages count as much as large
        b, a = (float(v) for v in np.polyfit(x_, y_, 1, w=1 / np.maximum(np.abs(y_), 1e-9)))
    fitted = a + b * x_
    rel = float(np.sqrt(np.mean(((fitted - y_) / np.where(y_ == 0, 1, y_)) ** 2)))
    return Linear(a, b, rel, len(x_))


def runtime_slope(path: str | Path, model: str, runtime: str = "hf") -> float:
    """A decode step's cost per request in the batch (ms), from a `bench runtime` JSON: (c16 − c1) / 15."""
    for result in json.loads(Path(path).read_text())["results"]:
        if result["model"] == model:
            steps = result["runtimes"][runtime]
            return (steps["decode_c16"]["median_ms"] - steps["decode_c1"]["median_ms"]) / 15
    raise ValueError(f"{path}: no {model!r} results")


def _lowest(points: Iterable[Point]) -> list[Point]:
    """The lowest-rate point of each (topology, workload): where the stage spans are least queued."""
    best: dict[tuple, Point] = {}
    for p in points:
        key = (p.topology, round(p.images, 3), round(p.pixels), round(p.prompt_tokens))
        if key not in best or p.rate < best[key].rate:
            best[key] = p
    return list(best.values())


def fit(points: Sequence[Point], machine: str, device_slots: float, host_on_device: bool,
        decode_max_batch: int = 16, input_len: int = 64, runtime_slope: float | None = None,
        **shape: float) -> Calibration:
    """A `Calibration` from recorded points (see the module docstring); `input_len`: the runs' ``--random-input-len``
    (tokens; characters in runs made before `bench serve` counted prompts in tokens); `runtime_slope`: ms per request
    in a decode batch from `bench runtime` (`runtime_slope`), else fitted from the points' TPOT; `shape`: model-shape
    overrides (``embed_bytes_per_token``, ``kv_bytes_per_token``)."""
    low = _lowest(points)
    split = [p for p in low if p.topology != "monolithic" and p.spans]
    base = [p for p in low if p.spans]
    if not base:
        raise ValueError("no point has server spans (epd_lab.server.critical_path_ms): run bench serve against "
                         "an epd_lab cluster")
    # the tower's cost from parts that ran alone (one encoder, or the floor); without such points, the parts of
    # encoders sharing one device ran side by side, each span holding the others' share: scaled by slots/encoders
    alone = [p for p in base if p.images and p.encoders == 1]
    mm = alone or [p for p in base if p.images]
    share = {id(p): 1.0 if alone else min(1.0, device_slots / p.encoders) for p in mm}
    load = fit_linear([p.part_kpatches * PATCH_PIXELS / 1e3 for p in mm],  # megapixels of one part
                      [p.spans.get("load", 0) + p.spans.get("decode", 0) for p in mm])
    vit = fit_linear([p.part_kpatches for p in mm], [p.spans.get("vit", 0) * share[id(p)] for p in mm])
    prefill = fit_linear([p.prompt_tokens / 1e3 for p in base], [p.spans.get("prefill", 0) for p in base])
    # decode: TPOT against the batch a step sees (1 + Little's law's mean in decode: rate × decode time), at each
    # workload's two lowest rates per topology (higher ones add the other stages' share of the device to TPOT,
    # which the model adds itself)
    rates: dict[tuple, list[float]] = {}
    for p in points:
        rates.setdefault((p.topology, round(p.prompt_tokens)), []).append(p.rate)
    calm = [p for p in points if p.decode_ms > 0 and p.rate in sorted(rates[(p.topology, round(p.prompt_tokens))])[:2]]
    batch = [min(decode_max_batch, 1 + p.rate * p.decode_ms / 1e3) for p in calm]
    tpot = [p.tpot_ms for p in calm]
    if runtime_slope is not None:  # the slope from `bench runtime` (16 against 1 in a batch), the level from serving
        resid = [t - runtime_slope * b for t, b in zip(tpot, batch)]
        decode = Linear(float(np.median(resid)), runtime_slope, 0.0, len(calm))
        fitted = np.asarray([decode(b) for b in batch])
        decode.rel_rms = float(np.sqrt(np.mean(((fitted - np.asarray(tpot)) / np.asarray(tpot)) ** 2)))
    else:
        decode = fit_linear(batch, tpot)
    if decode.b < 0:  # noise can tilt a flat line downwards; a larger batch is never cheaper
        flat = fit_linear([1.0] * len(calm), tpot)
        decode = Linear(flat.b, 0.0, flat.rel_rms, flat.n)
    hops = float(np.median([sum(p.spans.get(k, 0) for k in HOP_SPANS) for p in base]))
    client = float(np.median([p.ttft_ms - p.spans["ttft"] for p in low if "ttft" in p.spans]))
    ep = float(np.median([p.spans.get("transfer", 0) for p in split])) if split else 0.0
    kv = float(np.median([p.spans.get("kv_write", 0) for p in split])) if split else 0.0
    text_tokens = [p.prompt_tokens - p.images * p.pixels / TOKEN_PIXELS for p in base]
    meta = {"commit": commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "made_on": machine_info(), "points": len(points), "lowest_rate_points": len(low)}
    return Calibration(machine, device_slots, host_on_device, load, vit, prefill, decode, hops, client,
                       Link(ep), Link(kv), text_tokens_per_char=float(np.median(text_tokens)) / input_len,
                       decode_max_batch=decode_max_batch, sources=sorted({p.source for p in points}), meta=meta,
                       **shape)
