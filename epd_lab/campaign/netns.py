"""Emulated hosts on one machine: a Linux bridge in this network namespace and one network namespace per
"host", joined to the bridge by a veth pair, all in one /24 (this namespace is .1 on the bridge). A process
started with ``ip netns exec <ns>`` and bound to its host's address reaches the others only over its veth:
`cut` takes that link down (a pulled cable, mid-transfer if timed so), `restore` brings it back, `rate_mbit`
shapes what each host receives with ``tc qdisc ... tbf``, and `shape` what one host sends (its uplink) or receives
(its downlink), set and changed while it runs: a rate sweep needs no restart. This kernel has no ``netem``: no
delay or loss emulation.
`ray_nodes` runs a Ray cluster on such hosts, a node per namespace (`epd_lab.launch_ray`, docs/ray.md).

Needs root (CAP_NET_ADMIN); `available()` says whether ``ip netns add`` works here.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and why not when they cannot."""
    name = f"epd-probe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return False, f"ip netns add failed: {err.decode(errors='replace').strip() or exc}"
    _ip("netns", "del", name)
    return True, ""


class Hosts:
    """`names` as emulated hosts (a namespace each) on a fresh bridge; a context manager that removes all of
    it. `address(name)` is a host's address, `root` this namespace's address on the bridge."""

    def __init__(self, names: list[str], rate_mbit: float | None = None) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(0, 256)}"
        self.bridge = f"epdbr{self.tag}"
        self.root = f"{self.subnet}.1"
        self.names = list(names)
        self._made: list[str] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                ns, veth = self.netns(name), self.veth(name)
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if rate_mbit:
                    subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate_mbit}mbit",
                                    "burst", "256kb", "latency", "50ms"], check=True, capture_output=True, timeout=10)
        except BaseException:
            self.close()
            raise

    def netns(self, name: str) -> str:
        return f"epd-{self.tag}-{name}"

    def veth(self, name: str) -> str:
        return f"ev{self.tag}{self.names.index(name)}"  # at most 15 characters

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 2}"

    def shape(self, name: str, rate_mbit: float | None, burst_bytes: int = 4096, downlink: bool = False) -> None:
        """Limit what host `name` sends to `rate_mbit` (tbf on its own end of the link, in its namespace), or with
        `downlink` what it receives (tbf on the bridge's end), or lift that limit (None). A small `burst_bytes`
        keeps a transfer's time near bytes / rate: tbf lets a whole burst through at line rate (it must hold one
        full frame, 1514 bytes)."""
        where = ["tc", "qdisc"] if downlink else ["ip", "netns", "exec", self.netns(name), "tc", "qdisc"]
        dev = self.veth(name) if downlink else "eth0"
        if rate_mbit is None:
            subprocess.run([*where, "del", "dev", dev, "root"], capture_output=True, timeout=10)  # none: fine
            return
        subprocess.run([*where, "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst",
                        str(burst_bytes), "latency", "200ms"], check=True, capture_output=True, timeout=10)

    def cut(self, name: str) -> None:
        """Take `name`'s link down: nothing reaches or leaves that host until `restore`."""
        _ip("link", "set", self.veth(name), "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.veth(name), "up")

    def kill_processes(self, *names: str) -> None:
        """SIGKILL every process in the namespaces of hosts `names` (default: all; all of them this workbench's:
        the namespaces are made here), as a host that loses power, and wait until the kernel has let them go."""
        for name in names or self.names:
            pids = subprocess.run(["ip", "netns", "pids", self.netns(name)], capture_output=True, text=True,
                                  timeout=10).stdout.split()
            for pid in map(int, pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # a namespace goes once its last process is reaped

    def close(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made = []
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# what a test or a campaign sets for the GCS: a lost node found within ~3 s, where Ray's defaults take ~30
RAY_FAST_HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def ray_token_environment(token_path: str | os.PathLike) -> dict[str, str]:
    """The environment a Ray process (``ray start``, a driver) needs where the cluster runs with Ray's token
    authentication: the mode and the 0600 file that holds the token, never the token itself on a command line."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def ray_start(hosts: Hosts, name: str, head: str, num_cpus: float = 1, object_store_bytes: int = 80 << 20,
              env: dict[str, str] | None = None) -> None:
    """``ray start`` of one node inside host `name`'s namespace, with its own address and a custom resource
    ``host_<name>`` (8 units) to pin work to it; the head when `name` is the first host (`head`: its
    ``address:port``), else a worker joining `head`. `env` is added to the environment (`ray_token_environment`,
    `RAY_FAST_HEALTH_CHECKS`). A host killed with `Hosts.kill_processes` joins again with this."""
    ray = str(Path(sys.executable).with_name("ray"))
    port = head.rsplit(":", 1)[1]
    join = ["--head", "--port", port, "--include-dashboard=false"] if name == hosts.names[0] else ["--address", head]
    started = subprocess.run(
        ["ip", "netns", "exec", hosts.netns(name), ray, "start", "--num-cpus", str(num_cpus),
         "--object-store-memory", str(object_store_bytes), "--disable-usage-stats",
         "--node-ip-address", hosts.address(name), "--resources", json.dumps({f"host_{name}": 8}), *join],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    if started.returncode:
        raise RuntimeError(f"ray start on host {name} failed:\n{started.stderr[-2000:]}")


@contextlib.contextmanager
def ray_nodes(hosts: Hosts, num_cpus: float = 1, object_store_bytes: int = 80 << 20, port: int = 6379,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """A Ray cluster on emulated hosts: `ray_start` inside each host's namespace, the first host the head (no
    dashboard). Yields the head's address; at exit kills every process in the namespaces (Ray's daemons and
    workers). A Ray driver must run on a node: run it with ``ip netns exec`` in one of the namespaces (with the
    same `env` where it holds Ray's token settings)."""
    head = f"{hosts.address(hosts.names[0])}:{port}"
    try:
        for name in hosts.names:
            ray_start(hosts, name, head, num_cpus, object_store_bytes, env)
        yield head
    finally:
        hosts.kill_processes()
