"""The serving floor every role stands on (`epd_lab.serving`): settings written once and read back, typed errors
answered with their status, one body limit, one request counter, /health and /metrics.

The app tests drive `role_app` in process (Starlette's TestClient runs its lifespan) with a small role whose
routes raise what the real roles raise; the roles' own servers are tested through real processes in their
files (`test_encoder`, `test_pd`, `test_proxy`, `test_xpyd`).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from epd_lab.servers.encoder import EncoderSettings
from epd_lab.launch import ROLES, Cluster, Topology
from epd_lab.servers.decode import DecodeSettings
from epd_lab.servers.front import FrontSettings
from epd_lab.servers.monolithic import MonolithicSettings
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.servers.prefill import PrefillSettings
from epd_lab.servers.proxy import ProxySettings, create_app as proxy_app
from epd_lab.serving import (BadRequest, Conflict, GatewayTimeout, Metric, RoleMetrics, Unavailable, from_argv,
                             json_response, parser, read_body, read_struct, role_app, to_argv)
from epd_lab.serving.app import DirectPosts
from epd_lab.trace import Recorder
from helpers import metric, plain_metrics

NON_DEFAULT = [
    EncoderSettings(port=1234, backend="zmq_to_scheduler", model="/models/x", dtype="bfloat16", timeout=2.5,
                    embedding_ttl=7.0, cache_bytes=0),
    PrefillSettings(encoders=("http://127.0.0.1:1", "http://127.0.0.1:2"), backend="zmq_to_tokenizer",
                    transport="tcp", kv_blocks=64, block_size=8, timeout=3.0, kv_free_timeout=4.0, workers=2),
    DecodeSettings(transport="shm", kv_blocks=32, kv_quarantine=0.0, max_batch=1),
    ProxySettings(prefills=("http://127.0.0.1:3",), decodes=("http://127.0.0.1:4", "http://127.0.0.1:5"),
                  policy="least_loaded", retry_after=0.5, model="m", pipelined=True),
    Topology(encoders=3, backend="zmq_to_scheduler", prefills=1, decodes=2, proxy=True, trace=False),
    MonolithicSettings(kv_blocks=32, block_size=8, max_batch=2, media_roots=("/tmp",), media_private_hosts=True),
    FrontSettings(replicas=("http://127.0.0.1:6", "http://127.0.0.1:7"), policy="least_loaded", retry_after=0.5,
                  timeout=3.0, model="m"),
    Topology(monolithic=True, replicas=2, settings={"monolithic1": {"device": "cuda:1"}, "front": {"timeout": 5}}),
]


@pytest.mark.parametrize("settings", NON_DEFAULT, ids=lambda s: type(s).__name__)
def test_settings_survive_their_command_line(settings) -> None:
    argv = to_argv(settings)
    assert from_argv(type(settings), argv) == settings
    # only what differs from the defaults is written (a mapping's flag once per key)
    assert len({a for a in argv if a.startswith("--")}) == sum(
        getattr(settings, f.name) != (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
        for f in dataclasses.fields(settings) if f.metadata.get("cli", True))


def test_every_setting_has_its_option_with_help() -> None:
    for _, cls, _ in ROLES.values():
        text = parser(cls).format_help()
        for field in dataclasses.fields(cls):
            flag = field.metadata["flag"] or "--" + field.name.replace("_", "-")
            assert flag in text and field.metadata["help"], (cls.__name__, field.name)
    assert "--no-trace" in parser(Topology).format_help()


def test_values_the_settings_refuse_exit_with_the_usage(capsys) -> None:
    for argv, words in ((["--dtype", "float16"], "invalid choice"), (["--workers", "0"], "workers must be >= 1"),
                        (["--timeout", "soon"], "invalid float value")):
        with pytest.raises(SystemExit) as info:
            from_argv(PrefillSettings, argv)
        assert info.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        from_argv(ProxySettings, ["--decode", "http://127.0.0.1:1"])  # --prefill is required
    assert "--prefill" in capsys.readouterr().err


def test_ray_options_on_the_command_line(capsys) -> None:
    argv = ["--ray", "head:6379", "--ray-options", 'prefill={"num_gpus": 1, "resources": {"epd_p": 1}}',
            "--ray-options", 'proxy={"num_cpus": 0}', "--ray-options", 'decode1={"label_selector": {"r": "d"}}']
    topology = from_argv(Topology, argv)
    assert topology.ray_options == {"prefill": {"num_gpus": 1, "resources": {"epd_p": 1}}, "proxy": {"num_cpus": 0},
                                    "decode1": {"label_selector": {"r": "d"}}}
    assert from_argv(Topology, to_argv(topology)) == topology
    for value, words in (("prefill", "is not KEY=JSON"), ("prefill={x", "is not JSON"),
                         ("prefill=[1]", "is not a JSON object"), ('encoders={"num_cpus": 1}', "name a role"),
                         ('prefill={"num_cpu": 1}', "unknown num_cpu; known: num_cpus"),
                         ('prefill={"num_gpus": -1}', "'num_gpus'] must be a number >= 0"),
                         ('prefill={"num_cpus": true}', "'num_cpus'] must be a number >= 0"),
                         ('prefill={"resources": {"a": "x"}}', "must map resource names to numbers"),
                         ('prefill={"label_selector": {"a": 1}}', "must map label names to strings"),
                         ('decode0={"memory": 1.5}', "whole number of bytes")):
        with pytest.raises(SystemExit) as info:
            from_argv(Topology, ["--ray-options", value])
        assert info.value.code == 2 and words in capsys.readouterr().err, value


def test_a_command_line_that_cannot_carry_a_value_is_refused() -> None:
    with pytest.raises(ValueError, match="model=None"):
        to_argv(dataclasses.replace(NON_DEFAULT[3], model=None))
    with pytest.raises(ValueError, match="comma"):
        to_argv(dataclasses.replace(NON_DEFAULT[3], prefills=("http://a:1/x,y",)))


def test_topology_settings_reach_the_role_command_line() -> None:
    topology = Topology(encoders=1, prefills=1, decodes=1, proxy=True, timeout=20, dtype="bfloat16",
                        settings={"decode": {"max_batch": 2}, "proxy": {"policy": "least_loaded"}})
    cluster = object.__new__(Cluster)  # only its command lines: nothing is started
    cluster.topology, cluster.procs, cluster._ray = topology, [], None  # what close() reads at __del__
    decode = cluster.command("decode")
    assert decode[decode.index("-m") + 1] == "epd_lab.servers.decode"
    assert from_argv(DecodeSettings, decode[3:]) == DecodeSettings(dtype="bfloat16", timeout=20, max_batch=2)
    proxy = from_argv(ProxySettings, cluster.command("proxy", prefills=("http://p:1",), decodes=("http://d:1",))[3:])
    assert (proxy.policy, proxy.timeout, proxy.model) == ("least_loaded", 20, MODEL_ID)  # not the model directory
    with pytest.raises(ValueError, match="decode has no setting batch"):
        Topology(settings={"decode": {"batch": 2}})
    with pytest.raises(ValueError, match="unknown role"):
        Topology(settings={"decoder": {}})


# ---- role_app ----
class Role:
    """A role as the floor sees one: routes raise what the real roles raise."""

    def __init__(self) -> None:
        self.recorder = Recorder(node="test:0")
        self.metrics = RoleMetrics("test", "test-model")
        self.status = "ok"
        self.closed = threading.Event()
        self.ran = threading.Event()

    def health(self) -> dict:
        return {"status": self.status}

    def metric_families(self) -> list[Metric]:
        return [self.metrics.gauge("things", "things held", 3),
                self.metrics.counter("by_kind", "things by kind", {"a\"b": 1, "c": 2}, "kind")]

    def refusals(self) -> dict[str, float]:
        return {"things_refused": 2}

    async def run(self) -> None:
        self.ran.set()

    def close(self) -> None:
        self.closed.set()


@pytest.fixture()
def role() -> tuple[TestClient, Role]:
    it = Role()
    app = role_app("test", lambda: it, ("/raise/{status}", "/body", "/struct", "/plain"))

    @app.post("/raise/{status}")
    async def raise_(status: int) -> None:
        raise {400: BadRequest, 409: Conflict, 503: Unavailable, 504: GatewayTimeout}.get(status, RuntimeError)(
            f"raised {status}")

    @app.post("/body")
    async def body(request: Request):
        return json_response({"n": len(await read_body(request, limit=10))})

    @app.post("/struct")
    async def struct(request: Request):
        return json_response(await read_struct(request, dict[str, int]))

    @app.post("/plain")
    async def plain(request: Request):
        what = bytes(await read_body(request))
        if what == b"conflict":
            raise Conflict("raised in a plain route")
        if what == b"bug":
            raise RuntimeError("a bug in a plain route")
        return json_response({"echo": what.decode()})

    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, it
    assert it.closed.is_set()


def test_typed_errors_answer_their_status_and_detail(role) -> None:
    client, _ = role
    for status in (400, 409, 503, 504):
        r = client.post(f"/raise/{status}")
        assert (r.status_code, r.json()) == (status, {"detail": f"raised {status}"})
    r = client.post("/raise/500")  # a bug: 500 with its type, the server keeps serving
    assert r.status_code == 500 and r.json() == {"detail": "RuntimeError: raised 500"}
    r = client.get("/no/such/route")
    assert r.status_code == 404 and set(r.json()) == {"detail"}
    r = client.get("/raise/400")
    assert r.status_code == 405 and set(r.json()) == {"detail"}


def test_plain_posts_skip_the_framework_and_answer_as_it_would(role) -> None:
    """`DirectPosts`: a POST to a static route taking only the request calls it directly; its answers, errors
    and counts are what the framework's way gives (a route with a path parameter still goes that way)."""
    client, _ = role
    assert client.post("/plain", content=b"hi").json() == {"echo": "hi"}
    r = client.post("/plain", content=b"conflict")
    assert (r.status_code, r.json()) == (409, {"detail": "raised in a plain route"})
    r = client.post("/plain", content=b"bug")  # on to the framework's error middleware: 500, the server serves on
    assert (r.status_code, r.json()) == (500, {"detail": "RuntimeError: a bug in a plain route"})
    assert client.get("/plain").status_code == 405
    direct = client.app.middleware_stack
    while not isinstance(direct, DirectPosts):
        direct = direct.app
    assert set(direct.table) == {"/body", "/struct", "/plain"}  # not /raise/{status}
    text = plain_metrics(client.get("/metrics").text)
    for status in (200, 409, 500, 405):
        assert f'epd_lab:test_requests_total{{route="/plain",status="{status}"}} 1' in text, status


