"""A newcomer's first hour, through the real commands: `make lab`'s command line serves JupyterLab as root;
``--help`` of a command group lists its commands; no option is abbreviated; a user's mistake (a bad flag, an
unknown model, a busy port) is one line naming the value and the way out, ``--debug`` the traceback; the sweep
prints no warning about its kernels' channels; Jupyter's checkpoints are ignored by git.

Every command runs as a subprocess with a marker in its environment, which the roles it starts inherit: none
may be left running afterwards.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import nbformat
import pytest

from helpers import free_port, wait_for
from test_browser import _api, _stop

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "scripts" / "lab.sh"
EPD_LAB = Path(sys.executable).with_name("epd-lab")  # the console script, as a user runs it
MARKER = "EPD_TEST_FIRST_HOUR"
BENCHES = ("transfer", "epd", "e2e", "trace", "vit", "http", "runtime", "overload", "serve", "ab")
COMMANDS = ("bench", "encoder", "launch", "prefill-server", "decode-server", "proxy", "monolithic", "front", "sweep",
            "demo", "campaign", "rdma-info")
NOBODY = 65534


def _marked() -> list[int]:
    """The processes whose environment carries this test's marker."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if f"{MARKER}=".encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def epd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``epd-lab ARGS`` to its end; fails if anything it started is still running afterwards."""
    cmd = [str(EPD_LAB)] if EPD_LAB.exists() else [sys.executable, "-m", "epd_lab.cli"]
    env = {**os.environ, MARKER: uuid.uuid4().hex}
    env.pop("EPD_DEBUG", None)
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    try:  # a role exits shortly after the command that started it (its parent-death signal, its own shutdown)
        wait_for(lambda: not _marked(), 20, lambda: f"processes left behind by {args}: {_marked()}")
    finally:
        for pid in _marked():  # not left to the next test
            os.kill(pid, signal.SIGKILL)
    return done


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The single line a user's mistake gives, after checking it is one line, status 2 and no traceback."""
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("epd-lab"), lines[0]
    return lines[0]


# 1. make lab, as root and as a user

def test_make_lab_runs_the_lab_script() -> None:
    """`make lab` runs scripts/lab.sh, the command line the next test starts."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1].split()[-1] == "scripts/lab.sh", out


def _can_run_as_nobody() -> str | None:
    """Why this machine cannot run the venv's Python as uid 65534, or None."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv to switch to uid 65534"
    jupyter = ROOT / ".venv" / "bin" / "jupyter"  # what lab.sh runs, started from a shell as lab.sh does
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c",
                            f'exec "{jupyter}" --version'], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"uid 65534 cannot run {jupyter}: {probe.stderr[-300:]}"


