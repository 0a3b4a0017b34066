"""Every server's ``/metrics``: prometheus-client families, vLLM's where the meaning is vLLM's.

Each server keeps one `prometheus_client.CollectorRegistry` (never the global one: tests start several servers in
one process) with one collector, the floor's (`epd_lab.serving.app`): it yields the request counter
(``epd_lab:<role>_requests_total{route,status}``, counted by `CountRequests`, pure ASGI so that streamed answers
pass untouched), every refusal by reason (``epd_lab:refusals_total``), then the role's `metric_families`.
Values read from engines and counters at scrape time are families built here (`RoleMetrics.gauge`,
`RoleMetrics.counter`); latencies are histograms (`RoleMetrics.histogram`) with vLLM's names and buckets
(`TTFT_BUCKETS`, `TOKEN_BUCKETS`, `REQUEST_BUCKETS`). Every family has vLLM's ``model_name`` label. docs/metrics.md
lists them.
"""
from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator, Mapping, Sequence

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

__all__ = ["REQUEST_BUCKETS", "STAGE_BUCKETS", "TOKEN_BUCKETS", "TTFT_BUCKETS", "CountRequests", "Metric",
           "RoleMetrics", "engine_auth_failures", "engine_metrics", "refusal_family", "request_histograms"]

# vLLM's own bucket boundaries (its Prometheus stat logger's), so that one dashboard reads both
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # inter-token latency and time per output token
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # e2e, queue, prefill and decode time of a request
# this project's own short stages (a transfer, a ViT pass), finer at the low end than vLLM's request buckets
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0)

MODEL_LABEL = "model_name"


class RoleMetrics:
    """One role's families: names without a colon are the role's own (``epd_lab:<role>_<name>``), names with one
    are taken as they are (``vllm:...``, ``epd_lab:...``); every sample carries ``model_name``. Histograms made
    here are owned by the role (in no registry) and yielded by `instruments`."""

    def __init__(self, role: str, model: str) -> None:
        self.role, self.model = role, model
        self._instruments: list[Histogram] = []

    def name(self, name: str) -> str:
        """The full family name of `name`."""
        return name if ":" in name else f"epd_lab:{self.role}_{name}"

    def family(self, name: str, kind: str, help_: str, labels: Sequence[str],
               rows: Iterable[tuple[Sequence[Any], float]]) -> Metric:
        """A counter or gauge family with `labels` (after ``model_name``), one sample per (label values, value)
        of `rows`."""
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(self.name(name), help_, labels=[MODEL_LABEL, *labels])
        for values, value in rows:
            family.add_metric([self.model, *(str(v) for v in values)], value)
        return family

    def gauge(self, name: str, help_: str, value: float | Mapping[Any, float], label: str = "") -> Metric:
        """A gauge of one `value`, or one sample per key of `value` under `label`."""
        return self.of(name, "gauge", help_, value, label)

    def counter(self, name: str, help_: str, value: float | Mapping[Any, float], label: str = "") -> Metric:
        """A counter (``_total`` is added to the name) of one `value`, or one sample per key under `label`."""
        return self.of(name, "counter", help_, value, label)

    def of(self, name: str, kind: str, help_: str, value: float | Mapping[Any, float], label: str = "") -> Metric:
        """A `counter` or `gauge` as `kind` says (what a table of rows of both kinds builds its families with)."""
        if isinstance(value, Mapping):
            return self.family(name, kind, help_, (label,), (((k,), v) for k, v in sorted(value.items())))
        return self.family(name, kind, help_, (), (((), value),))

    def histogram(self, name: str, help_: str, buckets: Sequence[float]) -> Any:
        """A histogram of this role's model (observe on what it returns), yielded by `instruments`."""
        parent = Histogram(self.name(name), help_, [MODEL_LABEL], buckets=buckets, registry=None)
        self._instruments.append(parent)
        return parent.labels(self.model)

    def instruments(self) -> Iterator[Metric]:
        """The histograms' families as they stand."""
        for instrument in self._instruments:
            yield from instrument.collect()


