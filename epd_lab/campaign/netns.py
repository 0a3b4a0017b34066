"""Emulated hosts on one machine: a Linux bridge in this network namespace and one network namespace per
"host", joined to the bridge by a veth pair, all in one /24 (this namespace is .1 on the bridge). A process
started with ``ip netns exec <ns>`` and bound to its host's address reaches the others only over its veth:
`cut` takes that link down (a pulled cable, mid-transfer if timed so), `restore` brings it back, and `rate_mbit`
shapes each link with ``tc qdisc ... tbf`` (this kernel has no ``netem``: no delay or loss emulation).

Needs root (CAP_NET_ADMIN); `available()` says whether ``ip netns add`` works here.
"""
from __future__ import annotations

import random
import subprocess
import uuid


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

    def cut(self, name: str) -> None:
        """Take `name`'s link down: nothing reaches or leaves that host until `restore`."""
        _ip("link", "set", self.veth(name), "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.veth(name), "up")

    def close(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made = []
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
