"""The topology on a Ray cluster: `RaySettings`, the options that place a `Topology`'s processes on Ray nodes
(checked here, before anything starts, and without importing Ray), and in `actors` the actors that own those
processes (`RayRoles`, `RoleActor`, `RayProcess`), which import Ray; `epd_lab.launch` imports them only for
``placement="ray"``. ``from epd_lab.launch_ray import RayRoles`` works too: the names of `actors` are loaded on
first use.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from epd_lab.serving.settings import option

__all__ = ["RAY_OPTIONS", "STRATEGIES", "RaySettings", "check_ray_options"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement group strategies
RAY_OPTIONS = ("num_cpus", "num_gpus", "resources", "label_selector", "memory")
_RAY_KEY = re.compile(r"(encoder|prefill|decode)\d*|proxy")
_ACTORS = ("LOST", "HIDDEN_FROM_ROLES", "RayProcess", "RayRoles", "RoleActor", "actor_options")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def check_ray_options(key: str, values: Mapping[str, Any]) -> None:
    """`ValueError` naming what is wrong with ``ray_options[key]``, before Ray sees it: `key` a role or process
    name, only `RAY_OPTIONS`, each of the type Ray takes."""
    where = f"ray_options[{key!r}]"
    if not _RAY_KEY.fullmatch(key):
        raise ValueError(f"{where}: name a role (encoder, prefill, decode, proxy) or a process (encoder0, "
                         f"prefill1, ...)")
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of options, got {values!r}")
    unknown = set(values) - set(RAY_OPTIONS)
    if unknown:
        raise ValueError(f"{where}: unknown {', '.join(sorted(unknown))}; known: {', '.join(RAY_OPTIONS)}")
    for name in ("num_cpus", "num_gpus"):
        if name in values and not _number(values[name]):
            raise ValueError(f"{where}[{name!r}] must be a number >= 0, got {values[name]!r}")
    if "memory" in values and not (_number(values["memory"]) and float(values["memory"]).is_integer()):
        raise ValueError(f"{where}['memory'] must be a whole number of bytes >= 0, got {values['memory']!r}")
    resources = values.get("resources", {})
    if not (isinstance(resources, Mapping) and all(isinstance(k, str) and _number(v) for k, v in resources.items())):
        raise ValueError(f"{where}['resources'] must map resource names to numbers >= 0, got {resources!r}")
    labels = values.get("label_selector", {})
    if not (isinstance(labels, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
        raise ValueError(f"{where}['label_selector'] must map label names to strings, got {labels!r}")


@dataclass(slots=True, kw_only=True)  # keyword-only: a Topology's positional options stay its own
class RaySettings:
    """Where on a Ray cluster a topology's processes go: the cluster, one placement group or none, the address
    each role binds, and each role's or process's actor options. `epd_lab.launch.Topology` is one (its ``--ray``
    options); unused with ``placement="local"``."""

    ray_address: str | None = option(None, "the Ray cluster to join (implies placement=ray; unset: ray.init()'s "
                                           "own choice: RAY_ADDRESS, a running cluster, else a new local one)",
                                     flag="--ray")
    ray_strategy: str | None = option(None, "one placement group over all processes, a bundle each (their Ray "
                                            "resources), with this strategy", choices=STRATEGIES)
    ray_bind: str = option("loopback", "the address each process binds on its Ray node: loopback (127.0.0.1: nodes "
                                       "emulated on one machine) or node (the node's IP: real hosts)",
                           choices=("loopback", "node"))
    # Ray actor options by process name ("prefill1") or role ("prefill"), the name winning: num_cpus (default
    # the process's TP ranks), num_gpus (default 0), resources (custom ones, e.g. {"host_b": 1} pins to a node
    # started with it), label_selector (node labels), memory (bytes)
    ray_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata={"help": (
        "Ray actor options of a role or process, as KEY=JSON, repeated: e.g. --ray-options "
        "'prefill={\"num_gpus\": 1, \"resources\": {\"epd_p\": 1}}' --ray-options 'proxy={\"num_cpus\": 0}' "
        f"(options: {', '.join(RAY_OPTIONS)}; a process name such as prefill1 wins over its role)")})

    def __post_init__(self) -> None:
        if self.ray_strategy is not None and self.ray_strategy not in STRATEGIES:
            raise ValueError(f"ray_strategy must be one of {', '.join(STRATEGIES)}, got {self.ray_strategy!r}")
        if self.ray_bind not in ("loopback", "node"):
            raise ValueError(f"ray_bind must be loopback or node, got {self.ray_bind!r}")
        for key, values in self.ray_options.items():
            check_ray_options(key, values)


def __getattr__(name: str) -> Any:
    if name in _ACTORS:  # Ray is imported here, on first use
        from epd_lab.launch_ray import actors

        return getattr(actors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
