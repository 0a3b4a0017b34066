"""Start a topology of real processes on this host and tear it down without leaving any behind.

    with Cluster(Topology(encoders=2, backend="mooncake")) as cluster:
        with cluster.receiver() as receiver:
            got = receiver.receive(["photo.png"])

Each role is a plain process with a CLI (`python -m epd_lab.servers.encoder ...`), started with port 0:
it prints one JSON line with its URL once it serves, and the cluster then waits for its /health. Its command
line is its settings dataclass written back (`epd_lab.serving.to_argv`): the `Topology` fills the shared
options, ``Topology(settings={"decode": {"max_batch": 4}})`` any other one of a role, and a process name's entry
(``{"encoder1": {"device": "cuda:1"}}``, names from `Topology.process_names`) one of that process, over its role's.
``Topology(monolithic=True, replicas=2)`` starts two monolithic servers behind a round-robin front
(`epd_lab.servers.front`), whose URL is `Cluster.proxy_url`.
Every process's output goes to a log file kept by the cluster (`cluster.logs`).

``Topology(placement="ray")`` (or ``ray_address=``, ``epd-lab launch --ray ADDRESS``) starts the same command
lines on a Ray cluster's nodes instead, each owned by an actor (`epd_lab.launch_ray`, docs/ray.md); Ray is
imported only then.
"""
from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
import urllib.parse
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import httpx

from epd_lab import procs, security
from epd_lab.servers.encoder import EncoderSettings
from epd_lab.ep.messages import BACKENDS
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.ep.store import MooncakeMaster
from epd_lab.launch_ray import RaySettings
from epd_lab.servers.decode import DecodeSettings
from epd_lab.servers.front import FrontSettings
from epd_lab.servers.monolithic import MonolithicSettings
from epd_lab.servers.prefill import PrefillSettings
from epd_lab.servers.proxy import ProxySettings
from epd_lab.serving import option, to_argv
from epd_lab.servers.model_settings import (DEVICE_HELP, DTYPE_HELP, DTYPE_NAMES, MODEL_HELP, RUNTIME_HELP,
                                           RUNTIME_NAMES, transport_option)
from epd_lab.trace import Recorder, Span, collect

if TYPE_CHECKING:
    import pandas as pd

_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()

PLACEMENTS = ("local", "ray")
# each role: the module its process runs, the settings its command line is written from, and the `Topology`
# options it takes (the proxy's `model` is the id it lists, not the model directory)
ROLES: dict[str, tuple[str, type, tuple[str, ...]]] = {
    "encoder": ("epd_lab.servers.encoder", EncoderSettings,
                ("model", "device", "dtype", "runtime", "timeout", "transport", "backend", "media_roots", "tp",
                 "mm_global_cache")),
    "prefill": ("epd_lab.servers.prefill", PrefillSettings,
                ("model", "device", "dtype", "runtime", "timeout", "transport", "backend", "kv_blocks", "tp")),
    "decode": ("epd_lab.servers.decode", DecodeSettings,
               ("model", "device", "dtype", "runtime", "timeout", "transport", "kv_blocks")),
    "proxy": ("epd_lab.servers.proxy", ProxySettings, ("timeout", "pipelined")),
    "monolithic": ("epd_lab.servers.monolithic", MonolithicSettings,
                   ("model", "device", "dtype", "runtime", "timeout", "kv_blocks", "media_roots")),
    "front": ("epd_lab.servers.front", FrontSettings, ("timeout",)),
}


def role_of(process: str) -> str:
    """The role of a process name: ``prefill1`` → ``prefill``, ``front`` → ``front``."""
    return process.rstrip("0123456789")