def test_one_body_limit_and_one_decoder(role) -> None:
    client, _ = role
    assert client.post("/body", content=b"x" * 10).json() == {"n": 10}
    r = client.post("/body", content=b"x" * 11)
    assert r.status_code == 413 and "larger than 10 bytes" in r.json()["detail"]
    refused = metric(plain_metrics(client.get("/metrics").text), 'epd_lab:refusals_total{reason="body_too_large"}')
    assert refused == 1  # counted by the body reader, in this server's floor
    assert client.post("/struct", content=b'{"a": 1}').json() == {"a": 1}
    for bad in (b"{", b'{"a": "one"}', b"[]"):
        r = client.post("/struct", content=bad)
        assert r.status_code == 400 and r.json()["detail"].startswith("malformed"), bad


def test_health_metrics_and_the_request_counter(role) -> None:
    client, it = role
    assert it.ran.is_set()
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["http"]["keepalive_s"] > 0
    it.status = "degraded"
    assert client.get("/health").status_code == 503
    client.post("/raise/400")
    client.post("/raise/500")
    client.get("/no/such/route")
    text = plain_metrics(client.get("/metrics").text)
    for line in ('epd_lab:test_requests_total{route="/health",status="200"} 1',
                 'epd_lab:test_requests_total{route="/health",status="503"} 1',
                 'epd_lab:test_requests_total{route="/raise/{status}",status="400"} 0',  # templates are not paths
                 'epd_lab:test_requests_total{route="other",status="400"} 1',
                 'epd_lab:test_requests_total{route="other",status="500"} 1',
                 'epd_lab:test_requests_total{route="other",status="404"} 1',
                 "# TYPE epd_lab:test_things gauge", "epd_lab:test_things 3",
                 'epd_lab:test_by_kind_total{kind="a\\"b"} 1', 'epd_lab:test_by_kind_total{kind="c"} 2',
                 'epd_lab:refusals_total{reason="things_refused"} 2'):
        assert (line in text) != line.endswith(" 0"), line
    assert 'epd_lab:refusals_total{reason="body_too_large"} 0' in text  # the floor's own reasons, always there


