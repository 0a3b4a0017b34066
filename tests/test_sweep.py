"""`epd-lab sweep` / `run_sweep`: notebooks/05_sweep.ipynb through papermill, once per grid point, with real
encoders; a failing point recorded and the rest run; finished points skipped on a re-run; bad grids refused
before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from epd_lab.sweep import _done, convert, expand, load_sweep, notebook_parameters, point_name, run_sweep
from epd_lab.trace import load_frame

NB05 = Path(__file__).resolve().parents[1] / "notebooks" / "05_sweep.ipynb"
GRID = {"backend": ["mooncake", "zmq_to_scheduler", "nonsense"]}
PARAMS = {"requests": "2"}
OK_POINTS = ["backend=mooncake", "backend=zmq_to_scheduler"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    return out, run_sweep(NB05, GRID, out, params=PARAMS, timeout=120)


def test_every_point_is_collected_with_its_parameters_and_results(sweep):
    out, table = sweep
    assert list(table["point"]) == [*OK_POINTS, "backend=nonsense"]
    ok = table.set_index("point").loc[OK_POINTS]
    assert list(ok["status"]) == ["ok", "ok"]
    assert list(ok["backend"]) == ["mooncake", "zmq_to_scheduler"]
    assert list(ok["requests"]) == [2, 2]  # the fixed parameter, as an int
    assert list(ok["encoders"]) == [1, 1]  # the notebook's default
    assert list(ok["completed"]) == [2, 2] and list(ok["failed"]) == [0, 0]
    assert list(ok["bit_exact"]) == [True, True] and list(ok["verified"]) == [1, 1]
    assert (ok["e2e_ms"] > 0).all() and (ok["vit_ms"] > 0).all() and (ok["prefill_ms"] > 0).all()
    pd.testing.assert_frame_equal(pd.read_parquet(out / "sweep.parquet"), table)
    assert len(pd.read_csv(out / "sweep.csv")) == 3


@pytest.mark.parametrize("point", OK_POINTS)
def test_each_point_writes_its_files(sweep, point):
    out, _ = sweep
    d = out / point
    results = json.loads((d / "results.json").read_text())
    assert results["parameters"]["backend"] == point.split("=")[1] and results["errors"] == []
    requests = pd.read_csv(d / "requests.csv")
    assert list(requests["request"]) == ["req00000", "req00001"] and requests["ok"].all()
    spans = load_frame(d / "spans.parquet")
    assert set(spans["request"]) == {"req00000", "req00001"}  # the warm-up is left out
    assert {"http_encode", "vit", "transfer", "prefill"} <= set(spans["stage"])
    assert any(n.startswith("encoder:") for n in spans["node"]) and "prefill" in set(spans["node"])
    trace = json.loads((d / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(spans)
    executed = nbformat.read(d / "05_sweep.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)


def test_a_failing_point_is_recorded_and_the_others_complete(sweep):
    out, table = sweep
    row = table.set_index("point").loc["backend=nonsense"]
    assert row["status"] == "failed"
    assert row["error"].startswith("ValueError: unknown backend 'nonsense'")
    assert json.loads((out / "backend=nonsense" / "point.json").read_text())["status"] == "failed"
    executed = nbformat.read(out / "backend=nonsense" / "05_sweep.ipynb", as_version=4)  # kept, with the error
    assert any(o.get("ename") == "ValueError" for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert not (out / "backend=nonsense" / "results.json").exists()


def test_a_rerun_skips_finished_points_and_retries_failed_ones(sweep):
    out, first = sweep
    stamps = {p: (out / p / "05_sweep.ipynb").stat().st_mtime_ns for p in OK_POINTS}
    again = run_sweep(NB05, GRID, out, params=PARAMS, timeout=120)
    assert list(again["status"]) == ["skipped-done", "skipped-done", "failed"]
    assert {p: (out / p / "05_sweep.ipynb").stat().st_mtime_ns for p in OK_POINTS} == stamps
    assert list(again["e2e_ms"][:2]) == list(first["e2e_ms"][:2])  # collected from the same results.json
    point = {"backend": "mooncake", "requests": 2}
    assert _done(out / "backend=mooncake", point)
    assert not _done(out / "backend=mooncake", point | {"requests": 3})  # other fixed parameters: run it again
    loaded = load_sweep(out)
    assert loaded.swept == ["backend"]
    assert set(loaded.requests["request"]) == {f"{p}/req0000{i}" for p in OK_POINTS for i in (0, 1)}
    assert set(loaded.spans["point"]) == set(OK_POINTS)


@pytest.mark.parametrize("grid, params, message", [
    ({"backnd": ["mooncake"]}, {}, "unknown parameter 'backnd'"),
    ({}, {"requets": "2"}, "unknown parameter 'requets'"),
    ({"encoders": ["two"]}, {}, "encoders='two' is not a valid int"),
    ({"out_dir": ["x"]}, {}, "out_dir is set by the sweep"),
    ({"requests": ["2"]}, {"requests": "3"}, "in both the grid and the fixed parameters"),
])
def test_a_bad_grid_is_refused_before_anything_runs(tmp_path, grid, params, message):
    with pytest.raises(ValueError, match=message):
        run_sweep(NB05, grid, tmp_path / "out", params=params)
    assert not (tmp_path / "out").exists()


def test_points_are_the_cartesian_product_typed_as_the_notebook_declares():
    declared = notebook_parameters(NB05)
    points = expand({"backend": ["mooncake", "zmq_to_tokenizer"], "encoders": ["1", 2]}, {"seed": "7"}, declared)
    want = [{"backend": b, "encoders": e, "seed": 7} for b in ("mooncake", "zmq_to_tokenizer") for e in (1, 2)]
    assert points == want
    assert point_name(points[1], ["backend", "encoders"]) == "backend=mooncake,encoders=2"
    assert point_name(points[1], []) == "default"
    assert convert("false", "bool", "x") is False and convert("2.5", "float", "x") == 2.5
    with pytest.raises(ValueError):
        convert(2.5, "int", "x")


def test_cli_runs_a_one_point_sweep(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "epd_lab.cli", "sweep", str(NB05), "--grid", "encoders=2",
                           "--param", "images_per_request=2", "--param", "requests=2", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "encoders=2" in proc.stdout and "ok" in proc.stdout
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["point"]) == ["encoders=2"] and list(table["status"]) == ["ok"]
    assert list(table["parts"]) == [2] and list(table["bit_exact"]) == [True]  # 2 images over 2 encoders
