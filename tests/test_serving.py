"""The HTTP stack every server starts on (`epd_lab.serving`): the loop and parser chosen (uvloop + httptools,
else asyncio + h11), shown in /health, and connections kept alive and reused, as the server counts them.

The servers are real processes: the bench's app served through `serve_and_announce` (`epd_lab.bench.http`),
and one encoder for a role's /health. No timing is asserted here: the speeds live in `epd-lab bench http`.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import Response

from epd_lab import serving
from epd_lab.bench import http as bench_http
from epd_lab.launch import Cluster, Topology
from helpers import wait_for

BODY = bench_http.bodies()["small"]
N = 50


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The bench's app in its own process on the default stack."""
    with bench_http.server_process("auto", "auto") as url:
        yield url


def accepted(url: str) -> int:
    """Connections the server accepted so far, counting the one this question comes on."""
    return bench_http.stats(url)["connections_accepted"]


def port_of(response: bytes) -> int:
    return json.loads(response)["port"]


def test_auto_prefers_uvloop_and_httptools_and_falls_back(monkeypatch):
    monkeypatch.delenv("EPD_HTTP_LOOP", raising=False)
    monkeypatch.delenv("EPD_HTTP_PARSER", raising=False)
    assert serving.http_stack() == ("uvloop", "httptools")  # both are dependencies
    monkeypatch.setenv("EPD_HTTP_LOOP", "asyncio")
    assert serving.http_stack() == ("asyncio", "httptools")
    assert serving.http_stack("uvloop", "h11") == ("uvloop", "h11")  # named ones beat the variables
    monkeypatch.delenv("EPD_HTTP_LOOP")
    for missing in ("uvloop", "httptools"):
        monkeypatch.setitem(sys.modules, missing, None)  # import fails, as where the package is not installed
    assert serving.http_stack() == ("asyncio", "h11")
    with pytest.raises(ImportError):
        serving.http_stack("uvloop")
    with pytest.raises(ValueError):
        serving.http_stack("trio")


def test_server_runs_on_the_chosen_stack(server):
    info = bench_http.stats(server)
    assert (info["loop"], info["parser"]) == ("uvloop", "httptools")  # the loop as the running loop says it
    # the server keeps idle connections past every client's expiry: the client always closes first
    assert info["keepalive_s"] == serving.KEEPALIVE_S > serving.CLIENT_KEEPALIVE_S
    assert serving.KEEPALIVE_S > httpx.Limits().keepalive_expiry


def test_the_fallback_stack_serves():
    with bench_http.server_process("asyncio", "h11") as url:
        r = httpx.post(url + "/echo", content=BODY, headers=bench_http.HEADERS)
        assert r.status_code == 200 and r.json()["received"] == len(BODY)
        info = bench_http.stats(url)
    assert (info["loop"], info["parser"]) == ("asyncio", "h11")


def test_one_client_reuses_one_connection(server):
    """N posts through each client (httpx sync and async, http.client): one connection each, by the ports
    the server saw and by its accepted count."""
    before = accepted(server)
    with httpx.Client(base_url=server) as client:
        ports = {port_of(client.post("/echo", content=BODY, headers=bench_http.HEADERS).content) for _ in range(N)}
    assert len(ports) == 1

    async def async_posts() -> set[int]:
        async with httpx.AsyncClient(base_url=server) as client:
            return {port_of((await client.post("/echo", content=BODY, headers=bench_http.HEADERS)).content)
                    for _ in range(N)}

    assert len(asyncio.run(async_posts())) == 1
    conn = bench_http.http_connection(server)
    try:
        ports = set()
        for _ in range(N):
            conn.request("POST", "/echo", BODY, bench_http.HEADERS)
            ports.add(port_of(conn.getresponse().read()))
    finally:
        conn.close()
    assert len(ports) == 1
    assert accepted(server) - before == 3 + 1  # the three clients, and this question's own


