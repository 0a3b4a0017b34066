"""The package's layers: each top-level module or subpackage of epd_lab sits in one layer of `LAYERS`, imports
only from its own layer or the ones below, and no two of them import each other round a circle; nor do any two
modules at import time (a circle there fails or half-initialises a module, depending on which is imported first).

Imports are read from the source: module level and inside functions alike (a lazy import is still a
dependency), `if TYPE_CHECKING:` blocks left out (they never run).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import find_circle

PKG = Path(__file__).resolve().parents[1] / "epd_lab"

# lowest first; a unit may import from its own layer and every layer before it
LAYERS: list[set[str]] = [
    {"_native", "_verbs", "security", "failpoints", "procs", "wire_types", "noise", "boundary"},  # bindings, leaf helpers
    {"transfer", "trace"},  # the transfer engine (and what RDMA hardware the host has), spans
    {"kv", "machine"},  # P→D blocks and their wire; the host record
    {"models"},  # the model, its runtimes over the paged cache
    {"serving", "http"},  # what every server shares: HTTP (its clients), admission, settings
    {"ep"},  # E→P below the servers: messages, media, cache, receiver
    {"servers"},  # encoder, prefill, decode, proxy, monolithic
    {"launch", "launch_ray"},  # clusters of server processes, local or on Ray
    {"supervisor"},  # epd-lab launch: a cluster kept serving, its dead roles started again
    {"bench", "workload"},  # measurements
    {"whatif"},  # the calibrated model of serving: predicts bench serve's results
    {"viz", "sweep"},  # figures of bench results; notebook sweeps
    {"campaign"},  # reliability legs (and bench overload), their reports through viz
    {"demo", "panel", "cli"},  # front ends
]
LAYER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _units() -> set[str]:
    """epd_lab's top-level modules and subpackages; the compiled modules by their stubs."""
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"} | {p.stem for p in PKG.glob("*.pyi")}
    return modules | {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of the module except those under ``if TYPE_CHECKING:``."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "epd_lab" and len(parts) > 1 else None


def _graph() -> dict[str, dict[str, str]]:
    """unit → {imported unit: one place that imports it}."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts == ("__init__.py",):
            continue
        unit = rel.parts[0].removesuffix(".py")
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level:
                continue  # relative: inside the unit
            elif node.module == "epd_lab":
                names = [f"epd_lab.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            for name in names:
                target = _unit_of(name)
                if target and target != unit:
                    graph.setdefault(unit, {}).setdefault(target, f"epd_lab/{rel}:{node.lineno}")
    return graph


def test_every_unit_has_a_layer():
    units = _units()
    assert units - set(LAYER) == set(), "place the new units in LAYERS"
    assert set(LAYER) - units == set(), "LAYERS names units that do not exist"


def test_no_unit_imports_from_a_higher_layer():
    graph = _graph()
    upward = [f"{where}: {unit} (layer {LAYER[unit]}) imports {target} (layer {LAYER[target]})"
              for unit, targets in graph.items() for target, where in targets.items()
              if unit in LAYER and target in LAYER and LAYER[target] > LAYER[unit]]
    assert not upward, "\n".join(upward)


def test_no_import_circle_between_units():
    graph = {unit: set(targets) for unit, targets in _graph().items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle or [])


@pytest.mark.parametrize("edge", [("transfer", "servers"), ("viz", "campaign")])
def test_the_checks_would_see_a_violation(edge):
    unit, target = edge
    graph = {u: set(t) for u, t in _graph().items()}
    assert LAYER[target] > LAYER[unit]  # upward
    graph.setdefault(unit, set()).add(target)
    assert find_circle(graph) is not None  # and, as the target already depends on the unit, a circle


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: at module level, in its ``if`` and ``try``
    blocks, not in functions or classes, nor under ``if TYPE_CHECKING:``."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If):
            todo.extend(node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _module_graph() -> dict[str, set[str]]:
    """epd_lab's modules → the modules they import at import time (``from pkg import name`` counts as the
    submodule ``pkg.name`` where there is one, else as ``pkg``, its ``__init__``)."""
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_time(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                while target and target not in paths:  # an attribute of a module: that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.setdefault(name, set()).add(target)
    return graph


def test_no_import_circle_between_modules():
    circle = find_circle(_module_graph())
    assert circle is None, " -> ".join(circle or [])


def test_the_module_check_would_see_a_circle():
    graph = _module_graph()
    assert "epd_lab.serving.app" in graph["epd_lab.serving"]  # the package's __init__ imports its app
    graph.setdefault("epd_lab.serving.app", set()).add("epd_lab.serving")  # as `from epd_lab.serving import x`
    assert find_circle(graph) is not None
