"""`epd-lab launch` (`main`): start a topology and supervise it while it serves. A role that dies is started
again as it was (`Cluster.restart`: its old port, and a prefill's old KV side channels, so the proxy, the encoders'
receivers and the decodes take it back without being told), with backoff, at most `max_restarts` times within
`window_s`; then it stays down and says why. The topology serves on while its entry point (the proxy, the front, or
the one monolithic server) runs; the proxy passes over a role that is down meanwhile.

On Ray a role whose node is lost comes back on a surviving node that satisfies its options; where roles bind
their node's address (``ray_bind="node"``) it can come back only at its old address, and waits (``waiting``)
until a node of that address returns; the entry point that cannot come back ends `launch`, non-zero.

Every loss and restart is a JSON line (`emit`): ``{"event": "exited", "process": "prefill1", "returncode": -9}``,
``{"event": "restarted", "process": ..., "url": ..., "node": ..., "down_s": ...}``, ``{"event": "waiting",
"process": ..., "reason": ...}``, ``{"event": "gave_up", "process": ..., "reason": ...}``. `StatusServer` serves
the same state as ``GET /status`` (JSON) and ``GET /metrics`` (Prometheus), which ``epd-lab status URL`` reads.
"""
from __future__ import annotations

import argparse
import collections
import http.server
import json
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epd_lab import security
from epd_lab.launch import Cluster, RestartDeferred, RestartRefused, Topology
from epd_lab.serving import from_argv
from epd_lab.serving import prometheus_config as prometheus


def print_event(event: dict[str, Any], stream: Any = None) -> None:
    """One event as a JSON line on `stream` (default: stdout)."""
    print(json.dumps(event), file=stream or sys.stdout, flush=True)


@dataclass
class _Watch:
    """What the supervisor knows of one process."""

    down_since: float | None = None
    next_try: float = 0.0
    backoff_s: float = 0.0
    restarts: collections.deque = field(default_factory=collections.deque)  # when each restart began
    given_up: bool = False
    restarted: int = 0  # restarts that brought it back, over the cluster's life
    reason: str = ""  # why it waits, or why it stays down