def test_idle_connection_outlives_the_old_keepalive(server):
    """A connection idle longer than uvicorn's default keep-alive (5 s, which is also httpx's default
    expiry) still carries the next request: the server did not close it, and the client (expiry
    CLIENT_KEEPALIVE_S) did not either."""
    before = accepted(server)
    conn = bench_http.http_connection(server)
    limits = httpx.Limits(keepalive_expiry=serving.CLIENT_KEEPALIVE_S)
    with httpx.Client(base_url=server, limits=limits) as client:
        def both() -> tuple[int, int]:
            conn.request("POST", "/echo", BODY, bench_http.HEADERS)
            return (port_of(conn.getresponse().read()),
                    port_of(client.post("/echo", content=BODY, headers=bench_http.HEADERS).content))

        first = both()
        time.sleep(5.5)
        assert both() == first
    conn.close()
    assert accepted(server) - before == 2 + 1


def test_role_health_shows_the_stack():
    """A real role (an encoder, through `run_server`) serves on the stack and says so in /health."""
    with Cluster(Topology(encoders=1, backend="zmq_to_tokenizer")) as cluster, \
            httpx.Client(base_url=cluster.encoder_urls[0]) as client:
        for _ in range(3):
            stack = client.get("/health").json()["http"]
    assert (stack["loop"], stack["parser"], stack["keepalive_s"]) == ("uvloop", "httptools", serving.KEEPALIVE_S)
    assert stack["connections_open"] >= 1 and stack["connections_accepted"] >= 1


def test_bench_http_writes_the_json_schema(tmp_path):
    """A tiny run of `epd-lab bench http` (not a speed test: it checks what is written)."""
    out = tmp_path / "http.json"
    subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "http", "--rounds", "2", "--batch", "2",
                    "--load-rounds", "1", "--concurrency", "4", "--load-requests", "40", "--json", str(out)],
                   check=True, capture_output=True, timeout=110)
    data = json.loads(out.read_text())
    stacks = {(s["loop"], s["parser"]) for s in data["servers"]}
    assert stacks == set(bench_http.STACKS)
    assert all((s["served_on"]["loop"], s["served_on"]["parser"]) == (s["loop"], s["parser"]) for s in data["servers"])
    assert all(s["connections_accepted_while_measuring"] == 0 for s in data["servers"])
    clients = {r["client"] for r in data["rows"]}
    assert {"httpx.Client", "http.client", "httpx.AsyncClient"} <= clients
    for r in data["rows"]:
        assert r["round_trips"] == 4 and r["connections"] == 1 and 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
    assert {(r["loop"], r["parser"], r["body"]) for r in data["load"]} == {
        (*stack, body) for stack in bench_http.STACKS for body in ("small", "image")}
    assert all(r["median_rps"] > 0 and r["connections"] == 4 for r in data["load"])  # one per request in flight
    assert data["nagle"]["nodelay_median_us"] > 0 and data["machine"]["cores"] >= 1


@pytest.mark.parametrize("loop,parser", [("uvloop", "httptools"), ("asyncio", "h11")])
def test_client_gone_reads_a_closed_connection_and_leaves_an_open_one_serving(loop, parser):
    """`serving.client_gone` (the proxy's, prefill's and encoder's check before they start work) on a real
    uvicorn, both stacks: a client still connected reads False, twice, and its request is still answered (the
    stepped receive left the exchange whole); a client that sent its body and closed the socket reads True."""
    app, seen = FastAPI(), []

    @app.post("/check")
    async def check(request: Request) -> Response:
        await serving.read_body(request)
        return Response(json.dumps([serving.client_gone(request), serving.client_gone(request)]))

    @app.post("/watch")
    async def watch(request: Request) -> Response:
        await serving.read_body(request)
        for _ in range(1000):  # at most 5 s: the client closes at once
            if serving.client_gone(request):
                break
            await asyncio.sleep(0.005)
        seen.append(serving.client_gone(request))
        return Response(b"{}")

    sock = serving.bind_tcp("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, loop=loop, http=parser, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, "uvicorn did not start")
        url = serving.url_of("127.0.0.1", sock)
        r = httpx.post(url + "/check", content=BODY, headers=bench_http.HEADERS)
        assert r.status_code == 200 and r.json() == [False, False]
        with socket.create_connection(sock.getsockname()) as client:
            client.sendall(b"POST /watch HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
        wait_for(lambda: seen, 10, "the route did not finish")
        assert seen == [True]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()
