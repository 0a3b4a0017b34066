"""`epd-lab bench http`: one kept-alive HTTP hop, per server stack and per client, on loopback.

What is timed is one POST round trip, as the prefill receiver's /encode and /send and the proxy's posts
make them: a ~200 B JSON body (``small``) and a ~200 KB one (``image``: a base64 PNG in JSON), each
answered with ~200 B of JSON. The server is a FastAPI app served by `epd_lab.serving` (the path every role
starts through) in its own process, one per stack: uvicorn's parser (h11 or httptools) on its event loop
(asyncio or uvloop). The clients: ``httpx.Client``, ``http.client`` (HTTPConnection),
``httpx.AsyncClient``, ``aiohttp`` and ``aio_http`` (`epd_lab.http.aio`, the proxy's client), the async ones on
each loop.
Every client holds one connection to each server for the whole run.

The machine is shared and noisy (2 vCPUs), so the cells are interleaved: each round runs a batch of
round trips in every cell, the cells in a rotated order. Reported per cell: median and range (min, p10,
p90, max) in µs, and the connections the server saw: the distinct client ports its answers named. The
JSON also records each server's accepted-connection count (`epd_lab.serving.http_info`) before and after
the measured rounds, and a Nagle check: http.client's small POST with TCP_NODELAY cleared (CPython sends
its headers and body in two send() calls, and the second waits for the server's delayed ACK).

One round trip at a time leaves the server idle between requests; ``load`` measures each stack busy:
requests/s with `concurrency` requests in flight on as many kept-alive connections, sent by a minimal
HTTP/1.1 client on asyncio streams (its cost per request is far below the server's, so the server is
what is measured), in alternating rounds; each stack's ratio to the first (asyncio + h11) is taken within
a round, where the machine's load is alike, and its median reported.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import importlib
import importlib.util
import json
import re
import select
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import httpx
import msgspec
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import Response

from epd_lab.http.aio import AsyncHTTPClient
from epd_lab.bench import write_json
from epd_lab.machine import machine_info
from epd_lab.serving import CLIENT_KEEPALIVE_S, LOOPS, PARSERS, bind_tcp, http_info, serve_and_announce, url_of

STACKS = tuple((loop, parser) for loop in reversed(LOOPS) for parser in reversed(PARSERS))  # asyncio+h11 first
CLIENTS = ("httpx.Client", "http.client", "httpx.AsyncClient", "aiohttp", "aio_http")
ASYNC_CLIENTS = ("httpx.AsyncClient", "aiohttp", "aio_http")
HEADERS = {"content-type": "application/json"}
ANSWER_BYTES = 200
WARMUP = 20  # round trips per cell before the rounds: connection, first-use costs
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


def _padded(fields: dict[str, Any], size: int) -> bytes:
    """`fields` as a JSON object of `size` bytes, filled up by a ``pad`` string."""
    raw = msgspec.json.encode({**fields, "pad": ""})  # ends with "pad":""}
    return raw[:-2] + b"x" * (size - len(raw)) + b'"}'


def bodies() -> dict[str, bytes]:
    """The request bodies by name: 200 B of JSON, and ~200 KB holding a base64 'image'."""
    small = _padded({"req_id": "0123456789abcdef0123456789abcdef_local_part_0", "part_idx": 0, "num_parts": 1,
                     "prefill_host": "127.0.0.1", "embedding_port": 40000, "modality": "IMAGE"}, 200)
    raw = bytes(range(256)) * (150_000 // 256)  # base64: 4/3 of it, ~200 KB
    image = msgspec.json.encode({"req_id": "0123456789abcdef0123456789abcdef_local_part_0", "part_idx": 0,
                                 "mm_items": ["data:image/png;base64," + base64.b64encode(raw).decode()]})
    return {"small": small, "image": image}


# ---- the server ----
def create_app() -> FastAPI:
    """The measured app: ``POST /echo`` parses the JSON body and answers ~200 B naming the client's port
    (the server's view of which connection carried the request); ``GET /stats`` answers `http_info`."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        body = await request.body()
        msgspec.json.decode(body)  # the roles parse theirs
        answer = {"port": request.client.port if request.client else 0, "received": len(body)}
        return Response(_padded(answer, ANSWER_BYTES), media_type="application/json")

    @app.get("/stats")
    async def stats() -> Response:
        return Response(msgspec.json.encode(http_info()), media_type="application/json")

    return app


def serve(loop: str, parser: str, host: str = "127.0.0.1") -> int:
    """Serve `create_app` on `loop` + `parser` through `epd_lab.serving`, on a port the OS picks (printed)."""
    sock = bind_tcp(host, 0)
    return serve_and_announce(create_app(), sock, url_of(host, sock), 1.0, loop=loop, parser=parser)


@contextlib.contextmanager
def server_process(loop: str, parser: str, timeout: float = 60.0) -> Iterator[str]:
    """A `serve` process; yields its URL, terminates it on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "epd_lab.bench.http", "--serve", loop, parser],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the {loop}+{parser} server did not start (exit {proc.poll()})")
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def stats(url: str) -> dict[str, Any]:
    """The server's `http_info` (on a connection of its own, closed after)."""
    conn = http_connection(url)
    try:
        conn.request("GET", "/stats")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


# ---- the clients ----
def http_connection(url: str, nodelay: bool = True) -> http.client.HTTPConnection:
    """A connected HTTPConnection. CPython's connect() sets TCP_NODELAY (since 3.6; the JSON's
    ``nagle.connect_sets_nodelay`` checks): it sends a request's headers and body in two send() calls, and
    with Nagle on the second waits ~40 ms for the server's delayed ACK. `nodelay` False clears it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=30)
    conn.connect()
    if not nodelay:
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    return conn


def _answered(raw: bytes, sent: bytes) -> int:
    """The client port the server saw, after checking it received the whole body."""
    answer = msgspec.json.decode(raw)
    if answer["received"] != len(sent):
        raise RuntimeError(f"the server received {answer['received']} of {len(sent)} bytes")
    return answer["port"]


@dataclass
class Cell:
    """One measured combination: its round-trip times (s) and the client ports the server named."""

    loop: str
    parser: str
    client: str
    client_loop: str | None
    body: str
    times: list[float]
    ports: set[int]


class Clients:
    """One client of each kind per server, each holding its connection for the whole run; async clients
    on each event loop (each loop kept in this thread and run only for a batch)."""

    def __init__(self, stack: contextlib.ExitStack, urls: dict[tuple[str, str], str]) -> None:
        self.loops: dict[str, asyncio.AbstractEventLoop] = {}
        for name in LOOPS:
            if importlib.util.find_spec(name) is not None:
                loop = importlib.import_module(name).new_event_loop()
                self.loops[name] = loop
                stack.callback(loop.close)
        self.kinds = [k for k in CLIENTS if k != "aiohttp" or importlib.util.find_spec("aiohttp") is not None]
        limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
        self.sync: dict[tuple[str, ...], Callable[[bytes], int]] = {}  # by (client, server loop, parser)
        self.aio: dict[tuple[str, ...], Callable[[bytes], Awaitable[int]]] = {}  # (client, its loop, server's)
        for server, url in urls.items():
            client = stack.enter_context(httpx.Client(base_url=url, limits=limits, timeout=30))
            self.sync[("httpx.Client", *server)] = self._httpx_sync(client)
            conn = http_connection(url)
            stack.callback(conn.close)
            self.sync[("http.client", *server)] = self._http_client(conn)
            for loop_name, loop in self.loops.items():
                aclient = httpx.AsyncClient(base_url=url, limits=limits, timeout=30)
                stack.callback(lambda c=aclient, lp=loop: lp.run_until_complete(c.aclose()))
                self.aio[("httpx.AsyncClient", loop_name, *server)] = self._httpx_async(aclient)
                if "aiohttp" in self.kinds:
                    session = loop.run_until_complete(self._aiohttp_session())
                    stack.callback(lambda c=session, lp=loop: lp.run_until_complete(c.close()))
                    self.aio[("aiohttp", loop_name, *server)] = self._aiohttp(session, url)
                lean = AsyncHTTPClient(30)  # its connections are made on the loop of its first request
                stack.callback(lambda c=lean, lp=loop: lp.run_until_complete(c.close()))
                self.aio[("aio_http", loop_name, *server)] = self._aio_http(lean, url)

    @staticmethod
    def _httpx_sync(client: Any) -> Callable[[bytes], int]:
        def post(body: bytes) -> int:
            r = client.post("/echo", content=body, headers=HEADERS)
            r.raise_for_status()
            return _answered(r.content, body)
        return post

    @staticmethod
    def _http_client(conn: http.client.HTTPConnection) -> Callable[[bytes], int]:
        def post(body: bytes) -> int:
            conn.request("POST", "/echo", body, HEADERS)
            r = conn.getresponse()
            raw = r.read()  # read to the end, or the connection cannot carry the next request
            if r.status != 200:
                raise RuntimeError(f"/echo answered {r.status}")
            return _answered(raw, body)
        return post

    @staticmethod
    def _httpx_async(client: Any) -> Callable[[bytes], Awaitable[int]]:
        async def post(body: bytes) -> int:
            r = await client.post("/echo", content=body, headers=HEADERS)
            r.raise_for_status()
            return _answered(r.content, body)
        return post

    @staticmethod
    async def _aiohttp_session() -> Any:
        import aiohttp

        # created on the loop it will run on; keepalive as the httpx clients keep theirs
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S))

    @staticmethod
    def _aiohttp(session: Any, url: str) -> Callable[[bytes], Awaitable[int]]:
        async def post(body: bytes) -> int:
            async with session.post(url + "/echo", data=body, headers=HEADERS) as r:
                raw = await r.read()
                r.raise_for_status()
                return _answered(raw, body)
        return post

    @staticmethod
    def _aio_http(client: AsyncHTTPClient, url: str) -> Callable[[bytes], Awaitable[int]]:
        async def post(body: bytes) -> int:
            answer = await client.request("POST", url + "/echo", body, HEADERS)
            raw = await answer.read()
            answer.release()
            if answer.status != 200:
                raise RuntimeError(f"/echo answered {answer.status}")
            return _answered(raw, body)
        return post

    def cells(self, servers: list[tuple[str, str]], bodies: dict[str, bytes]) -> list[Cell]:
        """Every (server, client, client loop, body) combination, with no times yet."""
        out = []
        for body in bodies:
            for loop, parser in servers:
                for kind in self.kinds:
                    for client_loop in (self.loops if kind in ASYNC_CLIENTS else (None,)):
                        out.append(Cell(loop, parser, kind, client_loop, body, [], set()))
        return out

    def batch(self, cell: Cell, body: bytes, n: int, keep: bool = True) -> None:
        """`n` round trips of `cell`, timed one by one (kept in the cell unless `keep` is False)."""
        if cell.client_loop is None:
            post = self.sync[cell.client, cell.loop, cell.parser]
            for _ in range(n):
                t0 = time.perf_counter()
                port = post(body)
                dt = time.perf_counter() - t0
                if keep:
                    cell.times.append(dt)
                    cell.ports.add(port)
            return
        apost = self.aio[cell.client, cell.client_loop, cell.loop, cell.parser]

        async def run() -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                port = await apost(body)
                dt = time.perf_counter() - t0
                if keep:
                    cell.times.append(dt)
                    cell.ports.add(port)

        self.loops[cell.client_loop].run_until_complete(run())


# ---- the run ----
def _summary(cell: Cell) -> dict[str, Any]:
    us = sorted(t * 1e6 for t in cell.times)
    deciles = statistics.quantiles(us, n=10)
    return {"loop": cell.loop, "parser": cell.parser, "client": cell.client, "client_loop": cell.client_loop,
            "body": cell.body, "round_trips": len(us), "median_us": statistics.median(us), "min_us": us[0],
            "p10_us": deciles[0], "p90_us": deciles[-1], "max_us": us[-1], "connections": len(cell.ports)}


def nagle_check(url: str, body: bytes, n: int = 20) -> dict[str, Any]:
    """http.client's small POST with TCP_NODELAY set and cleared (median µs over `n`), and whether this
    interpreter's HTTPConnection.connect() sets it by itself."""
    plain = http_connection(url)
    sets_it = bool(plain.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    plain.close()
    out: dict[str, Any] = {"python": sys.version.split()[0], "connect_sets_nodelay": sets_it}
    for nodelay in (True, False):
        conn = http_connection(url, nodelay)
        post = Clients._http_client(conn)
        post(body)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            post(body)
            times.append(time.perf_counter() - t0)
        conn.close()
        out["nodelay_median_us" if nodelay else "nagle_median_us"] = statistics.median(times) * 1e6
    return out


async def load_rps(url: str, body: bytes, concurrency: int, requests: int) -> tuple[float, int]:
    """Requests/s of `requests` posts of `body` to /echo over `concurrency` kept-alive connections, each
    with one request in flight, and the client ports the server named (one per connection if reused)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /echo HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    start = asyncio.Event()
    ports: set[int] = set()

    async def worker(count: int) -> None:
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))  # TCP_NODELAY set by asyncio
        try:
            await start.wait()
            for _ in range(count):
                writer.writelines((head, body))
                headers = await reader.readuntil(b"\r\n\r\n")
                match = CONTENT_LENGTH.search(headers)
                if not headers.startswith(b"HTTP/1.1 200") or match is None:
                    raise RuntimeError(f"/echo answered {headers[:80]!r}")
                ports.add(_answered(await reader.readexactly(int(match.group(1))), body))
        finally:
            writer.close()
            await writer.wait_closed()

    tasks = [asyncio.ensure_future(worker(requests // concurrency + (i < requests % concurrency)))
             for i in range(concurrency)]
    await asyncio.sleep(0.05)  # the connections open before the clock starts
    t0 = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    return requests / (time.perf_counter() - t0), len(ports)


def run(rounds: int = 20, batch: int = 25, load_rounds: int = 10, concurrency: int = 16, load_requests: int = 1000,
        stacks: tuple[tuple[str, str], ...] = STACKS, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Start one server per stack, measure every cell `rounds` × `batch` times (interleaved), then each
    stack's requests/s under load in `load_rounds` alternating rounds; return ``{"machine", "created",
    "rows", "servers", "nagle", "load", ...}`` as the JSON holds it."""
    body = bodies()
    with contextlib.ExitStack() as stack:
        urls = {s: stack.enter_context(server_process(*s)) for s in stacks}
        clients = Clients(stack, urls)
        cells = clients.cells(list(stacks), body)
        log(f"{len(cells)} cells x {rounds} rounds x {batch} round trips; client loops {list(clients.loops)}, "
            f"clients {clients.kinds}")
        for cell in cells:
            clients.batch(cell, body[cell.body], WARMUP, keep=False)
        before = {s: stats(u) for s, u in urls.items()}
        for r in range(rounds):
            shift = r * len(cells) // rounds  # each round starts elsewhere: no cell always follows the same one
            for cell in cells[shift:] + cells[:shift]:
                clients.batch(cell, body[cell.body], batch)
        after = {s: stats(u) for s, u in urls.items()}
        nagle = nagle_check(urls[stacks[-1]], body["small"])
        aloop = next(iter(clients.loops.values()))  # the fastest loop there is: uvloop first
        load: dict[tuple[tuple[str, str], str], list[tuple[float, int]]] = {(s, b): [] for b in body for s in stacks}
        for r in range(load_rounds):
            for s, b in (list(load) if r % 2 == 0 else list(load)[::-1]):
                load[s, b].append(aloop.run_until_complete(load_rps(urls[s], body[b], concurrency, load_requests)))
    rows = [_summary(c) for c in cells]
    servers = [{"loop": s[0], "parser": s[1], "served_on": {k: after[s][k] for k in ("loop", "parser")},
                "keepalive_s": after[s]["keepalive_s"],
                "connections_accepted_while_measuring":
                    after[s]["connections_accepted"] - before[s]["connections_accepted"] - 1,  # less our /stats
                "requests_while_measuring": sum(r["round_trips"] for r in rows if (r["loop"], r["parser"]) == s)}
               for s in stacks]
    return {"machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": _versions(), "bodies": {k: len(v) for k, v in body.items()}, "answer_bytes": ANSWER_BYTES,
            "rounds": rounds, "batch": batch, "rows": rows, "servers": servers, "nagle": nagle,
            "load": [{"loop": s[0], "parser": s[1], "body": b, "concurrency": concurrency, "requests": load_requests,
                      "rounds": len(v), "median_rps": statistics.median(x[0] for x in v),
                      "min_rps": min(x[0] for x in v), "max_rps": max(x[0] for x in v),
                      "ratio_to": "+".join(stacks[0]),
                      "median_ratio": statistics.median(x[0] / y[0] for x, y in zip(v, load[stacks[0], b])),
                      "connections": max(x[1] for x in v)} for (s, b), v in load.items()]}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("uvicorn", "uvloop", "httptools", "h11", "httpx", "httpcore", "aiohttp", "fastapi", "starlette"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def table(result: dict[str, Any]) -> str:
    """Median µs per client (rows) and server stack (columns), one block per body, p10–p90 beside it."""
    rows = result["rows"]
    stacks = list(dict.fromkeys((r["loop"], r["parser"]) for r in rows))
    lines = []
    for body in dict.fromkeys(r["body"] for r in rows):
        lines.append(f"{body} ({result['bodies'][body]} B)".ljust(28)
                     + "".join(f"{l}+{p}".rjust(26) for l, p in stacks))
        clients = dict.fromkeys((r["client"], r["client_loop"]) for r in rows)
        for client, cloop in clients:
            cells = {(r["loop"], r["parser"]): r for r in rows
                     if (r["body"], r["client"], r["client_loop"]) == (body, client, cloop)}
            name = client + (f" @{cloop}" if cloop else "")
            lines.append(name.ljust(28) + "".join(
                f"{c['median_us']:7.0f} ({c['p10_us']:4.0f}-{c['p90_us']:5.0f}) c{c['connections']}".rjust(26)
                for c in (cells[s] for s in stacks)))
    for r in result["load"]:
        lines.append(f"load {r['body']:6s} {r['loop']}+{r['parser']:10s} {r['median_rps']:6.0f} req/s "
                     f"({r['min_rps']:.0f}-{r['max_rps']:.0f}), x{r['median_ratio']:.2f} {r['ratio_to']} in a round; "
                     f"{r['concurrency']} in flight on {r['connections']} connections")
    nagle = result["nagle"]
    lines.append(f"http.client small POST: {nagle['nodelay_median_us']:.0f} µs with TCP_NODELAY, "
                 f"{nagle['nagle_median_us']:.0f} µs without (connect() sets it here: {nagle['connect_sets_nodelay']})")
    for s in result["servers"]:
        lines.append(f"server {s['loop']}+{s['parser']}: served on {s['served_on']}, "
                     f"{s['requests_while_measuring']} requests, "
                     f"{s['connections_accepted_while_measuring']} connections accepted while measuring")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``epd-lab bench http``."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench http", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    ap.add_argument("--batch", type=int, default=25, help="round trips per cell per round")
    ap.add_argument("--load-rounds", type=int, default=10, help="alternating rounds of the load measurement")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight under load")
    ap.add_argument("--load-requests", type=int, default=1000, help="requests per load measurement")
    ap.add_argument("--serve", nargs=2, metavar=("LOOP", "PARSER"), help=argparse.SUPPRESS)  # a server process
    args = ap.parse_args(argv)
    if args.serve:
        return serve(*args.serve)
    result = run(args.rounds, args.batch, args.load_rounds, args.concurrency, args.load_requests)
    print(table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