def test_the_proxy_answers_openai_error_objects_on_the_floor() -> None:
    app = proxy_app(ProxySettings(prefills=("http://127.0.0.1:9",), decodes=("http://127.0.0.1:9",)))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", content=b"{")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["code"] == "invalid_request"
        r = client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = client.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)  # deeper than decoders go
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON body")
        metrics = plain_metrics(client.get("/metrics").text)
        assert 'epd_lab:proxy_requests_total{route="/v1/completions",status="400"} 1' in metrics


@pytest.mark.parametrize("role", list(ROLES))
def test_every_role_serves_its_openapi_schema(role) -> None:
    """/openapi.json (and so /docs, and schema-driven clients and fuzzers) works on every role: no route is
    annotated with a name FastAPI cannot resolve. The app is built, not started: no model loads."""
    module, cls, _ = ROLES[role]
    settings = NON_DEFAULT[[type(s) for s in NON_DEFAULT].index(cls)]
    app = importlib.import_module(module).create_app(settings)
    r = TestClient(app).get("/openapi.json")
    assert r.status_code == 200, r.text[:300]
    assert {"/health", "/metrics", "/v1/spans", "/v1/clock"} <= set(r.json()["paths"])


@pytest.mark.parametrize("command", ["encoder", "prefill-server", "decode-server", "proxy", "monolithic", "front",
                                     "launch"])