@dataclass(slots=True)
class Topology(RaySettings):
    """What to start: how many processes of each role, and the options they share. ``settings`` sets any
    other option of a role's settings (`EncoderSettings`, `PrefillSettings`, `DecodeSettings`, `ProxySettings`,
    `MonolithicSettings`, `FrontSettings`), by role name, or of one process by its name (`process_names`:
    ``{"monolithic1": {"device": "cuda:1"}}``), which wins over its role's; a name that is neither, or an option
    the role does not have, is refused here."""

    encoders: int = option(1, "encode servers")
    backend: str = option("mooncake", "the E→P backend", choices=BACKENDS)
    transport: str = transport_option("every role's engines")
    model: str | None = option(None, MODEL_HELP)
    device: str = option("cpu", DEVICE_HELP + " (every model role; one role's own: settings={'prefill': "
                                "{'device': 'cuda:1'}})")
    dtype: str = option("auto", DTYPE_HELP + " (each role's own device decides)", choices=DTYPE_NAMES)
    runtime: str = option("fast", RUNTIME_HELP, choices=RUNTIME_NAMES)
    timeout: float = option(10.0, "seconds for a request (and for each process to come up, times 6)")
    pool_bytes: int = option(0, "the in-driver receiver's persistent pool (0: a buffer per request, as the seed)")
    prefills: int = option(0, "prefill servers, each fanning images out to all encoders (0: the prefill role "
                              "stays in the driver, `Cluster.receiver`)")
    decodes: int = option(0, "decode servers")
    proxy: bool = option(False, "start the OpenAI-compatible proxy in front of the prefills and decodes")
    pipelined: bool = option(False, "the proxy asks decode while prefill runs (streamed requests); off: after "
                                    "prefill answered, which gave the lower TTFT on 2 vCPUs "
                                    "(docs/serving-bench.md, bench e2e)")
    monolithic: bool = option(False, "one process serving the whole model behind OpenAI's API (per replica), the "
                                     "floor E→P→D is measured against (`cluster.proxy_url`); no encoder, prefill, "
                                     "decode or proxy")
    replicas: int = option(1, "monolithic servers (with --monolithic); more than one: behind a round-robin front "
                              "(epd_lab.servers.front) whose URL is the cluster's proxy_url; one per GPU: "
                              "--settings 'monolithic1={\"device\": \"cuda:1\"}'")
    kv_blocks: int = option(512, "KV-cache blocks per prefill and decode server")
    mm_global_cache: bool = option(False, "the encoders' global embedding cache (L2 host pool, L3 Mooncake Store "
                                          "shared by all encoders): the cluster starts a mooncake_master for it "
                                          "unless --store-master names one")
    store_master: str | None = option(None, "HOST:PORT of a mooncake_master already running, for "
                                            "--mm-global-cache (none: the cluster starts its own)")
    restarts: int = option(3, "epd-lab launch: times a dead role is started again within a minute, with backoff, "
                              "on its old port and KV side channels; then it stays down (0: never)")
    status_port: int = option(0, "epd-lab launch: the port of its /status and /metrics (127.0.0.1; 0: the OS picks; "
                                 "the URL is in its first line; epd-lab status URL reads it)")
    tp: int = option(1, "tensor-parallel ranks of every encoder and prefill, each rank a process its server starts "
                        "(on its node: on Ray, its actor's); prefill i is DP rank i (its side channels' ports)")
    trace: bool = option(True, "record spans in every process (EPD_TRACE=0 in their environment when off)")
    media_roots: tuple[str, ...] = option((tempfile.gettempdir(),), "folders whose files the encoders serve as "
                                          "media items: the workbench writes its images to the temp folder; () "
                                          "for none")
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata={"help": (
        "options of a role's settings, or of one process's (its name wins), as KEY=JSON, repeated: e.g. --settings "
        "'decode={\"max_batch\": 4}' --settings 'encoder1={\"device\": \"cuda:1\"}'")})
    # the shared secret (`epd_lab.security`), handed to every process as EPD_SECRET in its environment, never on a
    # command line; None: each process inherits EPD_SECRET / EPD_SECRET_FILE from this one's environment, if set
    secret: str | None = field(default=None, repr=False, metadata={"cli": False})
    # emulated hosts (`epd_lab.campaign.netns`): process name ("decode0") -> (network namespace, "" for this
    # one; the address it binds); a process not named binds 127.0.0.1 here
    hosts: Mapping[str, tuple[str, str]] = field(default_factory=dict, metadata={"cli": False})
    placement: str = option("local", "where the processes run: local (children of this one) or ray (each owned by "
                                     "a Ray actor on a node of a Ray cluster; docs/ray.md)", choices=PLACEMENTS)
    def __post_init__(self) -> None:
        if self.encoders < 1:
            raise ValueError(f"encoders must be >= 1, got {self.encoders}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")
        if self.secret is not None:
            security.check_secret(self.secret)
        if self.prefills < 0 or self.decodes < 0:
            raise ValueError("prefills and decodes must be >= 0")
        if self.monolithic and (self.prefills or self.decodes or self.proxy):
            raise ValueError("a monolithic topology starts monolithic servers only: no prefills, decodes or proxy")
        if self.store_master is not None and not self.mm_global_cache:
            raise ValueError("store_master is the global embedding cache's: set mm_global_cache too")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {self.restarts}")
        if not 0 <= self.status_port < 65536:
            raise ValueError(f"status_port must be a port (0: the OS picks), got {self.status_port}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.replicas > 1 and not self.monolithic:
            raise ValueError("replicas are of the monolithic server: set monolithic=True")
        if self.proxy and not (self.prefills and self.decodes):
            raise ValueError("the proxy needs at least one prefill and one decode server")
        if self.ray_address:
            self.placement = "ray"
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.placement == "ray" and self.monolithic:
            raise ValueError("the monolithic floor runs locally (placement='local'); Ray places split topologies")
        if self.placement == "ray" and self.hosts:
            raise ValueError("hosts (network namespaces) are for placement='local'; Ray places by its nodes")
        RaySettings.__post_init__(self)
        processes = self.process_names()
        for key, values in self.settings.items():
            if key not in ROLES and key not in processes:
                raise ValueError(f"settings for unknown role or process {key!r}; roles: {', '.join(ROLES)}; "
                                 f"this topology's processes: {', '.join(processes)}")
            role = key if key in ROLES else role_of(key)
            names = {f.name for f in fields(ROLES[role][1])}
            unknown = set(values) - names
            if unknown:
                raise ValueError(f"{role} has no setting {', '.join(sorted(unknown))}; "
                                 f"it has {', '.join(sorted(names))}")

    def process_names(self) -> list[str]:
        """The processes this topology starts, in start order: ``encoder0``…, ``prefill0``…, ``decode0``…,
        ``proxy``; monolithic: ``monolithic``, or ``monolithic0``… and ``front`` for several replicas."""
        if self.monolithic:
            if self.replicas == 1:
                return ["monolithic"]
            return [*(f"monolithic{i}" for i in range(self.replicas)), "front"]
        return [*(f"encoder{i}" for i in range(self.encoders)), *(f"prefill{i}" for i in range(self.prefills)),
                *(f"decode{i}" for i in range(self.decodes)), *(["proxy"] if self.proxy else [])]

    def role_settings(self, role: str, process: str | None = None, **wiring: Any) -> Any:
        """The settings a `role` process starts with: this topology's shared options, the `wiring` the cluster
        knows once earlier roles run (URLs), ``settings[role]``, then ``settings[process]`` (that process's own).
        `ValueError` when the role refuses them."""
        _, cls, shared = ROLES[role]
        values = {name: getattr(self, name) for name in shared}
        own = self.settings.get(process, {}) if process is not None and process != role else {}
        # one construction, not the shared settings then a replace: dtype "auto" resolves on the role's own device
        return cls(**{**values, **wiring, **self.settings.get(role, {}), **own})


class RestartRefused(RuntimeError):
    """A role that cannot be started again as it was (`Cluster.restart`)."""


class RestartDeferred(RestartRefused):
    """A role that can come back only where it was, and that place is not there now: on Ray, no alive node has the
    address its peers know it by (`Cluster.restart`); another try may find the node returned."""


class Cluster:
    """The running processes of a `Topology`; a context manager. `close()` kills them all (and, on Ray, their
    actors and placement group)."""

    def __init__(self, topology: Topology, log_dir: str | None = None) -> None:
        self.topology = topology
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="epd-lab-"))
        # local: subprocess.Popen; on Ray: `launch_ray.RayProcess`, the same shape (pid, poll, kill, wait)
        self.procs: list[Any] = []
        self.logs: list[Path] = []
        self.encoder_urls: list[str] = []
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.monolithic_urls: list[str] = []
        self.proxy_url: str | None = None  # the one URL clients call: proxy, front, or the one monolithic server
        # per process, in `procs` order: its name, role, wiring and URL, so that `restart` starts it again as it was
        self.specs: list[tuple[str, str, dict[str, Any]]] = []
        self.proc_urls: list[str] = []
        self.proc_logs: list[Path] = []  # each process's current log (`logs` also keeps those of the ones replaced)
        self.side_channels: dict[str, list[str]] = {}  # a prefill's KV side channels, by process name
        self._ray: Any = None  # launch_ray.RayRoles
        self.store_master: MooncakeMaster | None = None  # the global cache's master, when this cluster started it
        _LIVE.add(self)
        try:
            if topology.placement == "ray":
                from epd_lab.launch_ray.actors import RayRoles  # Ray is imported only here

                self._ray = RayRoles(topology, self.process_names())
            if topology.monolithic:
                names = self.process_names()
                for name in names[:topology.replicas]:
                    self.monolithic_urls.append(self._start(name, "monolithic"))
                self.proxy_url = (self.monolithic_urls[0] if topology.replicas == 1 else
                                  self._start("front", "front", replicas=tuple(self.monolithic_urls)))
                for url in self.urls():
                    self._wait_healthy(url)
                return
            store = self._store_wiring()
            for i in range(topology.encoders):
                self.encoder_urls.append(self._start(f"encoder{i}", "encoder", **store))
            for i in range(topology.prefills):
                self.prefill_urls.append(self._start(f"prefill{i}", "prefill", encoders=tuple(self.encoder_urls),
                                                     dp_rank=i))
            # decode asks only the side channels of this cluster's prefills (their /health names them, to the token)
            auth = security.bearer_header(security.resolve(topology.secret))
            for i, url in enumerate(self.prefill_urls):
                self.side_channels[f"prefill{i}"] = httpx.get(url + "/health", headers=auth,
                                                              timeout=topology.timeout).json()["kv_urls"]
            kv_producers = tuple(u for urls in self.side_channels.values() for u in urls)
            for i in range(topology.decodes):
                self.decode_urls.append(self._start(f"decode{i}", "decode", kv_producers=kv_producers))
            if topology.proxy:
                self.proxy_url = self._start("proxy", "proxy", prefills=tuple(self.prefill_urls),
                                             decodes=tuple(self.decode_urls))
            for url in self.urls():
                self._wait_healthy(url)
        except BaseException:
            self.close()
            raise

    def _store_wiring(self) -> dict[str, str]:
        """The encoders' ``store_master``: the topology's, else a master this cluster starts (on this host: on
        Ray with ``ray_bind="node"``, on this node's address, which the other nodes reach)."""
        t = self.topology
        if not t.mm_global_cache:
            return {}
        if t.store_master is None:
            host = "127.0.0.1"
            if self._ray is not None and t.ray_bind == "node":
                import ray  # placement ray: imported already

                host = ray.util.get_node_ip_address()
            self.store_master = MooncakeMaster(host, log=self.log_dir / "mooncake_master.log")
        return {"store_master": t.store_master or self.store_master.address}

    def process_names(self) -> list[str]:
        """The processes this topology starts, in `procs` order (`Topology.process_names`)."""
        return self.topology.process_names()

    def command(self, role: str, process: str | None = None, **wiring: Any) -> list[str]:
        """The command line a `role` process of this cluster (`process`: its name, for its own settings) starts
        with (port 0: the OS picks)."""
        module = ROLES[role][0]
        return [sys.executable, "-m", module, *to_argv(self.topology.role_settings(role, process, **wiring))]

    def urls(self) -> list[str]:
        """Every server's base URL, in `procs` order: encoders, prefills, decodes, proxy; or monolithic servers
        and their front."""
        # one monolithic server is its own proxy_url: listed once
        front = [self.proxy_url] if self.proxy_url and self.proxy_url not in self.monolithic_urls else []
        return [*self.encoder_urls, *self.prefill_urls, *self.decode_urls, *self.monolithic_urls, *front]

    def _start(self, name: str, role: str, **wiring: Any) -> str:
        self.specs.append((name, role, wiring))
        self.proc_urls.append("")
        url = self._spawn(len(self.specs) - 1, self.log_dir / f"{name}.log", wiring)
        self.proc_urls[-1] = url
        return url

    def _spawn(self, index: int, log: Path, wiring: dict[str, Any], node_address: str | None = None) -> str:
        """Start process `index` of `specs` with `wiring`, as `procs[index]` (appended the first time); its URL.
        On Ray, `node_address` pins it to the alive node of that address."""
        name, role, _ = self.specs[index]
        self.logs.append(log)
        timeout = 6 * self.topology.timeout
        trace = {"EPD_TRACE": "1" if self.topology.trace else "0"}
        if self._ray is not None:
            device = getattr(self.topology.role_settings(role, name, **wiring), "device", "cpu")
            proc = self._ray.spawn(name, role, self.command(role, name, **wiring), trace, device, node_address)
            self._place(index, proc, log)
            return proc.await_url(timeout)
        netns, host = self.topology.hosts.get(name, ("", None))
        cmd = self.command(role, name, **wiring, **({"host": host} if host else {}))
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = procs.spawn(cmd, log, {**self._environment(), **trace})
        self._place(index, proc, log)
        return procs.await_url(proc, name, log, timeout)

    def _place(self, index: int, proc: Any, log: Path) -> None:
        if index < len(self.procs):
            self.procs[index], self.proc_logs[index] = proc, log
        else:
            self.procs.append(proc)
            self.proc_logs.append(log)

    def node_of(self, index: int) -> str:
        """Where process `index` runs: its Ray node's address, its emulated host's, or ``local``."""
        proc = self.procs[index]
        if self._ray is not None:
            return proc.node_address or "(placing)"
        return self.topology.hosts.get(self.specs[index][0], ("", "local"))[1]

    def restart(self, index: int, attempt: int) -> str:
        """Start process `index` again as it was: the same wiring, its old port, and for a prefill its old KV
        side channels (the decodes accept KV only from those), so that its peers take it back untold; waits for its
        /health. On Ray, a new actor on a node that satisfies the role's options; where roles bind their node's
        address (``ray_bind="node"``), a node of the old address only: `RestartDeferred` while none is alive.
        Returns its URL; `RestartRefused` when it cannot come back as it was, another error when this start
        failed."""
        name, role, wiring = self.specs[index]
        old = urllib.parse.urlsplit(self.proc_urls[index])
        again = {**wiring, "port": old.port}
        if role == "prefill":
            again["side_channel_base"] = _side_channel_base(self.side_channels[name], wiring.get("dp_rank", 0))
        node_address = None
        if self._ray is not None:
            self.procs[index].kill()  # its actor, if it still answers: a role is never run twice
            if self.topology.ray_bind == "node":
                node_address = old.hostname
                if not self._ray.node_alive(node_address):
                    raise RestartDeferred(f"no Ray node at {node_address} is alive, and {name} can come back only "
                                          f"at its address {self.proc_urls[index]} (its peers know it by it)")
        elif self.procs[index].poll() is None:
            procs.stop_all([self.procs[index]])
        url = self._spawn(index, self.log_dir / f"{name}.restart{attempt}.log", again, node_address)
        self._wait_healthy(url)
        return url

    def _environment(self) -> dict[str, str]:
        """A local role process's environment: this one's, with the topology's secret."""
        env = dict(os.environ)
        if self.topology.secret is not None:
            env.pop(security.ENV_SECRET_FILE, None)
            env[security.ENV_SECRET] = self.topology.secret
        return env

    def _wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + 6 * self.topology.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{url}/health did not answer 200")

    def spans(self, request_id: str | None = None, extra: Iterable[Span] = (), since_ns: int = 0) -> pd.DataFrame:
        """Every server's spans (optionally of one request, and `extra` ones such as an in-process
        receiver's) as one frame on this host's clock (`epd_lab.trace.collect`)."""
        return collect(self.urls(), request_id, since_ns, extra, timeout=self.topology.timeout,
                       secret=self.topology.secret)

    def receiver(self, recorder: Recorder | None = None, **overrides) -> EmbeddingReceiver:
        """A receiver (the prefill side) wired to this cluster's encoders."""
        t = self.topology
        if recorder is None and not t.trace:
            recorder = Recorder("prefill", enabled=False)
        config = ReceiverConfig(self.encoder_urls, t.backend, overrides.pop("timeout", t.timeout),
                                overrides.pop("pool_bytes", t.pool_bytes), transport=t.transport,
                                **{"device": t.device, **overrides})
        return EmbeddingReceiver(config, recorder)

    def alive(self) -> list[bool]:
        """Per process, in `procs` order: whether it still runs (on Ray: as its actor reports; a dead or
        unreachable actor counts as a dead process)."""
        return [p.poll() is None for p in self.procs]

    def close(self) -> None:
        """SIGTERM every process (its whole session), SIGKILL what is left after 5 s; on Ray also fetch each
        log into `log_dir`, kill the actors and remove the placement group. Idempotent."""
        if self._ray is not None:
            ray_roles, self._ray = self._ray, None
            ray_roles.close(self.procs, self.proc_logs)
            self.procs = []
        if self.procs:  # else closed already (at exit, `__del__` comes after the modules it would need are gone)
            procs.stop_all(self.procs)
            self.procs = []
        master, self.store_master = getattr(self, "store_master", None), None
        if master is not None:  # after the encoders: none is left talking to it
            master.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


def _side_channel_base(urls: list[str], dp_rank: int) -> int:
    """The `--side-channel-base` that gives a prefill of DP rank `dp_rank` its side channels `urls` again (seed
    003's formula, base + dp_rank * tp + rank); `RestartRefused` when they do not follow it (random ports of a TP
    group: no start can take them all again)."""
    ports = [int(urllib.parse.urlsplit(u).port or 0) for u in urls]
    base = ports[0] - dp_rank * len(ports)
    if base < 1 or ports != [base + dp_rank * len(ports) + r for r in range(len(ports))]:
        raise RestartRefused(f"its KV side channels {urls} do not follow base + dp_rank * tp + rank: give the prefills "
                           f"--side-channel-base (settings) so that a restart can take them again")
    return base
