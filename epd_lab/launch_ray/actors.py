"""Roles on a Ray cluster: each process of a `Topology` owned by a Ray actor on the node Ray places it on
(where: its `epd_lab.launch_ray.RaySettings`).

The actor (`RoleActor`) starts the same command line the local launcher starts (`Cluster.command`), with its
node's own Python; reads the URL the role announces and hands it back (addresses come from the actors, never
guessed); keeps the role's log on its node until `Cluster.close` fetches it; and kills the role's session when
it stops. Should the actor die (``ray.kill``, its node lost), the role dies with it (``PR_SET_PDEATHSIG``), its
callers find it down (`epd_lab.serving.Liveness`) and its replicas serve.

The actor is a small Python process beside the role, not the role itself: a role is a plain process with a CLI
(its uvicorn loop, its threads, its signals), started alike by both launchers, and Ray stays off the request
path.

The shared secret travels as a Ray object passed by reference (`ray.put`): it is in no actor's arguments,
command line, ``runtime_env`` or job metadata, which Ray's dashboard and state API show. The actor hands it to
the role as ``EPD_SECRET`` in the role's own environment, readable (``/proc/PID/environ``) by its user only, as
a 0600 file would be; unlike a file, nothing stays on the node's disk when the actor is SIGKILLed (node loss,
``ray.kill``), which runs no cleanup. The role's log stays in the actor's 0700 folder: `close` fetches it and
removes the folder; a killed actor's folder is left for the post-mortem.

Each role also gets ``EPD_HOST_ID`` = its Ray node id, so that two roles on different nodes use tcp even
where one machine runs both nodes (`epd_lab.transfer.engine`).

This module imports Ray; `epd_lab.launch` imports it only for ``placement="ray"``.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from epd_lab import procs, security
from epd_lab.transfer.engine import ENV_HOST_ID

if TYPE_CHECKING:
    from epd_lab.launch import Topology

__all__ = ["LOST", "RayProcess", "RayRoles", "RoleActor", "actor_options"]

LOST = -signal.SIGKILL  # the returncode of a role whose actor is gone: PR_SET_PDEATHSIG killed it
CALL_TIMEOUT = 5.0  # seconds a status call to an actor may take before the role counts as lost
LOG_BYTES = 4 << 20  # the tail of a role's log that `close` fetches from its node
# what an actor's environment may hold that its role's must not: the secret's file form (the actor hands the
# secret itself), and Ray's authentication token where the cluster runs with RAY_AUTH_MODE=token
HIDDEN_FROM_ROLES = (security.ENV_SECRET, security.ENV_SECRET_FILE, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@ray.remote(max_restarts=0)
class RoleActor:
    """Owns one role process on its node: starts it, reports its URL, keeps its log, stops it."""

    def __init__(self) -> None:
        # mkdtemp makes it 0700: the log, readable by this user only
        self.dir = Path(tempfile.mkdtemp(prefix="epd-lab-role-"))
        self.proc: Any = None
        self.log = self.dir / "role.log"

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], secret: bytes | None,
              bind_node: bool, timeout: float) -> dict[str, Any]:
        """Start ``python argv...`` (this node's Python) and wait for its URL; returns url, pid (the role's),
        actor_pid (this actor's process), node_id and log (its path on this node)."""
        node_id = ray.get_runtime_context().get_node_id()
        # a role needs neither the shared secret's other forms nor Ray's token (it never calls Ray)
        child_env = {k: v for k, v in os.environ.items() if k not in HIDDEN_FROM_ROLES}
        child_env.update(env)
        child_env[ENV_HOST_ID] = node_id
        if secret is not None:
            child_env[security.ENV_SECRET] = secret.decode("ascii")
        # argparse keeps the last --host: the node's own address where the roles must be reached from other hosts
        host = ["--host", ray.util.get_node_ip_address()] if bind_node else []
        self.proc = procs.spawn([sys.executable, *argv, *host], self.log, child_env)
        url = procs.await_url(self.proc, name, self.log, timeout)
        return {"url": url, "pid": self.proc.pid, "actor_pid": os.getpid(), "node_id": node_id,
                "node_address": ray.util.get_node_ip_address(), "log": str(self.log)}

    def poll(self) -> int | None:
        """The role's returncode, None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self) -> bytes:
        """Stop the role (SIGTERM its session, SIGKILL after 5 s) and remove the folder; returns the tail of the
        log."""
        if self.proc is not None:
            procs.stop_all([self.proc])
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_BYTES))
                text = f.read()
        except OSError:
            text = b""
        shutil.rmtree(self.dir, ignore_errors=True)
        return text


class RayProcess:
    """A role process owned by a `RoleActor`, shaped as the `subprocess.Popen` the local launcher keeps
    (``pid``, `poll`, `kill`, `wait`), so that `Cluster.alive` and the fault campaign read both alike.
    ``pid`` is the role's on its node, ``actor_pid`` its actor's, ``node_id`` the Ray node they run on and
    ``node_address`` its address, ``node_log`` the role's log there (what is left of a killed actor's role)."""

    def __init__(self, name: str, actor: Any, started: Any) -> None:
        self.name, self.actor, self._started = name, actor, started
        self.pid = self.actor_pid = 0
        self.node_id = self.node_address = self.node_log = ""
        self.returncode: int | None = None

    def await_url(self, timeout: float) -> str:
        """The URL the role announced (its actor started it); raises what the start raised."""
        try:
            info = ray.get(self._started, timeout=timeout + CALL_TIMEOUT)
        except GetTimeoutError:
            raise TimeoutError(f"{self.name}: its Ray actor was not placed and started within {timeout} s (are "
                               f"the resources it asks for in the cluster? ray status)") from None
        self.pid, self.actor_pid, self.node_log = info["pid"], info["actor_pid"], info["log"]
        self.node_id, self.node_address = info["node_id"], info["node_address"]
        return info["url"]

    def poll(self) -> int | None:
        """The role's returncode, None while it runs; `LOST` when its actor is dead or does not answer within
        `CALL_TIMEOUT` s (a lost node)."""
        if self.returncode is None:
            try:
                self.returncode = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT)
            except (RayActorError, GetTimeoutError):
                self.returncode = LOST
        return self.returncode

    def kill(self) -> None:
        """Kill the actor; the role dies with it (``PR_SET_PDEATHSIG``), as a node loss would kill both. An actor
        that is gone already (its node lost) is left as it is."""
        try:
            ray.kill(self.actor, no_restart=True)
        except RayError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the role is gone; returns its returncode."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still runs after {timeout} s")
            time.sleep(0.05)
        return self.returncode


def actor_options(topology: Topology, name: str) -> dict[str, Any]:
    """The Ray actor options of process `name`: defaults, then ``ray_options`` of its role, then of its name. The
    default ``num_cpus`` is the process's TP ranks: they are its children, so a TP group always lies on its
    actor's node (never across nodes, as a STRICT_PACK bundle would keep it) and Ray counts a CPU for each."""
    role = name.rstrip("0123456789")
    ranks = getattr(topology.role_settings(role, name), "tp", 1) if role in ("encoder", "prefill", "decode") else 1
    return {"num_cpus": ranks, "num_gpus": 0, **topology.ray_options.get(role, {}),
            **topology.ray_options.get(name, {})}


