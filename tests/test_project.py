"""The project's own files: dependency lists agree, the native module has its stub, the CLI answers."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    want = set(project["project"]["dependencies"])
    for extra in ("test", "mooncake", "ray"):
        want |= set(project["project"]["optional-dependencies"][extra])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert set(pip) - {"-e ."} == want
    conda = {d for d in env["dependencies"] if isinstance(d, str)}
    build = {r for r in project["build-system"]["requires"] if r.startswith(("cython", "setuptools"))}
    assert build <= conda


def test_torch_is_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "torch==2.13.0" in project["project"]["dependencies"]


def test_native_stub_lists_the_binding():
    import epd_lab._native as native

    stub = (ROOT / "epd_lab" / "_native.pyi").read_text()
    public = [n for n, obj in vars(native).items()
              if not n.startswith("_") and getattr(obj, "__module__", None) == "epd_lab._native"]
    assert {"Owner", "TcpConn", "ShmPeer"} <= set(public)
    for name in public:
        assert f"class {name}" in stub or f"def {name}" in stub, name


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "epd_lab.cli", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("bench", "demo", "rdma-info"):
        assert cmd in out.stdout


def test_bench_transfer_writes_the_json_schema(tmp_path):
    """A tiny run of `epd-lab bench transfer` (not a speed test: it checks what is written)."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "transfer", "--paths", "memcpy,shm,tcp,socket",
                    "--sizes", "4096,65536", "--budget", "0.01", "--no-scatter", "--json", str(out)],
                   check=True, capture_output=True, timeout=120)
    import json

    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["path"], r["size"], r["blocks"]) for r in rows} == {
        (p, s, 1) for p in ("memcpy", "shm", "tcp", "socket") for s in (4096, 65536)}
    for r in rows:
        assert r["gbps"] > 0 and r["repeats"] >= 5
        assert (r["rtt_us"] is None) == (r["path"] == "memcpy" or r["size"] != 4096)
    assert data["machine"]["cores"] >= 1


def test_the_local_launcher_does_not_import_ray():
    """Ray is optional: `epd_lab.launch` (hence `make demo`) imports it only for placement="ray"."""
    code = "import sys, epd_lab.launch, epd_lab.cli, epd_lab.demo; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_proxy_does_not_import_torch():
    """The proxy and the replicas' front hold no model and stay torch-free: the proxy's messages' field types come
    from `epd_lab.wire_types`, shared with `ep.messages` (which imports torch)."""
    code = ("import sys, epd_lab.servers.proxy, epd_lab.servers.front; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
