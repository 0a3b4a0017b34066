"""`epd-lab sweep`: run a papermill notebook once per point of a parameter grid and collect the results.

    epd-lab sweep notebooks/05_sweep.ipynb --grid backend=mooncake,zmq_to_tokenizer --grid encoders=1,2 \\
        --param requests=8 --out out/sweep

Each point (the cartesian product of the grid) runs the notebook with papermill into its own folder,
``DIR/<point>/`` (named by the grid values, e.g. ``backend=mooncake,encoders=2``), with the notebook's
``out_dir`` parameter set to that folder. Values are converted to the types of the notebook's
``parameters`` cell, and a key the notebook does not have is an error before anything runs (papermill
itself only warns). A point that fails is recorded with its error, its executed notebook kept, and
the sweep goes on; a point already done with the same parameters (``point.json`` says ok) is skipped
on a re-run. At the end
every point's ``results.json`` is collected into ``DIR/sweep.csv`` and ``DIR/sweep.parquet``.
"""
from __future__ import annotations

import ast
import contextlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from epd_lab.trace import load_frame

MARKER = "point.json"  # written by the sweep when a point ends: status, parameters, error
META = "sweep.json"  # the sweep's notebook, grid and fixed parameters
JUPYTER_DIRS = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
                "IPYTHONDIR": "ipython"}


def notebook_parameters(notebook: str | Path) -> dict[str, dict]:
    """The notebook's ``parameters`` cell as papermill reads it: name → {inferred_type_name, default, help}."""
    import papermill

    params = papermill.inspect_notebook(str(notebook))
    if not params:
        raise ValueError(f"{notebook} has no cell tagged 'parameters'")
    return params


def convert(value: Any, type_name: str | None, key: str) -> Any:
    """`value` (a string from the command line, or already typed) as the parameter's declared type."""
    try:
        if type_name == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("not an integer")
            return int(value)
        if type_name == "float":
            return float(value)
        if type_name == "bool":
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("not true/false")
                return value.lower() in ("true", "1")
            return bool(value)
        if type_name == "str":
            return str(value)
        return ast.literal_eval(value) if isinstance(value, str) else value  # untyped: a Python literal
    except (TypeError, ValueError, SyntaxError) as exc:
        raise ValueError(f"parameter {key}={value!r} is not a valid {type_name or 'literal'}: {exc}") from None


def expand(grid: dict[str, list], params: dict[str, Any], declared: dict[str, dict]) -> list[dict[str, Any]]:
    """The grid's points (cartesian product, in the order given), each with `params`, values typed.
    Raises `ValueError` for a key the notebook does not declare, before anything runs."""
    for key in [*grid, *params]:
        if key not in declared:
            raise ValueError(f"unknown parameter {key!r}; the notebook's parameters are: {', '.join(declared)}")
        if key == "out_dir":
            raise ValueError("out_dir is set by the sweep (one folder per point)")
    if "out_dir" not in declared:
        raise ValueError("the notebook has no out_dir parameter to write its results to")
    if dupes := set(grid) & set(params):
        raise ValueError(f"in both the grid and the fixed parameters: {', '.join(sorted(dupes))}")
    for key, values in grid.items():
        if not values:
            raise ValueError(f"grid key {key!r} has no values")
    typed = {k: [convert(v, declared[k]["inferred_type_name"], k) for v in vs] for k, vs in grid.items()}
    fixed = {k: convert(v, declared[k]["inferred_type_name"], k) for k, v in params.items()}
    return [{**dict(zip(typed, combo)), **fixed} for combo in itertools.product(*typed.values())]


def point_name(point: dict[str, Any], keys: list[str]) -> str:
    """A folder name from the grid's values, e.g. ``backend=mooncake,encoders=2`` (``default`` if none)."""
    name = ",".join(f"{k}={point[k]}" for k in keys) or "default"
    return name.replace(os.sep, "_").replace("\0", "_")