class RayRoles:
    """The Ray side of one `Cluster`: the connection, the placement group, an actor per process."""

    def __init__(self, topology: Topology, names: Sequence[str]) -> None:
        self.topology = topology
        self.names = list(names)
        # a notebook that called ray.init() keeps its connection; one made here is closed by `close`
        self.owns_connection = not ray.is_initialized()
        if self.owns_connection:
            ray.init(address=topology.ray_address, logging_level="WARNING", log_to_driver=False)
        secret = topology.secret.encode() if topology.secret is not None else security.load_secret()
        self.secret = None if secret is None else ray.put(secret)
        self.group = None
        try:
            if topology.ray_strategy is not None:
                self._place_group()
        except BaseException:
            self.close([], [])
            raise

    def _place_group(self) -> None:
        bundles = [self._bundle(name) for name in self.names]
        self.group = placement_group(bundles, strategy=self.topology.ray_strategy)
        timeout = 6 * self.topology.timeout
        try:
            ray.get(self.group.ready(), timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"the placement group ({self.topology.ray_strategy}, bundles {bundles}) was not "
                               f"placed within {timeout} s: not enough resources (ray status)") from None

    def options(self, name: str) -> dict[str, Any]:
        """The actor options of process `name` (`actor_options`)."""
        return actor_options(self.topology, name)

    def _bundle(self, name: str) -> dict[str, float]:
        o = self.options(name)
        bundle = {k: v for k, v in {"CPU": o["num_cpus"], "GPU": o["num_gpus"], **o.get("resources", {})}.items() if v}
        if not bundle:
            raise ValueError(f"{name} asks for no resource, and a placement group bundle needs one: give it "
                             f"num_cpus > 0 or a custom resource in ray_options")
        return bundle

    def node_alive(self, address: str) -> bool:
        """Whether an alive Ray node has `address`."""
        return self._node_at(address) is not None

    def _node_at(self, address: str) -> str | None:
        return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address), None)

    def spawn(self, name: str, role: str, cmd: Sequence[str], env: Mapping[str, str], device: str,
              node_address: str | None = None) -> RayProcess:
        """Create the actor of process `name` and ask it to start `cmd` (its ``sys.executable`` is replaced
        by the node's own); the URL comes with `RayProcess.await_url`. `node_address`: on the alive node of
        that address only (a restart where roles bind their node's address), its other options still required."""
        opts = self.options(name)
        if device.startswith("cuda") and not opts["num_gpus"]:
            # Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone at num_gpus=0: the role would see every GPU of its node
            # and take one that Ray gave to another actor
            raise ValueError(f"{name} runs on {device} but reserves no GPU with Ray; give ray_options "
                             f"{{'{role}': {{'num_gpus': 1}}}} and device 'cuda' (the actor's GPU is its cuda:0)")
        if node_address is not None:
            node = self._node_at(node_address)
            if node is None:
                raise RuntimeError(f"{name}: no Ray node at {node_address} is alive")
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        elif self.group is not None:  # a lost node's bundle: Ray places it again where the strategy allows
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.names.index(name))
        actor = RoleActor.options(**opts).remote()
        started = actor.start.remote(name, list(cmd[1:]), dict(env), self.secret,
                                     self.topology.ray_bind == "node", 6 * self.topology.timeout)
        return RayProcess(name, actor, started)

    def close(self, processes: Sequence[RayProcess], logs: Sequence[Path]) -> None:
        """Stop every role through its actor (its log fetched into `logs`), kill the actors, remove the
        placement group, and disconnect from Ray if this connected."""
        stops = [(p, log, p.actor.stop.remote()) for p, log in zip(processes, logs)]
        for p, log, stop in stops:
            try:
                log.write_bytes(ray.get(stop, timeout=10 + CALL_TIMEOUT))
            except (RayError, GetTimeoutError):
                log.write_bytes(f"(the log of {p.name} was lost with its Ray actor; on its node: {p.node_log})\n"
                                .encode())
            ray.kill(p.actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        self.secret = None
        if self.owns_connection:
            ray.shutdown()
            self.owns_connection = False
