"""One request counter and one Prometheus text writer for every server.

`CountRequests` (pure ASGI, so streamed answers pass untouched) counts answers by route and status for
``{prefix}_requests_total``; a role adds its own families as `Metric` rows.
"""
from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping, NamedTuple

__all__ = ["CountRequests", "Metric", "engine_metrics", "metrics_text"]

Labels = Mapping[str, Any]


class Metric(NamedTuple):
    """One metric family: `samples` are (name suffix, labels, value), e.g. ``("", {}, 3)`` or
    ``("_sum", {}, 1.5)``; `Metric.of` builds the common unlabelled or one-label cases."""

    name: str
    kind: str  # counter, gauge, summary
    help: str
    samples: tuple[tuple[str, Labels, float], ...]

    @classmethod
    def of(cls, name: str, kind: str, help_: str, value: float | Mapping[Any, float], label: str = "") -> "Metric":
        """An unlabelled family of one `value`, or one sample per key of `value` under `label`."""
        if isinstance(value, Mapping):
            return cls(name, kind, help_, tuple(("", {label: k}, v) for k, v in sorted(value.items())))
        return cls(name, kind, help_, (("", {}, value),))


def engine_metrics(*engines: Any) -> list[Metric]:
    """A role's transfer engines, summed over `engines` (None ones skipped): ``engine_regions``
    (registrations; at idle only the long-lived ones, such as a KV cache, remain), ``engine_writes_in_flight``
    (incoming writes pinning a registration) and ``engine_managed_buffers``: what a leak check reads; and as
    counters the pins dropped with a writer that died mid-write (``engine_pins_reaped_total``), what went GPU to
    GPU (``engine_cuda_writes_out_total``) or was staged through pinned host memory
    (``engine_cuda_staged_bytes_total``), and the bytes written by path (``engine_bytes_out_total{path="tcp"}``)."""
    stats = [e.stats() for e in engines if e is not None]
    by_path: collections.Counter[str] = collections.Counter()
    for s in stats:
        by_path.update({k.removeprefix("bytes_out_"): v for k, v in s.items() if k.startswith("bytes_out_")})
    paths = Metric.of("engine_bytes_out_total", "counter", "bytes the role's engines wrote to peers, by the path "
                      "they took (tcp, shm, verbs)", dict(by_path), "path")
    return [paths, *(Metric.of(f"engine_{key}" + ("_total" if kind == "counter" else ""), kind, help_,
                               sum(s.get(key, 0) for s in stats)) for key, kind, help_ in (
        ("regions", "gauge", "memory regions registered with the role's transfer engines"),
        ("writes_in_flight", "gauge", "incoming one-sided writes placing bytes now (each pins its registration)"),
        ("managed_buffers", "gauge", "buffers the engines allocated (receive pools)"),
        ("pins_reaped", "counter", "pins dropped because the same-host writer holding them died mid-write"),
        ("cuda_writes_out", "counter", "blocks written into peers' GPU memory over CUDA IPC"),
        ("cuda_staged_bytes", "counter", "bytes of GPU memory staged through pinned host memory to a peer"),
    ))]


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


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(prefix: str, requests: Mapping[tuple[str, int], int], families: Iterable[Metric]) -> str:
    """Prometheus text exposition: ``{prefix}_requests_total{route,status}`` from `requests`, then `families`,
    each named ``{prefix}_{name}``."""
    name = f"{prefix}_requests_total"
    lines = [f"# HELP {name} HTTP requests by route and status", f"# TYPE {name} counter"]
    lines += [f'{name}{{route="{route}",status="{status}"}} {n}' for (route, status), n in sorted(requests.items())]
    for family in families:
        full = f"{prefix}_{family.name}"
        lines += [f"# HELP {full} {family.help}", f"# TYPE {full} {family.kind}"]
        lines += [f"{full}{suffix}{_labels(labels)} {value}" for suffix, labels, value in family.samples]
    return "\n".join(lines) + "\n"
