"""Transfer engines by name, each imported only when it is opened (as vLLM's `KVConnectorFactory`).

Every role takes ``--transport NAME`` and opens it with `open_engine`. A name maps to a module path
and an attribute there, not to an imported class, so listing the choices (`ENGINES`) imports no
engine, opening ``tcp`` never imports Mooncake, and no engine has to import another to be chosen.
Before, `engine.open_engine` imported `mooncake`, which imported `Registration` from `engine`: an
import cycle. The engines do not import this module at module level, so it stays one way.

    register_transport("mine", "my_pkg.engines", "MyEngine")
    engine = open_engine("mine", "127.0.0.1", timeout=5.0)  # imports my_pkg.engines now
"""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class _Target(NamedTuple):
    module_path: str
    attr: str


_TRANSPORTS: dict[str, _Target] = {}


def register_transport(name: str, module_path: str, attr: str) -> None:
    """Let `open_engine(name, ...)` open an engine with ``attr(hostname, name, timeout=timeout)``.

    Args:
        name: the transport's name, as ``--transport`` takes it.
        module_path: the module that defines `attr`; imported when `name` is first opened, not here.
        attr: a class or factory in that module. It gets the transport's name as its protocol, so one
            class can serve several names (`TransferEngine` serves ``auto``, ``tcp``, ``shm``, ``verbs``).

    Raises:
        ValueError: `name` is registered already to another target. Registering the same target again
            is a no-op, so a re-run notebook cell does not fail.
    """
    target = _Target(module_path, attr)
    known = _TRANSPORTS.get(name)
    if known is not None and known != target:
        raise ValueError(f"transport {name!r} is already registered as "
                         f"{known.module_path}.{known.attr}")
    _TRANSPORTS[name] = target


def transports() -> tuple[str, ...]:
    """The registered names, in registration order, including ones registered after import."""
    return tuple(_TRANSPORTS)


def open_engine(protocol: str = "auto", hostname: str = "127.0.0.1", timeout: float = 5.0) -> Any:
    """Open the engine registered as `protocol`, importing its module now if need be.

    Built in: ours (`epd_lab.transfer.engine.TransferEngine`) for ``auto``/``tcp``/``shm``/``verbs``/``cuda``,
    and the real Mooncake engine (`epd_lab.transfer.mooncake.MooncakeTransferEngine`, same API) for
    ``mooncake``, whose timeout is whole seconds and at least 5 (`timeout` is rounded up to that).

    Raises:
        ValueError: `protocol` is not registered; the message lists the registered names.
    """
    target = _TRANSPORTS.get(protocol)
    if target is None:
        raise ValueError(f"unknown transport {protocol!r}; choose one of {', '.join(_TRANSPORTS)}")
    factory = getattr(importlib.import_module(target.module_path), target.attr)
    return factory(hostname, protocol, timeout=timeout)


# engine.PROTOCOLS, spelled out: naming the built-ins must not import the engines (a test checks they match)
for _name in ("auto", "tcp", "shm", "verbs", "cuda"):
    register_transport(_name, "epd_lab.transfer.engine", "TransferEngine")
register_transport("mooncake", "epd_lab.transfer.mooncake", "open_mooncake")
del _name

# The built-in names, for argparse choices and dropdowns built at import time; `transports()` is live.
ENGINES: tuple[str, ...] = transports()
