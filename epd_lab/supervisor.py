"""`epd-lab launch` (`main`): start a topology and supervise it while it serves. A role that dies is started
again as it was (`Cluster.restart`: its old port, and a prefill's old KV side channels, so the proxy, the encoders'
receivers and the decodes take it back without being told), with backoff, at most `max_restarts` times within
`window_s`; then it stays down and says why. The topology serves on while its entry point (the proxy, the front, or
the one monolithic server) runs; the proxy passes over a role that is down meanwhile.

Every loss and restart is a JSON line (`emit`): ``{"event": "exited", "process": "prefill1", "returncode": -9}``,
``{"event": "restarted", "process": ..., "url": ..., "down_s": ...}``, ``{"event": "gave_up", "process": ...,
"reason": ...}``.
"""
from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epd_lab.launch import Cluster, RestartRefused, Topology
from epd_lab.serving import from_argv


def print_event(event: dict[str, Any]) -> None:
    """One event as a JSON line on stdout."""
    print(json.dumps(event), flush=True)


@dataclass
class _Watch:
    """What the supervisor knows of one process."""

    down_since: float | None = None
    next_try: float = 0.0
    backoff_s: float = 0.0
    restarts: collections.deque = field(default_factory=collections.deque)  # when each restart began
    given_up: bool = False


class Supervisor:
    """Watches `cluster`'s processes; see the module docstring.

    Args:
        cluster: a started `Cluster` (local processes are restarted; on Ray a lost role is reported, not restarted).
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
        self.restarted = 0

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
            watch.given_up = True
            self.emit({"event": "gave_up", "process": name,
                       "reason": f"{len(watch.restarts)} restarts within {self.window_s:.0f} s"})
            return
        watch.restarts.append(time.monotonic())
        try:
            url = self.cluster.restart(index, len(watch.restarts))
        except RestartRefused as exc:
            watch.given_up = True
            self.emit({"event": "gave_up", "process": name, "reason": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001 - this start failed: tried again after the backoff
            watch.next_try = time.monotonic() + self._backoff(watch, time.monotonic())
            self.emit({"event": "restart_failed", "process": name, "reason": str(exc).splitlines()[0]})
            return
        self.restarted += 1
        self.emit({"event": "restarted", "process": name, "url": url,
                   "down_s": round(time.monotonic() - (watch.down_since or 0.0), 3)})
        watch.down_since = None


def main(argv: list[str] | None = None) -> int:
    """``epd-lab launch``: start a topology, print its URLs and logs as JSON, then serve until Ctrl-C, restarting
    roles that die (`Supervisor`); exit 1 when the topology's entry point is down for good."""
    topo = from_argv(Topology, argv, "epd-lab launch", main.__doc__)
    with Cluster(topo) as cluster:
        print(json.dumps({"encoders": cluster.encoder_urls, "prefills": cluster.prefill_urls,
                          "store_master": cluster.store_master.address if cluster.store_master else topo.store_master,
                          "decodes": cluster.decode_urls, "monolithic": cluster.monolithic_urls,
                          "proxy": cluster.proxy_url, "backend": topo.backend,
                          "logs": [str(p) for p in cluster.logs]}), flush=True)
        supervisor = Supervisor(cluster, max_restarts=topo.restarts)
        try:
            while supervisor.check():
                time.sleep(0.5)
            print("the topology's entry point is down and cannot be started again; stopping the cluster",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
