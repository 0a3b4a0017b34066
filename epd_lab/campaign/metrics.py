"""The servers' pool levels and RSS over a leg, from each server's ``/metrics`` (Prometheus text) and
``/proc/<pid>/status``, read by a sampler thread.

Pool levels are the gauges that must return to their idle value once nothing is in flight (`LEAK_GAUGES`:
embeddings held for ``/send``, KV blocks used or quarantined, requests admitted or in flight, KV requests held
for decode, the proxy's in-flight per backend, the transfer engines' registrations, pinning writes and managed
buffers), plus informative ones (`INFO_GAUGES`: the encoder's embedding cache bytes). Refusals are counted from
the same text (`refusal_counts`).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from epd_lab.campaign.client import auth_headers
from epd_lab.launch import Cluster

# /metrics gauges (`short_name`s, after "epd_lab:<role>_") back at their idle value after the last answer
LEAK_GAUGES = ("embeddings_held", "kv_blocks_used", "kv_blocks_quarantined", "inflight", "admitted",
               "kv_blocks_reserved", "kv_admission_admitted",  # decode's KV reservations
               "kv_requests_held", "active_requests", "backend_inflight", "engine_regions",
               "engine_writes_in_flight", "engine_managed_buffers")
INFO_GAUGES = ("cache_bytes", "queue_length")


def role_urls(cluster: Cluster) -> dict[str, str]:
    """Process name → base URL."""
    return dict(zip(cluster.process_names(), cluster.urls()))


def _samples(text: str) -> Iterator[tuple[str, Any]]:
    """(family type, sample) of every sample of a Prometheus text exposition (prometheus-client's parser)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield family.type, sample


def short_name(name: str) -> str:
    """A role's family name without its namespace and role (``epd_lab:prefill_kv_blocks_used``: ``kv_blocks_used``)."""
    return name.partition(":")[2].split("_", 1)[-1]


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges of a Prometheus text exposition: name → value (labelled samples of one name summed)."""
    values: dict[str, float] = {}
    for kind, sample in _samples(text):
        if kind == "gauge":
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def pool_levels(text: str) -> dict[str, float]:
    """The pool gauges (`LEAK_GAUGES`, `INFO_GAUGES`) of one server's /metrics, by short name (`short_name`)."""
    out = {}
    for name, value in parse_metrics(text).items():
        short = short_name(name)
        if name.startswith("epd_lab:") and (short in LEAK_GAUGES or short in INFO_GAUGES):
            out[short] = value
    return out


def refusal_counts(text: str) -> dict[str, float]:
    """A server's refusals from its /metrics: ``refused_total`` by reason (every role's admission, the proxy's
    by code; decode's KV admission's as ``kv_<reason>``) and the encoder's ``refused_held_bytes_total`` as
    ``held_bytes``; zeros left out."""
    out: dict[str, float] = {}
    for _, sample in _samples(text):
        if not sample.value or not sample.name.startswith("epd_lab:"):
            continue
        if sample.name.endswith("_refused_held_bytes_total"):
            reason = "held_bytes"
        elif sample.name.endswith("_refused_total") and "reason" in sample.labels:
            reason = sample.labels["reason"]
            if sample.name.endswith("_kv_admission_refused_total"):  # decode's second admission: its KV pool
                reason = "kv_" + reason
        else:
            continue
        out[reason] = out.get(reason, 0.0) + sample.value
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
    s, and once more at the end; `rows` is a long table ``{t, process, metric, value}`` (t: seconds since
    `t0`). A server that does not answer within the interval is recorded as missing (no row), never waited for."""

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