@pytest.mark.parametrize("who", ["invoker", "nobody"])
def test_the_lab_command_serves_jupyterlab(who: str) -> None:
    """scripts/lab.sh, as whoever runs the tests (root here, where JupyterLab used to refuse to start) and as an
    unprivileged user, on a port from the OS: JupyterLab answers HTTP on 127.0.0.1, then is stopped with every
    process it started."""
    prefix: list[str] = []
    if who == "nobody":
        if why := _can_run_as_nobody():
            pytest.skip(why)
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    home = Path(tempfile.mkdtemp(prefix="epd-lab-lab-"))  # not under tmp_path: uid 65534 must reach it
    home.chmod(0o777)
    dirs = {var: home / var.lower() for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                                                "IPYTHONDIR")}
    env = {**os.environ, "HOME": str(home), **{k: str(v) for k, v in dirs.items()}}
    log = home / "lab.log"
    base, token = None, ""
    try:
        with open(log, "wb") as out:
            server = subprocess.Popen([*prefix, str(LAB), f"--port={free_port()}"], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        try:
            def serving() -> tuple[str, str] | None:
                assert server.poll() is None, f"lab.sh exited with {server.returncode}:\n{log.read_text()[-3000:]}"
                try:  # the server's runtime file says where it listens (the port may have moved) and its token
                    info = json.loads((dirs["JUPYTER_RUNTIME_DIR"] / f"jpserver-{server.pid}.json").read_text())
                    _api(info["url"], info["token"], "api/status")
                except (ValueError, KeyError, OSError):
                    return None
                return info["url"], info["token"]

            base, token = wait_for(serving, 120, lambda: f"JupyterLab answering:\n{log.read_text()[-3000:]}",
                                   interval=0.2)
            assert base.startswith("http://127.0.0.1:"), base
        finally:
            _stop(server, base, token)
        assert server.returncode is not None
    finally:
        shutil.rmtree(home, ignore_errors=True)


# 2. --help of a command group

def test_help_of_every_command_group_exits_0_and_lists_its_commands() -> None:
    top = epd("--help")
    assert top.returncode == 0 and all(cmd in top.stdout for cmd in COMMANDS), top.stdout + top.stderr
    bench = epd("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    listed = re.findall(r"^    (\w+)\s", bench.stdout, re.MULTILINE)
    assert listed == list(BENCHES), bench.stdout
    one = epd("bench", "transfer", "--help")  # a bench's own options, past the group
    assert one.returncode == 0 and "--paths" in one.stdout, one.stderr
    sweep = epd("sweep", "--help")
    assert sweep.returncode == 0 and "sweep rates" in sweep.stdout, sweep.stderr
    assert "required: BENCH" in one_error_line(epd("bench"))


# 3. no abbreviations

def test_an_abbreviated_option_is_refused_not_expanded() -> None:
    """``--encoder 2`` once started two encoders (read as --encoders) and served until Ctrl-C."""
    line = one_error_line(epd("launch", "--encoder", "2", timeout=120))
    assert "unrecognized arguments: --encoder 2" in line and "epd-lab launch --help" in line, line
    line = one_error_line(epd("bench", "transfer", "--path", "memcpy"))  # --paths
    assert "--path memcpy" in line, line


def _parser_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("ArgumentParser", "add_parser")]


def test_every_parser_in_the_package_refuses_abbreviations() -> None:
    calls = 0
    for path in sorted((ROOT / "epd_lab").rglob("*.py")):
        for call in _parser_calls(ast.parse(path.read_text(), str(path))):
            calls += 1
            flags = {kw.arg: kw.value for kw in call.keywords}
            assert "allow_abbrev" in flags and isinstance(flags["allow_abbrev"], ast.Constant) \
                and flags["allow_abbrev"].value is False, f"{path.relative_to(ROOT)}:{call.lineno}"
    assert calls > 20  # the walk found the parsers


# 4. a user's mistake: one line; --debug: the traceback

def test_an_unknown_model_is_one_line_and_debug_shows_the_traceback() -> None:
    line = one_error_line(epd("encoder", "--model", "no-such-model"))
    assert "--model 'no-such-model'" in line and "qwen2-vl-2b" in line and "directory" in line, line
    debug = epd("--debug", "encoder", "--model", "no-such-model")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ValueError" in debug.stderr, debug.stderr


def test_a_role_that_launch_started_names_itself_and_its_one_line() -> None:
    line = one_error_line(epd("launch", "--model", "no-such-model"))
    assert re.search(r"encoder0 exited with \d+ while starting: --model 'no-such-model': not a model shape", line), \
        line


@pytest.mark.parametrize("form", ["--port N", "--port=N"])
def test_a_busy_port_names_the_port_and_the_way_out(form: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flag = ["--port", str(port)] if form == "--port N" else [f"--port={port}"]
        line = one_error_line(epd("proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                                  *flag))
    assert f"--port {port}: port {port} is already in use" in line and "--port 0" in line, line


# 5. git ignores Jupyter's checkpoints and dirs

@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and the clone")
@pytest.mark.parametrize("path", ["notebooks/.ipynb_checkpoints/01-checkpoint.ipynb",
                                  "docs/.ipynb_checkpoints/x-checkpoint.ipynb", ".jupyter/runtime/jpserver-1.json"])
def test_jupyter_files_are_ignored(path: str) -> None:
    done = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
    assert done.returncode == 0, f"git does not ignore {path}"


# 6. the sweep's kernels

def test_the_sweep_prints_no_warning_about_its_kernels_channels(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    params = nbformat.v4.new_code_cell("x = 0\nout_dir = '.'")
    params.metadata["tags"] = ["parameters"]
    write = nbformat.v4.new_code_cell("from pathlib import Path\nPath(out_dir, 'x.txt').write_text(str(x))")
    nb.cells = [params, write]
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    done = epd("sweep", str(tmp_path / "tiny.ipynb"), "--grid", "x=1,2", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / "out" / f"x={x}" / "x.txt").read_text() for x in (1, 2)] == ["1", "2"]  # kernels ran
    assert "without encryption" not in done.stderr and "WARNING" not in done.stderr, done.stderr[-3000:]


# 8. what the Makefile cites exists

def test_the_makefile_cites_only_files_in_the_repository() -> None:
    cited = re.findall(r"([\w./-]+\.md)\b", (ROOT / "Makefile").read_text())
    assert [c for c in cited if not (ROOT / c).exists()] == []
