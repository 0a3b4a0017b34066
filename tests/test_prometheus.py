"""Every role's /metrics through prometheus-client, read by a real Prometheus: `epd-lab launch --prometheus-config`
on a 1E1P1D topology with a proxy and the shared secret in a file, a Prometheus of its own (skipped where the
``prometheus`` binary is absent) scraping it every second, streamed chats timed by the client, and the TTFT p50
Prometheus computes from vLLM's histogram against the client's. Also: each role's families as prometheus-client's
parser reads them (vLLM's histograms where their meaning lives, every refusal reason, a refusal counted), and the
Grafana dashboard's queries naming only families the roles export."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from epd_lab.noise import data_uri, random_png
from epd_lab.serving.metrics import TTFT_BUCKETS
from epd_lab.serving.prometheus_config import launch_targets, write_scrape_config
from epd_lab.transfer import TransferEngine
from epd_lab.transfer.errors import AuthenticationError
from helpers import free_port, launch_event, read_line, stop_launch, wait_for

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-lab.json"
SECRET = "prometheus-test-secret-0123456789"
AUTH = {"Authorization": f"Bearer {SECRET}"}
OTHER_SECRET = "another-deployment-secret-987654"
CHATS = 8
IMAGE = data_uri(random_png(3, (64, 64)))
# what each role must export: vLLM's families where the meaning lives, this project's own beside them
EXPECTED = {
    "proxy": {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_success"},
    "prefill": {"vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:prompt_tokens",
                "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"},
    "decode": {"vllm:request_decode_time_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "vllm:generation_tokens", "epd_lab:kv_transfer_seconds",
               "epd_lab:decode_kv_bytes"},
    "encoder": {"epd_lab:encoder_queue_seconds", "epd_lab:encoder_vit_seconds", "epd_lab:ep_transfer_seconds",
                "epd_lab:encoder_cache_hits", "epd_lab:encoder_mm_cache_l1_hits"},
}
REASONS = {  # every refusal reason each role counts, zeros included
    "proxy": {"unauthorized", "body_too_large"},
    "encoder": {"unauthorized", "body_too_large", "admission_deadline", "admission_queue_full", "admission_expired",
                "held_bytes", "transfer_auth"},
    "prefill": {"unauthorized", "body_too_large", "admission_deadline", "admission_queue_full", "admission_expired",
                "kv_pool_exhausted", "kv_asks_refused", "transfer_auth", "ep_unauthenticated", "kv_unauthenticated"},
    "decode": {"unauthorized", "body_too_large", "admission_deadline", "admission_queue_full", "admission_expired",
               "kv_admission_deadline", "kv_admission_queue_full", "kv_admission_expired", "kv_producers_refused",
               "transfer_auth"},
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`epd-lab launch` of 1E1P1D with a proxy, its secret in a file, its scrape config written: (topology line,
    config path, secret file)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET + "\n")
    config = tmp / "prometheus.yml"
    env = {k: v for k, v in os.environ.items() if k != "EPD_SECRET"}
    env["EPD_SECRET_FILE"] = str(secret_file)
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.cli", "launch", "--encoders", "1", "--prefills", "1",
                             "--decodes", "1", "--proxy", "--timeout", "20", "--prometheus-config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        yield launch_event(proc, 240), config, secret_file
    finally:
        stop_launch(proc)


def _families(url: str) -> dict[str, object]:
    r = httpx.get(url + "/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _role_urls(topology: dict) -> dict[str, str]:
    return {"proxy": topology["proxy"], "encoder": topology["encoders"][0], "prefill": topology["prefills"][0],
            "decode": topology["decodes"][0]}


def _ttft(http: httpx.Client, proxy: str, i: int) -> float:
    """One streamed chat with an image: seconds from sending it to its first content chunk, as `bench serve`
    times a TTFT."""
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True, "messages": [{"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": f"n {i}"}]}]}
    t0, first = time.perf_counter(), None
    with http.stream("POST", proxy + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


def _bucket_width(value: float) -> float:
    """The width of the TTFT bucket `value` falls in."""
    bounds = (0.0, *TTFT_BUCKETS)
    return next(hi - lo for lo, hi in zip(bounds, bounds[1:]) if value <= hi)


def test_the_scrape_config_has_one_job_per_role_with_each_process_as_its_target(launched):
    topology, config, secret_file = launched
    jobs = {j["job_name"]: j for j in json.loads(config.read_text())["scrape_configs"]}
    assert set(jobs) == {"epd-lab-encoder", "epd-lab-prefill", "epd-lab-decode", "epd-lab-proxy"}
    for role, url in _role_urls(topology).items():
        job = jobs[f"epd-lab-{role}"]
        assert job["static_configs"][0]["targets"] == [url.removeprefix("http://")]
        assert job["authorization"] == {"type": "Bearer", "credentials_file": str(secret_file)}
    assert SECRET not in config.read_text()  # the secret is read from its file, never written out


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (Debian: apt-get install "
                    "prometheus; .ci/run installs it)")
def test_prometheus_computes_the_ttft_p50_the_client_measured(launched, tmp_path):
    topology, config, _ = launched
    spec = json.loads(config.read_text())
    spec["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    fast = tmp_path / "prometheus.yml"
    fast.write_text(json.dumps(spec))
    port = free_port()
    prom = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(["prometheus", f"--config.file={fast}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        # every job up (the bearer read from the secret's file), and a first scrape of the zero buckets
        wait_for(lambda: server.poll() is None and len([r for r in _safe_query(prom, "up == 1")]) == 4, 60,
                 "Prometheus did not scrape all four roles")
        with httpx.Client(headers=AUTH, timeout=60) as http:
            ttfts = [_ttft(http, topology["proxy"], i) for i in range(CHATS)]
        # each role scraped since the last chat: the proxy's TTFTs, the encoder's E→P transfers, the prefills
        scraped = ("sum(vllm:time_to_first_token_seconds_count)", "sum(epd_lab:ep_transfer_seconds_count)",
                   "sum(vllm:request_prefill_time_seconds_count)")
        wait_for(lambda: all(_value(_safe_query(prom, q)) == CHATS for q in scraped), 30,
                 "Prometheus did not scrape the chats")
        p50 = _value(_query(prom, "histogram_quantile(0.5, sum by (le) "
                                  "(rate(vllm:time_to_first_token_seconds_bucket[1m])))"))
        client = statistics.median(ttfts)
        assert abs(p50 - client) <= max(_bucket_width(client), _bucket_width(p50)), (p50, client, ttfts)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, server.stderr.read()[-2000:]


def _safe_query(prom: str, expr: str) -> list[dict]:
    try:
        return _query(prom, expr)
    except (httpx.HTTPError, AssertionError):
        return []


def _value(result: list[dict]) -> float | None:
    return float(result[0]["value"][1]) if result else None


def test_each_role_exports_vllm_families_where_their_meaning_lives_and_counts_every_refusal(launched):
    topology, _, _ = launched
    urls = _role_urls(topology)
    with httpx.Client(headers=AUTH, timeout=60) as http:
        _ttft(http, topology["proxy"], 0)  # at least one request through every role
    for role, url in urls.items():
        families = _families(url)
        assert EXPECTED[role] <= set(families), (role, EXPECTED[role] - set(families))
        for name in EXPECTED[role] & {n for n, f in families.items() if f.type == "histogram"}:
            assert families[name].samples[0].labels["model_name"], name  # vLLM's label, on every family
        refusals = {s.labels["reason"] for s in families["epd_lab:refusals"].samples}
        assert REASONS[role] <= refusals, (role, REASONS[role] - refusals)
    proxy = _families(urls["proxy"])
    buckets = [s.labels["le"] for s in proxy["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets == [*(repr(float(b)) for b in TTFT_BUCKETS), "+Inf"]  # vLLM's bounds


def _refused(url: str, reason: str) -> float:
    return next(s.value for s in _families(url)["epd_lab:refusals"].samples if s.labels["reason"] == reason)


def test_a_refusal_is_counted_by_the_role_that_refused(launched):
    """A request without the secret (401), a body over the limit (413, refused from its declared length), a KV
    side-channel ask without the secret's tag and a transfer-engine writer with another secret, each counted by the
    role that refused it."""
    topology, _, _ = launched
    for url in _role_urls(topology).values():
        before = _refused(url, "unauthorized")
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        assert _refused(url, "unauthorized") == before + 1
    proxy = topology["proxy"]
    before = _refused(proxy, "body_too_large")
    host, port = proxy.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # its headers only: refused unread
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {SECRET}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {200 << 20}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
    assert _refused(proxy, "body_too_large") == before + 1
    prefill = topology["prefills"][0]
    health = httpx.get(prefill + "/health", headers=AUTH, timeout=10).json()
    before = _refused(prefill, "kv_unauthenticated")
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as ask:  # an ask with no tag of the secret: answered refused
        ask.setsockopt(zmq.LINGER, 0)
        ask.connect(health["kv_url"])
        ask.send(b"not a tagged ask")
        assert ask.poll(10_000) and ask.recv_multipart()
    assert _refused(prefill, "kv_unauthenticated") == before + 1
    before = _refused(prefill, "transfer_auth")
    src = np.zeros(64, dtype=np.uint8)
    with TransferEngine(protocol="tcp", secret=OTHER_SECRET) as writer:  # another secret: refused, nothing written
        writer.register_buffer(src)
        with pytest.raises(AuthenticationError):
            writer.write_buffer(health["session_id"], src, 1 << 40)
    wait_for(lambda: _refused(prefill, "transfer_auth") == before + 1, 10, "the engine did not count the writer")


def test_the_grafana_dashboard_queries_only_families_the_roles_export(launched):
    topology, _, _ = launched
    exported: set[str] = set()
    for url in _role_urls(topology).values():
        for family in _families(url).values():
            exported |= {s.name for s in family.samples} | {family.name}
            if family.type == "counter":  # a counter with no labelled sample yet is exported all the same
                exported.add(family.name + "_total")
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    names = {n for e in exprs for n in re.findall(r"\b(?:vllm|epd_lab):[a-z0-9_:]+", e)}
    assert names and names <= exported, names - exported


def test_a_monolithic_server_exports_vllms_families_and_counts_a_prompt_its_kv_pool_cannot_hold():
    """The floor as one server: vLLM's request histograms and gauges, and a prompt longer than its eight KV blocks
    refused (503) and counted as ``kv_pool_exhausted``."""
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.servers.monolithic", "--port", "0", "--kv-blocks", "8",
                             "--block-size", "16"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = json.loads(read_line(proc, 120, "the monolithic server's URL"))["url"]
        with httpx.Client(headers=AUTH, timeout=60) as http:
            body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": "short"}]}
            assert http.post(url + "/v1/chat/completions", json=body).status_code == 200
            long = {**body, "stream": False, "messages": [{"role": "user", "content": "word " * 300}]}
            assert http.post(url + "/v1/chat/completions", json=long).status_code == 503
        families = _families(url)
        counts = {name: next(s.value for s in family.samples if s.name.endswith("_count"))
                  for name, family in families.items() if family.type == "histogram"}
        assert counts == {"vllm:time_to_first_token_seconds": 1, "vllm:inter_token_latency_seconds": 1,
                          "vllm:request_time_per_output_token_seconds": 1, "vllm:e2e_request_latency_seconds": 1,
                          "vllm:request_queue_time_seconds": 2,  # the refused one queued too, then got no token
                          "vllm:request_prefill_time_seconds": 1, "vllm:request_decode_time_seconds": 1}
        assert next(s.value for s in families["vllm:prompt_tokens"].samples) > 0
        assert next(s.value for s in families["vllm:kv_cache_usage_perc"].samples) == 0  # its blocks are back
        assert _refused(url, "kv_pool_exhausted") == 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_floor_of_replicas_is_scraped_as_monolithic_and_front_jobs(tmp_path):
    """`launch_targets` of monolithic replicas behind a front, without a secret: two jobs, no authorization; a
    lone monolithic server is its own entry point, listed once."""
    floor = SimpleNamespace(encoder_urls=[], prefill_urls=[], decode_urls=[], proxy_url="http://127.0.0.1:9000",
                            monolithic_urls=["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    path = write_scrape_config(tmp_path / "p.yml", launch_targets(floor), interval_s=0.5)
    spec = json.loads(path.read_text())
    assert spec["global"]["scrape_interval"] == "500ms"
    assert {j["job_name"]: j["static_configs"][0]["targets"] for j in spec["scrape_configs"]} == {
        "epd-lab-monolithic": ["127.0.0.1:9001", "127.0.0.1:9002"], "epd-lab-front": ["127.0.0.1:9000"]}
    assert not any("authorization" in j for j in spec["scrape_configs"])
    lone = SimpleNamespace(**{**vars(floor), "proxy_url": "http://127.0.0.1:9001",
                              "monolithic_urls": ["http://127.0.0.1:9001"]})
    assert launch_targets(lone) == {"encoder": [], "prefill": [], "decode": [], "monolithic": ["http://127.0.0.1:9001"]}