def request_histograms(metrics: RoleMetrics) -> dict[str, Any]:
    """vLLM's latency histograms of the server a client talks to (the proxy, the monolithic server), by stage:
    ``ttft``, ``itl`` (each gap between two tokens sent), ``tpot`` (a request's mean gap after its first token) and
    ``e2e``."""
    return {stage: metrics.histogram(name, help_, buckets) for stage, name, help_, buckets in (
        ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (request "
         "received to its first token sent; not streamed: to the first token made).", TTFT_BUCKETS),
        ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds (between two tokens "
         "sent on a stream).", TOKEN_BUCKETS),
        ("tpot", "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per "
         "request (streamed requests of two tokens or more).", TOKEN_BUCKETS),
        ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS))}


def refusal_family(metrics: RoleMetrics, refusals: Mapping[str, float]) -> Metric:
    """``epd_lab:refusals_total{reason}``: every refusal of the role, each reason (docs/metrics.md) its source."""
    return metrics.counter("epd_lab:refusals_total", "requests, messages and connections refused, by reason",
                           refusals, "reason")


def engine_metrics(metrics: RoleMetrics, *engines: Any) -> list[Metric]:
    """A role's transfer engines, summed over `engines` (None ones skipped): ``engine_regions``
    (registrations; at idle only the long-lived ones, such as a KV cache, remain), ``engine_writes_in_flight``
    (incoming writes pinning a registration) and ``engine_managed_buffers``: what a leak check reads; and as
    counters the pins dropped with a writer that died mid-write (``engine_pins_reaped_total``), what went GPU to
    GPU (``engine_cuda_writes_out_total``) or was staged through pinned host memory
    (``engine_cuda_staged_bytes_total``), the peers refused at the secret's handshake (``engine_auth_failures_total``)
    and the bytes written by path (``engine_bytes_out_total{path="tcp"}``)."""
    stats = [e.stats() for e in engines if e is not None]
    by_path: collections.Counter[str] = collections.Counter()
    for s in stats:
        by_path.update({k.removeprefix("bytes_out_"): v for k, v in s.items() if k.startswith("bytes_out_")})
    paths = metrics.counter("engine_bytes_out", "bytes the role's engines wrote to peers, by the path they took "
                            "(tcp, shm, verbs)", dict(by_path), "path")
    return [paths, *(metrics.of(f"engine_{key}", kind, help_, sum(s.get(key, 0) for s in stats))
                     for key, kind, help_ in (
        ("regions", "gauge", "memory regions registered with the role's transfer engines"),
        ("writes_in_flight", "gauge", "incoming one-sided writes placing bytes now (each pins its registration)"),
        ("managed_buffers", "gauge", "buffers the engines allocated (receive pools)"),
        ("pins_reaped", "counter", "pins dropped because the same-host writer holding them died mid-write"),
        ("cuda_writes_out", "counter", "blocks written into peers' GPU memory over CUDA IPC"),
        ("cuda_staged_bytes", "counter", "bytes of GPU memory staged through pinned host memory to a peer"),
        ("auth_failures", "counter", "peers refused at the engines' port: failed the secret's handshake or skipped it"),
    ))]


def engine_auth_failures(*engines: Any) -> int:
    """The secret handshakes `engines` refused (None ones skipped): a refusal reason of every role with one."""
    return sum(e.stats().get("auth_failures", 0) for e in engines if e is not None)


class CountRequests:
    """ASGI middleware counting answers by (route, status) into `counts`; paths not in `routes` count as
    ``other`` (so that a scan of random paths cannot grow the counter)."""

    def __init__(self, app: Any, routes: Iterable[str], counts: collections.Counter) -> None:
        self.app, self.routes, self.counts = app, frozenset(routes), counts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"

        started = False

        async def counting_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counts[route, message["status"]] += 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # the outermost middleware answers it 500, outside this one
                self.counts[route, 500] += 1
            raise
