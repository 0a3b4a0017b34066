"""The serving metrics of `epd-lab bench serve`, with the names and meanings of `vllm bench serve`'s result JSON.

Per request (seconds, as the client saw them):
- ``ttft``: from sending the request to the first chunk with ``choices`` (vLLM counts every such chunk, empty or not).
- ``itl``: the gaps between consecutive such chunks (one per chunk after the first).
- ``latency`` (E2EL): from sending to the last such chunk (the usage event after it does not count).
- ``queue_time``: from its arrival (due by the schedule) to its sending, waiting for a ``--max-concurrency`` slot
  (vLLM's ``client_queue_time``, whose list is ``queue_times``).
- TPOT: ``(latency - ttft) / (output_tokens - 1)``, only for requests of more than one token; for goodput a request
  of one token counts as TPOT 0 (as vLLM).

Over the run: ``request_throughput = completed / duration``, ``output_throughput = total_output_tokens / duration``,
``total_token_throughput`` = (input + output tokens) / duration, and DistServe's goodput,
``request_goodput = good / duration``, where a good request met every SLO given (``ttft``, ``tpot``, ``e2el`` in
ms, each ``<=``). Every selected metric gets ``mean_<m>_ms``, ``median_<m>_ms``, ``std_<m>_ms`` and
``p<q>_<m>_ms`` for each percentile q (``p99``, ``p99.9``); numpy's linear-interpolation percentiles, as vLLM.
``rtfx`` (vLLM's inverse real-time factor: seconds of input audio per second of the run) is 0: no dataset here
sends audio.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# vLLM's percentile metrics; the last two (a request's wait for a --max-concurrency slot, and its E2EL with the
# wait) only where the run had a concurrency bound, the last only with a finite request rate
METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestOutput:
    """One request as the client saw it (seconds; `start_time` on the bench's perf_counter clock)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens (0 when it gave none)
    output_tokens: int = 0  # the server's usage.completion_tokens, else the content chunks counted
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    scheduled: float = 0.0  # when the arrival schedule had it due (same clock as start_time)
    queue_time: float = 0.0  # from its arrival to its sending: the wait for a --max-concurrency slot
    generated_text: str = ""
    response_id: str = ""
    client_encode_s: float = 0.0  # building the body: images to data URIs or URLs, and the JSON

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for a request of at most one token."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (ms). `ValueError` for an unknown metric, a
    malformed item or a negative bound."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
    return slos


def percentile_key(metric: str, q: float) -> str:
    """vLLM's key for a percentile: ``p99_ttft_ms``, ``p99.9_ttft_ms``."""
    return f"p{int(q) if float(q).is_integer() else q}_{metric}_ms"


def is_good(out: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a finished request met every SLO (ms) in `slos`."""
    values = {"ttft": out.ttft, "tpot": out.tpot, "e2el": out.latency}
    return all(values[name] <= bound / 1e3 for name, bound in slos.items())  # in seconds, as vLLM compares


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float, slos: dict[str, float] | None = None,
                      selected: Sequence[str] = ("ttft", "tpot", "itl"),
                      percentiles: Sequence[float] = (99,)) -> dict:
    """The run's metrics as vLLM names them (see the module docstring); ``request_goodput`` is None without SLOs."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    for name in selected:
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    samples = {"ttft": [o.ttft for o in done], "tpot": [o.tpot for o in done if o.output_tokens > 1],
               "itl": [gap for o in done for gap in o.itl], "e2el": [o.latency for o in done],
               "client_queue_time": [o.queue_time for o in done],
               "e2el_including_client_queue": [o.latency + o.queue_time for o in done]}
    result = {"completed": len(done), "failed": len(outputs) - len(done), "total_input_tokens": total_in,
              "total_output_tokens": total_out, "request_throughput": len(done) / duration,
              "request_goodput": (sum(is_good(o, slos) for o in done) / duration) if slos else None,
              "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
              "rtfx": 0.0}
    for name in selected:
        ms = np.asarray(samples[name] or [0.0]) * 1e3  # vLLM reports 0 for a metric with no sample
        result |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                   f"std_{name}_ms": float(ms.std())}
        result |= {percentile_key(name, q): float(np.percentile(ms, q)) for q in percentiles}
    return result


def outputs_from_result(result: dict) -> list[RequestOutput]:
    """The per-request outputs back from a saved result's lists (vLLM's ``ttfts``, ``itls``, ``latencies``,
    ``output_lens``, ``input_lens``, ``errors``): enough to compute every metric again, e.g. for other SLOs.
    `ValueError` for a result saved without them (``bench serve`` without ``--save-detailed``)."""
    if "ttfts" not in result:
        raise ValueError("the result has no per-request lists: it was saved without --save-detailed")
    return [RequestOutput(success=not error, error=error or "", prompt_len=p, output_tokens=n, ttft=ttft, itl=itl,
                          latency=latency)
            for ttft, itl, latency, n, p, error in zip(result["ttfts"], result["itls"], result["latencies"],
                                                       result["output_lens"], result["input_lens"], result["errors"])]