class Supervisor:
    """Watches `cluster`'s processes; see the module docstring.

    Args:
        cluster: a started `Cluster` (`Cluster.restart` starts a process again, locally or on Ray).
        max_restarts: restarts of one process within `window_s` seconds before it stays down.
        window_s: the window of `max_restarts`.
        first_backoff_s: the wait before a process's first restart; each restart within the window doubles it.
        emit: where events go (default: JSON lines on stdout).
    """

    def __init__(self, cluster: Any, max_restarts: int = 3, window_s: float = 60.0, first_backoff_s: float = 0.5,
                 emit: Callable[[dict[str, Any]], None] = print_event) -> None:
        self.cluster, self.max_restarts, self.window_s = cluster, max_restarts, window_s
        self.first_backoff_s, self.emit = first_backoff_s, emit
        self.watches = [_Watch() for _ in cluster.procs]
        entry = cluster.proxy_url
        self.entry = cluster.proc_urls.index(entry) if entry in cluster.proc_urls else None
        self.last: list[dict[str, Any]] = self._rows(cluster.alive())  # the state at the last `check`

    def check(self) -> bool:
        """One look at every process: note the ones that died, restart those whose backoff passed. Returns whether
        the topology can still serve: its entry point runs (or, without one, some process does)."""
        now = time.monotonic()
        alive = self.cluster.alive()
        for index, (up, watch) in enumerate(zip(alive, self.watches)):
            name = self.cluster.specs[index][0]
            if up or watch.given_up:
                continue
            if watch.down_since is None:
                watch.down_since, watch.next_try = now, now + self._backoff(watch, now)
                self.emit({"event": "exited", "process": name,
                           "returncode": self.cluster.procs[index].poll()})
            if now >= watch.next_try:
                self._restart(index, name, watch)
        alive = self.cluster.alive()
        self.last = self._rows(alive)
        if self.entry is not None:
            return alive[self.entry]
        return any(alive)

    def _backoff(self, watch: _Watch, now: float) -> float:
        while watch.restarts and now - watch.restarts[0] > self.window_s:
            watch.restarts.popleft()
        watch.backoff_s = self.first_backoff_s * 2 ** len(watch.restarts)
        return watch.backoff_s

    def _restart(self, index: int, name: str, watch: _Watch) -> None:
        if len(watch.restarts) >= self.max_restarts:
            watch.given_up, watch.reason = True, f"{len(watch.restarts)} restarts within {self.window_s:.0f} s"
            self.emit({"event": "gave_up", "process": name, "reason": watch.reason})
            return
        watch.restarts.append(time.monotonic())
        try:
            url = self.cluster.restart(index, len(watch.restarts))
        except RestartDeferred as exc:
            watch.restarts.pop()  # not a try: the budget is for starts that failed
            if index == self.entry:  # clients know it by its address: nothing serves until it is back
                watch.given_up, watch.reason = True, str(exc)
                self.emit({"event": "gave_up", "process": name, "reason": str(exc)})
                return
            watch.next_try = time.monotonic() + max(watch.backoff_s, self.first_backoff_s)
            if watch.reason != str(exc):
                self.emit({"event": "waiting", "process": name, "reason": str(exc)})
            watch.reason = str(exc)
            return
        except RestartRefused as exc:
            watch.given_up, watch.reason = True, str(exc)
            self.emit({"event": "gave_up", "process": name, "reason": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001 - this start failed: tried again after the backoff
            watch.next_try = time.monotonic() + self._backoff(watch, time.monotonic())
            self.emit({"event": "restart_failed", "process": name, "reason": str(exc).splitlines()[0]})
            return
        watch.restarted += 1
        self.emit({"event": "restarted", "process": name, "url": url, "node": self.cluster.node_of(index),
                   "down_s": round(time.monotonic() - (watch.down_since or 0.0), 3)})
        watch.down_since, watch.reason = None, ""

    def _rows(self, alive: list[bool]) -> list[dict[str, Any]]:
        """Per process: name, role, url, node, state (up, down, waiting or gave_up), restarts and reason."""
        rows = []
        for index, (watch, up) in enumerate(zip(self.watches, alive)):
            name, role, _ = self.cluster.specs[index]
            state = ("up" if up else "gave_up" if watch.given_up else "waiting" if watch.reason else "down")
            rows.append({"process": name, "role": role, "url": self.cluster.proc_urls[index],
                         "node": self.cluster.node_of(index), "state": state, "restarts": watch.restarted,
                         "reason": watch.reason})
        return rows


class _Collector:
    """The supervisor's state as Prometheus families, read at each scrape."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("epd_lab:process_up", "1 while the process runs, 0 while it is down",
                               labels=["process", "role", "node"])
        restarts = CounterMetricFamily("epd_lab:process_restarts", "restarts that brought the process back",
                                       labels=["process", "role"])
        for row in self.supervisor.last:
            up.add_metric([row["process"], row["role"], row["node"]], float(row["state"] == "up"))
            restarts.add_metric([row["process"], row["role"]], row["restarts"])
        yield up
        yield restarts


class StatusServer:
    """``GET /status`` (the supervisor's `Supervisor.last` as JSON), ``GET /metrics`` (the same as Prometheus
    families: ``epd_lab:process_up``, ``epd_lab:process_restarts_total``) and ``GET /health``, on 127.0.0.1 in a
    thread; with a shared secret, every route but /health needs its bearer token, as the roles' do. A context
    manager."""

    def __init__(self, supervisor: Supervisor, port: int = 0, secret: bytes | None = None) -> None:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_Collector(supervisor))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/health" and secret is not None and not security.check_bearer(
                        secret, self.headers.get("Authorization")):
                    return self._send(401, "text/plain", b"missing or wrong bearer token\n")
                if self.path == "/status":
                    return self._send(200, "application/json", json.dumps(supervisor.last).encode())
                if self.path == "/metrics":
                    return self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                if self.path == "/health":
                    return self._send(200, "text/plain", b"ok\n")
                self._send(404, "text/plain", b"not found\n")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # the launch log is JSON lines: no access log in it
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="epd-status", daemon=True).start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "StatusServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``epd-lab launch``: start a topology, print its URLs, each process's node and logs as JSON, then serve until
    Ctrl-C, restarting roles that die (`Supervisor`; its state at ``status`` URL: `StatusServer`); exit 1 when the
    topology's entry point is down for good."""
    prometheus_config, argv = prometheus.pop_flag(argv)
    topo = from_argv(Topology, argv, "epd-lab launch", f"{main.__doc__} {prometheus.FLAG} FILE: {prometheus.FLAG_HELP}")
    # stdout carries JSON lines only: what else would print there (Ray's driver prints a lost node's notice) goes
    # to stderr
    events, sys.stdout = sys.stdout, sys.stderr
    try:
        return _serve(topo, prometheus_config, events)
    finally:
        sys.stdout = events


def _serve(topo: Topology, prometheus_config: Path | None, events: Any) -> int:
    with Cluster(topo) as cluster:
        if prometheus_config is not None:
            prometheus.write_launch_config(prometheus_config, cluster, security.resolve(topo.secret))
        supervisor = Supervisor(cluster, max_restarts=topo.restarts, emit=lambda e: print_event(e, events))
        secret = topo.secret.encode() if topo.secret is not None else security.load_secret()
        with StatusServer(supervisor, topo.status_port, secret) as status:
            print_event({"encoders": cluster.encoder_urls, "prefills": cluster.prefill_urls,
                         "store_master": (cluster.store_master.address if cluster.store_master else
                                          topo.store_master),
                         "decodes": cluster.decode_urls, "monolithic": cluster.monolithic_urls,
                         "proxy": cluster.proxy_url, "backend": topo.backend, "status": status.url,
                         "nodes": {row["process"]: row["node"] for row in supervisor.last},
                         "logs": [str(p) for p in cluster.logs]}, events)
            try:
                while supervisor.check():
                    time.sleep(0.5)
                entry = supervisor.watches[supervisor.entry].reason if supervisor.entry is not None else ""
                print(f"the topology's entry point is down and cannot be started again ({entry or 'no process runs'}"
                      f"); stopping the cluster", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                return 0


def status_main(argv: list[str] | None = None) -> int:
    """``epd-lab status URL``: the processes of the topology a running ``epd-lab launch`` supervises (its
    ``status`` URL, printed in its first line), one a line: process, role, state, node, restarts, URL, reason.
    Exit 1 when a process is not up."""
    ap = argparse.ArgumentParser(prog="epd-lab status", description=status_main.__doc__, allow_abbrev=False)
    ap.add_argument("url", help="the status URL `epd-lab launch` printed (http://127.0.0.1:PORT)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    answer = httpx.get(args.url.rstrip("/") + "/status", headers=security.bearer_header(security.load_secret()),
                       timeout=10.0)
    if answer.status_code == 401:
        raise SystemExit(f"{args.url} asks for the shared secret: set EPD_SECRET or EPD_SECRET_FILE as launch has")
    answer.raise_for_status()
    rows = answer.json()
    if args.json:
        print(json.dumps(rows))
    else:
        columns = ("process", "role", "state", "node", "restarts", "url", "reason")
        table = [columns, *([str(r[c]) for c in columns] for r in rows)]
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        for line in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return int(any(r["state"] != "up" for r in rows))