@contextlib.contextmanager
def hermetic_jupyter(root: Path) -> Iterator[None]:
    """Point Jupyter and IPython at folders under `root`, for the kernels started meanwhile; variables
    the caller already set are kept."""
    saved = {k: os.environ.get(k) for k in JUPYTER_DIRS}
    for var, sub in JUPYTER_DIRS.items():
        os.environ.setdefault(var, str(root / sub))
        Path(os.environ[var]).mkdir(parents=True, exist_ok=True)  # IPython falls back to a temp dir otherwise
    try:
        yield
    finally:
        for var, old in saved.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old


def run_point(notebook: Path, point_dir: Path, parameters: dict[str, Any], timeout: float) -> dict:
    """Execute `notebook` into `point_dir` with `parameters`; write and return the point's marker."""
    import papermill

    point_dir.mkdir(parents=True, exist_ok=True)
    for stale in (MARKER, "results.json"):  # an earlier run's, which a failure now must not leave looking valid
        (point_dir / stale).unlink(missing_ok=True)
    t0 = time.monotonic()
    status, error = "ok", None
    try:
        papermill.execute_notebook(str(notebook), str(point_dir / notebook.name),
                                   parameters={**parameters, "out_dir": str(point_dir)}, kernel_name="python3",
                                   progress_bar=False, cwd=str(notebook.parent), execution_timeout=timeout,
                                   config=_kernel_config())
    except Exception as exc:  # a failed point is recorded, and the sweep goes on
        status, error = "failed", _describe(exc)
    marker = {"status": status, "error": error, "parameters": parameters, "seconds": time.monotonic() - t0}
    (point_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return marker


def _kernel_config() -> Any:
    """nbclient's config for a point's kernel: CurveZMQ keys on its loopback channels where pyzmq has them.
    Without, ipykernel warns at every point that it runs "over TCP without encryption", which a sweep's user
    cannot act on; "auto" leaves a kernel that does not declare Curve support as it was."""
    import zmq
    from traitlets.config import Config

    return Config({"KernelManager": {"transport_encryption": "auto"}}) if zmq.has("curve") else Config()


def _describe(exc: Exception) -> str:
    """Exception type and message; for an error inside the notebook, the notebook's own exception."""
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _done(point_dir: Path, parameters: dict[str, Any]) -> bool:
    """Whether an earlier run finished this point with these very parameters (fixed ones included)."""
    try:
        marker = json.loads((point_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("status") == "ok" and marker.get("parameters") == json.loads(json.dumps(parameters))
            and (point_dir / "results.json").exists())


def collect(out: Path, rows: list[dict]) -> pd.DataFrame:
    """One row per point: name, status, error, seconds, its parameters, and the scalars of its
    ``results.json`` (lists such as ``errors`` become counts); written as ``sweep.csv``/``sweep.parquet``."""
    records = []
    for row in rows:
        record = {k: v for k, v in row.items() if k != "parameters"} | row["parameters"]
        path = out / row["point"] / "results.json"
        results = json.loads(path.read_text()) if row["status"] != "failed" and path.exists() else {}
        for key, value in results.items():
            if key == "parameters":
                continue
            record[f"n_{key}" if isinstance(value, list) else key] = len(value) if isinstance(value, list) else value
        records.append(record)
    table = pd.DataFrame(records)
    table.to_csv(out / "sweep.csv", index=False)
    table.to_parquet(out / "sweep.parquet", index=False)
    return pd.read_parquet(out / "sweep.parquet")  # exactly what a report reads back


def run_sweep(notebook: str | Path, grid: dict[str, list], out: str | Path, params: dict[str, Any] | None = None,
              timeout: float = 600.0) -> pd.DataFrame:
    """Run `notebook` at every point of `grid` (plus the fixed `params`) into ``out/<point>/``.

    `timeout` bounds each cell, in seconds. Returns the collected table (also in ``out/sweep.csv``);
    its ``status`` is ``ok``, ``failed`` (with ``error``) or ``skipped-done`` (finished by an earlier run).
    """
    from tqdm.auto import tqdm

    notebook, out = Path(notebook).resolve(), Path(out).resolve()
    declared = notebook_parameters(notebook)
    points = expand(grid, params or {}, declared)
    defaults = {k: _default(v) for k, v in declared.items() if k != "out_dir"}
    out.mkdir(parents=True, exist_ok=True)
    meta = {"notebook": str(notebook), "grid": {k: list(dict.fromkeys(p[k] for p in points)) for k in grid},
            "params": {k: points[0][k] for k in params or {}}, "parameters": list(defaults)}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    rows = []
    with hermetic_jupyter(out / ".jupyter"), tqdm(points, desc=f"sweep {notebook.stem}", unit="point") as bar:
        for point in bar:
            name = point_name(point, list(grid))
            bar.set_postfix_str(name)
            point_dir = out / name
            if _done(point_dir, point):
                marker = json.loads((point_dir / MARKER).read_text()) | {"status": "skipped-done"}
            else:
                marker = run_point(notebook, point_dir, point, timeout)
            rows.append({"point": name, "status": marker["status"], "error": marker["error"],
                         "seconds": marker["seconds"], "parameters": defaults | point})
    return collect(out, rows)


@dataclass
class SweepData:
    """A sweep read back (`load_sweep`)."""

    table: pd.DataFrame  # one row per point (sweep.parquet)
    requests: pd.DataFrame  # every point's requests.csv, one row per request
    spans: pd.DataFrame  # every point's spans.parquet, one row per span
    swept: list[str]  # the grid's keys with more than one value, in the order given


def load_sweep(out: str | Path) -> SweepData:
    """Read a sweep's table and every finished point's requests and spans. Their rows get the point's
    name and parameters as columns, and ``request`` becomes ``<point>/<request>`` (ids repeat across
    points)."""
    out = Path(out)
    meta = json.loads((out / META).read_text())
    table = pd.read_parquet(out / "sweep.parquet")
    requests, spans = [], []
    for row in table[table["status"] != "failed"].to_dict("records"):
        columns = {"point": row["point"]} | {k: row[k] for k in meta["parameters"]}
        for frames, frame in ((requests, pd.read_csv(out / row["point"] / "requests.csv")),
                              (spans, load_frame(out / row["point"] / "spans.parquet"))):
            frame = frame.assign(**columns)
            frame["request"] = row["point"] + "/" + frame["request"]
            frames.append(frame)
    return SweepData(table, pd.concat(requests, ignore_index=True) if requests else pd.DataFrame(),
                     pd.concat(spans, ignore_index=True) if spans else pd.DataFrame(),
                     [k for k, values in meta["grid"].items() if len(values) > 1])


def _default(param: dict) -> Any:
    """A parameter's default as a value (papermill gives its source text)."""
    try:
        return ast.literal_eval(param["default"])
    except (ValueError, SyntaxError):
        return param["default"]


def _pairs(texts: list[str], what: str) -> dict[str, str]:
    """``key=value`` arguments as a dict; a malformed or repeated key is an error."""
    out: dict[str, str] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} expects key=value, got {text!r}")
        if key.strip() in out:
            raise ValueError(f"{what} {key.strip()!r} given twice")
        out[key.strip()] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """``epd-lab sweep NOTEBOOK --grid key=v1,v2 ... --out DIR [--param key=value ...] [--timeout S]``."""
    import argparse

    if argv and argv[0] == "rates":  # `epd-lab sweep rates`: bench serve over request rates and topologies
        from epd_lab.bench.serve.rates import main as rates

        return rates(argv[1:])
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab sweep", description=__doc__.splitlines()[0],
                                 epilog="epd-lab sweep rates --help: bench serve over request rates and topologies")
    ap.add_argument("notebook", help="a notebook with a cell tagged 'parameters' and an out_dir parameter")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="values to sweep (repeatable)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a fixed parameter (repeatable)")
    ap.add_argument("--out", required=True, metavar="DIR", help="one folder per point, and sweep.csv")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each cell may run")
    args = ap.parse_args(argv)
    try:
        grid = {k: v.split(",") for k, v in _pairs(args.grid, "--grid").items()}
        params = _pairs(args.param, "--param")
        table = run_sweep(args.notebook, grid, args.out, params, args.timeout)
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    cols = [c for c in ("point", "status", "completed", "bit_exact", "e2e_ms", "error") if c in table]
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(table[cols].to_string(index=False))
    print(f"\n{len(table)} points -> {Path(args.out) / 'sweep.csv'}")
    return 0 if (table["status"] != "failed").all() else 1