def test_every_role_has_its_command_line(command, capsys) -> None:
    """``epd-lab <role> --help`` reaches the role's settings parser (the CLI imports the right module)."""
    from epd_lab import cli

    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0 and "--timeout" in capsys.readouterr().out


def test_a_server_caps_its_connections_and_closes_idle_ones() -> None:
    """A real server process (the proxy: no model to load) with a cap of 8 connections and a 1 s first-byte idle
    timeout: 8 idle sockets fill it, a ninth is closed as it is accepted, unanswered; a second later the idle
    ones are closed by the server, and it serves again, reporting both counts."""
    env = {**os.environ, "EPD_HTTP_MAX_CONNECTIONS": "8", "EPD_HTTP_IDLE_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.servers.proxy", "--prefill", "http://127.0.0.1:9",
                             "--decode", "http://127.0.0.1:9"], stdout=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        url = json.loads(proc.stdout.readline())["url"]
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(8)]
        time.sleep(0.2)  # accepted: all 8 open
        with socket.create_connection((host, int(port))) as ninth:
            ninth.settimeout(5)
            ninth.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = ninth.recv(1024)
            except ConnectionResetError:  # the request reached a socket already closed
                answer = b""
            assert answer == b""  # closed unanswered
        for sock in idle:
            sock.settimeout(5)
            assert sock.recv(1024) == b""  # the server closed it after 1 s of silence
            sock.close()
        http = httpx.get(url + "/health", timeout=5).json()["http"]
        assert http["connections_refused"] == 1 and http["connections_idle_closed"] == 8
        assert http["max_connections"] == 8 and http["connections_open"] == 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
